/* device.c — the compute device behind kvq_analysis_opts.device: a thin
 * layer over kernels/kvq_cuda.h when the build has CUDA, and a clear
 * "built without CUDA" otherwise, so nothing else in libkvq needs #if. */
#include "device.h"
#include "internal.h"
#include "kvq_config.h"

#include <stdio.h>

#if KVQ_HAVE_CUDA
struct kvq_device {
    kvq_cuda *cuda;
    char name[256];
};

int kvq_device_cuda_built(void) { return 1; }

kvq_status kvq_device_open_cuda(kvq_device **out, kvq_error *err)
{
    kvq_device *d = calloc(1, sizeof *d);
    *out = NULL;
    if (!d) return kvq_fail(err, KVQ_ERR_NOMEM, "out of memory");
    kvq_status st = kvq_cuda_open(&d->cuda, d->name, sizeof d->name, err);
    if (st) {
        free(d);
        return st;
    }
    *out = d;
    return KVQ_OK;
}

const char *kvq_device_name(const kvq_device *dev) { return dev->name; }
kvq_cuda *kvq_device_cuda(kvq_device *dev) { return dev->cuda; }

void kvq_device_close(kvq_device *dev)
{
    if (!dev) return;
    kvq_cuda_close(dev->cuda);
    free(dev);
}

kvq_status kvq_device_set_layer(kvq_device *dev, const kvq_layer *L, int nslots, kvq_error *err)
{
    return kvq_cuda_set_layer(dev->cuda, L->key, L->value, L->H, L->T, L->D, nslots, err);
}

kvq_status kvq_device_quantize_plan(kvq_device *dev, int slot, const kvq_plan *plan, kvq_recon_acc *recon,
                                    int *bad, kvq_error *err)
{
    return kvq_cuda_quantize_plan(dev->cuda, slot, plan, recon, bad, err);
}

kvq_status kvq_device_upload_slot(kvq_device *dev, int slot, const float *key, const float *value,
                                  kvq_error *err)
{
    return kvq_cuda_upload_slot(dev->cuda, slot, key, value, err);
}

kvq_status kvq_device_download_slot(kvq_device *dev, int slot, float *key, float *value, kvq_error *err)
{
    return kvq_cuda_download_slot(dev->cuda, slot, key, value, err);
}

kvq_status kvq_device_set_queries(kvq_device *dev, const float *q, int Hq, const int *pos, size_t npos,
                                  int query_prescaled, kvq_error *err)
{
    return kvq_cuda_set_queries(dev->cuda, q, Hq, pos, npos, query_prescaled, err);
}

kvq_status kvq_device_attention(kvq_device *dev, int h, int nslots, kvq_attn_acc *acc, kvq_error *err)
{
    return kvq_cuda_attention(dev->cuda, h, nslots, acc, err);
}

#else /* CPU-only build: no device can be opened */

struct kvq_device {
    int unused;
};

int kvq_device_cuda_built(void) { return 0; }

kvq_status kvq_device_open_cuda(kvq_device **out, kvq_error *err)
{
    *out = NULL;
    return kvq_fail(err, KVQ_ERR_UNSUPPORTED,
                    "--device cuda: this kvq was built without CUDA (rebuild with meson -Dcuda=enabled "
                    "where the CUDA Toolkit is installed); use --device cpu");
}

const char *kvq_device_name(const kvq_device *dev) { return (void)dev, "none"; }
void kvq_device_close(kvq_device *dev) { (void)dev; }

static kvq_status no_device(kvq_error *err)
{
    return kvq_fail(err, KVQ_ERR_UNSUPPORTED, "this kvq was built without CUDA");
}
kvq_status kvq_device_set_layer(kvq_device *dev, const kvq_layer *L, int nslots, kvq_error *err)
{
    return (void)dev, (void)L, (void)nslots, no_device(err);
}
kvq_status kvq_device_quantize_plan(kvq_device *dev, int slot, const kvq_plan *plan, kvq_recon_acc *recon,
                                    int *bad, kvq_error *err)
{
    return (void)dev, (void)slot, (void)plan, (void)recon, (void)bad, no_device(err);
}
kvq_status kvq_device_upload_slot(kvq_device *dev, int slot, const float *key, const float *value,
                                  kvq_error *err)
{
    return (void)dev, (void)slot, (void)key, (void)value, no_device(err);
}
kvq_status kvq_device_download_slot(kvq_device *dev, int slot, float *key, float *value, kvq_error *err)
{
    return (void)dev, (void)slot, (void)key, (void)value, no_device(err);
}
kvq_status kvq_device_set_queries(kvq_device *dev, const float *q, int Hq, const int *pos, size_t npos,
                                  int query_prescaled, kvq_error *err)
{
    return (void)dev, (void)q, (void)Hq, (void)pos, (void)npos, (void)query_prescaled, no_device(err);
}
kvq_status kvq_device_attention(kvq_device *dev, int h, int nslots, kvq_attn_acc *acc, kvq_error *err)
{
    return (void)dev, (void)h, (void)nslots, (void)acc, no_device(err);
}
#endif

/* device.c — the compute device behind kvq_analysis_opts.device: a thin
 * layer over kernels/kvq_cuda.h when the build has CUDA — the module
 * libkvq-cuda.so, opened with dlopen on the first --device cuda, so CPU
 * runs never load the CUDA runtime — and a clear "built without CUDA"
 * otherwise, so nothing else in libkvq needs #if. */
#include "device.h"
#include "../internal.h"
#include "kvq_config.h"

#include <stdio.h>

#if KVQ_HAVE_CUDA
#include <dlfcn.h>

struct kvq_device {
    void *module;              /* dlopen handle of libkvq-cuda.so */
    const kvq_cuda_api *api;
    kvq_cuda *cuda;
    char name[256];
};

int kvq_device_cuda_built(void) { return 1; }

/* Opens the CUDA module: $KVQ_CUDA_MODULE alone when set, else the build
 * tree's, else the installed one.  On failure err gives the loader's reason
 * for the first place that failed. */
static kvq_status load_module(kvq_device *d, kvq_error *err)
{
    const char *env = getenv("KVQ_CUDA_MODULE");
    const char *tries[3] = {env && *env ? env : NULL, KVQ_CUDA_MODULE_BUILD, KVQ_CUDA_MODULE_INSTALL};
    char why[512] = "";
    for (int i = 0; i < 3; i++) {
        if (!tries[i]) continue;
        void *h = dlopen(tries[i], RTLD_NOW | RTLD_LOCAL);
        if (!h) {
            const char *e = dlerror();
            if (!why[0]) snprintf(why, sizeof why, "%s", e ? e : tries[i]);
            if (i == 0) break; /* an explicit $KVQ_CUDA_MODULE is the only one tried */
            continue;
        }
        const kvq_cuda_api *(*entry)(void) = NULL;
        *(void **)&entry = dlsym(h, KVQ_CUDA_MODULE_SYMBOL);
        const kvq_cuda_api *api = entry ? entry() : NULL;
        if (!api || api->abi != KVQ_CUDA_ABI || api->size != sizeof *api) {
            dlclose(h);
            return kvq_fail(err, KVQ_ERR_UNSUPPORTED,
                            "--device cuda: %s is not a CUDA module of this kvq (rebuild it); use --device cpu",
                            tries[i]);
        }
        d->module = h, d->api = api;
        return KVQ_OK;
    }
    return kvq_fail(err, KVQ_ERR_UNSUPPORTED,
                    "--device cuda: cannot load the CUDA module (%s); set KVQ_CUDA_MODULE to libkvq-cuda.so, "
                    "or use --device cpu", why);
}

kvq_status kvq_device_open_cuda(kvq_device **out, kvq_error *err)
{
    kvq_device *d = calloc(1, sizeof *d);
    *out = NULL;
    if (!d) return kvq_fail(err, KVQ_ERR_NOMEM, "out of memory");
    kvq_status st = load_module(d, err);
    if (!st) st = d->api->open(&d->cuda, d->name, sizeof d->name, err);
    if (st) {
        kvq_device_close(d);
        return st;
    }
    *out = d;
    return KVQ_OK;
}

const char *kvq_device_name(const kvq_device *dev) { return dev->name; }
kvq_cuda *kvq_device_cuda(kvq_device *dev) { return dev->cuda; }
const kvq_cuda_api *kvq_device_cuda_api(kvq_device *dev) { return dev->api; }

void kvq_device_close(kvq_device *dev)
{
    if (!dev) return;
    if (dev->cuda) dev->api->close(dev->cuda);
    /* the module stays mapped: the CUDA runtime registers exit handlers in it */
    free(dev);
}

kvq_status kvq_device_set_layer(kvq_device *dev, const kvq_layer *L, int nslots, kvq_error *err)
{
    return dev->api->set_layer(dev->cuda, L->key, L->value, L->H, L->T, L->D, nslots, err);
}

kvq_status kvq_device_quantize_plan(kvq_device *dev, int slot, const kvq_plan *plan, kvq_recon_acc *recon,
                                    int *bad, kvq_error *err)
{
    return dev->api->quantize_plan(dev->cuda, slot, plan, recon, bad, err);
}

kvq_status kvq_device_upload_slot(kvq_device *dev, int slot, const float *key, const float *value,
                                  kvq_error *err)
{
    return dev->api->upload_slot(dev->cuda, slot, key, value, err);
}

kvq_status kvq_device_download_slot(kvq_device *dev, int slot, float *key, float *value, kvq_error *err)
{
    return dev->api->download_slot(dev->cuda, slot, key, value, err);
}

kvq_status kvq_device_set_queries(kvq_device *dev, const float *q, int Hq, const int *pos, size_t npos,
                                  int query_prescaled, kvq_error *err)
{
    return dev->api->set_queries(dev->cuda, q, Hq, pos, npos, query_prescaled, err);
}

kvq_status kvq_device_attention(kvq_device *dev, int h, int nslots, kvq_attn_acc *acc, kvq_error *err)
{
    return dev->api->attention(dev->cuda, h, nslots, acc, err);
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

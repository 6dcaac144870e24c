/* device.h — libkvq's internal view of the GPU (device.c): the analysis
 * driver calls these; with a CPU-only build they are never reached (no
 * kvq_device can be opened) and return KVQ_ERR_UNSUPPORTED. */
#ifndef KVQ_DEVICE_H
#define KVQ_DEVICE_H

#include "../quant/plan.h"

/* One layer's K, V [H][T][D] and room for nslots reconstructions. */
kvq_status kvq_device_set_layer(kvq_device *dev, const kvq_layer *L, int nslots, kvq_error *err);
/* Runs a plan into slot s; recon [2][H] gets the error sums, *bad the first
 * tensor*H + h whose scale is not finite (KVQ_ERR_NUMERIC, empty message). */
kvq_status kvq_device_quantize_plan(kvq_device *dev, int slot, const kvq_plan *plan, kvq_recon_acc *recon,
                                    int *bad, kvq_error *err);
/* Copies K', V' [H][T][D] computed on the CPU into slot s. */
kvq_status kvq_device_upload_slot(kvq_device *dev, int slot, const float *key, const float *value,
                                  kvq_error *err);
/* Copies slot s's K', V' [H][T][D] back (for tests). */
kvq_status kvq_device_download_slot(kvq_device *dev, int slot, float *key, float *value, kvq_error *err);
/* Query rows [Hq][npos][D] at ascending positions pos. */
kvq_status kvq_device_set_queries(kvq_device *dev, const float *q, int Hq, const int *pos, size_t npos,
                                  int query_prescaled, kvq_error *err);
/* Attention sums of KV head h for slots 0..nslots−1, added to acc[s]. */
kvq_status kvq_device_attention(kvq_device *dev, int h, int nslots, kvq_attn_acc *acc, kvq_error *err);

#include "kvq_config.h"
#if KVQ_HAVE_CUDA
#include "kvq_cuda.h"
/* The CUDA context of an open device and the module's functions
 * (benchmarks time its kernels). */
kvq_cuda *kvq_device_cuda(kvq_device *dev);
const kvq_cuda_api *kvq_device_cuda_api(kvq_device *dev);
#endif

#endif

/* kvq_cuda.h — host interface of the CUDA path (kernels/), built with the
 * meson `cuda` feature as a separate module, libkvq-cuda.so, which
 * lib/analysis/device.c opens with dlopen only when a device is asked for: CPU runs
 * never load the CUDA runtime.  The module exports one symbol,
 * kvq_cuda_module_api, the table of the functions below.
 *
 * The device holds one layer at a time: the exact K, V [H][T][D], `nslots`
 * reconstructions K', V' (one per quantizer, produced on the device from a
 * kvq_plan or uploaded from the CPU quantizers) and the selected query rows.
 * Every function checks every CUDA and cuBLAS call and returns a kvq_status
 * with a one-line message in err; nothing prints. */
#ifndef KVQ_CUDA_H
#define KVQ_CUDA_H

#include "quant/plan.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct kvq_cuda kvq_cuda;

/* Number of usable CUDA devices (0 if none, or no driver); on a CUDA
 * runtime failure returns -1 and writes the runtime's message into msg. */
int kvq_cuda_device_count(char *msg, int len);

/* Opens the first device: KVQ_ERR_UNSUPPORTED naming the reason when there
 * is none.  name: the device's name and compute capability. */
kvq_status kvq_cuda_open(kvq_cuda **out, char *name, size_t name_len, kvq_error *err);
void kvq_cuda_close(kvq_cuda *c);

/* Uploads one layer's K, V [H][T][D] and makes room for nslots K', V'. */
kvq_status kvq_cuda_set_layer(kvq_cuda *c, const float *key, const float *value, int H, int T, int D,
                              int nslots, kvq_error *err);

/* Runs a plan (both tensors) into slot s.  recon [2][H] (K heads, then V):
 * n, Σx², Σe², Σ|e| and max|e| are added (bits untouched).  A group whose
 * scale or zero is not finite gives KVQ_ERR_NUMERIC with *bad = tensor*H + h
 * and an empty message, as the CPU helpers do. */
kvq_status kvq_cuda_quantize_plan(kvq_cuda *c, int slot, const kvq_plan *plan, kvq_recon_acc *recon,
                                  int *bad, kvq_error *err);

/* Copies K', V' [H][T][D] made on the CPU into slot s. */
kvq_status kvq_cuda_upload_slot(kvq_cuda *c, int slot, const float *key, const float *value,
                                kvq_error *err);

/* Copies slot s's K', V' back to the host (tests compare them with the CPU's). */
kvq_status kvq_cuda_download_slot(kvq_cuda *c, int slot, float *key, float *value, kvq_error *err);

/* The query rows of the attention metrics: q [Hq][npos][D] (query head j's
 * row at pos[i], positions ascending, < T), for the current layer. */
kvq_status kvq_cuda_set_queries(kvq_cuda *c, const float *q, int Hq, const int *pos, size_t npos,
                                int query_prescaled, kvq_error *err);

/* Attention sums of KV head h (query heads h·G .. h·G+G−1) for slots
 * 0..nslots−1, added to acc[s] (docs/metrics.md: the same sums as kvq_attention_head). */
kvq_status kvq_cuda_attention(kvq_cuda *c, int h, int nslots, kvq_attn_acc *acc, kvq_error *err);

/* Benchmark helpers (kvq-bench): device-to-device copy bandwidth in GB/s
 * (bytes read + written) over n floats, and the seconds of one plan run. */
kvq_status kvq_cuda_copy_bandwidth(kvq_cuda *c, size_t n, double *gbs, kvq_error *err);
kvq_status kvq_cuda_time_plan(kvq_cuda *c, const kvq_plan *plan, int reps, double *seconds,
                              kvq_error *err);
/* Seconds of one cuBLAS sgemm of [m][k]·[k][n]ᵀ (float32), averaged over reps. */
kvq_status kvq_cuda_time_sgemm(kvq_cuda *c, int m, int n, int k, int reps, double *seconds,
                               kvq_error *err);

/* The module's table of the functions above (ABI checked by the loader). */
#define KVQ_CUDA_ABI 1
#define KVQ_CUDA_MODULE_SYMBOL "kvq_cuda_module_api"
typedef struct kvq_cuda_api {
    int abi;     /* KVQ_CUDA_ABI */
    size_t size; /* sizeof(kvq_cuda_api) */
    int (*device_count)(char *msg, int len);
    kvq_status (*open)(kvq_cuda **out, char *name, size_t name_len, kvq_error *err);
    void (*close)(kvq_cuda *c);
    kvq_status (*set_layer)(kvq_cuda *c, const float *key, const float *value, int H, int T, int D, int nslots,
                            kvq_error *err);
    kvq_status (*quantize_plan)(kvq_cuda *c, int slot, const kvq_plan *plan, kvq_recon_acc *recon, int *bad,
                                kvq_error *err);
    kvq_status (*upload_slot)(kvq_cuda *c, int slot, const float *key, const float *value, kvq_error *err);
    kvq_status (*download_slot)(kvq_cuda *c, int slot, float *key, float *value, kvq_error *err);
    kvq_status (*set_queries)(kvq_cuda *c, const float *q, int Hq, const int *pos, size_t npos,
                              int query_prescaled, kvq_error *err);
    kvq_status (*attention)(kvq_cuda *c, int h, int nslots, kvq_attn_acc *acc, kvq_error *err);
    kvq_status (*copy_bandwidth)(kvq_cuda *c, size_t n, double *gbs, kvq_error *err);
    kvq_status (*time_plan)(kvq_cuda *c, const kvq_plan *plan, int reps, double *seconds, kvq_error *err);
    kvq_status (*time_sgemm)(kvq_cuda *c, int m, int n, int k, int reps, double *seconds, kvq_error *err);
} kvq_cuda_api;
const kvq_cuda_api *kvq_cuda_module_api(void);

#ifdef __cplusplus
}
#endif
#endif

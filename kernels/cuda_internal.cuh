/* cuda_internal.cuh — what the CUDA sources share: the device context, the
 * checked-call macros (every CUDA and cuBLAS return value becomes a
 * kvq_status with a one-line message) and the block reductions. */
#ifndef KVQ_CUDA_INTERNAL_CUH
#define KVQ_CUDA_INTERNAL_CUH

#include "kvq_cuda.h"

#include <cublas_v2.h>
#include <cuda_runtime.h>

extern "C" {
#include "internal.h"
}

/* Returns from the calling function (which has a kvq_error *err) on failure. */
#define KVQ_CU(call)                                                                              \
    do {                                                                                          \
        cudaError_t e_ = (call);                                                                  \
        if (e_ != cudaSuccess)                                                                    \
            return kvq_fail(err, e_ == cudaErrorMemoryAllocation ? KVQ_ERR_NOMEM : KVQ_ERR_INTERNAL, \
                            "CUDA: %s: %s", #call, cudaGetErrorString(e_));                      \
    } while (0)
#define KVQ_CUBLAS(call)                                                                          \
    do {                                                                                          \
        cublasStatus_t s_ = (call);                                                               \
        if (s_ != CUBLAS_STATUS_SUCCESS)                                                          \
            return kvq_fail(err, s_ == CUBLAS_STATUS_ALLOC_FAILED ? KVQ_ERR_NOMEM : KVQ_ERR_INTERNAL, \
                            "cuBLAS: %s: %s", #call, cublasGetStatusString(s_));                 \
    } while (0)
/* After a kernel launch: the launch error, if any. */
#define KVQ_LAUNCHED() KVQ_CU(cudaGetLastError())

/* A device buffer that only grows. */
struct kvq_dbuf {
    void *p;
    size_t bytes;
};
kvq_status kvq_dbuf_reserve(kvq_dbuf *b, size_t bytes, kvq_error *err);
void kvq_dbuf_free(kvq_dbuf *b);

struct kvq_cuda {
    cudaStream_t stream;
    cublasHandle_t blas;
    int sms;
    /* the layer */
    int H, T, D, nslots;
    kvq_dbuf x;    /* [2][H][T][D] exact K, V */
    kvq_dbuf y;    /* [nslots][2][H][T][D] reconstructions */
    kvq_dbuf part; /* reconstruction partial sums (kvq_rpart) */
    kvq_dbuf flag; /* int: smallest tensor*H + h with a non-finite scale */
    kvq_dbuf mm;   /* float2 [H][groups][chunks][D]: long channel groups' chunk min, max */
    /* the queries */
    int Hq, prescaled;
    size_t npos;
    kvq_dbuf q;    /* [Hq][npos][D] */
    kvq_dbuf pos;  /* int [npos] */
    int *pos_host; /* the same positions on the host (chunk widths) */
    /* attention workspace */
    kvq_dbuf S, A, Sq, O, Ov;         /* rows × T (A: then A'), rows × D (Ov: then Oj) */
    kvq_dbuf rm, rlse, rarg;          /* exact row stats [rows] */
    kvq_dbuf rowe, rowq;              /* per-row sums [rows][3], [rows][6] */
    kvq_dbuf eacc, qacc;              /* [3], [nslots][6] */
};

/* Sizes in elements of one layer tensor, and slot tensors. */
static inline size_t kvq_cuda_tensor(const kvq_cuda *c) { return (size_t)c->H * c->T * c->D; }
static inline float *kvq_cuda_x(kvq_cuda *c, int tensor) { return (float *)c->x.p + tensor * kvq_cuda_tensor(c); }
static inline float *kvq_cuda_y(kvq_cuda *c, int slot, int tensor)
{
    return (float *)c->y.p + (2 * (size_t)slot + tensor) * kvq_cuda_tensor(c);
}

/* ------------------------------------------------------ device reductions */

__device__ inline double kvq_warp_sum(double v)
{
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

/* Sums over a 1-D block (blockDim.x a multiple of 32, ≤ 1024) of N values
 * at once, each reduced as a lone kvq_block_sum would (the same order), with
 * one pair of barriers for all N; every thread gets the totals. */
template <int N> __device__ inline void kvq_block_sums(double (&v)[N])
{
    __shared__ double sh[N][32];
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
    for (int n = 0; n < N; n++) v[n] = kvq_warp_sum(v[n]);
    __syncthreads(); /* a previous call may still be reading sh */
    if (lane == 0)
        for (int n = 0; n < N; n++) sh[n][w] = v[n];
    __syncthreads();
    for (int n = 0; n < N; n++) {
        double t = 0;
        for (int k = 0; k < nw; k++) t += sh[n][k];
        v[n] = t;
    }
}

/* Sum over a 1-D block; every thread gets the same total, added in the same
 * order on every run. */
__device__ inline double kvq_block_sum(double v)
{
    double a[1] = {v};
    kvq_block_sums(a);
    return a[0];
}

#endif

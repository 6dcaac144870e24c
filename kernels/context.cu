/* context.cu — the CUDA device context: opening the first GPU, the layer,
 * reconstruction slots and query rows held on it, and the benchmark timers. */
#include "cuda_internal.cuh"

#include <stdio.h>
#include <string.h>

extern "C" int kvq_cuda_device_count(char *msg, int len)
{
    int n = 0;
    cudaError_t e = cudaGetDeviceCount(&n);
    if (e == cudaErrorNoDevice || e == cudaErrorInsufficientDriver) return 0;
    if (e != cudaSuccess) {
        snprintf(msg, (size_t)len, "%s", cudaGetErrorString(e));
        return -1;
    }
    return n;
}

kvq_status kvq_dbuf_reserve(kvq_dbuf *b, size_t bytes, kvq_error *err)
{
    if (bytes <= b->bytes && b->p) return KVQ_OK;
    kvq_dbuf_free(b);
    cudaError_t e = cudaMalloc(&b->p, bytes ? bytes : 1);
    if (e != cudaSuccess) {
        b->p = NULL;
        return kvq_fail(err, KVQ_ERR_NOMEM, "CUDA: cannot allocate %zu bytes on the GPU: %s", bytes,
                        cudaGetErrorString(e));
    }
    b->bytes = bytes;
    return KVQ_OK;
}

void kvq_dbuf_free(kvq_dbuf *b)
{
    if (b->p) cudaFree(b->p);
    b->p = NULL;
    b->bytes = 0;
}

extern "C" kvq_status kvq_cuda_open(kvq_cuda **out, char *name, size_t name_len, kvq_error *err)
{
    *out = NULL;
    char msg[256] = "";
    int n = kvq_cuda_device_count(msg, (int)sizeof msg);
    if (n < 0) return kvq_fail(err, KVQ_ERR_UNSUPPORTED, "--device cuda: the CUDA runtime failed: %s", msg);
    if (n == 0)
        return kvq_fail(err, KVQ_ERR_UNSUPPORTED,
                        "--device cuda: no CUDA GPU found (no device or no driver); use --device cpu");
    cudaDeviceProp prop;
    KVQ_CU(cudaSetDevice(0));
    KVQ_CU(cudaGetDeviceProperties(&prop, 0));
    kvq_cuda *c = (kvq_cuda *)calloc(1, sizeof *c);
    if (!c) return kvq_fail(err, KVQ_ERR_NOMEM, "out of memory");
    c->sms = prop.multiProcessorCount;
    snprintf(name, name_len, "%s (sm_%d%d, %d SMs, %.0f GiB)", prop.name, prop.major, prop.minor, c->sms,
             (double)prop.totalGlobalMem / (1u << 30));
    cudaError_t e = cudaStreamCreateWithFlags(&c->stream, cudaStreamNonBlocking);
    if (e != cudaSuccess) {
        free(c);
        return kvq_fail(err, KVQ_ERR_INTERNAL, "CUDA: cudaStreamCreate: %s", cudaGetErrorString(e));
    }
    cublasStatus_t s = cublasCreate(&c->blas);
    if (s == CUBLAS_STATUS_SUCCESS) s = cublasSetStream(c->blas, c->stream);
    /* float32 products without TF32 tensor cores: the GPU is compared with the CPU */
    if (s == CUBLAS_STATUS_SUCCESS) s = cublasSetMathMode(c->blas, CUBLAS_DEFAULT_MATH);
    if (s != CUBLAS_STATUS_SUCCESS) {
        kvq_cuda_close(c);
        return kvq_fail(err, KVQ_ERR_INTERNAL, "cuBLAS: cublasCreate: %s", cublasGetStatusString(s));
    }
    *out = c;
    return KVQ_OK;
}

extern "C" void kvq_cuda_close(kvq_cuda *c)
{
    if (!c) return;
    kvq_dbuf *bufs[] = {&c->x, &c->y,  &c->part, &c->flag, &c->mm,   &c->q,    &c->pos,  &c->S,    &c->A,   &c->Sq,
                        &c->O, &c->Ov, &c->rm,   &c->rlse, &c->rarg, &c->rowe, &c->rowq, &c->eacc, &c->qacc};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) kvq_dbuf_free(bufs[i]);
    free(c->pos_host);
    if (c->blas) cublasDestroy(c->blas);
    if (c->stream) cudaStreamDestroy(c->stream);
    free(c);
}

extern "C" kvq_status kvq_cuda_set_layer(kvq_cuda *c, const float *key, const float *value, int H, int T,
                                         int D, int nslots, kvq_error *err)
{
    size_t n, bytes, ybytes;
    if (!kvq_tensor_bytes((size_t)H, (size_t)T, (size_t)D, &bytes) || !kvq_mul_size(bytes, 2, &n) ||
        !kvq_mul_size(n, (size_t)(nslots > 0 ? nslots : 1), &ybytes))
        return kvq_fail(err, KVQ_ERR_NOMEM, "layer size overflows");
    kvq_status st;
    if ((st = kvq_dbuf_reserve(&c->x, n, err)) || (st = kvq_dbuf_reserve(&c->y, ybytes, err))) return st;
    c->H = H, c->T = T, c->D = D, c->nslots = nslots;
    KVQ_CU(cudaMemcpyAsync(kvq_cuda_x(c, 0), key, bytes, cudaMemcpyHostToDevice, c->stream));
    KVQ_CU(cudaMemcpyAsync(kvq_cuda_x(c, 1), value, bytes, cudaMemcpyHostToDevice, c->stream));
    KVQ_CU(cudaStreamSynchronize(c->stream));
    c->npos = 0; /* queries belong to a layer */
    return KVQ_OK;
}

extern "C" kvq_status kvq_cuda_upload_slot(kvq_cuda *c, int slot, const float *key, const float *value,
                                           kvq_error *err)
{
    if (slot < 0 || slot >= c->nslots) return kvq_fail(err, KVQ_ERR_INTERNAL, "CUDA: slot %d of %d", slot, c->nslots);
    size_t bytes = kvq_cuda_tensor(c) * sizeof(float);
    KVQ_CU(cudaMemcpyAsync(kvq_cuda_y(c, slot, 0), key, bytes, cudaMemcpyHostToDevice, c->stream));
    KVQ_CU(cudaMemcpyAsync(kvq_cuda_y(c, slot, 1), value, bytes, cudaMemcpyHostToDevice, c->stream));
    KVQ_CU(cudaStreamSynchronize(c->stream));
    return KVQ_OK;
}

extern "C" kvq_status kvq_cuda_download_slot(kvq_cuda *c, int slot, float *key, float *value, kvq_error *err)
{
    if (slot < 0 || slot >= c->nslots) return kvq_fail(err, KVQ_ERR_INTERNAL, "CUDA: slot %d of %d", slot, c->nslots);
    size_t bytes = kvq_cuda_tensor(c) * sizeof(float);
    KVQ_CU(cudaMemcpyAsync(key, kvq_cuda_y(c, slot, 0), bytes, cudaMemcpyDeviceToHost, c->stream));
    KVQ_CU(cudaMemcpyAsync(value, kvq_cuda_y(c, slot, 1), bytes, cudaMemcpyDeviceToHost, c->stream));
    KVQ_CU(cudaStreamSynchronize(c->stream));
    return KVQ_OK;
}

extern "C" kvq_status kvq_cuda_set_queries(kvq_cuda *c, const float *q, int Hq, const int *pos, size_t npos,
                                           int query_prescaled, kvq_error *err)
{
    size_t n, bytes;
    if (!kvq_tensor_bytes((size_t)Hq, npos, (size_t)c->D, &bytes) || !kvq_mul_size(npos, sizeof(int), &n))
        return kvq_fail(err, KVQ_ERR_NOMEM, "query rows overflow");
    if (Hq <= 0 || c->H <= 0 || Hq % c->H)
        return kvq_fail(err, KVQ_ERR_INTERNAL, "CUDA: %d query heads for %d KV heads", Hq, c->H);
    for (size_t i = 0; i < npos; i++)
        if (pos[i] < 0 || pos[i] >= c->T || (i && pos[i] <= pos[i - 1]))
            return kvq_fail(err, KVQ_ERR_INTERNAL, "CUDA: query positions must ascend within 0..%d", c->T - 1);
    kvq_status st;
    if ((st = kvq_dbuf_reserve(&c->q, bytes, err)) || (st = kvq_dbuf_reserve(&c->pos, n, err))) return st;
    int *ph = (int *)realloc(c->pos_host, n ? n : 1);
    if (!ph) return kvq_fail(err, KVQ_ERR_NOMEM, "out of memory");
    c->pos_host = ph;
    memcpy(ph, pos, n);
    c->Hq = Hq, c->npos = npos, c->prescaled = query_prescaled;
    if (npos == 0) return KVQ_OK;
    KVQ_CU(cudaMemcpyAsync(c->q.p, q, bytes, cudaMemcpyHostToDevice, c->stream));
    KVQ_CU(cudaMemcpyAsync(c->pos.p, pos, n, cudaMemcpyHostToDevice, c->stream));
    KVQ_CU(cudaStreamSynchronize(c->stream));
    return KVQ_OK;
}

/* ------------------------------------------------------------ benchmarks */

extern "C" kvq_status kvq_cuda_copy_bandwidth(kvq_cuda *c, size_t n, double *gbs, kvq_error *err)
{
    kvq_dbuf a = {0, 0}, b = {0, 0};
    kvq_status st = kvq_dbuf_reserve(&a, n * sizeof(float), err);
    if (!st) st = kvq_dbuf_reserve(&b, n * sizeof(float), err);
    cudaEvent_t e0 = NULL, e1 = NULL;
    float ms = 0;
    const int reps = 20;
    if (!st) {
        cudaError_t e = cudaEventCreate(&e0);
        if (e == cudaSuccess) e = cudaEventCreate(&e1);
        if (e == cudaSuccess) e = cudaMemsetAsync(a.p, 0, n * sizeof(float), c->stream);
        if (e == cudaSuccess) e = cudaMemcpyAsync(b.p, a.p, n * sizeof(float), cudaMemcpyDeviceToDevice, c->stream);
        if (e == cudaSuccess) e = cudaEventRecord(e0, c->stream);
        for (int r = 0; r < reps && e == cudaSuccess; r++)
            e = cudaMemcpyAsync(b.p, a.p, n * sizeof(float), cudaMemcpyDeviceToDevice, c->stream);
        if (e == cudaSuccess) e = cudaEventRecord(e1, c->stream);
        if (e == cudaSuccess) e = cudaEventSynchronize(e1);
        if (e == cudaSuccess) e = cudaEventElapsedTime(&ms, e0, e1);
        if (e != cudaSuccess) st = kvq_fail(err, KVQ_ERR_INTERNAL, "CUDA: copy benchmark: %s", cudaGetErrorString(e));
    }
    if (e0) cudaEventDestroy(e0);
    if (e1) cudaEventDestroy(e1);
    kvq_dbuf_free(&a), kvq_dbuf_free(&b);
    if (!st) *gbs = 2.0 * n * sizeof(float) * reps / (ms * 1e-3) / 1e9;
    return st;
}

extern "C" kvq_status kvq_cuda_time_sgemm(kvq_cuda *c, int m, int n, int k, int reps, double *seconds,
                                          kvq_error *err)
{
    kvq_dbuf a = {0, 0}, b = {0, 0}, d = {0, 0};
    kvq_status st = kvq_dbuf_reserve(&a, (size_t)m * k * sizeof(float), err);
    if (!st) st = kvq_dbuf_reserve(&b, (size_t)n * k * sizeof(float), err);
    if (!st) st = kvq_dbuf_reserve(&d, (size_t)m * n * sizeof(float), err);
    cudaEvent_t e0 = NULL, e1 = NULL;
    float ms = 0;
    const float one = 1.0f, zero = 0.0f;
    if (!st) {
        cudaError_t e = cudaEventCreate(&e0);
        if (e == cudaSuccess) e = cudaEventCreate(&e1);
        if (e == cudaSuccess) e = cudaMemsetAsync(a.p, 0, (size_t)m * k * sizeof(float), c->stream);
        if (e == cudaSuccess) e = cudaMemsetAsync(b.p, 0, (size_t)n * k * sizeof(float), c->stream);
        cublasStatus_t s = CUBLAS_STATUS_SUCCESS;
        /* row-major [m][n] = A [m][k] · B [n][k]ᵀ, as the score products */
        for (int r = -1; r < reps && e == cudaSuccess && s == CUBLAS_STATUS_SUCCESS; r++) {
            if (r == 0) e = cudaEventRecord(e0, c->stream);
            if (e == cudaSuccess)
                s = cublasSgemm(c->blas, CUBLAS_OP_T, CUBLAS_OP_N, n, m, k, &one, (const float *)b.p, k,
                                (const float *)a.p, k, &zero, (float *)d.p, n);
        }
        if (e == cudaSuccess) e = cudaEventRecord(e1, c->stream);
        if (e == cudaSuccess) e = cudaEventSynchronize(e1);
        if (e == cudaSuccess) e = cudaEventElapsedTime(&ms, e0, e1);
        if (e != cudaSuccess) st = kvq_fail(err, KVQ_ERR_INTERNAL, "CUDA: sgemm benchmark: %s", cudaGetErrorString(e));
        else if (s != CUBLAS_STATUS_SUCCESS)
            st = kvq_fail(err, KVQ_ERR_INTERNAL, "cuBLAS: sgemm benchmark: %s", cublasGetStatusString(s));
    }
    if (e0) cudaEventDestroy(e0);
    if (e1) cudaEventDestroy(e1);
    kvq_dbuf_free(&a), kvq_dbuf_free(&b), kvq_dbuf_free(&d);
    if (!st) *seconds = ms * 1e-3 / (reps > 0 ? reps : 1);
    return st;
}

/* attention.cu — the attention metrics of one KV head on the GPU (docs/metrics.md),
 * the same sums as lib/metrics/attention.c (the reference is its
 * kvq_attention_head_ref): scores S = QKᵀ/√D over causal rows, stable softmax
 * A, outputs O = A·V, for the exact K, V and each slot's K', V'.
 *
 * Products go through cuBLAS (the scores strided-batched over the G query
 * heads that read the KV head, K broadcast with stride 0; the outputs one
 * product over all G·nc rows with V shared, a quantizer's A·V' and A'·V'
 * one over both A and A'); one block per row does
 * the softmax, KL and top-1; one warp per row the output differences.  Rows
 * are processed in chunks of positions so that a score matrix stays below
 * 32 M floats.  Per-row sums are reduced by a single block in row order, so
 * the result is the same on every run. */
#include "cuda_internal.cuh"

#include <limits.h>
#include <math.h>
#include <vector>

enum { ROWE = 3, ROWQ = 6 }; /* per-row sums: exact (s², a², o²); per slot (see below) */

/* Max and first arg-max over a 1-D block; every thread gets the result. */
__device__ void block_argmax(float &m, int &am)
{
    __shared__ float shm[32];
    __shared__ int sha[32];
    for (int o = 16; o > 0; o >>= 1) {
        float om = __shfl_xor_sync(0xffffffffu, m, o);
        int oa = __shfl_xor_sync(0xffffffffu, am, o);
        if (om > m || (om == m && oa < am)) m = om, am = oa;
    }
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
    __syncthreads();
    if (lane == 0) shm[w] = m, sha[w] = am;
    __syncthreads();
    m = shm[0], am = sha[0];
    for (int k = 1; k < nw; k++)
        if (shm[k] > m || (shm[k] == m && sha[k] < am)) m = shm[k], am = sha[k];
}

/* Scales row s[0..p] in place (unless prescaled), then returns its max,
 * first arg-max and Σ exp(s − m) (in double), as softmax_row on the CPU. */
__device__ void row_softmax_stats(float *s, int p, float scale, int prescaled, float &m, int &am, double &sum)
{
    m = -INFINITY, am = INT_MAX;
    for (int u = threadIdx.x; u <= p; u += blockDim.x) {
        float v = prescaled ? s[u] : __fdiv_rn(s[u], scale);
        s[u] = v;
        if (v > m || (v == m && u < am)) m = v, am = u;
    }
    block_argmax(m, am);
    double e = 0;
    for (int u = threadIdx.x; u <= p; u += blockDim.x) e += (double)expf(__fsub_rn(s[u], m));
    sum = kvq_block_sum(e);
}

/* Exact side, one block per row r = j·nc + i (query head j, position
 * pos[i]): scales S, writes A (zeros past the causal prefix up to ncol),
 * the row's max, log-sum-exp, arg-max and rowe[r] = (Σ s², Σ a², ·). */
__global__ void softmax_exact(float *S, float *A, int ncol, int nc, const int *pos, float scale, int prescaled,
                              float *rm, double *rlse, int *rarg, double *rowe)
{
    const int r = blockIdx.x, p = pos[r % nc];
    float *s = S + (size_t)r * ncol, *a = A + (size_t)r * ncol;
    float m;
    int am;
    double sum;
    row_softmax_stats(s, p, scale, prescaled, m, am, sum);
    const float fsum = (float)sum;
    double s2 = 0, a2 = 0;
    for (int u = threadIdx.x; u < ncol; u += blockDim.x) {
        if (u <= p) {
            float av = __fdiv_rn(expf(__fsub_rn(s[u], m)), fsum);
            a[u] = av;
            s2 += (double)s[u] * s[u];
            a2 += (double)av * av;
        } else {
            a[u] = 0.0f;
        }
    }
    double t[2] = {s2, a2};
    kvq_block_sums(t);
    if (threadIdx.x == 0) {
        rm[r] = m, rlse[r] = log(sum), rarg[r] = am;
        rowe[(size_t)r * ROWE + 0] = t[0];
        rowe[(size_t)r * ROWE + 1] = t[1];
    }
}

/* Quantized side of the same rows: scales Sq, writes Aq and
 * rowq[r] = (Σ (s − s')², Σ (a − a')², KL(A‖A'), top-1 unchanged, ·, ·). */
__global__ void softmax_compare(float *Sq, float *Aq, const float *S, const float *A, int ncol, int nc,
                                const int *pos, float scale, int prescaled, const float *rm, const double *rlse,
                                const int *rarg, double *rowq)
{
    const int r = blockIdx.x, p = pos[r % nc];
    float *sq = Sq + (size_t)r * ncol, *aq = Aq + (size_t)r * ncol;
    const float *s = S + (size_t)r * ncol, *a = A + (size_t)r * ncol;
    float mq;
    int amq;
    double sum;
    row_softmax_stats(sq, p, scale, prescaled, mq, amq, sum);
    const float fsum = (float)sum;
    const double lseq = log(sum), m = rm[r], lse = rlse[r];
    double ds2 = 0, da2 = 0, kl = 0;
    for (int u = threadIdx.x; u < ncol; u += blockDim.x) {
        if (u <= p) {
            float av = __fdiv_rn(expf(__fsub_rn(sq[u], mq)), fsum);
            aq[u] = av;
            double ds = (double)s[u] - (double)sq[u], da = (double)a[u] - (double)av;
            ds2 += ds * ds;
            da2 += da * da;
            if (a[u] != 0.0f) { /* KL from both log-softmaxes */
                double la = ((double)s[u] - m) - lse, lq = ((double)sq[u] - mq) - lseq;
                kl += (double)a[u] * (la - lq);
            }
        } else {
            aq[u] = 0.0f;
        }
    }
    double t[3] = {ds2, da2, kl};
    kvq_block_sums(t);
    if (threadIdx.x == 0) {
        double *o = rowq + (size_t)r * ROWQ;
        o[0] = t[0], o[1] = t[1], o[2] = t[2], o[3] = rarg[r] == amq ? 1.0 : 0.0;
    }
}

/* One warp per row of D outputs: Ov == NULL → out[r·stride + col] = Σ O²;
 * else out[..col] = Σ (O − Ov)², out[..col+1] = Σ (O − Oj)². */
__global__ void output_rows(const float *O, const float *Ov, const float *Oj, int rows, int D, double *out,
                            int stride, int col)
{
    const int r = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    if (r >= rows) return;
    const size_t off = (size_t)r * D;
    double a = 0, b = 0;
    for (int c = lane; c < D; c += 32) {
        double o = O[off + c];
        if (Ov) {
            double d1 = o - (double)Ov[off + c], d2 = o - (double)Oj[off + c];
            a += d1 * d1, b += d2 * d2;
        } else {
            a += o * o;
        }
    }
    a = kvq_warp_sum(a), b = kvq_warp_sum(b);
    if (lane == 0) {
        out[(size_t)r * stride + col] = a;
        if (Ov) out[(size_t)r * stride + col + 1] = b;
    }
}

/* acc[v] += Σ_r rowv[r·STRIDE + v] for v < STRIDE; one block, fixed order. */
template <int STRIDE> __global__ void reduce_rows(const double *rowv, int rows, double *acc)
{
    double t[STRIDE] = {};
    for (int r = threadIdx.x; r < rows; r += blockDim.x)
        for (int v = 0; v < STRIDE; v++) t[v] += rowv[(size_t)r * STRIDE + v];
    kvq_block_sums(t);
    if (threadIdx.x == 0)
        for (int v = 0; v < STRIDE; v++) acc[v] += t[v];
}

/* ------------------------------------------------------------------ host */

/* Row-major C [G][nc][ncol] = Q [G][nc][D] · K [ncol][D]ᵀ (K shared). */
static cublasStatus_t scores(kvq_cuda *c, const float *Q, long long qstride, const float *K, float *S, int G,
                             int nc, int ncol)
{
    const float one = 1.0f, zero = 0.0f;
    return cublasSgemmStridedBatched(c->blas, CUBLAS_OP_T, CUBLAS_OP_N, ncol, nc, c->D, &one, K, c->D, 0, Q, c->D,
                                     qstride, &zero, S, ncol, (long long)nc * ncol, G);
}

/* Row-major O [G][nc][D] = A [G][nc][ncol] · V [ncol][D] (V shared): A is contiguous, so one
 * product of G·nc rows.  As G products of nc rows (strided-batched) cuBLAS tiled each small
 * output 32×32 and ran 3.6× slower on an H100 at last:64 (78 against 22 µs; 2.4× at last:512),
 * which made these products 83 % of the attention's GPU time. */
static cublasStatus_t outputs(kvq_cuda *c, const float *A, const float *V, float *O, int G, int nc, int ncol)
{
    const float one = 1.0f, zero = 0.0f;
    return cublasSgemm(c->blas, CUBLAS_OP_N, CUBLAS_OP_N, c->D, G * nc, ncol, &one, V, c->D, A, ncol, &zero, O, c->D);
}

extern "C" kvq_status kvq_cuda_attention(kvq_cuda *c, int h, int nslots, kvq_attn_acc *acc, kvq_error *err)
{
    if (c->npos == 0) return KVQ_OK;
    if (h < 0 || h >= c->H || nslots < 0 || nslots > c->nslots)
        return kvq_fail(err, KVQ_ERR_INTERNAL, "CUDA: attention of head %d with %d slots", h, nslots);
    const int G = c->Hq / c->H, T = c->T, D = c->D, prescaled = c->prescaled;
    const size_t npos = c->npos, budget = (size_t)1 << 25;
    size_t cp = budget / ((size_t)G * T);
    if (cp < 1) cp = 1;
    if (cp > npos) cp = npos;
    const size_t rows_max = (size_t)G * cp;
    kvq_status st;
    if ((st = kvq_dbuf_reserve(&c->S, rows_max * T * sizeof(float), err)) ||
        (st = kvq_dbuf_reserve(&c->A, 2 * rows_max * T * sizeof(float), err)) || /* A, then A' */
        (st = kvq_dbuf_reserve(&c->Sq, rows_max * T * sizeof(float), err)) ||
        (st = kvq_dbuf_reserve(&c->O, rows_max * D * sizeof(float), err)) ||
        (st = kvq_dbuf_reserve(&c->Ov, 2 * rows_max * D * sizeof(float), err)) || /* A·V', then A'·V' */
        (st = kvq_dbuf_reserve(&c->rm, rows_max * sizeof(float), err)) ||
        (st = kvq_dbuf_reserve(&c->rlse, rows_max * sizeof(double), err)) ||
        (st = kvq_dbuf_reserve(&c->rarg, rows_max * sizeof(int), err)) ||
        (st = kvq_dbuf_reserve(&c->rowe, rows_max * ROWE * sizeof(double), err)) ||
        (st = kvq_dbuf_reserve(&c->rowq, rows_max * ROWQ * sizeof(double), err)) ||
        (st = kvq_dbuf_reserve(&c->eacc, ROWE * sizeof(double), err)) ||
        (st = kvq_dbuf_reserve(&c->qacc, ((size_t)nslots + 1) * ROWQ * sizeof(double), err)))
        return st;
    const int *pos = c->pos_host;
    KVQ_CU(cudaMemsetAsync(c->eacc.p, 0, ROWE * sizeof(double), c->stream));
    KVQ_CU(cudaMemsetAsync(c->qacc.p, 0, ((size_t)nslots + 1) * ROWQ * sizeof(double), c->stream));

    const float scale = sqrtf((float)D);
    const size_t hoff = (size_t)h * T * D;
    const float *K = kvq_cuda_x(c, 0) + hoff, *V = kvq_cuda_x(c, 1) + hoff;
    const float *Q = (const float *)c->q.p + (size_t)h * G * npos * D; /* [G][npos][D] */
    float *S = (float *)c->S.p, *A = (float *)c->A.p, *Sq = (float *)c->Sq.p;
    float *O = (float *)c->O.p, *Ov = (float *)c->Ov.p;
    float *rm = (float *)c->rm.p;
    double *rlse = (double *)c->rlse.p, *rowe = (double *)c->rowe.p, *rowq = (double *)c->rowq.p;
    double *eacc = (double *)c->eacc.p, *qacc = (double *)c->qacc.p;
    int *rarg = (int *)c->rarg.p;
    const int *dpos = (const int *)c->pos.p;
    for (size_t r0 = 0; r0 < npos; r0 += cp) {
        const int nc = (int)(npos - r0 < cp ? npos - r0 : cp);
        const int ncol = pos[r0 + nc - 1] + 1, rows = G * nc; /* positions ascend */
        const float *Qc = Q + r0 * D;
        const long long qstride = (long long)npos * D;
        const int warps_grid = (rows + 7) / 8;
        /* A' right after A and A'·V' right after A·V' (leading dimensions ncol and D): both
         * output products of a quantizer are one product of 2·G·nc rows */
        float *Aq = A + (size_t)rows * ncol, *Oj = Ov + (size_t)rows * D;
        /* exact: S, A, O and their norms */
        KVQ_CUBLAS(scores(c, Qc, qstride, K, S, G, nc, ncol));
        softmax_exact<<<rows, 256, 0, c->stream>>>(S, A, ncol, nc, dpos + r0, scale, prescaled, rm, rlse, rarg, rowe);
        KVQ_LAUNCHED();
        KVQ_CUBLAS(outputs(c, A, V, O, G, nc, ncol));
        output_rows<<<warps_grid, 256, 0, c->stream>>>(O, NULL, NULL, rows, D, rowe, ROWE, 2);
        KVQ_LAUNCHED();
        reduce_rows<ROWE><<<1, 256, 0, c->stream>>>(rowe, rows, eacc);
        KVQ_LAUNCHED();
        /* each quantizer against it */
        for (int s = 0; s < nslots; s++) {
            const float *Kq = kvq_cuda_y(c, s, 0) + hoff, *Vq = kvq_cuda_y(c, s, 1) + hoff;
            KVQ_CUBLAS(scores(c, Qc, qstride, Kq, Sq, G, nc, ncol));
            softmax_compare<<<rows, 256, 0, c->stream>>>(Sq, Aq, S, A, ncol, nc, dpos + r0, scale, prescaled, rm,
                                                         rlse, rarg, rowq);
            KVQ_LAUNCHED();
            /* [A·V'; A'·V']: exact attention and quantized values; both quantized */
            KVQ_CUBLAS(outputs(c, A, Vq, Ov, 2 * G, nc, ncol));
            output_rows<<<warps_grid, 256, 0, c->stream>>>(O, Ov, Oj, rows, D, rowq, ROWQ, 4);
            KVQ_LAUNCHED();
            reduce_rows<ROWQ><<<1, 256, 0, c->stream>>>(rowq, rows, qacc + (size_t)s * ROWQ);
            KVQ_LAUNCHED();
        }
    }
    std::vector<double> e(ROWE), q((size_t)nslots * ROWQ + 1);
    KVQ_CU(cudaMemcpyAsync(e.data(), eacc, ROWE * sizeof(double), cudaMemcpyDeviceToHost, c->stream));
    if (nslots)
        KVQ_CU(
            cudaMemcpyAsync(q.data(), qacc, (size_t)nslots * ROWQ * sizeof(double), cudaMemcpyDeviceToHost, c->stream));
    KVQ_CU(cudaStreamSynchronize(c->stream));
    for (int s = 0; s < nslots; s++) {
        const double *v = &q[(size_t)s * ROWQ];
        kvq_attn_acc *a = &acc[s];
        a->s_diff2 += v[0], a->a_diff2 += v[1], a->kl_sum += v[2], a->top1_same += v[3];
        a->o_diff2 += v[4], a->o_joint_diff2 += v[5];
        a->s_ref2 += e[0], a->a_ref2 += e[1], a->o_ref2 += e[2];
        a->rows += (double)G * npos;
    }
    return KVQ_OK;
}

/* quant.cu — the uniform quantizer families on the GPU: the steps of a
 * kvq_plan (lib/quant/plan.c is the CPU executor and the reference), fused
 * with the reconstruction error sums.
 *
 * Arithmetic follows docs/building-blocks.md (U, A) operation by operation with explicitly
 * rounded intrinsics (__fsub_rn, __fdiv_rn, __fmul_rn, __fadd_rn: never fused
 * into an FMA, divisions not by reciprocal), rintf for round-half-even and
 * __float2half_rn for the fp16 scale, so K', V' equal the CPU's bit for bit.
 * Error sums are per-block partials in double, added on the host in a fixed
 * order: the same result on every run.
 *
 * Kernels:
 *   rows_kernel     U or A on groups along a row: per token within a head
 *                   (TOKEN, ABSMAX) or along all heads of a token
 *                   (TOKEN_LAYER); 8, 16 or 32 lanes per group, a few
 *                   elements each in registers.
 *   channel_kernel  U per channel: a block is 32 channels × 8 token lanes
 *                   over one group of tokens, so every load is coalesced.
 *   channel_minmax_kernel, channel_apply_kernel
 *                   the same for groups too long and too few to fill the GPU
 *                   (kcvt's K: one group of all T tokens): the group's tokens
 *                   are split into chunks over blocks; the first kernel writes
 *                   each chunk's min and max, the second combines its group's
 *                   (min and max are exact in any order) and quantizes its chunk.
 *   recon_kernel    the exact copy (EXACT) and the error of TOKEN_LAYER
 *                   steps, whose groups straddle heads. */
#include "cuda_internal.cuh"

#include <cuda_fp16.h>
#include <math.h>
#include <vector>

/* Reconstruction partial sums of one block. */
struct kvq_rpart {
    double x2, e2, ae, mx;
};

__device__ inline void add_error(kvq_rpart &r, float x, float y)
{
    float e = __fsub_rn(x, y); /* E = X − X' in float32 */
    double ae = fabs((double)e);
    r.x2 += (double)x * (double)x;
    r.e2 += (double)e * (double)e;
    r.ae += ae;
    r.mx = fmax(r.mx, ae);
}

/* Block-wide reduction of r into *out (thread 0 writes); every thread calls. */
__device__ void store_partial(kvq_rpart r, kvq_rpart *out)
{
    __shared__ kvq_rpart sh[32];
    for (int o = 16; o > 0; o >>= 1) {
        r.x2 += __shfl_xor_sync(0xffffffffu, r.x2, o);
        r.e2 += __shfl_xor_sync(0xffffffffu, r.e2, o);
        r.ae += __shfl_xor_sync(0xffffffffu, r.ae, o);
        r.mx = fmax(r.mx, __shfl_xor_sync(0xffffffffu, r.mx, o));
    }
    int tid = threadIdx.y * blockDim.x + threadIdx.x, nw = (blockDim.x * blockDim.y) >> 5;
    if ((tid & 31) == 0) sh[tid >> 5] = r;
    __syncthreads();
    if (tid == 0) {
        kvq_rpart t = sh[0];
        for (int k = 1; k < nw; k++) {
            t.x2 += sh[k].x2, t.e2 += sh[k].e2, t.ae += sh[k].ae;
            t.mx = fmax(t.mx, sh[k].mx);
        }
        *out = t;
    }
}

__device__ inline float round_scale(float s, int fp16)
{
    return fp16 ? __half2float(__float2half_rn(s)) : s; /* overflow → inf, as the CPU */
}

/* U: x' = clamp(rne((x − z)/s), 0, L)·s + z, or z when s = 0. */
__device__ inline float u_value(float x, float s, float z, float L)
{
    if (s == 0.0f) return z;
    float v = __fdiv_rn(__fsub_rn(x, z), s);
    v = v < 0.0f ? 0.0f : (v > L ? L : v);
    return __fadd_rn(__fmul_rn(rintf(v), s), z);
}

/* A: x' = clamp(rne(x/s), qmin, qmax)·s, or 0 when s = 0. */
__device__ inline float a_value(float x, float s, float qmin, float qmax)
{
    if (s == 0.0f) return 0.0f;
    float v = __fdiv_rn(x, s);
    v = v < qmin ? qmin : (v > qmax ? qmax : v);
    return __fmul_rn(rintf(v), s);
}

/* The numeric flag: the smallest tensor*H + h with a non-finite scale, or
 * FLAG_NONE (set by a byte memset, so resetting it needs no host copy). */
#define FLAG_NONE 0x7f7f7f7f
__device__ inline void flag_bad(int *flag, int code) { atomicMin(flag, code); }

enum { KIND_U = 0, KIND_A = 1 };

/* Groups of G along rows of W values.  LAYER = 0: a row is token t of head
 * blockIdx.y (W = D); LAYER = 1: a row is token t of all heads, head-major
 * (W = H·D; no error sums here, recon_kernel adds them per head).
 *
 * R > 0 (groups of at most LPG·R): a warp takes 32/LPG consecutive groups at
 * a time, LPG lanes each; lane l holds elements l, l + LPG, … of its group in
 * registers, and loads its next group before it reduces and quantizes this
 * one.  A group of 32 thus costs 8 lanes and 3 shuffle steps instead of a
 * whole warp and 5: the work per group (reduction, scale, loop) was most of
 * the instructions where each lane held one element.  R = 0 (LPG = 32): any
 * G, two passes over the group (the second from L1).  The values are the same
 * either way: min and max are exact in any order. */
template <int LAYER> __device__ inline size_t row_addr(size_t head, int T, int D, int t, int j)
{
    return LAYER ? (size_t)(j / D) * T * D + (size_t)t * D + j % D : head + (size_t)t * D + j;
}

template <int KIND, int LAYER, int LPG, int R>
__global__ void rows_kernel(const float *__restrict__ x, float *__restrict__ y, int H, int T, int D, int t0, int nrows,
                            int G, int bits, int fp16, kvq_rpart *part, int *flag, int bad_base)
{
    constexpr int NG = 32 / LPG; /* groups a warp holds at once */
    const int W = LAYER ? H * D : D, ngroups = (W + G - 1) / G;
    const int h = LAYER ? 0 : blockIdx.y;
    const size_t head = (size_t)h * T * D;
    const int lane = threadIdx.x & 31, l = lane % LPG, sub = lane / LPG, warps = blockDim.x >> 5;
    const long items = (long)nrows * ngroups, stride = (long)gridDim.x * warps * NG;
    const float L = (float)((1u << bits) - 1u);
    const float qmax = (float)((1u << (bits - 1)) - 1u), qmin = -(float)(1u << (bits - 1));
    kvq_rpart r = {0, 0, 0, 0};
    float cur[R > 0 ? R : 1], nxt[R > 0 ? R : 1];
    /* this lane's group: item `it` (group g of row t); the warp's first group is it − sub */
    long it = ((long)blockIdx.x * warps + (threadIdx.x >> 5)) * NG + sub;
    /* (t, g) advanced by stride without a division per group (a 64-bit one costs about a
     * hundred instructions) */
    int t = t0 + (int)(it / ngroups), g = (int)(it % ngroups);
    const int dt = (int)(stride / ngroups), dg = (int)(stride % ngroups);
    auto advance = [&](int &tt, int &gg) {
        tt += dt, gg += dg;
        if (gg >= ngroups) gg -= ngroups, tt++;
    };
    /* group (tt, gg)'s values into v (R > 0): lanes past the group's end load nothing */
    auto load = [&](int tt, int gg, float *v) {
        int c0 = gg * G, len = W - c0 < G ? W - c0 : G;
#pragma unroll
        for (int k = 0; k < R; k++)
            if (l + LPG * k < len) v[k] = x[row_addr<LAYER>(head, T, D, tt, c0 + l + LPG * k)];
    };
    if (R > 0 && it < items) load(t, g, cur);
    /* the whole warp runs while any of its groups is left (the shuffles need every lane) */
    for (; it - sub < items; it += stride, advance(t, g)) {
        const bool live = it < items;
        const int c0 = g * G, len = live ? (W - c0 < G ? W - c0 : G) : 0;
        if (R > 0 && it + stride < items) {
            int tn = t, gn = g;
            advance(tn, gn);
            load(tn, gn, nxt);
        }
        /* min and max (U) or max |x| (A) over the group */
        float mn = INFINITY, mx = -INFINITY;
        if (R > 0) {
#pragma unroll
            for (int k = 0; k < R; k++)
                if (l + LPG * k < len) {
                    if (KIND == KIND_U)
                        mn = fminf(mn, cur[k]), mx = fmaxf(mx, cur[k]);
                    else
                        mx = fmaxf(mx, fabsf(cur[k]));
                }
        } else {
            for (int i = l; i < len; i += LPG) {
                float v = x[row_addr<LAYER>(head, T, D, t, c0 + i)];
                if (KIND == KIND_U)
                    mn = fminf(mn, v), mx = fmaxf(mx, v);
                else
                    mx = fmaxf(mx, fabsf(v));
            }
        }
        for (int o = LPG / 2; o > 0; o >>= 1) { /* within the LPG lanes of the group */
            mn = fminf(mn, __shfl_xor_sync(0xffffffffu, mn, o));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
        }
        float s, z = 0.0f;
        if (KIND == KIND_U) {
            s = round_scale(__fdiv_rn(__fsub_rn(mx, mn), L), fp16);
            z = round_scale(mn, fp16);
        } else {
            s = round_scale(__fdiv_rn(mx, qmax), fp16);
        }
        bool ok = isfinite(s) && isfinite(z);
        if (live && !ok && l == 0) flag_bad(flag, bad_base + h); /* span=layer: head 0, as the CPU */
        /* quantize, write, add the error */
        if (live && ok && R > 0) {
#pragma unroll
            for (int k = 0; k < R; k++)
                if (l + LPG * k < len) {
                    float v = cur[k], q = KIND == KIND_U ? u_value(v, s, z, L) : a_value(v, s, qmin, qmax);
                    y[row_addr<LAYER>(head, T, D, t, c0 + l + LPG * k)] = q;
                    if (!LAYER) add_error(r, v, q);
                }
        } else if (live && ok) {
            for (int i = l; i < len; i += LPG) { /* the group is in L1 */
                size_t a = row_addr<LAYER>(head, T, D, t, c0 + i);
                float v = x[a];
                float q = KIND == KIND_U ? u_value(v, s, z, L) : a_value(v, s, qmin, qmax);
                y[a] = q;
                if (!LAYER) add_error(r, v, q);
            }
        }
        if (R > 0)
#pragma unroll
            for (int k = 0; k < R; k++) cur[k] = nxt[k];
    }
    if (!LAYER) store_partial(r, &part[(size_t)h * gridDim.x + blockIdx.x]);
}

/* rows_kernel for groups of G: the fewest lanes a group (8, 16 or 32) that hold it with at
 * most four elements a lane; past 128, any G in two passes. */
template <int KIND, int LAYER>
static void launch_rows(dim3 grid, cudaStream_t st, const float *x, float *y, int H, int T, int D, int t0, int n, int G,
                        int bits, int fp16, kvq_rpart *part, int *flag, int bad)
{
    if (G <= 8)
        rows_kernel<KIND, LAYER, 8, 1><<<grid, 256, 0, st>>>(x, y, H, T, D, t0, n, G, bits, fp16, part, flag, bad);
    else if (G <= 16)
        rows_kernel<KIND, LAYER, 8, 2><<<grid, 256, 0, st>>>(x, y, H, T, D, t0, n, G, bits, fp16, part, flag, bad);
    else if (G <= 32)
        rows_kernel<KIND, LAYER, 8, 4><<<grid, 256, 0, st>>>(x, y, H, T, D, t0, n, G, bits, fp16, part, flag, bad);
    else if (G <= 64)
        rows_kernel<KIND, LAYER, 16, 4><<<grid, 256, 0, st>>>(x, y, H, T, D, t0, n, G, bits, fp16, part, flag, bad);
    else if (G <= 128)
        rows_kernel<KIND, LAYER, 32, 4><<<grid, 256, 0, st>>>(x, y, H, T, D, t0, n, G, bits, fp16, part, flag, bad);
    else
        rows_kernel<KIND, LAYER, 32, 0><<<grid, 256, 0, st>>>(x, y, H, T, D, t0, n, G, bits, fp16, part, flag, bad);
}

/* U per channel: groups of G tokens from t0 (the last one shorter) of each
 * channel of head blockIdx.y.  Block (32, 8): 32 channels × 8 token lanes. */
__global__ void channel_kernel(const float *__restrict__ x, float *__restrict__ y, int T, int D, int t0, int t1,
                               int G, int bits, int fp16, kvq_rpart *part, int *flag, int bad_base)
{
    __shared__ float smn[8][32], smx[8][32];
    const int h = blockIdx.y, tx = threadIdx.x, ty = threadIdx.y;
    const float *xh = x + (size_t)h * T * D;
    float *yh = y + (size_t)h * T * D;
    const int ngroups = (int)(((long)t1 - t0 + G - 1) / G), ntiles = (D + 31) / 32;
    const long items = (long)ngroups * ntiles;
    const float L = (float)((1u << bits) - 1u);
    kvq_rpart r = {0, 0, 0, 0};
    for (long it = blockIdx.x; it < items; it += gridDim.x) {
        int g = (int)(it / ntiles), c = (int)(it % ntiles) * 32 + tx;
        int ts = t0 + g * G, te = t1 - ts < G ? t1 : ts + G;
        bool active = c < D;
        float mn = INFINITY, mx = -INFINITY;
        if (active)
            for (int t = ts + ty; t < te; t += 8) {
                float v = xh[(size_t)t * D + c];
                mn = fminf(mn, v), mx = fmaxf(mx, v);
            }
        smn[ty][tx] = mn, smx[ty][tx] = mx;
        __syncthreads();
        if (ty == 0) {
            for (int k = 1; k < 8; k++) mn = fminf(mn, smn[k][tx]), mx = fmaxf(mx, smx[k][tx]);
            smn[0][tx] = mn, smx[0][tx] = mx;
        }
        __syncthreads();
        mn = smn[0][tx], mx = smx[0][tx];
        float s = round_scale(__fdiv_rn(__fsub_rn(mx, mn), L), fp16), z = round_scale(mn, fp16);
        if (active && (!isfinite(s) || !isfinite(z))) {
            if (ty == 0) flag_bad(flag, bad_base + h);
            active = false;
        }
        if (active)
            for (int t = ts + ty; t < te; t += 8) {
                size_t a = (size_t)t * D + c;
                float v = xh[a], q = u_value(v, s, z, L);
                yh[a] = q;
                add_error(r, v, q);
            }
        __syncthreads(); /* smn/smx are reused by the next item */
    }
    store_partial(r, &part[(size_t)h * gridDim.x + blockIdx.x]);
}

/* Min and max over 8 token lanes of a (32, 8) block, into every thread's mn, mx. */
__device__ inline void block_minmax(float &mn, float &mx)
{
    __shared__ float smn[8][32], smx[8][32];
    const int tx = threadIdx.x, ty = threadIdx.y;
    smn[ty][tx] = mn, smx[ty][tx] = mx;
    __syncthreads();
    for (int k = 0; k < 8; k++) mn = fminf(mn, smn[k][tx]), mx = fmaxf(mx, smx[k][tx]);
}

/* The block's chunk of a split channel step: chunk k = blockIdx.x % nchunk of group
 * g = blockIdx.x / nchunk (G tokens from t0, the last group shorter; C tokens a chunk),
 * tokens [ts, te), channel c = blockIdx.y·32 + threadIdx.x of head h = blockIdx.z; mm_at is
 * chunk j's entry of that group and channel in mm [H][groups][nchunk][D]. */
struct channel_chunk {
    int h, g, k, c, ngroups, nchunk;
    long ts, te;
    __device__ size_t mm_at(int j, int D) const { return (((size_t)h * ngroups + g) * nchunk + j) * D + c; }
};
__device__ inline channel_chunk chunk_of_block(int t0, int t1, int G, int nchunk, int C)
{
    channel_chunk b;
    b.h = blockIdx.z, b.g = blockIdx.x / nchunk, b.k = blockIdx.x % nchunk, b.c = blockIdx.y * 32 + threadIdx.x;
    b.ngroups = (int)(((long)t1 - t0 + G - 1) / G), b.nchunk = nchunk;
    const long gs = (long)t0 + (long)b.g * G, ge = t1 - gs < G ? t1 : gs + G;
    b.ts = gs + (long)b.k * C, b.te = ge - b.ts < C ? ge : b.ts + C;
    return b;
}

/* The block's chunk (chunk_of_block): its min and max into mm[h][g][k][c]. */
__global__ void channel_minmax_kernel(const float *__restrict__ x, int T, int D, int t0, int t1, int G, int nchunk,
                                      int C, float2 *__restrict__ mm)
{
    const channel_chunk b = chunk_of_block(t0, t1, G, nchunk, C);
    const int c = b.c;
    const long ts = b.ts, te = b.te;
    const float *xh = x + (size_t)b.h * T * D;
    float mn = INFINITY, mx = -INFINITY;
    if (c < D)
        for (long t = ts + threadIdx.y; t < te; t += 8) {
            float v = xh[(size_t)t * D + c];
            mn = fminf(mn, v), mx = fmaxf(mx, v);
        }
    block_minmax(mn, mx);
    if (threadIdx.y == 0 && c < D) mm[b.mm_at(b.k, D)] = make_float2(mn, mx);
}

/* The same block's chunk, quantized with its group's min and max (the chunks' from mm), and
 * its error partial sums into part[h][blockIdx.y·gridDim.x + blockIdx.x]. */
__global__ void channel_apply_kernel(const float *__restrict__ x, float *__restrict__ y, int T, int D, int t0, int t1,
                                     int G, int nchunk, int C, const float2 *__restrict__ mm, int bits, int fp16,
                                     kvq_rpart *part, int *flag, int bad_base)
{
    const channel_chunk b = chunk_of_block(t0, t1, G, nchunk, C);
    const int h = b.h, c = b.c;
    const long ts = b.ts, te = b.te;
    const float *xh = x + (size_t)h * T * D;
    float *yh = y + (size_t)h * T * D;
    const float L = (float)((1u << bits) - 1u);
    bool active = c < D;
    float mn = INFINITY, mx = -INFINITY;
    if (active)
        for (int j = threadIdx.y; j < nchunk; j += 8) {
            float2 m = mm[b.mm_at(j, D)];
            mn = fminf(mn, m.x), mx = fmaxf(mx, m.y);
        }
    block_minmax(mn, mx);
    float s = round_scale(__fdiv_rn(__fsub_rn(mx, mn), L), fp16), z = round_scale(mn, fp16);
    if (active && (!isfinite(s) || !isfinite(z))) {
        if (threadIdx.y == 0) flag_bad(flag, bad_base + h);
        active = false;
    }
    kvq_rpart r = {0, 0, 0, 0};
    if (active)
        for (long t = ts + threadIdx.y; t < te; t += 8) {
            size_t a = (size_t)t * D + c;
            float v = xh[a], q = u_value(v, s, z, L);
            yh[a] = q;
            add_error(r, v, q);
        }
    store_partial(r, &part[(size_t)h * gridDim.x * gridDim.y + (size_t)blockIdx.y * gridDim.x + blockIdx.x]);
}

/* Tokens [t0, t1) of head blockIdx.y: copy x to y if `copy` (EXACT), then
 * add the error of y against x. */
__global__ void recon_kernel(const float *__restrict__ x, float *__restrict__ y, int T, int D, int t0, int t1,
                             int copy, kvq_rpart *part)
{
    const int h = blockIdx.y;
    const size_t off = ((size_t)h * T + t0) * D, n = (size_t)(t1 - t0) * D;
    kvq_rpart r = {0, 0, 0, 0};
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        float v = x[off + i], q;
        if (copy) y[off + i] = q = v;
        else q = y[off + i];
        add_error(r, v, q);
    }
    store_partial(r, &part[(size_t)h * gridDim.x + blockIdx.x]);
}

/* ------------------------------------------------------------------ host */

/* One launch whose partials belong to (tensor, heads 0..H−1). */
struct launch {
    int tensor, nblk;
    size_t first; /* index of its first partial */
    double n;     /* elements per head */
};

static int blocks_for(long items, long per_block, int H, int sms)
{
    long want = (items + per_block - 1) / per_block, cap = (8L * sms + H - 1) / H;
    if (cap < 16) cap = 16;
    if (want > cap) want = cap;
    return want < 1 ? 1 : (int)want;
}

/* A per-channel step whose groups are too few to fill the GPU (fewer blocks than half of
 * blocks_for's cap, one group a block) and long: split each group into *nchunk chunks of *C
 * tokens (a multiple of the 8 token lanes), as many blocks as the cap allows. */
static bool channel_split(const kvq_step *s, int H, int D, int sms, int *nchunk, int *C)
{
    long n = (long)s->t1 - s->t0, G = s->group < n ? s->group : n;
    long ngroups = (n + s->group - 1) / s->group, ntiles = (D + 31) / 32;
    long cap = blocks_for(1L << 40, 1, H, sms), per_group = cap / (ngroups * ntiles);
    if (2 * ngroups * ntiles > cap || G < 256 || per_group < 2) return false;
    long c = (G + per_group - 1) / per_group;
    c = (c + 7) / 8 * 8;
    *C = (int)c, *nchunk = (int)((G + c - 1) / c);
    return true;
}

/* Launches every step of plan on slot `slot`; fills the launch list. */
static kvq_status launch_plan(kvq_cuda *c, int slot, const kvq_plan *plan, std::vector<launch> &ls,
                              kvq_error *err)
{
    const int H = c->H, T = c->T, D = c->D;
    /* partials: at most two launches per step, H × nblk each */
    size_t need = 0;
    int maxblk = blocks_for(1L << 40, 1, H, c->sms);
    for (int t = 0; t < 2; t++) need += (size_t)2 * plan->nsteps[t] * H * maxblk;
    size_t need_mm = 0; /* the split channel steps' chunk min, max */
    for (int t = 0; t < 2; t++)
        for (int i = 0; i < plan->nsteps[t]; i++) {
            const kvq_step *s = &plan->step[t][i];
            int nchunk, C;
            if (s->kind == KVQ_STEP_CHANNEL && s->t1 > s->t0 && s->group >= 1 &&
                channel_split(s, H, D, c->sms, &nchunk, &C)) {
                size_t m = (size_t)H * ((s->t1 - s->t0 + s->group - 1) / s->group) * nchunk * D;
                if (m > need_mm) need_mm = m;
            }
        }
    kvq_status st;
    if ((st = kvq_dbuf_reserve(&c->part, need * sizeof(kvq_rpart), err)) ||
        (st = kvq_dbuf_reserve(&c->flag, sizeof(int), err)) ||
        (need_mm && (st = kvq_dbuf_reserve(&c->mm, need_mm * sizeof(float2), err))))
        return st;
    KVQ_CU(cudaMemsetAsync(c->flag.p, 0x7f, sizeof(int), c->stream)); /* FLAG_NONE */
    kvq_rpart *part = (kvq_rpart *)c->part.p;
    int *flag = (int *)c->flag.p;
    size_t used = 0;
    ls.clear();
    for (int tensor = 0; tensor < 2; tensor++) {
        const float *x = kvq_cuda_x(c, tensor);
        float *y = kvq_cuda_y(c, slot, tensor);
        for (int i = 0; i < plan->nsteps[tensor]; i++) {
            const kvq_step *s = &plan->step[tensor][i];
            int t0 = s->t0, t1 = s->t1, n = t1 - t0, fp16 = s->prec == KVQ_SCALE_FP16;
            if (n <= 0) continue;
            if (s->bits < 1 || s->bits > 16 || (s->kind == KVQ_STEP_ABSMAX && s->bits < 2) ||
                (s->kind != KVQ_STEP_EXACT && s->group < (s->kind == KVQ_STEP_ABSMAX ? 0 : 1)))
                return kvq_fail(err, KVQ_ERR_INTERNAL, "CUDA: plan step with bits=%d group=%d", s->bits, s->group);
            int bad = tensor * H;
            launch l = {tensor, 0, used, (double)n * D};
            switch (s->kind) {
            case KVQ_STEP_EXACT:
                l.nblk = blocks_for((long)n * D, 256L * 8, H, c->sms);
                recon_kernel<<<dim3(l.nblk, H), 256, 0, c->stream>>>(x, y, T, D, t0, t1, 1, part + used);
                break;
            case KVQ_STEP_TOKEN:
            case KVQ_STEP_ABSMAX: {
                int G = s->group == 0 || s->group > D ? D : s->group;
                long items = (long)n * ((D + G - 1) / G);
                l.nblk = blocks_for(items, 8 * 4, H, c->sms);
                if (s->kind == KVQ_STEP_TOKEN)
                    launch_rows<KIND_U, 0>(dim3(l.nblk, H), c->stream, x, y, H, T, D, t0, n, G, s->bits, fp16,
                                           part + used, flag, bad);
                else
                    launch_rows<KIND_A, 0>(dim3(l.nblk, H), c->stream, x, y, H, T, D, t0, n, G, s->bits, fp16,
                                           part + used, flag, bad);
                break;
            }
            case KVQ_STEP_CHANNEL: {
                long items = (long)((n + (long)s->group - 1) / s->group) * ((D + 31) / 32);
                int nchunk, C;
                if (channel_split(s, H, D, c->sms, &nchunk, &C)) {
                    dim3 grid((unsigned)(((n + s->group - 1) / s->group) * nchunk), (D + 31) / 32, H);
                    channel_minmax_kernel<<<grid, dim3(32, 8), 0, c->stream>>>(x, T, D, t0, t1, s->group, nchunk, C,
                                                                               (float2 *)c->mm.p);
                    KVQ_LAUNCHED();
                    l.nblk = (int)(grid.x * grid.y);
                    channel_apply_kernel<<<grid, dim3(32, 8), 0, c->stream>>>(x, y, T, D, t0, t1, s->group, nchunk, C,
                                                                              (const float2 *)c->mm.p, s->bits, fp16,
                                                                              part + used, flag, bad);
                    break;
                }
                l.nblk = blocks_for(items, 2, H, c->sms);
                channel_kernel<<<dim3(l.nblk, H), dim3(32, 8), 0, c->stream>>>(x, y, T, D, t0, t1, s->group, s->bits,
                                                                               fp16, part + used, flag, bad);
                break;
            }
            case KVQ_STEP_TOKEN_LAYER: {
                long W = (long)H * D, G = (long)s->group > W ? W : s->group;
                long items = (long)n * ((W + G - 1) / G);
                launch_rows<KIND_U, 1>(dim3(blocks_for(items, 8 * 4, 1, c->sms)), c->stream, x, y, H, T, D, t0, n,
                                       (int)G, s->bits, fp16, NULL, flag, bad);
                KVQ_LAUNCHED();
                /* the error per head, from what was written */
                l.nblk = blocks_for((long)n * D, 256L * 8, H, c->sms);
                recon_kernel<<<dim3(l.nblk, H), 256, 0, c->stream>>>(x, y, T, D, t0, t1, 0, part + used);
                break;
            }
            }
            KVQ_LAUNCHED();
            used += (size_t)l.nblk * H;
            ls.push_back(l);
        }
    }
    return KVQ_OK;
}

extern "C" kvq_status kvq_cuda_quantize_plan(kvq_cuda *c, int slot, const kvq_plan *plan, kvq_recon_acc *recon,
                                             int *bad, kvq_error *err)
{
    if (slot < 0 || slot >= c->nslots) return kvq_fail(err, KVQ_ERR_INTERNAL, "CUDA: slot %d of %d", slot, c->nslots);
    std::vector<launch> ls;
    kvq_status st = launch_plan(c, slot, plan, ls, err);
    if (st) return st;
    size_t total = ls.empty() ? 0 : ls.back().first + (size_t)ls.back().nblk * c->H;
    std::vector<kvq_rpart> host(total > 0 ? total : 1);
    int flag = FLAG_NONE;
    if (total)
        KVQ_CU(cudaMemcpyAsync(host.data(), c->part.p, total * sizeof(kvq_rpart), cudaMemcpyDeviceToHost, c->stream));
    KVQ_CU(cudaMemcpyAsync(&flag, c->flag.p, sizeof flag, cudaMemcpyDeviceToHost, c->stream));
    KVQ_CU(cudaStreamSynchronize(c->stream));
    if (flag != FLAG_NONE) {
        /* like the CPU helpers: the caller names the fp16 overflow */
        *bad = flag;
        if (err) err->status = KVQ_ERR_NUMERIC, err->msg[0] = '\0';
        return KVQ_ERR_NUMERIC;
    }
    for (const launch &l : ls)
        for (int h = 0; h < c->H; h++) {
            kvq_recon_acc *a = &recon[l.tensor * c->H + h];
            for (int b = 0; b < l.nblk; b++) {
                const kvq_rpart &p = host[l.first + (size_t)h * l.nblk + b];
                a->sum_x2 += p.x2, a->sum_e2 += p.e2, a->sum_abs_e += p.ae;
                if (p.mx > a->max_abs) a->max_abs = p.mx;
            }
            a->n += l.n;
        }
    return KVQ_OK;
}

extern "C" kvq_status kvq_cuda_time_plan(kvq_cuda *c, const kvq_plan *plan, int reps, double *seconds,
                                         kvq_error *err)
{
    if (c->nslots < 1) return kvq_fail(err, KVQ_ERR_INTERNAL, "CUDA: no slot to time a plan in");
    std::vector<launch> ls;
    cudaEvent_t e0, e1;
    KVQ_CU(cudaEventCreate(&e0));
    cudaError_t e = cudaEventCreate(&e1);
    if (e != cudaSuccess) {
        cudaEventDestroy(e0);
        return kvq_fail(err, KVQ_ERR_INTERNAL, "CUDA: cudaEventCreate: %s", cudaGetErrorString(e));
    }
    kvq_status st = launch_plan(c, 0, plan, ls, err); /* warm-up */
    if (!st) e = cudaEventRecord(e0, c->stream);
    for (int r = 0; r < reps && !st && e == cudaSuccess; r++) st = launch_plan(c, 0, plan, ls, err);
    float ms = 0;
    if (!st && e == cudaSuccess) e = cudaEventRecord(e1, c->stream);
    if (!st && e == cudaSuccess) e = cudaEventSynchronize(e1);
    if (!st && e == cudaSuccess) e = cudaEventElapsedTime(&ms, e0, e1);
    cudaEventDestroy(e0), cudaEventDestroy(e1);
    if (st) return st;
    if (e != cudaSuccess) return kvq_fail(err, KVQ_ERR_INTERNAL, "CUDA: plan timing: %s", cudaGetErrorString(e));
    *seconds = ms * 1e-3 / (reps > 0 ? reps : 1);
    return KVQ_OK;
}

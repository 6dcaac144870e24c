/* simd_avx512.c — the SIMD level probe (CPU support, capped by KVQ_SIMD or
 * kvq_simd_cap) and the AVX-512 versions of the hot loops: U per token
 * (groups of G contiguous channels), U per channel (blocks of tokens), the
 * reconstruction-error sums, exp, softmax and the attention rows' comparison.
 * Same arithmetic as the references in quant/uniform.c, metrics.c and
 * attention.c, in the same order per element (divide by s, clamp, round half
 * to even, q·s + z; no FMA in U), selected at run time when the CPU has
 * AVX-512F and F16C; tests/test_quant.c and test_metrics.c check them against
 * the references.  With simd_avx2.c and fp16.c, the only places with ISA
 * intrinsics. */
#include "../simd.h"

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>

#define AVX512 __attribute__((target("avx512f,avx512vl,avx512dq,f16c,avx2,avx")))

static int cpu_avx512 = -1, cpu_avx2 = -1; /* -1: not yet probed */
static int env_cap = -1;                    /* -1: KVQ_SIMD not yet read */
static int simd_cap = -1;                   /* set by kvq_simd_cap; -1: the environment's */

static int cap_level(void)
{
    int c = __atomic_load_n(&simd_cap, __ATOMIC_RELAXED);
    if (c >= 0) return c;
    c = __atomic_load_n(&env_cap, __ATOMIC_RELAXED);
    if (c < 0) {
        const char *e = getenv("KVQ_SIMD");
        c = !e                   ? KVQ_SIMD_AVX512
            : !strcmp(e, "none") ? KVQ_SIMD_NONE
            : !strcmp(e, "avx2") ? KVQ_SIMD_AVX2
                                 : KVQ_SIMD_AVX512;
        __atomic_store_n(&env_cap, c, __ATOMIC_RELAXED);
    }
    return c;
}

int kvq_simd_active(void)
{
    int cpu = __atomic_load_n(&cpu_avx512, __ATOMIC_RELAXED);
    if (cpu < 0) {
        __builtin_cpu_init();
        cpu = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
              __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("f16c");
        __atomic_store_n(&cpu_avx512, cpu, __ATOMIC_RELAXED);
    }
    return cpu && cap_level() >= KVQ_SIMD_AVX512;
}

int kvq_simd_avx2_active(void)
{
    int cpu = __atomic_load_n(&cpu_avx2, __ATOMIC_RELAXED);
    if (cpu < 0) {
        __builtin_cpu_init();
        cpu = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
        __atomic_store_n(&cpu_avx2, cpu, __ATOMIC_RELAXED);
    }
    return cpu && cap_level() >= KVQ_SIMD_AVX2;
}

void kvq_simd_cap(int level) { __atomic_store_n(&simd_cap, level, __ATOMIC_RELAXED); }

void kvq_simd_force(int on) { kvq_simd_cap(on ? -1 : KVQ_SIMD_NONE); }

/* Round to fp16 precision and back (F16C; round half to even like kvq_f32_to_f16). */
AVX512 static inline __m512 round_f16_512(__m512 v)
{
    return _mm512_cvtph_ps(_mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
AVX512 static inline float round_f16_1(float v)
{
    __m128 h = _mm_cvtph_ps(_mm_cvtps_ph(_mm_set_ss(v), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    return _mm_cvtss_f32(h);
}

/* Reconstruction sums kept in registers while a kernel quantizes, so the
 * error costs no second pass over x and x'; kvq_recon_avx512 uses them too. */
typedef struct {
    __m512d sx2, se2, sae;
    __m512 mx;
} racc;

AVX512 static inline void racc_init(racc *a)
{
    a->sx2 = a->se2 = a->sae = _mm512_setzero_pd();
    a->mx = _mm512_setzero_ps();
}

/* Adds the error e = x − x' (zero in lanes that do not count): max |e|, Σe², Σ|e|. */
AVX512 static inline void racc_add_error(racc *a, __m512 e)
{
    a->mx = _mm512_max_ps(a->mx, _mm512_abs_ps(e));
    __m512d elo = _mm512_cvtps_pd(_mm512_castps512_ps256(e));
    __m512d ehi = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(e), 1)));
    a->se2 = _mm512_add_pd(a->se2, _mm512_add_pd(_mm512_mul_pd(elo, elo), _mm512_mul_pd(ehi, ehi)));
    a->sae = _mm512_add_pd(a->sae, _mm512_add_pd(_mm512_abs_pd(elo), _mm512_abs_pd(ehi)));
}

/* Adds x (zero in lanes that do not count) to Σx². */
AVX512 static inline void racc_add_x(racc *a, __m512 xv)
{
    __m512d xlo = _mm512_cvtps_pd(_mm512_castps512_ps256(xv));
    __m512d xhi = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(xv), 1)));
    a->sx2 = _mm512_add_pd(a->sx2, _mm512_add_pd(_mm512_mul_pd(xlo, xlo), _mm512_mul_pd(xhi, xhi)));
}

/* Adds x and its error e = x − x' (both zero in lanes that do not count). */
AVX512 static inline void racc_add(racc *a, __m512 xv, __m512 e)
{
    racc_add_error(a, e);
    racc_add_x(a, xv);
}

AVX512 static inline void racc_flush(const racc *a, kvq_recon_acc *acc, size_t n)
{
    acc->sum_x2 += _mm512_reduce_add_pd(a->sx2);
    acc->sum_e2 += _mm512_reduce_add_pd(a->se2);
    acc->sum_abs_e += _mm512_reduce_add_pd(a->sae);
    float m = _mm512_reduce_max_ps(a->mx);
    if ((double)m > acc->max_abs) acc->max_abs = m;
    acc->n += (double)n;
}

/* Whether the U kernels stream an output of n floats at y: only a large one
 * (a layer's), which leaves the cache before it is read anyway.  A head's
 * (4 MB at 8k tokens) is read back at once by the metrics that follow it in
 * kvq-analyze's head loop; streamed, it came back from memory (12
 * per-token specs on four 8k layers: 4.91-5.00 s streamed, 4.78-4.82 s not). */
static size_t stream_min_bytes = KVQ_STREAM_MIN_BYTES;
void kvq_simd_stream_min(size_t bytes) { __atomic_store_n(&stream_min_bytes, bytes, __ATOMIC_RELAXED); }
static inline int stream_output(const float *y, size_t n)
{
    return (uintptr_t)y % 64 == 0 && n * sizeof(float) >= __atomic_load_n(&stream_min_bytes, __ATOMIC_RELAXED);
}

/* Full-vector store, non-temporal when `stream` (y 64-byte aligned): the
 * output is not read again soon, and skipping the read-for-ownership of its
 * cache lines saves a third of the memory traffic. */
AVX512 static inline void store16(float *y, __m512 v, int stream)
{
    if (stream) _mm512_stream_ps(y, v);
    else _mm512_storeu_ps(y, v);
}

/* q·s + z for one vector: v = (x − z)/s, clamp to [0, hi], round half to even. */
AVX512 static inline __m512 uq(__m512 x, __m512 s, __m512 z, __m512 hi)
{
    __m512 v = _mm512_div_ps(_mm512_sub_ps(x, z), s);
    v = _mm512_min_ps(_mm512_max_ps(v, _mm512_setzero_ps()), hi);
    v = _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    return _mm512_add_ps(_mm512_mul_ps(v, s), z);
}

/* Horizontal min (is_max = 0) or max of 16 vectors at once: lane perm16[g]
 * of the result reduces v[g].  Four butterfly levels (15 + 15 shuffles, 15
 * min/max) instead of 16 separate reductions. */
AVX512 static inline __m512 red16(const __m512 *v, int is_max)
{
#define OP(a, b) (is_max ? _mm512_max_ps(a, b) : _mm512_min_ps(a, b))
    __m512 w[8], x[4], y[2];
    for (int k = 0; k < 8; k++)
        w[k] =
            OP(_mm512_shuffle_f32x4(v[2 * k], v[2 * k + 1], 0x44), _mm512_shuffle_f32x4(v[2 * k], v[2 * k + 1], 0xEE));
    for (int k = 0; k < 4; k++)
        x[k] =
            OP(_mm512_shuffle_f32x4(w[2 * k], w[2 * k + 1], 0x88), _mm512_shuffle_f32x4(w[2 * k], w[2 * k + 1], 0xDD));
    for (int k = 0; k < 2; k++)
        y[k] = OP(_mm512_shuffle_ps(x[2 * k], x[2 * k + 1], 0x44), _mm512_shuffle_ps(x[2 * k], x[2 * k + 1], 0xEE));
    return OP(_mm512_shuffle_ps(y[0], y[1], 0x88), _mm512_shuffle_ps(y[0], y[1], 0xDD));
#undef OP
}

/* Which lane of red16's result holds group g: found once by reducing
 * constant vectors (v[g] = g). */
static int perm16[16], perm16_ready;

AVX512 static void perm16_init(void)
{
    __m512 v[16];
    float out[16];
    for (int g = 0; g < 16; g++) v[g] = _mm512_set1_ps((float)g);
    _mm512_storeu_ps(out, red16(v, 0));
    for (int lane = 0; lane < 16; lane++) perm16[(int)out[lane]] = lane;
    __atomic_store_n(&perm16_ready, 1, __ATOMIC_RELEASE);
}

/* U on ngroups contiguous full groups of G values (G a multiple of 16), 16
 * groups at a time: their min/max reduced together (red16), their scales
 * and zeros computed in one vector.  Same values as the per-group loop; a
 * constant group is written as 0·1 + z (clamp to [0, 0], s = 1). */
AVX512 static kvq_status u_groups16(const float *x, float *y, size_t ngroups, size_t G, int bits, int fp16,
                                    int stream, racc *a, int fuse)
{
    if (!__atomic_load_n(&perm16_ready, __ATOMIC_ACQUIRE)) perm16_init();
    const __m512 vl = _mm512_set1_ps((float)((1u << bits) - 1u));
    for (size_t k0 = 0; k0 + 16 <= ngroups; k0 += 16) {
        const float *xb = x + k0 * G;
        float *yb = y + k0 * G;
        __m512 vmn[16], vmx[16];
        for (int g = 0; g < 16; g++) {
            const float *p = xb + g * G;
            vmn[g] = vmx[g] = _mm512_loadu_ps(p);
            for (size_t i = 16; i < G; i += 16) {
                __m512 v = _mm512_loadu_ps(p + i);
                vmn[g] = _mm512_min_ps(vmn[g], v);
                vmx[g] = _mm512_max_ps(vmx[g], v);
            }
        }
        __m512 mn = red16(vmn, 0), mx = red16(vmx, 1);
        __m512 vs = _mm512_div_ps(_mm512_sub_ps(mx, mn), vl), vz = mn;
        if (fp16) vs = round_f16_512(vs), vz = round_f16_512(vz);
        __mmask16 bad = _mm512_cmp_ps_mask(_mm512_sub_ps(vs, vs), _mm512_setzero_ps(), _CMP_NEQ_UQ) |
                        _mm512_cmp_ps_mask(_mm512_sub_ps(vz, vz), _mm512_setzero_ps(), _CMP_NEQ_UQ);
        if (bad) return KVQ_ERR_NUMERIC;
        __mmask16 zero = _mm512_cmp_ps_mask(vs, _mm512_setzero_ps(), _CMP_EQ_OQ);
        __m512 vh = _mm512_mask_blend_ps(zero, vl, _mm512_setzero_ps());
        vs = _mm512_mask_blend_ps(zero, vs, _mm512_set1_ps(1.0f));
        float sa[16], za[16], ha[16];
        _mm512_storeu_ps(sa, vs), _mm512_storeu_ps(za, vz), _mm512_storeu_ps(ha, vh);
        for (int g = 0; g < 16; g++) {
            int lane = perm16[g];
            __m512 s = _mm512_set1_ps(sa[lane]), z = _mm512_set1_ps(za[lane]), h = _mm512_set1_ps(ha[lane]);
            const float *p = xb + g * G;
            float *o = yb + g * G;
            for (size_t i = 0; i < G; i += 16) {
                __m512 xv = _mm512_loadu_ps(p + i), yv = uq(xv, s, z, h);
                store16(o + i, yv, stream);
                if (fuse) racc_add(a, xv, _mm512_sub_ps(xv, yv));
            }
        }
    }
    return KVQ_OK;
}

/* U on one group of n contiguous values (masked tail), error into a. */
AVX512 static inline kvq_status u_group1(const float *g, float *o, size_t n, float L, int fp16, int stream,
                                         racc *a, int fuse)
{
    /* min and max of the group (masked tail) */
    __m512 vmn = _mm512_set1_ps(INFINITY), vmx = _mm512_set1_ps(-INFINITY);
    size_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m512 v = _mm512_loadu_ps(g + i);
        vmn = _mm512_min_ps(vmn, v);
        vmx = _mm512_max_ps(vmx, v);
    }
    __mmask16 tail = (__mmask16)((1u << (n - i)) - 1u);
    if (tail) {
        __m512 v = _mm512_maskz_loadu_ps(tail, g + i);
        vmn = _mm512_mask_min_ps(vmn, tail, vmn, v);
        vmx = _mm512_mask_max_ps(vmx, tail, vmx, v);
    }
    float mn = _mm512_reduce_min_ps(vmn), mx = _mm512_reduce_max_ps(vmx);
    float s = (mx - mn) / L, z = mn;
    if (fp16) s = round_f16_1(s), z = round_f16_1(z);
    if (!isfinite(s) || !isfinite(z)) return KVQ_ERR_NUMERIC;
    __m512 vz = _mm512_set1_ps(z), vs = _mm512_set1_ps(s), vl = _mm512_set1_ps(L);
    /* x' = uq(x), or z for a constant group (s = 0) */
    for (i = 0; i + 16 <= n; i += 16) {
        __m512 xv = _mm512_loadu_ps(g + i), yv = s == 0.0f ? vz : uq(xv, vs, vz, vl);
        store16(o + i, yv, stream);
        if (fuse) racc_add(a, xv, _mm512_sub_ps(xv, yv));
    }
    if (tail) {
        __m512 xv = _mm512_maskz_loadu_ps(tail, g + i), yv = s == 0.0f ? vz : uq(xv, vs, vz, vl);
        _mm512_mask_storeu_ps(o + i, tail, yv);
        if (fuse) racc_add(a, xv, _mm512_maskz_sub_ps(tail, xv, yv));
    }
    return KVQ_OK;
}

AVX512 kvq_status kvq_u_rows_avx512(const float *x, float *y, size_t nrows, size_t D, size_t G,
                                    int bits, int fp16, kvq_recon_acc *recon)
{
    const float L = (float)((1u << bits) - 1u);
    /* every group starts on a cache line and is whole vectors: stream */
    const int stream = stream_output(y, nrows * D) && D % 16 == 0 && G % 16 == 0;
    const int fuse = recon != NULL;
    kvq_status st = KVQ_OK;
    racc a;
    racc_init(&a);
    if (G % 16 == 0 && D % G == 0) {
        /* whole groups, contiguous across rows: 16 at a time, then the rest */
        size_t ngroups = nrows * (D / G), batched = ngroups / 16 * 16;
        st = u_groups16(x, y, batched, G, bits, fp16, stream, &a, fuse);
        for (size_t k = batched; k < ngroups && !st; k++)
            st = u_group1(x + k * G, y + k * G, G, L, fp16, stream, &a, fuse);
    } else {
        for (size_t r = 0; r < nrows && !st; r++)
            for (size_t c0 = 0; c0 < D && !st; c0 += G)
                st = u_group1(x + r * D + c0, y + r * D + c0, D - c0 < G ? D - c0 : G, L, fp16, stream, &a, fuse);
    }
    if (stream) _mm_sfence(); /* order the streamed lines before anyone reads them */
    if (st) return st;
    if (recon) racc_flush(&a, recon, nrows * D);
    return KVQ_OK;
}

AVX512 kvq_status kvq_u_channels_avx512(const float *x, float *y, size_t n, size_t D, int bits,
                                        int fp16, kvq_recon_acc *recon)
{
    const float L = (float)((1u << bits) - 1u);
    const int stream = stream_output(y, n * D) && D % 16 == 0; /* every row on a cache line */
    racc a;
    racc_init(&a);
    for (size_t c0 = 0; c0 < D; c0 += 16) {
        __mmask16 m = D - c0 >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (D - c0)) - 1u);
        const float *xb = x + c0;
        float *yb = y + c0;
        /* two independent min/max chains (even and odd rows) halve the latency */
        __m512 vmn = _mm512_maskz_loadu_ps(m, xb), vmx = vmn, wmn = vmn, wmx = vmn;
        size_t t = 1;
        for (; t + 1 < n; t += 2) {
            __m512 v = _mm512_maskz_loadu_ps(m, xb + t * D), w = _mm512_maskz_loadu_ps(m, xb + (t + 1) * D);
            vmn = _mm512_min_ps(vmn, v), vmx = _mm512_max_ps(vmx, v);
            wmn = _mm512_min_ps(wmn, w), wmx = _mm512_max_ps(wmx, w);
        }
        if (t < n) {
            __m512 v = _mm512_maskz_loadu_ps(m, xb + t * D);
            vmn = _mm512_min_ps(vmn, v), vmx = _mm512_max_ps(vmx, v);
        }
        vmn = _mm512_min_ps(vmn, wmn), vmx = _mm512_max_ps(vmx, wmx);
        __m512 vs = _mm512_div_ps(_mm512_sub_ps(vmx, vmn), _mm512_set1_ps(L)), vz = vmn;
        if (fp16) vs = round_f16_512(vs), vz = round_f16_512(vz);
        /* any lane not finite (inf or nan): x − x is not 0 */
        __mmask16 bad = _mm512_cmp_ps_mask(_mm512_sub_ps(vs, vs), _mm512_setzero_ps(), _CMP_NEQ_UQ) |
                        _mm512_cmp_ps_mask(_mm512_sub_ps(vz, vz), _mm512_setzero_ps(), _CMP_NEQ_UQ);
        if (bad & m) return KVQ_ERR_NUMERIC;
        /* constant channels: s = 1 and clamp to [0, 0] give x' = z */
        __mmask16 zero = _mm512_cmp_ps_mask(vs, _mm512_setzero_ps(), _CMP_EQ_OQ);
        __m512 hi = _mm512_mask_blend_ps(zero, _mm512_set1_ps(L), _mm512_setzero_ps());
        vs = _mm512_mask_blend_ps(zero, vs, _mm512_set1_ps(1.0f));
        for (t = 0; t < n; t++) {
            __m512 xv = _mm512_maskz_loadu_ps(m, xb + t * D), yv = uq(xv, vs, vz, hi);
            if (m == 0xffff) store16(yb + t * D, yv, stream);
            else _mm512_mask_storeu_ps(yb + t * D, m, yv);
            if (recon) racc_add(&a, xv, _mm512_maskz_sub_ps(m, xv, yv));
        }
    }
    if (stream) _mm_sfence();
    if (recon) racc_flush(&a, recon, n * D);
    return KVQ_OK;
}

/* How far ahead (floats) the reconstruction sums fetch their inputs: they
 * read x and up to four outputs at once, a head's 4 MB each from memory,
 * more streams than the hardware prefetchers follow across pages (on the
 * Zen 5 recon_group's share of B's cycles 3.0 -> 1.1 % with the fetches). */
#define RECON_AHEAD 256

AVX512 void kvq_recon_avx512(kvq_recon_acc *acc, const float *x, const float *y, size_t n)
{
    racc a;
    racc_init(&a);
    for (size_t i = 0; i < n; i += 16) {
        if (i + RECON_AHEAD < n) {
            _mm_prefetch((const char *)(x + i + RECON_AHEAD), _MM_HINT_T0);
            _mm_prefetch((const char *)(y + i + RECON_AHEAD), _MM_HINT_T0);
        }
        __mmask16 m = n - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - i)) - 1u);
        __m512 xv = _mm512_maskz_loadu_ps(m, x + i), yv = _mm512_maskz_loadu_ps(m, y + i);
        racc_add(&a, xv, _mm512_sub_ps(xv, yv)); /* masked lanes: 0 − 0 */
    }
    racc_flush(&a, acc, n);
}

/* kvq_recon_avx512 of x against y[0..g) into acc[0..g), x read once: each
 * output's sums in the order of its own call (Σx², the same for all g,
 * kept once: its additions are those of each call).  g a constant 2..4,
 * so that the accumulators stay in registers. */
AVX512 static inline void recon_group(kvq_recon_acc *const *acc, const float *x, const float *const *y, size_t n,
                                      const int g)
{
    racc a[4];
    for (int j = 0; j < g; j++) racc_init(&a[j]);
    for (size_t i = 0; i < n; i += 16) {
        __mmask16 m = n - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - i)) - 1u);
        if (i + RECON_AHEAD < n) {
            _mm_prefetch((const char *)(x + i + RECON_AHEAD), _MM_HINT_T0);
            for (int j = 0; j < g; j++) _mm_prefetch((const char *)(y[j] + i + RECON_AHEAD), _MM_HINT_T0);
        }
        __m512 xv = _mm512_maskz_loadu_ps(m, x + i);
        racc_add_x(&a[0], xv);
        for (int j = 0; j < g; j++) racc_add_error(&a[j], _mm512_sub_ps(xv, _mm512_maskz_loadu_ps(m, y[j] + i)));
    }
    for (int j = 0; j < g; j++) {
        a[j].sx2 = a[0].sx2;
        racc_flush(&a[j], acc[j], n);
    }
}

AVX512 void kvq_recon_many_avx512(kvq_recon_acc *const *acc, const float *x, const float *const *y, int m, size_t n)
{
    for (int i = 0; i < m;) {
        int g = m - i >= 4 ? 4 : m - i;
        if (g == 4)
            recon_group(acc + i, x, y + i, n, 4);
        else if (g == 3)
            recon_group(acc + i, x, y + i, n, 3);
        else if (g == 2)
            recon_group(acc + i, x, y + i, n, 2);
        else
            kvq_recon_avx512(acc[i], x, y[i], n);
        i += g;
    }
}

/* ----------------------------------------------------- softmax rows */

/* exp(x) for x <= 0 (Cephes expf: Cody–Waite reduction by ln 2, degree-6
 * polynomial, 2^n by scalef); within 2 ulp of expf, denormals included. */
AVX512 static inline __m512 exp512(__m512 x)
{
    x = _mm512_max_ps(x, _mm512_set1_ps(-104.0f)); /* below: 0 after scaling */
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 y = _mm512_set1_ps(1.9875691500e-4f);
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.3981999507e-3f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(8.3334519073e-3f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(4.1665795894e-2f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.6666665459e-1f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(5.0000001201e-1f));
    y = _mm512_fmadd_ps(y, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(y, n);
}

AVX512 void kvq_exp_avx512(const float *x, float *y, size_t n)
{
    for (size_t i = 0; i < n; i += 16) {
        __mmask16 m = n - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - i)) - 1u);
        _mm512_mask_storeu_ps(y + i, m, exp512(_mm512_maskz_loadu_ps(m, x + i)));
    }
}

static inline __mmask16 lanes(size_t n, size_t i)
{
    return n - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - i)) - 1u);
}

/* Softmax pass 1: scales s[0..n) (divides, as the reference) unless
 * prescaled, and returns the max and its first index.  Each lane keeps its
 * own max and the first index holding it (replaced only by a greater
 * value); the answer is the lowest index among the lanes holding the max.
 * Masked-off lanes are -inf, never greater.  Whole vectors are stored
 * plainly, only a row's tail masked.  Unless pf is NULL, the row pf[0..n)
 * that a later pass reads is fetched into the cache meanwhile, a line a
 * vector. */
AVX512 static inline float scale_max512(float *s, size_t n, float scale, int prescaled, int *argmax, const float *pf)
{
    const __m512 ninf = _mm512_set1_ps(-INFINITY), vscale = _mm512_set1_ps(scale);
    const __m512i sixteen = _mm512_set1_epi32(16);
    __m512 vmax = ninf;
    __m512i idx = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), best = idx;
    for (size_t i = 0; i < n; i += 16, idx = _mm512_add_epi32(idx, sixteen)) {
        if (pf) _mm_prefetch((const char *)(pf + i), _MM_HINT_T0);
        __mmask16 k = lanes(n, i);
        __m512 v = _mm512_mask_loadu_ps(ninf, k, s + i);
        if (!prescaled) {
            v = _mm512_div_ps(v, vscale);
            if (k == 0xffff) _mm512_storeu_ps(s + i, v);
            else _mm512_mask_storeu_ps(s + i, k, v);
        }
        __mmask16 gt = _mm512_cmp_ps_mask(v, vmax, _CMP_GT_OQ);
        vmax = _mm512_mask_mov_ps(vmax, gt, v);
        best = _mm512_mask_mov_epi32(best, gt, idx);
    }
    float m = _mm512_reduce_max_ps(vmax);
    __mmask16 at = _mm512_cmp_ps_mask(vmax, _mm512_set1_ps(m), _CMP_EQ_OQ);
    *argmax = _mm512_reduce_min_epi32(_mm512_mask_mov_epi32(_mm512_set1_epi32(0x7fffffff), at, best));
    return m;
}

/* Softmax pass 2: a = exp(s − m) over [0, n), returns Σ a in double;
 * fetches pf[0..n) into the cache as scale_max512 does. */
AVX512 static inline double exp_sum512(const float *s, float *a, size_t n, float m, const float *pf)
{
    const __m512 vm = _mm512_set1_ps(m);
    __m512d sum = _mm512_setzero_pd();
    for (size_t i = 0; i < n; i += 16) {
        if (pf) _mm_prefetch((const char *)(pf + i), _MM_HINT_T0);
        __mmask16 k = lanes(n, i);
        __m512 e = _mm512_maskz_mov_ps(k, exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, s + i), vm)));
        if (k == 0xffff) _mm512_storeu_ps(a + i, e);
        else _mm512_mask_storeu_ps(a + i, k, e);
        sum = _mm512_add_pd(sum, _mm512_add_pd(_mm512_cvtps_pd(_mm512_castps512_ps256(e)),
                                               _mm512_cvtps_pd(_mm512_extractf32x8_ps(e, 1))));
    }
    return _mm512_reduce_add_pd(sum);
}

AVX512 void kvq_softmax_avx512(float *s, float *a, size_t n, size_t ncol, float scale, int prescaled,
                               float *m_out, double *sum_out, int *argmax_out)
{
    float m = scale_max512(s, n, scale, prescaled, argmax_out, NULL);
    double total = exp_sum512(s, a, n, m, NULL);
    __m512 vf = _mm512_set1_ps((float)total); /* a / Σ */
    for (size_t i = 0; i < n; i += 16) {
        __mmask16 k = lanes(n, i);
        _mm512_mask_storeu_ps(a + i, k, _mm512_div_ps(_mm512_maskz_loadu_ps(k, a + i), vf));
    }
    for (size_t u = n; u < ncol; u++) a[u] = 0.0f;
    *m_out = m, *sum_out = total;
}

/* The comparison sums of 8 elements (lanes that do not count load a = 0,
 * s = s' = 0: they add 0 and no KL term). */
AVX512 static inline void compare8(__m256 s8, __m256 a8, __m256 sq8, __m256 aq8, __m512d vm, __m512d vl,
                                   __m512d vmq, __m512d vlq, __m512d *vs, __m512d *va, __m512d *vk)
{
    __m512d x = _mm512_cvtps_pd(s8), xq = _mm512_cvtps_pd(sq8);
    __m512d y = _mm512_cvtps_pd(a8), yq = _mm512_cvtps_pd(aq8);
    __m512d ds = _mm512_sub_pd(x, xq), da = _mm512_sub_pd(y, yq);
    *vs = _mm512_add_pd(*vs, _mm512_mul_pd(ds, ds));
    *va = _mm512_add_pd(*va, _mm512_mul_pd(da, da));
    /* a·((s − m − lse) − (s' − m' − lse')) where a != 0, as the reference */
    __m512d la = _mm512_sub_pd(_mm512_sub_pd(x, vm), vl), lq = _mm512_sub_pd(_mm512_sub_pd(xq, vmq), vlq);
    __mmask8 nz = _mm512_cmp_pd_mask(y, _mm512_setzero_pd(), _CMP_NEQ_OQ);
    *vk = _mm512_mask_add_pd(*vk, nz, *vk, _mm512_mul_pd(y, _mm512_sub_pd(la, lq)));
}

/* Adds Σ (s − s')², Σ (a − a')² and KL(A‖A') of one row of n. */
AVX512 void kvq_row_compare_avx512(const float *s, const float *a, const float *sq, const float *aq, size_t n,
                                   double m, double lse, double mq, double lseq, double *sd2, double *ad2,
                                   double *kl)
{
    __m512d vs = _mm512_setzero_pd(), va = vs, vk = vs;
    const __m512d vm = _mm512_set1_pd(m), vl = _mm512_set1_pd(lse), vmq = _mm512_set1_pd(mq),
                  vlq = _mm512_set1_pd(lseq);
    for (size_t i = 0; i < n; i += 8) {
        __mmask8 k = n - i >= 8 ? (__mmask8)0xff : (__mmask8)((1u << (n - i)) - 1u);
        compare8(_mm256_maskz_loadu_ps(k, s + i), _mm256_maskz_loadu_ps(k, a + i), _mm256_maskz_loadu_ps(k, sq + i),
                 _mm256_maskz_loadu_ps(k, aq + i), vm, vl, vmq, vlq, &vs, &va, &vk);
    }
    *sd2 += _mm512_reduce_add_pd(vs);
    *ad2 += _mm512_reduce_add_pd(va);
    *kl += _mm512_reduce_add_pd(vk);
}

/* kvq_softmax_avx512 of the row sq into aq, then kvq_row_compare_avx512 of
 * (s, a) against it, its last pass (a' = e / Σ) and the comparison fused:
 * the same values and sums in the same order (each 16 as two 8s), one pass
 * fewer over the row.  The exact rows s and a, which come from memory (each
 * quantizer reads all of a head's again), are fetched during the first two
 * passes: on the Zen 5 the comparison otherwise waits on four streams at
 * once (1.6 against 0.8 ns an element on 256 rows of 8192). */
AVX512 void kvq_softmax_compare_avx512(const float *s, const float *a, float *sq, float *aq, size_t n, size_t ncol,
                                       float scale, int prescaled, double m, double lse, float *mq_out,
                                       double *sumq_out, int *argmaxq_out, double *sd2, double *ad2, double *kl)
{
    float mq = scale_max512(sq, n, scale, prescaled, argmaxq_out, s);
    double total = exp_sum512(sq, aq, n, mq, a);
    const __m512 vf = _mm512_set1_ps((float)total);
    const __m512d vm = _mm512_set1_pd(m), vl = _mm512_set1_pd(lse), vmq = _mm512_set1_pd(mq),
                  vlq = _mm512_set1_pd(log(total));
    __m512d vs = _mm512_setzero_pd(), va = vs, vk = vs;
    for (size_t i = 0; i < n; i += 16) {
        __mmask16 k = lanes(n, i);
        __m512 y = _mm512_maskz_div_ps(k, _mm512_maskz_loadu_ps(k, aq + i), vf);
        if (k == 0xffff) _mm512_storeu_ps(aq + i, y);
        else _mm512_mask_storeu_ps(aq + i, k, y);
        __m512 x = _mm512_maskz_loadu_ps(k, s + i), xa = _mm512_maskz_loadu_ps(k, a + i);
        __m512 xq = _mm512_maskz_loadu_ps(k, sq + i);
        compare8(_mm512_castps512_ps256(x), _mm512_castps512_ps256(xa), _mm512_castps512_ps256(xq),
                 _mm512_castps512_ps256(y), vm, vl, vmq, vlq, &vs, &va, &vk);
        if (n - i > 8)
            compare8(_mm512_extractf32x8_ps(x, 1), _mm512_extractf32x8_ps(xa, 1), _mm512_extractf32x8_ps(xq, 1),
                     _mm512_extractf32x8_ps(y, 1), vm, vl, vmq, vlq, &vs, &va, &vk);
    }
    for (size_t u = n; u < ncol; u++) aq[u] = 0.0f;
    *sd2 += _mm512_reduce_add_pd(vs);
    *ad2 += _mm512_reduce_add_pd(va);
    *kl += _mm512_reduce_add_pd(vk);
    *mq_out = mq, *sumq_out = total;
}

#else /* not x86-64 GCC/Clang: the portable paths only */

int kvq_simd_active(void) { return 0; }
int kvq_simd_avx2_active(void) { return 0; }
void kvq_simd_cap(int level) { (void)level; }
void kvq_simd_force(int on) { (void)on; }
void kvq_simd_stream_min(size_t bytes) { (void)bytes; }
kvq_status kvq_u_rows_avx512(const float *x, float *y, size_t nrows, size_t D, size_t G, int bits, int fp16,
                             kvq_recon_acc *recon)
{ (void)x, (void)y, (void)nrows, (void)D, (void)G, (void)bits, (void)fp16, (void)recon; return KVQ_ERR_UNSUPPORTED; }
kvq_status kvq_u_channels_avx512(const float *x, float *y, size_t n, size_t D, int bits, int fp16,
                                 kvq_recon_acc *recon)
{ (void)x, (void)y, (void)n, (void)D, (void)bits, (void)fp16, (void)recon; return KVQ_ERR_UNSUPPORTED; }
void kvq_recon_avx512(kvq_recon_acc *acc, const float *x, const float *y, size_t n)
{ (void)acc, (void)x, (void)y, (void)n; }
void kvq_recon_many_avx512(kvq_recon_acc *const *acc, const float *x, const float *const *y, int m, size_t n)
{
    (void)acc, (void)x, (void)y, (void)m, (void)n;
}
void kvq_exp_avx512(const float *x, float *y, size_t n) { (void)x, (void)y, (void)n; }
void kvq_softmax_avx512(float *s, float *a, size_t n, size_t ncol, float scale, int prescaled, float *m_out,
                        double *sum_out, int *argmax_out)
{ (void)s, (void)a, (void)n, (void)ncol, (void)scale, (void)prescaled, (void)m_out, (void)sum_out, (void)argmax_out; }
void kvq_row_compare_avx512(const float *s, const float *a, const float *sq, const float *aq, size_t n, double m,
                            double lse, double mq, double lseq, double *sd2, double *ad2, double *kl)
{
    (void)s, (void)a, (void)sq, (void)aq, (void)n, (void)m, (void)lse, (void)mq, (void)lseq, (void)sd2, (void)ad2,
        (void)kl;
}
void kvq_softmax_compare_avx512(const float *s, const float *a, float *sq, float *aq, size_t n, size_t ncol,
                                float scale, int prescaled, double m, double lse, float *mq_out, double *sumq_out,
                                int *argmaxq_out, double *sd2, double *ad2, double *kl)
{ (void)s, (void)a, (void)sq, (void)aq, (void)n, (void)ncol, (void)scale, (void)prescaled, (void)m, (void)lse,
  (void)mq_out, (void)sumq_out, (void)argmaxq_out, (void)sd2, (void)ad2, (void)kl; }

#endif

/* simd_avx512.c — AVX-512 versions of the hot loops: U per token (groups of
 * G contiguous channels), U per channel (blocks of tokens), and the
 * reconstruction-error sums.  Same arithmetic as the references in
 * quant/uniform.c and metrics.c, in the same order per element (divide by s,
 * clamp, round half to even, q·s + z; no FMA in U), selected at run time
 * when the CPU has AVX-512F and F16C; tests/test_simd.c checks them against
 * the references.  The only place with ISA intrinsics besides fp16.c. */
#include "simd.h"

#include <math.h>
#include <stdint.h>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>

#define AVX512 __attribute__((target("avx512f,avx512vl,avx512dq,f16c,avx2,avx")))

static int simd_enabled = -1; /* -1: not yet probed */

int kvq_simd_active(void)
{
    if (simd_enabled < 0) {
        __builtin_cpu_init();
        simd_enabled = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
                       __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("f16c");
    }
    return simd_enabled;
}

void kvq_simd_force(int on)
{
    simd_enabled = -1;
    if (on && kvq_simd_active()) return;
    simd_enabled = 0;
}

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
 * error costs no second pass over x and x' (same sums as kvq_recon_avx512). */
typedef struct {
    __m512d sx2, se2, sae;
    __m512 mx;
} racc;

AVX512 static inline void racc_init(racc *a)
{
    a->sx2 = a->se2 = a->sae = _mm512_setzero_pd();
    a->mx = _mm512_setzero_ps();
}

/* Adds x and its error e = x − x' (both zero in lanes that do not count). */
AVX512 static inline void racc_add(racc *a, __m512 xv, __m512 e)
{
    a->mx = _mm512_max_ps(a->mx, _mm512_abs_ps(e));
    __m512d elo = _mm512_cvtps_pd(_mm512_castps512_ps256(e));
    __m512d ehi = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(e), 1)));
    __m512d xlo = _mm512_cvtps_pd(_mm512_castps512_ps256(xv));
    __m512d xhi = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(xv), 1)));
    a->se2 = _mm512_add_pd(a->se2, _mm512_add_pd(_mm512_mul_pd(elo, elo), _mm512_mul_pd(ehi, ehi)));
    a->sx2 = _mm512_add_pd(a->sx2, _mm512_add_pd(_mm512_mul_pd(xlo, xlo), _mm512_mul_pd(xhi, xhi)));
    a->sae = _mm512_add_pd(a->sae, _mm512_add_pd(_mm512_abs_pd(elo), _mm512_abs_pd(ehi)));
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

AVX512 kvq_status kvq_u_rows_avx512(const float *x, float *y, size_t nrows, size_t D, size_t G,
                                    int bits, int fp16, kvq_recon_acc *recon)
{
    const float L = (float)((1u << bits) - 1u);
    /* every group starts on a cache line and is whole vectors: stream */
    const int stream = (uintptr_t)y % 64 == 0 && D % 16 == 0 && G % 16 == 0;
    racc a;
    racc_init(&a);
    for (size_t r = 0; r < nrows; r++) {
        const float *xr = x + r * D;
        float *yr = y + r * D;
        for (size_t c0 = 0; c0 < D; c0 += G) {
            size_t n = D - c0 < G ? D - c0 : G;
            const float *g = xr + c0;
            float *o = yr + c0;
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
                if (recon) racc_add(&a, xv, _mm512_sub_ps(xv, yv));
            }
            if (tail) {
                __m512 xv = _mm512_maskz_loadu_ps(tail, g + i), yv = s == 0.0f ? vz : uq(xv, vs, vz, vl);
                _mm512_mask_storeu_ps(o + i, tail, yv);
                if (recon) racc_add(&a, xv, _mm512_maskz_sub_ps(tail, xv, yv));
            }
        }
    }
    if (stream) _mm_sfence(); /* order the streamed lines before anyone reads them */
    if (recon) racc_flush(&a, recon, nrows * D);
    return KVQ_OK;
}

AVX512 kvq_status kvq_u_channels_avx512(const float *x, float *y, size_t n, size_t D, int bits,
                                        int fp16, kvq_recon_acc *recon)
{
    const float L = (float)((1u << bits) - 1u);
    const int stream = (uintptr_t)y % 64 == 0 && D % 16 == 0; /* every row on a cache line */
    racc a;
    racc_init(&a);
    for (size_t c0 = 0; c0 < D; c0 += 16) {
        __mmask16 m = D - c0 >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (D - c0)) - 1u);
        const float *xb = x + c0;
        float *yb = y + c0;
        __m512 vmn = _mm512_maskz_loadu_ps(m, xb), vmx = vmn;
        for (size_t t = 1; t < n; t++) {
            __m512 v = _mm512_maskz_loadu_ps(m, xb + t * D);
            vmn = _mm512_min_ps(vmn, v);
            vmx = _mm512_max_ps(vmx, v);
        }
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
        for (size_t t = 0; t < n; t++) {
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

AVX512 void kvq_recon_avx512(kvq_recon_acc *acc, const float *x, const float *y, size_t n)
{
    __m512d sx2 = _mm512_setzero_pd(), se2 = sx2, sae = sx2;
    __m512 mx = _mm512_setzero_ps();
    size_t i = 0;
    for (; i < n; i += 16) {
        __mmask16 m = n - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - i)) - 1u);
        __m512 xv = _mm512_maskz_loadu_ps(m, x + i), yv = _mm512_maskz_loadu_ps(m, y + i);
        __m512 e = _mm512_sub_ps(xv, yv);
        __m512 ae = _mm512_abs_ps(e);
        mx = _mm512_max_ps(mx, ae);
        __m512d elo = _mm512_cvtps_pd(_mm512_castps512_ps256(e));
        __m512d ehi = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(e), 1)));
        __m512d xlo = _mm512_cvtps_pd(_mm512_castps512_ps256(xv));
        __m512d xhi = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(xv), 1)));
        se2 = _mm512_add_pd(se2, _mm512_add_pd(_mm512_mul_pd(elo, elo), _mm512_mul_pd(ehi, ehi)));
        sx2 = _mm512_add_pd(sx2, _mm512_add_pd(_mm512_mul_pd(xlo, xlo), _mm512_mul_pd(xhi, xhi)));
        sae = _mm512_add_pd(sae, _mm512_add_pd(_mm512_abs_pd(elo), _mm512_abs_pd(ehi)));
    }
    acc->sum_x2 += _mm512_reduce_add_pd(sx2);
    acc->sum_e2 += _mm512_reduce_add_pd(se2);
    acc->sum_abs_e += _mm512_reduce_add_pd(sae);
    float m = _mm512_reduce_max_ps(mx);
    if ((double)m > acc->max_abs) acc->max_abs = m;
    acc->n += (double)n;
}

#else /* not x86-64 GCC/Clang: the portable paths only */

int kvq_simd_active(void) { return 0; }
void kvq_simd_force(int on) { (void)on; }
kvq_status kvq_u_rows_avx512(const float *x, float *y, size_t nrows, size_t D, size_t G, int bits, int fp16,
                             kvq_recon_acc *recon)
{ (void)x, (void)y, (void)nrows, (void)D, (void)G, (void)bits, (void)fp16, (void)recon; return KVQ_ERR_UNSUPPORTED; }
kvq_status kvq_u_channels_avx512(const float *x, float *y, size_t n, size_t D, int bits, int fp16,
                                 kvq_recon_acc *recon)
{ (void)x, (void)y, (void)n, (void)D, (void)bits, (void)fp16, (void)recon; return KVQ_ERR_UNSUPPORTED; }
void kvq_recon_avx512(kvq_recon_acc *acc, const float *x, const float *y, size_t n)
{ (void)acc, (void)x, (void)y, (void)n; }

#endif

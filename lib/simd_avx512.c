/* simd_avx512.c — AVX-512 versions of the hot loops: U per token (groups of
 * G contiguous channels), U per channel (blocks of tokens), and the
 * reconstruction-error sums.  Same arithmetic as the references in
 * quant/uniform.c and metrics.c, in the same order per element (divide by s,
 * clamp, round half to even, q·s + z; no FMA in U), selected at run time
 * when the CPU has AVX-512F and F16C; tests/test_simd.c checks them against
 * the references.  The only place with ISA intrinsics besides fp16.c. */
#include "simd.h"

#include <math.h>

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

/* q·s + z for one vector: v = (x − z)/s, clamp to [0, hi], round half to even. */
AVX512 static inline __m512 uq(__m512 x, __m512 s, __m512 z, __m512 hi)
{
    __m512 v = _mm512_div_ps(_mm512_sub_ps(x, z), s);
    v = _mm512_min_ps(_mm512_max_ps(v, _mm512_setzero_ps()), hi);
    v = _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    return _mm512_add_ps(_mm512_mul_ps(v, s), z);
}

AVX512 kvq_status kvq_u_rows_avx512(const float *x, float *y, size_t nrows, size_t D, size_t G,
                                    int bits, int fp16)
{
    const float L = (float)((1u << bits) - 1u);
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
            __m512 vz = _mm512_set1_ps(z);
            if (s == 0.0f) { /* constant group: x' = z */
                for (i = 0; i + 16 <= n; i += 16) _mm512_storeu_ps(o + i, vz);
                if (tail) _mm512_mask_storeu_ps(o + i, tail, vz);
                continue;
            }
            __m512 vs = _mm512_set1_ps(s), vl = _mm512_set1_ps(L);
            for (i = 0; i + 16 <= n; i += 16) _mm512_storeu_ps(o + i, uq(_mm512_loadu_ps(g + i), vs, vz, vl));
            if (tail) _mm512_mask_storeu_ps(o + i, tail, uq(_mm512_maskz_loadu_ps(tail, g + i), vs, vz, vl));
        }
    }
    return KVQ_OK;
}

AVX512 kvq_status kvq_u_channels_avx512(const float *x, float *y, size_t n, size_t D, int bits,
                                        int fp16)
{
    const float L = (float)((1u << bits) - 1u);
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
        for (size_t t = 0; t < n; t++)
            _mm512_mask_storeu_ps(yb + t * D, m, uq(_mm512_maskz_loadu_ps(m, xb + t * D), vs, vz, hi));
    }
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
kvq_status kvq_u_rows_avx512(const float *x, float *y, size_t nrows, size_t D, size_t G, int bits, int fp16)
{ (void)x, (void)y, (void)nrows, (void)D, (void)G, (void)bits, (void)fp16; return KVQ_ERR_UNSUPPORTED; }
kvq_status kvq_u_channels_avx512(const float *x, float *y, size_t n, size_t D, int bits, int fp16)
{ (void)x, (void)y, (void)n, (void)D, (void)bits, (void)fp16; return KVQ_ERR_UNSUPPORTED; }
void kvq_recon_avx512(kvq_recon_acc *acc, const float *x, const float *y, size_t n)
{ (void)acc, (void)x, (void)y, (void)n; }

#endif

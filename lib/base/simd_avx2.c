/* simd_avx2.c — AVX2 + FMA versions of the attention metrics' row loops
 * (exp, softmax, one row's comparison sums) and of U per token, for CPUs
 * without AVX-512: the same arithmetic as simd_avx512.c (Cephes exp with the
 * same constants and FMAs, so the same values; division as the reference;
 * no FMA in U), 8 lanes instead of 16.  Selected at run time
 * (kvq_simd_avx2_active); tests/test_metrics.c checks the rows against expf
 * and the plain C reference, tests/test_quant.c U against the reference. */
#include "../simd.h"

#include <math.h>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>

#define AVX2 __attribute__((target("avx2,fma")))

/* exp(x) for x <= 0: Cody–Waite reduction by ln 2, degree-6 polynomial,
 * then y·2^n as y·2^n1·2^n2 (n1 = floor(n/2)): the first product is exact,
 * the second rounds once, so subnormal results equal AVX-512's scalef. */
AVX2 static inline __m256 exp256(__m256 x)
{
    x = _mm256_max_ps(x, _mm256_set1_ps(-104.0f)); /* below: 0 after scaling */
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    __m256i ni = _mm256_cvtps_epi32(n), n1 = _mm256_srai_epi32(ni, 1), n2 = _mm256_sub_epi32(ni, n1);
    const __m256i bias = _mm256_set1_epi32(127);
    __m256 p1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n1, bias), 23));
    __m256 p2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n2, bias), 23));
    return _mm256_mul_ps(_mm256_mul_ps(y, p1), p2);
}

/* All-ones in the lanes below rem (rem < 8: a tail). */
AVX2 static inline __m256i lanes8(size_t rem)
{
    __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(rem >= 8 ? 8 : (int)rem), idx);
}

/* Loads and stores of 8 floats at p with rem left in the row: whole
 * vectors plainly, the tail masked (masked stores are slow on AMD cores:
 * microcoded, so only the last vector of a row may use one). */
AVX2 static inline __m256 load8(const float *p, size_t rem, __m256i k)
{
    return rem >= 8 ? _mm256_loadu_ps(p) : _mm256_maskload_ps(p, k);
}

AVX2 static inline void store8(float *p, size_t rem, __m256i k, __m256 v)
{
    if (rem >= 8) _mm256_storeu_ps(p, v);
    else _mm256_maskstore_ps(p, k, v);
}

AVX2 void kvq_exp_avx2(const float *x, float *y, size_t n)
{
    for (size_t i = 0; i < n; i += 8) {
        __m256i k = lanes8(n - i);
        store8(y + i, n - i, k, exp256(load8(x + i, n - i, k)));
    }
}

AVX2 static inline float hmax8(__m256 v)
{
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    return _mm_cvtss_f32(m);
}

AVX2 static inline double hsum4(__m256d v)
{
    __m128d s = _mm_add_pd(_mm256_castpd256_pd128(v), _mm256_extractf128_pd(v, 1));
    return _mm_cvtsd_f64(_mm_add_sd(s, _mm_unpackhi_pd(s, s)));
}

/* Softmax pass 1: scales s[0..n) (divides, as the reference) unless
 * prescaled, and returns the max and its first index.  Each lane keeps its
 * own max and the first index holding it (replaced only by a greater
 * value); the answer is the lowest index among the lanes holding the max.
 * Masked-off lanes are -inf, never greater.  Unless pf is NULL, the row
 * pf[0..n) that a later pass reads is fetched into the cache meanwhile, a
 * line every two vectors. */
AVX2 static inline float scale_max(float *s, size_t n, float scale, int prescaled, int *argmax, const float *pf)
{
    const __m256 ninf = _mm256_set1_ps(-INFINITY), vscale = _mm256_set1_ps(scale);
    const __m256i eight = _mm256_set1_epi32(8);
    __m256 vmax = ninf;
    __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), best = idx;
    for (size_t i = 0; i < n; i += 8, idx = _mm256_add_epi32(idx, eight)) {
        if (pf && !(i & 15)) _mm_prefetch((const char *)(pf + i), _MM_HINT_T0);
        __m256i k = lanes8(n - i);
        __m256 v = load8(s + i, n - i, k);
        if (!prescaled) {
            v = _mm256_div_ps(v, vscale);
            store8(s + i, n - i, k, v);
        }
        v = _mm256_blendv_ps(ninf, v, _mm256_castsi256_ps(k));
        __m256 gt = _mm256_cmp_ps(v, vmax, _CMP_GT_OQ);
        vmax = _mm256_blendv_ps(vmax, v, gt);
        best = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(best), _mm256_castsi256_ps(idx), gt));
    }
    float m = hmax8(vmax);
    __m256i at = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff)),
                                                      _mm256_castsi256_ps(best),
                                                      _mm256_cmp_ps(vmax, _mm256_set1_ps(m), _CMP_EQ_OQ)));
    __m128i a4 = _mm_min_epi32(_mm256_castsi256_si128(at), _mm256_extracti128_si256(at, 1));
    a4 = _mm_min_epi32(a4, _mm_shuffle_epi32(a4, _MM_SHUFFLE(1, 0, 3, 2)));
    a4 = _mm_min_epi32(a4, _mm_shuffle_epi32(a4, _MM_SHUFFLE(2, 3, 0, 1)));
    *argmax = _mm_cvtsi128_si32(a4);
    return m;
}

/* Softmax pass 2: a = exp(s − m) over [0, n), returns Σ a in double;
 * fetches pf[0..n) into the cache as scale_max does. */
AVX2 static inline double exp_sum(const float *s, float *a, size_t n, float m, const float *pf)
{
    const __m256 vm = _mm256_set1_ps(m);
    __m256d sum = _mm256_setzero_pd();
    for (size_t i = 0; i < n; i += 8) {
        if (pf && !(i & 15)) _mm_prefetch((const char *)(pf + i), _MM_HINT_T0);
        __m256i k = lanes8(n - i);
        __m256 e = _mm256_and_ps(exp256(_mm256_sub_ps(load8(s + i, n - i, k), vm)), _mm256_castsi256_ps(k));
        store8(a + i, n - i, k, e);
        sum = _mm256_add_pd(sum, _mm256_add_pd(_mm256_cvtps_pd(_mm256_castps256_ps128(e)),
                                               _mm256_cvtps_pd(_mm256_extractf128_ps(e, 1))));
    }
    return hsum4(sum);
}

AVX2 void kvq_softmax_avx2(float *s, float *a, size_t n, size_t ncol, float scale, int prescaled,
                           float *m_out, double *sum_out, int *argmax_out)
{
    float m = scale_max(s, n, scale, prescaled, argmax_out, NULL);
    double total = exp_sum(s, a, n, m, NULL);
    /* a / Σ */
    __m256 vf = _mm256_set1_ps((float)total);
    for (size_t i = 0; i < n; i += 8) {
        __m256i k = lanes8(n - i);
        store8(a + i, n - i, k, _mm256_div_ps(load8(a + i, n - i, k), vf));
    }
    for (size_t u = n; u < ncol; u++) a[u] = 0.0f;
    *m_out = m, *sum_out = total;
}

/* The comparison sums of 4 columns (kvq_row_compare_avx2's step). */
AVX2 static inline void compare4(__m128 s4, __m128 a4, __m128 sq4, __m128 aq4, __m256d vm, __m256d vl,
                                 __m256d vmq, __m256d vlq, __m256d *vs, __m256d *va, __m256d *vk)
{
    __m256d x = _mm256_cvtps_pd(s4), xq = _mm256_cvtps_pd(sq4);
    __m256d y = _mm256_cvtps_pd(a4), yq = _mm256_cvtps_pd(aq4);
    __m256d ds = _mm256_sub_pd(x, xq), da = _mm256_sub_pd(y, yq);
    *vs = _mm256_add_pd(*vs, _mm256_mul_pd(ds, ds));
    *va = _mm256_add_pd(*va, _mm256_mul_pd(da, da));
    /* a·((s − m − lse) − (s' − m' − lse')) where a != 0 (masked-off lanes load a = 0) */
    __m256d la = _mm256_sub_pd(_mm256_sub_pd(x, vm), vl), lq = _mm256_sub_pd(_mm256_sub_pd(xq, vmq), vlq);
    __m256d nz = _mm256_cmp_pd(y, _mm256_setzero_pd(), _CMP_NEQ_OQ);
    *vk = _mm256_add_pd(*vk, _mm256_and_pd(nz, _mm256_mul_pd(y, _mm256_sub_pd(la, lq))));
}

/* kvq_softmax_avx2 of the row sq into aq, then kvq_row_compare_avx2 of
 * (s, a) against it, its last pass (a' = e / Σ) and the comparison fused:
 * the same values and sums in the same order, one pass fewer over the row;
 * the exact rows s and a fetched during the first two passes, as
 * kvq_softmax_compare_avx512 does. */
AVX2 void kvq_softmax_compare_avx2(const float *s, const float *a, float *sq, float *aq, size_t n, size_t ncol,
                                   float scale, int prescaled, double m, double lse, float *mq_out,
                                   double *sumq_out, int *argmaxq_out, double *sd2, double *ad2, double *kl)
{
    float mq = scale_max(sq, n, scale, prescaled, argmaxq_out, s);
    double total = exp_sum(sq, aq, n, mq, a);
    const __m256 vf = _mm256_set1_ps((float)total);
    const __m256d vm = _mm256_set1_pd(m), vl = _mm256_set1_pd(lse), vmq = _mm256_set1_pd(mq),
                  vlq = _mm256_set1_pd(log(total));
    __m256d vs = _mm256_setzero_pd(), va = vs, vk = vs;
    for (size_t i = 0; i < n; i += 8) {
        __m256i k = lanes8(n - i);
        __m256 y = _mm256_div_ps(load8(aq + i, n - i, k), vf);
        store8(aq + i, n - i, k, y);
        y = _mm256_and_ps(y, _mm256_castsi256_ps(k)); /* masked-off lanes 0, as a load would give */
        __m256 x = load8(s + i, n - i, k), xa = load8(a + i, n - i, k);
        __m256 xq = load8(sq + i, n - i, k);
        compare4(_mm256_castps256_ps128(x), _mm256_castps256_ps128(xa), _mm256_castps256_ps128(xq),
                 _mm256_castps256_ps128(y), vm, vl, vmq, vlq, &vs, &va, &vk);
        if (n - i > 4)
            compare4(_mm256_extractf128_ps(x, 1), _mm256_extractf128_ps(xa, 1), _mm256_extractf128_ps(xq, 1),
                     _mm256_extractf128_ps(y, 1), vm, vl, vmq, vlq, &vs, &va, &vk);
    }
    for (size_t u = n; u < ncol; u++) aq[u] = 0.0f;
    *sd2 += hsum4(vs);
    *ad2 += hsum4(va);
    *kl += hsum4(vk);
    *mq_out = mq, *sumq_out = total;
}

/* Adds Σ (s − s')², Σ (a − a')² and KL(A‖A') of one row of n. */
AVX2 void kvq_row_compare_avx2(const float *s, const float *a, const float *sq, const float *aq, size_t n,
                               double m, double lse, double mq, double lseq, double *sd2, double *ad2, double *kl)
{
    __m256d vs = _mm256_setzero_pd(), va = vs, vk = vs;
    const __m256d vm = _mm256_set1_pd(m), vl = _mm256_set1_pd(lse), vmq = _mm256_set1_pd(mq),
                  vlq = _mm256_set1_pd(lseq);
    const __m128i idx = _mm_setr_epi32(0, 1, 2, 3);
    for (size_t i = 0; i < n; i += 4) {
        __m128i k = _mm_cmpgt_epi32(_mm_set1_epi32(n - i >= 4 ? 4 : (int)(n - i)), idx);
        compare4(_mm_maskload_ps(s + i, k), _mm_maskload_ps(a + i, k), _mm_maskload_ps(sq + i, k),
                 _mm_maskload_ps(aq + i, k), vm, vl, vmq, vlq, &vs, &va, &vk);
    }
    *sd2 += hsum4(vs);
    *ad2 += hsum4(va);
    *kl += hsum4(vk);
}

/* ------------------------------------------------------ U per token */

AVX2 static inline float hmin8(__m256 v)
{
    __m128 m = _mm_min_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_min_ps(m, _mm_movehl_ps(m, m));
    m = _mm_min_ss(m, _mm_movehdup_ps(m));
    return _mm_cvtss_f32(m);
}

/* U on one group of G values (G a multiple of 8), as kvq_group_quantize_ref:
 * min and max (the order does not change them), s = (max − min)/L and z = min
 * rounded to the scale precision, then q = rne(clamp((x − z)/s, 0, L)) and
 * x' = q·s + z — a multiply and an add, no FMA, as the reference. */
AVX2 static inline kvq_status u_group8(const float *g, float *o, size_t G, float L, int fp16)
{
    __m256 vmn = _mm256_loadu_ps(g), vmx = vmn;
    for (size_t i = 8; i < G; i += 8) {
        __m256 v = _mm256_loadu_ps(g + i);
        vmn = _mm256_min_ps(vmn, v), vmx = _mm256_max_ps(vmx, v);
    }
    float mn = hmin8(vmn), mx = hmax8(vmx);
    float s = (mx - mn) / L, z = mn;
    if (fp16) s = kvq_round_f16(s), z = kvq_round_f16(z);
    if (!isfinite(s) || !isfinite(z)) return KVQ_ERR_NUMERIC;
    if (s == 0.0f) { /* a constant group: x' = z */
        for (size_t i = 0; i < G; i += 8) _mm256_storeu_ps(o + i, _mm256_set1_ps(z));
        return KVQ_OK;
    }
    const __m256 vs = _mm256_set1_ps(s), vz = _mm256_set1_ps(z), vl = _mm256_set1_ps(L), zero = _mm256_setzero_ps();
    for (size_t i = 0; i < G; i += 8) {
        __m256 v = _mm256_div_ps(_mm256_sub_ps(_mm256_loadu_ps(g + i), vz), vs);
        v = _mm256_min_ps(_mm256_max_ps(v, zero), vl);
        v = _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        _mm256_storeu_ps(o + i, _mm256_add_ps(_mm256_mul_ps(v, vs), vz));
    }
    return KVQ_OK;
}

AVX2 kvq_status kvq_u_rows_avx2(const float *x, float *y, size_t nrows, size_t D, size_t G, int bits, int fp16)
{
    if (G % 8 != 0 || D % G != 0) return KVQ_ERR_UNSUPPORTED;
    const float L = (float)((1u << bits) - 1u);
    for (size_t k = 0, ngroups = nrows * (D / G); k < ngroups; k++) {
        kvq_status st = u_group8(x + k * G, y + k * G, G, L, fp16);
        if (st) return st;
    }
    return KVQ_OK;
}

#else /* not x86-64 GCC/Clang: never selected (kvq_simd_avx2_active is 0) */

void kvq_exp_avx2(const float *x, float *y, size_t n) { (void)x, (void)y, (void)n; }
kvq_status kvq_u_rows_avx2(const float *x, float *y, size_t nrows, size_t D, size_t G, int bits, int fp16)
{ (void)x, (void)y, (void)nrows, (void)D, (void)G, (void)bits, (void)fp16; return KVQ_ERR_UNSUPPORTED; }
void kvq_softmax_avx2(float *s, float *a, size_t n, size_t ncol, float scale, int prescaled, float *m_out,
                      double *sum_out, int *argmax_out)
{ (void)s, (void)a, (void)n, (void)ncol, (void)scale, (void)prescaled, (void)m_out, (void)sum_out, (void)argmax_out; }
void kvq_row_compare_avx2(const float *s, const float *a, const float *sq, const float *aq, size_t n, double m,
                          double lse, double mq, double lseq, double *sd2, double *ad2, double *kl)
{
    (void)s, (void)a, (void)sq, (void)aq, (void)n, (void)m, (void)lse, (void)mq, (void)lseq, (void)sd2, (void)ad2,
        (void)kl;
}
void kvq_softmax_compare_avx2(const float *s, const float *a, float *sq, float *aq, size_t n, size_t ncol,
                              float scale, int prescaled, double m, double lse, float *mq_out, double *sumq_out,
                              int *argmaxq_out, double *sd2, double *ad2, double *kl)
{ (void)s, (void)a, (void)sq, (void)aq, (void)n, (void)ncol, (void)scale, (void)prescaled, (void)m, (void)lse,
  (void)mq_out, (void)sumq_out, (void)argmaxq_out, (void)sd2, (void)ad2, (void)kl; }

#endif

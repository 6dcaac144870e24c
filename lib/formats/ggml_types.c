/* ggml_types.c — the ggml block formats, shared by the GGUF weights of the
 * models in the loop (docs/models.md) and llama.cpp's KV-cache types (the `ggml`
 * quantizer, docs/quantizers.md#ggml): block geometry, dequantization and, for the cache
 * types, quantization.  Written from the block layouts of ggml's
 * ggml-common.h and the formulas of its dequantize_row_* and
 * quantize_row_*_ref functions, evaluated in the same float order (no FMA:
 * meson sets -ffp-contract=off), so the values are ggml's bit for bit.
 *
 * Layouts (little-endian, packed; d/m/dmin are IEEE half):
 *   q4_0  {d; qs[16]}                    32 values, 18 bytes
 *   q4_1  {d; m; qs[16]}                 32 values, 20 bytes
 *   q5_0  {d; qh[4]; qs[16]}             32 values, 22 bytes
 *   q5_1  {d; m; qh[4]; qs[16]}          32 values, 24 bytes
 *   q8_0  {d; int8 qs[32]}               32 values, 34 bytes
 *   iq4_nl {d; qs[16]}                   32 values, 18 bytes (4-bit indices into kvalues_iq4nl)
 *   q2_K  {scales[16]; qs[64]; d; dmin}  256 values, 84 bytes
 *   q3_K  {hmask[32]; qs[64]; scales[12]; d}          256 values, 110 bytes
 *   q4_K  {d; dmin; scales[12]; qs[128]}              256 values, 144 bytes
 *   q5_K  {d; dmin; scales[12]; qh[32]; qs[128]}      256 values, 176 bytes
 *   q6_K  {ql[128]; qh[64]; int8 scales[16]; d}       256 values, 210 bytes
 *   mxfp4, nvfp4: see fp4.c */
#include "../internal.h"
#include "../simd.h"
#include "formats.h"

#include <float.h>
#ifdef KVQ_AVX2_CLONES
#include <immintrin.h>
#endif
#include <math.h>
#include <string.h>

typedef struct ggml_type_row {
    int type;
    const char *name;
    int block;    /* values per block */
    size_t bytes; /* bytes per block */
    /* finite_by_scales: every value is a small integer times the block's
     * half scale d (at byte scale_d), plus or minus one times its second
     * half scale (dmin or m, at scale_m; 0: none), so that it is finite
     * whenever they are: |value| <= 65504 · 128 · 32 (q6_K's bound, the
     * largest).  Not f32, f16, bf16, nor mxfp4 and nvfp4, whose scales
     * reach past FLT_MAX. */
    unsigned char scale_d, scale_m;
    int finite_by_scales;
} ggml_type_row;

static const ggml_type_row types[] = {
    {KVQ_GGML_F32, "f32", 1, 4, .finite_by_scales = 0},
    {KVQ_GGML_F16, "f16", 1, 2, .finite_by_scales = 0},
    {KVQ_GGML_Q4_0, "q4_0", 32, 18, .finite_by_scales = 1},
    {KVQ_GGML_Q4_1, "q4_1", 32, 20, .scale_m = 2, .finite_by_scales = 1},
    {KVQ_GGML_Q5_0, "q5_0", 32, 22, .finite_by_scales = 1},
    {KVQ_GGML_Q5_1, "q5_1", 32, 24, .scale_m = 2, .finite_by_scales = 1},
    {KVQ_GGML_Q8_0, "q8_0", 32, 34, .finite_by_scales = 1},
    {KVQ_GGML_Q2_K, "q2_K", 256, 84, .scale_d = 80, .scale_m = 82, .finite_by_scales = 1},
    {KVQ_GGML_Q3_K, "q3_K", 256, 110, .scale_d = 108, .finite_by_scales = 1},
    {KVQ_GGML_Q4_K, "q4_K", 256, 144, .scale_m = 2, .finite_by_scales = 1},
    {KVQ_GGML_Q5_K, "q5_K", 256, 176, .scale_m = 2, .finite_by_scales = 1},
    {KVQ_GGML_Q6_K, "q6_K", 256, 210, .scale_d = 208, .finite_by_scales = 1},
    {KVQ_GGML_BF16, "bf16", 1, 2, .finite_by_scales = 0},
    {KVQ_GGML_IQ4_NL, "iq4_nl", 32, 18, .finite_by_scales = 1},
    {KVQ_GGML_IQ4_XS, "iq4_xs", 256, 136, .finite_by_scales = 1},
    {KVQ_GGML_MXFP4, "mxfp4", 32, 17, .finite_by_scales = 0},
    {KVQ_GGML_NVFP4, "nvfp4", 64, 36, .finite_by_scales = 0},
};

/* ggml-common.h's kvalues_iq4nl: the 16 non-linear levels of iq4_nl */
static const int8_t kvalues_iq4nl[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

static const ggml_type_row *type_row(int type)
{
    for (size_t i = 0; i < sizeof types / sizeof types[0]; i++)
        if (types[i].type == type) return &types[i];
    return NULL;
}

int kvq_ggml_type_size(int type, int *block_values, size_t *block_bytes)
{
    const ggml_type_row *r = type_row(type);
    if (!r) return 0;
    if (block_values) *block_values = r->block;
    if (block_bytes) *block_bytes = r->bytes;
    return 1;
}

const char *kvq_ggml_type_name(int type)
{
    const ggml_type_row *r = type_row(type);
    return r ? r->name : NULL;
}

static inline float half_at(const uint8_t *p) { return kvq_f16_to_f32((uint16_t)(p[0] | p[1] << 8)); }

int kvq_ggml_finite_by_scales(int type, const void *src, size_t n)
{
    const ggml_type_row *r = type_row(type);
    if (!r || !r->finite_by_scales) return 0;
    const uint8_t *p = src;
    int two = r->scale_m != 0; /* a second half scale (dmin, m) */
    for (size_t i = 0, nb = n / (size_t)r->block; i < nb; i++, p += r->bytes)
        if (!isfinite(half_at(p + r->scale_d)) || (two && !isfinite(half_at(p + r->scale_m)))) return 0;
    return 1;
}

/* ggml's get_scale_min_k4: the 6-bit scale and min of sub-block j of a
 * q4_K/q5_K block from its 12 packed bytes. */
static inline void scale_min_k4(int j, const uint8_t *q, uint8_t *sc, uint8_t *m)
{
    if (j < 4) {
        *sc = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *sc = (uint8_t)((q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4));
        *m = (uint8_t)((q[j + 4] >> 4) | ((q[j] >> 6) << 4));
    }
}

static void deq_q4_0(const uint8_t *b, float *y)
{
    float d = half_at(b);
    const uint8_t *qs = b + 2;
    for (int j = 0; j < 16; j++) {
        y[j] = (float)((qs[j] & 0xF) - 8) * d;
        y[j + 16] = (float)((qs[j] >> 4) - 8) * d;
    }
}

static void deq_q4_1(const uint8_t *b, float *y)
{
    float d = half_at(b), m = half_at(b + 2);
    const uint8_t *qs = b + 4;
    for (int j = 0; j < 16; j++) {
        y[j] = (float)(qs[j] & 0xF) * d + m;
        y[j + 16] = (float)(qs[j] >> 4) * d + m;
    }
}

/* q5_0 / q5_1: bit j of qh is the fifth bit of value j, bit j+16 of value j+16. */
static void deq_q5(const uint8_t *b, float *y, int with_min)
{
    float d = half_at(b), m = with_min ? half_at(b + 2) : 0.0f;
    const uint8_t *p = b + (with_min ? 4 : 2);
    uint32_t qh = (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
    const uint8_t *qs = p + 4;
    for (int j = 0; j < 16; j++) {
        int h0 = (int)((qh >> j) << 4 & 0x10), h1 = (int)(qh >> (j + 12) & 0x10);
        int x0 = (qs[j] & 0xF) | h0, x1 = (qs[j] >> 4) | h1;
        if (with_min) {
            y[j] = (float)x0 * d + m;
            y[j + 16] = (float)x1 * d + m;
        } else {
            y[j] = (float)(x0 - 16) * d;
            y[j + 16] = (float)(x1 - 16) * d;
        }
    }
}

static void deq_q8_0(const uint8_t *b, float *y)
{
    float d = half_at(b);
    for (int j = 0; j < 32; j++) y[j] = (float)(int8_t)b[2 + j] * d;
}

static void deq_iq4_nl(const uint8_t *b, float *y)
{
    float d = half_at(b);
    const uint8_t *qs = b + 2;
    for (int j = 0; j < 16; j++) {
        y[j] = d * (float)kvalues_iq4nl[qs[j] & 0xF];
        y[j + 16] = d * (float)kvalues_iq4nl[qs[j] >> 4];
    }
}

/* iq4_xs {d; scales_h; scales_l[4]; qs[128]}: 8 sub-blocks of 32 iq4_nl
 * indices, each with a 6-bit scale ls (low 4 bits in scales_l, high 2 in
 * scales_h) giving d · (ls − 32). */
static void deq_iq4_xs(const uint8_t *b, float *y)
{
    float d = half_at(b);
    unsigned scales_h = (unsigned)b[2] | (unsigned)b[3] << 8;
    const uint8_t *scales_l = b + 4, *qs = b + 8;
    for (int ib = 0; ib < 8; ib++, y += 32, qs += 16) {
        int ls = ((scales_l[ib / 2] >> 4 * (ib % 2)) & 0xf) | (((scales_h >> 2 * ib) & 3) << 4);
        float dl = d * (float)(ls - 32);
        for (int j = 0; j < 16; j++) {
            y[j] = dl * (float)kvalues_iq4nl[qs[j] & 0xf];
            y[j + 16] = dl * (float)kvalues_iq4nl[qs[j] >> 4];
        }
    }
}

static void deq_q2_K(const uint8_t *b, float *y)
{
    const uint8_t *scales = b, *q = b + 16;
    float d = half_at(b + 80), dmin = half_at(b + 82);
    int is = 0;
    for (int n = 0; n < 256; n += 128) {
        for (int shift = 0; shift < 8; shift += 2) {
            for (int half = 0; half < 2; half++) {
                uint8_t sc = scales[is++];
                float dl = d * (float)(sc & 0xF), ml = dmin * (float)(sc >> 4);
                for (int l = 0; l < 16; l++) *y++ = dl * (float)((q[l + 16 * half] >> shift) & 3) - ml;
            }
        }
        q += 32;
    }
}

static void deq_q3_K(const uint8_t *b, float *y)
{
    const uint8_t *hm = b, *q = b + 32, *ps = b + 96;
    float d_all = half_at(b + 108);
    /* 16 six-bit scales: low 4 bits in ps[0..7] (two per byte), high 2 bits in ps[8..11] */
    int8_t scales[16];
    for (int j = 0; j < 16; j++) {
        int lo = j < 8 ? ps[j] & 0xF : ps[j - 8] >> 4;
        int hi = (ps[8 + j % 4] >> (2 * (j / 4))) & 3;
        scales[j] = (int8_t)((lo | hi << 4) - 32);
    }
    int is = 0;
    uint8_t m = 1;
    for (int n = 0; n < 256; n += 128) {
        for (int shift = 0; shift < 8; shift += 2) {
            for (int half = 0; half < 2; half++) {
                float dl = d_all * (float)scales[is++];
                for (int l = 0; l < 16; l++) {
                    int k = l + 16 * half;
                    *y++ = dl * (float)(((q[k] >> shift) & 3) - ((hm[k] & m) ? 0 : 4));
                }
            }
            m <<= 1;
        }
        q += 32;
    }
}

/* q4_K (with_high = 0) and q5_K (with_high = 1). */
static void deq_q45_K(const uint8_t *b, float *y, int with_high)
{
    float d = half_at(b), dmin = half_at(b + 2);
    const uint8_t *scales = b + 4, *qh = b + 16, *ql = b + (with_high ? 48 : 16);
    int is = 0;
    uint8_t u1 = 1, u2 = 2;
    for (int j = 0; j < 256; j += 64) {
        uint8_t sc, m;
        scale_min_k4(is, scales, &sc, &m);
        float d1 = d * (float)sc, m1 = dmin * (float)m;
        scale_min_k4(is + 1, scales, &sc, &m);
        float d2 = d * (float)sc, m2 = dmin * (float)m;
        for (int l = 0; l < 32; l++)
            *y++ = d1 * (float)((ql[l] & 0xF) + (with_high && (qh[l] & u1) ? 16 : 0)) - m1;
        for (int l = 0; l < 32; l++)
            *y++ = d2 * (float)((ql[l] >> 4) + (with_high && (qh[l] & u2) ? 16 : 0)) - m2;
        ql += 32, is += 2;
        u1 = (uint8_t)(u1 << 2), u2 = (uint8_t)(u2 << 2);
    }
}

static void deq_q6_K(const uint8_t *b, float *y)
{
    const uint8_t *ql = b, *qh = b + 128;
    const int8_t *sc = (const int8_t *)(b + 192);
    float d = half_at(b + 208);
    for (int n = 0; n < 256; n += 128) {
        for (int l = 0; l < 32; l++) {
            int is = l / 16;
            int q1 = ((ql[l] & 0xF) | ((qh[l] >> 0 & 3) << 4)) - 32;
            int q2 = ((ql[l + 32] & 0xF) | ((qh[l] >> 2 & 3) << 4)) - 32;
            int q3 = ((ql[l] >> 4) | ((qh[l] >> 4 & 3) << 4)) - 32;
            int q4 = ((ql[l + 32] >> 4) | ((qh[l] >> 6 & 3) << 4)) - 32;
            y[l] = d * (float)sc[is] * (float)q1;
            y[l + 32] = d * (float)sc[is + 2] * (float)q2;
            y[l + 64] = d * (float)sc[is + 4] * (float)q3;
            y[l + 96] = d * (float)sc[is + 6] * (float)q4;
        }
        y += 128, ql += 64, qh += 32, sc += 8;
    }
}

#ifdef KVQ_AVX2_CLONES
/* deq_q6_K with AVX2 (the output heads of Q4_K_M models are q6_K): a
 * quarter's 32 codes at once from ql's nibbles and qh's bit pairs, then
 * each 8 of them times its (d·sc) as the plain loop multiplies them, so
 * the same bits. */
KVQ_TARGET_AVX2 static void deq_q6_K_avx2(const uint8_t *b, float *y)
{
    const uint8_t *ql = b, *qh = b + 128;
    const int8_t *sc = (const int8_t *)(b + 192);
    float d = half_at(b + 208);
    const __m256i m4 = _mm256_set1_epi8(0x0F), m3 = _mm256_set1_epi8(3), k32 = _mm256_set1_epi8(32);
    for (int n = 0; n < 256; n += 128, y += 128, ql += 64, qh += 32, sc += 8) {
        __m256i lo = _mm256_loadu_si256((const __m256i *)ql), hi = _mm256_loadu_si256((const __m256i *)(ql + 32));
        __m256i h = _mm256_loadu_si256((const __m256i *)qh), q[4];
        q[0] = _mm256_or_si256(_mm256_and_si256(lo, m4), _mm256_slli_epi16(_mm256_and_si256(h, m3), 4));
        q[1] = _mm256_or_si256(_mm256_and_si256(hi, m4),
                               _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 2), m3), 4));
        q[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(lo, 4), m4),
                               _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 4), m3), 4));
        q[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(hi, 4), m4),
                               _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 6), m3), 4));
        for (int k = 0; k < 4; k++) { /* y[32k + l] = (d·sc[2k + l / 16])·(q − 32) */
            __m256i v = _mm256_sub_epi8(q[k], k32);
            __m128i half[2] = {_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1)};
            for (int j = 0; j < 2; j++) {
                __m256 s = _mm256_set1_ps(d * (float)sc[2 * k + j]);
                __m256 a = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(half[j]));
                __m256 c = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(half[j], 8)));
                _mm256_storeu_ps(y + 32 * k + 16 * j, _mm256_mul_ps(s, a));
                _mm256_storeu_ps(y + 32 * k + 16 * j + 8, _mm256_mul_ps(s, c));
            }
        }
    }
}
#endif

void kvq_ggml_dequantize(int type, const void *src, float *dst, size_t n)
{
    const uint8_t *p = src;
    const ggml_type_row *r = type_row(type);
    if (!r) return;
    size_t nb = n / (size_t)r->block;
    switch (type) {
    case KVQ_GGML_F32: memcpy(dst, src, n * sizeof(float)); return;
    case KVQ_GGML_F16: {
        /* unaligned source: convert in bounded aligned pieces */
        uint16_t tmp[1024];
        for (size_t i = 0; i < n; i += 1024) {
            size_t k = n - i < 1024 ? n - i : 1024;
            memcpy(tmp, p + 2 * i, 2 * k);
            kvq_f16_to_f32_array(tmp, dst + i, k);
        }
        return;
    }
    case KVQ_GGML_BF16:
        for (size_t i = 0; i < n; i++) {
            uint32_t u = (uint32_t)(p[2 * i] | p[2 * i + 1] << 8) << 16;
            memcpy(&dst[i], &u, 4);
        }
        return;
    default: break;
    }
#ifdef KVQ_AVX2_CLONES
    if (type == KVQ_GGML_Q6_K && kvq_simd_avx2_active()) {
        for (size_t i = 0; i < nb; i++, p += r->bytes, dst += r->block) deq_q6_K_avx2(p, dst);
        return;
    }
#endif
    for (size_t i = 0; i < nb; i++, p += r->bytes, dst += r->block) {
        switch (type) {
        case KVQ_GGML_Q4_0: deq_q4_0(p, dst); break;
        case KVQ_GGML_IQ4_NL: deq_iq4_nl(p, dst); break;
        case KVQ_GGML_IQ4_XS: deq_iq4_xs(p, dst); break;
        case KVQ_GGML_Q4_1: deq_q4_1(p, dst); break;
        case KVQ_GGML_Q5_0: deq_q5(p, dst, 0); break;
        case KVQ_GGML_Q5_1: deq_q5(p, dst, 1); break;
        case KVQ_GGML_Q8_0: deq_q8_0(p, dst); break;
        case KVQ_GGML_Q2_K: deq_q2_K(p, dst); break;
        case KVQ_GGML_Q3_K: deq_q3_K(p, dst); break;
        case KVQ_GGML_Q4_K: deq_q45_K(p, dst, 0); break;
        case KVQ_GGML_Q5_K: deq_q45_K(p, dst, 1); break;
        case KVQ_GGML_Q6_K: deq_q6_K(p, dst); break;
        case KVQ_GGML_MXFP4: kvq_mxfp4_block_dequantize(p, dst); break;
        case KVQ_GGML_NVFP4:
            for (int s = 0; s < 4; s++) kvq_nvfp4_block_dequantize(p[s], p + 4 + 8 * s, 1.0f, dst + 16 * s);
            break;
        default: break;
        }
    }
}

/* ----------------------------------- quantization (docs/quantizers.md#ggml) */

static inline void put_half(uint8_t *p, float v)
{
    uint16_t h = kvq_f32_to_f16(v); /* GGML_FP32_TO_FP16: round to nearest even */
    p[0] = (uint8_t)(h & 0xFF), p[1] = (uint8_t)(h >> 8);
}

/* roundf (half away from zero) without the library call, for the block
 * loops: below 2^23 the truncation t and v − t are exact, so t moves away
 * from zero exactly when |v − t| >= 0.5; larger values are integers already
 * and inf or nan keep roundf's answer. */
static inline float round_away(float v)
{
    if (!(fabsf(v) < 8388608.0f)) return roundf(v);
    float t = (float)(int32_t)v, d = v - t;
    t += (d >= 0.5f) - (d <= -0.5f);
    return copysignf(t, v);
}

/* quantize_row_q8_0_ref, one block */
static void q_q8_0(const float *x, uint8_t *b)
{
    float amax = 0.0f;
    for (int j = 0; j < 32; j++) {
        float v = fabsf(x[j]);
        amax = amax > v ? amax : v; /* MAX(amax, fabsf(v)) */
    }
    const float d = amax / ((1 << 7) - 1);
    const float id = d ? 1.0f / d : 0.0f;
    put_half(b, d);
    for (int j = 0; j < 32; j++) b[2 + j] = (uint8_t)(int8_t)round_away(x[j] * id);
}

/* q_q8_0 with both loops in lanes that vectorise, the same bytes: the
 * largest |x| of finite values is the same in any order, and below 2^23
 * round_away is its branch-free middle.  A block holding a NaN (where
 * ggml's MAX order decides; its scaled copy is NaN too) or a scaled value at
 * or beyond 2^23 (an infinite id) goes through q_q8_0.  The scalar max
 * waited 4 cycles a value: 15 % of a layer's ggml run. */
static void q_q8_0_lanes(const float *x, uint8_t *b)
{
    float v[32];
    int odd = 0;
    const float amax = kvq_absmax_lanes(x, 32, 8);
    const float d = amax / ((1 << 7) - 1);
    const float id = d ? 1.0f / d : 0.0f;
    for (int j = 0; j < 32; j++) {
        v[j] = x[j] * id;
        odd |= !(fabsf(v[j]) < 8388608.0f);
    }
    if (odd) {
        q_q8_0(x, b);
        return;
    }
    put_half(b, d);
    for (int j = 0; j < 32; j++) {
        float t = (float)(int32_t)v[j], r = v[j] - t;
        t += (float)((r >= 0.5f) - (r <= -0.5f));
        b[2 + j] = (uint8_t)(int8_t)(int32_t)t; /* round_away's copysign only signs a zero */
    }
}

/* quantize_row_q4_0_ref / q5_0_ref: d = max / −2^(bits−1), the signed value of largest magnitude */
static void q_q4_0_q5_0(const float *x, uint8_t *b, int five)
{
    float amax = 0.0f, max = 0.0f;
    for (int j = 0; j < 32; j++) {
        const float v = x[j];
        if (amax < fabsf(v)) amax = fabsf(v), max = v;
    }
    const float d = max / (five ? -16 : -8);
    const float id = d ? 1.0f / d : 0.0f;
    put_half(b, d);
    uint8_t *qs = b + (five ? 6 : 2);
    uint32_t qh = 0;
    for (int j = 0; j < 16; j++) {
        const float x0 = x[j] * id, x1 = x[16 + j] * id;
        int8_t t0 = (int8_t)(x0 + (five ? 16.5f : 8.5f)), t1 = (int8_t)(x1 + (five ? 16.5f : 8.5f));
        const uint8_t xi0 = (uint8_t)(t0 < (five ? 31 : 15) ? t0 : (five ? 31 : 15)); /* MIN(15|31, ...) */
        const uint8_t xi1 = (uint8_t)(t1 < (five ? 31 : 15) ? t1 : (five ? 31 : 15));
        qs[j] = (uint8_t)((xi0 & 0x0F) | ((xi1 & 0x0F) << 4));
        qh |= ((xi0 & 0x10u) >> 4) << (j + 0);
        qh |= ((xi1 & 0x10u) >> 4) << (j + 16);
    }
    if (five) b[2] = (uint8_t)qh, b[3] = (uint8_t)(qh >> 8), b[4] = (uint8_t)(qh >> 16), b[5] = (uint8_t)(qh >> 24);
}

/* quantize_row_q4_1_ref / q5_1_ref: d = (max − min) / (2^bits − 1), m = min */
static void q_q4_1_q5_1(const float *x, uint8_t *b, int five)
{
    float min = FLT_MAX, max = -FLT_MAX;
    for (int j = 0; j < 32; j++) {
        const float v = x[j];
        if (v < min) min = v;
        if (v > max) max = v;
    }
    const float d = (max - min) / ((1 << (five ? 5 : 4)) - 1);
    const float id = d ? 1.0f / d : 0.0f;
    put_half(b, d);
    put_half(b + 2, min);
    uint8_t *qs = b + (five ? 8 : 4);
    uint32_t qh = 0;
    for (int j = 0; j < 16; j++) {
        const float x0 = (x[j] - min) * id, x1 = (x[16 + j] - min) * id;
        uint8_t xi0, xi1;
        if (five) { /* (uint8_t)(x0 + 0.5f), no clamp */
            xi0 = (uint8_t)(x0 + 0.5f), xi1 = (uint8_t)(x1 + 0.5f);
        } else { /* MIN(15, (int8_t)(x0 + 0.5f)) */
            int8_t t0 = (int8_t)(x0 + 0.5f), t1 = (int8_t)(x1 + 0.5f);
            xi0 = (uint8_t)(t0 < 15 ? t0 : 15), xi1 = (uint8_t)(t1 < 15 ? t1 : 15);
        }
        qs[j] = (uint8_t)((xi0 & 0x0F) | ((xi1 & 0x0F) << 4));
        qh |= ((xi0 & 0x10u) >> 4) << (j + 0);
        qh |= ((xi1 & 0x10u) >> 4) << (j + 16);
    }
    if (five) b[4] = (uint8_t)qh, b[5] = (uint8_t)(qh >> 8), b[6] = (uint8_t)(qh >> 16), b[7] = (uint8_t)(qh >> 24);
}

/* ggml's best_index_int8(16, kvalues_iq4nl, x): the level nearest to x,
 * ties to the upper one, with ggml's float arithmetic for the last step.
 * Branch-free instead of ggml's binary search: mu = 1 + the levels 1..14 at
 * or below x, so that x lies in [level mu−1, level mu); then the nearer of
 * the two.  Equal to the binary search on all 2^32 float bit patterns
 * (checked exhaustively once, nan included). */
static inline int best_index_iq4nl(float x)
{
    int mu = 1;
    for (int k = 1; k < 15; k++) mu += x >= (float)kvalues_iq4nl[k];
    int r = x - (float)kvalues_iq4nl[mu - 1] < (float)kvalues_iq4nl[mu] - x ? mu - 1 : mu;
    r = x <= (float)kvalues_iq4nl[0] ? 0 : r;
    return x >= (float)kvalues_iq4nl[15] || x != x ? 15 : r;
}

/* quantize_row_iq4_nl_ref, one block: quantize_row_iq4_nl_impl with
 * super_block_size = block_size = 32, no importance weights (w = x²) and
 * ntry = −1, so no scale search: d0 = max/−127 picks the levels, then the
 * least-squares d = Σw·q·x / Σw·q² is stored.  A block below 1e-15 stores
 * d = 0 (ggml leaves its indices unset; kvq writes 0, x' = 0 either way). */
static void q_iq4_nl(const float *x, uint8_t *b)
{
    uint8_t L[32] = {0};
    float weight[32];
    for (int j = 0; j < 32; j++) weight[j] = x[j] * x[j];
    float amax = 0, max = 0;
    for (int j = 0; j < 32; j++) {
        float ax = fabsf(x[j]);
        if (ax > amax) amax = ax, max = x[j];
    }
    float d = 0.0f;
    if (!(amax < 1e-15f)) { /* GROUP_MAX_EPS */
        d = max / kvalues_iq4nl[0];
        float id = 1 / d;
        float sumqx = 0, sumq2 = 0;
        for (int j = 0; j < 32; j++) {
            float al = id * x[j];
            int l = best_index_iq4nl(al);
            L[j] = (uint8_t)l;
            float q = kvalues_iq4nl[l];
            float w = weight[j];
            sumqx += w * q * x[j];
            sumq2 += w * q * q;
        }
        d = sumq2 > 0 ? sumqx / sumq2 : 0.f;
    }
    put_half(b, d);
    for (int j = 0; j < 16; j++) b[2 + j] = (uint8_t)(L[j] | (L[16 + j] << 4));
}

int kvq_ggml_quantize_ref(int type, const float *x, void *dst, size_t n)
{
    uint8_t *p = dst;
    switch (type) {
    case KVQ_GGML_F16:
        for (size_t i = 0; i < n; i++) put_half(p + 2 * i, x[i]);
        return 1;
    case KVQ_GGML_BF16: /* ggml_compute_fp32_to_bf16 for finite x: round to nearest even */
        for (size_t i = 0; i < n; i++) {
            uint32_t u;
            memcpy(&u, &x[i], 4);
            uint16_t h = (uint16_t)((u + (0x7fffu + ((u >> 16) & 1u))) >> 16);
            p[2 * i] = (uint8_t)(h & 0xFF), p[2 * i + 1] = (uint8_t)(h >> 8);
        }
        return 1;
    case KVQ_GGML_Q8_0: case KVQ_GGML_Q4_0: case KVQ_GGML_Q4_1: case KVQ_GGML_Q5_0: case KVQ_GGML_Q5_1:
    case KVQ_GGML_IQ4_NL:
        break;
    case KVQ_GGML_MXFP4:
        for (size_t i = 0; i + 32 <= n; i += 32) kvq_mxfp4_block_ref(x + i, p + i / 32 * 17);
        return 1;
    case KVQ_GGML_NVFP4:
        for (size_t i = 0; i + 64 <= n; i += 64)
            for (int s = 0; s < 4; s++) {
                uint8_t *b = p + i / 64 * 36;
                kvq_nvfp4_block_ref(x + i + 16 * s, 1.0f, 0, &b[s], b + 4 + 8 * s);
            }
        return 1;
    default:
        return 0;
    }
    const ggml_type_row *r = type_row(type);
    for (size_t i = 0; i + 32 <= n; i += 32, p += r->bytes) {
        switch (type) {
        case KVQ_GGML_Q8_0: q_q8_0(x + i, p); break;
        case KVQ_GGML_Q4_0: q_q4_0_q5_0(x + i, p, 0); break;
        case KVQ_GGML_Q5_0: q_q4_0_q5_0(x + i, p, 1); break;
        case KVQ_GGML_Q4_1: q_q4_1_q5_1(x + i, p, 0); break;
        case KVQ_GGML_Q5_1: q_q4_1_q5_1(x + i, p, 1); break;
        case KVQ_GGML_IQ4_NL: q_iq4_nl(x + i, p); break;
        }
    }
    return 1;
}

int kvq_ggml_quantize(int type, const float *x, void *dst, size_t n)
{
    if (type != KVQ_GGML_Q8_0) return kvq_ggml_quantize_ref(type, x, dst, n);
    uint8_t *p = dst;
    for (size_t i = 0; i + 32 <= n; i += 32, p += type_row(type)->bytes) q_q8_0_lanes(x + i, p);
    return 1;
}

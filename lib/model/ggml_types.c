/* ggml_types.c — the ggml weight formats kvq reads from GGUF files (SPEC §8):
 * block geometry and dequantization, written from the block layouts of
 * ggml's ggml-common.h and the formulas of its dequantize_row_* functions,
 * evaluated in the same float order (no FMA: meson sets -ffp-contract=off),
 * so the values are ggml's bit for bit.
 *
 * Layouts (little-endian, packed; d/m/dmin are IEEE half):
 *   q4_0  {d; qs[16]}                    32 values, 18 bytes
 *   q4_1  {d; m; qs[16]}                 32 values, 20 bytes
 *   q5_0  {d; qh[4]; qs[16]}             32 values, 22 bytes
 *   q5_1  {d; m; qh[4]; qs[16]}          32 values, 24 bytes
 *   q8_0  {d; int8 qs[32]}               32 values, 34 bytes
 *   q2_K  {scales[16]; qs[64]; d; dmin}  256 values, 84 bytes
 *   q3_K  {hmask[32]; qs[64]; scales[12]; d}          256 values, 110 bytes
 *   q4_K  {d; dmin; scales[12]; qs[128]}              256 values, 144 bytes
 *   q5_K  {d; dmin; scales[12]; qh[32]; qs[128]}      256 values, 176 bytes
 *   q6_K  {ql[128]; qh[64]; int8 scales[16]; d}       256 values, 210 bytes */
#include "model.h"

#include <string.h>

typedef struct ggml_type_row {
    int type;
    const char *name;
    int block;    /* values per block */
    size_t bytes; /* bytes per block */
} ggml_type_row;

static const ggml_type_row types[] = {
    {KVQ_GGML_F32, "f32", 1, 4},        {KVQ_GGML_F16, "f16", 1, 2},
    {KVQ_GGML_Q4_0, "q4_0", 32, 18},    {KVQ_GGML_Q4_1, "q4_1", 32, 20},
    {KVQ_GGML_Q5_0, "q5_0", 32, 22},    {KVQ_GGML_Q5_1, "q5_1", 32, 24},
    {KVQ_GGML_Q8_0, "q8_0", 32, 34},    {KVQ_GGML_Q2_K, "q2_K", 256, 84},
    {KVQ_GGML_Q3_K, "q3_K", 256, 110},  {KVQ_GGML_Q4_K, "q4_K", 256, 144},
    {KVQ_GGML_Q5_K, "q5_K", 256, 176},  {KVQ_GGML_Q6_K, "q6_K", 256, 210},
    {KVQ_GGML_BF16, "bf16", 1, 2},
};

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
    for (size_t i = 0; i < nb; i++, p += r->bytes, dst += r->block) {
        switch (type) {
        case KVQ_GGML_Q4_0: deq_q4_0(p, dst); break;
        case KVQ_GGML_Q4_1: deq_q4_1(p, dst); break;
        case KVQ_GGML_Q5_0: deq_q5(p, dst, 0); break;
        case KVQ_GGML_Q5_1: deq_q5(p, dst, 1); break;
        case KVQ_GGML_Q8_0: deq_q8_0(p, dst); break;
        case KVQ_GGML_Q2_K: deq_q2_K(p, dst); break;
        case KVQ_GGML_Q3_K: deq_q3_K(p, dst); break;
        case KVQ_GGML_Q4_K: deq_q45_K(p, dst, 0); break;
        case KVQ_GGML_Q5_K: deq_q45_K(p, dst, 1); break;
        case KVQ_GGML_Q6_K: deq_q6_K(p, dst); break;
        default: break;
        }
    }
}

/* fp4.c — the FP4 micro-scaled block formats (docs/quantizers.md#fp4), as ggml computes
 * them: E2M1 elements with an E8M0 block scale (MXFP4, OCP Microscaling
 * v1.0) or an unsigned E4M3 one (NVFP4).  Written from ggml's
 * quantize_row_mxfp4_ref / dequantize_row_mxfp4, quantize_row_nvfp4_ref /
 * dequantize_row_nvfp4 (ggml-quants.c) and the conversions of ggml-impl.h,
 * evaluated in the same float order (meson sets -ffp-contract=off), so
 * codes and values are ggml's bit for bit.
 *
 * As in ggml, element values are kept doubled (kvq_e2m1_doubled: 0, 1, 2,
 * 3, 4, 6, 8, 12 for E2M1's 0, 0.5, 1, 1.5, 2, 3, 4, 6) and scales are
 * decoded halved, so that value = doubled · half-scale exactly.
 *
 * One deviation of ggml's from E4M3 matters beyond ggml's own use:
 * ggml_fp32_to_ue4m3 treats exponent 15 as overflow, so every scale in
 * [256, 448) is stored as 448.  With g = 1 KV block scales (amax/6) are far
 * below that; the two-level scheme (g = amax/(6·448)) puts the largest
 * blocks exactly there, so it rounds as E4M3 does (kvq_ue4m3_encode_rne,
 * nearest even, as CUDA's cvt.rn.satfinite and torch's float8_e4m3fn).
 *
 * Layouts (as ggml-common.h):
 *   mxfp4 {uint8 e (E8M0); qs[16]}        32 values, 17 bytes
 *   nvfp4 {uint8 d[4] (UE4M3); qs[32]}    64 values, 36 bytes (four sub-blocks of 16)
 * In qs, byte j of a (sub-)block of n values holds element j in its low
 * nibble and element j + n/2 in its high nibble. */
#include "../internal.h"
#include "../simd.h"
#include "formats.h"

#include <math.h>
#include <string.h>

/* ggml-common.h's kvalues_fp4: E2M1 codes 0..15 → doubled values */
const int8_t kvq_e2m1_doubled[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

/* --------------------------------------------------------------- scales */

uint8_t kvq_e8m0_mxfp4(float amax)
{
    if (!(amax > 0.0f)) return 0; /* an all-zero block */
    /* ggml: (uint8_t)(floorf(log2f(amax)) - 2 + 127).  Below 2^-125 that is
     * negative and ggml's cast undefined; kvq keeps the smallest scale. */
    float e = floorf(log2f(amax)) - 2 + 127;
    return e < 0.0f ? 0 : (uint8_t)e;
}

float kvq_e8m0_half(uint8_t e) /* ggml_e8m0_to_fp32_half: 2^(e − 128) */
{
    uint32_t bits = e < 2 ? 0x00200000u << e : (uint32_t)(e - 1) << 23;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

uint8_t kvq_ue4m3_encode(float x) /* ggml_fp32_to_ue4m3 */
{
    if (!(x > 0.0f)) return 0;
    if (x > 448.0f) x = 448.0f;
    uint32_t bits;
    memcpy(&bits, &x, 4);
    int fp32_exp = (int)((bits >> 23) & 0xFF) - 127;
    int fp32_man = (int)((bits >> 20) & 0x7);
    int exp = fp32_exp + 7;
    if (exp <= 0) { /* subnormal: man · 2^-9, man = round(x · 2^9) clamped to 1..7, else 0 */
        int man = (int)(x * 512.0f + 0.5f);
        if (man > 7) man = 7;
        return man < 1 ? 0 : (uint8_t)man;
    }
    if (exp >= 15) return 0x7E;
    int man = fp32_man + (int)((bits >> 19) & 1); /* the next bit rounds (half up) */
    if (man > 7) {
        man = 0;
        if (++exp >= 15) return 0x7E;
    }
    return (uint8_t)((exp << 3) | man);
}

uint8_t kvq_ue4m3_encode_rne(float x)
{
    if (!(x > 0.0f)) return 0;
    float v = kvq_fp8_cast_ref(x, KVQ_FP8_E4M3); /* nearest, ties to even, saturating at 448 */
    if (v < 0x1p-6f) return (uint8_t)(v * 512.0f); /* subnormal: man · 2^-9 (0 when v is) */
    int exp = ilogbf(v);
    return (uint8_t)((exp + 7) << 3 | (int)(ldexpf(v, -exp) * 8.0f - 8.0f));
}

float kvq_ue4m3_half(uint8_t u) /* ggml_ue4m3_to_fp32: half the E4M3 value */
{
    if (u == 0 || u == 0x7F) return 0.0f;
    int exp = (u >> 3) & 0xF, man = u & 0x7;
    float raw = exp == 0 ? ldexpf((float)man, -9) : ldexpf(1.0f + (float)man / 8.0f, exp - 7);
    return raw * 0.5f;
}

/* ------------------------------------------------------------- elements */

int kvq_e2m1_index(float x, float d) /* ggml's best_index_mxfp4: first of equals */
{
    int best = 0;
    float best_err = fabsf((float)kvq_e2m1_doubled[0] * d - x);
    for (int i = 1; i < 16; i++) {
        float err = fabsf((float)kvq_e2m1_doubled[i] * d - x);
        if (err < best_err) best = i, best_err = err;
    }
    return best;
}

/* n values (even) of x with half-scale d into n/2 bytes: element j in the
 * low nibble of byte j, element j + n/2 in its high nibble. */
static void e2m1_pack(const float *x, float d, int n, uint8_t *qs)
{
    for (int j = 0; j < n / 2; j++)
        qs[j] = (uint8_t)(kvq_e2m1_index(x[j], d) | kvq_e2m1_index(x[j + n / 2], d) << 4);
}

static void e2m1_unpack(const uint8_t *qs, float d, int n, float *y)
{
    for (int j = 0; j < n / 2; j++) {
        y[j] = (float)kvq_e2m1_doubled[qs[j] & 0x0F] * d;
        y[j + n / 2] = (float)kvq_e2m1_doubled[qs[j] >> 4] * d;
    }
}

static float absmax_of(const float *x, int n)
{
    float amax = 0.0f;
    for (int j = 0; j < n; j++)
        if (amax < fabsf(x[j])) amax = fabsf(x[j]);
    return amax;
}

/* The hot loop: y = the E2M1 value nearest x at half-scale d, the same
 * choice as kvq_e2m1_index without its 16-way search and nibbles.  For
 * x >= 0 the negative codes are never strictly nearer than code 0 (their
 * error is fl(v·d + x) >= x), for x < 0 the positive ones are not, and
 * fl(−v·d − x) = −fl(v·d − |x|): so the search runs over the 8 magnitudes
 * of |x| in table order (ties keep the first) and the sign is put back —
 * except on 0, which ggml's code 0 gives as +0.  Branch-free, so the loop
 * over a block vectorises; compiled plain and again for AVX2. */
static inline __attribute__((always_inline)) void e2m1_try(float v, float a, float *best_err, float *best_val)
{
    float err = fabsf(v - a);
    int better = err < *best_err;
    *best_val = better ? v : *best_val;
    *best_err = better ? err : *best_err;
}

static inline __attribute__((always_inline)) float e2m1_round(float x, float d)
{
    float a = fabsf(x), best_err = a, best_val = 0.0f;
    /* kvq_e2m1_doubled[1..7], written out so that the loop over x unrolls them */
    e2m1_try(1.0f * d, a, &best_err, &best_val);
    e2m1_try(2.0f * d, a, &best_err, &best_val);
    e2m1_try(3.0f * d, a, &best_err, &best_val);
    e2m1_try(4.0f * d, a, &best_err, &best_val);
    e2m1_try(6.0f * d, a, &best_err, &best_val);
    e2m1_try(8.0f * d, a, &best_err, &best_val);
    e2m1_try(12.0f * d, a, &best_err, &best_val);
    uint32_t xb, vb;
    memcpy(&xb, &x, 4), memcpy(&vb, &best_val, 4);
    vb |= best_val != 0.0f ? xb & 0x80000000u : 0u; /* x's sign, but 0 stays +0 */
    memcpy(&best_val, &vb, 4);
    return best_val;
}

#define FP4_ROUND_LOOP(suffix, attr)                                                          \
    attr static void fp4_round_##suffix(const float *restrict x, float *restrict y, int n, float d) \
    {                                                                                         \
        for (int j = 0; j < n; j++) y[j] = e2m1_round(x[j], d);                               \
    }
FP4_ROUND_LOOP(plain, )
#ifdef KVQ_AVX2_CLONES
FP4_ROUND_LOOP(avx2, KVQ_TARGET_AVX2)
FP4_ROUND_LOOP(avx512, KVQ_TARGET_AVX512)
#endif

void kvq_fp4_round(const float *x, float *y, int n, float d) { KVQ_PICK_CLONE(fp4_round)(x, y, n, d); }

/* --------------------------------------------------------------- blocks */

void kvq_mxfp4_block_ref(const float *x, uint8_t *blk)
{
    uint8_t e = kvq_e8m0_mxfp4(absmax_of(x, KVQ_MXFP4_BLOCK));
    blk[0] = e;
    e2m1_pack(x, kvq_e8m0_half(e), KVQ_MXFP4_BLOCK, blk + 1);
}

void kvq_mxfp4_block_dequantize(const uint8_t *blk, float *y)
{
    e2m1_unpack(blk + 1, kvq_e8m0_half(blk[0]), KVQ_MXFP4_BLOCK, y);
}

float kvq_mxfp4_block_scale(const float *x)
{
    return kvq_e8m0_half(kvq_e8m0_mxfp4(kvq_absmax_lanes(x, KVQ_MXFP4_BLOCK, 8)));
}

float kvq_nvfp4_block_scale(const float *x, float g, int rne)
{
    float s = kvq_absmax_lanes(x, KVQ_NVFP4_BLOCK, 8) / 6.0f / g;
    return kvq_ue4m3_half(rne ? kvq_ue4m3_encode_rne(s) : kvq_ue4m3_encode(s)) * g;
}

float kvq_nvfp4_block_ref(const float *x, float g, int rne, uint8_t *scale, uint8_t *qs)
{
    /* ggml: ue = fp32_to_ue4m3(amax / 6.0f), g = 1; the second level divides it */
    float s = absmax_of(x, KVQ_NVFP4_BLOCK) / 6.0f / g;
    uint8_t ue = rne ? kvq_ue4m3_encode_rne(s) : kvq_ue4m3_encode(s);
    float d = kvq_ue4m3_half(ue) * g;
    *scale = ue;
    e2m1_pack(x, d, KVQ_NVFP4_BLOCK, qs);
    return d;
}

void kvq_nvfp4_block_dequantize(uint8_t scale, const uint8_t *qs, float g, float *y)
{
    e2m1_unpack(qs, kvq_ue4m3_half(scale) * g, KVQ_NVFP4_BLOCK, y);
}

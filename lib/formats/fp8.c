/* fp8.c — the OCP FP8 formats e4m3 (no infinities, largest finite 448) and
 * e5m2 (IEEE-like, largest finite 57344): the cast that the `fp8` family
 * (quant/fp8.c) and NVFP4's two-level scales (fp4.c) use.
 *
 * kvq_fp8_cast_ref is the definition: integer bit manipulation of the
 * float32, round to nearest with ties to the even code, saturating to the
 * largest finite value (CUDA's __NV_SATFINITE), subnormals kept.
 * kvq_fp8_quantize_array is the hot loop: the same rounding written without
 * branches so that it vectorises (compiled a second time for AVX2 and picked
 * at run time); tests check it against the reference on every float16 value
 * and on both sides of every rounding boundary. */
#include "../internal.h"
#include "../simd.h"
#include "formats.h"

#include <math.h>
#include <string.h>

/* --------------------------------------------------------------- the cast */

typedef struct fp8_format {
    int man_bits;       /* M: stored mantissa bits */
    int emin;           /* exponent of the smallest normal (1 − bias) */
    uint32_t fmax_bits; /* float32 bits of the largest finite value */
    float fmax;
} fp8_format;

static const fp8_format formats[] = {
    [KVQ_FP8_E4M3] = {.man_bits = 3, .emin = -6, .fmax_bits = 0x43E00000u, .fmax = 448.0f},
    [KVQ_FP8_E5M2] = {.man_bits = 2, .emin = -14, .fmax_bits = 0x47600000u, .fmax = 57344.0f},
};

static inline uint32_t f32_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline float bits_f32(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

float kvq_fp8_max(kvq_fp8_format format) { return formats[format].fmax; }

float kvq_fp8_cast_ref(float y, kvq_fp8_format format)
{
    const fp8_format *f = &formats[format];
    uint32_t u = f32_bits(y), sign = u & 0x80000000u, a = u & 0x7fffffffu;
    if (a > 0x7f800000u) return y;                        /* NaN stays NaN */
    if (a >= f->fmax_bits) return bits_f32(sign | f->fmax_bits); /* saturate (inf too) */
    int e = (int)(a >> 23) - 127; /* exponent of |y| (float32 subnormals: -127) */
    if (e >= f->emin) {
        /* a normal of the format: keep M mantissa bits, round half to even
         * (the code's last bit is the mantissa's); a carry moves to the next
         * binade, and nothing below fmax rounds beyond it */
        int drop = 23 - f->man_bits;
        uint32_t q = a >> drop, rem = a & ((1u << drop) - 1u), half = 1u << (drop - 1);
        if (rem > half || (rem == half && (q & 1u))) q++;
        return bits_f32(sign | (q << drop));
    }
    /* a subnormal of the format: q · 2^(emin − M) with q = m, the code's
     * mantissa; |y| = full · 2^(e − 23) */
    if (a < 0x00800000u) return bits_f32(sign); /* float32 subnormal: far below half a step */
    uint32_t full = (a & 0x7fffffu) | 0x800000u;
    int shift = f->emin - f->man_bits - e + 23; /* ≥ 24 − M */
    if (shift > 24) return bits_f32(sign);      /* below half the smallest subnormal */
    uint32_t q = full >> shift, rem = full & ((1u << shift) - 1u), half = 1u << (shift - 1);
    if (rem > half || (rem == half && (q & 1u))) q++; /* q = 2^M: the smallest normal */
    float v = (float)q * ldexpf(1.0f, f->emin - f->man_bits); /* exact */
    return bits_f32(sign | f32_bits(v));
}

/* fp8(v) without branches, for the hot loops.  Normals round in the
 * integer bits as above; below the smallest normal, adding 2^(emin − M + 23)
 * rounds |v| to a multiple of 2^(emin − M) in the FPU (nearest, ties to
 * even: the sum's last mantissa bit is q's), and subtracting it again is
 * exact.  ±inf saturates; NaN cannot occur here (finite x, finite s > 0). */
typedef struct fp8_consts {
    int drop;                        /* 23 − M */
    uint32_t keep, halfm1;           /* mantissa mask, half a step − 1 */
    uint32_t fmax_bits, min_normal;  /* float32 bits of fmax and 2^emin */
    float magic;                     /* 2^(emin − M + 23) */
} fp8_consts;

static fp8_consts fp8_consts_of(kvq_fp8_format format)
{
    const fp8_format *f = &formats[format];
    int drop = 23 - f->man_bits;
    return (fp8_consts){.drop = drop, .keep = ~((1u << drop) - 1u), .halfm1 = (1u << (drop - 1)) - 1u,
                        .fmax_bits = f->fmax_bits, .min_normal = (uint32_t)(f->emin + 127) << 23,
                        .magic = ldexpf(1.0f, f->emin - f->man_bits + 23)};
}

static inline __attribute__((always_inline)) float fp8_cast_fast(float v, fp8_consts k)
{
    uint32_t u = f32_bits(v), sign = u & 0x80000000u, a = u & 0x7fffffffu;
    a = a < k.fmax_bits ? a : k.fmax_bits;
    uint32_t normal = (a + k.halfm1 + ((a >> k.drop) & 1u)) & k.keep;
    uint32_t sub = f32_bits((bits_f32(a) + k.magic) - k.magic);
    uint32_t below = -(uint32_t)(a < k.min_normal); /* a mask, not a branch: the loop vectorises */
    return bits_f32(sign | (sub & below) | (normal & ~below));
}

/* The two hot loops, compiled plain and again for AVX2:
 * y = fp8(x / s)·s over n values, and over rows of D with a scale per column. */
#define FP8_LOOPS(suffix, attr)                                                                    \
    attr static void fp8_scaled_##suffix(const float *restrict x, float *restrict y, size_t n,    \
                                         float s, fp8_consts k)                                    \
    {                                                                                              \
        for (size_t i = 0; i < n; i++) y[i] = fp8_cast_fast(x[i] / s, k) * s;                      \
    }                                                                                              \
    attr static void fp8_columns_##suffix(const float *restrict x, float *restrict y, size_t rows, \
                                          size_t D, const float *restrict s, fp8_consts k)         \
    {                                                                                              \
        for (size_t t = 0; t < rows; t++)                                                          \
            for (size_t c = 0; c < D; c++)                                                         \
                y[t * D + c] = fp8_cast_fast(x[t * D + c] / s[c], k) * s[c];                       \
    }

FP8_LOOPS(plain, )
#ifdef KVQ_AVX2_CLONES
FP8_LOOPS(avx2, KVQ_TARGET_AVX2)
FP8_LOOPS(avx512, KVQ_TARGET_AVX512)
#endif

void kvq_fp8_quantize_array(const float *x, float *y, size_t n, float s, kvq_fp8_format format)
{
    KVQ_PICK_CLONE(fp8_scaled)(x, y, n, s, fp8_consts_of(format));
}

void kvq_fp8_quantize_columns(const float *x, float *y, size_t rows, size_t D, const float *s,
                                 kvq_fp8_format format)
{
    KVQ_PICK_CLONE(fp8_columns)(x, y, rows, D, s, fp8_consts_of(format));
}

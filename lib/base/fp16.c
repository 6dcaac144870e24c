/* fp16.c — IEEE binary16 <-> float32 conversion (round half to even).
 * The scalar functions are the definition; the array path uses F16C
 * (_mm256_cvtph_ps) when the CPU has it and is tested against the scalar one.
 * Also the finite check of float32 arrays that dump reads and the model's
 * weights and activations share. */
#include "../internal.h"
#include "../simd.h"

#include <math.h>
#include <string.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define KVQ_X86 1
#endif

static inline uint32_t f32_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline float bits_f32(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

uint16_t kvq_f32_to_f16(float x)
{
    uint32_t u = f32_bits(x);
    uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
    uint32_t exp = (u >> 23) & 0xffu;
    uint32_t man = u & 0x7fffffu;

    if (exp == 0xffu) /* inf or nan (keep a quiet nan) */
        return (uint16_t)(sign | 0x7c00u | (man ? 0x200u | (man >> 13) : 0u));
    int e = (int)exp - 127 + 15; /* rebiased exponent */
    if (e >= 31) return (uint16_t)(sign | 0x7c00u); /* overflow -> inf */
    if (e <= 0) {
        /* subnormal half (or zero): value = man_full * 2^(exp-150);
         * half subnormal unit is 2^-24, so shift by (126 - exp) - 13 + ... */
        if (e < -10) return sign; /* below half of the smallest subnormal: rounds to 0 */
        uint32_t full = man | 0x800000u;      /* 24-bit significand */
        int shift = 14 - e;                   /* bits to drop: 1 - e + 13 */
        uint32_t q = full >> shift;
        uint32_t rem = full & ((1u << shift) - 1u);
        uint32_t half = 1u << (shift - 1);
        if (rem > half || (rem == half && (q & 1u))) q++;
        return (uint16_t)(sign | q); /* q may carry into the smallest normal: correct */
    }
    uint32_t q = ((uint32_t)e << 10) | (man >> 13);
    uint32_t rem = man & 0x1fffu;
    if (rem > 0x1000u || (rem == 0x1000u && (q & 1u))) q++; /* may carry to inf: correct */
    return (uint16_t)(sign | q);
}

float kvq_f16_to_f32(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu;
    uint32_t man = h & 0x3ffu;
    if (exp == 0) {
        /* zero or subnormal: man * 2^-24, exact in float32 */
        float v = (float)man * 0x1p-24f;
        return sign ? -v : v;
    }
    if (exp == 31) /* inf, or NaN made quiet as IEEE conversions (and F16C) do */
        return bits_f32(sign | 0x7f800000u | (man ? 0x400000u | (man << 13) : 0u));
    return bits_f32(sign | ((exp - 15 + 127) << 23) | (man << 13));
}

float kvq_round_f16(float x) { return kvq_f16_to_f32(kvq_f32_to_f16(x)); }

void kvq_f16_to_f32_array_ref(const uint16_t *src, float *dst, size_t n)
{
    for (size_t i = 0; i < n; i++) dst[i] = kvq_f16_to_f32(src[i]);
}

#ifdef KVQ_X86
__attribute__((target("avx,f16c"))) static void f16_to_f32_f16c(const uint16_t *src, float *dst,
                                                               size_t n)
{
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m128i h = _mm_loadu_si128((const __m128i *)(src + i));
        _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(h));
    }
    for (; i < n; i++) dst[i] = kvq_f16_to_f32(src[i]);
}

__attribute__((target("avx,f16c"))) static void f32_to_f16_f16c(const float *src, uint16_t *dst,
                                                               size_t n)
{
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 v = _mm256_loadu_ps(src + i);
        _mm_storeu_si128((__m128i *)(dst + i), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
    }
    for (; i < n; i++) dst[i] = kvq_f32_to_f16(src[i]);
}

static int have_f16c(void)
{
    static int cached = -1;
    if (cached < 0) {
        __builtin_cpu_init();
        cached = __builtin_cpu_supports("f16c") && __builtin_cpu_supports("avx");
    }
    return cached;
}
#endif

void kvq_f16_to_f32_array(const uint16_t *src, float *dst, size_t n)
{
#ifdef KVQ_X86
    if (have_f16c()) {
        f16_to_f32_f16c(src, dst, n);
        return;
    }
#endif
    kvq_f16_to_f32_array_ref(src, dst, n);
}

void kvq_f32_to_f16_array(const float *src, uint16_t *dst, size_t n)
{
#ifdef KVQ_X86
    if (have_f16c()) {
        f32_to_f16_f16c(src, dst, n);
        return;
    }
#endif
    for (size_t i = 0; i < n; i++) dst[i] = kvq_f32_to_f16(src[i]);
}

/* Index of the first inf or NaN in x[0..n), or n: blocks are checked by a
 * loop without early exit (it vectorises: the largest |x| bit pattern,
 * which is at least inf's when one is not finite), then searched; compiled
 * plain and for AVX2 (the weights of a model are checked once each). */
KVQ_BODY size_t first_nonfinite_body(const float *x, size_t n)
{
    enum { BLOCK = 4096 };
    for (size_t b = 0; b < n; b += BLOCK) {
        size_t e = n - b < BLOCK ? n : b + BLOCK;
        int32_t worst = 0; /* |x| bit patterns fit in 31 bits: signed compares vectorise on every x86-64 */
        for (size_t i = b; i < e; i++) {
            int32_t u;
            memcpy(&u, &x[i], sizeof u);
            u &= 0x7fffffff;
            worst = u > worst ? u : worst;
        }
        if (worst >= 0x7f800000)
            for (size_t i = b; i < e; i++)
                if (!isfinite(x[i])) return i;
    }
    return n;
}

static size_t first_nonfinite_plain(const float *x, size_t n) { return first_nonfinite_body(x, n); }
#ifdef KVQ_AVX2_CLONES
KVQ_TARGET_AVX2 static size_t first_nonfinite_avx2(const float *x, size_t n) { return first_nonfinite_body(x, n); }
KVQ_TARGET_AVX512 static size_t first_nonfinite_avx512(const float *x, size_t n) { return first_nonfinite_body(x, n); }
#endif

size_t kvq_first_nonfinite(const float *x, size_t n) { return KVQ_PICK_CLONE(first_nonfinite)(x, n); }

/* test_fp16.c — fp16 conversion (round half to even), the F16C array path
 * against the scalar reference, the finite check at every SIMD level, and
 * the seeded generator. */
#include "simd.h"
#include "testutil.h"

#include <string.h>

START_TEST(every_half_round_trips)
{
    for (uint32_t h = 0; h < 65536; h++) {
        float f = kvq_f16_to_f32((uint16_t)h);
        if (isnan(f)) continue;
        ck_assert_uint_eq(kvq_f32_to_f16(f), h);
    }
}
END_TEST

START_TEST(rounding_hand_cases)
{
    /* spacing at 1 is 2^-10: a tie at 1 + 2^-11 goes to even (1) */
    ck_assert_float_eq(kvq_round_f16(1.0f + 0x1p-11f), 1.0f);
    ck_assert_float_eq(kvq_round_f16(1.0f + 3 * 0x1p-11f), 1.0f + 2 * 0x1p-10f);
    ck_assert_float_eq(kvq_round_f16(1.0f + 0x1p-11f + 0x1p-20f), 1.0f + 0x1p-10f);
    ck_assert_float_eq(kvq_round_f16(0.1f), 0.0999755859375f);
    ck_assert_float_eq(kvq_round_f16(65504.0f), 65504.0f);
    ck_assert_float_eq(kvq_round_f16(65519.99f), 65504.0f);
    ck_assert(isinf(kvq_round_f16(65520.0f))); /* the tie above 65504 rounds to inf */
    /* subnormals: unit 2^-24; 2^-25 is a tie -> 0, 3·2^-25 -> 2·2^-24 */
    ck_assert_float_eq(kvq_round_f16(0x1p-25f), 0.0f);
    ck_assert_float_eq(kvq_round_f16(3 * 0x1p-25f), 2 * 0x1p-24f);
    ck_assert_float_eq(kvq_round_f16(0x1p-24f), 0x1p-24f);
    ck_assert_float_eq(kvq_round_f16(-2.5f), -2.5f);
    ck_assert_uint_eq(kvq_f32_to_f16(-0.0f), 0x8000);
    ck_assert(isnan(kvq_f16_to_f32(kvq_f32_to_f16(NAN))));
    /* largest subnormal rounding up into the smallest normal */
    ck_assert_float_eq(kvq_round_f16(0x1p-14f - 0x1p-26f), 0x1p-14f);
}
END_TEST

START_TEST(array_paths_match_reference)
{
    uint16_t *h = malloc(65536 * sizeof *h);
    float *a = malloc(65536 * sizeof *a), *b = malloc(65536 * sizeof *b);
    for (uint32_t i = 0; i < 65536; i++) h[i] = (uint16_t)i;
    kvq_f16_to_f32_array(h, a, 65536);
    kvq_f16_to_f32_array_ref(h, b, 65536);
    ck_assert_int_eq(memcmp(a, b, 65536 * sizeof *a), 0); /* bitwise, NaN payloads too */
    /* f32 -> f16: random values over many binades, and ties */
    kvq_rng r;
    kvq_rng_init(&r, 1, 2, 3, 4);
    for (int i = 0; i < 65536; i++) {
        double e = -30 + 48 * kvq_rng_uniform(&r);
        a[i] = (float)(ldexp(kvq_rng_uniform(&r) + 0.5, (int)e) * (i % 2 ? -1 : 1));
        if (i % 7 == 0) a[i] = kvq_f16_to_f32((uint16_t)(i & 0x7bff)) + ldexp(1.0, -12); /* near ties */
    }
    kvq_f32_to_f16_array(a, h, 65536);
    for (int i = 0; i < 65536; i++) ck_assert_uint_eq(h[i], kvq_f32_to_f16(a[i]));
    free(h), free(a), free(b);
}
END_TEST

/* kvq_first_nonfinite at every SIMD level: the index of the first inf or
 * NaN, at the ends of the 4096-value blocks it checks at once and in a
 * second block, with a later one after it, or n when all are finite. */
START_TEST(first_nonfinite_at_every_level)
{
    const size_t lens[] = {0, 1, 7, 4095, 4096, 4097, 10000};
    const float bad[] = {NAN, INFINITY, -INFINITY};
    float *x = malloc(10000 * sizeof *x);
    ck_assert(x);
    for (int level = -1; level <= KVQ_SIMD_AVX512; level++) {
        kvq_simd_cap(level);
        for (size_t li = 0; li < sizeof lens / sizeof lens[0]; li++) {
            size_t n = lens[li], at[] = {0, n / 2, 4095, 4096, n - 1};
            for (size_t i = 0; i < n; i++) x[i] = (float)i * (i % 2 ? -1e30f : 1e-30f);
            ck_assert_uint_eq(kvq_first_nonfinite(x, n), n);
            for (size_t k = 0; n && k < sizeof at / sizeof at[0]; k++) {
                if (at[k] >= n) continue;
                float keep = x[at[k]], keep_last = x[n - 1];
                x[at[k]] = bad[k % 3];
                if (at[k] + 1 < n) x[n - 1] = bad[(k + 1) % 3]; /* a later one does not count */
                ck_assert_msg(kvq_first_nonfinite(x, n) == at[k], "level %d, n %zu: %zu, want %zu", level, n,
                              kvq_first_nonfinite(x, n), at[k]);
                x[at[k]] = keep, x[n - 1] = keep_last;
            }
        }
    }
    kvq_simd_cap(-1);
    free(x);
}
END_TEST

START_TEST(rng_is_reproducible_and_stream_separated)
{
    kvq_rng a, b, c;
    kvq_rng_init(&a, 42, 1, 2, 0);
    kvq_rng_init(&b, 42, 1, 2, 0);
    kvq_rng_init(&c, 42, 1, 2, 1);
    int same_c = 0;
    for (int i = 0; i < 1000; i++) {
        uint64_t x = kvq_rng_u64(&a), y = kvq_rng_u64(&b), z = kvq_rng_u64(&c);
        ck_assert(x == y);
        same_c += x == z;
    }
    ck_assert_int_lt(same_c, 2);
    /* uniform in [0,1), mean near 1/2; normal mean 0 var 1 */
    double su = 0, sn = 0, sn2 = 0;
    for (int i = 0; i < 100000; i++) {
        double u = kvq_rng_uniform(&a), n = kvq_rng_normal(&a);
        ck_assert(u >= 0 && u < 1);
        su += u, sn += n, sn2 += n * n;
    }
    ck_assert(fabs(su / 1e5 - 0.5) < 0.01);
    ck_assert(fabs(sn / 1e5) < 0.02);
    ck_assert(fabs(sn2 / 1e5 - 1) < 0.03);
    for (int i = 0; i < 1000; i++) ck_assert(kvq_rng_below(&a, 7) < 7);
}
END_TEST

int main(void)
{
    Suite *s = suite_create("fp16-rng");
    TCase *tc = tcase_create("core");
    tcase_add_test(tc, every_half_round_trips);
    tcase_add_test(tc, rounding_hand_cases);
    tcase_add_test(tc, array_paths_match_reference);
    tcase_add_test(tc, first_nonfinite_at_every_level);
    tcase_add_test(tc, rng_is_reproducible_and_stream_separated);
    suite_add_tcase(s, tc);
    return run_suite(s);
}

/* rng.c — kvq's seeded generator (docs/building-blocks.md#random-numbers).
 * xoshiro256** (Blackman & Vigna) with its state filled by splitmix64 from
 * the run seed and up to three stream indices (layer, head, tensor), so each
 * stream is reproducible and independent of thread scheduling. */
#include "../internal.h"

#include <math.h>

static uint64_t splitmix64(uint64_t *x)
{
    uint64_t z = (*x += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

void kvq_rng_init(kvq_rng *r, uint64_t seed, uint64_t a, uint64_t b, uint64_t c)
{
    /* Mix the indices into one 64-bit key, each through splitmix64, so that
     * (seed, a, b, c) tuples differing in any place give unrelated streams. */
    uint64_t x = seed;
    uint64_t k = splitmix64(&x);
    x = k ^ a;
    k = splitmix64(&x);
    x = k ^ b;
    k = splitmix64(&x);
    x = k ^ c;
    for (int i = 0; i < 4; i++) r->s[i] = splitmix64(&x);
}

uint64_t kvq_stream_of_name(const char *name)
{
    uint64_t h = 0xcbf29ce484222325ull; /* FNV-1a's offset basis and prime */
    for (const unsigned char *c = (const unsigned char *)name; *c; c++) h = (h ^ *c) * 0x100000001b3ull;
    return h | (1ull << 63);
}

static inline uint64_t rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }

uint64_t kvq_rng_u64(kvq_rng *r)
{
    uint64_t *s = r->s;
    uint64_t result = rotl(s[1] * 5, 7) * 9;
    uint64_t t = s[1] << 17;
    s[2] ^= s[0];
    s[3] ^= s[1];
    s[1] ^= s[2];
    s[0] ^= s[3];
    s[2] ^= t;
    s[3] = rotl(s[3], 45);
    return result;
}

double kvq_rng_uniform(kvq_rng *r) { return (double)(kvq_rng_u64(r) >> 11) * 0x1p-53; }

double kvq_rng_normal(kvq_rng *r)
{
    /* Box–Muller; one value per call keeps the stream position simple. */
    double u1 = 1.0 - kvq_rng_uniform(r); /* (0, 1] */
    double u2 = kvq_rng_uniform(r);
    return sqrt(-2.0 * log(u1)) * cos(2.0 * M_PI * u2);
}

uint64_t kvq_rng_below(kvq_rng *r, uint64_t n)
{
    if (n == 0) return 0;
    /* rejection sampling: drop the biased top range */
    uint64_t limit = UINT64_MAX - (UINT64_MAX % n);
    uint64_t x;
    do x = kvq_rng_u64(r);
    while (x >= limit);
    return x % n;
}

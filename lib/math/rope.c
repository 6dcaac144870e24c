/* rope.c — rotary position embedding (RoPE) as kvq-dump/1 describes it
 * (docs/dump-format.md): pairs (2i, 2i+1) for `interleaved`, (i, i+D/2) for `half`,
 * angle t·theta^(−2i/D) unless the dump gives explicit cos/sin tables.
 * Used by kvq-gen to make dumps and by the clustered-residual quantizer to
 * put key centres back at a position. */
#include "../internal.h"

#include <math.h>
#include <string.h>

/* The two channels of pair i. */
static inline void rope_pair(kvq_rope_style style, int D, int i, int *a, int *b)
{
    *a = style == KVQ_ROPE_HALF ? i : 2 * i;
    *b = style == KVQ_ROPE_HALF ? i + D / 2 : 2 * i + 1;
}

/* Rotates pair (a, b) of r by the angle with cosine c and sine s. */
static inline void rope_turn(float *r, int a, int b, double c, double s)
{
    double xa = r[a], xb = r[b];
    r[a] = (float)(xa * c - xb * s);
    r[b] = (float)(xa * s + xb * c);
}

void kvq_rope_apply(float *x, int T, int D, double theta, kvq_rope_style style)
{
    for (int t = 0; t < T; t++)
        for (int i = 0; i < D / 2; i++) {
            double ang = t * pow(theta, -2.0 * i / D);
            int a, b;
            rope_pair(style, D, i, &a, &b);
            rope_turn(x + (size_t)t * D, a, b, cos(ang), sin(ang));
        }
}

kvq_status kvq_rope_from_theta(kvq_rope *r, int T, int D, double theta, kvq_rope_style style,
                               kvq_error *err)
{
    memset(r, 0, sizeof *r);
    size_t n = (size_t)T * (size_t)(D / 2);
    r->cos = kvq_alloc_array(n ? n : 1, sizeof *r->cos);
    r->sin = kvq_alloc_array(n ? n : 1, sizeof *r->sin);
    if (!r->cos || !r->sin) {
        kvq_rope_free(r);
        return kvq_fail(err, KVQ_ERR_NOMEM, "out of memory for RoPE tables of %d x %d", T, D / 2);
    }
    for (int t = 0; t < T; t++)
        for (int i = 0; i < D / 2; i++) {
            double ang = t * pow(theta, -2.0 * i / D);
            r->cos[(size_t)t * (D / 2) + i] = cos(ang);
            r->sin[(size_t)t * (D / 2) + i] = sin(ang);
        }
    r->T = T, r->D = D, r->style = style;
    return KVQ_OK;
}

void kvq_rope_free(kvq_rope *r)
{
    if (!r) return;
    free(r->cos), free(r->sin);
    memset(r, 0, sizeof *r);
}

void kvq_rope_rotate(const kvq_rope *r, float *x, int t, int inverse)
{
    int half = r->D / 2;
    const double *c = r->cos + (size_t)t * half, *s = r->sin + (size_t)t * half;
    for (int i = 0; i < half; i++) {
        int a, b;
        rope_pair(r->style, r->D, i, &a, &b);
        rope_turn(x, a, b, c[i], inverse ? -s[i] : s[i]);
    }
}

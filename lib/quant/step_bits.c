/* step_bits.c — the stored bits of a plan step (kvq.h, kvq_step): codes,
 * scales and zeros, 16 per exact element.  On its own so that the executor
 * (plan.c), the U/A helpers (uniform.c) and the CUDA path all count with it
 * without importing one another. */
#include "../internal.h"
#include "quant.h"

double kvq_step_bits(const kvq_step *s, int H, int D, int h)
{
    double tokens = s->t1 > s->t0 ? (double)(s->t1 - s->t0) : 0.0;
    double sb = kvq_scale_bits(s->prec);
    switch (s->kind) {
    case KVQ_STEP_EXACT:
        return 16.0 * tokens * D;
    case KVQ_STEP_TOKEN: {
        int G = s->group > D ? D : s->group;
        int ngroups = (D + G - 1) / G;
        return tokens * ((double)D * s->bits + ngroups * 2.0 * sb);
    }
    case KVQ_STEP_ABSMAX: {
        int G = s->group == 0 || s->group > D ? D : s->group;
        int ngroups = (D + G - 1) / G;
        return tokens * ((double)D * s->bits + ngroups * sb);
    }
    case KVQ_STEP_CHANNEL: {
        int ngroups = s->t1 > s->t0 ? (int)(((long)s->t1 - s->t0 + s->group - 1) / s->group) : 0;
        return tokens * D * s->bits + (double)ngroups * D * 2.0 * sb;
    }
    case KVQ_STEP_TOKEN_LAYER: {
        /* each group's scale+zero bits go to the heads in proportion to the
         * elements they hold in it; the same for every token */
        size_t W = (size_t)H * D, G = (size_t)s->group > W ? W : (size_t)s->group;
        size_t a = (size_t)h * D, b = a + (size_t)D;
        double bits = tokens * D * s->bits;
        for (size_t c0 = 0; c0 < W; c0 += G) {
            size_t c1 = W - c0 < G ? W : c0 + G, n = c1 - c0;
            size_t lo = a > c0 ? a : c0, hi = b < c1 ? b : c1;
            if (hi > lo) bits += tokens * 2.0 * sb * (double)(hi - lo) / (double)n;
        }
        return bits;
    }
    }
    return 0.0;
}

double kvq_plan_bits(const kvq_plan *p, int tensor, int H, int D, int h)
{
    double bits = 0;
    for (int i = 0; i < p->nsteps[tensor]; i++) bits += kvq_step_bits(&p->step[tensor][i], H, D, h);
    return bits;
}

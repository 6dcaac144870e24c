/* alloc.c — the bit allocation of kvq-alloc (docs/models.md#kvq-alloc):
 * the exact optimum of the multiple-choice knapsack "one grid point per
 * layer, least predicted loss within a bit budget", by dynamic programming
 * over the layers on the Pareto frontier of (bits, loss) of partial
 * assignments. */
#include "../internal.h"

#include <math.h>
#include <string.h>

/* One partial assignment of layers 0..l: its summed weight and cost, the
 * choice of layer l and the state of layers 0..l−1 it extends. */
typedef struct alloc_state {
    double w, c;
    int choice, parent;
} alloc_state;

/* Is a (weight, cost) strictly better than b?  Lower cost, then lower
 * weight; equal in both: neither (the earlier one, whose choices come first
 * in lexicographic order, is kept). */
static int better(const alloc_state *a, const alloc_state *b)
{
    return a->c < b->c || (a->c == b->c && a->w < b->w);
}

static int by_weight(const void *pa, const void *pb)
{
    const alloc_state *a = pa, *b = pb;
    if (a->w != b->w) return a->w < b->w ? -1 : 1;
    if (a->c != b->c) return a->c < b->c ? -1 : 1;
    return 0;
}

/* The choices of layers 0..l of candidate s (parents in front[0..l−1]). */
static void choices_of(alloc_state *const *front, int l, const alloc_state *s, int *out)
{
    out[l] = s->choice;
    for (int k = l - 1, p = s->parent; k >= 0; k--) {
        out[k] = front[k][p].choice;
        p = front[k][p].parent;
    }
}

/* Among candidates of equal weight and cost, the one whose choices come
 * first lexicographically (the lower grid index per layer, in layer order). */
static size_t lex_first(alloc_state *const *front, int l, const alloc_state *c, size_t i0, size_t i1, int *va,
                        int *vb)
{
    size_t best = i0;
    choices_of(front, l, &c[best], va);
    for (size_t i = i0 + 1; i < i1; i++) {
        choices_of(front, l, &c[i], vb);
        int k = 0;
        while (k <= l && va[k] == vb[k]) k++;
        if (k <= l && vb[k] < va[k]) {
            best = i;
            memcpy(va, vb, (size_t)(l + 1) * sizeof *va);
        }
    }
    return best;
}

kvq_status kvq_alloc_solve(int L, int G, const double *cost, const double *weight, double capacity, int *choice,
                           double *min_weight, kvq_error *err)
{
    if (min_weight) *min_weight = NAN; /* set on every path: callers read it after a failure */
    if (L <= 0 || G <= 0) return kvq_fail(err, KVQ_ERR_USAGE, "allocation: expected layers and grid points");
    double wmin = 0;
    for (int l = 0; l < L; l++) {
        double m = INFINITY;
        for (int g = 0; g < G; g++) {
            double w = weight[(size_t)l * G + g], c = cost[(size_t)l * G + g];
            if (!isfinite(w) || w < 0 || isnan(c))
                return kvq_fail(err, KVQ_ERR_USAGE, "allocation: layer %d, point %d: weight %g, cost %g", l, g, w, c);
            if (w < m) m = w;
        }
        wmin += m;
    }
    if (min_weight) *min_weight = wmin;
    if (!(wmin <= capacity))
        return kvq_fail(err, KVQ_ERR_USAGE, "allocation: the cheapest assignment needs %.17g, more than %.17g", wmin,
                        capacity);
    /* frontier[l]: the non-dominated states after layer l, by weight */
    alloc_state **front = calloc((size_t)L, sizeof *front);
    size_t *nfront = calloc((size_t)L, sizeof *nfront);
    alloc_state *cand = NULL;
    int *va = kvq_alloc_array((size_t)L, sizeof *va), *vb = kvq_alloc_array((size_t)L, sizeof *vb);
    kvq_status st = front && nfront && va && vb ? KVQ_OK : kvq_fail(err, KVQ_ERR_NOMEM, "out of memory");
    for (int l = 0; l < L && !st; l++) {
        size_t nprev = l ? nfront[l - 1] : 1, n = 0;
        cand = kvq_alloc_array(nprev * (size_t)G, sizeof *cand);
        if (!cand) {
            st = kvq_fail(err, KVQ_ERR_NOMEM, "out of memory for %zu partial allocations", nprev * (size_t)G);
            break;
        }
        for (size_t p = 0; p < nprev; p++)
            for (int g = 0; g < G; g++) {
                alloc_state s = {.w = weight[(size_t)l * G + g], .c = cost[(size_t)l * G + g], .choice = g,
                                 .parent = (int)p};
                if (l) s.w = front[l - 1][p].w + s.w, s.c = front[l - 1][p].c + s.c;
                if (s.w <= capacity) cand[n++] = s; /* weights only grow: beyond capacity stays beyond */
            }
        qsort(cand, n, sizeof *cand, by_weight);
        /* keep a state only if no lighter-or-equal state is at least as good;
         * of states equal in both, the lexicographically first */
        size_t kept = 0;
        for (size_t i = 0, j; i < n; i = j) {
            for (j = i + 1; j < n && cand[j].w == cand[i].w && cand[j].c == cand[i].c;) j++;
            alloc_state s = cand[j - i > 1 ? lex_first(front, l, cand, i, j, va, vb) : i];
            if (!kept || better(&s, &cand[kept - 1])) cand[kept++] = s;
        }
        front[l] = cand, nfront[l] = kept, cand = NULL;
    }
    if (!st) {
        const alloc_state *f = front[L - 1];
        size_t best = 0;
        for (size_t i = 1; i < nfront[L - 1]; i++)
            if (better(&f[i], &f[best])) best = i;
        for (int l = L - 1; l >= 0; l--) {
            choice[l] = front[l][best].choice;
            best = (size_t)front[l][best].parent;
        }
    }
    for (int l = 0; front && l < L; l++) free(front[l]);
    free(front), free(nfront), free(cand), free(va), free(vb);
    return st;
}

kvq_status kvq_alloc_mix_text(const char *const *specs, const int *choice, int L, char *buf, size_t len,
                              kvq_error *err)
{
    size_t o = (size_t)snprintf(buf, len, "mix(");
#define PUT(...) (o += (size_t)snprintf(buf + (o < len ? o : len), o < len ? len - o : 0, __VA_ARGS__))
    int first_item = 1;
    for (int l = 0; l < L; l++) {
        int c = choice[l], used = 0;
        for (int k = 0; k < l; k++) used |= choice[k] == c;
        if (used) continue; /* this spec's ranges were written at its first layer */
        PUT("%s", first_item ? "" : ";");
        first_item = 0;
        int first_range = 1;
        for (int a = l; a < L; a++) {
            if (choice[a] != c) continue;
            int b = a;
            while (b + 1 < L && choice[b + 1] == c) b++;
            if (b == L - 1 && b > a) PUT("%s%d-", first_range ? "" : ",", a);
            else if (b == a) PUT("%s%d", first_range ? "" : ",", a);
            else PUT("%s%d-%d", first_range ? "" : ",", a, b);
            first_range = 0;
            a = b;
        }
        PUT("=%s", specs[c]);
    }
    PUT(")");
#undef PUT
    if (o < len) return KVQ_OK;
    return kvq_fail(err, KVQ_ERR_USAGE, "an allocation's mix(...) spec needs %zu characters, more than %zu", o,
                    len ? len - 1 : 0);
}

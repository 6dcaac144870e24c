/* alloc.c — the bit allocation of kvq-alloc (docs/models.md#kvq-alloc):
 * the exact optimum of the multiple-choice knapsack "one grid point per
 * layer, least predicted loss within a bit budget", by dynamic programming
 * over the layers on the Pareto frontier of (bits, loss) of partial
 * assignments. */
#include "../internal.h"
#include "analysis.h"

#include <errno.h>
#include <math.h>
#include <stdlib.h>
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

/* ------------------------------------------------- the sensitivity table */

static const char *const table_cols[] = {"layer", "spec", "k_bits", "v_bits", "bits", "dnll", "dnll_se", "run"};
enum { NCOLS = sizeof table_cols / sizeof table_cols[0] };

int kvq_alloc_table_columns(const char *const **cols)
{
    *cols = table_cols;
    return NCOLS;
}

kvq_status kvq_alloc_point_init(kvq_alloc_point *pt, int L, kvq_error *err)
{
    pt->k_bits = calloc((size_t)L, sizeof(double)), pt->v_bits = calloc((size_t)L, sizeof(double));
    pt->dnll = calloc((size_t)L, sizeof(double)), pt->dnll_se = calloc((size_t)L, sizeof(double));
    if (pt->k_bits && pt->v_bits && pt->dnll && pt->dnll_se) return KVQ_OK;
    kvq_alloc_point_free(pt);
    return kvq_fail(err, KVQ_ERR_NOMEM, "out of memory");
}

void kvq_alloc_point_free(kvq_alloc_point *pt)
{
    free(pt->k_bits), free(pt->v_bits), free(pt->dnll), free(pt->dnll_se);
    pt->k_bits = pt->v_bits = pt->dnll = pt->dnll_se = NULL;
}

kvq_status kvq_alloc_stored_bits(const kvq_spec *spec, const kvq_model_info *in, int T, kvq_calib *calib,
                                 uint64_t seed, int nthreads, double *k_bits, double *v_bits, kvq_error *err)
{
    int H = in->n_kv_heads, Hq = in->n_heads, D = in->head_dim;
    size_t n = (size_t)H * T * D, nq = (size_t)Hq * T * D;
    float *x = malloc(nq * sizeof *x), *k = malloc(n * sizeof *k), *v = malloc(n * sizeof *v);
    kvq_acc *acc = calloc((size_t)H, sizeof *acc);
    kvq_status st = x && k && v && acc ? KVQ_OK : kvq_fail(err, KVQ_ERR_NOMEM, "out of memory");
    /* a synthetic layer: the bits depend on the shapes alone (a tokens(...)
     * selector keeps as many tokens whichever it picks) */
    for (size_t i = 0; !st && i < nq; i++) x[i] = (float)(sin(0.37 * (double)i) * (1.0 + (double)(i % 7)));
    kvq_arrays_opts ao = {.spec = spec->text, .seed = seed, .nthreads = nthreads, .rope_theta = in->rope_theta,
                          .rope_style = in->rope_style, .calib = calib, .query = x, .num_heads = Hq};
    if (!st) st = kvq_quantize_arrays(&ao, H, T, D, x, x, x, k, v, acc, err);
    if (!st) {
        double kb = 0, vb = 0, ne = (double)n;
        for (int h = 0; h < H; h++) kb += acc[h].k.bits, vb += acc[h].v.bits;
        *k_bits = kb / ne, *v_bits = vb / ne;
    }
    free(x), free(k), free(v), free(acc);
    return st;
}

/* A refusal of a table's content: KVQ_ERR_FORMAT, or `code`, and what mends it. */
#define REFUSE(code, how, ...) (*fix = (how), kvq_fail(err, code, __VA_ARGS__))

kvq_status kvq_alloc_table_read(const char *path, const char *data, size_t size, int whole, const char *run,
                                kvq_alloc_point *pts, int np, int L, size_t *keep, kvq_alloc_fix *fix, kvq_error *err)
{
    kvq_csv t;
    *keep = 0, *fix = KVQ_ALLOC_FIX_NONE;
    kvq_status st = kvq_csv_parse(path, data, size, &t, err);
    if (st) return st;
    if (!t.nrec) { /* empty, or a torn header */
        if (whole) st = kvq_fail(err, KVQ_ERR_FORMAT, "%s: empty: not a sensitivity table (kvq-alloc --shard writes "
                                 "them)", path);
        goto done;
    }
    int ok = t.ncols == NCOLS;
    for (int k = 0; ok && k < NCOLS; k++) ok = !strcmp(kvq_csv_at(&t, 0, k), table_cols[k]);
    if (!ok) {
        st = REFUSE(KVQ_ERR_FORMAT, KVQ_ALLOC_FIX_REMOVE, "%s: line 1: expected the header layer,spec,k_bits,v_bits,"
                    "bits,dnll,dnll_se,run (a table of this kvq-alloc)", path);
        goto done;
    }
    *keep = t.end[0];
    int cur = -1, seen = 0;
    size_t pass_begin = t.end[0];
    for (size_t r = 1; r < t.nrec; r++) {
        const char *layer_s = kvq_csv_at(&t, r, 0), *spec_s = kvq_csv_at(&t, r, 1), *run_s = kvq_csv_at(&t, r, 7);
        double v[5];
        int spec_i = -1;
        for (int i = 0; i < np; i++)
            if (!strcmp(pts[i].spec.text, spec_s)) spec_i = i;
        char *end;
        errno = 0;
        long layer = strtol(layer_s, &end, 10);
        if (errno || end == layer_s || *end || layer < 0 || layer > L - 1 || spec_i < 0) {
            st = REFUSE(KVQ_ERR_USAGE, KVQ_ALLOC_FIX_REMOVE, "%s: line %zu: not a row of this run's grid and model "
                        "(a spec of its grid, a layer 0..%d)", path, r + 1, L - 1);
            goto done;
        }
        if (strcmp(run_s, run)) {
            st = REFUSE(KVQ_ERR_USAGE, KVQ_ALLOC_FIX_OPTIONS, "%s: line %zu: measured in another run (run %s, this "
                        "run %s: another model, text, token limit, policy, stride, chunking, seed or "
                        "calibration)", path, r + 1, run_s, run);
            goto done;
        }
        for (int k = 0; k < 5; k++) {
            const char *cell = kvq_csv_at(&t, r, 2 + k);
            if (k == 4 && !*cell) { v[k] = NAN; continue; } /* dnll_se of a single position */
            if (kvq_csv_number(cell, &v[k])) {
                st = REFUSE(KVQ_ERR_FORMAT, KVQ_ALLOC_FIX_REMOVE, "%s: line %zu: %s '%s': expected a finite number",
                            path, r + 1, table_cols[2 + k], cell);
                goto done;
            }
        }
        if (v[4] < 0) { /* a standard error (NaN: a single position) */
            st = REFUSE(KVQ_ERR_FORMAT, KVQ_ALLOC_FIX_REMOVE, "%s: line %zu: dnll_se %.17g: a standard error is not "
                        "negative", path, r + 1, v[4]);
            goto done;
        }
        kvq_alloc_point *pt = &pts[spec_i];
        if (!(fabs(v[0] - pt->want_k) <= 1e-9 * pt->want_k) || !(fabs(v[1] - pt->want_v) <= 1e-9 * pt->want_v) ||
            v[2] != (v[0] + v[1]) / 2) {
            st = REFUSE(KVQ_ERR_FORMAT, KVQ_ALLOC_FIX_REMOVE, "%s: line %zu: bits %.17g, %.17g, %.17g: %s stores "
                        "%.17g and %.17g on this model's layers (bits their mean)", path, r + 1, v[0], v[1], v[2],
                        pt->spec.text, pt->want_k, pt->want_v);
            goto done;
        }
        if (spec_i != cur) {
            if (cur >= 0) break; /* a pass left unfinished: what follows is not read */
            cur = spec_i, seen = 0, pass_begin = t.end[r - 1];
        }
        if (layer != seen) break; /* out of order */
        if (pt->done) {
            st = kvq_fail(err, KVQ_ERR_FORMAT, "%s: line %zu: %s's pass is in %s%s twice", path, r + 1, pt->spec.text,
                          pt->from ? pt->from : path, pt->from && whole && strcmp(pt->from, path) ? " and here:" : "");
            goto done;
        }
        pt->k_bits[layer] = v[0], pt->v_bits[layer] = v[1], pt->dnll[layer] = v[3], pt->dnll_se[layer] = v[4];
        if (++seen == L) {
            pt->done = 1, cur = -1, *keep = t.end[r];
            if (whole) pt->from = path, pt->rows = data + pass_begin, pt->rows_len = t.end[r] - pass_begin;
        }
    }
    if (whole && (*keep != size || t.torn))
        st = REFUSE(KVQ_ERR_FORMAT, KVQ_ALLOC_FIX_RESUME, "%s: ends in an unfinished pass: its run did not finish",
                    path);
done:
    kvq_csv_free(&t);
    return st;
}
#undef REFUSE

kvq_status kvq_alloc_table_rows(const kvq_alloc_point *pt, int L, const char *run, char **buf, size_t *len,
                                kvq_error *err)
{
    *buf = NULL, *len = 0;
    FILE *ms = open_memstream(buf, len);
    kvq_report *r = ms ? kvq_rows_new(ms, KVQ_FMT_CSV, table_cols, NCOLS, 2) : NULL;
    kvq_status st = r ? KVQ_OK : KVQ_ERR_NOMEM;
    if (r) kvq_report_omit_header(r);
    for (int l = 0; l < L && !st; l++) {
        char ls[16];
        snprintf(ls, sizeof ls, "%d", l);
        kvq_cell row[NCOLS] = {{.text = ls}, {.text = pt->spec.text}, {.num = pt->k_bits[l], .is_num = 1},
                               {.num = pt->v_bits[l], .is_num = 1},
                               {.num = (pt->k_bits[l] + pt->v_bits[l]) / 2, .is_num = 1},
                               {.num = pt->dnll[l], .is_num = 1}, {.num = pt->dnll_se[l], .is_num = 1},
                               {.text = run}};
        st = kvq_rows_add(r, row);
    }
    if (r) {
        kvq_status f = kvq_report_finish(r);
        if (!st) st = f;
    }
    if ((ms && fclose(ms)) || !ms || st) {
        free(*buf);
        *buf = NULL, *len = 0;
        return kvq_fail(err, KVQ_ERR_NOMEM, "out of memory");
    }
    return KVQ_OK;
}

/* ------------------------------------------------------ the allocations */

void kvq_allocation_free(kvq_allocation *a)
{
    free(a->cost), free(a->weight), free(a->choice), free(a->mix), free(a->pred), free(a->ubits), free(a->upred);
    free(a->fits);
    memset(a, 0, sizeof *a);
}

kvq_status kvq_alloc_plan(const kvq_alloc_point *pts, int np, int L, double layer_elems, const double *budgets,
                          int nbudgets, kvq_allocation *a, kvq_error *err)
{
    memset(a, 0, sizeof *a);
    a->L = L, a->np = np, a->nbudgets = nbudgets, a->bad_budget = -1, a->min_bits = NAN;
    a->cost = calloc((size_t)L * np, sizeof *a->cost), a->weight = calloc((size_t)L * np, sizeof *a->weight);
    a->choice = calloc((size_t)L * nbudgets, sizeof *a->choice), a->mix = calloc((size_t)nbudgets, sizeof *a->mix);
    a->pred = calloc((size_t)nbudgets, sizeof *a->pred);
    a->ubits = calloc((size_t)np, sizeof *a->ubits), a->upred = calloc((size_t)np, sizeof *a->upred);
    a->fits = calloc((size_t)np, sizeof *a->fits);
    const char **texts = calloc((size_t)np, sizeof *texts); /* the grid points' specs, for the mix(...) texts */
    kvq_status st = KVQ_OK;
    if (!a->cost || !a->weight || !a->choice || !a->mix || !a->pred || !a->ubits || !a->upred || !a->fits || !texts) {
        st = kvq_fail(err, KVQ_ERR_NOMEM, "out of memory");
        goto done;
    }
    /* the knapsack per budget: weights are each layer's stored bits per token
     * (K and V of its KV heads); every layer of these models has the same
     * size, so the budget's capacity is B times their sum */
    double ntot = a->elems = layer_elems * L;
    for (int i = 0; i < np; i++) texts[i] = pts[i].spec.text;
    for (int l = 0; l < L; l++)
        for (int i = 0; i < np; i++) {
            a->cost[(size_t)l * np + i] = pts[i].dnll[l];
            a->weight[(size_t)l * np + i] = (pts[i].k_bits[l] + pts[i].v_bits[l]) / 2 * layer_elems;
        }
    double bmax = 0;
    for (int b = 0; b < nbudgets; b++) {
        double wmin = NAN;
        int *choice = a->choice + (size_t)b * L;
        bmax = budgets[b] > bmax ? budgets[b] : bmax;
        st = kvq_alloc_solve(L, np, a->cost, a->weight, budgets[b] * ntot, choice, &wmin, err);
        if (st == KVQ_ERR_USAGE && wmin > budgets[b] * ntot) {
            a->bad_budget = b, a->min_bits = wmin / ntot;
            st = kvq_fail(err, KVQ_ERR_USAGE, "budget %g: below the cheapest allocation of this grid, %.6g bits per "
                          "element", budgets[b], a->min_bits);
        }
        if (st) goto done;
        char text[KVQ_SPEC_MAX + 8];
        kvq_error perr = {0};
        if (kvq_alloc_mix_text(texts, choice, L, text, sizeof text, &perr) || kvq_spec_parse(text, &a->mix[b], &perr)) {
            a->bad_budget = b;
            st = kvq_fail(err, KVQ_ERR_UNSUPPORTED, "budget %g: the allocation does not fit a spec of %d characters",
                          budgets[b], KVQ_SPEC_MAX - 1);
            goto done;
        }
        for (int l = 0; l < L; l++) a->pred[b] += a->cost[(size_t)l * np + choice[l]];
    }
    /* the uniform points: their bits, predicted loss, and whether they fit the largest budget */
    for (int i = 0; i < np; i++) {
        double w = 0, s = 0;
        for (int l = 0; l < L; l++) w += a->weight[(size_t)l * np + i], s += a->cost[(size_t)l * np + i];
        a->ubits[i] = w / ntot, a->upred[i] = s, a->fits[i] = w <= bmax * ntot;
    }
done:
    free(texts);
    return st;
}

int kvq_alloc_best_uniform(const kvq_allocation *a, double budget, const double *nll)
{
    int best = -1; /* least measured nll, then fewer bits */
    for (int i = 0; i < a->np; i++) {
        if (!a->fits[i] || a->ubits[i] * a->elems > budget * a->elems) continue;
        if (best < 0 || nll[i] < nll[best] || (nll[i] == nll[best] && a->ubits[i] < a->ubits[best])) best = i;
    }
    return best;
}

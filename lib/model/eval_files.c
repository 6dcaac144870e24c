/* eval_files.c — kvq-eval's result files (docs/models.md#shards): its rows'
 * columns and cells, a corpus shard's rows (each window's, with the sums
 * the run pools, the run's fingerprint and the shard's I/N), the check of
 * a shard file a run resumes, and the merge of shard files: read, checked
 * (rows of another run, of another shard, duplicated, or with sums no run
 * writes are refused) and pooled in window order as one run pools them
 * (kvq_eval_sums_add), so the merged rows are the unsharded run's, bit for
 * bit.  The tool keeps the files' locking, writing and provenance. */
#include "model.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

static const char *const EVAL_COLS[] = {"model", "tokens", "quantizer", "spec", "policy", "layer", "k_bits", "v_bits",
                                        "nll_ref", "nll", "dnll", "ppl_ratio", "kl", "top1", "positions", "dnll_se",
                                        "cache_tokens",
                                        /* a shard's rows: the window and what the run pools */
                                        "run", "shard", "window", "windows", "nll_ref_sum", "nll_sum", "kl_sum",
                                        "top1_sum",
                                        "k_bits_sum", "v_bits_sum", "elements", "d_n", "d_mean", "d_m2",
                                        "cache_tokens_sum"};
enum { NSTD = KVQ_EVAL_NCOLS, NSHARD = 32, NSUMS = 11, C_MODEL = 0, C_TOKENS, C_QUANT, C_SPEC, C_POLICY, C_LAYER,
       C_POS = 14, C_RUN = 17, C_SHARD, C_WINDOW, C_WINDOWS, C_SUMS };
/* the sums' columns, from C_SUMS on */
enum { S_NLL_REF, S_NLL, S_KL, S_TOP1, S_K_BITS, S_V_BITS, S_ELEMENTS, S_D_N, S_D_MEAN, S_D_M2, S_CACHE };

_Static_assert(sizeof EVAL_COLS / sizeof EVAL_COLS[0] == NSHARD, "EVAL_COLS holds NSHARD names");
const char *const *kvq_eval_columns(int shard, int *ncols)
{
    *ncols = shard ? NSHARD : NSTD;
    return EVAL_COLS;
}

void kvq_eval_cells(const kvq_eval_row *r, const kvq_eval_item *it, double nll_ref, const char *tokens, char *npos,
                    kvq_cell *row)
{
    double dnll = it->nll - nll_ref;
    snprintf(npos, 16, "%d", it->positions);
    kvq_cell c[NSTD] = {{.text = r->model},
                        {.text = tokens},
                        {.text = r->quantizer},
                        {.text = r->spec},
                        {.text = r->policy},
                        {.text = r->layer},
                        {.num = it->k_bits, .is_num = 1},
                        {.num = it->v_bits, .is_num = 1},
                        {.num = nll_ref, .is_num = 1},
                        {.num = it->nll, .is_num = 1},
                        {.num = dnll, .is_num = 1},
                        {.num = exp(dnll), .is_num = 1},
                        {.num = it->kl, .is_num = 1},
                        {.num = it->top1, .is_num = 1},
                        {.text = npos},
                        {.num = it->dnll_se, .is_num = 1},
                        {.num = it->cache_tokens, .is_num = 1}};
    memcpy(row, c, sizeof c);
}

/* ---------------------------------------------------------------- shards */

/* Row rec of a shard file as this run writes it: its identity cells. */
static int same_item(const kvq_csv *t, size_t rec, const kvq_eval_row *r, const char *chunk)
{
    const char *want[] = {r->model, chunk, r->quantizer, r->spec, r->policy, r->layer};
    for (int c = 0; c < 6; c++)
        if (strcmp(kvq_csv_at(t, rec, c), want[c])) return 0;
    return 1;
}

/* Window w's rows at record rec of a resumed file: this run's, this shard's, each item's in order. */
static kvq_status shard_check_window(const kvq_eval_shard_id *s, const kvq_csv *t, size_t rec, int w, kvq_error *err)
{
    const char *path = s->path;
    char cs[16];
    snprintf(cs, sizeof cs, "%d", s->chunk);
    for (int i = 0; i < s->nitems; i++) {
        double wv, nv;
        size_t r = rec + (size_t)i, line = r + 1;
        if (strcmp(kvq_csv_at(t, r, C_RUN), s->run))
            return kvq_fail(err, KVQ_ERR_FORMAT, "%s: line %zu: of another run (fingerprint %s, this run's %s: another "
                            "model, text, --chunk, --chunks, --context, --policy, --stride, --seed or --calib); remove "
                            "it or choose another -o", path, line, kvq_csv_at(t, r, C_RUN), s->run);
        if (strcmp(kvq_csv_at(t, r, C_SHARD), s->shard))
            return kvq_fail(err, KVQ_ERR_FORMAT, "%s: line %zu: a row of shard %s, this run is shard %s; remove it or "
                            "choose another -o", path, line, kvq_csv_at(t, r, C_SHARD), s->shard);
        if (!same_item(t, r, &s->rows[i], cs) || kvq_csv_number(kvq_csv_at(t, r, C_WINDOW), &wv) || wv != w ||
            kvq_csv_number(kvq_csv_at(t, r, C_WINDOWS), &nv) || nv != s->nwin)
            return kvq_fail(err, KVQ_ERR_FORMAT, "%s: line %zu is not window %d of this run's shard (the same model, "
                            "--chunk, --shard and -q in the same order); remove it or drop --resume", path, line, w);
    }
    return KVQ_OK;
}

kvq_status kvq_eval_shard_resume(const kvq_eval_shard_id *s, const kvq_csv *t, int w0, int w1, int *done, size_t *keep,
                                 kvq_error *err)
{
    int ok = t->ncols == NSHARD, w = w0;
    kvq_status st;
    for (int c = 0; ok && c < NSHARD; c++) ok = !strcmp(kvq_csv_at(t, 0, c), EVAL_COLS[c]);
    if (!ok)
        return kvq_fail(err, KVQ_ERR_FORMAT, "%s: not a kvq-eval shard (its header is not a shard's); remove it or "
                        "choose another -o", s->path);
    size_t rec = 1;
    for (; rec + (size_t)s->nitems <= t->nrec && w < w1; w++, rec += (size_t)s->nitems)
        if ((st = shard_check_window(s, t, rec, w, err))) return st;
    if (rec < t->nrec && w == w1)
        return kvq_fail(err, KVQ_ERR_FORMAT, "%s: has more rows than this shard's %d windows; remove it or drop "
                        "--resume", s->path, w1 - w0);
    *done = w - w0;
    *keep = t->end[(size_t)*done * (size_t)s->nitems]; /* the header and the whole windows */
    return KVQ_OK;
}

kvq_status kvq_eval_shard_rows(const kvq_eval_shard_id *s, int window, const kvq_eval_sums *ref,
                               const kvq_eval_sums *sums, FILE *f)
{
    char tokens[16], windows[16], wi[16], npos[16];
    kvq_report *r = kvq_rows_new(f, KVQ_FMT_CSV, EVAL_COLS, NSHARD, 6);
    if (!r) return KVQ_ERR_NOMEM;
    kvq_report_omit_header(r);
    snprintf(tokens, sizeof tokens, "%d", s->chunk);
    snprintf(windows, sizeof windows, "%d", s->nwin);
    snprintf(wi, sizeof wi, "%d", window);
    double nll_ref = ref->nll / ref->positions;
    kvq_status st = KVQ_OK;
    for (int i = 0; i < s->nitems && !st; i++) {
        kvq_eval_item it = {0};
        kvq_eval_item_finish(&it, &sums[i]);
        kvq_cell row[NSHARD];
        kvq_eval_cells(&s->rows[i], &it, nll_ref, tokens, npos, row);
        const kvq_eval_sums *w = &sums[i];
        double v[] = {ref->nll,  w->nll, w->kl,     w->top1, w->k_bits,      w->v_bits,
                      w->elements, w->d_n, w->d_mean, w->d_m2, w->cache_tokens};
        row[C_RUN] = (kvq_cell){.text = s->run};
        row[C_SHARD] = (kvq_cell){.text = s->shard};
        row[C_WINDOW] = (kvq_cell){.text = wi};
        row[C_WINDOWS] = (kvq_cell){.text = windows};
        for (int k = 0; k < NSUMS; k++) row[C_SUMS + k] = (kvq_cell){.num = v[k], .is_num = 1};
        st = kvq_rows_add(r, row);
    }
    kvq_status fst = st ? (kvq_report_discard(r), KVQ_OK) : kvq_report_finish(r);
    return st ? st : fst;
}

/* ----------------------------------------------------------------- merge */

typedef struct shard_win {
    int file;   /* which shard */
    size_t rec; /* its first row */
    long window;
} shard_win;

static int cmp_win(const void *a, const void *b)
{
    const shard_win *x = a, *y = b;
    return x->window < y->window ? -1 : x->window > y->window;
}

/* Why a row's sums cannot come from a run (v: the NSUMS sums, pos: its
 * positions), or NULL: counts are whole and within the positions, NLL, KL,
 * bits and the squared deviations are not negative (every sum is finite:
 * kvq_csv_number refuses the rest). */
static const char *impossible_sums(const double v[NSUMS], double pos)
{
    if (v[S_NLL_REF] < 0 || v[S_NLL] < 0) return "a negative NLL sum";
    if (v[S_KL] < 0) return "a negative KL sum (each position's KL is at least 0)";
    if (v[S_TOP1] < 0 || v[S_TOP1] > pos || v[S_TOP1] != floor(v[S_TOP1]))
        return "top1_sum is not a count of its positions";
    if (v[S_K_BITS] < 0 || v[S_V_BITS] < 0 || v[S_ELEMENTS] < 0) return "negative bits or elements";
    if (v[S_D_N] < 0 || v[S_D_N] > pos || v[S_D_N] != floor(v[S_D_N])) return "d_n is not a count of its positions";
    if (v[S_D_M2] < 0) return "a negative d_m2 (a sum of squares)";
    if (v[S_CACHE] < 0) return "a negative cache_tokens_sum";
    return NULL;
}

/* A merge of shard files: what is read and checked, step by step. */
struct kvq_eval_merge {
    const char *const *files;
    int nfiles, nitems, r0; /* r0: the first shard with a window, the reference */
    long nwin, nshard;
    kvq_csv *t;  /* [nfiles] */
    int *holder; /* [nshard]: the file that holds shard I, or -1 */
    shard_win *win;
    size_t nw;
    kvq_eval_sums *acc, ref; /* [nitems] and the exact model's, pooled in window order */
    char tokens[32];         /* the run's tokens: a window's times the windows */
    kvq_error *err;
};

/* Every file read: a kvq-eval shard of this version, finished; the reference found. */
static kvq_status merge_read(kvq_eval_merge *m)
{
    size_t total = 0;
    for (int f = 0; f < m->nfiles; f++) {
        kvq_csv *t = &m->t[f];
        kvq_status st = kvq_csv_read(m->files[f], t, m->err);
        if (st) return st;
        int ok = t->nrec > 0 && t->ncols == NSHARD;
        for (int c = 0; ok && c < NSHARD; c++) ok = !strcmp(kvq_csv_at(t, 0, c), EVAL_COLS[c]);
        if (!ok)
            return kvq_fail(m->err, KVQ_ERR_FORMAT, "%s: not a kvq-eval shard of this version (kvq-eval --shard "
                            "writes them)", m->files[f]);
        if (t->torn)
            return kvq_fail(m->err, KVQ_ERR_FORMAT, "%s: ends in an unfinished row: its run did not finish "
                            "(continue it with --resume)", m->files[f]);
        if (m->r0 < 0 && t->nrec > 1) m->r0 = f;
        total += t->nrec;
    }
    if (m->r0 < 0) return kvq_fail(m->err, KVQ_ERR_FORMAT, "%s: no window in the shards", m->files[0]);
    if (!(m->win = calloc(total + 1, sizeof *m->win))) return kvq_fail(m->err, KVQ_ERR_NOMEM, "out of memory");
    return KVQ_OK;
}

/* The row at rec of file f against the reference's run and the file's shard
 * I/N (*si, *sn: set by its first row; each shard in one file). */
static kvq_status merge_shard_of(kvq_eval_merge *m, int f, size_t rec, long *si, long *sn)
{
    const kvq_csv *t = &m->t[f];
    const char *sh = kvq_csv_at(t, rec, C_SHARD), *run0 = kvq_csv_at(&m->t[m->r0], 1, C_RUN);
    const char *file = m->files[f], *ref = m->files[m->r0];
    if (strcmp(kvq_csv_at(t, rec, C_RUN), run0))
        return kvq_fail(m->err, KVQ_ERR_FORMAT, "%s: line %zu: of another run than %s's (fingerprint %s, not %s: "
                        "another model, text or options): not shards of one run", file, rec + 1, ref,
                        kvq_csv_at(t, rec, C_RUN), run0);
    if (*si < 0) {
        if (kvq_shard_parse(sh, si, sn))
            return kvq_fail(m->err, KVQ_ERR_FORMAT, "%s: line %zu: shard '%s': expected I/N", file, rec + 1, sh);
        if (m->nshard < 0) {
            m->nshard = *sn;
            if (!(m->holder = malloc((size_t)m->nshard * sizeof *m->holder)))
                return kvq_fail(m->err, KVQ_ERR_NOMEM, "out of memory");
            for (long k = 0; k < m->nshard; k++) m->holder[k] = -1;
        }
        if (*sn != m->nshard)
            return kvq_fail(m->err, KVQ_ERR_FORMAT, "%s: line %zu: shard %s of a run in %ld shards; %s's has %ld: not "
                            "shards of one run", file, rec + 1, sh, *sn, ref, m->nshard);
        if (m->holder[*si] >= 0)
            return kvq_fail(m->err, KVQ_ERR_FORMAT, "shard %s is in %s and %s: duplicated", sh,
                            m->files[m->holder[*si]], file);
        m->holder[*si] = f;
    }
    char want[48];
    snprintf(want, sizeof want, "%ld/%ld", *si, *sn);
    if (strcmp(sh, want))
        return kvq_fail(m->err, KVQ_ERR_FORMAT, "%s: line %zu: shard '%s' in a file of shard %s: not one shard's "
                        "output", file, rec + 1, sh, want);
    return KVQ_OK;
}

/* Window rows rec .. rec + n of file f against the reference's: the same items, one run, one exact stream. */
static kvq_status merge_window_rows(kvq_eval_merge *m, int f, size_t rec, size_t n)
{
    const kvq_csv *t = &m->t[f], *t0 = &m->t[m->r0];
    const char *file = m->files[f], *ref = m->files[m->r0];
    for (size_t i = 0; i < n; i++) {
        for (int c = 0; c <= C_LAYER; c++)
            if (strcmp(kvq_csv_at(t, rec + i, c), kvq_csv_at(t0, 1 + i, c)))
                return kvq_fail(m->err, KVQ_ERR_FORMAT, "%s: line %zu: %s '%s' where %s has '%s': not shards of one "
                                "run", file, rec + i + 1, EVAL_COLS[c], kvq_csv_at(t, rec + i, c), ref,
                                kvq_csv_at(t0, 1 + i, c));
        for (int c = C_RUN; c <= C_WINDOWS; c++)
            if (strcmp(kvq_csv_at(t, rec + i, c), kvq_csv_at(t, rec, c)))
                return kvq_fail(m->err, KVQ_ERR_FORMAT, "%s: line %zu: %s '%s' in a window whose first row has '%s'",
                                file, rec + i + 1, EVAL_COLS[c], kvq_csv_at(t, rec + i, c), kvq_csv_at(t, rec, c));
        if (strcmp(kvq_csv_at(t, rec + i, C_SUMS + S_NLL_REF), kvq_csv_at(t, rec, C_SUMS + S_NLL_REF)))
            return kvq_fail(m->err, KVQ_ERR_FORMAT, "%s: line %zu: nll_ref_sum differs from its window's first row's "
                            "(one exact stream per window)", file, rec + i + 1);
    }
    return KVQ_OK;
}

/* The window starting at rec of file f (shard si/sn): a window of the run's
 * count within the shard's share, the reference's items, one run and one
 * exact stream; *wv its index, *n its rows. */
static kvq_status merge_window(kvq_eval_merge *m, int f, size_t rec, long si, long sn, long *wv, size_t *n)
{
    const kvq_csv *t = &m->t[f], *t0 = &m->t[m->r0];
    const char *file = m->files[f], *ref = m->files[m->r0];
    double w, nv;
    if (kvq_csv_number(kvq_csv_at(t, rec, C_WINDOW), &w) || w < 0 || w != floor(w) ||
        kvq_csv_number(kvq_csv_at(t, rec, C_WINDOWS), &nv) || nv < 1 || nv != floor(nv) || w >= nv)
        return kvq_fail(m->err, KVQ_ERR_FORMAT, "%s: line %zu: expected a window below the number of windows", file,
                        rec + 1);
    if (m->nwin < 0) m->nwin = (long)nv;
    if ((long)nv != m->nwin)
        return kvq_fail(m->err, KVQ_ERR_FORMAT, "%s: line %zu: a run of %ld windows; %s's has %ld: not shards of one "
                        "run", file, rec + 1, (long)nv, ref, m->nwin);
    long lo = m->nwin * si / sn, hi = m->nwin * (si + 1) / sn; /* shard I's windows, as kvq-eval splits them */
    if ((long)w < lo || (long)w >= hi)
        return kvq_fail(m->err, KVQ_ERR_FORMAT, "%s: line %zu: window %ld is not one of shard %s's (%ld..%ld)", file,
                        rec + 1, (long)w, kvq_csv_at(t, rec, C_SHARD), lo, hi - 1);
    *wv = (long)w, *n = 0;
    while (rec + *n < t->nrec && !strcmp(kvq_csv_at(t, rec + *n, C_WINDOW), kvq_csv_at(t, rec, C_WINDOW))) ++*n;
    if (!m->nitems) m->nitems = (int)*n;
    if ((int)*n != m->nitems)
        return kvq_fail(m->err, KVQ_ERR_FORMAT, "%s: window %ld has %zu rows, window %s of %s has %d: not shards of "
                        "one run (or an unfinished window)", file, (long)w, *n, kvq_csv_at(t0, 1, C_WINDOW), ref,
                        m->nitems);
    return merge_window_rows(m, f, rec, *n);
}

/* Every file's windows indexed (m->win), sorted, each once, covering the run. */
static kvq_status merge_index(kvq_eval_merge *m)
{
    kvq_status st;
    for (int f = 0; f < m->nfiles; f++) {
        long si = -1, sn = -1, wv = 0;
        size_t n = 0;
        for (size_t rec = 1; rec < m->t[f].nrec; rec += n) {
            if ((st = merge_shard_of(m, f, rec, &si, &sn)) || (st = merge_window(m, f, rec, si, sn, &wv, &n)))
                return st;
            m->win[m->nw++] = (shard_win){f, rec, wv};
        }
    }
    qsort(m->win, m->nw, sizeof *m->win, cmp_win);
    for (size_t k = 0; k < m->nw; k++) {
        if (k && m->win[k].window == m->win[k - 1].window)
            return kvq_fail(m->err, KVQ_ERR_FORMAT, "window %ld is in %s and %s: duplicated", m->win[k].window,
                            m->files[m->win[k - 1].file], m->files[m->win[k].file]);
        if (m->win[k].window != (long)k)
            return kvq_fail(m->err, KVQ_ERR_FORMAT, "window %zu of %ld is in no shard: the shards do not cover the run "
                            "(a shard missing or unfinished?)", k, m->nwin);
    }
    if ((long)m->nw != m->nwin)
        return kvq_fail(m->err, KVQ_ERR_FORMAT, "windows %zu..%ld of %ld are in no shard: a shard missing or "
                        "unfinished", m->nw, m->nwin - 1, m->nwin);
    return KVQ_OK;
}

/* Row rec of file f's sums (and its positions), checked to be sums a run writes. */
static kvq_status merge_row_sums(kvq_eval_merge *m, int f, size_t rec, double v[NSUMS], double *pos)
{
    const kvq_csv *tf = &m->t[f];
    const char *file = m->files[f];
    for (int c = 0; c < NSUMS; c++)
        if (kvq_csv_number(kvq_csv_at(tf, rec, C_SUMS + c), &v[c]))
            return kvq_fail(m->err, KVQ_ERR_FORMAT, "%s: line %zu: %s: expected a finite number", file, rec + 1,
                            EVAL_COLS[C_SUMS + c]);
    if (kvq_csv_number(kvq_csv_at(tf, rec, C_POS), pos) || *pos < 1 || *pos != floor(*pos))
        return kvq_fail(m->err, KVQ_ERR_FORMAT, "%s: line %zu: positions: expected a positive count", file, rec + 1);
    const char *why = impossible_sums(v, *pos);
    if (why) return kvq_fail(m->err, KVQ_ERR_FORMAT, "%s: line %zu: %s: not sums a run writes", file, rec + 1, why);
    return KVQ_OK;
}

/* The windows' sums pooled in window order, as one run pools them. */
static kvq_status merge_sums(kvq_eval_merge *m)
{
    if (!(m->acc = calloc((size_t)m->nitems, sizeof *m->acc))) return kvq_fail(m->err, KVQ_ERR_NOMEM, "out of memory");
    for (size_t k = 0; k < m->nw; k++)
        for (int i = 0; i < m->nitems; i++) {
            double v[NSUMS], pos;
            kvq_status st = merge_row_sums(m, m->win[k].file, m->win[k].rec + (size_t)i, v, &pos);
            if (st) return st;
            if (i == 0) kvq_eval_sums_add(&m->ref, &(kvq_eval_sums){.nll = v[S_NLL_REF], .positions = pos});
            kvq_eval_sums w = {.nll = v[S_NLL], .kl = v[S_KL], .top1 = v[S_TOP1], .positions = pos,
                               .k_bits = v[S_K_BITS], .v_bits = v[S_V_BITS], .elements = v[S_ELEMENTS],
                               .d_n = v[S_D_N], .d_mean = v[S_D_MEAN], .d_m2 = v[S_D_M2],
                               .cache_tokens = v[S_CACHE]};
            kvq_eval_sums_add(&m->acc[i], &w);
        }
    double chunk;
    if (kvq_csv_number(kvq_csv_at(&m->t[m->r0], 1, C_TOKENS), &chunk))
        return kvq_fail(m->err, KVQ_ERR_FORMAT, "%s: line 2: tokens: expected a number", m->files[m->r0]);
    snprintf(m->tokens, sizeof m->tokens, "%.0f", chunk * (double)m->nwin);
    return KVQ_OK;
}

kvq_status kvq_eval_merge_open(const char *const *files, int nfiles, kvq_eval_merge **out, kvq_error *err)
{
    *out = NULL;
    kvq_eval_merge *m = calloc(1, sizeof *m);
    if (!m || !(m->t = calloc((size_t)(nfiles > 0 ? nfiles : 1), sizeof *m->t)))
        return free(m), kvq_fail(err, KVQ_ERR_NOMEM, "out of memory");
    *m = (kvq_eval_merge){.files = files, .nfiles = nfiles, .r0 = -1, .nwin = -1, .nshard = -1, .t = m->t, .err = err};
    kvq_status st = nfiles > 0 ? KVQ_OK : kvq_fail(err, KVQ_ERR_USAGE, "no shard files given");
    if (st || (st = merge_read(m)) || (st = merge_index(m)) || (st = merge_sums(m))) {
        kvq_eval_merge_free(m);
        return st;
    }
    m->err = NULL;
    *out = m;
    return KVQ_OK;
}

long kvq_eval_merge_windows(const kvq_eval_merge *m) { return m->nwin; }

int kvq_eval_merge_items(const kvq_eval_merge *m) { return m->nitems; }

kvq_status kvq_eval_merge_rows(const kvq_eval_merge *m, kvq_report *rep)
{
    const kvq_csv *t0 = &m->t[m->r0];
    char npos[16];
    double nll_ref = m->ref.nll / m->ref.positions;
    for (int i = 0; i < m->nitems; i++) {
        kvq_eval_item item = {0};
        kvq_eval_item_finish(&item, &m->acc[i]);
        kvq_eval_row id = {.model = kvq_csv_at(t0, 1 + (size_t)i, C_MODEL),
                           .quantizer = kvq_csv_at(t0, 1 + (size_t)i, C_QUANT),
                           .spec = kvq_csv_at(t0, 1 + (size_t)i, C_SPEC),
                           .policy = kvq_csv_at(t0, 1 + (size_t)i, C_POLICY)};
        snprintf(id.layer, sizeof id.layer, "%s", kvq_csv_at(t0, 1 + (size_t)i, C_LAYER));
        kvq_cell row[NSTD];
        kvq_eval_cells(&id, &item, nll_ref, m->tokens, npos, row);
        kvq_status st = kvq_rows_add(rep, row);
        if (st) return st;
    }
    return KVQ_OK;
}

void kvq_eval_merge_free(kvq_eval_merge *m)
{
    if (!m) return;
    for (int f = 0; m->t && f < m->nfiles; f++) kvq_csv_free(&m->t[f]);
    free(m->t), free(m->win), free(m->acc), free(m->holder), free(m);
}

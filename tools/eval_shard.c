/* eval_shard.c — kvq-eval's rows, and corpus runs across machines
 * (docs/models.md#shards): `--chunk N --shard I/S` evaluates a contiguous
 * share of the windows and appends each window's rows to OUT as it
 * finishes (locked, fsynced; --resume continues after the last whole
 * window), with the exact sums the run pools, the run's fingerprint and
 * the shard's I/N; `--merge` adds the shards' sums in window order, as one
 * run adds them (kvq_eval_sums_add), so the merged rows are the unsharded
 * run's, bit for bit.  Both refuse rows of another run (model, text,
 * options), of another shard, duplicated, or with sums no run writes. */
#include "cli.h"

#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

static const char *const EVAL_COLS[] = {"model", "tokens", "quantizer", "spec", "policy", "layer", "k_bits", "v_bits",
                                        "nll_ref", "nll", "dnll", "ppl_ratio", "kl", "top1", "positions", "dnll_se",
                                        "cache_tokens",
                                        /* a shard's rows: the window and what the run pools */
                                        "run", "shard", "window", "windows", "nll_ref_sum", "nll_sum", "kl_sum", "top1_sum",
                                        "k_bits_sum", "v_bits_sum", "elements", "d_n", "d_mean", "d_m2",
                                        "cache_tokens_sum"};
enum { NSTD = CLI_EVAL_NCOLS, NSHARD = 32, NSUMS = 11, C_MODEL = 0, C_TOKENS, C_QUANT, C_SPEC, C_POLICY, C_LAYER, C_POS = 14,
       C_RUN = 17, C_SHARD, C_WINDOW, C_WINDOWS, C_SUMS };
/* the sums' columns, from C_SUMS on */
enum { S_NLL_REF, S_NLL, S_KL, S_TOP1, S_K_BITS, S_V_BITS, S_ELEMENTS, S_D_N, S_D_MEAN, S_D_M2, S_CACHE };

_Static_assert(sizeof EVAL_COLS / sizeof EVAL_COLS[0] == NSHARD, "EVAL_COLS holds NSHARD names");
const char *const *cli_eval_columns(int shard, int *ncols)
{
    *ncols = shard ? NSHARD : NSTD;
    return EVAL_COLS;
}

void cli_eval_cells(const cli_eval_row *r, const kvq_eval_item *it, double nll_ref, const char *tokens,
                    char *npos, kvq_cell *row)
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

struct cli_eval_shard {
    const char *prog, *path, *run, *shard;
    int fd;
    const cli_eval_row *rows;
    int nitems, chunk, nwin;
    long whole; /* whole windows in OUT (what an interrupted run keeps) */
};

/* Row i of window w of a shard file as this run would write it: its identity cells. */
static int same_item(const kvq_csv *t, size_t rec, const cli_eval_row *r, const char *chunk)
{
    const char *want[] = {r->model, chunk, r->quantizer, r->spec, r->policy, r->layer};
    for (int c = 0; c < 6; c++)
        if (strcmp(kvq_csv_at(t, rec, c), want[c])) return 0;
    return 1;
}

/* A shard's OUT opened for writing and locked: new, or with resume an
 * existing regular file.  CLI_OK with s->fd, or the exit code after printing. */
static int shard_lock(cli_eval_shard *s, int resume, int *exists)
{
    const char *prog = s->prog, *path = s->path;
    struct stat st;
    *exists = stat(path, &st) == 0;
    if (*exists && !resume)
        return cli_error(prog, "%s: exists; continue its windows with --resume, or choose another -o (nothing is "
                         "overwritten)", path), CLI_RUNTIME;
    if (*exists && !S_ISREG(st.st_mode))
        return cli_error(prog, "%s: not a regular file (a shard's OUT is read back, cut and appended to)", path),
               CLI_RUNTIME;
    if ((s->fd = open(path, O_WRONLY | O_CREAT | O_CLOEXEC, 0666)) < 0)
        return cli_error(prog, "%s: cannot write: %s", path, strerror(errno)), CLI_RUNTIME;
    if (!flock(s->fd, LOCK_EX | LOCK_NB)) return CLI_OK; /* before reading: another run may be about to cut it */
    if (errno == EWOULDBLOCK)
        cli_error(prog, "%s: another kvq-eval run is writing it (it holds the lock); wait for it or choose another -o",
                  path);
    else cli_error(prog, "%s: cannot lock: %s", path, strerror(errno));
    return CLI_RUNTIME;
}

/* Window w's rows at record rec of a resumed OUT: this run's, this shard's, each item's in order. */
static int shard_check_window(const cli_eval_shard *s, const kvq_csv *t, size_t rec, int w)
{
    const char *prog = s->prog, *path = s->path;
    char cs[16];
    snprintf(cs, sizeof cs, "%d", s->chunk);
    for (int i = 0; i < s->nitems; i++) {
        double wv, nv;
        size_t r = rec + (size_t)i, line = r + 1;
        if (strcmp(kvq_csv_at(t, r, C_RUN), s->run))
            return cli_error(prog, "%s: line %zu: of another run (fingerprint %s, this run's %s: another model, text, "
                             "--chunk, --chunks, --context, --policy, --stride, --seed or --calib); remove it or "
                             "choose another -o", path, line, kvq_csv_at(t, r, C_RUN), s->run), CLI_RUNTIME;
        if (strcmp(kvq_csv_at(t, r, C_SHARD), s->shard))
            return cli_error(prog, "%s: line %zu: a row of shard %s, this run is shard %s; remove it or choose "
                             "another -o", path, line, kvq_csv_at(t, r, C_SHARD), s->shard), CLI_RUNTIME;
        if (!same_item(t, r, &s->rows[i], cs) || kvq_csv_number(kvq_csv_at(t, r, C_WINDOW), &wv) || wv != w ||
            kvq_csv_number(kvq_csv_at(t, r, C_WINDOWS), &nv) || nv != s->nwin)
            return cli_error(prog, "%s: line %zu is not window %d of this run's shard (the same model, --chunk, "
                             "--shard and -q in the same order); remove it or drop --resume", path, line, w),
                   CLI_RUNTIME;
    }
    return CLI_OK;
}

/* --resume: the header, then whole windows w0.. of this run's items in
 * order; *done: those windows, *keep: the bytes they end at. */
static int shard_resume(cli_eval_shard *s, const kvq_csv *t, int w0, int w1, int *done, size_t *keep)
{
    int ok = t->ncols == NSHARD, w = w0, rc = CLI_OK;
    for (int c = 0; ok && c < NSHARD; c++) ok = !strcmp(kvq_csv_at(t, 0, c), EVAL_COLS[c]);
    if (!ok)
        return cli_error(s->prog, "%s: not a kvq-eval shard (its header is not a shard's); remove it or choose "
                         "another -o", s->path), CLI_RUNTIME;
    size_t rec = 1;
    for (; rec + (size_t)s->nitems <= t->nrec && w < w1; w++, rec += (size_t)s->nitems)
        if ((rc = shard_check_window(s, t, rec, w))) return rc;
    if (rec < t->nrec && w == w1)
        return cli_error(s->prog, "%s: has more rows than this shard's %d windows; remove it or drop --resume", s->path,
                         w1 - w0), CLI_RUNTIME;
    *done = w - w0;
    *keep = t->end[(size_t)*done * (size_t)s->nitems]; /* the header and the whole windows */
    s->whole = *done;
    return CLI_OK;
}

/* OUT cut after its whole windows (keep bytes) and positioned there; a new one gets its header. */
static int shard_start(cli_eval_shard *s, int exists, size_t keep)
{
    if (exists && ftruncate(s->fd, (off_t)keep))
        return cli_error(s->prog, "%s: cannot cut its unfinished window: %s", s->path, strerror(errno)), CLI_RUNTIME;
    if (lseek(s->fd, (off_t)keep, SEEK_SET) < 0)
        return cli_error(s->prog, "%s: cannot seek: %s", s->path, strerror(errno)), CLI_RUNTIME;
    if (keep) return CLI_OK;
    if (cli_write_csv_header(s->prog, s->path, s->fd, EVAL_COLS, NSHARD, 6)) return CLI_RUNTIME;
    if (fsync(s->fd)) return cli_error(s->prog, "%s: write failed: %s", s->path, strerror(errno)), CLI_RUNTIME;
    return CLI_OK;
}

int cli_eval_shard_open(const char *prog, const char *path, int resume, const char *run, const char *shard,
                        const cli_eval_row *rows, int nitems, int chunk, int nwin, int w0, int w1, int *done,
                        cli_eval_shard **out)
{
    *out = NULL, *done = 0;
    cli_eval_shard *s = calloc(1, sizeof *s);
    if (!s) return cli_error(prog, "out of memory"), CLI_RUNTIME;
    *s = (cli_eval_shard){.prog = prog, .path = path, .run = run, .shard = shard, .fd = -1, .rows = rows,
                          .nitems = nitems, .chunk = chunk, .nwin = nwin};
    kvq_csv t = {0};
    kvq_error err = {0};
    size_t keep = 0;
    int exists, rc = shard_lock(s, resume, &exists);
    if (!rc && exists && kvq_csv_read(path, &t, &err)) rc = cli_fail(prog, &err);
    if (!rc && t.nrec) rc = shard_resume(s, &t, w0, w1, done, &keep);
    if (!rc) rc = shard_start(s, exists, keep);
    kvq_csv_free(&t);
    if (!rc) return *out = s, CLI_OK;
    if (s->fd >= 0) close(s->fd);
    free(s);
    return rc;
}

static kvq_status fail(kvq_error *err, kvq_status st, const char *path, int window, const char *why)
{
    err->status = st;
    snprintf(err->msg, sizeof err->msg, "%s: window %d: %s", path, window, why);
    return st;
}

kvq_status cli_eval_shard_window(void *ud, int window, const kvq_eval_sums *ref, const kvq_eval_sums *sums,
                                 kvq_error *err)
{
    cli_eval_shard *s = ud;
    char *buf = NULL, tokens[16], windows[16], wi[16], npos[16];
    size_t len = 0;
    FILE *ms = open_memstream(&buf, &len);
    kvq_report *r = ms ? kvq_rows_new(ms, KVQ_FMT_CSV, EVAL_COLS, NSHARD, 6) : NULL;
    kvq_status st = r ? KVQ_OK : KVQ_ERR_NOMEM;
    if (r) kvq_report_omit_header(r);
    snprintf(tokens, sizeof tokens, "%d", s->chunk);
    snprintf(windows, sizeof windows, "%d", s->nwin);
    snprintf(wi, sizeof wi, "%d", window);
    double nll_ref = ref->nll / ref->positions;
    for (int i = 0; i < s->nitems && !st; i++) {
        kvq_eval_item it = {0};
        kvq_eval_item_finish(&it, &sums[i]);
        kvq_cell row[NSHARD];
        cli_eval_cells(&s->rows[i], &it, nll_ref, tokens, npos, row);
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
    if (r) {
        kvq_status f = kvq_report_finish(r);
        if (!st) st = f;
    }
    if (ms && fclose(ms) && !st) st = KVQ_ERR_NOMEM;
    if (st) {
        free(buf);
        return fail(err, st, s->path, window, "out of memory for its rows");
    }
    /* one write and an fsync a window: after a crash OUT holds whole windows and at most a torn one */
    if (cli_write_all(s->fd, buf, len) || fsync(s->fd)) {
        char why[256];
        snprintf(why, sizeof why, "write failed: %s", strerror(errno));
        free(buf);
        return fail(err, KVQ_ERR_IO, s->path, window, why);
    }
    free(buf);
    cli_interrupt_count(++s->whole);
    return KVQ_OK;
}

int cli_eval_shard_close(cli_eval_shard *s)
{
    if (!s) return CLI_OK;
    int rc = CLI_OK;
    if (close(s->fd)) {
        cli_error(s->prog, "%s: write failed: %s", s->path, strerror(errno));
        rc = CLI_RUNTIME;
    }
    free(s);
    return rc;
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
typedef struct eval_merge {
    const char *prog;
    char **files;
    int nfiles, nitems, r0; /* r0: the first shard with a window, the reference */
    long nwin, nshard;
    kvq_csv *t;  /* [nfiles] */
    int *holder; /* [nshard]: the file that holds shard I, or -1 */
    shard_win *win;
    size_t nw;
    kvq_eval_sums *acc, ref; /* [nitems] and the exact model's, pooled in window order */
} eval_merge;

/* Every file read: a kvq-eval shard of this version, finished; the reference found. */
static int merge_read(eval_merge *m)
{
    kvq_error err = {0};
    size_t total = 0;
    for (int f = 0; f < m->nfiles; f++) {
        kvq_csv *t = &m->t[f];
        if (kvq_csv_read(m->files[f], t, &err)) return cli_fail(m->prog, &err);
        int ok = t->nrec > 0 && t->ncols == NSHARD;
        for (int c = 0; ok && c < NSHARD; c++) ok = !strcmp(kvq_csv_at(t, 0, c), EVAL_COLS[c]);
        if (!ok)
            return cli_error(m->prog, "%s: not a kvq-eval shard of this version (kvq-eval --shard writes them)",
                             m->files[f]), CLI_RUNTIME;
        if (t->torn)
            return cli_error(m->prog, "%s: ends in an unfinished row: its run did not finish (continue it with "
                             "--resume)", m->files[f]), CLI_RUNTIME;
        if (m->r0 < 0 && t->nrec > 1) m->r0 = f;
        total += t->nrec;
    }
    if (m->r0 < 0) return cli_error(m->prog, "%s: no window in the shards", m->files[0]), CLI_RUNTIME;
    if (!(m->win = calloc(total + 1, sizeof *m->win))) return cli_error(m->prog, "out of memory"), CLI_RUNTIME;
    return CLI_OK;
}

/* The row at rec of file f against the reference's run and the file's shard
 * I/N (*si, *sn: set by its first row; each shard in one file). */
static int merge_shard_of(eval_merge *m, int f, size_t rec, long *si, long *sn)
{
    const kvq_csv *t = &m->t[f];
    const char *sh = kvq_csv_at(t, rec, C_SHARD), *run0 = kvq_csv_at(&m->t[m->r0], 1, C_RUN);
    const char *prog = m->prog, *file = m->files[f], *ref = m->files[m->r0];
    if (strcmp(kvq_csv_at(t, rec, C_RUN), run0))
        return cli_error(prog, "%s: line %zu: of another run than %s's (fingerprint %s, not %s: another model, text "
                         "or options): not shards of one run", file, rec + 1, ref, kvq_csv_at(t, rec, C_RUN), run0),
               CLI_RUNTIME;
    if (*si < 0) {
        if (cli_parse_shard(sh, si, sn))
            return cli_error(prog, "%s: line %zu: shard '%s': expected I/N", file, rec + 1, sh), CLI_RUNTIME;
        if (m->nshard < 0) {
            m->nshard = *sn;
            if (!(m->holder = malloc((size_t)m->nshard * sizeof *m->holder)))
                return cli_error(prog, "out of memory"), CLI_RUNTIME;
            for (long k = 0; k < m->nshard; k++) m->holder[k] = -1;
        }
        if (*sn != m->nshard)
            return cli_error(prog, "%s: line %zu: shard %s of a run in %ld shards; %s's has %ld: not shards of one "
                             "run", file, rec + 1, sh, *sn, ref, m->nshard), CLI_RUNTIME;
        if (m->holder[*si] >= 0)
            return cli_error(prog, "shard %s is in %s and %s: duplicated", sh, m->files[m->holder[*si]], file),
                   CLI_RUNTIME;
        m->holder[*si] = f;
    }
    char want[48];
    snprintf(want, sizeof want, "%ld/%ld", *si, *sn);
    if (strcmp(sh, want))
        return cli_error(prog, "%s: line %zu: shard '%s' in a file of shard %s: not one shard's output", file, rec + 1,
                         sh, want), CLI_RUNTIME;
    return CLI_OK;
}

/* The window starting at rec of file f (shard si/sn): a window of the run's
 * count within the shard's share, the reference's items, one run and one
 * exact stream; *wv its index, *n its rows. */
static int merge_window(eval_merge *m, int f, size_t rec, long si, long sn, long *wv, size_t *n)
{
    const kvq_csv *t = &m->t[f], *t0 = &m->t[m->r0];
    const char *prog = m->prog, *file = m->files[f], *ref = m->files[m->r0];
    double w, nv;
    if (kvq_csv_number(kvq_csv_at(t, rec, C_WINDOW), &w) || w < 0 || w != floor(w) ||
        kvq_csv_number(kvq_csv_at(t, rec, C_WINDOWS), &nv) || nv < 1 || nv != floor(nv) || w >= nv)
        return cli_error(prog, "%s: line %zu: expected a window below the number of windows", file, rec + 1),
               CLI_RUNTIME;
    if (m->nwin < 0) m->nwin = (long)nv;
    if ((long)nv != m->nwin)
        return cli_error(prog, "%s: line %zu: a run of %ld windows; %s's has %ld: not shards of one run", file,
                         rec + 1, (long)nv, ref, m->nwin), CLI_RUNTIME;
    long lo = m->nwin * si / sn, hi = m->nwin * (si + 1) / sn; /* shard I's windows, as kvq-eval splits them */
    if ((long)w < lo || (long)w >= hi)
        return cli_error(prog, "%s: line %zu: window %ld is not one of shard %s's (%ld..%ld)", file, rec + 1, (long)w,
                         kvq_csv_at(t, rec, C_SHARD), lo, hi - 1), CLI_RUNTIME;
    *wv = (long)w, *n = 0;
    while (rec + *n < t->nrec && !strcmp(kvq_csv_at(t, rec + *n, C_WINDOW), kvq_csv_at(t, rec, C_WINDOW))) ++*n;
    if (!m->nitems) m->nitems = (int)*n;
    if ((int)*n != m->nitems)
        return cli_error(prog, "%s: window %ld has %zu rows, window %s of %s has %d: not shards of one run (or an "
                         "unfinished window)", file, (long)w, *n, kvq_csv_at(t0, 1, C_WINDOW), ref, m->nitems),
               CLI_RUNTIME;
    for (size_t i = 0; i < *n; i++) {
        for (int c = 0; c <= C_LAYER; c++)
            if (strcmp(kvq_csv_at(t, rec + i, c), kvq_csv_at(t0, 1 + i, c)))
                return cli_error(prog, "%s: line %zu: %s '%s' where %s has '%s': not shards of one run", file,
                                 rec + i + 1, EVAL_COLS[c], kvq_csv_at(t, rec + i, c), ref, kvq_csv_at(t0, 1 + i, c)),
                       CLI_RUNTIME;
        for (int c = C_RUN; c <= C_WINDOWS; c++)
            if (strcmp(kvq_csv_at(t, rec + i, c), kvq_csv_at(t, rec, c)))
                return cli_error(prog, "%s: line %zu: %s '%s' in a window whose first row has '%s'", file, rec + i + 1,
                                 EVAL_COLS[c], kvq_csv_at(t, rec + i, c), kvq_csv_at(t, rec, c)), CLI_RUNTIME;
        if (strcmp(kvq_csv_at(t, rec + i, C_SUMS + S_NLL_REF), kvq_csv_at(t, rec, C_SUMS + S_NLL_REF)))
            return cli_error(prog, "%s: line %zu: nll_ref_sum differs from its window's first row's (one exact "
                             "stream per window)", file, rec + i + 1), CLI_RUNTIME;
    }
    return CLI_OK;
}

/* Every file's windows indexed (m->win), sorted, each once, covering the run. */
static int merge_index(eval_merge *m)
{
    for (int f = 0; f < m->nfiles; f++) {
        long si = -1, sn = -1, wv;
        size_t n;
        for (size_t rec = 1; rec < m->t[f].nrec; rec += n) {
            if (merge_shard_of(m, f, rec, &si, &sn) || merge_window(m, f, rec, si, sn, &wv, &n)) return CLI_RUNTIME;
            m->win[m->nw++] = (shard_win){f, rec, wv};
        }
    }
    qsort(m->win, m->nw, sizeof *m->win, cmp_win);
    for (size_t k = 0; k < m->nw; k++) {
        if (k && m->win[k].window == m->win[k - 1].window)
            return cli_error(m->prog, "window %ld is in %s and %s: duplicated", m->win[k].window,
                             m->files[m->win[k - 1].file], m->files[m->win[k].file]), CLI_RUNTIME;
        if (m->win[k].window != (long)k)
            return cli_error(m->prog, "window %zu of %ld is in no shard: the shards do not cover the run (a shard "
                             "missing or unfinished?)", k, m->nwin), CLI_RUNTIME;
    }
    if ((long)m->nw != m->nwin)
        return cli_error(m->prog, "windows %zu..%ld of %ld are in no shard: a shard missing or unfinished", m->nw,
                         m->nwin - 1, m->nwin), CLI_RUNTIME;
    return CLI_OK;
}

/* The windows' sums pooled in window order, as one run pools them (each row's sums possible). */
static int merge_sums(eval_merge *m)
{
    if (!(m->acc = calloc((size_t)m->nitems, sizeof *m->acc))) return cli_error(m->prog, "out of memory"), CLI_RUNTIME;
    for (size_t k = 0; k < m->nw; k++) {
        const kvq_csv *tf = &m->t[m->win[k].file];
        const char *file = m->files[m->win[k].file];
        for (int i = 0; i < m->nitems; i++) {
            size_t rec = m->win[k].rec + (size_t)i;
            double v[NSUMS], pos;
            for (int c = 0; c < NSUMS; c++)
                if (kvq_csv_number(kvq_csv_at(tf, rec, C_SUMS + c), &v[c]))
                    return cli_error(m->prog, "%s: line %zu: %s: expected a finite number", file, rec + 1,
                                     EVAL_COLS[C_SUMS + c]), CLI_RUNTIME;
            if (kvq_csv_number(kvq_csv_at(tf, rec, C_POS), &pos) || pos < 1 || pos != floor(pos))
                return cli_error(m->prog, "%s: line %zu: positions: expected a positive count", file, rec + 1),
                       CLI_RUNTIME;
            const char *why = impossible_sums(v, pos);
            if (why) return cli_error(m->prog, "%s: line %zu: %s: not sums a run writes", file, rec + 1, why), CLI_RUNTIME;
            if (i == 0) kvq_eval_sums_add(&m->ref, &(kvq_eval_sums){.nll = v[S_NLL_REF], .positions = pos});
            kvq_eval_sums w = {.nll = v[S_NLL], .kl = v[S_KL], .top1 = v[S_TOP1], .positions = pos,
                               .k_bits = v[S_K_BITS], .v_bits = v[S_V_BITS], .elements = v[S_ELEMENTS],
                               .d_n = v[S_D_N], .d_mean = v[S_D_MEAN], .d_m2 = v[S_D_M2],
                               .cache_tokens = v[S_CACHE]};
            kvq_eval_sums_add(&m->acc[i], &w);
        }
    }
    return CLI_OK;
}

/* Provenance: the shards (and their runs, from their meta files), then this merge. */
static int merge_provenance(const eval_merge *m, kvq_format fmt, cli_meta *meta)
{
    cli_meta_operands(meta, m->files, m->nfiles);
    for (int f = 0; f < m->nfiles; f++) {
        char *mp = cli_meta_path(m->files[f]), *runs = NULL;
        if (!mp) return cli_error(m->prog, "out of memory"), CLI_RUNTIME;
        cli_meta_input(meta, "shard", m->files[f]);
        int mrc = cli_meta_read_runs(m->prog, mp, &runs);
        if (!mrc && !runs)
            fprintf(stderr, "%s: note: %s: no meta file; the merge records the shard's checksum only\n", m->prog,
                    m->files[f]);
        cli_meta_prior_runs(meta, runs);
        free(mp), free(runs);
        if (mrc) return mrc;
    }
    cli_meta_bool(meta, "options", "merge", 1);
    cli_meta_str(meta, "options", "format", cli_format_name(fmt));
    cli_meta_int(meta, "result", "windows", m->nwin);
    return cli_meta_check_format(m->prog, meta, fmt);
}

/* The pooled rows, as one run writes them, into the report rep. */
static int merge_rows(const eval_merge *m, kvq_report *rep, const char *output)
{
    const kvq_csv *t0 = &m->t[m->r0];
    char tokens[32], npos[16];
    double chunk;
    if (kvq_csv_number(kvq_csv_at(t0, 1, C_TOKENS), &chunk))
        return cli_error(m->prog, "%s: line 2: tokens: expected a number", m->files[m->r0]), CLI_RUNTIME;
    snprintf(tokens, sizeof tokens, "%.0f", chunk * (double)m->nwin);
    double nll_ref = m->ref.nll / m->ref.positions;
    for (int i = 0; i < m->nitems; i++) {
        kvq_eval_item item = {0};
        kvq_eval_item_finish(&item, &m->acc[i]);
        cli_eval_row id = {.model = kvq_csv_at(t0, 1 + (size_t)i, C_MODEL),
                           .quantizer = kvq_csv_at(t0, 1 + (size_t)i, C_QUANT),
                           .spec = kvq_csv_at(t0, 1 + (size_t)i, C_SPEC),
                           .policy = kvq_csv_at(t0, 1 + (size_t)i, C_POLICY)};
        snprintf(id.layer, sizeof id.layer, "%s", kvq_csv_at(t0, 1 + (size_t)i, C_LAYER));
        kvq_cell row[NSTD];
        cli_eval_cells(&id, &item, nll_ref, tokens, npos, row);
        errno = 0;
        kvq_status wst = kvq_rows_add(rep, row);
        if (wst) return cli_write_error(m->prog, output, wst, errno);
    }
    return CLI_OK;
}

int cli_eval_merge(const char *prog, char **files, int nfiles, const char *output, kvq_format fmt, cli_meta *meta)
{
    eval_merge m = {.prog = prog, .files = files, .nfiles = nfiles, .r0 = -1, .nwin = -1, .nshard = -1};
    kvq_report *rep = NULL;
    cli_out out = {0};
    int rc = CLI_RUNTIME;
    if (!(m.t = calloc((size_t)nfiles, sizeof *m.t))) { cli_error(prog, "out of memory"); return CLI_RUNTIME; }
    if ((rc = merge_read(&m)) || (rc = merge_index(&m)) || (rc = merge_sums(&m)) ||
        (rc = merge_provenance(&m, fmt, meta)))
        goto done;
    rc = CLI_RUNTIME;
    if (cli_out_open(&out, output, prog) || cli_out_attach_meta(&out, meta, prog)) goto done;
    if (!(rep = kvq_rows_new(out.f, fmt, EVAL_COLS, NSTD, 6))) { cli_error(prog, "out of memory"); goto done; }
    if ((rc = merge_rows(&m, rep, output))) goto done;
    errno = 0;
    kvq_status st = kvq_report_finish(rep);
    rep = NULL;
    if (st) { rc = cli_write_error(prog, output, st, errno); goto done; }
    rc = cli_meta_commit(&out, prog) ? CLI_RUNTIME : CLI_OK;
    if (!rc)
        fprintf(stderr, "%s: merged %ld windows of %d configurations from %d shards into %s\n", prog, m.nwin,
                m.nitems, nfiles, output ? output : "stdout");
done:
    kvq_report_discard(rep);
    if (out.f) cli_out_abort(&out);
    for (int f = 0; f < nfiles; f++) kvq_csv_free(&m.t[f]);
    free(m.t), free(m.win), free(m.acc), free(m.holder);
    return rc;
}

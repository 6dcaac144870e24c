/* kvq-alloc — which layers, and keys or values, deserve the bits
 * (docs/models.md#kvq-alloc): per-layer sensitivities of one family over a
 * grid (one kvq-eval --per-layer pass per point, appended to
 * OUT.sensitivity.csv as each finishes, so --resume continues), the exact
 * knapsack optimum per bit budget (kvq_alloc_solve), then the chosen mix
 * and the uniform points within the budgets evaluated in full.  Across
 * machines: --shard I/N measures a share of the points into its own table,
 * --merge joins the tables and allocates (docs/models.md#shards). */
#define _GNU_SOURCE /* asprintf */
#include "cli.h"

#include <errno.h>
#include <fcntl.h>
#include <getopt.h>
#include <inttypes.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

static const char *prog = "kvq-alloc";

enum { MAX_ARGS = 64, MAX_BUDGETS = 64 };

typedef kvq_alloc_point point; /* a valid grid point and its sensitivity row per layer */

/* --- the sensitivity table (OUT.sensitivity.csv, a shard's -o) ----------- */

/* What a table is read against: this run's points, layers and fingerprint. */
typedef struct sens_ctx {
    point *pts;
    int np, L;
    char run[17]; /* kvq_eval_fingerprint as 16 hex digits */
} sens_ctx;

/* A table's complete passes into their points (kvq_alloc_table_read), a
 * refusal printed with what mends it: remove the file, or drop --resume
 * (resume), or rerun with the shard's options (a merge, from != NULL).
 * CLI_OK, or the exit code after printing. */
static int sens_load(const sens_ctx *c, const char *path, const char *from, const char *data, size_t size,
                     size_t *keep)
{
    kvq_error err = {0};
    kvq_alloc_fix fix;
    if (!kvq_alloc_table_read(path, data, size, from != NULL, c->run, c->pts, c->np, c->L, keep, &fix, &err))
        return CLI_OK;
    if (fix == KVQ_ALLOC_FIX_REMOVE || fix == KVQ_ALLOC_FIX_OPTIONS)
        cli_error(prog, "%s; remove the file%s", err.msg,
                  !from ? " or drop --resume" : fix == KVQ_ALLOC_FIX_OPTIONS ? " or use this run's options" : "");
    else if (fix == KVQ_ALLOC_FIX_RESUME) cli_error(prog, "%s (continue it with --resume)", err.msg);
    else cli_error(prog, "%s", err.msg);
    return err.status == KVQ_ERR_USAGE ? CLI_USAGE : CLI_RUNTIME;
}

/* Opens the table at path for this run: created (registered as a temporary
 * until a pass is in it), or with resume read and cut after its last
 * complete pass; locked for the run (a second run on it exits 1 at once).
 * Not a regular file: refused.  *fd, and CLI_OK or the exit code. */
static int sens_open(const sens_ctx *c, const char *path, int resume, int *fd, int *created)
{
    *fd = -1, *created = 0;
    struct stat st;
    int exists = lstat(path, &st) == 0;
    if (exists && !resume) {
        cli_error(prog, "%s exists: --resume continues its passes (or remove it)", path);
        return CLI_USAGE;
    }
    if (exists && (stat(path, &st) != 0 || !S_ISREG(st.st_mode))) {
        cli_error(prog, "%s: not a regular file (the sensitivity table is read back, cut and appended to)", path);
        return CLI_USAGE;
    }
    if ((*fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC, 0666)) < 0) {
        cli_error(prog, "%s: cannot write: %s", path, strerror(errno));
        return CLI_RUNTIME;
    }
    if (flock(*fd, LOCK_EX | LOCK_NB)) {
        if (errno == EWOULDBLOCK)
            cli_error(prog, "%s: another kvq-alloc run is writing it (it holds the lock); wait for it or choose another "
                      "-o", path);
        else
            cli_error(prog, "%s: cannot lock: %s", path, strerror(errno));
        close(*fd), *fd = -1;
        return CLI_RUNTIME;
    }
    *created = !exists;
    size_t size = 0, keep = 0;
    char *data = NULL;
    if (exists && cli_read_file(prog, path, &data, &size)) return CLI_RUNTIME;
    int rc = exists ? sens_load(c, path, NULL, data, size, &keep) : CLI_OK;
    free(data);
    if (rc) return rc;
    if (exists && (ftruncate(*fd, (off_t)keep) || lseek(*fd, (off_t)keep, SEEK_SET) < 0)) {
        cli_error(prog, "%s: cannot drop the unfinished pass: %s", path, strerror(errno));
        return CLI_RUNTIME;
    }
    const char *const *cols;
    int ncols = kvq_alloc_table_columns(&cols);
    if (!keep && cli_write_csv_header(prog, path, *fd, cols, ncols, 2)) /* new or empty: the header */
        return CLI_RUNTIME;
    return CLI_OK;
}

/* One pass's rows (every layer of pt), one write and an fsync. */
static int sens_append(int fd, const char *path, const point *pt, const char *run, int L)
{
    char *buf;
    size_t len;
    kvq_error err = {0};
    if (kvq_alloc_table_rows(pt, L, run, &buf, &len, &err)) return cli_fail(prog, &err);
    int rc = cli_write_all(fd, buf, len) || fsync(fd) ? CLI_RUNTIME : CLI_OK;
    if (rc) cli_error(prog, "%s: write failed: %s", path, strerror(errno));
    free(buf);
    return rc;
}

/* --- progress ------------------------------------------------------------ */

typedef struct progress_state {
    int on, pass, npasses, validating;
    time_t start;
} progress_state;

/* "sensitivity pass p/N, layer l/L" while measuring, then "validation" for the full evaluation of the allocations. */
static void pass_progress(void *ud, int pass, int npasses, int layer, int nlayers)
{
    (void)pass, (void)npasses;
    progress_state *p = ud;
    if (!p->on) return;
    long el = (long)(time(NULL) - p->start);
    if (p->validating) {
        fprintf(stderr, "\r%s: validation (the allocations and the uniform points in full), layer %d/%d, %lds      ",
                prog, layer, nlayers, el);
    } else {
        double frac = (p->pass + (double)layer / nlayers) / p->npasses;
        fprintf(stderr, "\r%s: sensitivity pass %d/%d, layer %d/%d, %lds, about %lds left      ", prog, p->pass + 1,
                p->npasses, layer, nlayers, el, frac > 0 ? (long)(el / frac * (1 - frac) + 0.5) : 0L);
    }
    fflush(stderr);
}

static int parse_budgets(const char *s, double *b, int *n)
{
    char *buf = strdup(s), *save = NULL;
    if (!buf) return -1;
    int rc = 0;
    for (char *t = strtok_r(buf, ",", &save); t && !rc; t = strtok_r(NULL, ",", &save)) {
        char *end;
        errno = 0;
        double v = strtod(t, &end);
        if (errno || end == t || *end || !(v > 0) || !isfinite(v) || *n == MAX_BUDGETS) rc = -1;
        else b[(*n)++] = v;
    }
    free(buf);
    return rc;
}

/* The allocation per budget (steps 2 and 3 of docs/models.md#kvq-alloc):
 * the knapsack's optimum, then the allocations and the uniform points within
 * the largest budget evaluated in full; OUT, OUT.uniform.csv and a summary. */
typedef struct alloc_run {
    kvq_model *m;
    const int *ids;
    int T, L;
    const kvq_model_info *in;
    point *pts;
    int np;
    const double *budgets;
    int nbudgets, decode;
    kvq_eval_opts *eo;
    progress_state *ps;
    const char *output, *sens_path, *uni_path;
    cli_meta *meta;
} alloc_run;

/* What allocate computes: the knapsack's allocations, then the items
 * evaluated in full (the allocations [0, nbudgets), then the uniform points
 * that fit the largest budget). */
typedef struct alloc_result {
    kvq_allocation al;
    kvq_eval_item *items; /* [nit] */
    int nit, *uni;        /* uni[point]: its item, -1 if it does not fit */
    int *best;            /* [nbudgets]: the best uniform point within the budget, -1 none */
    double *unll;         /* [np]: the uniform points' NLL (NaN: not evaluated) */
    double nll_ref;
} alloc_result;

/* Step 2 and the full evaluation: the allocations, the uniform points within the largest budget. */
static int alloc_evaluate(const alloc_run *a, alloc_result *r)
{
    int np = a->np, nb = a->nbudgets;
    double n_l = 2.0 * a->in->n_kv_heads * a->in->head_dim; /* K and V elements of a layer per token */
    kvq_error err = {0};
    kvq_policy pol = a->decode ? KVQ_POLICY_DECODE : KVQ_POLICY_PREFILL;
    kvq_status pst = kvq_alloc_plan(a->pts, np, a->L, n_l, a->budgets, nb, &r->al, &err);
    if (pst) { /* a budget's refusal names its option */
        if (r->al.bad_budget >= 0) cli_error(prog, "--%s", err.msg);
        else cli_fail(prog, &err);
        return pst == KVQ_ERR_USAGE ? CLI_USAGE : CLI_RUNTIME;
    }
    r->uni = calloc((size_t)np, sizeof *r->uni), r->best = calloc((size_t)nb, sizeof *r->best);
    r->unll = calloc((size_t)np, sizeof *r->unll);
    r->items = calloc((size_t)(np + nb) + 1, sizeof *r->items);
    if (!r->uni || !r->best || !r->unll || !r->items) return cli_error(prog, "out of memory"), CLI_RUNTIME;
    for (int b = 0; b < nb; b++)
        r->items[r->nit++] = (kvq_eval_item){.spec = &r->al.mix[b], .layer = -1, .policy = pol};
    for (int i = 0; i < np; i++) {
        r->uni[i] = -1;
        if (r->al.fits[i])
            r->uni[i] = r->nit,
            r->items[r->nit++] = (kvq_eval_item){.spec = &a->pts[i].spec, .layer = -1, .policy = pol};
    }
    a->ps->validating = 1;
    kvq_status est = kvq_model_eval(a->m, a->ids, a->T, r->items, r->nit, a->eo, &r->nll_ref, &err);
    if (a->ps->on) fputc('\n', stderr);
    if (est) return cli_fail(prog, &err);
    for (int i = 0; i < np; i++) r->unll[i] = r->uni[i] >= 0 ? r->items[r->uni[i]].nll : NAN;
    for (int b = 0; b < nb; b++) r->best[b] = kvq_alloc_best_uniform(&r->al, a->budgets[b], r->unll);
    return CLI_OK;
}

static const char *const ALLOC_COLS[] = {"budget", "spec", "mean_bits", "k_bits", "v_bits", "dnll_pred",
                                         "dnll", "dnll_se", "kl", "top1"};
enum { ALLOC_NCOL = sizeof ALLOC_COLS / sizeof ALLOC_COLS[0] };

/* Item it's row from its spec on (cells [1, ALLOC_NCOL)): pred is its predicted dnll. */
static void alloc_cells(const kvq_eval_item *it, double pred, double nll_ref, kvq_cell *c)
{
    kvq_cell row[ALLOC_NCOL - 1] = {{.text = it->spec->text}, {.num = (it->k_bits + it->v_bits) / 2, .is_num = 1},
                                    {.num = it->k_bits, .is_num = 1}, {.num = it->v_bits, .is_num = 1},
                                    {.num = pred, .is_num = 1}, {.num = it->nll - nll_ref, .is_num = 1},
                                    {.num = it->dnll_se, .is_num = 1}, {.num = it->kl, .is_num = 1},
                                    {.num = it->top1, .is_num = 1}};
    memcpy(c, row, sizeof row);
}

/* OUT's rows (each budget's allocation, then its best uniform point) and OUT.uniform.csv's. */
static kvq_status alloc_rows(const alloc_run *a, const alloc_result *r, kvq_report *rep, kvq_report *urep)
{
    kvq_status wst = KVQ_OK;
    for (int b = 0; b < a->nbudgets && !wst; b++) {
        char bt[32];
        snprintf(bt, sizeof bt, "%g", a->budgets[b]);
        for (int u = 0; u < 2 && !wst; u++) {
            const kvq_eval_item *it = u ? (r->best[b] >= 0 ? &r->items[r->uni[r->best[b]]] : NULL) : &r->items[b];
            if (!it) {
                fprintf(stderr, "%s: note: --budget %g: no uniform point of the grid fits\n", prog, a->budgets[b]);
                break;
            }
            kvq_cell row[ALLOC_NCOL] = {{.text = bt}};
            alloc_cells(it, u ? r->al.upred[r->best[b]] : r->al.pred[b], r->nll_ref, row + 1);
            errno = 0;
            wst = kvq_rows_add(rep, row);
        }
    }
    for (int i = 0; i < a->np && !wst; i++) {
        if (r->uni[i] < 0) continue;
        kvq_cell row[ALLOC_NCOL - 1];
        alloc_cells(&r->items[r->uni[i]], r->al.upred[i], r->nll_ref, row);
        errno = 0;
        wst = kvq_rows_add(urep, row);
    }
    return wst;
}

/* The summary: the four files, then each budget's allocation beside its best uniform point. */
static void alloc_summary(const alloc_run *a, const alloc_result *r)
{
    fprintf(stderr, "%s: wrote %s (the allocations), %s (%d sensitivity passes), %s (%d uniform points), %s.meta.json\n",
            prog, a->output, a->sens_path, a->np, a->uni_path, r->nit - a->nbudgets, a->output);
    for (int b = 0; b < a->nbudgets; b++) {
        const kvq_eval_item *ab = &r->items[b], *u = r->best[b] >= 0 ? &r->items[r->uni[r->best[b]]] : NULL;
        fprintf(stderr, "  budget %g: %s — %.4g bits, dnll %.4g", a->budgets[b], ab->spec->text,
                (ab->k_bits + ab->v_bits) / 2, ab->nll - r->nll_ref);
        if (u)
            fprintf(stderr, "; best uniform %s — %.4g bits, dnll %.4g\n", u->spec->text, (u->k_bits + u->v_bits) / 2,
                    u->nll - r->nll_ref);
        else fputs("; no uniform point fits\n", stderr);
    }
}

/* Steps 2 and 3 of docs/models.md#kvq-alloc: OUT, OUT.uniform.csv, the summary. */
static int allocate(const alloc_run *a)
{
    alloc_result r = {0};
    kvq_report *rep = NULL, *urep = NULL;
    cli_out out = {0}, uout = {0};
    kvq_format fmt = cli_pick_format(NULL, a->output);
    int rc = alloc_evaluate(a, &r);
    if (rc) goto done;
    rc = CLI_RUNTIME;
    if (cli_out_open(&out, a->output, prog) || cli_out_attach_meta(&out, a->meta, prog) ||
        cli_out_open(&uout, a->uni_path, prog))
        goto done;
    rep = kvq_rows_new(out.f, fmt == KVQ_FMT_TABLE ? KVQ_FMT_CSV : fmt, ALLOC_COLS, ALLOC_NCOL, 2);
    urep = kvq_rows_new(uout.f, KVQ_FMT_CSV, ALLOC_COLS + 1, ALLOC_NCOL - 1, 1);
    kvq_status wst = !rep || !urep ? KVQ_ERR_NOMEM : alloc_rows(a, &r, rep, urep);
    int werr = errno;
    for (int k = 0; k < 2 && !wst; k++) { /* OUT's report, then the uniform points' */
        errno = 0;
        wst = kvq_report_finish(k ? urep : rep);
        if (k) urep = NULL;
        else rep = NULL;
        werr = errno;
    }
    if (wst) rc = cli_write_error(prog, a->output, wst, werr);
    else if (!cli_meta_commit(&uout, prog) && !cli_meta_commit(&out, prog)) alloc_summary(a, &r), rc = CLI_OK;
done:
    kvq_report_discard(rep);
    kvq_report_discard(urep);
    if (out.f) cli_out_abort(&out);
    if (uout.f) cli_out_abort(&uout);
    kvq_allocation_free(&r.al);
    free(r.uni), free(r.best), free(r.unll), free(r.items);
    return rc;
}

/* One run: its options as parsed, then what its steps share. */
typedef struct alloc_job {
    /* the options */
    const char *family, *output, *calib, *grids[MAX_ARGS], *fixed[MAX_ARGS];
    int ngrids, nfixed, nbudgets, resume, merge, decode, progress_mode;
    double budgets[MAX_BUDGETS];
    long stride, chunk, chunks;
    cli_shard share; /* --shard I/N (n 0: none) */
    uint64_t seed;
    cli_model mo;
    char **argv; /* the model is argv[optind]; a merge's shards follow it */
    int optind;
    char **shards;
    int nshards;
    cli_meta *meta;
    /* the run */
    kvq_grid *grid;
    kvq_model *m;
    const kvq_model_info *in;
    kvq_calib *cal;
    point *pts;
    int np, *ids, T, L;
    int fd, created; /* the sensitivity table: open, and created by this run (removed if no pass lands) */
    char *sens_path, *uni_path, **shard_data;
    kvq_eval_opts eo;
    sens_ctx sc;
    int mine, ndone; /* this run's points (a shard's share), and those already measured */
    progress_state ps;
} alloc_job;

/* --grid and --fixed: repeatable, up to MAX_ARGS each. */
static int opt_grid(const char *p, const char *arg, void *at, void *base)
{
    alloc_job *s = base;
    int grid = at == (void *)s->grids, *n = grid ? &s->ngrids : &s->nfixed;
    if (*n == MAX_ARGS) return cli_error(p, "more than %d --%s options", MAX_ARGS, grid ? "grid" : "fixed"), CLI_USAGE;
    ((const char **)at)[(*n)++] = arg;
    return CLI_OK;
}

static int opt_budget(const char *p, const char *arg, void *at, void *base)
{
    alloc_job *s = base;
    (void)at;
    if (!parse_budgets(arg, s->budgets, &s->nbudgets)) return CLI_OK;
    cli_error(p, "--budget %s: expected positive numbers of bits, comma-separated (at most %d)", arg, MAX_BUDGETS);
    return CLI_USAGE;
}

static const char *const policies[] = {"prefill", "decode", NULL}; /* --policy: decode is 1 */

enum { OPT_FAMILY = 256, OPT_RESUME, OPT_POLICY, OPT_STRIDE, OPT_CHUNK, OPT_CHUNKS, OPT_CALIB, OPT_PROGRESS,
       OPT_SEED, OPT_SHARD, OPT_MERGE };

/* The budgets as recorded: a list of their values. */
static void record_budgets(cli_meta *meta, const cli_optrow *row, const void *base)
{
    const alloc_job *s = base;
    cli_meta_empty_list(meta, "options", row->name);
    for (int b = 0; b < s->nbudgets; b++) {
        char bt[32];
        snprintf(bt, sizeof bt, "%.17g", s->budgets[b]);
        cli_meta_list(meta, "options", row->name, bt);
    }
}

/* kvq-alloc's options, one row each (cli_optrow); the model's input and
 * --threads, and the record's, are cli.h's groups.  The recorded rows go
 * into the provenance as they took effect. */
#define ROW(nm, k, kind, field, ...) \
    {.name = nm, .key = k, .arg = kind, .offset = offsetof(alloc_job, field), __VA_ARGS__}
#define REC .record = CLI_RECORD
static const cli_optrow rows[] = {
    ROW("family", OPT_FAMILY, CLI_ARG_TEXT, family, .record = CLI_RECORD | CLI_RECORD_NULL, .metavar = "NAME",
        .help = "the quantizer family (kvq-analyze --list-quantizers), or a template tokens(SELECT; HI; LO) (its "
                "selector's keys)"),
    ROW("grid", 'g', CLI_ARG_CUSTOM, grids, .parse = opt_grid, REC, .record_fn = cli_optrow_record_array,
        .aux_offset = offsetof(alloc_job, ngrids), .metavar = "K=V1,V2",
        .help = "values of key K; repeatable (points: their product)"),
    ROW("fixed", 'f', CLI_ARG_CUSTOM, fixed, .parse = opt_grid, REC, .record_fn = cli_optrow_record_array,
        .aux_offset = offsetof(alloc_job, nfixed), .metavar = "K=V[,..]",
        .help = "keys held fixed at every point; repeatable"),
    ROW("budget", 'b', CLI_ARG_CUSTOM, budgets, .parse = opt_budget, REC, .record_fn = record_budgets,
        .metavar = "B[,B..]", .help = "mean stored bits per element over K and V (repeatable)"),
    ROW("output", 'o', CLI_ARG_TEXT, output, .metavar = "OUT",
        .help = "the allocations (CSV, or JSON lines for *.jsonl), written atomically; beside it "
                "OUT.sensitivity.csv (appended pass by pass), OUT.uniform.csv (every uniform point evaluated) and "
                "OUT.meta.json (the provenance)"),
    ROW("resume", OPT_RESUME, CLI_ARG_FLAG, resume, REC,
        .help = "keep the complete passes of OUT.sensitivity.csv, run the rest"),
    ROW("shard", OPT_SHARD, CLI_ARG_CUSTOM, share, .parse = cli_optrow_shard, REC, .record_fn = cli_optrow_record_shard,
        .metavar = "I/N",
        .help = "measure only the grid's valid points i with i mod N = I, into the sensitivity table -o OUT itself "
                "(no --budget)"),
    ROW("merge", OPT_MERGE, CLI_ARG_FLAG, merge, REC,
        .help = "kvq-alloc --merge MODEL SHARD... (the shards' tables, with the run's other options): join them into "
                "OUT.sensitivity.csv and allocate"),
    ROW("policy", OPT_POLICY, CLI_ARG_CHOICE, decode, .choices = policies, REC, .metavar = "P",
        .help = "prefill (default) or decode, as kvq-eval"),
    ROW("stride", OPT_STRIDE, CLI_ARG_LONG, stride, REC, .min = 1, .max = 1L << 30, .expect = "an integer 1..2^30",
        .metavar = "N", .help = "decode: re-quantize the cache every N positions (default 1)"),
    ROW("chunk", OPT_CHUNK, CLI_ARG_LONG, chunk, .record = CLI_RECORD | CLI_RECORD_NULL, .min = 4, .max = 1L << 30,
        .expect = "an integer 4..2^30", .metavar = "N",
        .help = "corpus evaluation in windows of N tokens (as kvq-eval)"),
    ROW("chunks", OPT_CHUNKS, CLI_ARG_LONG, chunks, .record = CLI_RECORD | CLI_RECORD_NULL, .min = 1, .max = 1L << 30,
        .expect = "an integer 1..2^30", .metavar = "K", .help = "only the first K windows"),
    ROW("calib", OPT_CALIB, CLI_ARG_TEXT, calib, .record = CLI_RECORD | CLI_RECORD_NULL, .metavar = "FILE",
        .help = "calibration dump of the same model"),
    ROW("progress", OPT_PROGRESS, CLI_ARG_CUSTOM, progress_mode, .parse = cli_optrow_progress, .metavar = "WHEN",
        .help = "auto (default: on a terminal), always or never"),
    ROW("seed", OPT_SEED, CLI_ARG_U64, seed, REC, .metavar = "N",
        .help = "seed of the quantizers' random streams (default 0)"),
};
#undef ROW
#undef REC
enum { NROWS = sizeof rows / sizeof rows[0] };

static void usage(FILE *f)
{
    fprintf(f, "usage: kvq-alloc MODEL (--text FILE | --tokens FILE) --family NAME\n"
               "                 --grid K=V1,V2,... [--grid ...] [--fixed K=V,...]\n"
               "                 --budget B[,B...] -o OUT [options]\n"
               "The per-layer assignment of a family's grid points that minimises the predicted\n"
               "loss within each budget of mean stored bits per element (K and V together),\n"
               "from each layer's sensitivity (dnll with only that layer quantized), then\n"
               "evaluated in full beside the uniform points within the budget.\n\n");
    cli_optrows_usage(f, rows, NROWS);
    cli_optrows_usage(f, cli_model_rows, cli_model_nrows);
    cli_optrows_usage(f, cli_meta_rows, cli_meta_nrows);
    fprintf(f, CLI_HELP_VERSION_HELP
               "\n"
               "Example: kvq-alloc data/kvq-retrieval.gguf --text data/retrieval-main.txt \\\n"
               "           --family kivi --grid kbits=2,4,8 --grid vbits=2,4,8 \\\n"
               "           --fixed residual=0 --budget 3,4,6 -o alloc.csv\n");
}

/* What the options need together (after getopt): the operands (MODEL, and
 * a merge's SHARD...), the required options, the exclusions. */
static int check_options(int argc, char **argv, alloc_job *s)
{
    int rc, nops = argc - optind;
    if (s->merge && nops >= 2) s->nshards = nops - 1, argc = optind + 1; /* --merge: MODEL SHARD...; else MODEL alone */
    else if (s->merge)
        return cli_error(prog, "--merge: expected MODEL SHARD... (the shards' sensitivity tables)"), CLI_USAGE;
    if ((rc = cli_model_check(prog, argc, optind, &s->mo,
                              "kvq-alloc MODEL (--text FILE | --tokens FILE) --family NAME --grid ... --budget B -o OUT")))
        return rc;
    s->argv = argv, s->optind = optind, s->shards = argv + optind + 1;
    if (!s->family || !s->ngrids || !s->output || (!s->nbudgets && !s->share.n)) {
        cli_error(prog, "%s required (see --help)", !s->family ? "--family NAME" : !s->ngrids ? "--grid K=V1,V2,..."
                  : !s->output ? "-o OUT" : "--budget B");
        return CLI_USAGE;
    }
    if (s->share.n && (s->nbudgets || s->merge)) {
        cli_error(prog, "--shard %ld/%ld measures sensitivities only: --budget and --merge go to the merge", s->share.i,
                  s->share.n);
        return CLI_USAGE;
    }
    if (s->merge && s->resume) return cli_error(prog, "--merge joins finished shards: --resume does not apply"), CLI_USAGE;
    if (s->chunks && !s->chunk) return cli_error(prog, "--chunks needs --chunk N"), CLI_USAGE;
    if (!s->output[0] || !strcmp(s->output, "-")) return cli_error(prog, "-o: expected a file name"), CLI_USAGE;
    return cli_meta_check_format(prog, s->meta, s->share.n ? KVQ_FMT_CSV : cli_pick_format(NULL, s->output));
}

/* The options into s; *stop: --help or --version answered (rc as they end). */
static int parse_options(int argc, char **argv, alloc_job *s, int *stop)
{
    const cli_getopt_ctx go = {.prog = prog, .usage = usage, .model = &s->mo, .meta = s->meta};
    int rc = cli_optrows_getopt(&go, rows, NROWS, ":g:f:b:o:hV", argc, argv, s, stop);
    return rc || *stop ? rc : check_options(argc, argv, s);
}

/* The grid's valid points, and the files that hold what the run
 * measures (checked against the inputs). */
static int open_grid(alloc_job *s)
{
    kvq_error err = {0};
    int rc;
    if (kvq_grid_new(s->family, s->grids, s->ngrids, s->fixed, s->nfixed, &s->grid, &err)) return cli_fail(prog, &err);
    size_t npoints = kvq_grid_size(s->grid);
    if (!(s->pts = calloc(npoints, sizeof *s->pts))) return cli_error(prog, "out of memory"), CLI_RUNTIME;
    for (size_t p = 0; p < npoints; p++) {
        kvq_error perr = {0};
        if (kvq_grid_spec(s->grid, p, &s->pts[s->np].spec, &perr)) {
            fprintf(stderr, "%s: note: point %zu skipped: %s\n", prog, p, perr.msg);
            continue;
        }
        s->np++;
    }
    if (!s->np) return cli_error(prog, "the grid has no valid point"), CLI_USAGE;
    /* the sensitivity table: the shard's -o, or OUT.sensitivity.csv */
    if (s->share.n) {
        if (!(s->sens_path = strdup(s->output))) return cli_error(prog, "out of memory"), CLI_RUNTIME;
    } else if (asprintf(&s->sens_path, "%s.sensitivity.csv", s->output) < 0 ||
               asprintf(&s->uni_path, "%s.uniform.csv", s->output) < 0) {
        s->sens_path = s->uni_path = NULL;
        return cli_error(prog, "out of memory"), CLI_RUNTIME;
    }
    const char *inputs[MAX_ARGS + 5] = {s->argv[s->optind], s->mo.text, s->mo.tokens, s->mo.tokenizer, s->calib};
    int nin = 5;
    for (int i = 0; i < s->nshards && nin < MAX_ARGS + 5; i++) inputs[nin++] = s->shards[i];
    if ((rc = cli_check_output(prog, s->output, inputs, nin)) ||
        (!s->share.n && (rc = cli_check_side_file(prog, "the sensitivity table of -o", s->sens_path, inputs, nin))) ||
        (s->uni_path && (rc = cli_check_side_file(prog, "the uniform points of -o", s->uni_path, inputs, nin))))
        return rc;
    return CLI_OK;
}

/* The calibration dump and the model (its tokens), checked against the points and --chunk. */
static int open_model(alloc_job *s)
{
    kvq_error err = {0};
    int rc;
    if (s->calib && kvq_calib_open(s->calib, &s->cal, &err)) return cli_fail(prog, &err);
    for (int i = 0; i < s->np; i++)
        if ((rc = cli_check_calib(prog, &s->pts[i].spec, s->cal != NULL))) return rc;
    s->mo.no_context_cut = s->chunk > 0;
    s->mo.uses = s->chunk > 0 && s->chunks > 0 ? s->chunk * s->chunks : 0; /* --chunks K: the first K windows alone */
    if ((rc = cli_model_load(prog, s->argv, s->optind, &s->mo, &s->m, &s->ids, &s->T))) return rc;
    s->in = kvq_model_get_info(s->m);
    s->L = s->in->n_layers;
    for (int i = 0; i < s->np; i++)
        if (kvq_spec_check_shape(&s->pts[i].spec, s->in->head_dim, &err)) return cli_fail(prog, &err);
    if (s->chunk > s->in->context_length) {
        cli_error(prog, "--chunk %ld: the model's context length is %d", s->chunk, s->in->context_length);
        return CLI_USAGE;
    }
    if (s->chunk && s->T < s->chunk) {
        cli_error(prog, "%s: %d tokens: fewer than one window of --chunk %ld", s->mo.text ? s->mo.text : s->mo.tokens,
                  s->T, s->chunk);
        return CLI_RUNTIME;
    }
    return CLI_OK;
}

/* The run's fingerprint (the sensitivity table's), each point's stored
 * bits, and the budgets against the cheapest point. */
static int measure_points(alloc_job *s)
{
    kvq_error err = {0};
    s->eo = (kvq_eval_opts){.stride = (int)s->stride, .seed = s->seed, .nthreads = (int)s->mo.threads, .calib = s->cal,
                            .progress = pass_progress, .chunk = (int)s->chunk, .chunks = (int)s->chunks};
    s->sc = (sens_ctx){.pts = s->pts, .np = s->np, .L = s->L};
    snprintf(s->sc.run, sizeof s->sc.run, "%016" PRIx64,
             kvq_eval_fingerprint(s->m, s->ids, s->T, s->decode ? KVQ_POLICY_DECODE : KVQ_POLICY_PREFILL, &s->eo,
                                  s->calib));
    for (int i = 0; i < s->np; i++) {
        point *pt = &s->pts[i];
        if (kvq_alloc_point_init(pt, s->L, &err) ||
            kvq_alloc_stored_bits(&pt->spec, s->in, s->chunk ? (int)s->chunk : s->T, s->cal, s->seed,
                                  (int)s->mo.threads, &pt->want_k, &pt->want_v, &err))
            return cli_fail(prog, &err);
    }
    /* a budget below every point's bits cannot be met: said before the passes, not after them
       (the same refusal as the allocation's; budgets within rounding of it are left to that) */
    double min_bits = INFINITY;
    for (int i = 0; i < s->np; i++) min_bits = fmin(min_bits, (s->pts[i].want_k + s->pts[i].want_v) / 2);
    for (int b = 0; b < s->nbudgets; b++)
        if (s->budgets[b] < min_bits * (1 - 1e-9)) {
            cli_error(prog, "--budget %g: below the cheapest allocation of this grid, %.6g bits per element",
                      s->budgets[b], min_bits);
            return CLI_USAGE;
        }
    return CLI_OK;
}

/* The grid's points, the files, the model; what each point stores. */
static int open_inputs(alloc_job *s)
{
    int rc;
    if ((rc = open_grid(s)) || (rc = open_model(s))) return rc;
    return measure_points(s);
}

/* Provenance: the inputs and every option's effective value. */
static void record_options(const alloc_job *s)
{
    cli_meta *meta = s->meta;
    cli_meta_operands(meta, s->argv + s->optind, 1);
    cli_meta_model(meta, s->argv[s->optind], &s->mo, s->in, s->T);
    cli_meta_input(meta, "calib", s->calib);
    cli_optrows_record(meta, rows, NROWS, s, 0);
    cli_meta_str(meta, "result", "run", s->sc.run);
    cli_meta_str(meta, "result", "sensitivity", s->sens_path);
    cli_meta_str(meta, "result", "uniform", s->uni_path);
}

/* --merge: the shards' passes, every point in one of them, into
 * OUT.sensitivity.csv in point order, as one run writes them. */
static int merge_shards(alloc_job *s)
{
    int rc;
    if (!(s->shard_data = calloc((size_t)s->nshards, sizeof *s->shard_data)))
        return cli_error(prog, "out of memory"), CLI_RUNTIME;
    for (int i = 0; i < s->nshards; i++) {
        size_t size, keep;
        if ((rc = cli_read_file(prog, s->shards[i], &s->shard_data[i], &size)) ||
            (rc = sens_load(&s->sc, s->shards[i], s->shards[i], s->shard_data[i], size, &keep)))
            return rc;
        cli_meta_input(s->meta, "shard", s->shards[i]);
    }
    int missing = 0;
    char list[256] = "";
    for (int i = 0; i < s->np; i++)
        if (!s->pts[i].done) {
            if (missing < 5) { /* the first five, cut at the list's size */
                strncat(list, missing ? "; " : "", sizeof list - 1 - strlen(list));
                strncat(list, s->pts[i].spec.text, sizeof list - 1 - strlen(list));
            }
            missing++;
        }
    if (missing) {
        cli_error(prog, "%d of the grid's %d points are in no shard: %s%s", missing, s->np, list,
                  missing > 5 ? "; ..." : "");
        return CLI_RUNTIME;
    }
    if (access(s->sens_path, F_OK) == 0) {
        cli_error(prog, "%s exists: a merge writes it anew (remove it)", s->sens_path);
        return CLI_USAGE;
    }
    if ((rc = sens_open(&s->sc, s->sens_path, 0, &s->fd, &s->created))) return rc;
    cli_temp_register(s->sens_path); /* until it is whole */
    for (int i = 0; i < s->np; i++)
        if (cli_write_all(s->fd, s->pts[i].rows, s->pts[i].rows_len))
            return cli_error(prog, "%s: write failed: %s", s->sens_path, strerror(errno)), CLI_RUNTIME;
    if (fsync(s->fd)) return cli_error(prog, "%s: write failed: %s", s->sens_path, strerror(errno)), CLI_RUNTIME;
    cli_temp_unregister(s->sens_path), s->created = 0;
    fprintf(stderr, "%s: joined %d sensitivity passes from %d shards into %s\n", prog, s->np, s->nshards, s->sens_path);
    return CLI_OK;
}

/* One --per-layer pass per point of this run not yet in the table, each
 * appended to it as it lands. */
static int measure(alloc_job *s)
{
    kvq_error err = {0};
    int rc;
    for (int i = 0; i < s->np; i++)
        if (!s->share.n || i % s->share.n == s->share.i) s->mine++, s->ndone += s->pts[i].done;
    cli_meta_int(s->meta, "result", "passes_resumed", s->merge ? 0 : s->ndone);
    cli_meta_int(s->meta, "result", "passes_run", s->mine - s->ndone);
    kvq_eval_item *items = calloc((size_t)s->L + 1, sizeof *items);
    if (!items) return cli_error(prog, "out of memory"), CLI_RUNTIME;
    if (s->progress_mode < 0) cli_progress_option(prog, "auto", &s->progress_mode);
    s->ps = (progress_state){s->progress_mode != CLI_PROGRESS_NEVER, 0, s->mine - s->ndone, 0, time(NULL)};
    s->eo.ud = &s->ps;
    static char note_head[1024], note_tail[256];
    snprintf(note_head, sizeof note_head, "%s: interrupted: %s keeps ", prog, s->sens_path);
    snprintf(note_tail, sizeof note_tail, " of %d sensitivity passes complete; the same command with --resume "
             "continues\n", s->mine);
    cli_interrupt_note(note_head, note_tail);
    cli_interrupt_count(s->ndone);
    if (s->ndone && s->ndone < s->mine)
        fprintf(stderr, "%s: resuming: %d of %d sensitivity passes already in %s\n", prog, s->ndone, s->mine,
                s->sens_path);
    rc = CLI_OK;
    for (int i = 0; i < s->np && !rc; i++) {
        point *pt = &s->pts[i];
        if (pt->done || (s->share.n && i % s->share.n != s->share.i)) continue;
        for (int l = 0; l < s->L; l++)
            items[l] = (kvq_eval_item){.spec = &pt->spec, .layer = l,
                                       .policy = s->decode ? KVQ_POLICY_DECODE : KVQ_POLICY_PREFILL};
        double nll_ref;
        if (kvq_model_eval(s->m, s->ids, s->T, items, s->L, &s->eo, &nll_ref, &err)) {
            if (s->ps.on) fputc('\n', stderr);
            rc = cli_fail(prog, &err);
            break;
        }
        for (int l = 0; l < s->L; l++) {
            pt->k_bits[l] = items[l].k_bits, pt->v_bits[l] = items[l].v_bits;
            pt->dnll[l] = items[l].nll - nll_ref, pt->dnll_se[l] = items[l].dnll_se;
        }
        if ((rc = sens_append(s->fd, s->sens_path, pt, s->sc.run, s->L))) break;
        if (s->created) cli_temp_unregister(s->sens_path), s->created = 0; /* a pass is in it: kept from now on */
        pt->done = 1;
        cli_interrupt_count(++s->ndone);
        s->ps.pass++;
    }
    free(items);
    if (rc) return rc;
    if (s->ps.on && s->ps.npasses) fputc('\n', stderr);
    int closed = s->fd >= 0 ? close(s->fd) : 0;
    s->fd = -1;
    if (closed) return cli_error(prog, "%s: write failed: %s", s->sens_path, strerror(errno)), CLI_RUNTIME;
    return CLI_OK;
}

static int run(int argc, char **argv, cli_meta *meta)
{
    alloc_job s = {.stride = 1, .progress_mode = -1, .fd = -1, .meta = meta};
    int stop = 0, rc = parse_options(argc, argv, &s, &stop);
    if (rc || stop || (rc = open_inputs(&s))) goto done;
    record_options(&s);
    /* 1. sensitivities: a merge joins the shards' passes; else one pass per point not yet in the table */
    if (s.merge) {
        if ((rc = merge_shards(&s))) goto done;
    } else {
        if ((rc = sens_open(&s.sc, s.sens_path, s.resume, &s.fd, &s.created))) goto done;
        if (s.created) cli_temp_register(s.sens_path); /* an interrupted first pass leaves nothing */
        if (s.resume && !s.created) cli_meta_input_extended(meta, "sensitivity (resumed)", s.sens_path);
    }
    if ((rc = measure(&s))) goto done;
    if (s.share.n) { /* a shard's table is its result (even with no point of its own): its record, with its checksum */
        if (s.created) cli_temp_unregister(s.sens_path), s.created = 0;
        if ((rc = cli_meta_write_hashed(meta, prog, s.sens_path))) goto done;
        fprintf(stderr, "%s: %s: shard %ld/%ld complete (%d of the grid's %d points)\n", prog, s.sens_path, s.share.i,
                s.share.n, s.mine, s.np);
        goto done;
    }
    /* 2-3. the allocations, evaluated beside the uniform points */
    alloc_run ar = {.m = s.m, .ids = s.ids, .T = s.T, .L = s.L, .in = s.in, .pts = s.pts, .np = s.np,
                    .budgets = s.budgets, .nbudgets = s.nbudgets, .decode = s.decode, .eo = &s.eo, .ps = &s.ps,
                    .output = s.output, .sens_path = s.sens_path, .uni_path = s.uni_path, .meta = meta};
    rc = allocate(&ar);
done:
    if (s.fd >= 0) close(s.fd);
    if (s.created && s.sens_path) { /* no pass finished: leave nothing behind */
        cli_temp_unregister(s.sens_path);
        unlink(s.sens_path);
    }
    for (int i = 0; s.pts && i < s.np; i++) kvq_alloc_point_free(&s.pts[i]);
    for (int i = 0; s.shard_data && i < s.nshards; i++) free(s.shard_data[i]);
    free(s.shard_data);
    free(s.pts), free(s.sens_path), free(s.uni_path);
    free(s.ids);
    kvq_grid_free(s.grid);
    kvq_model_close(s.m);
    kvq_calib_close(s.cal);
    return rc;
}

int main(int argc, char **argv) { return cli_main(prog, argc, argv, CLI_MAIN_TUNE_MALLOC, run); }

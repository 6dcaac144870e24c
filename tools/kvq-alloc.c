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

static void usage(FILE *f)
{
    fprintf(f,
        "usage: kvq-alloc MODEL (--text FILE | --tokens FILE) --family NAME --grid K=V1,V2,...\n"
        "                 [--grid ...] [--fixed K=V,...] --budget B[,B...] -o OUT [options]\n"
        "The per-layer assignment of a family's grid points that minimises the predicted loss\n"
        "within each budget of mean stored bits per element (K and V together), from each\n"
        "layer's sensitivity (dnll with only that layer quantized), then evaluated in full\n"
        "beside the uniform points within the budget.\n\n"
        "      --family NAME     the quantizer family (see kvq-analyze --list-quantizers),\n"
        "                        or a template tokens(SELECT; HI; LO) (its selector's keys)\n"
        "  -g, --grid K=V1,V2    values of key K; repeatable (points: their product)\n"
        "  -f, --fixed K=V[,..]  keys held fixed at every point; repeatable\n"
        "  -b, --budget B[,B..]  mean stored bits per element over K and V (repeatable)\n"
        "  -o, --output OUT      the allocations (CSV, or JSON lines for *.jsonl), written\n"
        "                        atomically; beside it OUT.sensitivity.csv (appended pass by\n"
        "                        pass), OUT.uniform.csv (every uniform point evaluated) and\n"
        "                        OUT.meta.json (the run's provenance)\n"
        CLI_META_HELP
        "      --resume          keep the complete passes of OUT.sensitivity.csv, run the rest\n"
        "      --shard I/N       measure only the grid's valid points i with i mod N = I, into\n"
        "                        the sensitivity table -o OUT itself (no --budget)\n"
        "      --merge           kvq-alloc --merge MODEL SHARD... (the shards' tables, with\n"
        "                        the run's other options): join them into OUT.sensitivity.csv\n"
        "                        and allocate\n"
        "      --policy P        prefill (default) or decode, as kvq-eval\n"
        "      --stride N        decode: re-quantize the cache every N positions (default 1)\n"
        "      --chunk N         corpus evaluation in windows of N tokens (as kvq-eval)\n"
        "      --chunks K        only the first K windows\n"
        "      --calib FILE      calibration dump of the same model\n"
        "      --text FILE       text, tokenized as llama.cpp does (BOS if the model adds one)\n"
        "      --tokens FILE     whitespace-separated token ids instead (any model)\n"
        "      --tokenizer FILE  llama2.c tokenizer.bin (llama2.c checkpoints only)\n"
        "      --max-tokens N    keep the first N tokens (BOS included)\n"
        "      --progress WHEN   auto (default: on a terminal), always or never\n"
        "      --threads N       worker threads (default: all cores)\n"
        "      --seed N          seed of the quantizers' random streams (default 0)\n"
        "  -h, --help            this help\n"
        "  -V, --version         print the version\n\n"
        "Example: kvq-alloc stories260K.gguf --text story.txt --family kivi --grid kbits=2,4,8 \\\n"
        "           --grid vbits=2,4,8 --fixed residual=0 --budget 3,4,6 -o alloc.csv\n");
}

enum {
    OPT_FAMILY = 256,
    OPT_RESUME,
    OPT_POLICY,
    OPT_STRIDE,
    OPT_CHUNK,
    OPT_CHUNKS,
    OPT_CALIB,
    OPT_PROGRESS,
    OPT_SEED,
    OPT_SHARD,
    OPT_MERGE
};

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

static int allocate(const alloc_run *a)
{
    int L = a->L, np = a->np, nb = a->nbudgets, rc = CLI_RUNTIME;
    double n_l = 2.0 * a->in->n_kv_heads * a->in->head_dim; /* K and V elements of a layer per token */
    kvq_allocation al;
    int *uni = calloc((size_t)np, sizeof *uni), *best = calloc((size_t)nb, sizeof *best);
    double *unll = calloc((size_t)np, sizeof *unll);
    kvq_eval_item *items = calloc((size_t)(np + nb) + 1, sizeof *items);
    kvq_report *rep = NULL, *urep = NULL;
    cli_out out = {0}, uout = {0};
    kvq_error err = {0};
    kvq_policy pol = a->decode ? KVQ_POLICY_DECODE : KVQ_POLICY_PREFILL;
    kvq_status pst = kvq_alloc_plan(a->pts, np, L, n_l, a->budgets, nb, &al, &err);
    if (pst) { /* a budget's refusal names its option */
        if (al.bad_budget >= 0) cli_error(prog, "--%s", err.msg);
        else cli_fail(prog, &err);
        rc = pst == KVQ_ERR_USAGE ? CLI_USAGE : CLI_RUNTIME;
        goto done;
    }
    if (!uni || !best || !unll || !items) {
        cli_error(prog, "out of memory");
        goto done;
    }
    /* the allocations and the uniform points within the largest budget, in full */
    int nit = 0;
    for (int b = 0; b < nb; b++) items[nit++] = (kvq_eval_item){.spec = &al.mix[b], .layer = -1, .policy = pol};
    for (int i = 0; i < np; i++) {
        uni[i] = -1;
        if (al.fits[i]) uni[i] = nit, items[nit++] = (kvq_eval_item){.spec = &a->pts[i].spec, .layer = -1, .policy = pol};
    }
    a->ps->validating = 1;
    double nll_ref;
    kvq_status est = kvq_model_eval(a->m, a->ids, a->T, items, nit, a->eo, &nll_ref, &err);
    if (a->ps->on) fputc('\n', stderr);
    if (est) { rc = cli_fail(prog, &err); goto done; }
    for (int i = 0; i < np; i++) unll[i] = uni[i] >= 0 ? items[uni[i]].nll : NAN;

    static const char *const cols[] = {"budget", "spec", "mean_bits", "k_bits", "v_bits", "dnll_pred",
                                       "dnll", "dnll_se", "kl", "top1"};
    enum { NCOL = sizeof cols / sizeof cols[0] };
    kvq_format fmt = cli_pick_format(NULL, a->output);
    if (fmt == KVQ_FMT_TABLE) fmt = KVQ_FMT_CSV;
    if (cli_out_open(&out, a->output, prog) || cli_out_attach_meta(&out, a->meta, prog) ||
        cli_out_open(&uout, a->uni_path, prog))
        goto done;
    rep = kvq_rows_new(out.f, fmt, cols, NCOL, 2);
    urep = kvq_rows_new(uout.f, KVQ_FMT_CSV, cols + 1, NCOL - 1, 1);
    kvq_status wst = !rep || !urep ? KVQ_ERR_NOMEM : KVQ_OK;
    for (int b = 0; b < nb && !wst; b++) { /* each budget's allocation, then its best uniform point */
        char bt[32];
        snprintf(bt, sizeof bt, "%g", a->budgets[b]);
        best[b] = kvq_alloc_best_uniform(&al, a->budgets[b], unll);
        for (int r = 0; r < 2 && !wst; r++) {
            const kvq_eval_item *it = r ? (best[b] >= 0 ? &items[uni[best[b]]] : NULL) : &items[b];
            if (!it) {
                fprintf(stderr, "%s: note: --budget %g: no uniform point of the grid fits\n", prog, a->budgets[b]);
                break;
            }
            kvq_cell row[NCOL] = {{.text = bt}, {.text = it->spec->text},
                                  {.num = (it->k_bits + it->v_bits) / 2, .is_num = 1},
                                  {.num = it->k_bits, .is_num = 1}, {.num = it->v_bits, .is_num = 1},
                                  {.num = r ? al.upred[best[b]] : al.pred[b], .is_num = 1},
                                  {.num = it->nll - nll_ref, .is_num = 1}, {.num = it->dnll_se, .is_num = 1},
                                  {.num = it->kl, .is_num = 1}, {.num = it->top1, .is_num = 1}};
            errno = 0;
            wst = kvq_rows_add(rep, row);
        }
    }
    for (int i = 0; i < np && !wst; i++) {
        if (uni[i] < 0) continue;
        const kvq_eval_item *it = &items[uni[i]];
        kvq_cell row[NCOL - 1] = {{.text = it->spec->text}, {.num = (it->k_bits + it->v_bits) / 2, .is_num = 1},
                                  {.num = it->k_bits, .is_num = 1}, {.num = it->v_bits, .is_num = 1},
                                  {.num = al.upred[i], .is_num = 1}, {.num = it->nll - nll_ref, .is_num = 1},
                                  {.num = it->dnll_se, .is_num = 1}, {.num = it->kl, .is_num = 1},
                                  {.num = it->top1, .is_num = 1}};
        errno = 0;
        wst = kvq_rows_add(urep, row);
    }
    int werr = errno;
    if (!wst) {
        errno = 0;
        wst = kvq_report_finish(rep);
        rep = NULL;
        werr = errno;
    }
    if (!wst) {
        errno = 0;
        wst = kvq_report_finish(urep);
        urep = NULL;
        werr = errno;
    }
    if (wst) {
        rc = cli_write_error(prog, a->output, wst, werr);
        goto done;
    }
    if (cli_out_commit(&uout, prog) || cli_out_commit(&out, prog)) goto done;
    /* the summary: the four files, then each budget's allocation beside its best uniform point */
    fprintf(stderr, "%s: wrote %s (the allocations), %s (%d sensitivity passes), %s (%d uniform points), %s.meta.json\n",
            prog, a->output, a->sens_path, np, a->uni_path, nit - nb, a->output);
    for (int b = 0; b < nb; b++) {
        const kvq_eval_item *ab = &items[b], *u = best[b] >= 0 ? &items[uni[best[b]]] : NULL;
        fprintf(stderr, "  budget %g: %s — %.4g bits, dnll %.4g", a->budgets[b], ab->spec->text,
                (ab->k_bits + ab->v_bits) / 2, ab->nll - nll_ref);
        if (u)
            fprintf(stderr, "; best uniform %s — %.4g bits, dnll %.4g\n", u->spec->text, (u->k_bits + u->v_bits) / 2,
                    u->nll - nll_ref);
        else fputs("; no uniform point fits\n", stderr);
    }
    rc = CLI_OK;
done:
    kvq_report_discard(rep);
    kvq_report_discard(urep);
    if (out.f) cli_out_abort(&out);
    if (uout.f) cli_out_abort(&uout);
    kvq_allocation_free(&al);
    free(uni), free(best), free(unll), free(items);
    return rc;
}

static int run(int argc, char **argv, cli_meta *meta)
{
    static const struct option longopts[] = {
        {"family", required_argument, 0, OPT_FAMILY}, {"grid", required_argument, 0, 'g'},
        {"fixed", required_argument, 0, 'f'}, {"budget", required_argument, 0, 'b'},
        {"output", required_argument, 0, 'o'}, {"resume", no_argument, 0, OPT_RESUME},
        {"shard", required_argument, 0, OPT_SHARD}, {"merge", no_argument, 0, OPT_MERGE},
        {"policy", required_argument, 0, OPT_POLICY}, {"stride", required_argument, 0, OPT_STRIDE},
        {"chunk", required_argument, 0, OPT_CHUNK}, {"chunks", required_argument, 0, OPT_CHUNKS},
        {"calib", required_argument, 0, OPT_CALIB}, CLI_MODEL_LONGOPTS,
        {"progress", required_argument, 0, OPT_PROGRESS}, {"seed", required_argument, 0, OPT_SEED},
        CLI_META_LONGOPTS, {"help", no_argument, 0, 'h'}, {"version", no_argument, 0, 'V'}, {0, 0, 0, 0}};
    const char *family = NULL, *output = NULL, *calib = NULL, *grids[MAX_ARGS], *fixed[MAX_ARGS];
    int ngrids = 0, nfixed = 0, nbudgets = 0, resume = 0, merge = 0, decode = 0, progress_mode = -1, rc = CLI_OK, c;
    double budgets[MAX_BUDGETS];
    long stride = 1, chunk = 0, chunks = 0, shard_i = 0, shard_n = 0;
    uint64_t seed = 0;
    cli_model mo = {0};
    kvq_grid *grid = NULL;
    kvq_model *m = NULL;
    kvq_calib *cal = NULL;
    point *pts = NULL;
    int np = 0, *ids = NULL, T = 0, L = 0, fd = -1, created = 0;
    kvq_eval_item *items = NULL;
    char *sens_path = NULL, *uni_path = NULL, **shard_data = NULL;
    int nshards = 0;
    kvq_error err = {0};
    const cli_getopt_ctx go = {.prog = prog, .usage = usage, .analysis = NULL, .model = &mo, .meta = meta};
    while ((c = cli_getopt(&go, argc, argv, ":g:f:b:o:hV", longopts, &rc)) != -1) {
        if (c == CLI_GETOPT_STOP) goto done;
        switch (c) {
        case OPT_FAMILY: family = optarg; break;
        case 'g':
        case 'f':
            if ((c == 'g' ? ngrids : nfixed) == MAX_ARGS) {
                cli_error(prog, "more than %d --%s options", MAX_ARGS, c == 'g' ? "grid" : "fixed");
                rc = CLI_USAGE; goto done;
            }
            if (c == 'g') grids[ngrids++] = optarg;
            else fixed[nfixed++] = optarg;
            break;
        case 'b':
            if (parse_budgets(optarg, budgets, &nbudgets)) {
                cli_error(prog, "--budget %s: expected positive numbers of bits, comma-separated (at most %d)", optarg,
                          MAX_BUDGETS);
                rc = CLI_USAGE; goto done;
            }
            break;
        case 'o': output = optarg; break;
        case OPT_RESUME: resume = 1; break;
        case OPT_MERGE: merge = 1; break;
        case OPT_SHARD:
            if (cli_parse_shard(optarg, &shard_i, &shard_n)) {
                cli_error(prog, "--shard %s: expected I/N with 0 <= I < N, e.g. 0/4", optarg);
                rc = CLI_USAGE; goto done;
            }
            break;
        case OPT_POLICY:
            if (!strcmp(optarg, "prefill") || !strcmp(optarg, "decode")) decode = !strcmp(optarg, "decode");
            else { cli_error(prog, "--policy %s: expected prefill or decode", optarg); rc = CLI_USAGE; goto done; }
            break;
        case OPT_STRIDE:
        case OPT_CHUNK:
        case OPT_CHUNKS: {
            long *dst = c == OPT_STRIDE ? &stride : c == OPT_CHUNK ? &chunk : &chunks;
            if (cli_parse_long(optarg, c == OPT_CHUNK ? 4 : 1, 1L << 30, dst)) {
                cli_error(prog, "--%s %s: expected an integer %s", c == OPT_STRIDE ? "stride" : c == OPT_CHUNK ? "chunk"
                          : "chunks", optarg, c == OPT_CHUNK ? "4..2^30" : "1..2^30");
                rc = CLI_USAGE; goto done;
            }
            break;
        }
        case OPT_CALIB: calib = optarg; break;
        case OPT_PROGRESS:
            if ((rc = cli_progress_option(prog, optarg, &progress_mode))) goto done;
            break;
        case OPT_SEED:
            if (cli_parse_u64(optarg, &seed)) {
                cli_error(prog, "--seed %s: expected a non-negative integer", optarg);
                rc = CLI_USAGE; goto done;
            }
            break;
        }
    }
    /* --merge: MODEL SHARD...; else MODEL alone */
    int nops = argc - optind;
    if (merge && nops >= 2) nshards = nops - 1, argc = optind + 1;
    else if (merge) { cli_error(prog, "--merge: expected MODEL SHARD... (the shards' sensitivity tables)"); rc = CLI_USAGE; goto done; }
    if ((rc = cli_model_check(prog, argc, optind, &mo,
                              "kvq-alloc MODEL (--text FILE | --tokens FILE) --family NAME --grid ... --budget B -o OUT")))
        goto done;
    char **shards = argv + optind + 1;
    if (!family || !ngrids || !output || (!nbudgets && !shard_n)) {
        cli_error(prog, "%s required (see --help)", !family ? "--family NAME" : !ngrids ? "--grid K=V1,V2,..."
                  : !output ? "-o OUT" : "--budget B");
        rc = CLI_USAGE; goto done;
    }
    if (shard_n && (nbudgets || merge)) {
        cli_error(prog, "--shard %ld/%ld measures sensitivities only: --budget and --merge go to the merge", shard_i,
                  shard_n);
        rc = CLI_USAGE; goto done;
    }
    if (merge && resume) { cli_error(prog, "--merge joins finished shards: --resume does not apply"); rc = CLI_USAGE; goto done; }
    if (chunks && !chunk) { cli_error(prog, "--chunks needs --chunk N"); rc = CLI_USAGE; goto done; }
    if (!output[0] || !strcmp(output, "-")) { cli_error(prog, "-o: expected a file name"); rc = CLI_USAGE; goto done; }
    if ((rc = cli_meta_check_format(prog, meta, shard_n ? KVQ_FMT_CSV : cli_pick_format(NULL, output)))) goto done;
    if (kvq_grid_new(family, grids, ngrids, fixed, nfixed, &grid, &err)) { rc = cli_fail(prog, &err); goto done; }
    size_t npoints = kvq_grid_size(grid);
    if (!(pts = calloc(npoints, sizeof *pts))) { cli_error(prog, "out of memory"); rc = CLI_RUNTIME; goto done; }
    for (size_t p = 0; p < npoints; p++) {
        kvq_error perr = {0};
        if (kvq_grid_spec(grid, p, &pts[np].spec, &perr)) {
            fprintf(stderr, "%s: note: point %zu skipped: %s\n", prog, p, perr.msg);
            continue;
        }
        np++;
    }
    if (!np) { cli_error(prog, "the grid has no valid point"); rc = CLI_USAGE; goto done; }
    /* the sensitivity table: the shard's -o, or OUT.sensitivity.csv */
    if (shard_n) {
        if (!(sens_path = strdup(output))) { cli_error(prog, "out of memory"); rc = CLI_RUNTIME; goto done; }
    } else if (asprintf(&sens_path, "%s.sensitivity.csv", output) < 0 ||
               asprintf(&uni_path, "%s.uniform.csv", output) < 0) {
        sens_path = uni_path = NULL;
        cli_error(prog, "out of memory");
        rc = CLI_RUNTIME; goto done;
    }
    {
        const char *in[MAX_ARGS + 5] = {argv[optind], mo.text, mo.tokens, mo.tokenizer, calib};
        int nin = 5;
        for (int i = 0; i < nshards && nin < MAX_ARGS + 5; i++) in[nin++] = shards[i];
        if ((rc = cli_check_output(prog, output, in, nin)) ||
            (!shard_n && (rc = cli_check_side_file(prog, "the sensitivity table of -o", sens_path, in, nin))) ||
            (uni_path && (rc = cli_check_side_file(prog, "the uniform points of -o", uni_path, in, nin))))
            goto done;
    }
    if (calib && kvq_calib_open(calib, &cal, &err)) { rc = cli_fail(prog, &err); goto done; }
    for (int i = 0; i < np; i++)
        if ((rc = cli_check_calib(prog, &pts[i].spec, cal != NULL))) goto done;
    mo.no_context_cut = chunk > 0;
    mo.uses = chunk > 0 && chunks > 0 ? chunk * chunks : 0; /* --chunks K: the first K windows alone */
    if ((rc = cli_model_load(prog, argv, optind, &mo, &m, &ids, &T))) goto done;
    const kvq_model_info *in = kvq_model_get_info(m);
    L = in->n_layers;
    for (int i = 0; i < np; i++)
        if (kvq_spec_check_shape(&pts[i].spec, in->head_dim, &err)) { rc = cli_fail(prog, &err); goto done; }
    if (chunk > in->context_length) {
        cli_error(prog, "--chunk %ld: the model's context length is %d", chunk, in->context_length);
        rc = CLI_USAGE; goto done;
    }
    if (chunk && T < chunk) {
        cli_error(prog, "%s: %d tokens: fewer than one window of --chunk %ld", mo.text ? mo.text : mo.tokens, T, chunk);
        rc = CLI_RUNTIME; goto done;
    }
    kvq_eval_opts eo = {.stride = (int)stride, .seed = seed, .nthreads = (int)mo.threads, .calib = cal,
                        .progress = pass_progress, .chunk = (int)chunk, .chunks = (int)chunks};
    sens_ctx sc = {.pts = pts, .np = np, .L = L};
    snprintf(sc.run, sizeof sc.run, "%016" PRIx64,
             kvq_eval_fingerprint(m, ids, T, decode ? KVQ_POLICY_DECODE : KVQ_POLICY_PREFILL, &eo, calib));
    for (int i = 0; i < np; i++) {
        point *pt = &pts[i];
        if (kvq_alloc_point_init(pt, L, &err) ||
            kvq_alloc_stored_bits(&pt->spec, in, chunk ? (int)chunk : T, cal, seed, (int)mo.threads, &pt->want_k,
                                  &pt->want_v, &err)) {
            rc = cli_fail(prog, &err);
            goto done;
        }
    }

    /* provenance: the inputs and every option's effective value */
    cli_meta_operands(meta, argv + optind, 1);
    cli_meta_model(meta, argv[optind], &mo, in, T);
    cli_meta_input(meta, "calib", calib);
    cli_meta_str(meta, "options", "family", family);
    cli_meta_empty_list(meta, "options", "grid");
    for (int i = 0; i < ngrids; i++) cli_meta_list(meta, "options", "grid", grids[i]);
    cli_meta_empty_list(meta, "options", "fixed");
    for (int i = 0; i < nfixed; i++) cli_meta_list(meta, "options", "fixed", fixed[i]);
    cli_meta_empty_list(meta, "options", "budget");
    for (int b = 0; b < nbudgets; b++) {
        char bt[32];
        snprintf(bt, sizeof bt, "%.17g", budgets[b]);
        cli_meta_list(meta, "options", "budget", bt);
    }
    cli_meta_bool(meta, "options", "resume", resume);
    cli_meta_bool(meta, "options", "merge", merge);
    if (shard_n) {
        char sh[48];
        snprintf(sh, sizeof sh, "%ld/%ld", shard_i, shard_n);
        cli_meta_str(meta, "options", "shard", sh);
    }
    cli_meta_str(meta, "options", "policy", decode ? "decode" : "prefill");
    cli_meta_int(meta, "options", "stride", stride);
    cli_meta_int_set(meta, "options", "chunk", chunk);
    cli_meta_int_set(meta, "options", "chunks", chunks);
    cli_meta_str(meta, "options", "calib", calib);
    cli_meta_u64(meta, "options", "seed", seed);
    cli_meta_str(meta, "result", "run", sc.run);
    cli_meta_str(meta, "result", "sensitivity", sens_path);
    cli_meta_str(meta, "result", "uniform", uni_path);

    /* 1. sensitivities: a merge joins the shards' passes; else one --per-layer pass per point not yet in the table */
    if (merge) {
        if (!(shard_data = calloc((size_t)nshards, sizeof *shard_data))) { cli_error(prog, "out of memory"); rc = CLI_RUNTIME; goto done; }
        for (int s = 0; s < nshards; s++) {
            size_t size, keep;
            if ((rc = cli_read_file(prog, shards[s], &shard_data[s], &size))) goto done;
            if ((rc = sens_load(&sc, shards[s], shards[s], shard_data[s], size, &keep))) goto done;
            cli_meta_input(meta, "shard", shards[s]);
        }
        int missing = 0;
        char list[256] = "";
        for (int i = 0; i < np; i++)
            if (!pts[i].done) {
                size_t l = strlen(list);
                if (missing < 5) snprintf(list + l, sizeof list - l, "%s%s", missing ? "; " : "", pts[i].spec.text);
                missing++;
            }
        if (missing) {
            cli_error(prog, "%d of the grid's %d points are in no shard: %s%s", missing, np, list,
                      missing > 5 ? "; ..." : "");
            rc = CLI_RUNTIME; goto done;
        }
        /* OUT.sensitivity.csv: the shards' passes in point order, as one run writes them */
        if (access(sens_path, F_OK) == 0) {
            cli_error(prog, "%s exists: a merge writes it anew (remove it)", sens_path);
            rc = CLI_USAGE; goto done;
        }
        if ((rc = sens_open(&sc, sens_path, 0, &fd, &created))) goto done;
        cli_temp_register(sens_path); /* until it is whole */
        for (int i = 0; i < np; i++)
            if (cli_write_all(fd, pts[i].rows, pts[i].rows_len)) {
                cli_error(prog, "%s: write failed: %s", sens_path, strerror(errno));
                rc = CLI_RUNTIME; goto done;
            }
        if (fsync(fd)) { cli_error(prog, "%s: write failed: %s", sens_path, strerror(errno)); rc = CLI_RUNTIME; goto done; }
        cli_temp_unregister(sens_path), created = 0;
        fprintf(stderr, "%s: joined %d sensitivity passes from %d shards into %s\n", prog, np, nshards, sens_path);
    } else {
        if ((rc = sens_open(&sc, sens_path, resume, &fd, &created))) goto done;
        if (created) cli_temp_register(sens_path); /* an interrupted first pass leaves nothing */
        if (resume && !created) cli_meta_input_extended(meta, "sensitivity (resumed)", sens_path);
    }
    int mine = 0, ndone = 0; /* this run's points (a shard's share), and those already measured */
    for (int i = 0; i < np; i++)
        if (!shard_n || i % shard_n == shard_i) mine++, ndone += pts[i].done;
    cli_meta_int(meta, "result", "passes_resumed", merge ? 0 : ndone);
    cli_meta_int(meta, "result", "passes_run", mine - ndone);
    if (!(items = calloc((size_t)L + 1, sizeof *items))) { cli_error(prog, "out of memory"); rc = CLI_RUNTIME; goto done; }
    if (progress_mode < 0) cli_progress_option(prog, "auto", &progress_mode);
    progress_state ps = {progress_mode != CLI_PROGRESS_NEVER, 0, mine - ndone, 0, time(NULL)};
    eo.ud = &ps;
    static char note_head[1024], note_tail[256];
    snprintf(note_head, sizeof note_head, "interrupted: %s keeps ", sens_path);
    snprintf(note_tail, sizeof note_tail, " of %d sensitivity passes complete; the same command with --resume "
             "continues\n", mine);
    cli_interrupt_note(note_head, note_tail);
    cli_interrupt_count(ndone);
    if (ndone && ndone < mine)
        fprintf(stderr, "%s: resuming: %d of %d sensitivity passes already in %s\n", prog, ndone, mine, sens_path);
    for (int i = 0; i < np; i++) {
        point *pt = &pts[i];
        if (pt->done || (shard_n && i % shard_n != shard_i)) continue;
        for (int l = 0; l < L; l++)
            items[l] = (kvq_eval_item){.spec = &pt->spec, .layer = l,
                                       .policy = decode ? KVQ_POLICY_DECODE : KVQ_POLICY_PREFILL};
        double nll_ref;
        if (kvq_model_eval(m, ids, T, items, L, &eo, &nll_ref, &err)) {
            if (ps.on) fputc('\n', stderr);
            rc = cli_fail(prog, &err);
            goto done;
        }
        for (int l = 0; l < L; l++) {
            pt->k_bits[l] = items[l].k_bits, pt->v_bits[l] = items[l].v_bits;
            pt->dnll[l] = items[l].nll - nll_ref, pt->dnll_se[l] = items[l].dnll_se;
        }
        if ((rc = sens_append(fd, sens_path, pt, sc.run, L))) goto done;
        if (created) cli_temp_unregister(sens_path), created = 0; /* a pass is in it: kept from now on */
        pt->done = 1;
        cli_interrupt_count(++ndone);
        ps.pass++;
    }
    if (ps.on && ps.npasses) fputc('\n', stderr);
    if (fd >= 0 && close(fd)) {
        fd = -1;
        cli_error(prog, "%s: write failed: %s", sens_path, strerror(errno));
        rc = CLI_RUNTIME; goto done;
    }
    fd = -1;
    if (shard_n) { /* a shard's table is its result (even with no point of its own): its record, with its checksum */
        if (created) cli_temp_unregister(sens_path), created = 0;
        if ((rc = cli_meta_write_hashed(meta, prog, sens_path))) goto done;
        fprintf(stderr, "%s: %s: shard %ld/%ld complete (%d of the grid's %d points)\n", prog, sens_path, shard_i,
                shard_n, mine, np);
        goto done;
    }

    /* 2-3. the allocations, evaluated beside the uniform points */
    alloc_run ar = {.m = m, .ids = ids, .T = T, .L = L, .in = in, .pts = pts, .np = np, .budgets = budgets,
                    .nbudgets = nbudgets, .decode = decode, .eo = &eo, .ps = &ps, .output = output,
                    .sens_path = sens_path, .uni_path = uni_path, .meta = meta};
    rc = allocate(&ar);
done:
    if (fd >= 0) close(fd);
    if (created && sens_path) { /* no pass finished: leave nothing behind */
        cli_temp_unregister(sens_path);
        unlink(sens_path);
    }
    for (int i = 0; pts && i < np; i++) kvq_alloc_point_free(&pts[i]);
    for (int s = 0; shard_data && s < nshards; s++) free(shard_data[s]);
    free(shard_data);
    free(pts), free(items), free(sens_path), free(uni_path);
    free(ids);
    kvq_grid_free(grid);
    kvq_model_close(m);
    kvq_calib_close(cal);
    return rc;
}

int main(int argc, char **argv) { return cli_main(prog, argc, argv, CLI_MAIN_TUNE_MALLOC, run); }

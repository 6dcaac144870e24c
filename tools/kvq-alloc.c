/* kvq-alloc — which layers, and keys or values, deserve the bits
 * (docs/models.md#kvq-alloc): per-layer sensitivities of one family over a
 * grid (one kvq-eval --per-layer pass per point, appended to
 * OUT.sensitivity.csv as each finishes, so --resume continues), the exact
 * knapsack optimum per bit budget (kvq_alloc_solve), then the chosen mix
 * and the uniform points within the budgets evaluated in full. */
#define _GNU_SOURCE /* asprintf */
#include "cli.h"

#include <errno.h>
#include <getopt.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
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
        "      --family NAME     the quantizer family (see kvq-analyze --list-quantizers)\n"
        "  -g, --grid K=V1,V2    values of key K; repeatable (points: their product)\n"
        "  -f, --fixed K=V[,..]  keys held fixed at every point; repeatable\n"
        "  -b, --budget B[,B..]  mean stored bits per element over K and V (repeatable)\n"
        "  -o, --output OUT      the allocations (CSV, or JSON lines for *.jsonl), written\n"
        "                        atomically; beside it OUT.sensitivity.csv (appended pass by\n"
        "                        pass), OUT.uniform.csv (every uniform point evaluated) and\n"
        "                        OUT.meta.json (the run's provenance)\n"
        CLI_META_HELP
        "      --resume          keep the complete passes of OUT.sensitivity.csv, run the rest\n"
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

enum { OPT_FAMILY = 256, OPT_RESUME, OPT_POLICY, OPT_STRIDE, OPT_CHUNK, OPT_CHUNKS, OPT_CALIB, OPT_PROGRESS, OPT_SEED };

enum { MAX_ARGS = 64, MAX_BUDGETS = 64 };

/* One valid grid point and its sensitivity row per layer. */
typedef struct point {
    kvq_spec spec;
    double *k_bits, *v_bits, *dnll, *dnll_se; /* [L] */
    int done;
} point;

/* --- OUT.sensitivity.csv: read back for --resume ------------------------ */

/* The next CSV field of *p (quoted or not) into buf; *p moves past its comma. */
static int csv_field(const char **p, char *buf, size_t len)
{
    const char *s = *p;
    size_t o = 0;
    if (*s == '"') {
        for (s++; *s && !(*s == '"' && s[1] != '"'); s++) {
            if (*s == '"') s++;
            if (o + 1 < len) buf[o++] = *s;
        }
        if (*s != '"') return -1;
        s++;
    } else {
        for (; *s && *s != ',' && *s != '\n'; s++)
            if (o + 1 < len) buf[o++] = *s;
    }
    buf[o] = '\0';
    if (*s == ',') s++;
    *p = s;
    return 0;
}

static const char *const SENS_COLS[] = {"layer", "spec", "k_bits", "v_bits", "bits", "dnll", "dnll_se"};
enum { NSENS = 7 };

/* Reads the rows of `path` into the points whose spec they name; a point is
 * complete with all L layers.  Returns the byte length of the complete
 * points' rows (the file is cut there), or -1 after printing an error. */
static long sens_read(const char *path, point *pts, int np, int L)
{
    FILE *f = fopen(path, "r");
    if (!f) return errno == ENOENT ? 0 : (cli_error(prog, "%s: %s", path, strerror(errno)), -1);
    char line[4096], cell[KVQ_SPEC_MAX];
    long keep = 0, pos = 0, lineno = 0;
    int cur = -1, seen = 0; /* the point whose rows are being read, its rows so far */
    while (fgets(line, sizeof line, f)) {
        long len = (long)strlen(line);
        lineno++;
        if (len == 0 || line[len - 1] != '\n') break; /* a torn last line */
        pos += len;
        if (lineno == 1) {
            if (strncmp(line, "layer,spec,k_bits,v_bits,bits,dnll,dnll_se\n", (size_t)len)) {
                cli_error(prog, "%s: line 1: expected the header layer,spec,k_bits,v_bits,bits,dnll,dnll_se", path);
                fclose(f);
                return -1;
            }
            keep = pos;
            continue;
        }
        const char *p = line;
        double v[NSENS];
        int layer = -1, spec_i = -1;
        for (int c = 0; c < NSENS; c++) {
            char *end;
            if (csv_field(&p, cell, sizeof cell)) break;
            if (c == 1) {
                for (int i = 0; i < np; i++)
                    if (!strcmp(pts[i].spec.text, cell)) spec_i = i;
                continue;
            }
            errno = 0;
            v[c] = strtod(cell, &end);
            if (errno || end == cell || *end) { layer = -2; break; }
            if (c == 0) layer = (int)v[0];
        }
        if (spec_i < 0 || layer < 0 || layer >= L) {
            cli_error(prog, "%s: line %ld: not a row of this run's grid and model (a spec of --family/--grid/--fixed, "
                      "a layer below %d); remove the file or drop --resume", path, lineno, L);
            fclose(f);
            return -1;
        }
        if (spec_i != cur) cur = spec_i, seen = 0;
        if (layer != seen) break; /* out of order: keep what came before */
        point *pt = &pts[spec_i];
        pt->k_bits[layer] = v[2], pt->v_bits[layer] = v[3], pt->dnll[layer] = v[5], pt->dnll_se[layer] = v[6];
        if (++seen == L) pt->done = 1, keep = pos, cur = -1;
    }
    fclose(f);
    return keep;
}

/* --- the allocation as a mix -------------------------------------------- */

/* "mix(0-1,4=SPEC;2-3=SPEC)" of choice[L] (point indices), points in order of first use. */
static int mix_text(const point *pts, const int *choice, int L, char *buf, size_t len)
{
    size_t o = (size_t)snprintf(buf, len, "mix(");
    int first_item = 1;
    for (int l = 0; l < L; l++) {
        int c = choice[l], used = 0;
        for (int k = 0; k < l; k++) used |= choice[k] == c;
        if (used) continue;
        o += (size_t)snprintf(buf + o, o < len ? len - o : 0, "%s", first_item ? "" : ";");
        first_item = 0;
        int first_range = 1;
        for (int a = l; a < L; a++) {
            if (choice[a] != c) continue;
            int b = a;
            while (b + 1 < L && choice[b + 1] == c) b++;
            if (b == L - 1 && b > a) o += (size_t)snprintf(buf + o, o < len ? len - o : 0, "%s%d-", first_range ? "" : ",", a);
            else if (b == a) o += (size_t)snprintf(buf + o, o < len ? len - o : 0, "%s%d", first_range ? "" : ",", a);
            else o += (size_t)snprintf(buf + o, o < len ? len - o : 0, "%s%d-%d", first_range ? "" : ",", a, b);
            first_range = 0;
            a = b;
        }
        o += (size_t)snprintf(buf + o, o < len ? len - o : 0, "=%s", pts[c].spec.text);
    }
    o += (size_t)snprintf(buf + o, o < len ? len - o : 0, ")");
    return o < len ? 0 : -1;
}

/* --- progress ------------------------------------------------------------ */

typedef struct progress_state {
    int on, pass, npasses;
    time_t start;
} progress_state;

static void pass_progress(void *ud, int pass, int npasses, int layer, int nlayers)
{
    (void)pass, (void)npasses;
    progress_state *p = ud;
    if (!p->on) return;
    long el = (long)(time(NULL) - p->start);
    double frac = (p->pass + (double)layer / nlayers) / p->npasses;
    fprintf(stderr, "\r%s: pass %d/%d, layer %d/%d, %lds, about %lds left      ", prog, p->pass + 1, p->npasses, layer,
            nlayers, el, frac > 0 ? (long)(el / frac * (1 - frac) + 0.5) : 0L);
    fflush(stderr);
}

/* --- main ------------------------------------------------------------------ */

static int parse_budgets(const char *s, double *b, int *n)
{
    char buf[1024];
    snprintf(buf, sizeof buf, "%s", s);
    char *save = NULL;
    for (char *t = strtok_r(buf, ",", &save); t; t = strtok_r(NULL, ",", &save)) {
        char *end;
        errno = 0;
        double v = strtod(t, &end);
        if (errno || end == t || *end || !(v > 0) || !isfinite(v) || *n == MAX_BUDGETS) return -1;
        b[(*n)++] = v;
    }
    return 0;
}

int main(int argc, char **argv)
{
    cli_blas_setup(argv);
    cli_check_stdout_at_exit(prog);
    cli_tune_malloc();
    static const struct option longopts[] = {
        {"family", required_argument, 0, OPT_FAMILY}, {"grid", required_argument, 0, 'g'},
        {"fixed", required_argument, 0, 'f'}, {"budget", required_argument, 0, 'b'},
        {"output", required_argument, 0, 'o'}, {"resume", no_argument, 0, OPT_RESUME},
        {"policy", required_argument, 0, OPT_POLICY}, {"stride", required_argument, 0, OPT_STRIDE},
        {"chunk", required_argument, 0, OPT_CHUNK}, {"chunks", required_argument, 0, OPT_CHUNKS},
        {"calib", required_argument, 0, OPT_CALIB}, CLI_MODEL_LONGOPTS,
        {"progress", required_argument, 0, OPT_PROGRESS}, {"seed", required_argument, 0, OPT_SEED},
        CLI_META_LONGOPTS, {"help", no_argument, 0, 'h'}, {"version", no_argument, 0, 'V'}, {0, 0, 0, 0}};
    const char *family = NULL, *output = NULL, *calib = NULL, *grids[MAX_ARGS], *fixed[MAX_ARGS];
    int ngrids = 0, nfixed = 0, nbudgets = 0, resume = 0, decode = 0, progress_mode = -1, rc = CLI_OK, c;
    double budgets[MAX_BUDGETS];
    long stride = 1, chunk = 0, chunks = 0;
    uint64_t seed = 0;
    cli_model mo = {0};
    kvq_grid *grid = NULL;
    kvq_model *m = NULL;
    kvq_calib *cal = NULL;
    point *pts = NULL;
    int np = 0, *ids = NULL, T = 0, L = 0;
    kvq_eval_item *items = NULL;
    kvq_spec *vspecs = NULL;
    double *cost = NULL, *weight = NULL;
    int *choice = NULL;
    char *sens_path = NULL, *uni_path = NULL;
    FILE *sens = NULL;
    kvq_report *rep = NULL, *urep = NULL;
    cli_out out = {0}, uout = {0};
    kvq_error err = {0};
    cli_meta *meta = cli_meta_begin(prog, argc, argv);
    if (!meta) { cli_error(prog, "out of memory"); rc = CLI_RUNTIME; goto done; }
    opterr = 0;
    while ((c = getopt_long(argc, argv, ":g:f:b:o:hV", longopts, NULL)) != -1) {
        int mrc = cli_model_option(prog, c, optarg, &mo);
        if (mrc < 0) mrc = cli_meta_option(prog, c, optarg, meta);
        if (mrc >= 0) {
            if (mrc) { rc = mrc; goto done; }
            continue;
        }
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
        case 'h': usage(stdout); goto done;
        case 'V': cli_version(prog); goto done;
        case ':': cli_error(prog, "option %s needs a value (see --help)", argv[optind - 1]); rc = CLI_USAGE; goto done;
        default: cli_error(prog, "unknown option %s (see --help)", argv[optind - 1]); rc = CLI_USAGE; goto done;
        }
    }
    if ((rc = cli_model_check(prog, argc, optind, &mo,
                              "kvq-alloc MODEL (--text FILE | --tokens FILE) --family NAME --grid ... --budget B -o OUT")))
        goto done;
    if (!family || !ngrids || !nbudgets || !output) {
        cli_error(prog, "%s required (see --help)", !family ? "--family NAME" : !ngrids ? "--grid K=V1,V2,..."
                  : !nbudgets ? "--budget B" : "-o OUT");
        rc = CLI_USAGE; goto done;
    }
    if (chunks && !chunk) { cli_error(prog, "--chunks needs --chunk N"); rc = CLI_USAGE; goto done; }
    if (!output[0]) { cli_error(prog, "-o: expected a file name"); rc = CLI_USAGE; goto done; }
    if ((rc = cli_meta_check_format(prog, meta, cli_pick_format(NULL, output)))) goto done;
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
    if (asprintf(&sens_path, "%s.sensitivity.csv", output) < 0 || asprintf(&uni_path, "%s.uniform.csv", output) < 0) {
        sens_path = uni_path = NULL;
        cli_error(prog, "out of memory");
        rc = CLI_RUNTIME; goto done;
    }
    {
        const char *in[] = {argv[optind], mo.text, mo.tokens, mo.tokenizer, calib};
        if ((rc = cli_check_output(prog, output, in, 5)) || (rc = cli_check_output(prog, sens_path, in, 5)) ||
            (rc = cli_check_output(prog, uni_path, in, 5)))
            goto done;
    }
    if (!resume && access(sens_path, F_OK) == 0) {
        cli_error(prog, "%s exists: --resume continues its passes (or remove it)", sens_path);
        rc = CLI_USAGE; goto done;
    }
    if (calib && kvq_calib_open(calib, &cal, &err)) { rc = cli_fail(prog, &err); goto done; }
    for (int i = 0; i < np; i++)
        if (kvq_spec_needs_calib(&pts[i].spec) && !cal) {
            cli_error(prog, "%s: needs --calib FILE (a kvq-dump of another text with the same model)", pts[i].spec.text);
            rc = CLI_USAGE; goto done;
        }
    mo.no_context_cut = chunk > 0;
    if ((rc = cli_model_load(prog, argv, optind, &mo, &m, &ids, &T))) goto done;
    const kvq_model_info *in = kvq_model_get_info(m);
    L = in->n_layers;
    for (int i = 0; i < np; i++)
        if (kvq_spec_check_shape(&pts[i].spec, in->head_dim, &err)) { rc = cli_fail(prog, &err); goto done; }
    if (chunk > in->context_length) {
        cli_error(prog, "--chunk %ld: the model's context length is %d", chunk, in->context_length);
        rc = CLI_USAGE; goto done;
    }
    for (int i = 0; i < np; i++) {
        point *pt = &pts[i];
        pt->k_bits = calloc((size_t)L, sizeof(double)), pt->v_bits = calloc((size_t)L, sizeof(double));
        pt->dnll = calloc((size_t)L, sizeof(double)), pt->dnll_se = calloc((size_t)L, sizeof(double));
        if (!pt->k_bits || !pt->v_bits || !pt->dnll || !pt->dnll_se) {
            cli_error(prog, "out of memory");
            rc = CLI_RUNTIME; goto done;
        }
    }

    /* provenance: the inputs (a resumed sensitivity file is one) and every option's effective value */
    cli_meta_operands(meta, argv + optind, argc - optind);
    cli_meta_model(meta, argv[optind], &mo, in, T);
    cli_meta_input(meta, "calib", calib);
    cli_meta_str(meta, "options", "family", family);
    cli_meta_empty_list(meta, "options", "grid");
    for (int i = 0; i < ngrids; i++) cli_meta_list(meta, "options", "grid", grids[i]);
    cli_meta_empty_list(meta, "options", "fixed");
    for (int i = 0; i < nfixed; i++) cli_meta_list(meta, "options", "fixed", fixed[i]);
    for (int b = 0; b < nbudgets; b++) {
        char bt[32];
        snprintf(bt, sizeof bt, "%.17g", budgets[b]);
        cli_meta_list(meta, "options", "budget", bt);
    }
    cli_meta_bool(meta, "options", "resume", resume);
    cli_meta_str(meta, "options", "policy", decode ? "decode" : "prefill");
    cli_meta_int(meta, "options", "stride", stride);
    cli_meta_int_set(meta, "options", "chunk", chunk);
    cli_meta_int_set(meta, "options", "chunks", chunks);
    cli_meta_str(meta, "options", "calib", calib);
    cli_meta_u64(meta, "options", "seed", seed);
    cli_meta_str(meta, "result", "sensitivity", sens_path);
    cli_meta_str(meta, "result", "uniform", uni_path);

    /* 1. sensitivities: one --per-layer pass per point not yet in the file */
    long keep = resume ? sens_read(sens_path, pts, np, L) : 0;
    if (keep < 0) { rc = CLI_USAGE; goto done; }
    int ndone = 0;
    for (int i = 0; i < np; i++) ndone += pts[i].done;
    cli_meta_int(meta, "result", "passes_resumed", ndone);
    cli_meta_int(meta, "result", "passes_run", np - ndone);
    if (resume && keep > 0 && truncate(sens_path, keep)) {
        cli_error(prog, "%s: cannot drop the unfinished pass: %s", sens_path, strerror(errno));
        rc = CLI_RUNTIME; goto done;
    }
    /* the passes kept are an input (the run appends the others) */
    if (resume && access(sens_path, F_OK) == 0) cli_meta_input_extended(meta, "sensitivity (resumed)", sens_path);
    if (!(items = calloc((size_t)(L > np + nbudgets ? L : np + nbudgets) + 1, sizeof *items))) {
        cli_error(prog, "out of memory");
        rc = CLI_RUNTIME; goto done;
    }
    if (progress_mode < 0) cli_progress_option(prog, "auto", &progress_mode);
    progress_state ps = {progress_mode != CLI_PROGRESS_NEVER, 0, np - ndone + 1, time(NULL)};
    kvq_eval_opts eo = {.stride = (int)stride, .seed = seed, .nthreads = (int)mo.threads, .calib = cal,
                        .progress = pass_progress, .ud = &ps, .chunk = (int)chunk, .chunks = (int)chunks};
    static char note_head[1024], note_tail[256];
    snprintf(note_head, sizeof note_head, "interrupted: %s keeps ", sens_path);
    snprintf(note_tail, sizeof note_tail, " of %d sensitivity passes complete; the same command with --resume "
             "continues\n", np);
    cli_interrupt_note(note_head, note_tail);
    cli_interrupt_count(ndone);
    if (ndone && ndone < np)
        fprintf(stderr, "%s: resuming: %d of %d sensitivity passes already in %s\n", prog, ndone, np, sens_path);
    for (int i = 0; i < np; i++) {
        point *pt = &pts[i];
        if (pt->done) continue;
        for (int l = 0; l < L; l++)
            items[l] = (kvq_eval_item){.spec = &pt->spec, .layer = l,
                                       .policy = decode ? KVQ_POLICY_DECODE : KVQ_POLICY_PREFILL};
        double nll_ref;
        if (kvq_model_eval(m, ids, T, items, L, &eo, &nll_ref, &err)) {
            if (ps.on) fputc('\n', stderr);
            rc = cli_fail(prog, &err);
            goto done;
        }
        /* opened when the first pass is done: an interrupted first pass leaves no file */
        if (!sens && (!(sens = fopen(sens_path, "a")) || fseek(sens, 0, SEEK_END))) {
            cli_error(prog, "%s: cannot write: %s", sens_path, strerror(errno));
            rc = CLI_RUNTIME; goto done;
        }
        kvq_report *r = kvq_rows_new(sens, KVQ_FMT_CSV, SENS_COLS, NSENS, 2);
        if (!r) { cli_error(prog, "out of memory"); rc = CLI_RUNTIME; goto done; }
        if (ftell(sens) > 0) kvq_report_omit_header(r);
        kvq_status wst = KVQ_OK;
        for (int l = 0; l < L && !wst; l++) {
            char ls[16];
            snprintf(ls, sizeof ls, "%d", l);
            pt->k_bits[l] = items[l].k_bits, pt->v_bits[l] = items[l].v_bits;
            pt->dnll[l] = items[l].nll - nll_ref, pt->dnll_se[l] = items[l].dnll_se;
            kvq_cell row[NSENS] = {{.text = ls}, {.text = pt->spec.text}, {.num = pt->k_bits[l], .is_num = 1},
                                   {.num = pt->v_bits[l], .is_num = 1},
                                   {.num = (pt->k_bits[l] + pt->v_bits[l]) / 2, .is_num = 1},
                                   {.num = pt->dnll[l], .is_num = 1}, {.num = pt->dnll_se[l], .is_num = 1}};
            errno = 0;
            wst = kvq_rows_add(r, row);
        }
        int werr = errno;
        kvq_status fst = kvq_report_finish(r);
        if (!wst) wst = fst, werr = errno;
        if (!wst && (fflush(sens) || fsync(fileno(sens)))) wst = KVQ_ERR_IO, werr = errno;
        if (wst) { rc = cli_write_error(prog, sens_path, wst, werr); goto done; }
        pt->done = 1;
        cli_interrupt_count(++ndone);
        ps.pass++;
    }
    if (sens) fclose(sens);
    sens = NULL;

    /* 2. the knapsack per budget: weights are each layer's stored bits per
     * token (K and V of its KV heads); every layer of these models has the
     * same size, so the budget's capacity is B times their sum */
    double n_l = 2.0 * in->n_kv_heads * in->head_dim, ntot = n_l * L;
    cost = calloc((size_t)L * np, sizeof *cost), weight = calloc((size_t)L * np, sizeof *weight);
    choice = calloc((size_t)L * nbudgets, sizeof *choice);
    vspecs = calloc((size_t)nbudgets, sizeof *vspecs);
    if (!cost || !weight || !choice || !vspecs) { cli_error(prog, "out of memory"); rc = CLI_RUNTIME; goto done; }
    for (int l = 0; l < L; l++)
        for (int i = 0; i < np; i++) {
            cost[(size_t)l * np + i] = pts[i].dnll[l];
            weight[(size_t)l * np + i] = (pts[i].k_bits[l] + pts[i].v_bits[l]) / 2 * n_l;
        }
    for (int b = 0; b < nbudgets; b++) {
        double wmin;
        kvq_error aerr = {0};
        kvq_status st = kvq_alloc_solve(L, np, cost, weight, budgets[b] * ntot, choice + (size_t)b * L, &wmin, &aerr);
        if (st == KVQ_ERR_USAGE && wmin > budgets[b] * ntot) {
            cli_error(prog, "--budget %g: below the cheapest allocation of this grid, %.6g bits per element", budgets[b],
                      wmin / ntot);
            rc = CLI_USAGE; goto done;
        }
        if (st) { rc = cli_fail(prog, &aerr); goto done; }
        char text[KVQ_SPEC_MAX + 8];
        if (mix_text(pts, choice + (size_t)b * L, L, text, sizeof text) ||
            kvq_spec_parse(text, &vspecs[b], &err)) {
            cli_error(prog, "--budget %g: the allocation does not fit a spec of %d characters", budgets[b],
                      KVQ_SPEC_MAX - 1);
            rc = CLI_RUNTIME; goto done;
        }
    }

    /* 3. the allocations and the uniform points within the largest budget, in full */
    double bmax = 0;
    for (int b = 0; b < nbudgets; b++) bmax = budgets[b] > bmax ? budgets[b] : bmax;
    int nit = 0, *uni = calloc((size_t)np, sizeof *uni); /* uni[i]: item of point i, or −1 */
    if (!uni) { cli_error(prog, "out of memory"); rc = CLI_RUNTIME; goto done; }
    for (int b = 0; b < nbudgets; b++)
        items[nit++] = (kvq_eval_item){.spec = &vspecs[b], .layer = -1,
                                       .policy = decode ? KVQ_POLICY_DECODE : KVQ_POLICY_PREFILL};
    double *ubits = calloc((size_t)np, sizeof *ubits), *upred = calloc((size_t)np, sizeof *upred);
    if (!ubits || !upred) { free(uni), free(ubits), free(upred); cli_error(prog, "out of memory"); rc = CLI_RUNTIME; goto done; }
    for (int i = 0; i < np; i++) {
        double w = 0, s = 0;
        for (int l = 0; l < L; l++) w += weight[(size_t)l * np + i], s += cost[(size_t)l * np + i];
        ubits[i] = w / ntot, upred[i] = s, uni[i] = -1;
        if (w <= bmax * ntot)
            uni[i] = nit, items[nit++] = (kvq_eval_item){.spec = &pts[i].spec, .layer = -1,
                                                         .policy = decode ? KVQ_POLICY_DECODE : KVQ_POLICY_PREFILL};
    }
    ps.pass = ps.npasses - 1;
    double nll_ref;
    kvq_status est = kvq_model_eval(m, ids, T, items, nit, &eo, &nll_ref, &err);
    if (ps.on) fputc('\n', stderr);
    if (est) { free(uni), free(ubits), free(upred); rc = cli_fail(prog, &err); goto done; }

    static const char *const cols[] = {"budget", "spec", "mean_bits", "k_bits", "v_bits", "dnll_pred",
                                       "dnll", "dnll_se", "kl", "top1"};
    enum { NCOL = sizeof cols / sizeof cols[0] };
    kvq_format fmt = cli_pick_format(NULL, output);
    if (fmt == KVQ_FMT_TABLE) fmt = KVQ_FMT_CSV;
    kvq_status wst = KVQ_OK;
    if (cli_out_open(&out, output, prog) || cli_out_attach_meta(&out, meta, prog) ||
        cli_out_open(&uout, uni_path, prog)) {
        free(uni), free(ubits), free(upred);
        rc = CLI_RUNTIME; goto done;
    }
    rep = kvq_rows_new(out.f, fmt, cols, NCOL, 2);
    urep = kvq_rows_new(uout.f, KVQ_FMT_CSV, cols + 1, NCOL - 1, 1);
    if (!rep || !urep) wst = KVQ_ERR_NOMEM;
    for (int b = 0; b < nbudgets && !wst; b++) {
        char bt[32];
        snprintf(bt, sizeof bt, "%g", budgets[b]);
        double pred = 0;
        for (int l = 0; l < L; l++) pred += cost[(size_t)l * np + choice[(size_t)b * L + l]];
        const kvq_eval_item *a = &items[b];
        int best = -1; /* the best uniform point within this budget: least measured dnll, then fewer bits */
        for (int i = 0; i < np; i++) {
            if (uni[i] < 0 || ubits[i] * ntot > budgets[b] * ntot) continue;
            const kvq_eval_item *u = &items[uni[i]], *bu = best >= 0 ? &items[uni[best]] : NULL;
            if (!bu || u->nll < bu->nll || (u->nll == bu->nll && ubits[i] < ubits[best])) best = i;
        }
        for (int r = 0; r < 2 && !wst; r++) {
            const kvq_eval_item *it = r ? (best >= 0 ? &items[uni[best]] : NULL) : a;
            if (!it) {
                fprintf(stderr, "%s: note: --budget %g: no uniform point of the grid fits\n", prog, budgets[b]);
                break;
            }
            kvq_cell row[NCOL] = {{.text = bt}, {.text = it->spec->text},
                                  {.num = (it->k_bits + it->v_bits) / 2, .is_num = 1},
                                  {.num = it->k_bits, .is_num = 1}, {.num = it->v_bits, .is_num = 1},
                                  {.num = r ? upred[best] : pred, .is_num = 1}, {.num = it->nll - nll_ref, .is_num = 1},
                                  {.num = it->dnll_se, .is_num = 1}, {.num = it->kl, .is_num = 1},
                                  {.num = it->top1, .is_num = 1}};
            errno = 0;
            wst = kvq_rows_add(rep, row);
        }
    }
    for (int i = 0; i < np && !wst; i++) {
        if (uni[i] < 0) continue;
        const kvq_eval_item *it = &items[uni[i]];
        kvq_cell row[NCOL - 1] = {{.text = it->spec->text}, {.num = (it->k_bits + it->v_bits) / 2, .is_num = 1},
                                  {.num = it->k_bits, .is_num = 1}, {.num = it->v_bits, .is_num = 1},
                                  {.num = upred[i], .is_num = 1}, {.num = it->nll - nll_ref, .is_num = 1},
                                  {.num = it->dnll_se, .is_num = 1}, {.num = it->kl, .is_num = 1},
                                  {.num = it->top1, .is_num = 1}};
        errno = 0;
        wst = kvq_rows_add(urep, row);
    }
    free(uni), free(ubits), free(upred);
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
    if (wst) { rc = cli_write_error(prog, output, wst, werr); goto done; }
    if (cli_out_commit(&uout, prog) || cli_out_commit(&out, prog)) rc = CLI_RUNTIME;
done:
    kvq_report_discard(rep);
    kvq_report_discard(urep);
    if (out.f) cli_out_abort(&out);
    if (uout.f) cli_out_abort(&uout);
    if (sens) {
        long size = fseek(sens, 0, SEEK_END) ? 1 : ftell(sens);
        fclose(sens);
        if (size == 0) unlink(sens_path); /* no pass finished: leave nothing behind */
    }
    for (int i = 0; pts && i < np; i++) free(pts[i].k_bits), free(pts[i].v_bits), free(pts[i].dnll), free(pts[i].dnll_se);
    free(pts), free(items), free(vspecs), free(cost), free(weight), free(choice), free(sens_path), free(uni_path);
    free(ids);
    kvq_grid_free(grid);
    kvq_model_close(m);
    kvq_calib_close(cal);
    cli_meta_free(meta);
    return rc;
}

/* kvq-eval — what a quantized KV cache does to the model (docs/models.md): the
 * model runs teacher-forced over a text with the exact cache and with each
 * quantizer's cache (prefill: the whole cache quantized at once; decode:
 * the cache as generation holds it), and the loss, KL and top-1 changes are
 * reported per quantizer (and per layer with --per-layer). */
#include "eval_files.h"

#include <inttypes.h>

#include <errno.h>
#include <getopt.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

static const char *prog = "kvq-eval";

static void usage(FILE *f);

typedef struct progress_state {
    int on;
    time_t start;
    const char *unit; /* "window" (NULL), "task" */
} progress_state;

/* After each corpus window (or task): those done, elapsed, and the time left at this pace. */
static void window_progress(void *ud, int done, int total)
{
    progress_state *p = ud;
    if (!p->on) return;
    long el = (long)(time(NULL) - p->start);
    fprintf(stderr, "\r%s: %s %d/%d, %lds, about %lds left      %s", prog, p->unit ? p->unit : "window", done,
            total, el, (long)((double)el / done * (total - done) + 0.5), done == total ? "\n" : "");
    fflush(stderr);
}

static void progress(void *ud, int pass, int npasses, int layer, int nlayers)
{
    progress_state *p = ud;
    if (!p->on) return;
    fprintf(stderr, "\r%s: pass %d/%d, layer %d/%d, %lds", prog, pass + 1, npasses, layer, nlayers,
            (long)(time(NULL) - p->start));
    if (pass + 1 == npasses && layer == nlayers) fputc('\n', stderr);
    fflush(stderr);
}

/* A -q value: `none` (the exact cache: a spec without quantizer) or a registry spec. */
static int add_spec(kvq_spec **specs, int *n, const char *text)
{
    if (strcmp(text, "none")) return cli_add_spec(prog, specs, n, text);
    kvq_spec none = {0};
    snprintf(none.text, sizeof none.text, "none");
    return cli_push_spec(prog, specs, n, &none);
}

/* One run: its options as parsed, then what its steps share. */
typedef struct eval_state {
    /* the options */
    const char *output, *format, *calib, *tasks_path;
    double per_depth; /* --per-depth B (0: none) */
    int progress_mode; /* cli_progress_option's; -1 until --progress or "auto" sets it */
    long stride, chunk, chunks, context;
    cli_shard share; /* --shard I/N (n 0: none) */
    int resume, merge, per_layer, policies[2];
    int task_merge; /* --merge of --tasks shards */
    uint64_t seed;
    cli_model mo;
    kvq_spec *specs; /* -q's, or the default set */
    int nspecs, defaults;
    char **argv; /* the model is argv[optind] (a merge's shards from there) */
    int argc, optind;
    cli_meta *meta;
    /* the run */
    kvq_calib *cal;
    kvq_model *m;
    const kvq_model_info *in;
    int *ids, T, nwin;
    kvq_eval_item *items; /* [nitems]: spec × policy × layer */
    kvq_eval_row *rows;   /* [nitems]: each item's row identity */
    kvq_spec *owns;       /* [nitems]: a mix's spec of the row's layer */
    int nitems;
    char policy_name[2][40];
    kvq_format fmt;
    int w0, w1, wdone; /* a shard's windows, and those already in OUT */
    char run[17], shard_id[48]; /* a shard's run fingerprint and I/N */
    eval_shard *shard;
    cli_out out;
    kvq_report *rep;
    kvq_task *tasks; /* --tasks */
    size_t ntasks;
} eval_state;

/* -q: a spec, or none. */
static int opt_quant(const char *p, const char *arg, void *at, void *base)
{
    eval_state *s = base;
    (void)p, (void)at;
    return add_spec(&s->specs, &s->nspecs, arg);
}

/* --policy: prefill, decode or both, into policies[2]. */
static int opt_policy(const char *p, const char *arg, void *at, void *base)
{
    int *pol = at;
    (void)base;
    if (!strcmp(arg, "prefill")) pol[0] = 1, pol[1] = 0;
    else if (!strcmp(arg, "decode")) pol[0] = 0, pol[1] = 1;
    else if (!strcmp(arg, "prefill,decode") || !strcmp(arg, "decode,prefill")) pol[0] = pol[1] = 1;
    else return cli_error(p, "--policy %s: expected prefill, decode or prefill,decode", arg), CLI_USAGE;
    return CLI_OK;
}

/* Record functions of the rows whose value the record says in its own way. */
static void record_policy(cli_meta *meta, const cli_optrow *row, const void *base)
{
    const int *pol = (const int *)((const char *)base + row->offset);
    cli_meta_str(meta, "options", row->name, pol[0] && pol[1] ? "prefill,decode" : pol[0] ? "prefill" : "decode");
}

static void record_per_depth(cli_meta *meta, const cli_optrow *row, const void *base)
{
    const eval_state *s = base; /* a --tasks run's, or its shards' merge */
    if (s->tasks_path || s->task_merge) cli_meta_double(meta, "options", row->name, s->per_depth);
}

static void record_resume(cli_meta *meta, const cli_optrow *row, const void *base)
{
    const eval_state *s = base; /* a corpus shard's (a task shard is never resumed) */
    if (s->share.n && !s->tasks_path) cli_meta_bool(meta, "options", row->name, s->resume);
}

enum { OPT_CALIB = 256, OPT_POLICY, OPT_STRIDE, OPT_PER_LAYER, OPT_FORMAT, OPT_PROGRESS, OPT_SEED, OPT_CHUNK,
       OPT_CHUNKS, OPT_CONTEXT, OPT_SHARD, OPT_RESUME, OPT_MERGE, OPT_TASKS, OPT_PER_DEPTH };

/* kvq-eval's options, one row each (cli_optrow); the model's input and
 * --threads, and the record's, are cli.h's groups.  The recorded rows go into
 * the provenance as they took effect (a --merge run's: its output). */
#define ROW(nm, k, kind, field, ...) \
    {.name = nm, .key = k, .arg = kind, .offset = offsetof(eval_state, field), __VA_ARGS__}
#define REC .record = CLI_RECORD
#define REC_NULL .record = CLI_RECORD | CLI_RECORD_NULL
static const cli_optrow rows[] = {
    ROW("quant", 'q', CLI_ARG_CUSTOM, specs, .parse = opt_quant, REC, .record_fn = cli_optrow_record_specs,
        .aux_offset = offsetof(eval_state, nspecs), .metavar = "SPEC",
        .help = "quantizer spec NAME[:key=value,...], or none (the exact cache); repeatable (default: kvq-analyze's "
                "default set)"),
    ROW("calib", OPT_CALIB, CLI_ARG_TEXT, calib, REC_NULL, .metavar = "FILE",
        .help = "calibration dump of the same model (kvq-dump of another text)"),
    ROW("policy", OPT_POLICY, CLI_ARG_CUSTOM, policies, .parse = opt_policy, REC, .record_fn = record_policy,
        .metavar = "P",
        .help = "prefill (default: every layer's cache quantized once over all T tokens, as papers' perplexity "
                "tables do), decode (the cache as it holds t+1 tokens at position t), or prefill,decode"),
    ROW("stride", OPT_STRIDE, CLI_ARG_LONG, stride, REC, .min = 1, .max = 1L << 30, .expect = "a positive integer",
        .metavar = "N", .help = "decode: re-quantize the cache every N positions (default 1)"),
    ROW("per-layer", OPT_PER_LAYER, CLI_ARG_FLAG, per_layer, REC,
        .help = "one row per layer with only that layer quantized"),
    ROW("chunk", OPT_CHUNK, CLI_ARG_LONG, chunk, REC_NULL, .min = 4, .max = 1L << 30, .expect = "an integer 4..2^30",
        .metavar = "N",
        .help = "corpus evaluation (llama.cpp perplexity's protocol): windows of N tokens, each from an empty cache "
                "with BOS first when the model adds one, scoring each window's second half"),
    ROW("chunks", OPT_CHUNKS, CLI_ARG_LONG, chunks, REC_NULL, .min = 1, .max = 1L << 30, .expect = "an integer 1..2^30",
        .metavar = "K", .help = "evaluate only the first K windows"),
    ROW("context", OPT_CONTEXT, CLI_ARG_LONG, context, REC_NULL, .min = 1, .max = 1L << 30,
        .expect = "a positive integer (tokens)", .metavar = "N",
        .help = "the context protocol: the first N tokens (of each window) prefilled exactly and their cache "
                "compressed once, the rest teacher-forced on top (their own entries exact with prefill, stored by "
                "the spec or a tokens(...)'s HI with decode); only positions >= N are scored"),
    ROW("tasks", OPT_TASKS, CLI_ARG_TEXT, tasks_path, REC, .metavar = "FILE",
        .help = "retrieval tasks (JSON lines, kvq-gen --task): each context's cache compressed as --context does, "
                "the question and the answer on top; the answer scored: answer_nll, exact (every answer token the "
                "arg-max), recall_drop"),
    ROW("per-depth", OPT_PER_DEPTH, CLI_ARG_REAL, per_depth, .record = CLI_RECORD | CLI_RECORD_ALT,
        .record_fn = record_per_depth, .real_max = 1, .expect = "a bucket width in (0, 1], e.g. 0.25", .metavar = "B",
        .help = "with --tasks: also a row per depth bucket of width B"),
    ROW("shard", OPT_SHARD, CLI_ARG_CUSTOM, share, .parse = cli_optrow_shard, REC, .record_fn = cli_optrow_record_shard,
        .metavar = "I/N",
        .help = "with --chunk: only the I-th of N contiguous shares of the windows, each window's rows appended to "
                "-o OUT as it ends (with the sums --merge pools, the run's fingerprint and I/N); with --tasks: of the "
                "tasks, a row per task written to -o OUT at the end"),
    ROW("resume", OPT_RESUME, CLI_ARG_FLAG, resume, REC, .record_fn = record_resume,
        .help = "continue a shard's OUT after its last whole window"),
    ROW("merge", OPT_MERGE, CLI_ARG_FLAG, merge, .record = CLI_RECORD_ALT,
        .help = "kvq-eval --merge SHARD... [-o OUT]: pool the shards' windows (or tasks, with --per-depth B as the "
                "run's) into the rows of one run (bit for bit)"),
    ROW("format", OPT_FORMAT, CLI_ARG_CUSTOM, format, .parse = cli_optrow_format, .record = CLI_RECORD | CLI_RECORD_ALT,
        .record_fn = cli_optrow_record_format, .aux_offset = offsetof(eval_state, fmt), .metavar = "FMT",
        .help = "table, csv or jsonl (default: table on a terminal, else csv; with -o, jsonl for *.jsonl names)"),
    ROW("output", 'o', CLI_ARG_TEXT, output, .record = CLI_RECORD_ALT, .metavar = "FILE",
        .help = "write results to FILE (atomically) instead of stdout, and the run's provenance to FILE.meta.json"),
    ROW("progress", OPT_PROGRESS, CLI_ARG_CUSTOM, progress_mode, .parse = cli_optrow_progress, .metavar = "WHEN",
        .help = "auto (default: on a terminal), always or never"),
    ROW("seed", OPT_SEED, CLI_ARG_U64, seed, REC, .metavar = "N",
        .help = "seed of the quantizers' random streams (default 0)"),
};
#undef ROW
#undef REC
#undef REC_NULL
enum { NROWS = sizeof rows / sizeof rows[0] };

/* The options into s; *stop: --help or --version answered (rc as they end). */
static int parse_options(int argc, char **argv, eval_state *s, int *stop)
{
    const cli_getopt_ctx go = {.prog = prog, .usage = usage, .model = &s->mo, .meta = s->meta};
    int rc = cli_optrows_getopt(&go, rows, NROWS, ":q:o:hV", argc, argv, s, stop);
    s->argc = argc, s->argv = argv, s->optind = optind;
    return rc;
}

static void usage(FILE *f)
{
    fprintf(f, "usage: kvq-eval MODEL (--text FILE | --tokens FILE) [-q SPEC]... [options]\n"
               "       kvq-eval MODEL --tasks FILE.jsonl [-q SPEC]... [--per-depth B] [options]\n"
               "Teacher-forced loss of a model (GGUF llama/qwen2/qwen3/gemma3/phi3, or llama2.c)\n"
               "with each quantizer's KV cache against the exact cache: nll, dnll, ppl_ratio,\n"
               "KL, top-1.\n\n");
    cli_optrows_usage(f, rows, NROWS);
    cli_optrows_usage(f, cli_model_rows, cli_model_nrows);
    cli_optrows_usage(f, cli_meta_rows, cli_meta_nrows);
    fprintf(f, CLI_HELP_VERSION_HELP
               "\n"
               "Example: kvq-eval data/kvq-retrieval.gguf --text data/retrieval-main.txt \\\n"
               "           -q none -q kivi:bits=2 --policy prefill,decode\n"
               "Across machines: kvq-eval M --text T --chunk 512 -q ... --shard I/4 \\\n"
               "           -o shard-I.csv (I = 0..3), then\n"
               "                 kvq-eval --merge shard-*.csv -o all.csv\n");
}

/* --merge: the shards' rows pooled; no model to run. */
static int merge(eval_state *s)
{
    if (s->share.n || s->resume || s->nspecs || s->chunk || s->chunks || s->context || s->calib || s->per_layer ||
        s->mo.text || s->mo.tokens || s->tasks_path) {
        cli_error(prog, "--merge pools finished shards: their options are in their rows (only -o, --format, --meta "
                  "and, for task shards, --per-depth apply)");
        return CLI_USAGE;
    }
    if (s->optind >= s->argc) return cli_error(prog, "--merge: no shard files given"), CLI_USAGE;
    char **shards = s->argv + s->optind;
    int nshards = s->argc - s->optind, rc = cli_check_output(prog, s->output, (const char *const *)shards, nshards);
    if (rc) return rc;
    s->fmt = cli_pick_format(s->format, s->output);
    s->task_merge = kvq_is_task_shard(shards[0]); /* kvq-eval --tasks --shard's */
    if (!s->task_merge && s->per_depth)
        return cli_error(prog, "--per-depth: the shards are not of a --tasks run"), CLI_USAGE;
    cli_optrows_record(s->meta, rows, NROWS, s, 1);
    if (s->task_merge) return eval_task_merge(prog, shards, nshards, s->output, s->fmt, s->per_depth, s->meta);
    return eval_merge(prog, shards, nshards, s->output, s->fmt, s->meta);
}

/* The calibration dump, the specs (the default set when none is given) and
 * the calibration each needs: what both kinds of run set up first. */
static int open_specs(eval_state *s)
{
    kvq_error err = {0};
    int rc;
    if (s->calib && kvq_calib_open(s->calib, &s->cal, &err)) return cli_fail(prog, &err);
    s->defaults = s->nspecs == 0;
    if (s->defaults && (rc = cli_add_default_specs(prog, s->cal != NULL, &s->specs, &s->nspecs, NULL, 0))) return rc;
    for (int i = 0; i < s->nspecs; i++)
        if (s->specs[i].q && (rc = cli_check_calib(prog, &s->specs[i], s->cal != NULL))) return rc;
    return CLI_OK;
}

/* llama.cpp's block rule (ggml, fp4), as kvq-analyze: the default set
 * without what the model's head_dim cannot run, with a note. */
static int fit_specs(eval_state *s)
{
    char skipped[256] = "";
    int rc = cli_fit_specs_to_head_dim(prog, s->argv[s->optind], s->defaults, s->specs, &s->nspecs, s->in->head_dim,
                                       skipped, sizeof skipped);
    if (!rc && skipped[0])
        fprintf(stderr, "%s: note: default set without %s: head_dim %d is not a multiple of their blocks "
                "(llama.cpp refuses such a KV cache)\n", prog, skipped, s->in->head_dim);
    return rc;
}

/* The options' checks, the calibration dump, the specs (the default set
 * when none is given), the model and its tokens, the windows. */
static int open_inputs(eval_state *s)
{
    int rc;
    if ((rc = cli_model_check(prog, s->argc, s->optind, &s->mo,
                              "kvq-eval MODEL (--text FILE | --tokens FILE) -q SPEC...")))
        return rc;
    if (s->share.n && (!s->chunk || !s->output || !strcmp(s->output, "-"))) {
        cli_error(prog, "--shard %ld/%ld: needs --chunk N and -o OUT (its windows' rows are appended to OUT)",
                  s->share.i, s->share.n);
        return CLI_USAGE;
    }
    if (s->resume && !s->share.n) {
        cli_error(prog, "--resume continues a shard (--shard I/N; --shard 0/1 for a whole corpus run)");
        return CLI_USAGE;
    }
    if (s->share.n && s->format && strcmp(s->format, "csv")) {
        cli_error(prog, "--format %s: a shard is written as CSV (--merge writes any format)", s->format);
        return CLI_USAGE;
    }
    const char *inputs[] = {s->argv[s->optind], s->mo.text, s->mo.tokens, s->mo.tokenizer, s->calib};
    if ((rc = cli_check_output(prog, s->output, inputs, 5)) || (rc = open_specs(s))) return rc;
    if (s->chunks && !s->chunk) return cli_error(prog, "--chunks needs --chunk N"), CLI_USAGE;
    s->mo.no_context_cut = s->chunk > 0;
    s->mo.uses = s->chunk > 0 && s->chunks > 0 ? s->chunk * s->chunks : 0; /* --chunks K: the first K windows alone */
    if ((rc = cli_model_load(prog, s->argv, s->optind, &s->mo, &s->m, &s->ids, &s->T))) return rc;
    s->in = kvq_model_get_info(s->m);
    if ((rc = fit_specs(s))) return rc;
    long chunk = s->chunk, T = s->T;
    if (chunk > s->in->context_length) {
        cli_error(prog, "--chunk %ld: the model's context length is %d", chunk, s->in->context_length);
        return CLI_USAGE;
    }
    if (chunk && T < chunk) {
        cli_error(prog, "%s: %ld tokens: fewer than one window of --chunk %ld", s->mo.text ? s->mo.text : s->mo.tokens,
                  T, chunk);
        return CLI_RUNTIME;
    }
    if (s->context && s->context > (chunk ? chunk : T) - 2) {
        cli_error(prog, "--context %ld: expected at most %ld (a context and at least one scored position in %s of %ld "
                  "tokens)", s->context, (chunk ? chunk : T) - 2L, chunk ? "each window" : "the text", chunk ? chunk : T);
        return CLI_USAGE;
    }
    s->nwin = chunk ? (int)(T / chunk) : 1;
    if (s->chunks && s->nwin > s->chunks) s->nwin = (int)s->chunks;
    return CLI_OK;
}

/* The evaluation's items (spec × policy × layer) and each one's row
 * identity: a mix's --per-layer row names that layer's spec (and mix as
 * its quantizer); with --context the policy cell names the protocol too. */
static int make_items(eval_state *s)
{
    int nlay = s->per_layer ? s->in->n_layers : 1, npol = s->policies[0] + s->policies[1], k = 0;
    s->nitems = s->nspecs * npol * nlay;
    if (!(s->items = calloc((size_t)s->nitems + 1, sizeof *s->items)) ||
        !(s->rows = calloc((size_t)s->nitems + 1, sizeof *s->rows)) ||
        !(s->owns = calloc((size_t)s->nitems + 1, sizeof *s->owns)))
        return cli_error(prog, "out of memory"), CLI_RUNTIME;
    for (int i = 0; i < s->nspecs; i++)
        for (int p = 0; p < 2; p++)
            for (int l = 0; s->policies[p] && l < nlay; l++)
                s->items[k++] = (kvq_eval_item){.spec = s->specs[i].q ? &s->specs[i] : NULL,
                                                .layer = s->per_layer ? l : -1,
                                                .policy = p ? KVQ_POLICY_DECODE : KVQ_POLICY_PREFILL};
    snprintf(s->policy_name[0], sizeof s->policy_name[0], "prefill");
    snprintf(s->policy_name[1], sizeof s->policy_name[1], "decode");
    for (int p = 0; s->context && p < 2; p++)
        snprintf(s->policy_name[p], sizeof s->policy_name[p], "%s/context=%ld", p ? "decode" : "prefill", s->context);
    for (int i = 0; i < s->nitems; i++) {
        const kvq_eval_item *it = &s->items[i];
        const kvq_spec *sp = it->spec, *text = sp;
        if (sp && it->layer >= 0 && kvq_spec_is_mix(sp) && !kvq_spec_for_layer(sp, it->layer, &s->owns[i], NULL))
            text = &s->owns[i];
        s->rows[i] = (kvq_eval_row){.model = s->in->name, .quantizer = sp ? kvq_quantizer_name(sp->q) : "none",
                                    .spec = sp ? text->text : "none",
                                    .policy = s->policy_name[it->policy == KVQ_POLICY_DECODE]};
        if (it->layer < 0) snprintf(s->rows[i].layer, sizeof s->rows[i].layer, "all");
        else snprintf(s->rows[i].layer, sizeof s->rows[i].layer, "%d", it->layer);
    }
    return CLI_OK;
}

/* Provenance: the inputs and every option's effective value. */
static void record_options(const eval_state *s)
{
    cli_meta *meta = s->meta;
    cli_meta_operands(meta, s->argv + s->optind, s->argc - s->optind);
    cli_meta_model(meta, s->argv[s->optind], &s->mo, s->in, s->T);
    cli_meta_input(meta, "calib", s->calib);
    cli_optrows_record(meta, rows, NROWS, s, 0);
}

/* Where the rows go: a shard's share of the windows, appended to OUT
 * window by window (continued with --resume), or OUT written whole. */
static int open_out(eval_state *s)
{
    cli_meta *meta = s->meta;
    int rc;
    s->w0 = 0, s->w1 = s->nwin;
    if (!s->share.n) {
        int ncol;
        const char *const *cols = kvq_eval_columns(0, &ncol);
        if (cli_out_open(&s->out, s->output, prog) || cli_out_attach_meta(&s->out, meta, prog)) return CLI_RUNTIME;
        if (!(s->rep = kvq_rows_new(s->out.f, s->fmt, cols, ncol, 6)))
            return cli_error(prog, "out of memory"), CLI_RUNTIME;
        return CLI_OK;
    }
    s->w0 = (int)(s->nwin * s->share.i / s->share.n), s->w1 = (int)(s->nwin * (s->share.i + 1) / s->share.n);
    snprintf(s->shard_id, sizeof s->shard_id, "%ld/%ld", s->share.i, s->share.n);
    /* the run: model, text and the options that change rows (the rows name the configurations) */
    kvq_eval_opts fo = {.stride = (int)s->stride, .seed = s->seed, .chunk = (int)s->chunk, .chunks = (int)s->chunks,
                        .context = (int)s->context};
    snprintf(s->run, sizeof s->run, "%016" PRIx64,
             kvq_eval_fingerprint(s->m, s->ids, s->T, s->policies[1] ? KVQ_POLICY_DECODE : KVQ_POLICY_PREFILL, &fo,
                                  s->calib));
    cli_meta_str(meta, "result", "run", s->run);
    cli_meta_int(meta, "result", "windows", s->nwin);
    cli_meta_int(meta, "result", "window_begin", s->w0);
    cli_meta_int(meta, "result", "window_end", s->w1);
    kvq_eval_shard_id id = {.path = s->output, .run = s->run, .shard = s->shard_id, .rows = s->rows,
                            .nitems = s->nitems, .chunk = (int)s->chunk, .nwin = s->nwin};
    if ((rc = eval_shard_open(prog, &id, s->resume, s->w0, s->w1, &s->wdone, &s->shard))) return rc;
    if (s->wdone) { /* the runs that wrote those windows stay in the record */
        char *mp = cli_meta_path(s->output), *runs = NULL;
        if (!mp) return cli_error(prog, "out of memory"), CLI_RUNTIME;
        rc = cli_meta_read_runs(prog, mp, &runs);
        free(mp);
        if (!rc) cli_meta_prior_runs(meta, runs);
        free(runs);
        if (rc) return rc;
        fprintf(stderr, "%s: resuming: %d of this shard's %d windows already in %s\n", prog, s->wdone, s->w1 - s->w0,
                s->output);
    }
    cli_meta_int(meta, "result", "windows_resumed", s->wdone);
    static char note_head[1024], note_tail[256];
    snprintf(note_head, sizeof note_head, "%s: interrupted: %s keeps ", prog, s->output);
    snprintf(note_tail, sizeof note_tail, " of shard %ld/%ld's %d windows; the same command with --resume "
             "continues\n", s->share.i, s->share.n, s->w1 - s->w0);
    cli_interrupt_note(note_head, note_tail);
    cli_interrupt_count(s->wdone);
    return CLI_OK;
}

static void say_complete(const eval_state *s)
{
    fprintf(stderr, "%s: %s: shard %ld/%ld complete (windows %d..%d of %d)\n", prog, s->output, s->share.i, s->share.n,
            s->w0, s->w1 - 1, s->nwin);
}

/* A shard whose windows are all in OUT: closed, its record written with
 * OUT's checksum; said before (it was complete when the run began) or after. */
static int finish_shard(eval_state *s, int say_first)
{
    if (say_first) say_complete(s);
    int rc = eval_shard_close(s->shard);
    s->shard = NULL;
    if (!rc) rc = cli_meta_write_hashed(s->meta, prog, s->output);
    if (!rc && !say_first) say_complete(s);
    return rc;
}

/* Every item through the model (a shard: its windows still to run), then
 * the rows. */
static int evaluate(eval_state *s)
{
    kvq_error err = {0};
    if (s->progress_mode < 0) cli_progress_option(prog, "auto", &s->progress_mode);
    /* auto: on a terminal from the start (a pass is long), always, or never */
    progress_state ps = {s->progress_mode != CLI_PROGRESS_NEVER, time(NULL), NULL};
    kvq_eval_opts eo = {.stride = (int)s->stride, .seed = s->seed, .nthreads = (int)s->mo.threads, .calib = s->cal,
                        .progress = s->chunk ? NULL : progress, .ud = &ps, .chunk = (int)s->chunk,
                        .chunks = (int)s->chunks, .window_progress = window_progress, .context = (int)s->context};
    if (s->share.n) {
        if (s->w0 + s->wdone == s->w1) return finish_shard(s, 1); /* every window of the shard is in OUT */
        eo.window_begin = s->w0 + s->wdone, eo.window_end = s->w1;
        eo.window_done = eval_shard_window;
        eo.window_ud = s->shard;
    }
    const kvq_model_info *in = s->in;
    if (s->fmt == KVQ_FMT_TABLE)
        fprintf(stderr, "%s: %s: %s %s, %d layers, %d query / %d KV heads, head_dim %d; %d tokens%s\n", prog,
                s->argv[s->optind], in->format, in->name, in->n_layers, in->n_heads, in->n_kv_heads, in->head_dim,
                s->T, s->chunk ? " (in windows)" : "");
    double nll_ref = NAN;
    if (kvq_model_eval(s->m, s->ids, s->T, s->items, s->nitems, &eo, &nll_ref, &err)) {
        if (ps.on) fputc('\n', stderr);
        return cli_fail(prog, &err);
    }
    if (s->shard) return finish_shard(s, 0); /* every window's rows are in OUT */
    char toks[16], npos[16];
    snprintf(toks, sizeof toks, "%ld", s->chunk ? (long)s->nwin * s->chunk : (long)s->T);
    for (int i = 0; i < s->nitems; i++) {
        kvq_cell row[KVQ_EVAL_NCOLS];
        kvq_eval_cells(&s->rows[i], &s->items[i], nll_ref, toks, npos, row);
        errno = 0;
        kvq_status wst = kvq_rows_add(s->rep, row);
        if (wst) return cli_write_error(prog, s->output, wst, errno);
    }
    errno = 0;
    kvq_status st = kvq_report_finish(s->rep);
    s->rep = NULL;
    if (st) return cli_write_error(prog, s->output, st, errno);
    return cli_meta_commit(&s->out, prog) ? CLI_RUNTIME : CLI_OK;
}

/* ------------------------------------------------------------ --tasks */

/* --tasks: its options' checks, the task file, the specs, the model (with a
 * tokenizer), and every task tokenized and checked against its context
 * before any work. */
static int open_tasks(eval_state *s)
{
    kvq_error err = {0};
    int rc;
    if (s->mo.text || s->mo.tokens) {
        cli_error(prog, "--tasks: the prompts come from the task file (no --text or --tokens)");
        return CLI_USAGE;
    }
    if (s->chunk || s->chunks || s->context) {
        cli_error(prog, "--tasks: each task is its own window whose context is compressed (no --chunk, --chunks or "
                  "--context)");
        return CLI_USAGE;
    }
    if (s->resume) {
        cli_error(prog, "--tasks --shard writes its share whole: no --resume (rerun the shard)");
        return CLI_USAGE;
    }
    if (s->share.n && (!s->output || !strcmp(s->output, "-") || s->per_depth ||
                       (s->format && strcmp(s->format, "csv")))) {
        cli_error(prog, "--tasks --shard %ld/%ld: needs -o OUT, written as CSV, and no --per-depth (give it to "
                  "--merge)", s->share.i, s->share.n);
        return CLI_USAGE;
    }
    if (s->optind != s->argc - 1) {
        cli_error(prog, s->optind >= s->argc ? "no model given (kvq-eval MODEL --tasks FILE.jsonl)"
                                             : "unexpected argument %s (one MODEL)", s->argv[s->optind + 1]);
        return CLI_USAGE;
    }
    const char *inputs[] = {s->argv[s->optind], s->tasks_path, s->mo.tokenizer, s->calib};
    if ((rc = cli_check_output(prog, s->output, inputs, 4)) || (rc = open_specs(s))) return rc;
    char *buf = NULL;
    size_t len = 0;
    if ((rc = cli_read_file(prog, s->tasks_path, &buf, &len))) return rc;
    kvq_status st = kvq_tasks_parse(s->tasks_path, buf, len, &s->tasks, &s->ntasks, &err);
    free(buf);
    if (st) return cli_fail(prog, &err);
    if (kvq_model_open(s->argv[s->optind], s->mo.tokenizer, &s->m, &err)) return cli_fail(prog, &err);
    s->in = kvq_model_get_info(s->m);
    if (!s->in->has_tokenizer) {
        cli_error(prog, "%s: the model has no tokenizer: --tasks needs one to read the task texts",
                  s->argv[s->optind]);
        return CLI_RUNTIME;
    }
    if ((rc = fit_specs(s))) return rc;
    if (kvq_model_check_tasks(s->m, s->tasks, s->ntasks, &err)) {
        char tmp[sizeof err.msg];
        snprintf(tmp, sizeof tmp, "%s", err.msg);
        cli_error(prog, "%s: %s", s->tasks_path, tmp);
        return CLI_RUNTIME;
    }
    return CLI_OK;
}

/* Every task through the model with every item, then per item a row over
 * all tasks and, with --per-depth B, one per depth bucket [kB, (k+1)B)
 * (depth 1 in the last). */
static int evaluate_tasks(eval_state *s)
{
    kvq_error err = {0};
    int rc;
    cli_meta *meta = s->meta;
    record_options(s); /* T 0: the tasks' own tokens */
    cli_meta_input(meta, "tasks", s->tasks_path);
    cli_meta_int(meta, "result", "tasks", (long long)s->ntasks);
    if (s->progress_mode < 0) cli_progress_option(prog, "auto", &s->progress_mode);
    progress_state ps = {s->progress_mode == CLI_PROGRESS_ALWAYS ||
                         (s->progress_mode != CLI_PROGRESS_NEVER && isatty(2)), time(NULL), "task"};
    kvq_eval_opts eo = {.stride = (int)s->stride, .seed = s->seed, .nthreads = (int)s->mo.threads, .calib = s->cal,
                        .window_progress = window_progress, .ud = &ps};
    /* a shard: its contiguous share of the tasks */
    size_t t0 = 0, t1 = s->ntasks;
    if (s->share.n) {
        t0 = (size_t)(s->ntasks * (size_t)s->share.i / (size_t)s->share.n);
        t1 = (size_t)(s->ntasks * (size_t)(s->share.i + 1) / (size_t)s->share.n);
        cli_meta_int(meta, "result", "task_begin", (long long)t0);
        cli_meta_int(meta, "result", "task_end", (long long)t1);
    }
    kvq_task_result *res = calloc((t1 - t0 ? t1 - t0 : 1) * (size_t)(s->nitems + 1), sizeof *res);
    double *depth = malloc((s->ntasks ? s->ntasks : 1) * sizeof *depth);
    if (!res || !depth) {
        free(res), free(depth);
        return cli_error(prog, "out of memory"), CLI_RUNTIME;
    }
    for (size_t t = 0; t < s->ntasks; t++) depth[t] = s->tasks[t].depth;
    if (kvq_model_eval_tasks(s->m, s->tasks, t0, t1, s->items, s->nitems, &eo, res, &err)) {
        free(res), free(depth);
        if (ps.on) fputc('\n', stderr);
        return cli_fail(prog, &err);
    }
    if (cli_out_open(&s->out, s->output, prog) || cli_out_attach_meta(&s->out, meta, prog)) rc = CLI_RUNTIME;
    else if (s->share.n) {
        /* the run: the model, the task file and the options that change rows (the rows name the configurations) */
        uint64_t h = kvq_fingerprint_file(KVQ_FINGERPRINT_SEED, s->argv[s->optind]);
        h = kvq_fingerprint_file(h, s->tasks_path);
        h = kvq_fingerprint_file(h, s->calib);
        long long v[] = {s->stride, (long long)s->seed, s->policies[0], s->policies[1]};
        snprintf(s->run, sizeof s->run, "%016" PRIx64, kvq_fingerprint_bytes(h, v, sizeof v));
        cli_meta_str(meta, "result", "run", s->run);
        rc = eval_task_shard_rows(prog, &s->out, s->rows, s->nitems, res, depth, t0, t1, s->ntasks, s->run);
    }
    else
        rc = eval_task_rows(prog, &s->out, s->fmt, s->rows, s->nitems, res, depth, s->ntasks, s->per_depth);
    free(res), free(depth);
    if (rc) return rc;
    return cli_meta_commit(&s->out, prog) ? CLI_RUNTIME : CLI_OK;
}

static int run(int argc, char **argv, cli_meta *meta)
{
    eval_state s = {.progress_mode = -1, .stride = 1, .policies = {1, 0}, .meta = meta};
    int stop = 0, rc = parse_options(argc, argv, &s, &stop);
    if (rc || stop) goto done;
    if (s.merge) {
        rc = merge(&s);
        goto done;
    }
    if (s.per_depth && !s.tasks_path && !s.merge) {
        cli_error(prog, "--per-depth B needs --tasks FILE");
        rc = CLI_USAGE;
        goto done;
    }
    if (s.tasks_path) {
        if ((rc = open_tasks(&s)) || (rc = make_items(&s))) goto done;
        s.fmt = cli_pick_format(s.format, s.output);
        if (!(rc = cli_meta_check_format(prog, meta, s.fmt))) rc = evaluate_tasks(&s);
        goto done;
    }
    if ((rc = open_inputs(&s)) || (rc = make_items(&s))) goto done;
    s.fmt = cli_pick_format(s.format, s.output);
    if ((rc = cli_meta_check_format(prog, meta, s.fmt))) goto done;
    record_options(&s);
    if ((rc = open_out(&s))) goto done;
    rc = evaluate(&s);
done:
    kvq_report_discard(s.rep);
    if (s.out.f) cli_out_abort(&s.out);
    kvq_model_close(s.m);
    kvq_calib_close(s.cal);
    eval_shard_close(s.shard);
    free(s.specs), free(s.owns), free(s.rows), free(s.items), free(s.ids);
    kvq_tasks_free(s.tasks, s.ntasks);
    return rc;
}

int main(int argc, char **argv) { return cli_main(prog, argc, argv, CLI_MAIN_TUNE_MALLOC, run); }

/* kvq-analyze — run quantizers over kvq dumps and report reconstruction and
 * attention errors (docs/tools.md).  A thin layer over libkvq: parse options, open
 * dumps, call kvq_analyze_dump, write the report atomically. */
#include "cli.h"

#include <errno.h>
#include <getopt.h>
#include <libgen.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static const char *prog = "kvq-analyze";

enum { OPT_CALIB = 256, OPT_FORMAT, OPT_LIST, OPT_PROGRESS };

/* One run: its options as parsed, then what its steps share. */
typedef struct analyze_state {
    /* the options */
    cli_analysis an;
    const char *calib, *output, *format;
    int progress_mode, list; /* list: --list-quantizers */
    kvq_spec *specs; /* -q's, or the default set */
    int nspecs;
    char **dumps; /* the DUMP operands */
    int ndumps;
    cli_meta *meta;
    /* the run */
    kvq_calib *calib_dump;
    char skipped[256], skipped_shape[256]; /* default families left out: for want of --calib, of a head_dim */
    int shape_dim;                         /* the head_dim that left families out */
    kvq_format fmt;
    cli_out out;
    kvq_report *report;
    kvq_dump *dump;
} analyze_state;

/* -q: a spec. */
static int opt_quant(const char *p, const char *arg, void *at, void *base)
{
    analyze_state *s = base;
    (void)at;
    return cli_add_spec(p, &s->specs, &s->nspecs, arg);
}

/* kvq-analyze's options, one row each (cli_optrow); --layers, --heads,
 * --queries, --per, --threads, --seed and --device are the analysis group's
 * (cli.h), --meta and --no-hash the record's.  The recorded rows go into the
 * provenance as they took effect: the default set's specs, the format chosen. */
#define ROW(nm, k, kind, field, ...) \
    {.name = nm, .key = k, .arg = kind, .offset = offsetof(analyze_state, field), __VA_ARGS__}
#define AUX(field) .aux_offset = offsetof(analyze_state, field)
static const cli_optrow rows[] = {
    ROW("quant", 'q', CLI_ARG_CUSTOM, specs, .parse = opt_quant, .record = CLI_RECORD,
        .record_fn = cli_optrow_record_specs, AUX(nspecs), .metavar = "SPEC",
        .help = "quantizer spec NAME[:key=value,...]; repeatable (default: one configuration of every family)"),
    ROW("calib", OPT_CALIB, CLI_ARG_TEXT, calib, .record = CLI_RECORD | CLI_RECORD_NULL, .metavar = "FILE",
        .help = "calibration dump of the same model"),
    ROW("format", OPT_FORMAT, CLI_ARG_CUSTOM, format, .parse = cli_optrow_format, .record = CLI_RECORD,
        .record_fn = cli_optrow_record_format, AUX(fmt), .metavar = "FMT",
        .help = "table, csv or jsonl (default: table on a terminal, else csv; with -o, jsonl for *.jsonl names)"),
    ROW("output", 'o', CLI_ARG_TEXT, output, .metavar = "FILE",
        .help = "write results to FILE (atomically) instead of stdout, and the run's provenance to FILE.meta.json"),
    ROW("progress", OPT_PROGRESS, CLI_ARG_CUSTOM, progress_mode, .parse = cli_optrow_progress, .metavar = "WHEN",
        .help = "auto (default: a line on a terminal once a run takes over a second), always or never"),
    ROW("list-quantizers", OPT_LIST, CLI_ARG_FLAG, list, .help = "list quantizers, their keys and defaults"),
};
#undef ROW
#undef AUX
enum { NROWS = sizeof rows / sizeof rows[0] };

static void usage(FILE *f)
{
    fprintf(f, "usage: kvq-analyze [options] DUMP...\n"
               "Measure how quantizers distort the keys, values, attention scores and outputs\n"
               "stored in kvq-dump/1 HDF5 files.\n\n");
    cli_optrows_usage(f, rows, NROWS);
    cli_optrows_usage(f, cli_analysis_rows, cli_analysis_nrows);
    fprintf(f, "      --device DEV      cpu (default) or cuda: the uniform families (per-token,\n"
               "                        per-channel, kivi, kcvt, absmax) and every attention\n"
               "                        metric on the GPU; the other quantizers on the CPU\n");
    cli_optrows_usage(f, cli_meta_rows, cli_meta_nrows);
    fprintf(f, CLI_HELP_VERSION_HELP "\n"
               "Example: kvq-analyze -q kivi:bits=2,group=32,residual=128 --per model \\\n"
               "           data/stories260K.h5\n");
}

/* The options into s; *stop: --help, --version or --list-quantizers answered (rc as they end). */
static int parse_options(int argc, char **argv, analyze_state *s, int *stop)
{
    const cli_getopt_ctx go = {.prog = prog, .usage = usage, .analysis = &s->an, .meta = s->meta};
    int rc = cli_optrows_getopt(&go, rows, NROWS, ":q:o:hV", argc, argv, s, stop);
    if (rc || *stop) return rc;
    if (s->list) return kvq_registry_describe(stdout), *stop = 1, CLI_OK;
    if (optind >= argc)
        return cli_error(prog, "no dump given (usage: kvq-analyze [options] DUMP...; see --help)"), CLI_USAGE;
    s->dumps = argv + optind, s->ndumps = argc - optind;
    return CLI_OK;
}

/* The device, the calibration dump and the specs: the default set
 * (families left out for want of --calib are said at the end of a
 * successful run) and llama.cpp's block rule (ggml, fp4): the default set
 * leaves out what a dump's head_dim cannot take; a spec given explicitly
 * is a usage error. */
static int choose_specs(analyze_state *s)
{
    kvq_error err = {0};
    int rc;
    if ((rc = cli_analysis_device(prog, &s->an))) return rc;
    if (s->calib && kvq_calib_open(s->calib, &s->calib_dump, &err)) return cli_fail(prog, &err);
    int defaults = s->nspecs == 0;
    if (defaults && (rc = cli_add_default_specs(prog, s->calib_dump != NULL, &s->specs, &s->nspecs, s->skipped,
                                                sizeof s->skipped)))
        return rc;
    for (int i = 0; i < s->ndumps; i++) {
        if (kvq_dump_open(s->dumps[i], &s->dump, &err)) return cli_fail(prog, &err);
        int head_dim = kvq_dump_get_info(s->dump)->head_dim;
        kvq_dump_close(s->dump);
        s->dump = NULL;
        if ((rc = cli_fit_specs_to_head_dim(prog, s->dumps[i], defaults, s->specs, &s->nspecs, head_dim,
                                            s->skipped_shape, sizeof s->skipped_shape)))
            return rc;
        if (s->skipped_shape[0] && !s->shape_dim) s->shape_dim = head_dim;
    }
    for (int i = 0; i < s->nspecs; i++)
        if ((rc = cli_check_calib(prog, &s->specs[i], s->calib_dump != NULL))) return rc;
    return CLI_OK;
}

/* Provenance: the inputs and every option's effective value. */
static void record_options(const analyze_state *s)
{
    cli_meta *meta = s->meta;
    cli_meta_operands(meta, s->dumps, s->ndumps);
    for (int i = 0; i < s->ndumps; i++) cli_meta_input(meta, "dump", s->dumps[i]);
    cli_meta_input(meta, "calib", s->calib);
    cli_optrows_record(meta, rows, NROWS, s, 0);
    cli_meta_analysis(meta, &s->an);
}

/* OUT (never one of the inputs), written under a temporary name, and its report. */
static int open_out(analyze_state *s)
{
    const char *in[] = {s->calib};
    int rc;
    if ((rc = cli_check_output(prog, s->output, in, 1)) ||
        (rc = cli_check_output(prog, s->output, (const char *const *)s->dumps, s->ndumps)))
        return rc;
    if (cli_out_open(&s->out, s->output, prog) || cli_out_attach_meta(&s->out, s->meta, prog)) return CLI_RUNTIME;
    if (!(s->report = kvq_report_new(s->out.f, s->fmt, NULL, 0))) return cli_error(prog, "out of memory"), CLI_RUNTIME;
    return CLI_OK;
}

/* Each dump analysed and its rows reported, then OUT committed. */
static int analyze_dumps(analyze_state *s)
{
    kvq_error err = {0};
    cli_progress progress = {0};
    const cli_analysis *an = &s->an;
    kvq_analysis_opts opts = {
        .specs = s->specs, .nspecs = s->nspecs, .layers = an->layers, .nlayers = an->nlayers,
        .heads = an->heads, .nheads = an->nheads, .queries = an->queries, .seed = an->seed, .nthreads = (int)an->threads,
        .calib = s->calib_dump, .device = an->device, .progress = cli_progress_stage, .ud = &progress};
    if (s->progress_mode < 0) cli_progress_option(prog, "auto", &s->progress_mode);
    if (an->device && s->fmt == KVQ_FMT_TABLE) fprintf(stderr, "%s: device: %s\n", prog, kvq_device_name(an->device));
    for (int i = 0; i < s->ndumps; i++) {
        kvq_analysis a;
        if (kvq_dump_open(s->dumps[i], &s->dump, &err)) return cli_fail(prog, &err);
        cli_meta_share_reading(s->meta, s->dump);
        const kvq_dump_info *info = kvq_dump_get_info(s->dump);
        if (s->fmt == KVQ_FMT_TABLE)
            fprintf(stderr, "%s: %s: model %s, %d layers, %d KV heads (%d query heads), head_dim %d, %d tokens%s\n",
                    prog, s->dumps[i], info->model, info->num_layers, info->num_kv_heads, info->num_heads,
                    info->head_dim, info->seq_len, info->has_query ? "" : "; no queries: attention columns empty");
        cli_progress_start(&progress, prog, s->progress_mode, s->dumps[i]);
        kvq_status ast = kvq_analyze_dump(s->dump, &opts, &a, &err);
        cli_progress_end(&progress);
        if (ast) return cli_fail(prog, &err);
        char *pathcopy = strdup(s->dumps[i]);
        errno = 0;
        kvq_status st =
            pathcopy ? kvq_report_analysis(s->report, basename(pathcopy), &a, s->specs, an->per, NULL) : KVQ_ERR_NOMEM;
        int werr = errno;
        free(pathcopy);
        kvq_analysis_free(&a);
        kvq_dump_close(s->dump);
        s->dump = NULL;
        if (st) return cli_write_error(prog, s->output, st, werr);
    }
    errno = 0;
    kvq_status st = kvq_report_finish(s->report);
    s->report = NULL;
    if (st) return cli_write_error(prog, s->output, st, errno);
    return cli_meta_commit(&s->out, prog) ? CLI_RUNTIME : CLI_OK;
}

static int run(int argc, char **argv, cli_meta *meta)
{
    analyze_state s = {.progress_mode = -1, .meta = meta};
    cli_analysis_init(&s.an);
    int stop = 0, rc = parse_options(argc, argv, &s, &stop);
    if (rc || stop || (rc = choose_specs(&s))) goto done;
    s.fmt = cli_pick_format(s.format, s.output);
    if ((rc = cli_meta_check_format(prog, meta, s.fmt))) goto done;
    record_options(&s);
    if ((rc = open_out(&s)) || (rc = analyze_dumps(&s))) goto done;
    if (s.skipped[0])
        fprintf(stderr, "%s: note: default set without %s: needs --calib FILE (a calibration dump of the same model)\n",
                prog, s.skipped);
    if (s.skipped_shape[0])
        fprintf(stderr, "%s: note: default set without %s: head_dim %d is not a multiple of their blocks "
                "(llama.cpp refuses such a KV cache)\n", prog, s.skipped_shape, s.shape_dim);
done:
    kvq_report_discard(s.report); /* after an error: print no partial table */
    if (s.out.f) cli_out_abort(&s.out);
    kvq_dump_close(s.dump);
    kvq_calib_close(s.calib_dump);
    free(s.specs);
    cli_analysis_free(&s.an);
    return rc;
}

int main(int argc, char **argv) { return cli_main(prog, argc, argv, CLI_MAIN_TUNE_MALLOC, run); }

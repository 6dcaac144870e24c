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

static void usage(FILE *f)
{
    fprintf(f,
        "usage: kvq-analyze [options] DUMP...\n"
        "Measure how quantizers distort the keys, values, attention scores and outputs\n"
        "stored in kvq-dump/1 HDF5 files.\n\n"
        "  -q, --quant SPEC      quantizer spec NAME[:key=value,...]; repeatable\n"
        "                        (default: one configuration of every family)\n"
        "      --calib FILE      calibration dump of the same model\n"
        "      --layers LIST     layers to analyse, e.g. 0-3,7 (default: all)\n"
        "      --heads LIST      KV heads to analyse (default: all)\n"
        "      --queries SEL     query rows: last:N (default last:64), all, every:N,\n"
        "                        random:N\n"
        "      --per WHAT        pool results per head, layer (default) or model\n"
        "      --format FMT      table, csv or jsonl (default: table on a terminal,\n"
        "                        else csv; with -o, jsonl for *.jsonl names)\n"
        "  -o, --output FILE     write results to FILE (atomically) instead of stdout,\n"
        "                        and the run's provenance to FILE.meta.json\n"
        CLI_META_HELP
        "      --threads N       worker threads (default: all cores)\n"
        "      --seed N          seed of the random streams (default 0)\n"
        "      --device DEV      cpu (default) or cuda: the uniform families (per-token,\n"
        "                        per-channel, kivi, kcvt, absmax) and every attention\n"
        "                        metric on the GPU; the other quantizers on the CPU\n"
        "      --progress WHEN   auto (default: a line on a terminal once a run takes\n"
        "                        over a second), always or never\n"
        "      --list-quantizers list quantizers, their keys and defaults\n"
        "  -h, --help            this help\n"
        "  -V, --version         print the version\n\n"
        "Example: kvq-analyze -q kivi:bits=2,group=32,residual=128 --per model \\\n"
        "           data/stories260K.h5\n");
}

enum { OPT_CALIB = 256, OPT_FORMAT, OPT_LIST, OPT_PROGRESS };

/* One run: its options as parsed, then what its steps share. */
typedef struct analyze_state {
    /* the options */
    cli_analysis an;
    const char *calib, *output, *format;
    int progress_mode;
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

/* The options into s; *stop: --help, --version or --list-quantizers answered (rc as they end). */
static int parse_options(int argc, char **argv, analyze_state *s, int *stop)
{
    static const struct option longopts[] = {
        {"quant", required_argument, 0, 'q'}, {"calib", required_argument, 0, OPT_CALIB},
        CLI_ANALYSIS_LONGOPTS,
        {"format", required_argument, 0, OPT_FORMAT}, {"output", required_argument, 0, 'o'},
        {"list-quantizers", no_argument, 0, OPT_LIST}, {"progress", required_argument, 0, OPT_PROGRESS},
        CLI_META_LONGOPTS,
        {"help", no_argument, 0, 'h'}, {"version", no_argument, 0, 'V'}, {0, 0, 0, 0}};
    int rc = CLI_OK, c;
    const cli_getopt_ctx go = {.prog = prog, .usage = usage, .analysis = &s->an, .model = NULL, .meta = s->meta};
    while ((c = cli_getopt(&go, argc, argv, ":q:o:hV", longopts, &rc)) != -1) {
        if (c == CLI_GETOPT_STOP) return *stop = 1, rc;
        switch (c) {
        case 'q':
            if ((rc = cli_add_spec(prog, &s->specs, &s->nspecs, optarg))) return rc;
            break;
        case OPT_CALIB: s->calib = optarg; break;
        case OPT_FORMAT:
            if ((rc = cli_format_option(prog, optarg, &s->format))) return rc;
            break;
        case 'o': s->output = optarg; break;
        case OPT_PROGRESS:
            if ((rc = cli_progress_option(prog, optarg, &s->progress_mode))) return rc;
            break;
        case OPT_LIST: kvq_registry_describe(stdout); return *stop = 1, CLI_OK;
        }
    }
    if (optind >= argc) {
        cli_error(prog, "no dump given (usage: kvq-analyze [options] DUMP...; see --help)");
        return CLI_USAGE;
    }
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
    for (int i = 0; i < s->nspecs; i++) cli_meta_list(meta, "options", "quant", s->specs[i].text);
    cli_meta_str(meta, "options", "calib", s->calib);
    cli_meta_analysis(meta, &s->an);
    cli_meta_str(meta, "options", "format", cli_format_name(s->fmt));
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

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
        "      --queries SEL     query rows: last:N (default last:64), all, every:N, random:N\n"
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
        "Example: kvq-analyze -q kivi:bits=2,group=32,residual=128 --per model data/stories260K.h5\n");
}

enum { OPT_CALIB = 256, OPT_FORMAT, OPT_LIST, OPT_PROGRESS };

static int run(int argc, char **argv, cli_meta *meta)
{
    static const struct option longopts[] = {
        {"quant", required_argument, 0, 'q'}, {"calib", required_argument, 0, OPT_CALIB},
        CLI_ANALYSIS_LONGOPTS,
        {"format", required_argument, 0, OPT_FORMAT}, {"output", required_argument, 0, 'o'},
        {"list-quantizers", no_argument, 0, OPT_LIST}, {"progress", required_argument, 0, OPT_PROGRESS},
        CLI_META_LONGOPTS,
        {"help", no_argument, 0, 'h'}, {"version", no_argument, 0, 'V'}, {0, 0, 0, 0}};

    int rc = CLI_OK;
    kvq_error err = {0};
    kvq_spec *specs = NULL;
    int nspecs = 0;
    cli_analysis an;
    const char *calib = NULL, *output = NULL, *format = NULL;
    char skipped[256] = "", skipped_shape[256] = "";
    int shape_dim = 0; /* the head_dim that left families out */
    kvq_dump *dump = NULL;
    kvq_calib *calib_dump = NULL;
    kvq_report *report = NULL;
    cli_out out = {0};
    cli_progress progress = {0};
    int c, progress_mode = -1;

    cli_analysis_init(&an);
    const cli_getopt_ctx go = {.prog = prog, .usage = usage, .analysis = &an, .model = NULL, .meta = meta};
    while ((c = cli_getopt(&go, argc, argv, ":q:o:hV", longopts, &rc)) != -1) {
        if (c == CLI_GETOPT_STOP) goto done;
        switch (c) {
        case 'q':
            if ((rc = cli_add_spec(prog, &specs, &nspecs, optarg))) goto done;
            break;
        case OPT_CALIB: calib = optarg; break;
        case OPT_FORMAT:
            if ((rc = cli_format_option(prog, optarg, &format))) goto done;
            break;
        case 'o': output = optarg; break;
        case OPT_PROGRESS:
            if ((rc = cli_progress_option(prog, optarg, &progress_mode))) goto done;
            break;
        case OPT_LIST: kvq_registry_describe(stdout); goto done;
        }
    }
    if (optind >= argc) {
        cli_error(prog, "no dump given (usage: kvq-analyze [options] DUMP...; see --help)");
        rc = CLI_USAGE;
        goto done;
    }

    if ((rc = cli_analysis_device(prog, &an))) goto done;
    if (calib) {
        if (kvq_calib_open(calib, &calib_dump, &err)) { rc = cli_fail(prog, &err); goto done; }
    }
    /* the default set; families left out for want of --calib are said at the end of a successful run */
    int defaults = nspecs == 0;
    if (defaults && (rc = cli_add_default_specs(prog, calib_dump != NULL, &specs, &nspecs, skipped, sizeof skipped)))
        goto done;
    /* llama.cpp's block rule (ggml, fp4): the default set leaves out what a
     * dump's head_dim cannot take; a spec given explicitly is a usage error */
    for (int i = optind; i < argc; i++) {
        if (kvq_dump_open(argv[i], &dump, &err)) { rc = cli_fail(prog, &err); goto done; }
        int head_dim = kvq_dump_get_info(dump)->head_dim;
        kvq_dump_close(dump);
        dump = NULL;
        if ((rc = cli_fit_specs_to_head_dim(prog, argv[i], defaults, specs, &nspecs, head_dim, skipped_shape,
                                            sizeof skipped_shape)))
            goto done;
        if (skipped_shape[0] && !shape_dim) shape_dim = head_dim;
    }
    for (int s = 0; s < nspecs; s++)
        if ((rc = cli_check_calib(prog, &specs[s], calib_dump != NULL))) goto done;

    kvq_format fmt = cli_pick_format(format, output);
    if ((rc = cli_meta_check_format(prog, meta, fmt))) goto done;
    /* provenance: the inputs and every option's effective value */
    cli_meta_operands(meta, argv + optind, argc - optind);
    for (int i = optind; i < argc; i++) cli_meta_input(meta, "dump", argv[i]);
    cli_meta_input(meta, "calib", calib);
    for (int s = 0; s < nspecs; s++) cli_meta_list(meta, "options", "quant", specs[s].text);
    cli_meta_str(meta, "options", "calib", calib);
    cli_meta_analysis(meta, &an);
    cli_meta_str(meta, "options", "format", cli_format_name(fmt));

    {
        const char *in[] = {calib};
        if ((rc = cli_check_output(prog, output, in, 1)) ||
            (rc = cli_check_output(prog, output, (const char *const *)argv + optind, argc - optind)))
            goto done;
    }
    if (cli_out_open(&out, output, prog) || cli_out_attach_meta(&out, meta, prog)) { rc = CLI_RUNTIME; goto done; }
    if (!(report = kvq_report_new(out.f, fmt, NULL, 0))) {
        cli_error(prog, "out of memory");
        rc = CLI_RUNTIME;
        goto done;
    }

    kvq_analysis_opts opts = {
        .specs = specs, .nspecs = nspecs, .layers = an.layers, .nlayers = an.nlayers,
        .heads = an.heads, .nheads = an.nheads, .queries = an.queries, .seed = an.seed, .nthreads = (int)an.threads,
        .calib = calib_dump, .device = an.device, .progress = cli_progress_stage, .ud = &progress};
    if (progress_mode < 0) cli_progress_option(prog, "auto", &progress_mode);
    if (an.device && fmt == KVQ_FMT_TABLE) fprintf(stderr, "%s: device: %s\n", prog, kvq_device_name(an.device));
    for (int i = optind; i < argc; i++) {
        kvq_analysis a;
        if (kvq_dump_open(argv[i], &dump, &err)) { rc = cli_fail(prog, &err); goto done; }
        const kvq_dump_info *info = kvq_dump_get_info(dump);
        if (fmt == KVQ_FMT_TABLE)
            fprintf(stderr, "%s: %s: model %s, %d layers, %d KV heads (%d query heads), head_dim %d, %d tokens%s\n",
                    prog, argv[i], info->model, info->num_layers, info->num_kv_heads, info->num_heads,
                    info->head_dim, info->seq_len, info->has_query ? "" : "; no queries: attention columns empty");
        cli_progress_start(&progress, prog, progress_mode, argv[i]);
        kvq_status ast = kvq_analyze_dump(dump, &opts, &a, &err);
        cli_progress_end(&progress);
        if (ast) { rc = cli_fail(prog, &err); goto done; }
        char *pathcopy = strdup(argv[i]);
        errno = 0;
        kvq_status st =
            pathcopy ? kvq_report_analysis(report, basename(pathcopy), &a, specs, an.per, NULL) : KVQ_ERR_NOMEM;
        int werr = errno;
        free(pathcopy);
        kvq_analysis_free(&a);
        kvq_dump_close(dump);
        dump = NULL;
        if (st) { rc = cli_write_error(prog, output, st, werr); goto done; }
    }
    errno = 0;
    kvq_status st = kvq_report_finish(report);
    report = NULL;
    if (st) { rc = cli_write_error(prog, output, st, errno); goto done; }
    if (cli_out_commit(&out, prog)) rc = CLI_RUNTIME;
    if (!rc && skipped[0])
        fprintf(stderr, "%s: note: default set without %s: needs --calib FILE (a calibration dump of the same model)\n",
                prog, skipped);
    if (!rc && skipped_shape[0])
        fprintf(stderr, "%s: note: default set without %s: head_dim %d is not a multiple of their blocks "
                "(llama.cpp refuses such a KV cache)\n", prog, skipped_shape, shape_dim);

done:
    kvq_report_discard(report); /* after an error: print no partial table */
    if (out.f) cli_out_abort(&out);
    kvq_dump_close(dump);
    kvq_calib_close(calib_dump);
    free(specs);
    cli_analysis_free(&an);
    return rc;
}

int main(int argc, char **argv) { return cli_main(prog, argc, argv, CLI_MAIN_TUNE_MALLOC, run); }

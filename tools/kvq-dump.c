/* kvq-dump — run a model (GGUF or llama2.c) over a text and write its
 * keys, values and queries as kvq-dump/1 (docs/models.md). */
#include "cli.h"

#include <getopt.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

static const char *prog = "kvq-dump";

/* Everything kvq-dump's options set (the rows below land here). */
typedef struct dump_args {
    int *layers, nlayers; /* NULL: all */
    const char *output;
    cli_model mo;
} dump_args;

static int opt_layers(const char *p, const char *arg, void *at, void *base)
{
    dump_args *a = base;
    (void)at;
    return cli_index_list_option(p, arg, 4095, "layers", "0-3,7 of distinct layers", &a->layers, &a->nlayers);
}

enum { OPT_LAYERS = 256 };
/* kvq-dump's own options (cli_optrow); the model's input and --threads, and
 * the record's, are cli.h's groups; the run records what took effect. */
static const cli_optrow rows[] = {
    {.name = "layers", .key = OPT_LAYERS, .arg = CLI_ARG_CUSTOM, .offset = offsetof(dump_args, layers),
     .parse = opt_layers, .record = CLI_RECORD, .record_fn = cli_optrow_record_ints,
     .aux_offset = offsetof(dump_args, nlayers), .metavar = "LIST",
     .help = "layers to write, e.g. 0-3,7 (default: all)"},
    {.name = "output", .key = 'o', .arg = CLI_ARG_TEXT, .offset = offsetof(dump_args, output), .metavar = "FILE",
     .help = "the dump to write (atomically), and its provenance to FILE.meta.json"},
};
enum { NROWS = sizeof rows / sizeof rows[0] };

static void usage(FILE *f)
{
    fprintf(f, "usage: kvq-dump MODEL (--text FILE | --tokens FILE) [options] -o OUT.h5\n"
               "Run a model (GGUF v2/v3: llama, qwen2, qwen3, gemma3, phi3; or a llama2.c\n"
               "checkpoint) over a text and write every layer's key, value, query and\n"
               "pre-RoPE key, the token ids and the mean next-token loss as a kvq-dump/1\n"
               "HDF5 file.\n\n");
    cli_optrows_usage(f, cli_model_rows, cli_model_nrows);
    cli_optrows_usage(f, rows, NROWS);
    fprintf(f, "      --no-hash         record the inputs' size and mtime, not their SHA-256\n" CLI_HELP_VERSION_HELP
               "\nExample: kvq-dump stories260K.gguf --text story.txt -o story.h5\n");
}

/* The options into a, checked: MODEL, OUT (not an input), no inline record. */
static int parse_options(int argc, char **argv, dump_args *a, cli_meta *meta, int *stop)
{
    const cli_getopt_ctx go = {.prog = prog, .usage = usage, .model = &a->mo, .meta = meta};
    int rc = cli_optrows_getopt(&go, rows, NROWS, ":o:hV", argc, argv, a, stop);
    if (rc || *stop) return rc;
    if ((rc = cli_model_check(prog, argc, optind, &a->mo, "kvq-dump MODEL (--text FILE | --tokens FILE) -o OUT.h5")))
        return rc;
    if (!a->output) return cli_error(prog, "no output given (-o OUT.h5)"), CLI_USAGE;
    const char *in[] = {argv[optind], a->mo.text, a->mo.tokens, a->mo.tokenizer};
    if ((rc = cli_check_output(prog, a->output, in, 4))) return rc;
    if (cli_meta_inline(meta))
        return cli_error(prog, "--meta inline: a dump is HDF5; its record is OUT.meta.json"), CLI_USAGE;
    return CLI_OK;
}

static int run(int argc, char **argv, cli_meta *meta)
{
    dump_args a = {0};
    int *ids = NULL, T = 0, stop;
    kvq_model *m = NULL;
    kvq_error err = {0};
    int rc = parse_options(argc, argv, &a, meta, &stop);
    if (rc || stop || (rc = cli_model_load(prog, argv, optind, &a.mo, &m, &ids, &T))) goto done;
    const kvq_model_info *in = kvq_model_get_info(m);
    cli_meta_operands(meta, argv + optind, argc - optind);
    cli_meta_model(meta, argv[optind], &a.mo, in, T);
    cli_optrows_record(meta, rows, NROWS, &a, 0);
    double nll;
    if ((rc = cli_meta_drop(prog, a.output))) goto done;
    if (kvq_model_dump(m, ids, T, a.layers, a.nlayers, a.output, (int)a.mo.threads, &nll, &err)) {
        rc = cli_fail(prog, &err);
        goto done;
    }
    fprintf(stderr, "%s: %s: %s %s, %d layers, %d tokens, mean NLL %.4f nats (perplexity %.3f)\n", prog, a.output,
            in->format, in->name, a.layers ? a.nlayers : in->n_layers, T, nll, exp(nll));
    cli_meta_double(meta, "result", "mean_nll", nll);
    rc = cli_meta_write_hashed(meta, prog, a.output);
done:
    kvq_model_close(m);
    free(a.layers), free(ids);
    return rc;
}

int main(int argc, char **argv) { return cli_main(prog, argc, argv, CLI_MAIN_TUNE_MALLOC | CLI_MAIN_TEMP_HOOKS, run); }

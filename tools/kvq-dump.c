/* kvq-dump — run a model (GGUF or llama2.c) over a text and write its
 * keys, values and queries as kvq-dump/1 (docs/models.md). */
#include "cli.h"

#include <getopt.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

static const char *prog = "kvq-dump";

static void usage(FILE *f)
{
    fprintf(f,
        "usage: kvq-dump MODEL (--text FILE | --tokens FILE) [options] -o OUT.h5\n"
        "Run a model (GGUF v2/v3: llama, qwen2, qwen3, gemma3, phi3; or a llama2.c\n"
        "checkpoint) over a text and write every layer's key, value, query and\n"
        "pre-RoPE key, the token ids and the mean next-token loss as a kvq-dump/1\n"
        "HDF5 file.\n\n"
        "      --text FILE       text, tokenized as llama.cpp does (BOS if the model adds\n"
        "                        one)\n"
        "      --tokens FILE     whitespace-separated token ids instead (any model)\n"
        "      --tokenizer FILE  llama2.c tokenizer.bin (llama2.c checkpoints only)\n"
        "      --max-tokens N    keep the first N tokens (BOS included)\n"
        "      --layers LIST     layers to write, e.g. 0-3,7 (default: all)\n"
        "  -o, --output FILE     the dump to write (atomically), and its provenance to\n"
        "                        FILE.meta.json\n"
        "      --no-hash         record the inputs' size and mtime, not their SHA-256\n"
        "      --threads N       worker threads (default: all cores)\n"
        "  -h, --help            this help\n"
        "  -V, --version         print the version\n\n"
        "Example: kvq-dump stories260K.gguf --text story.txt -o story.h5\n");
}

enum { OPT_LAYERS = 256 };

static int run(int argc, char **argv, cli_meta *meta)
{
    static const struct option longopts[] = {
        CLI_MODEL_LONGOPTS, {"layers", required_argument, 0, OPT_LAYERS},
        {"output", required_argument, 0, 'o'}, {"help", no_argument, 0, 'h'}, {"version", no_argument, 0, 'V'},
        CLI_META_LONGOPTS, {0, 0, 0, 0}};
    const char *output = NULL;
    cli_model mo = {0};
    int *layers = NULL, nlayers = 0, *ids = NULL, T = 0, rc = CLI_OK, c;
    kvq_model *m = NULL;
    kvq_error err = {0};
    const cli_getopt_ctx go = {.prog = prog, .usage = usage, .analysis = NULL, .model = &mo, .meta = meta};
    while ((c = cli_getopt(&go, argc, argv, ":o:hV", longopts, &rc)) != -1) {
        if (c == CLI_GETOPT_STOP) goto done;
        switch (c) {
        case OPT_LAYERS:
            free(layers), layers = NULL;
            if (cli_parse_list(optarg, 4095, &layers, &nlayers)) {
                cli_error(prog, "--layers %s: expected a list like 0-3,7 of distinct layers", optarg);
                rc = CLI_USAGE; goto done;
            }
            break;
        case 'o': output = optarg; break;
        }
    }
    if ((rc = cli_model_check(prog, argc, optind, &mo, "kvq-dump MODEL (--text FILE | --tokens FILE) -o OUT.h5")))
        goto done;
    if (!output) {
        cli_error(prog, "no output given (-o OUT.h5)");
        rc = CLI_USAGE; goto done;
    }
    {
        const char *in[] = {argv[optind], mo.text, mo.tokens, mo.tokenizer};
        if ((rc = cli_check_output(prog, output, in, 4))) goto done;
    }
    if (cli_meta_inline(meta)) {
        cli_error(prog, "--meta inline: a dump is HDF5; its record is OUT.meta.json");
        rc = CLI_USAGE; goto done;
    }
    if ((rc = cli_model_load(prog, argv, optind, &mo, &m, &ids, &T))) goto done;
    const kvq_model_info *in = kvq_model_get_info(m);
    cli_meta_operands(meta, argv + optind, argc - optind);
    cli_meta_model(meta, argv[optind], &mo, in, T);
    cli_meta_ints(meta, "options", "layers", layers, nlayers);
    double nll;
    if ((rc = cli_meta_drop(prog, output))) goto done;
    if (kvq_model_dump(m, ids, T, layers, nlayers, output, (int)mo.threads, &nll, &err)) {
        rc = cli_fail(prog, &err);
        goto done;
    }
    fprintf(stderr, "%s: %s: %s %s, %d layers, %d tokens, mean NLL %.4f nats (perplexity %.3f)\n", prog, output,
            in->format, in->name, layers ? nlayers : in->n_layers, T, nll, exp(nll));
    cli_meta_double(meta, "result", "mean_nll", nll);
    rc = cli_meta_write_hashed(meta, prog, output);
done:
    kvq_model_close(m);
    free(layers), free(ids);
    return rc;
}

int main(int argc, char **argv) { return cli_main(prog, argc, argv, CLI_MAIN_TUNE_MALLOC | CLI_MAIN_TEMP_HOOKS, run); }

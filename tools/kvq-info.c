/* kvq-info — describe kvq dumps (docs/tools.md): shapes, dtypes, RoPE settings and
 * per-layer statistics (per-channel abs-max max/median ratio, kurtosis);
 * --channels writes per-channel magnitudes as CSV; --values L:H writes one
 * KV head's keys and values token by token (for magnitude maps). */
#include "cli.h"

#include <errno.h>
#include <getopt.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

static const char *prog = "kvq-info";

static const char *dtype_name(kvq_dtype t) { return t == KVQ_F16 ? "float16" : t == KVQ_F64 ? "float64" : "float32"; }

/* One tensor's statistics row; st has H*D entries. */
static void tensor_summary(FILE *f, const float *x, int H, int T, int D, kvq_channel_stats *st)
{
    kvq_channel_stats_compute(x, H, T, D, st);
    size_t n = (size_t)H * D;
    double ms = 0;
    for (size_t i = 0; i < n; i++) ms += st[i].rms * st[i].rms;
    fprintf(f, "  %13.3f %10.3f %10.4g", kvq_channel_absmax_ratio(st, n), kvq_kurtosis(x, (size_t)H * T * D),
            sqrt(ms / (double)n));
}

static void channels_csv(FILE *f, const char *dump, int layer, const char *tensor, const float *x,
                         int H, int T, int D, kvq_channel_stats *st)
{
    kvq_channel_stats_compute(x, H, T, D, st);
    for (int h = 0; h < H; h++)
        for (int c = 0; c < D; c++) {
            const kvq_channel_stats *s = &st[(size_t)h * D + c];
            fprintf(f, "%s,%d,%d,%s,%d,%.9g,%.9g,%.9g\n", dump, layer, h, tensor, c, s->abs_max, s->abs_mean, s->rms);
        }
}

/* One KV head's tensor, a row per token. */
static void values_csv(FILE *f, const char *dump, int layer, int head, const char *tensor, const float *x,
                       int T, int D)
{
    const float *xh = x + (size_t)head * T * D;
    for (int t = 0; t < T; t++) {
        fprintf(f, "%s,%d,%d,%s,%d", dump, layer, head, tensor, t);
        for (int c = 0; c < D; c++) fprintf(f, ",%.9g", xh[(size_t)t * D + c]);
        fputc('\n', f);
    }
}

/* --values: one layer and KV head of one dump; *D is the header's head_dim
 * (0 until the first dump sets it). */
static int dump_values(FILE *f, const char *path, long layer, long head, int *D)
{
    kvq_error err = {0};
    kvq_dump *d = NULL;
    kvq_layer L = {0};
    int rc = CLI_OK;
    if (kvq_dump_open(path, &d, &err)) return cli_fail(prog, &err);
    const kvq_dump_info *in = kvq_dump_get_info(d);
    const char *base = strrchr(path, '/') ? strrchr(path, '/') + 1 : path;
    if (layer >= in->num_layers || head >= in->num_kv_heads) {
        cli_error(prog, "%s: --values %ld:%ld: expected layer 0..%d and KV head 0..%d", path, layer, head,
                  in->num_layers - 1, in->num_kv_heads - 1);
        rc = CLI_USAGE;
        goto done;
    }
    if (*D && in->head_dim != *D) {
        cli_error(prog, "%s: /head_dim: expected %d like the first dump (one CSV holds one head_dim), got %d", path, *D,
                  in->head_dim);
        rc = CLI_RUNTIME;
        goto done;
    }
    if (!*D) {
        *D = in->head_dim;
        fprintf(f, "dump,layer,head,tensor,token");
        for (int c = 0; c < *D; c++) fprintf(f, ",c%d", c);
        fputc('\n', f);
    }
    if (kvq_dump_read_layer(d, (int)layer, KVQ_READ_KEY_PRE_ROPE, &L, &err)) { rc = cli_fail(prog, &err); goto done; }
    values_csv(f, base, (int)layer, (int)head, "key", L.key, L.T, L.D);
    values_csv(f, base, (int)layer, (int)head, "value", L.value, L.T, L.D);
    if (L.key_pre_rope) values_csv(f, base, (int)layer, (int)head, "key_pre_rope", L.key_pre_rope, L.T, L.D);
done:
    kvq_layer_free(&L);
    kvq_dump_close(d);
    return rc;
}

/* A dump's description: its header, and the per-layer table's head. */
static void describe_header(FILE *f, const char *path, const kvq_dump_info *in)
{
    fprintf(f, "%s\n  model %s, format kvq-dump/1\n", path, in->model);
    fprintf(f, "  %d layers, %d query heads, %d KV heads (%d query heads per KV head), head_dim %d, %d tokens\n",
            in->num_layers, in->num_heads, in->num_kv_heads, in->num_heads / in->num_kv_heads, in->head_dim,
            in->seq_len);
    fprintf(f, "  key %s, value %s, query %s, key_pre_rope %s, rope tables %s\n",
            dtype_name(in->key_dtype), dtype_name(in->value_dtype),
            in->has_query ? dtype_name(in->query_dtype) : "absent",
            in->has_key_pre_rope ? "present" : "absent", in->has_rope_table ? "present" : "absent");
    fprintf(f, "  rope_theta %s", in->has_rope_theta ? "" : "unset");
    if (in->has_rope_theta) fprintf(f, "%g", in->rope_theta);
    fprintf(f, ", rope_style %s, query_prescaled %d\n",
            in->rope_style == KVQ_ROPE_HALF          ? "half"
            : in->rope_style == KVQ_ROPE_INTERLEAVED ? "interleaved"
                                                     : "unset",
            in->query_prescaled);
    if (in->attn_scale > 0 || in->attn_softcap > 0 || in->window_layers)
        fprintf(f, "  attention: attn_scale %g, attn_softcap %g, %d layer(s) with a sliding window\n",
                in->attn_scale > 0 ? in->attn_scale : 1.0 / sqrt((double)in->head_dim), in->attn_softcap,
                in->window_layers);
    fprintf(f, "  per layer: channel abs-max ratio = max/median of the per-(head,channel) abs-max;\n"
               "  kurtosis is Pearson's (normal = 3); rms over all elements\n");
    fprintf(f, "  %5s  %13s %10s %10s  %13s %10s %10s%s%s\n", "layer", "K absmax max/med", "K kurt", "K rms",
            "V absmax max/med", "V kurt", "V rms",
            in->has_key_pre_rope ? "  pre-RoPE K max/med   kurt        rms" : "",
            in->has_query ? "      Q rms" : "");
}

static int describe(FILE *f, const char *path, int channels, const cli_meta *meta)
{
    cli_progress pr = {0}; /* a line on a terminal once a long dump has taken a second */
    kvq_error err = {0};
    kvq_dump *d = NULL;
    kvq_layer L = {0};
    kvq_channel_stats *st = NULL;
    int rc = CLI_OK;
    if (kvq_dump_open(path, &d, &err)) return cli_fail(prog, &err);
    cli_meta_share_reading(meta, d);
    const kvq_dump_info *in = kvq_dump_get_info(d);
    const char *base = strrchr(path, '/') ? strrchr(path, '/') + 1 : path;
    st = calloc((size_t)in->num_kv_heads * in->head_dim, sizeof *st);
    if (!st) { cli_error(prog, "%s: out of memory", path); rc = CLI_RUNTIME; goto done; }
    if (!channels) describe_header(f, path, in);
    int mode;
    cli_progress_option(prog, "auto", &mode);
    cli_progress_start(&pr, prog, mode, path);
    for (int l = 0; l < in->num_layers; l++) {
        cli_progress_stage(&pr, l, in->num_layers, "read and statistics");
        /* every tensor is read, so every one is checked (finite, as kvq-analyze requires) */
        if (kvq_dump_read_layer(d, l, KVQ_READ_KEY_PRE_ROPE | KVQ_READ_QUERY, &L, &err)) {
            rc = cli_fail(prog, &err);
            goto done;
        }
        if (channels) {
            channels_csv(f, base, l, "key", L.key, L.H, L.T, L.D, st);
            channels_csv(f, base, l, "value", L.value, L.H, L.T, L.D, st);
            if (L.key_pre_rope) channels_csv(f, base, l, "key_pre_rope", L.key_pre_rope, L.H, L.T, L.D, st);
        } else {
            fprintf(f, "  %5d", l);
            tensor_summary(f, L.key, L.H, L.T, L.D, st);
            tensor_summary(f, L.value, L.H, L.T, L.D, st);
            if (L.key_pre_rope) tensor_summary(f, L.key_pre_rope, L.H, L.T, L.D, st);
            if (L.query) {
                double ss = 0;
                size_t nq = (size_t)L.Hq * L.T * L.D;
                for (size_t i = 0; i < nq; i++) ss += (double)L.query[i] * L.query[i];
                fprintf(f, "  %10.4g", sqrt(ss / (double)nq));
            }
            fputc('\n', f);
        }
        kvq_layer_free(&L);
    }
done:
    cli_progress_end(&pr);
    kvq_layer_free(&L);
    free(st);
    kvq_dump_close(d);
    return rc;
}

/* Everything kvq-info's options set (the rows below land here). */
typedef struct info_args {
    int channels;
    long vlayer, vhead; /* --values L:H (-1: not given) */
    const char *output;
} info_args;

/* --values L:H */
static int opt_values(const char *p, const char *arg, void *at, void *base)
{
    info_args *a = base;
    (void)at;
    const char *colon = strchr(arg, ':');
    char layer[32];
    if (colon && (size_t)(colon - arg) < sizeof layer) {
        memcpy(layer, arg, (size_t)(colon - arg));
        layer[colon - arg] = '\0';
        if (!cli_parse_long(layer, 0, 1 << 20, &a->vlayer) && !cli_parse_long(colon + 1, 0, 1 << 20, &a->vhead))
            return CLI_OK;
    }
    a->vlayer = a->vhead = -1;
    return cli_error(p, "--values %s: expected LAYER:HEAD, e.g. 0:1", arg), CLI_USAGE;
}

/* --values as recorded: "L:H", null when not given. */
static void record_values(cli_meta *meta, const cli_optrow *row, const void *base)
{
    const info_args *a = base;
    char v[48];
    snprintf(v, sizeof v, "%ld:%ld", a->vlayer, a->vhead);
    cli_meta_str(meta, "options", row->name, a->vlayer >= 0 ? v : NULL);
}

enum { OPT_CHANNELS = 256, OPT_VALUES };
#define ROW(nm, k, kind, field, ...) \
    {.name = nm, .key = k, .arg = kind, .offset = offsetof(info_args, field), __VA_ARGS__}
static const cli_optrow rows[] = {
    ROW("channels", OPT_CHANNELS, CLI_ARG_FLAG, channels, .record = CLI_RECORD,
        .help = "write per-channel magnitudes as CSV instead (dump,layer,head,tensor,channel,abs_max,abs_mean,rms)"),
    ROW("values", OPT_VALUES, CLI_ARG_CUSTOM, vlayer, .parse = opt_values, .record = CLI_RECORD,
        .record_fn = record_values, .metavar = "L:H",
        .help = "write the keys and values of layer L, KV head H as CSV (dump,layer,head,tensor,token,c0..c{D-1}; "
                "tensor is key, value and key_pre_rope when the dump has it)"),
    ROW("output", 'o', CLI_ARG_TEXT, output, .metavar = "FILE",
        .help = "write to FILE (atomically) instead of stdout, and the run's provenance to FILE.meta.json"),
};
#undef ROW
enum { NROWS = sizeof rows / sizeof rows[0] };

static void usage(FILE *f)
{
    fprintf(f, "usage: kvq-info [options] DUMP...\n"
               "Describe kvq-dump/1 files: shapes, dtypes and per-layer statistics.\n\n");
    cli_optrows_usage(f, rows, NROWS);
    fprintf(f, "      --no-hash         record the dumps' size and mtime, not their SHA-256\n" CLI_HELP_VERSION_HELP);
}

/* The report of every dump, built in memory and written to out only when
 * every dump succeeded: a failing run leaves nothing that looks like a result. */
static int write_report(const info_args *a, char **dumps, int ndumps, cli_out *out)
{
    char *text = NULL;
    size_t text_len = 0;
    int rc = CLI_OK, D = 0;
    FILE *f = open_memstream(&text, &text_len);
    if (!f) return cli_error(prog, "out of memory"), CLI_RUNTIME;
    if (a->channels) fprintf(f, "dump,layer,head,tensor,channel,abs_max,abs_mean,rms\n");
    for (int i = 0; i < ndumps && rc == CLI_OK; i++)
        rc = a->vlayer >= 0 ? dump_values(f, dumps[i], a->vlayer, a->vhead, &D)
                            : describe(f, dumps[i], a->channels, out->meta);
    if (fclose(f) != 0 && rc == CLI_OK) rc = (cli_error(prog, "out of memory for the report"), CLI_RUNTIME);
    if (rc == CLI_OK && fwrite(text, 1, text_len, out->f) != text_len)
        rc = cli_write_error(prog, a->output, KVQ_ERR_IO, errno);
    free(text);
    return rc;
}

static int run(int argc, char **argv, cli_meta *meta)
{
    info_args a = {.vlayer = -1, .vhead = -1};
    cli_out out = {0};
    const cli_getopt_ctx go = {.prog = prog, .usage = usage, .meta = meta};
    int stop, rc = cli_optrows_getopt(&go, rows, NROWS, ":o:hV", argc, argv, &a, &stop);
    if (rc || stop) return rc;
    if (optind >= argc)
        return cli_error(prog, "no dump given (usage: kvq-info [--channels] DUMP...; see --help)"), CLI_USAGE;
    if (a.channels && a.vlayer >= 0)
        return cli_error(prog, "--channels and --values write different tables: choose one"), CLI_USAGE;
    if ((rc = cli_check_output(prog, a.output, (const char *const *)argv + optind, argc - optind)) ||
        (rc = cli_meta_check_format(prog, meta, KVQ_FMT_CSV)))
        return rc;
    cli_meta_operands(meta, argv + optind, argc - optind);
    for (int i = optind; i < argc; i++) cli_meta_input(meta, "dump", argv[i]);
    cli_optrows_record(meta, rows, NROWS, &a, 0);
    if (cli_out_open(&out, a.output, prog) || cli_out_attach_meta(&out, meta, prog)) {
        cli_out_abort(&out);
        return CLI_RUNTIME;
    }
    if ((rc = write_report(&a, argv + optind, argc - optind, &out))) cli_out_abort(&out);
    else if (cli_meta_commit(&out, prog)) rc = CLI_RUNTIME;
    return rc;
}

int main(int argc, char **argv) { return cli_main(prog, argc, argv, 0, run); }

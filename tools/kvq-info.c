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

static void usage(FILE *f)
{
    fprintf(f,
        "usage: kvq-info [options] DUMP...\n"
        "Describe kvq-dump/1 files: shapes, dtypes and per-layer statistics.\n\n"
        "      --channels        write per-channel magnitudes as CSV instead\n"
        "                        (dump,layer,head,tensor,channel,abs_max,abs_mean,rms)\n"
        "      --values L:H      write the keys and values of layer L, KV head H as CSV\n"
        "                        (dump,layer,head,tensor,token,c0..c{D-1}; tensor is key,\n"
        "                        value and key_pre_rope when the dump has it)\n"
        "  -o, --output FILE     write to FILE (atomically) instead of stdout, and the\n"
        "                        run's provenance to FILE.meta.json\n"
        "      --no-hash         record the dumps' size and mtime, not their SHA-256\n"
        "  -h, --help            this help\n"
        "  -V, --version         print the version\n");
}

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

static int describe(FILE *f, const char *path, int channels)
{
    cli_progress pr = {0}; /* a line on a terminal once a long dump has taken a second */
    kvq_error err = {0};
    kvq_dump *d = NULL;
    kvq_layer L = {0};
    kvq_channel_stats *st = NULL;
    int rc = CLI_OK;
    if (kvq_dump_open(path, &d, &err)) return cli_fail(prog, &err);
    const kvq_dump_info *in = kvq_dump_get_info(d);
    const char *base = strrchr(path, '/') ? strrchr(path, '/') + 1 : path;
    st = calloc((size_t)in->num_kv_heads * in->head_dim, sizeof *st);
    if (!st) { cli_error(prog, "%s: out of memory", path); rc = CLI_RUNTIME; goto done; }
    if (!channels) {
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

static int run(int argc, char **argv, cli_meta *meta)
{
    static const struct option longopts[] = {
        {"channels", no_argument, 0, 'c'}, {"values", required_argument, 0, 'v'},
        {"output", required_argument, 0, 'o'}, CLI_META_LONGOPTS,
        {"help", no_argument, 0, 'h'}, {"version", no_argument, 0, 'V'}, {0, 0, 0, 0}};
    int channels = 0, c, rc = CLI_OK, D = 0;
    long vlayer = -1, vhead = -1;
    const char *output = NULL;
    cli_out out = {0};
    const cli_getopt_ctx go = {.prog = prog, .usage = usage, .analysis = NULL, .model = NULL, .meta = meta};
    while ((c = cli_getopt(&go, argc, argv, ":o:hV", longopts, &rc)) != -1) {
        if (c == CLI_GETOPT_STOP) return rc;
        switch (c) {
        case 'c': channels = 1; break;
        case 'v': {
            char *colon = strchr(optarg, ':');
            if (colon) *colon = '\0';
            int bad =
                !colon || cli_parse_long(optarg, 0, 1 << 20, &vlayer) || cli_parse_long(colon + 1, 0, 1 << 20, &vhead);
            if (colon) *colon = ':';
            if (bad) {
                cli_error(prog, "--values %s: expected LAYER:HEAD, e.g. 0:1", optarg);
                return CLI_USAGE;
            }
            break;
        }
        case 'o': output = optarg; break;
        }
    }
    if (optind >= argc) {
        cli_error(prog, "no dump given (usage: kvq-info [--channels] DUMP...; see --help)");
        return CLI_USAGE;
    }
    if (channels && vlayer >= 0) {
        cli_error(prog, "--channels and --values write different tables: choose one");
        return CLI_USAGE;
    }
    int crc = cli_check_output(prog, output, (const char *const *)argv + optind, argc - optind);
    if (crc || (crc = cli_meta_check_format(prog, meta, KVQ_FMT_CSV))) return crc;
    cli_meta_operands(meta, argv + optind, argc - optind);
    for (int i = optind; i < argc; i++) cli_meta_input(meta, "dump", argv[i]);
    cli_meta_bool(meta, "options", "channels", channels);
    if (vlayer >= 0) {
        char v[48];
        snprintf(v, sizeof v, "%ld:%ld", vlayer, vhead);
        cli_meta_str(meta, "options", "values", v);
    } else cli_meta_str(meta, "options", "values", NULL);
    if (cli_out_open(&out, output, prog) || cli_out_attach_meta(&out, meta, prog)) {
        cli_out_abort(&out);
        return CLI_RUNTIME;
    }
    /* the report is built in memory and written only when every dump
     * succeeded: a failing run leaves nothing that looks like a result */
    char *text = NULL;
    size_t text_len = 0;
    FILE *f = open_memstream(&text, &text_len);
    if (!f) {
        cli_error(prog, "out of memory");
        cli_out_abort(&out);
        return CLI_RUNTIME;
    }
    if (channels) fprintf(f, "dump,layer,head,tensor,channel,abs_max,abs_mean,rms\n");
    for (int i = optind; i < argc && rc == CLI_OK; i++)
        rc = vlayer >= 0 ? dump_values(f, argv[i], vlayer, vhead, &D) : describe(f, argv[i], channels);
    if (fclose(f) != 0 && rc == CLI_OK) {
        cli_error(prog, "out of memory for the report");
        rc = CLI_RUNTIME;
    }
    if (rc == CLI_OK && fwrite(text, 1, text_len, out.f) != text_len) {
        rc = cli_write_error(prog, output, KVQ_ERR_IO, errno);
        cli_out_abort(&out);
    } else if (rc == CLI_OK) {
        if (cli_meta_commit(&out, prog)) rc = CLI_RUNTIME;
    } else {
        cli_out_abort(&out);
    }
    free(text);
    return rc;
}

int main(int argc, char **argv) { return cli_main(prog, argc, argv, 0, run); }

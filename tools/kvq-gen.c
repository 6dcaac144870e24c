/* kvq-gen — write seeded synthetic kvq dumps of any shape (docs/tools.md): outlier
 * key channels, RoPE, peaked attention; for tests, demos and benchmarks.  With
 * --task, seeded retrieval task files instead (SPEC §8, docs/models.md#retrieval-tasks). */
#include "cli.h"

#include <getopt.h>
#include <stdlib.h>
#include <string.h>

static const char *prog = "kvq-gen";

static void usage(FILE *f)
{
    fprintf(f,
        "usage: kvq-gen [options] -o OUT.h5\n"
        "       kvq-gen --task KIND --count N --context-tokens L [--model M] [--seed S]\n"
        "               -o OUT.jsonl\n"
        "Write a synthetic kvq-dump/1 file with the structure of real KV caches, or\n"
        "retrieval tasks (one JSON object per line) for kvq-eval --tasks.\n\n"
        "      --preset NAME     tiny (default) or llama3-8b (32 query heads, 8 KV heads,\n"
        "                        head_dim 128, 4096 tokens, 4 layers); options below\n"
        "                        override\n"
        "      --layers N        layers\n"
        "      --heads N         query heads\n"
        "      --kv-heads N      KV heads (divides --heads)\n"
        "      --head-dim N      head dimension (even)\n"
        "      --tokens N        sequence length\n"
        "      --dtype T         float16 or float32 (default) or float64\n"
        "      --rope-style S    interleaved (default) or half\n"
        "      --rope-theta X    RoPE base (default 10000)\n"
        "      --outliers N      outlier channels per KV head in pre-RoPE keys\n"
        "                        (default 4)\n"
        "      --outlier-scale X their magnitude factor (default 8)\n"
        "      --peak X          query-key alignment; larger = more peaked attention\n"
        "                        (default 8)\n"
        "      --no-query        omit queries\n"
        "      --no-key-pre-rope omit pre-RoPE keys\n"
        "      --seed N          seed (default 0)\n"
        "      --task KIND       needle, multikey, kv or mqar: write tasks, not a dump\n"
        "      --count N         tasks (default 100)\n"
        "      --context-tokens L  tokens of each task's context (as many sentences\n"
        "                        or pairs as fit)\n"
        "      --model FILE      count tokens with this model's tokenizer (default: one\n"
        "                        per word, digit and punctuation mark, exact for\n"
        "                        data/kvq-retrieval.gguf)\n"
        "      --progress WHEN   auto (default: a line on a terminal once a run takes\n"
        "                        more than a second), always or never\n"
        "  -o, --output FILE     output dump (written atomically), and its provenance to\n"
        "                        FILE.meta.json (every setting, a preset expanded)\n"
        "      --no-hash         do not record the dump's SHA-256\n"
        "  -h, --help            this help\n"
        "  -V, --version         print the version\n");
}

enum { OPT_PRESET = 256, OPT_LAYERS, OPT_HEADS, OPT_KV, OPT_DIM, OPT_TOKENS, OPT_DTYPE,
       OPT_STYLE, OPT_THETA, OPT_OUTLIERS, OPT_OSCALE, OPT_PEAK, OPT_NOQ, OPT_NOPRE, OPT_SEED,
       OPT_PROGRESS, OPT_TASK, OPT_COUNT, OPT_CONTEXT_TOKENS, OPT_MODEL };

static int parse_pos_double(const char *s, double *out)
{
    char *end;
    double v = strtod(s, &end);
    if (end == s || *end || !(v > 0) || v > 1e30) return -1;
    *out = v;
    return 0;
}

/* Task mode's settings (--task, --count, --context-tokens, --model). */
typedef struct task_opts {
    int on;
    kvq_task_kind kind;
    long count, context_tokens;
    const char *model;
} task_opts;

static size_t count_model_tokens(void *ud, const char *text, size_t len)
{
    int *ids;
    size_t n;
    kvq_error err;
    if (kvq_model_tokenize_part(ud, text, len, &ids, &n, &err)) return (size_t)-1 / 2; /* too many: never fits */
    free(ids);
    return n;
}

/* kvq-gen --task: the tasks as JSON lines, atomically, with their record. */
static int write_tasks(const task_opts *t, uint64_t seed, const char *output, cli_meta *meta)
{
    kvq_error err = {0};
    kvq_model *m = NULL;
    kvq_task *tasks = NULL;
    cli_out out = {0};
    int rc = CLI_RUNTIME;
    if (!t->context_tokens) {
        cli_error(prog, "--task needs --context-tokens L");
        return CLI_USAGE;
    }
    if (t->model) {
        if (kvq_model_open(t->model, NULL, &m, &err)) return cli_fail(prog, &err);
        if (!kvq_model_get_info(m)->has_tokenizer) {
            cli_error(prog, "%s: the model has no tokenizer to count tokens with", t->model);
            goto done;
        }
    }
    cli_meta_str(meta, "options", "task", kvq_task_kind_name(t->kind));
    cli_meta_int(meta, "options", "count", t->count);
    cli_meta_int(meta, "options", "context-tokens", t->context_tokens);
    cli_meta_u64(meta, "options", "seed", seed);
    cli_meta_str(meta, "options", "token-count", m ? "model" : "approximate");
    cli_meta_input(meta, "model", t->model);
    if (kvq_tasks_generate(t->kind, (size_t)t->count, (int)t->context_tokens, seed, m ? count_model_tokens : NULL, m,
                           &tasks, &err)) {
        rc = cli_fail(prog, &err);
        goto done;
    }
    if (cli_out_open(&out, output, prog) || cli_out_attach_meta(&out, meta, prog)) goto done;
    for (long i = 0; i < t->count; i++) {
        char *line = kvq_task_json(&tasks[i], kvq_task_kind_name(t->kind));
        if (!line) {
            cli_error(prog, "out of memory writing %s", output);
            cli_out_abort(&out);
            goto done;
        }
        fputs(line, out.f);
        fputc('\n', out.f);
        free(line);
    }
    rc = cli_meta_commit(&out, prog);
done:
    kvq_tasks_free(tasks, tasks ? (size_t)t->count : 0);
    kvq_model_close(m);
    return rc;
}

static int run(int argc, char **argv, cli_meta *meta)
{
    static const struct option longopts[] = {
        {"preset", required_argument, 0, OPT_PRESET}, {"layers", required_argument, 0, OPT_LAYERS},
        {"heads", required_argument, 0, OPT_HEADS}, {"kv-heads", required_argument, 0, OPT_KV},
        {"head-dim", required_argument, 0, OPT_DIM}, {"tokens", required_argument, 0, OPT_TOKENS},
        {"dtype", required_argument, 0, OPT_DTYPE}, {"rope-style", required_argument, 0, OPT_STYLE},
        {"rope-theta", required_argument, 0, OPT_THETA}, {"outliers", required_argument, 0, OPT_OUTLIERS},
        {"outlier-scale", required_argument, 0, OPT_OSCALE}, {"peak", required_argument, 0, OPT_PEAK},
        {"no-query", no_argument, 0, OPT_NOQ}, {"no-key-pre-rope", no_argument, 0, OPT_NOPRE},
        {"seed", required_argument, 0, OPT_SEED}, {"progress", required_argument, 0, OPT_PROGRESS},
        {"task", required_argument, 0, OPT_TASK}, {"count", required_argument, 0, OPT_COUNT},
        {"context-tokens", required_argument, 0, OPT_CONTEXT_TOKENS}, {"model", required_argument, 0, OPT_MODEL},
        {"output", required_argument, 0, 'o'}, CLI_META_LONGOPTS,
        {"help", no_argument, 0, 'h'}, {"version", no_argument, 0, 'V'}, {0, 0, 0, 0}};
    kvq_gen_opts o;
    kvq_gen_defaults(&o);
    const char *output = NULL;
    int c, progress_mode = -1;
    task_opts task = {.count = 100};
    cli_progress progress = {0};
    long v;
    /* presets first, so that explicit options override them in any order */
    for (int i = 1; i < argc; i++) {
        const char *p = NULL;
        if (!strcmp(argv[i], "--preset") && i + 1 < argc) p = argv[i + 1];
        else if (!strncmp(argv[i], "--preset=", 9)) p = argv[i] + 9;
        if (p && !strcmp(p, "llama3-8b"))
            o.num_layers = 4, o.num_heads = 32, o.num_kv_heads = 8, o.head_dim = 128, o.seq_len = 4096,
            o.rope_theta = 500000.0, o.rope_style = KVQ_ROPE_HALF;
        else if (p && strcmp(p, "tiny")) {
            cli_error(prog, "--preset %s: expected tiny or llama3-8b", p);
            return CLI_USAGE;
        }
    }
#define INTOPT(field, lo, hi, name)                                                              \
    if (cli_parse_long(optarg, lo, hi, &v)) {                                                    \
        cli_error(prog, "--%s %s: expected an integer %ld..%ld", name, optarg, (long)(lo), (long)(hi)); \
        return CLI_USAGE;                                                                        \
    }                                                                                            \
    field = (int)v;
    const cli_getopt_ctx go = {.prog = prog, .usage = usage, .analysis = NULL, .model = NULL, .meta = meta};
    int rc = CLI_OK;
    while ((c = cli_getopt(&go, argc, argv, ":o:hV", longopts, &rc)) != -1) {
        if (c == CLI_GETOPT_STOP) return rc;
        switch (c) {
        case OPT_PRESET: break;
        case OPT_LAYERS: INTOPT(o.num_layers, 1, 1000, "layers") break;
        case OPT_HEADS: INTOPT(o.num_heads, 1, 1 << 16, "heads") break;
        case OPT_KV: INTOPT(o.num_kv_heads, 1, 1 << 16, "kv-heads") break;
        case OPT_DIM: INTOPT(o.head_dim, 2, 4096, "head-dim") break;
        case OPT_TOKENS: INTOPT(o.seq_len, 1, 1 << 24, "tokens") break;
        case OPT_OUTLIERS: INTOPT(o.outlier_channels, 0, 2048, "outliers") break;
        case OPT_DTYPE:
            if (!strcmp(optarg, "float16")) o.dtype = KVQ_F16;
            else if (!strcmp(optarg, "float32")) o.dtype = KVQ_F32;
            else if (!strcmp(optarg, "float64")) o.dtype = KVQ_F64;
            else { cli_error(prog, "--dtype %s: expected float16, float32 or float64", optarg); return CLI_USAGE; }
            break;
        case OPT_STYLE:
            if (!strcmp(optarg, "interleaved")) o.rope_style = KVQ_ROPE_INTERLEAVED;
            else if (!strcmp(optarg, "half")) o.rope_style = KVQ_ROPE_HALF;
            else { cli_error(prog, "--rope-style %s: expected interleaved or half", optarg); return CLI_USAGE; }
            break;
        case OPT_THETA:
            if (parse_pos_double(optarg, &o.rope_theta)) {
                cli_error(prog, "--rope-theta %s: expected a positive number", optarg);
                return CLI_USAGE;
            }
            break;
        case OPT_OSCALE:
            if (parse_pos_double(optarg, &o.outlier_scale)) {
                cli_error(prog, "--outlier-scale %s: expected a positive number", optarg);
                return CLI_USAGE;
            }
            break;
        case OPT_PEAK:
            if (parse_pos_double(optarg, &o.peak)) {
                cli_error(prog, "--peak %s: expected a positive number", optarg);
                return CLI_USAGE;
            }
            break;
        case OPT_NOQ: o.with_query = 0; break;
        case OPT_NOPRE: o.with_key_pre_rope = 0; break;
        case OPT_SEED:
            if (cli_parse_u64(optarg, &o.seed)) {
                cli_error(prog, "--seed %s: expected a non-negative integer", optarg);
                return CLI_USAGE;
            }
            break;
        case OPT_PROGRESS:
            if ((c = cli_progress_option(prog, optarg, &progress_mode))) return c;
            break;
        case OPT_TASK:
            if (kvq_task_kind_parse(optarg, &task.kind)) {
                cli_error(prog, "--task %s: expected needle, multikey, kv or mqar", optarg);
                return CLI_USAGE;
            }
            task.on = 1;
            break;
        case OPT_COUNT:
            if (cli_parse_long(optarg, 1, 1000000, &task.count)) {
                cli_error(prog, "--count %s: expected an integer 1..1000000", optarg);
                return CLI_USAGE;
            }
            break;
        case OPT_CONTEXT_TOKENS:
            if (cli_parse_long(optarg, 1, 1 << 24, &task.context_tokens)) {
                cli_error(prog, "--context-tokens %s: expected an integer 1..16777216", optarg);
                return CLI_USAGE;
            }
            break;
        case OPT_MODEL: task.model = optarg; break;
        case 'o': output = optarg; break;
        }
    }
    if (optind < argc) {
        cli_error(prog, "unexpected argument %s (see --help)", argv[optind]);
        return CLI_USAGE;
    }
    if (!output) {
        cli_error(prog, task.on ? "no output given (-o OUT.jsonl)" : "no output given (-o OUT.h5)");
        return CLI_USAGE;
    }
    kvq_error err = {0};
    const char *inputs[] = {task.model};
    int crc = cli_check_output(prog, output, inputs, 1);
    if (crc) return crc;
    if (task.on) return write_tasks(&task, o.seed, output, meta);
    if (cli_meta_inline(meta)) {
        cli_error(prog, "--meta inline: a dump is HDF5; its record is OUT.meta.json");
        return CLI_USAGE;
    }
    /* provenance: every generator setting as it took effect (a preset expanded) */
    static const char *const dtypes[] = {"float16", "float32", "float64"};
    cli_meta_int(meta, "options", "layers", o.num_layers);
    cli_meta_int(meta, "options", "heads", o.num_heads);
    cli_meta_int(meta, "options", "kv-heads", o.num_kv_heads);
    cli_meta_int(meta, "options", "head-dim", o.head_dim);
    cli_meta_int(meta, "options", "tokens", o.seq_len);
    cli_meta_str(meta, "options", "dtype", dtypes[o.dtype]);
    cli_meta_str(meta, "options", "rope-style", o.rope_style == KVQ_ROPE_HALF ? "half" : "interleaved");
    cli_meta_double(meta, "options", "rope-theta", o.rope_theta);
    cli_meta_int(meta, "options", "outliers", o.outlier_channels);
    cli_meta_double(meta, "options", "outlier-scale", o.outlier_scale);
    cli_meta_double(meta, "options", "peak", o.peak);
    cli_meta_bool(meta, "options", "no-query", !o.with_query);
    cli_meta_bool(meta, "options", "no-key-pre-rope", !o.with_key_pre_rope);
    cli_meta_u64(meta, "options", "seed", o.seed);
    if ((crc = cli_meta_drop(prog, output))) return crc;
    if (progress_mode < 0) cli_progress_option(prog, "auto", &progress_mode);
    cli_progress_start(&progress, prog, progress_mode, output);
    o.progress = cli_progress_stage, o.progress_ud = &progress;
    kvq_status st = kvq_gen_write(output, &o, &err);
    cli_progress_end(&progress);
    return st ? cli_fail(prog, &err) : cli_meta_write_hashed(meta, prog, output);
}

int main(int argc, char **argv) { return cli_main(prog, argc, argv, CLI_MAIN_TEMP_HOOKS, run); }

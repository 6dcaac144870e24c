/* kvq-gen — write seeded synthetic kvq dumps of any shape (docs/tools.md): outlier
 * key channels, RoPE, peaked attention; for tests, demos and benchmarks.  With
 * --task, seeded retrieval task files instead (SPEC §8, docs/models.md#retrieval-tasks). */
#include "cli.h"

#include <getopt.h>
#include <stdlib.h>
#include <string.h>

static const char *prog = "kvq-gen";

static void usage(FILE *f);

enum { OPT_PRESET = 256, OPT_LAYERS, OPT_HEADS, OPT_KV, OPT_DIM, OPT_TOKENS, OPT_DTYPE,
       OPT_STYLE, OPT_THETA, OPT_OUTLIERS, OPT_OSCALE, OPT_PEAK, OPT_NOQ, OPT_NOPRE, OPT_SEED,
       OPT_PROGRESS, OPT_TASK, OPT_COUNT, OPT_CONTEXT_TOKENS, OPT_MODEL };

/* Task mode's settings (--task, --count, --context-tokens, --model). */
typedef struct task_opts {
    int on;
    kvq_task_kind kind;
    int count, context_tokens;
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
    cli_meta_str(meta, "options", "token-count", m ? "model" : "approximate"); /* the rows: run() */
    cli_meta_input(meta, "model", t->model);
    if (kvq_tasks_generate(t->kind, (size_t)t->count, (int)t->context_tokens, seed, m ? count_model_tokens : NULL, m,
                           &tasks, &err)) {
        rc = cli_fail(prog, &err);
        goto done;
    }
    if (cli_out_open(&out, output, prog) || cli_out_attach_meta(&out, meta, prog)) goto done;
    for (int i = 0; i < t->count; i++) {
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

/* Everything kvq-gen's options set (the rows below land here). */
typedef struct gen_args {
    kvq_gen_opts o;
    int preset, dtype, style, no_query, no_pre, task; /* CHOICE indices (task: -1 when not given) and flags */
    task_opts t;
    const char *output, *progress;
} gen_args;

static const char *const presets[] = {"tiny", "llama3-8b", NULL};
static const char *const dtypes[] = {"float16", "float32", "float64", NULL}; /* kvq_dtype's order */
static const char *const styles[] = {"interleaved", "half", NULL};          /* kvq_rope_style's, from 1 */
static const char *const kinds[] = {"needle", "multikey", "kv", "mqar", NULL}; /* kvq_task_kind's */

#define ROW(nm, k, kind, field, ...) {.name = nm, .key = k, .arg = kind, .offset = offsetof(gen_args, field), __VA_ARGS__}
static const cli_optrow rows[] = {
    ROW("preset", OPT_PRESET, CLI_ARG_CHOICE, preset, .choices = presets, .metavar = "NAME",
        .help = "tiny (default) or llama3-8b (32 query heads, 8 KV heads, head_dim 128, 4096 tokens, 4 layers); "
                "options below override"),
    ROW("layers", OPT_LAYERS, CLI_ARG_INT, o.num_layers, .min = 1, .max = 1000, .record = CLI_RECORD, .metavar = "N",
        .help = "layers"),
    ROW("heads", OPT_HEADS, CLI_ARG_INT, o.num_heads, .min = 1, .max = 1 << 16, .record = CLI_RECORD, .metavar = "N",
        .help = "query heads"),
    ROW("kv-heads", OPT_KV, CLI_ARG_INT, o.num_kv_heads, .min = 1, .max = 1 << 16, .record = CLI_RECORD, .metavar = "N",
        .help = "KV heads (divides --heads)"),
    ROW("head-dim", OPT_DIM, CLI_ARG_INT, o.head_dim, .min = 2, .max = 4096, .record = CLI_RECORD, .metavar = "N",
        .help = "head dimension (even)"),
    ROW("tokens", OPT_TOKENS, CLI_ARG_INT, o.seq_len, .min = 1, .max = 1 << 24, .record = CLI_RECORD, .metavar = "N",
        .help = "sequence length"),
    ROW("dtype", OPT_DTYPE, CLI_ARG_CHOICE, dtype, .choices = dtypes, .record = CLI_RECORD, .metavar = "T",
        .help = "float16 or float32 (default) or float64"),
    ROW("rope-style", OPT_STYLE, CLI_ARG_CHOICE, style, .choices = styles, .record = CLI_RECORD, .metavar = "S",
        .help = "interleaved (default) or half"),
    ROW("rope-theta", OPT_THETA, CLI_ARG_REAL, o.rope_theta, .record = CLI_RECORD, .metavar = "X",
        .help = "RoPE base (default 10000)"),
    ROW("outliers", OPT_OUTLIERS, CLI_ARG_INT, o.outlier_channels, .min = 0, .max = 2048, .record = CLI_RECORD,
        .metavar = "N", .help = "outlier channels per KV head in pre-RoPE keys (default 4)"),
    ROW("outlier-scale", OPT_OSCALE, CLI_ARG_REAL, o.outlier_scale, .record = CLI_RECORD, .metavar = "X",
        .help = "their magnitude factor (default 8)"),
    ROW("peak", OPT_PEAK, CLI_ARG_REAL, o.peak, .record = CLI_RECORD, .metavar = "X",
        .help = "query-key alignment; larger = more peaked attention (default 8)"),
    ROW("no-query", OPT_NOQ, CLI_ARG_FLAG, no_query, .record = CLI_RECORD, .help = "omit queries"),
    ROW("no-key-pre-rope", OPT_NOPRE, CLI_ARG_FLAG, no_pre, .record = CLI_RECORD, .help = "omit pre-RoPE keys"),
    ROW("seed", OPT_SEED, CLI_ARG_U64, o.seed, .record = CLI_RECORD | CLI_RECORD_ALT, .metavar = "N",
        .help = "seed (default 0)"),
    ROW("task", OPT_TASK, CLI_ARG_CHOICE, task, .choices = kinds, .record = CLI_RECORD_ALT, .metavar = "KIND",
        .help = "needle, multikey, kv or mqar: write tasks, not a dump"),
    ROW("count", OPT_COUNT, CLI_ARG_INT, t.count, .record = CLI_RECORD_ALT, .min = 1, .max = 1000000, .metavar = "N",
        .help = "tasks (default 100)"),
    ROW("context-tokens", OPT_CONTEXT_TOKENS, CLI_ARG_INT, t.context_tokens, .record = CLI_RECORD_ALT, .min = 1,
        .max = 1 << 24, .metavar = "L", .help = "tokens of each task's context (as many sentences or pairs as fit)"),
    ROW("model", OPT_MODEL, CLI_ARG_TEXT, t.model, .metavar = "FILE",
        .help = "count tokens with this model's tokenizer (default: one per word, digit and punctuation mark, exact "
                "for data/kvq-retrieval.gguf)"),
    ROW("progress", OPT_PROGRESS, CLI_ARG_TEXT, progress, .metavar = "WHEN",
        .help = "auto (default: a line on a terminal once a run takes more than a second), always or never"),
    ROW("output", 'o', CLI_ARG_TEXT, output, .metavar = "FILE",
        .help = "output dump (written atomically), and its provenance to FILE.meta.json (every setting, a preset "
                "expanded)"),
};
#undef ROW
enum { NROWS = sizeof rows / sizeof rows[0] };

/* Presets first, so that explicit options override them in any order. */
static int apply_preset(int argc, char **argv, gen_args *a)
{
    for (int i = 1; i < argc; i++) {
        const char *p = NULL;
        if (!strcmp(argv[i], "--preset") && i + 1 < argc) p = argv[i + 1];
        else if (!strncmp(argv[i], "--preset=", 9)) p = argv[i] + 9;
        if (p && !strcmp(p, "llama3-8b"))
            a->o.num_layers = 4, a->o.num_heads = 32, a->o.num_kv_heads = 8, a->o.head_dim = 128, a->o.seq_len = 4096,
            a->o.rope_theta = 500000.0, a->o.rope_style = KVQ_ROPE_HALF;
        else if (p && strcmp(p, "tiny"))
            return cli_error(prog, "--preset %s: expected tiny or llama3-8b", p), CLI_USAGE;
    }
    return CLI_OK;
}

/* The options, row by row; *stop after --help, --version or a refusal. */
static int parse_options(int argc, char **argv, gen_args *a, cli_meta *meta, int *stop)
{
    const cli_getopt_ctx go = {.prog = prog, .usage = usage, .meta = meta};
    int rc = cli_optrows_getopt(&go, rows, NROWS, ":o:hV", argc, argv, a, stop);
    a->o.dtype = (kvq_dtype)a->dtype, a->o.rope_style = (kvq_rope_style)(a->style + 1);
    a->o.with_query = !a->no_query, a->o.with_key_pre_rope = !a->no_pre;
    if (a->task >= 0) a->t.on = 1, a->t.kind = (kvq_task_kind)a->task;
    return rc;
}

static void usage(FILE *f)
{
    fprintf(f, "usage: kvq-gen [options] -o OUT.h5\n"
               "       kvq-gen --task KIND --count N --context-tokens L [--model M] [--seed S]\n"
               "               -o OUT.jsonl\n"
               "Write a synthetic kvq-dump/1 file with the structure of real KV caches, or\n"
               "retrieval tasks (one JSON object per line) for kvq-eval --tasks.\n\n");
    cli_optrows_usage(f, rows, NROWS);
    fprintf(f, "      --no-hash         do not record the dump's SHA-256\n"
               "  -h, --help            this help\n"
               "  -V, --version         print the version\n");
}

static int run(int argc, char **argv, cli_meta *meta)
{
    gen_args a = {.task = -1, .t = {.count = 100}};
    kvq_gen_defaults(&a.o);
    int rc, stop = 0, progress_mode = -1;
    if ((rc = apply_preset(argc, argv, &a))) return rc;
    a.dtype = (int)a.o.dtype, a.style = (int)a.o.rope_style - 1;
    if ((rc = parse_options(argc, argv, &a, meta, &stop)) || stop) return rc;
    if (a.progress && (rc = cli_progress_option(prog, a.progress, &progress_mode))) return rc;
    if (optind < argc) return cli_error(prog, "unexpected argument %s (see --help)", argv[optind]), CLI_USAGE;
    if (!a.output)
        return cli_error(prog, a.t.on ? "no output given (-o OUT.jsonl)" : "no output given (-o OUT.h5)"), CLI_USAGE;
    const char *inputs[] = {a.t.model};
    if ((rc = cli_check_output(prog, a.output, inputs, 1))) return rc;
    if (a.t.on) { /* the task rows as they took effect */
        cli_optrows_record(meta, rows, NROWS, &a, 1);
        return write_tasks(&a.t, a.o.seed, a.output, meta);
    }
    if (cli_meta_inline(meta))
        return cli_error(prog, "--meta inline: a dump is HDF5; its record is OUT.meta.json"), CLI_USAGE;
    cli_optrows_record(meta, rows, NROWS, &a, 0); /* every generator setting as it took effect (a preset expanded) */
    if ((rc = cli_meta_drop(prog, a.output))) return rc;
    if (progress_mode < 0) cli_progress_option(prog, "auto", &progress_mode);
    cli_progress progress = {0};
    cli_progress_start(&progress, prog, progress_mode, a.output);
    a.o.progress = cli_progress_stage, a.o.progress_ud = &progress;
    kvq_error err = {0};
    kvq_status st = kvq_gen_write(a.output, &a.o, &err);
    cli_progress_end(&progress);
    return st ? cli_fail(prog, &err) : cli_meta_write_hashed(meta, prog, a.output);
}

int main(int argc, char **argv) { return cli_main(prog, argc, argv, CLI_MAIN_TEMP_HOOKS, run); }

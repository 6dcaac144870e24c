/* optrows.c — a tool's options as rows (cli_optrow, curl's option table):
 * one row per option makes its getopt entry, its checked parsing (one
 * message per kind of argument), its --help line and its provenance
 * record, so that an option is one row and not four places by hand.  The
 * options the tools share are rows too (the analysis and model groups
 * here, the record's in meta.c), parsed by the one option loop, cli_getopt. */
#include "cli.h"

#include <math.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

/* ------------------------------------------------------- the groups */

int cli_index_list_option(const char *prog, const char *arg, int max, const char *name, const char *what, int **v,
                          int *n)
{
    free(*v), *v = NULL;
    if (!cli_parse_list(arg, max, v, n)) return CLI_OK;
    cli_error(prog, "--%s %s: expected a list like %s", name, arg, what);
    return CLI_USAGE;
}

static int opt_layers(const char *prog, const char *arg, void *at, void *base)
{
    cli_analysis *a = base;
    (void)at;
    return cli_index_list_option(prog, arg, 999, "layers", "0-3,7 of distinct layers", &a->layers, &a->nlayers);
}

static int opt_heads(const char *prog, const char *arg, void *at, void *base)
{
    cli_analysis *a = base;
    (void)at;
    return cli_index_list_option(prog, arg, 1 << 20, "heads", "0-1,3 of distinct KV heads", &a->heads, &a->nheads);
}

static int opt_queries(const char *prog, const char *arg, void *at, void *base)
{
    kvq_error err = {0};
    (void)base;
    return kvq_query_sel_parse(arg, (kvq_query_sel *)at, &err) ? cli_fail(prog, &err) : CLI_OK;
}

/* --queries as given ("last:64", "all"); --threads as it took effect (0: all cores, counted). */
static void record_queries(cli_meta *meta, const cli_optrow *row, const void *base)
{
    static const char *const kind[] = {"last", "all", "every", "random"};
    const kvq_query_sel *q = (const kvq_query_sel *)((const char *)base + row->offset);
    char text[64];
    if (q->kind == KVQ_Q_ALL) snprintf(text, sizeof text, "all");
    else snprintf(text, sizeof text, "%s:%ld", kind[q->kind], q->n);
    cli_meta_str(meta, "options", row->name, text);
}

static void record_threads(cli_meta *meta, const cli_optrow *row, const void *base)
{
    cli_meta_int(meta, "options", row->name, kvq_threads((int)*(const long *)((const char *)base + row->offset)));
}

static const char *const pers[] = {"head", "layer", "model", NULL}; /* kvq_per's order */
_Static_assert(sizeof(kvq_per) == sizeof(int), "a CHOICE row stores an int");
static const char *const devices[] = {"cpu", "cuda", NULL};          /* cli_analysis.cuda */
#define AN(nm, k, kind, field, ...) \
    {.name = nm, .key = k, .arg = kind, .offset = offsetof(cli_analysis, field), .record = CLI_RECORD, __VA_ARGS__}
const cli_optrow cli_analysis_rows[] = {
    AN("layers", CLI_OPT_LAYERS, CLI_ARG_CUSTOM, layers, .parse = opt_layers, .record_fn = cli_optrow_record_ints,
       .aux_offset = offsetof(cli_analysis, nlayers), .metavar = "LIST",
       .help = "layers to analyse, e.g. 0-3,7 (default: all)"),
    AN("heads", CLI_OPT_HEADS, CLI_ARG_CUSTOM, heads, .parse = opt_heads, .record_fn = cli_optrow_record_ints,
       .aux_offset = offsetof(cli_analysis, nheads), .metavar = "LIST", .help = "KV heads to analyse (default: all)"),
    AN("queries", CLI_OPT_QUERIES, CLI_ARG_CUSTOM, queries, .parse = opt_queries, .record_fn = record_queries,
       .metavar = "SEL", .help = "query rows: last:N (default last:64), all, every:N, random:N"),
    AN("per", CLI_OPT_PER, CLI_ARG_CHOICE, per, .choices = pers, .metavar = "WHAT",
       .help = "pool results per head, layer (default) or model"),
    AN("threads", CLI_OPT_THREADS, CLI_ARG_LONG, threads, .min = 1, .max = 4096, .record_fn = record_threads,
       .metavar = "N", .help = "worker threads (default: all cores)"),
    AN("seed", CLI_OPT_SEED, CLI_ARG_U64, seed, .metavar = "N", .help = "seed of the random streams (default 0)"),
    AN("device", CLI_OPT_DEVICE, CLI_ARG_CHOICE, cuda, .choices = devices, .metavar = "DEV"), /* help: the tool's */
};
#undef AN
const int cli_analysis_nrows = sizeof cli_analysis_rows / sizeof cli_analysis_rows[0];

#define MO(nm, k, kind, field, ...) \
    {.name = nm, .key = k, .arg = kind, .offset = offsetof(cli_model, field), __VA_ARGS__}
const cli_optrow cli_model_rows[] = {
    MO("text", CLI_OPT_TEXT, CLI_ARG_TEXT, text, .record = CLI_RECORD | CLI_RECORD_NULL, .metavar = "FILE",
       .help = "text, tokenized as llama.cpp does (BOS if the model adds one)"),
    MO("tokens", CLI_OPT_TOKENS, CLI_ARG_TEXT, tokens, .record = CLI_RECORD | CLI_RECORD_NULL, .metavar = "FILE",
       .help = "whitespace-separated token ids instead (any model)"),
    MO("tokenizer", CLI_OPT_TOKENIZER, CLI_ARG_TEXT, tokenizer, .record = CLI_RECORD | CLI_RECORD_NULL,
       .metavar = "FILE", .help = "llama2.c tokenizer.bin (llama2.c checkpoints only)"),
    MO("max-tokens", CLI_OPT_MAX_TOKENS, CLI_ARG_LONG, max_tokens, .min = 2, .max = 1L << 30,
       .expect = "an integer 2..2^30", .record = CLI_RECORD | CLI_RECORD_NULL, .metavar = "N",
       .help = "keep the first N tokens (BOS included)"),
    MO("threads", CLI_OPT_MODEL_THREADS, CLI_ARG_LONG, threads, .min = 1, .max = 4096, .record = CLI_RECORD,
       .record_fn = record_threads, .metavar = "N", .help = "worker threads (default: all cores)"),
};
#undef MO
const int cli_model_nrows = sizeof cli_model_rows / sizeof cli_model_rows[0];

void cli_meta_analysis(cli_meta *m, const cli_analysis *an)
{
    cli_optrows_record(m, cli_analysis_rows, cli_analysis_nrows, an, 0);
}

void cli_meta_model(cli_meta *m, const char *model_path, const cli_model *mo, const kvq_model_info *in, int T)
{
    cli_meta_input(m, "model", model_path);
    cli_meta_input(m, "text", mo->text);
    cli_meta_input(m, "tokens", mo->tokens);
    cli_meta_input(m, "tokenizer", mo->tokenizer);
    cli_optrows_record(m, cli_model_rows, cli_model_nrows, mo, 0);
    cli_meta_str(m, "model", "name", in->name);
    cli_meta_str(m, "model", "architecture", in->arch_name);
    cli_meta_str(m, "model", "format", in->format);
    cli_meta_int(m, "model", "layers", in->n_layers);
    cli_meta_int(m, "model", "kv_heads", in->n_kv_heads);
    cli_meta_int(m, "model", "head_dim", in->head_dim);
    cli_meta_int(m, "model", "tokens", T);
}

/* The groups a context has, in the order their options are parsed. */
typedef struct {
    const cli_optrow *rows;
    int n;
    void *base;
} group;
static int groups_of(const cli_getopt_ctx *go, group *g)
{
    int k = 0;
    if (go->analysis) g[k++] = (group){cli_analysis_rows, cli_analysis_nrows, go->analysis};
    if (go->model) g[k++] = (group){cli_model_rows, cli_model_nrows, go->model};
    if (go->meta) g[k++] = (group){cli_meta_rows, cli_meta_nrows, go->meta};
    return k;
}

static struct option long_entry(const cli_optrow *r)
{
    return (struct option){r->name, r->arg == CLI_ARG_FLAG ? no_argument : required_argument, 0, r->key};
}

/* getopt's table: the rows, then the option groups go has and -h, -V;
 * malloc'ed into *out; -1 out of memory. */
static int optrows_longopts(const cli_optrow *rows, int n, const cli_getopt_ctx *go, struct option **out)
{
    group g[3];
    int ng = groups_of(go, g), total = n + 2;
    for (int i = 0; i < ng; i++) total += g[i].n;
    struct option *o = calloc((size_t)total + 1, sizeof *o);
    if (!o) return -1;
    int k = 0;
    for (int i = 0; i < n; i++) o[k++] = long_entry(&rows[i]);
    for (int i = 0; i < ng; i++)
        for (int j = 0; j < g[i].n; j++) o[k++] = long_entry(&g[i].rows[j]);
    o[k++] = (struct option){"help", no_argument, 0, 'h'};
    o[k++] = (struct option){"version", no_argument, 0, 'V'};
    *out = o;
    return 0;
}

int cli_getopt(const cli_getopt_ctx *g, int argc, char **argv, const char *shortopts, const struct option *longopts,
               int *rc)
{
    group gr[3];
    int ng = groups_of(g, gr);
    opterr = 0; /* the messages are ours */
    for (;;) {
        int c = getopt_long(argc, argv, shortopts, longopts, NULL), r = CLI_OPTROW_NONE;
        if (c == -1) return -1;
        for (int i = 0; i < ng && r == CLI_OPTROW_NONE; i++)
            r = cli_optrow_parse(g->prog, gr[i].rows, gr[i].n, c, optarg, gr[i].base);
        if (r == CLI_OK) continue;
        if (r != CLI_OPTROW_NONE) {
            *rc = r;
            return CLI_GETOPT_STOP;
        }
        switch (c) {
        case 'h': g->usage(stdout); *rc = CLI_OK; return CLI_GETOPT_STOP;
        case 'V': cli_version(g->prog); *rc = CLI_OK; return CLI_GETOPT_STOP;
        case ':':
            cli_error(g->prog, "option %s needs a value (see --help)", argv[optind - 1]);
            *rc = CLI_USAGE;
            return CLI_GETOPT_STOP;
        case '?':
            cli_error(g->prog, "unknown option %s (see --help)", argv[optind - 1]);
            *rc = CLI_USAGE;
            return CLI_GETOPT_STOP;
        default: return c;
        }
    }
}

/* "float16, float32 or float64" from a NULL-terminated list. */
static void choice_list(const char *const *choices, char *buf, size_t len)
{
    buf[0] = '\0';
    int n = 0;
    while (choices[n]) n++;
    for (int i = 0; i < n; i++)
        snprintf(buf + strlen(buf), len - strlen(buf), "%s%s", i ? (i == n - 1 ? " or " : ", ") : "", choices[i]);
}

int cli_optrow_parse(const char *prog, const cli_optrow *rows, int n, int key, const char *arg, void *base)
{
    const cli_optrow *r = NULL;
    for (int i = 0; i < n && !r; i++)
        if (rows[i].key == key) r = &rows[i];
    if (!r) return CLI_OPTROW_NONE;
    char *at = (char *)base + r->offset, expect[160];
    long v;
    double d;
    char *end;
    switch (r->arg) {
    case CLI_ARG_FLAG: *(int *)at = 1; return CLI_OK;
    case CLI_ARG_TEXT: *(const char **)at = arg; return CLI_OK;
    case CLI_ARG_INT:
        if (!cli_parse_long(arg, r->min, r->max, &v)) return *(int *)at = (int)v, CLI_OK;
        snprintf(expect, sizeof expect, "an integer %ld..%ld", r->min, r->max);
        break;
    case CLI_ARG_LONG:
        if (!cli_parse_long(arg, r->min, r->max, (long *)at)) return CLI_OK;
        snprintf(expect, sizeof expect, "an integer %ld..%ld", r->min, r->max);
        break;
    case CLI_ARG_U64:
        if (!cli_parse_u64(arg, (uint64_t *)at)) return CLI_OK;
        snprintf(expect, sizeof expect, "a non-negative integer");
        break;
    case CLI_ARG_REAL:
        d = strtod(arg, &end);
        if (end != arg && !*end && d > 0 && d <= (r->real_max > 0 ? r->real_max : 1e30)) /* positive, finite */
            return *(double *)at = d, CLI_OK;
        if (r->real_max > 0) snprintf(expect, sizeof expect, "a number in (0, %g]", r->real_max);
        else snprintf(expect, sizeof expect, "a positive number");
        break;
    case CLI_ARG_CHOICE:
        for (int i = 0; r->choices[i]; i++)
            if (!strcmp(arg, r->choices[i])) return *(int *)at = i, CLI_OK;
        choice_list(r->choices, expect, sizeof expect);
        break;
    case CLI_ARG_CUSTOM: return r->parse(prog, arg, at, base);
    }
    cli_error(prog, "--%s %s: expected %s", r->name, arg, r->expect ? r->expect : expect);
    return CLI_USAGE;
}

/* n texts as the list "options".name ([] when n is 0). */
static void record_texts(cli_meta *meta, const char *name, const char *const *v, int n)
{
    cli_meta_empty_list(meta, "options", name);
    for (int i = 0; i < n; i++) cli_meta_list(meta, "options", name, v[i]);
}

void cli_optrow_record_list(cli_meta *meta, const cli_optrow *row, const void *base)
{
    record_texts(meta, row->name, *(const char *const *const *)((const char *)base + row->offset),
                 *(const int *)((const char *)base + row->aux_offset));
}

void cli_optrow_record_array(cli_meta *meta, const cli_optrow *row, const void *base)
{
    record_texts(meta, row->name, (const char *const *)((const char *)base + row->offset),
                 *(const int *)((const char *)base + row->aux_offset));
}

void cli_optrow_record_specs(cli_meta *meta, const cli_optrow *row, const void *base)
{
    const kvq_spec *v = *(const kvq_spec *const *)((const char *)base + row->offset);
    int n = *(const int *)((const char *)base + row->aux_offset);
    for (int i = 0; i < n; i++) cli_meta_list(meta, "options", row->name, v[i].text);
}

void cli_optrow_record_format(cli_meta *meta, const cli_optrow *row, const void *base)
{
    cli_meta_str(meta, "options", row->name,
                 cli_format_name(*(const kvq_format *)((const char *)base + row->aux_offset)));
}

void cli_optrow_record_shard(cli_meta *meta, const cli_optrow *row, const void *base)
{
    const cli_shard *sh = (const cli_shard *)((const char *)base + row->offset);
    if (sh->n == 0) return; /* none given (kvq-eval's, kvq-alloc's) */
    char text[48];
    snprintf(text, sizeof text, "%ld/%ld", sh->i, sh->n);
    cli_meta_str(meta, "options", row->name, text);
}

void cli_optrow_record_ints(cli_meta *meta, const cli_optrow *row, const void *base)
{
    const int *v = *(const int *const *)((const char *)base + row->offset);
    cli_meta_ints(meta, "options", row->name, v, *(const int *)((const char *)base + row->aux_offset));
}

void cli_optrows_record(cli_meta *meta, const cli_optrow *rows, int n, const void *base, int alt)
{
    for (int i = 0; i < n; i++) {
        const cli_optrow *r = &rows[i];
        const char *at = (const char *)base + r->offset;
        int nullable = r->record & CLI_RECORD_NULL;
        if (!(r->record & (alt ? CLI_RECORD_ALT : CLI_RECORD))) continue;
        if (r->record_fn) {
            r->record_fn(meta, r, base);
            continue;
        }
        switch (r->arg) {
        case CLI_ARG_FLAG: cli_meta_bool(meta, "options", r->name, *(const int *)at); break;
        case CLI_ARG_TEXT:
            if (*(const char *const *)at || nullable) cli_meta_str(meta, "options", r->name, *(const char *const *)at);
            break;
        case CLI_ARG_INT:
            if (nullable) cli_meta_int_set(meta, "options", r->name, *(const int *)at);
            else cli_meta_int(meta, "options", r->name, *(const int *)at);
            break;
        case CLI_ARG_LONG:
            if (nullable) cli_meta_int_set(meta, "options", r->name, *(const long *)at);
            else cli_meta_int(meta, "options", r->name, *(const long *)at);
            break;
        case CLI_ARG_U64: cli_meta_u64(meta, "options", r->name, *(const uint64_t *)at); break;
        case CLI_ARG_REAL: cli_meta_double(meta, "options", r->name, *(const double *)at); break;
        case CLI_ARG_CHOICE: cli_meta_str(meta, "options", r->name, r->choices[*(const int *)at]); break;
        case CLI_ARG_CUSTOM: break; /* recorded through its record_fn */
        }
    }
}

void cli_optrows_usage(FILE *f, const cli_optrow *rows, int n)
{
    enum { COL = 24, WIDTH = 80 };
    for (int i = 0; i < n; i++) {
        const cli_optrow *r = &rows[i];
        if (!r->help) continue; /* the tool describes it */
        char head[64];
        int len = snprintf(head, sizeof head, "--%s%s%s", r->name,
                           r->metavar ? " " : "", r->metavar ? r->metavar : "");
        if (r->key > 0 && r->key < 128) fprintf(f, "  -%c, %s", r->key, head);
        else fprintf(f, "      %s", head);
        int col = 6 + len;
        const char *h = r->help;
        int first = 1;
        while (*h) { /* the help text, wrapped at WIDTH with COL's indent */
            const char *word = h;
            while (*h && *h != ' ') h++;
            int wl = (int)(h - word);
            int need = first ? (col < COL ? COL - col : 2) : 1;
            if (!first && col + need + wl > WIDTH) fprintf(f, "\n%*s", COL, ""), col = COL, need = 0;
            fprintf(f, "%*s%.*s", need, "", wl, word);
            col += need + wl, first = 0;
            while (*h == ' ') h++;
        }
        fputc('\n', f);
    }
}

int cli_optrows_getopt(const cli_getopt_ctx *go, const cli_optrow *rows, int n, const char *shortopts, int argc,
                       char **argv, void *base, int *stop)
{
    struct option *longopts;
    *stop = 0;
    if (optrows_longopts(rows, n, go, &longopts))
        return *stop = 1, cli_error(go->prog, "out of memory"), CLI_RUNTIME;
    int rc = CLI_OK, c;
    while (!rc && (c = cli_getopt(go, argc, argv, shortopts, longopts, &rc)) != -1) {
        if (c == CLI_GETOPT_STOP) {
            *stop = 1;
            break;
        }
        if ((rc = cli_optrow_parse(go->prog, rows, n, c, optarg, base)) == CLI_OPTROW_NONE) rc = CLI_OK;
        if (rc) *stop = 1;
    }
    free(longopts);
    return rc;
}

int cli_optrow_format(const char *prog, const char *arg, void *at, void *base)
{
    (void)base;
    return cli_format_option(prog, arg, (const char **)at);
}

int cli_optrow_progress(const char *prog, const char *arg, void *at, void *base)
{
    (void)base;
    return cli_progress_option(prog, arg, (int *)at);
}

int cli_optrow_shard(const char *prog, const char *arg, void *at, void *base)
{
    cli_shard *sh = at;
    (void)base;
    return cli_shard_option(prog, arg, &sh->i, &sh->n);
}

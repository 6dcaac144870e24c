/* optrows.c — a tool's options as rows (cli_optrow, curl's option table):
 * one row per option makes its getopt entry, its checked parsing (one
 * message per kind of argument), its --help line and its provenance
 * record, so that an option is one row and not four places by hand. */
#include "cli.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

/* The option groups cli_getopt parses for a context that has them, then -h and -V. */
static const struct option model_group[] = {CLI_MODEL_LONGOPTS, {0, 0, 0, 0}};
static const struct option analysis_group[] = {CLI_ANALYSIS_LONGOPTS, {0, 0, 0, 0}};
static const struct option meta_group[] = {CLI_META_LONGOPTS, {0, 0, 0, 0}};
static const struct option help_version[] = {{"help", no_argument, 0, 'h'}, {"version", no_argument, 0, 'V'},
                                             {0, 0, 0, 0}};

int cli_optrows_longopts(const cli_optrow *rows, int n, const cli_getopt_ctx *go, struct option **out)
{
    const struct option *groups[] = {go->model ? model_group : NULL, go->analysis ? analysis_group : NULL,
                                     go->meta ? meta_group : NULL, help_version};
    enum { NGROUPS = sizeof groups / sizeof groups[0] };
    int total = n;
    for (int g = 0; g < NGROUPS; g++)
        for (int i = 0; groups[g] && groups[g][i].name; i++) total++;
    struct option *o = calloc((size_t)total + 1, sizeof *o);
    if (!o) return -1;
    for (int i = 0; i < n; i++)
        o[i] = (struct option){rows[i].name, rows[i].arg == CLI_ARG_FLAG ? no_argument : required_argument, 0,
                               rows[i].key};
    for (int g = 0, k = n; g < NGROUPS; g++)
        for (int i = 0; groups[g] && groups[g][i].name; i++) o[k++] = groups[g][i];
    *out = o;
    return 0;
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

void cli_optrows_record(cli_meta *meta, const cli_optrow *rows, int n, const void *base)
{
    for (int i = 0; i < n; i++) {
        const cli_optrow *r = &rows[i];
        const char *at = (const char *)base + r->offset;
        if (!r->record) continue;
        switch (r->arg) {
        case CLI_ARG_FLAG: cli_meta_bool(meta, "options", r->name, *(const int *)at); break;
        case CLI_ARG_TEXT:
            if (*(const char *const *)at) cli_meta_str(meta, "options", r->name, *(const char *const *)at);
            break;
        case CLI_ARG_INT: cli_meta_int(meta, "options", r->name, *(const int *)at); break;
        case CLI_ARG_LONG: cli_meta_int(meta, "options", r->name, *(const long *)at); break;
        case CLI_ARG_U64: cli_meta_u64(meta, "options", r->name, *(const uint64_t *)at); break;
        case CLI_ARG_REAL: cli_meta_double(meta, "options", r->name, *(const double *)at); break;
        case CLI_ARG_CHOICE: cli_meta_str(meta, "options", r->name, r->choices[*(const int *)at]); break;
        case CLI_ARG_CUSTOM: break;
        }
    }
}

void cli_optrows_usage(FILE *f, const cli_optrow *rows, int n)
{
    enum { COL = 24, WIDTH = 80 };
    for (int i = 0; i < n; i++) {
        const cli_optrow *r = &rows[i];
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
    if (cli_optrows_longopts(rows, n, go, &longopts))
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

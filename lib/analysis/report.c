/* report.c — result rows as CSV, JSON lines or an aligned table (docs/tools.md
 * columns), and the per head / layer / model pooling of an analysis.
 * Writes only to the FILE the caller gives. */
#include "../internal.h"
#include "../quant/quant.h"

#include <math.h>
#include <stddef.h>
#include <stdio.h>
#include <string.h>

/* The metric columns after dump, layer, head, quantizer, spec (docs/tools.md),
 * from kvq_metric_cols.def: the field of kvq_metrics each prints and its flags
 * (KVQ_METRIC_ATTN: empty in CSV, null in JSONL, "-" in the table when the dump
 * has no queries; KVQ_METRIC_TABLE: the table shows it; CSV and JSONL show all). */
typedef struct metric_col {
    const char *name;
    size_t offset; /* of the double in kvq_metrics */
} metric_col;
static const metric_col metric_cols[] = {
#define KVQ_METRIC(column, sums, table, value) {#column, offsetof(kvq_metrics, column)},
#include "../kvq_metric_cols.def"
#undef KVQ_METRIC
};
enum { NMETRIC = sizeof metric_cols / sizeof metric_cols[0] };

static unsigned metric_flags(int i)
{
    const char *name;
    unsigned flags = 0;
    kvq_metric_column(i, &name, &flags);
    return flags;
}

static double metric_value(const kvq_metrics *m, int i)
{
    double v;
    memcpy(&v, (const char *)m + metric_cols[i].offset, sizeof v);
    return v;
}

static int attn_missing(int i, const kvq_metrics *m) { return (metric_flags(i) & KVQ_METRIC_ATTN) && !m->has_attn; }

static int table_ncols(void)
{
    int n = 0;
    for (int i = 0; i < NMETRIC; i++) n += (metric_flags(i) & KVQ_METRIC_TABLE) != 0;
    return n;
}

struct kvq_report {
    FILE *f;
    kvq_format fmt;
    const char *const *extra;
    int nextra;
    int header_done;
    /* table: buffered cells, row-major, ncols per row */
    char **cells;
    size_t ncells, cap;
    int ncols;
    int ntext; /* leading text columns of the table (left-aligned) */
    /* generic rows (kvq_rows_new): caller-named columns */
    const char *const *cols;
};

/* Integer values print as integers (k_bits 10, static_bytes 680), never in
 * exponent form (docs/tools.md). */
static int fmt_integer(char *buf, size_t len, double x)
{
    if (x != floor(x) || fabs(x) >= 1e15) return 0;
    snprintf(buf, len, "%.0f", x);
    return 1;
}

/* The table's 4 significant digits, integers whole. */
static void fmt_table(char *buf, size_t len, double x)
{
    if (!fmt_integer(buf, len, x)) snprintf(buf, len, "%.4g", x);
}

/* Shortest "%.Ng" that reads back to the same double (like Python's repr). */
static void fmt_exact(char *buf, size_t len, double x)
{
    if (isnan(x)) { snprintf(buf, len, "nan"); return; }
    if (isinf(x)) { snprintf(buf, len, x > 0 ? "inf" : "-inf"); return; }
    if (fmt_integer(buf, len, x)) return;
    for (int p = 1; p <= 17; p++) {
        snprintf(buf, len, "%.*g", p, x);
        if (strtod(buf, NULL) == x) return;
    }
}

kvq_report *kvq_report_new(FILE *f, kvq_format fmt, const char *const *extra_cols, int nextra)
{
    kvq_report *r = calloc(1, sizeof *r);
    if (!r) return NULL;
    r->f = f, r->fmt = fmt, r->extra = extra_cols, r->nextra = nextra;
    r->ncols = 5 + table_ncols() + nextra;
    r->ntext = 5;
    return r;
}

static void csv_cell(FILE *f, const char *s)
{
    if (strpbrk(s, ",\"\n")) {
        fputc('"', f);
        for (; *s; s++) {
            if (*s == '"') fputc('"', f);
            fputc(*s, f);
        }
        fputc('"', f);
    } else {
        fputs(s, f);
    }
}

static void json_string(FILE *f, const char *s)
{
    fputc('"', f);
    for (; *s; s++) {
        unsigned char c = (unsigned char)*s;
        if (c == '"' || c == '\\') fprintf(f, "\\%c", c);
        else if (c < 0x20) fprintf(f, "\\u%04x", c);
        else fputc(c, f);
    }
    fputc('"', f);
}

static int table_push(kvq_report *r, const char *s)
{
    if (r->ncells == r->cap) {
        size_t nc = r->cap ? 2 * r->cap : 256;
        char **p = realloc(r->cells, nc * sizeof *p);
        if (!p) return -1;
        r->cells = p, r->cap = nc;
    }
    return (r->cells[r->ncells++] = strdup(s)) ? 0 : -1;
}

static void csv_header(kvq_report *r)
{
    if (r->header_done) return;
    FILE *f = r->f;
    fputs("dump,layer,head,quantizer,spec", f);
    for (int i = 0; i < NMETRIC; i++) fprintf(f, ",%s", metric_cols[i].name);
    for (int i = 0; i < r->nextra; i++) fputc(',', f), csv_cell(f, r->extra[i]);
    fputc('\n', f);
    r->header_done = 1;
}

kvq_status kvq_report_header(kvq_report *r)
{
    if (r->fmt != KVQ_FMT_CSV) return KVQ_OK;
    if (r->cols && !r->header_done) { /* kvq_rows_new's columns */
        for (int i = 0; i < r->ncols; i++) fputs(i ? "," : "", r->f), csv_cell(r->f, r->cols[i]);
        fputc('\n', r->f);
        r->header_done = 1;
    } else csv_header(r);
    return ferror(r->f) ? KVQ_ERR_IO : KVQ_OK;
}

void kvq_report_omit_header(kvq_report *r) { r->header_done = 1; }

/* Is s a whole finite number (written unquoted in JSON)? */
static int is_number(const char *s)
{
    char *end;
    if (!*s || strchr(s, 'x') || strchr(s, 'X') || *s == '+' || *s == '.' || *s == ' ') return 0;
    double v = strtod(s, &end);
    return !*end && isfinite(v) && (s[0] != '0' || s[1] == '\0' || s[1] == '.' || s[1] == 'e' || s[1] == 'E');
}

/* One row; layer/head < 0 print as `all`; extra: nextra cells (may be NULL). */
static kvq_status report_row(kvq_report *r, const char *dump, int layer, int head,
                              const kvq_spec *spec, const char *text, const kvq_metrics *m, const char *const *extra)
{
    char ls[16], hs[16], num[40];
    if (layer < 0) snprintf(ls, sizeof ls, "all"); else snprintf(ls, sizeof ls, "%d", layer);
    if (head < 0) snprintf(hs, sizeof hs, "all"); else snprintf(hs, sizeof hs, "%d", head);
    FILE *f = r->f;

    if (r->fmt == KVQ_FMT_TABLE) {
        if (!r->header_done) {
            const char *h[] = {"dump", "layer", "head", "quantizer", "spec"};
            for (int i = 0; i < 5; i++) if (table_push(r, h[i])) return KVQ_ERR_NOMEM;
            for (int i = 0; i < NMETRIC; i++)
                if ((metric_flags(i) & KVQ_METRIC_TABLE) && table_push(r, metric_cols[i].name)) return KVQ_ERR_NOMEM;
            for (int i = 0; i < r->nextra; i++) if (table_push(r, r->extra[i])) return KVQ_ERR_NOMEM;
            r->header_done = 1;
        }
        const char *c[] = {dump, ls, hs, spec->q->name, text};
        for (int i = 0; i < 5; i++) if (table_push(r, c[i])) return KVQ_ERR_NOMEM;
        for (int k = 0; k < NMETRIC; k++) {
            if (!(metric_flags(k) & KVQ_METRIC_TABLE)) continue;
            if (attn_missing(k, m)) snprintf(num, sizeof num, "-");
            else fmt_table(num, sizeof num, metric_value(m, k));
            if (table_push(r, num)) return KVQ_ERR_NOMEM;
        }
        for (int i = 0; i < r->nextra; i++) if (table_push(r, extra && extra[i] ? extra[i] : "")) return KVQ_ERR_NOMEM;
        return KVQ_OK;
    }

    if (r->fmt == KVQ_FMT_CSV) {
        csv_header(r);
        csv_cell(f, dump);
        fprintf(f, ",%s,%s,", ls, hs);
        csv_cell(f, spec->q->name);
        fputc(',', f);
        csv_cell(f, text);
        for (int i = 0; i < NMETRIC; i++) {
            fputc(',', f);
            if (attn_missing(i, m)) continue; /* empty, not zero */
            fmt_exact(num, sizeof num, metric_value(m, i));
            fputs(num, f);
        }
        for (int i = 0; i < r->nextra; i++) fputc(',', f), csv_cell(f, extra && extra[i] ? extra[i] : "");
        fputc('\n', f);
    } else {
        fputs("{\"dump\":", f);
        json_string(f, dump);
        if (layer < 0) fputs(",\"layer\":\"all\"", f); else fprintf(f, ",\"layer\":%d", layer);
        if (head < 0) fputs(",\"head\":\"all\"", f); else fprintf(f, ",\"head\":%d", head);
        fputs(",\"quantizer\":", f);
        json_string(f, spec->q->name);
        fputs(",\"spec\":", f);
        json_string(f, text);
        for (int i = 0; i < NMETRIC; i++) {
            fprintf(f, ",\"%s\":", metric_cols[i].name);
            /* JSON has no inf/nan: those and absent metrics are null */
            double v = metric_value(m, i);
            if (attn_missing(i, m) || !isfinite(v)) {
                fputs("null", f);
            } else {
                fmt_exact(num, sizeof num, v);
                fputs(num, f);
            }
        }
        for (int i = 0; i < r->nextra; i++) {
            fputc(',', f);
            json_string(f, r->extra[i]);
            fputc(':', f);
            const char *cell = extra && extra[i] ? extra[i] : "";
            if (is_number(cell)) fputs(cell, f); /* grid values: numbers stay numbers */
            else json_string(f, cell);
        }
        fputs("}\n", f);
    }
    return ferror(f) ? KVQ_ERR_IO : KVQ_OK;
}

/* One row to fn: its spec's text (a mix's row of one layer names that layer's spec). */
static kvq_status each_row_call(kvq_row_fn fn, void *ud, int layer, int head, const kvq_spec *spec, const kvq_acc *acc)
{
    kvq_metrics m;
    kvq_spec own;
    const char *text = spec->text;
    if (layer >= 0 && kvq_spec_is_mix(spec) && !kvq_spec_for_layer(spec, layer, &own, NULL)) text = own.text;
    kvq_metrics_finalize(acc, &m);
    return fn(ud, layer, head, spec, text, &m);
}

kvq_status kvq_analysis_each_row(const kvq_analysis *a, const kvq_spec *specs, kvq_per per, kvq_row_fn fn, void *ud)
{
    int nl = a->nlayers, nh = a->nheads, ns = a->nspecs;
    kvq_status st = KVQ_OK;
    if (per == KVQ_PER_HEAD) {
        for (int li = 0; li < nl && !st; li++)
            for (int hi = 0; hi < nh && !st; hi++)
                for (int s = 0; s < ns && !st; s++)
                    st = each_row_call(fn, ud, a->layers[li], a->heads[hi], &specs[s],
                                       &a->acc[((size_t)li * nh + hi) * ns + s]);
        return st;
    }
    /* pooled: sums merged in (layer, head) order */
    int groups = per == KVQ_PER_LAYER ? nl : 1;
    for (int g = 0; g < groups && !st; g++)
        for (int s = 0; s < ns && !st; s++) {
            kvq_acc pooled = {0};
            for (int li = 0; li < nl; li++) {
                if (per == KVQ_PER_LAYER && li != g) continue;
                for (int hi = 0; hi < nh; hi++) kvq_acc_merge(&pooled, &a->acc[((size_t)li * nh + hi) * ns + s]);
            }
            st = each_row_call(fn, ud, per == KVQ_PER_LAYER ? a->layers[g] : -1, -1, &specs[s], &pooled);
        }
    return st;
}

/* kvq_report_analysis's rows: the report, the dump's name and the extra cells. */
typedef struct report_rows {
    kvq_report *r;
    const char *dump;
    const char *const *extra;
} report_rows;

static kvq_status report_each(void *ud, int layer, int head, const kvq_spec *spec, const char *text,
                              const kvq_metrics *m)
{
    const report_rows *rr = ud;
    return report_row(rr->r, rr->dump, layer, head, spec, text, m, rr->extra);
}

kvq_status kvq_report_analysis(kvq_report *r, const char *dump, const kvq_analysis *a,
                               const kvq_spec *specs, kvq_per per, const char *const *extra)
{
    report_rows rr = {r, dump, extra};
    return kvq_analysis_each_row(a, specs, per, report_each, &rr);
}

kvq_report *kvq_rows_new(FILE *f, kvq_format fmt, const char *const *cols, int ncols, int ntext)
{
    kvq_report *r = calloc(1, sizeof *r);
    if (!r) return NULL;
    r->f = f, r->fmt = fmt, r->cols = cols, r->ncols = ncols, r->ntext = ntext;
    return r;
}

kvq_status kvq_rows_add(kvq_report *r, const kvq_cell *cells)
{
    char num[40];
    FILE *f = r->f;
    int nc = r->ncols;
    if (r->fmt == KVQ_FMT_TABLE) {
        for (int i = 0; !r->header_done && i < nc; i++)
            if (table_push(r, r->cols[i])) return KVQ_ERR_NOMEM;
        r->header_done = 1;
        for (int i = 0; i < nc; i++) {
            if (!cells[i].is_num) snprintf(num, sizeof num, "%s", "");
            else if (isnan(cells[i].num)) snprintf(num, sizeof num, "-");
            else fmt_table(num, sizeof num, cells[i].num);
            if (table_push(r, cells[i].is_num ? num : cells[i].text)) return KVQ_ERR_NOMEM;
        }
        return KVQ_OK;
    }
    if (r->fmt == KVQ_FMT_CSV) {
        for (int i = 0; !r->header_done && i < nc; i++) fputs(i ? "," : "", f), csv_cell(f, r->cols[i]);
        if (!r->header_done) fputc('\n', f);
        r->header_done = 1;
        for (int i = 0; i < nc; i++) {
            if (i) fputc(',', f);
            if (!cells[i].is_num) csv_cell(f, cells[i].text);
            else if (!isnan(cells[i].num)) fmt_exact(num, sizeof num, cells[i].num), fputs(num, f);
        }
        fputc('\n', f);
    } else {
        for (int i = 0; i < nc; i++) {
            fputs(i ? "," : "{", f);
            json_string(f, r->cols[i]);
            fputc(':', f);
            if (!cells[i].is_num) json_string(f, cells[i].text);
            else if (!isfinite(cells[i].num)) fputs("null", f);
            else fmt_exact(num, sizeof num, cells[i].num), fputs(num, f);
        }
        fputs("}\n", f);
    }
    return ferror(f) ? KVQ_ERR_IO : KVQ_OK;
}

static void report_free(kvq_report *r)
{
    for (size_t i = 0; i < r->ncells; i++) free(r->cells[i]);
    free(r->cells);
    free(r);
}

void kvq_report_discard(kvq_report *r)
{
    if (r) report_free(r);
}

kvq_status kvq_report_finish(kvq_report *r)
{
    if (!r) return KVQ_OK;
    kvq_status st = KVQ_OK;
    if (r->fmt == KVQ_FMT_TABLE && r->ncells) {
        int nc = r->ncols;
        size_t *w = calloc((size_t)nc, sizeof *w);
        if (!w) {
            st = KVQ_ERR_NOMEM;
        } else {
            for (size_t i = 0; i < r->ncells; i++) {
                size_t l = strlen(r->cells[i]);
                if (l > w[i % nc]) w[i % nc] = l;
            }
            for (size_t i = 0; i < r->ncells; i++) {
                int c = (int)(i % nc);
                /* text columns left-aligned, numbers right-aligned */
                if (c < r->ntext) fprintf(r->f, "%-*s", (int)w[c], r->cells[i]);
                else fprintf(r->f, "%*s", (int)w[c], r->cells[i]);
                fputs(c == nc - 1 ? "\n" : "  ", r->f);
            }
            free(w);
        }
    }
    if (fflush(r->f) != 0 || ferror(r->f)) st = KVQ_ERR_IO;
    report_free(r);
    return st;
}

/* sweep.c — what kvq-sweep needs from the library: the parameter grid (its
 * order, validation and the spec of each point) and the reader of sweep
 * output files (CSV or JSON lines) used by --resume and --merge.
 *
 * Grid order: the cartesian product of the --grid keys in the order given,
 * the last key varying fastest (nested loops, first key outermost); point p
 * is the p-th tuple.  A point's spec names the fixed and grid keys in the
 * quantizer's parameter order, e.g. kivi:bits=2,group=32,residual=64.
 * A tokens(SELECT; HI; LO) template sweeps its selector's keys: the point
 * tokens(snapkv:keep=0.25,obs=32; none; kivi:bits=2) of the template
 * tokens(snapkv; none; kivi:bits=2) (keys written in SELECT are fixed). */
#include "../internal.h"
#include "../quant/quant.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>


/* s, a whole decimal (strtol's syntax) in [lo, hi]; 0, or -1. */
static int parse_range(const char *s, long lo, long hi, long *out)
{
    char *end;
    if (!*s) return -1;
    errno = 0;
    long v = strtol(s, &end, 10);
    if (errno || end == s || *end || v < lo || v > hi) return -1;
    *out = v;
    return 0;
}

int kvq_shard_parse(const char *s, long *i, long *n)
{
    const char *slash = s ? strchr(s, '/') : NULL;
    char head[32];
    if (!slash || (size_t)(slash - s) >= sizeof head) return -1;
    memcpy(head, s, (size_t)(slash - s));
    head[slash - s] = '\0';
    if (parse_range(head, 0, 1000000, i) || parse_range(slash + 1, 1, 1000000, n) || *i >= *n) return -1;
    return 0;
}

/* --------------------------------------------------------------- the grid */

enum { GRID_MAX_POINTS = 100000000 };

struct kvq_grid {
    const kvq_quantizer *q;      /* the family, or a tokens(...) template's selector */
    int tokens;                  /* a tokens(...) template: points are tokens(q:keys TAIL */
    char tail[KVQ_SPEC_MAX];     /* its "; HI; LO)" */
    unsigned flags;              /* KVQ_READ_* tensors every point reads */
    int nkeys;                   /* grid keys, in the order given */
    int param[KVQ_MAX_PARAMS];   /* their index in q->params */
    int nvals[KVQ_MAX_PARAMS];
    char **vals[KVQ_MAX_PARAMS]; /* value texts as given */
    char *fixed[KVQ_MAX_PARAMS]; /* per parameter index: fixed value text or NULL */
    size_t npoints;
};

void kvq_grid_free(kvq_grid *g)
{
    if (!g) return;
    for (int k = 0; k < g->nkeys; k++) {
        for (int i = 0; i < g->nvals[k]; i++) free(g->vals[k][i]);
        free(g->vals[k]);
    }
    for (int i = 0; i < KVQ_MAX_PARAMS; i++) free(g->fixed[i]);
    free(g);
}

/* An option's argument as messages show it: at most 64 characters, so that a
 * long list never pushes the reason out of the message. */
typedef struct {
    char text[96];
} shown_arg;

static shown_arg shorten(const char *arg)
{
    shown_arg s;
    size_t n = strlen(arg);
    if (n <= 64) snprintf(s.text, sizeof s.text, "%s", arg);
    else snprintf(s.text, sizeof s.text, "%.48s...(%zu characters)", arg, n);
    return s;
}

/* "key=..." → index of key in q's parameters; the value part in *rest. */
static kvq_status split_key(const kvq_grid *g, const char *opt, const char *full, char *key, size_t klen,
                            const char **rest, int *param, kvq_error *err)
{
    shown_arg shown = shorten(full);
    const char *arg = shown.text, *eq = strchr(full, '=');
    if (!eq || eq == full || !eq[1])
        return kvq_fail(err, KVQ_ERR_USAGE, "%s %s: expected key=value%s", opt, arg,
                        !strcmp(opt, "--grid") ? "1,value2,..." : "");
    if ((size_t)(eq - full) >= klen) return kvq_fail(err, KVQ_ERR_USAGE, "%s %s: key too long", opt, arg);
    memcpy(key, full, (size_t)(eq - full));
    key[eq - full] = '\0';
    *rest = eq + 1;
    *param = kvq_spec_param_index(g->q, key);
    if (*param < 0) {
        kvq_error e = {0};
        double v;
        kvq_param_parse(g->q, key, "0", &v, &e); /* names the keys */
        return kvq_fail(err, KVQ_ERR_USAGE, "%s %s: %s", opt, arg, e.msg);
    }
    for (int k = 0; k < g->nkeys; k++)
        if (g->param[k] == *param)
            return kvq_fail(err, KVQ_ERR_USAGE, "%s %s: key '%s' is already a --grid key", opt, arg, key);
    if (g->fixed[*param]) return kvq_fail(err, KVQ_ERR_USAGE, "%s %s: key '%s' is already fixed", opt, arg, key);
    return KVQ_OK;
}

/* Adds one --grid key=v1,v2,... */
static kvq_status add_grid(kvq_grid *g, const char *full, kvq_error *err)
{
    char key[64];
    const char *rest;
    int param;
    shown_arg shown = shorten(full);
    const char *arg = shown.text;
    kvq_status st = split_key(g, "--grid", full, key, sizeof key, &rest, &param, err);
    if (st) return st;
    if (g->nkeys == KVQ_MAX_PARAMS) return kvq_fail(err, KVQ_ERR_USAGE, "--grid %s: too many grid keys", arg);
    int k = g->nkeys;
    double parsed[256];
    char *copy = strdup(rest), *save = NULL;
    if (!copy) return kvq_fail(err, KVQ_ERR_NOMEM, "out of memory");
    g->param[k] = param;
    g->nkeys++;
    size_t len = strlen(rest);
    if (rest[len - 1] == ',' || strstr(rest, ",,")) {
        free(copy);
        return kvq_fail(err, KVQ_ERR_USAGE, "--grid %s: empty value in the list", arg);
    }
    for (char *v = strtok_r(copy, ",", &save); v; v = strtok_r(NULL, ",", &save)) {
        int n = g->nvals[k];
        if (n == 256) { st = kvq_fail(err, KVQ_ERR_USAGE, "--grid %s: more than 256 values", arg); break; }
        kvq_error e = {0};
        if (kvq_param_parse(g->q, key, v, &parsed[n], &e)) {
            st = kvq_fail(err, KVQ_ERR_USAGE, "--grid %s: %s", arg, e.msg);
            break;
        }
        for (int i = 0; i < n && !st; i++)
            if (parsed[i] == parsed[n]) st = kvq_fail(err, KVQ_ERR_USAGE, "--grid %s: value '%s' given twice", arg, v);
        if (st) break;
        char **nv = realloc(g->vals[k], (size_t)(n + 1) * sizeof *nv);
        if (!nv || !(nv[n] = strdup(v))) {
            if (nv) g->vals[k] = nv;
            st = kvq_fail(err, KVQ_ERR_NOMEM, "out of memory");
            break;
        }
        g->vals[k] = nv;
        g->nvals[k]++;
    }
    free(copy);
    return st;
}

/* Adds one --fixed key=value[,key=value...] */
static kvq_status add_fixed(kvq_grid *g, const char *arg, kvq_error *err)
{
    char *copy = strdup(arg), *save = NULL;
    kvq_status st = copy ? KVQ_OK : kvq_fail(err, KVQ_ERR_NOMEM, "out of memory");
    if (!st && (!*arg || arg[strlen(arg) - 1] == ',' || strstr(arg, ",,")))
        st = kvq_fail(err, KVQ_ERR_USAGE, "--fixed %s: expected key=value[,key=value...]", arg);
    for (char *item = st ? NULL : strtok_r(copy, ",", &save); item && !st; item = strtok_r(NULL, ",", &save)) {
        char key[64];
        const char *val;
        int param;
        double v;
        kvq_error e = {0};
        if ((st = split_key(g, "--fixed", item, key, sizeof key, &val, &param, err))) break;
        if (kvq_param_parse(g->q, key, val, &v, &e)) {
            st = kvq_fail(err, KVQ_ERR_USAGE, "--fixed %s: %s", item, e.msg);
            break;
        }
        if (!(g->fixed[param] = strdup(val))) st = kvq_fail(err, KVQ_ERR_NOMEM, "out of memory");
    }
    free(copy);
    return st;
}

/* A tokens(SELECT; HI; LO) template: g->q the selector, g->tail "; HI;
 * LO)", keys written in SELECT fixed; HI and LO checked on a probe point
 * (whose read flags every point shares: a selector's and HI's and LO's). */
static kvq_status tokens_template(kvq_grid *g, const char *quant, kvq_error *err)
{
    shown_arg shown = shorten(quant);
    int len = (int)strlen(quant), cut[4], b, e;
    int semi = quant[len - 1] == ')' && kvq_tokens_cut(quant, cut) >= 2 ? cut[1] : -1; /* SELECT's end */
    if (semi < 0 || len - semi >= KVQ_SPEC_MAX)
        return kvq_fail(err, KVQ_ERR_USAGE, "--quant %s: expected tokens(SELECT; HI; LO), SELECT a selector whose "
                        "keys --grid and --fixed give", shown.text);
    kvq_tokens_part(quant, cut, 0, &b, &e);
    char name[64], keys[KVQ_SPEC_MAX] = "";
    int nl = (int)strcspn(quant + b, ":;");
    if (b + nl > e) nl = e - b;
    snprintf(name, sizeof name, "%.*s", nl, quant + b);
    if (!(g->q = kvq_token_selector_find(name)))
        return kvq_fail(err, KVQ_ERR_USAGE, "--quant %s: unknown selector '%s' (known: window, h2o, zipcache, snapkv, "
                        "tova, knorm, random)", shown.text, name);
    if (b + nl < e) snprintf(keys, sizeof keys, "%.*s", e - (b + nl + 1), quant + b + nl + 1);
    snprintf(g->tail, sizeof g->tail, "%s", quant + semi);
    g->tokens = 1;
    kvq_status st = keys[0] ? add_fixed(g, keys, err) : KVQ_OK;
    if (st) return st;
    char probe[2 * KVQ_SPEC_MAX];
    snprintf(probe, sizeof probe, "tokens(%s:%s%s", g->q->name,
             kvq_token_selector_kind(g->q) == KVQ_SEL_WINDOW ? "sinks=1" : "keep=1", g->tail);
    kvq_spec sp;
    kvq_error e2 = {0};
    if ((st = kvq_spec_parse(probe, &sp, &e2))) {
        const char *why = strstr(e2.msg, "): "); /* the probe's text left out: HI's or LO's reason */
        return kvq_fail(err, st, "--quant %s: %s", shown.text, why ? why + 3 : e2.msg);
    }
    g->flags = kvq_spec_read_flags(&sp);
    return KVQ_OK;
}

kvq_status kvq_grid_new(const char *quant, const char *const *grids, int ngrids,
                        const char *const *fixed, int nfixed, kvq_grid **out, kvq_error *err)
{
    *out = NULL;
    int tokens = quant && !strncmp(quant, "tokens(", 7);
    const kvq_quantizer *q = tokens ? NULL : kvq_quantizer_find(quant ? quant : "");
    if (!q && !tokens) {
        char names[512];
        size_t o = 0;
        for (size_t i = 0; i < kvq_quantizer_count() && o < sizeof names; i++)
            o += (size_t)snprintf(names + o, sizeof names - o, "%s%s", i ? ", " : "", kvq_quantizer_at(i)->name);
        return kvq_fail(err, KVQ_ERR_USAGE, "--quant %s: unknown quantizer (known: %s; or a tokens(SELECT; HI; LO) "
                        "template)", quant ? quant : "", names);
    }
    kvq_grid *g = calloc(1, sizeof *g);
    if (!g) return kvq_fail(err, KVQ_ERR_NOMEM, "out of memory");
    g->q = q;
    kvq_status st = tokens ? tokens_template(g, quant, err) : KVQ_OK;
    if (!tokens) g->flags = kvq_quantizer_read_flags(q);
    for (int i = 0; i < nfixed && !st; i++) st = add_fixed(g, fixed[i], err);
    for (int i = 0; i < ngrids && !st; i++) st = add_grid(g, grids[i], err);
    g->npoints = 1;
    for (int k = 0; k < g->nkeys && !st; k++) {
        g->npoints *= (size_t)g->nvals[k];
        if (g->npoints > GRID_MAX_POINTS)
            st = kvq_fail(err, KVQ_ERR_USAGE, "the grid has more than %d points", GRID_MAX_POINTS);
    }
    if (st) {
        kvq_grid_free(g);
        return st;
    }
    *out = g;
    return KVQ_OK;
}

size_t kvq_grid_size(const kvq_grid *g) { return g->npoints; }
int kvq_grid_nkeys(const kvq_grid *g) { return g->nkeys; }
const kvq_quantizer *kvq_grid_quantizer(const kvq_grid *g) { return g->q; }
unsigned kvq_grid_read_flags(const kvq_grid *g) { return g->flags; }
const char *kvq_grid_key(const kvq_grid *g, int k) { return g->q->params[g->param[k]].key; }

/* Index of grid key k's value at point p (last key fastest). */
static int value_index(const kvq_grid *g, size_t p, int k)
{
    for (int j = g->nkeys - 1; j > k; j--) p /= (size_t)g->nvals[j];
    return (int)(p % (size_t)g->nvals[k]);
}

const char *kvq_grid_value(const kvq_grid *g, size_t p, int k)
{
    return g->vals[k][value_index(g, p, k)];
}

kvq_status kvq_grid_spec(const kvq_grid *g, size_t p, kvq_spec *out, kvq_error *err)
{
    char text[2 * KVQ_SPEC_MAX];
    size_t o = (size_t)snprintf(text, sizeof text, "%s%s", g->tokens ? "tokens(" : "", g->q->name), o0 = o;
    for (int i = 0; i < g->q->nparams && o < sizeof text; i++) {
        const char *v = g->fixed[i];
        for (int k = 0; k < g->nkeys && !v; k++)
            if (g->param[k] == i) v = kvq_grid_value(g, p, k);
        if (v) o += (size_t)snprintf(text + o, sizeof text - o, "%c%s=%s", o == o0 ? ':' : ',', g->q->params[i].key, v);
    }
    if (g->tokens && o < sizeof text) snprintf(text + o, sizeof text - o, "%s", g->tail);
    return kvq_spec_parse(text, out, err);
}

/* ------------------------------------------------- sweep output files */

void kvq_sweep_file_free(kvq_sweep_file *f)
{
    if (!f) return;
    for (size_t i = 0; i < f->nunits; i++) free(f->units[i].spec);
    free(f->units), free(f->columns), free(f->data);
    memset(f, 0, sizeof *f);
}

/* Appends s[0..n) to a growing string. */
static int str_add(char **buf, size_t *len, size_t *cap, const char *s, size_t n)
{
    if (*len + n + 1 > *cap) {
        size_t nc = (*cap ? *cap * 2 : 256) + n;
        char *p = realloc(*buf, nc);
        if (!p) return -1;
        *buf = p, *cap = nc;
    }
    memcpy(*buf + *len, s, n);
    *len += n;
    (*buf)[*len] = '\0';
    return 0;
}

/* One CSV line [s, e): field i unquoted into `cells` (joined by '\0'),
 * the count in *nf.  -1 on a malformed quote. */
static int csv_split(const char *s, const char *e, char **cells, size_t *clen, size_t *ccap,
                     const char **starts, int maxf, int *nf)
{
    *clen = 0, *nf = 0;
    size_t offs[512];
    for (;;) {
        if (*nf < maxf && *nf < 512) offs[*nf] = *clen;
        (*nf)++;
        if (s < e && *s == '"') {
            for (s++;; s++) {
                if (s >= e) return -1;
                if (*s == '"') {
                    if (s + 1 < e && s[1] == '"') { if (str_add(cells, clen, ccap, "\"", 1)) return -1; s++; continue; }
                    s++;
                    break;
                }
                if (str_add(cells, clen, ccap, s, 1)) return -1;
            }
            if (s < e && *s != ',') return -1;
        } else {
            const char *c = s < e ? memchr(s, ',', (size_t)(e - s)) : NULL; /* s <= e here: said for the compiler */
            const char *f = c ? c : e;
            if (memchr(s, '"', (size_t)(f - s))) return -1;
            if (str_add(cells, clen, ccap, s, (size_t)(f - s))) return -1;
            s = f;
        }
        if (str_add(cells, clen, ccap, "", 1)) return -1; /* the '\0' ending the cell */
        if (s >= e) break;
        s++; /* the comma */
    }
    for (int i = 0; i < *nf && i < maxf && i < 512; i++) starts[i] = *cells + offs[i];
    return 0;
}

/* A JSON string at *s (after the opening quote) decoded into out (max len);
 * *s moves past the closing quote.  -1 if malformed. */
static int json_str(const char **s, const char *e, char *out, size_t len)
{
    size_t o = 0;
    for (const char *p = *s; p < e; p++) {
        char c = *p;
        if (c == '"') {
            out[o] = '\0'; /* o < len: the copy below stops at len - 1 */
            *s = p + 1;
            return 0;
        }
        if (c == '\\') {
            if (++p >= e) return -1;
            switch (*p) {
            case 'n': c = '\n'; break;
            case 't': c = '\t'; break;
            case 'r': c = '\r'; break;
            case 'b': c = '\b'; break;
            case 'f': c = '\f'; break;
            case 'u': {
                unsigned v = 0;
                for (int i = 0; i < 4; i++) {
                    if (++p >= e) return -1;
                    char h = *p;
                    v = v * 16 + (unsigned)(h >= '0' && h <= '9' ? h - '0' : h >= 'a' && h <= 'f' ? h - 'a' + 10
                                            : h >= 'A' && h <= 'F' ? h - 'A' + 10 : 99);
                    if (v > 0xffff) return -1;
                }
                c = v < 0x80 ? (char)v : '?';
                break;
            }
            default: c = *p; /* \" \\ \/ */
            }
        }
        if (o + 1 < len) out[o++] = c;
    }
    return -1;
}

/* One JSON-lines row [s, e): its keys joined by ',' into keys, the `spec`
 * string and the `point` value text.  -1 if it is not a flat object. */
static int json_row(const char *s, const char *e, char **keys, size_t *klen, size_t *kcap, char *spec,
                    size_t slen, char *point, size_t plen)
{
    *klen = 0;
    spec[0] = point[0] = '\0';
    if (str_add(keys, klen, kcap, "", 0)) return -1;
    if (s >= e || *s++ != '{') return -1;
    for (int first = 1;; first = 0) {
        if (s < e && *s == '}' && first) return s + 1 == e ? 0 : -1;
        char key[128], val[KVQ_SPEC_MAX];
        if (s >= e || *s++ != '"' || json_str(&s, e, key, sizeof key)) return -1;
        if (s >= e || *s++ != ':') return -1;
        if (s < e && *s == '"') {
            s++;
            if (json_str(&s, e, val, sizeof val)) return -1;
        } else {
            const char *t = s;
            while (s < e && *s != ',' && *s != '}') s++;
            if (s == t || (size_t)(s - t) >= sizeof val) return -1;
            memcpy(val, t, (size_t)(s - t));
            val[s - t] = '\0';
        }
        if (str_add(keys, klen, kcap, ",", first ? 0 : 1) || str_add(keys, klen, kcap, key, strlen(key))) return -1;
        if (!strcmp(key, "spec")) snprintf(spec, slen, "%s", val);
        if (!strcmp(key, "point")) snprintf(point, plen, "%s", val);
        if (s >= e) return -1;
        if (*s == '}') return s + 1 == e ? 0 : -1;
        if (*s++ != ',') return -1;
    }
}

static int parse_point(const char *text, long *out)
{
    char *end;
    errno = 0;
    long v = strtol(text, &end, 10);
    if (errno || end == text || *end || v < 0 || text[0] == '+' || text[0] == ' ') return -1;
    *out = v;
    return 0;
}

/* Adds a row of point `pt` at [b, e) to the units (a new unit when the
 * point changes). */
static kvq_status add_row(kvq_sweep_file *f, const char *path, size_t line, long pt, const char *spec,
                          size_t b, size_t e, size_t *cap, kvq_error *err)
{
    kvq_sweep_unit *u = f->nunits ? &f->units[f->nunits - 1] : NULL;
    if (u && u->point == pt) {
        if (strcmp(u->spec, spec))
            return kvq_fail(err, KVQ_ERR_FORMAT, "%s: line %zu: point %ld has spec '%s', earlier rows '%s'", path, line,
                            pt, spec, u->spec);
        u->nrows++;
        u->end = e;
        return KVQ_OK;
    }
    if (f->nunits == *cap) {
        size_t nc = *cap ? 2 * *cap : 64;
        kvq_sweep_unit *p = realloc(f->units, nc * sizeof *p);
        if (!p) return kvq_fail(err, KVQ_ERR_NOMEM, "out of memory");
        f->units = p, *cap = nc;
    }
    u = &f->units[f->nunits];
    if (!(u->spec = strdup(spec))) return kvq_fail(err, KVQ_ERR_NOMEM, "out of memory");
    u->point = pt, u->nrows = 1, u->begin = b, u->end = e;
    f->nunits++;
    return KVQ_OK;
}

/* The whole file into f->data (f->size bytes), checked free of NUL bytes; its
 * format told by its first byte. */
static kvq_status read_whole(const char *path, kvq_sweep_file *f, kvq_error *err)
{
    f->fmt = KVQ_FMT_CSV;
    FILE *fp = fopen(path, "rb");
    if (!fp) return kvq_fail(err, KVQ_ERR_IO, "%s: cannot open: %s", path, strerror(errno));
    size_t cap = 0, n;
    char chunk[65536];
    kvq_status st = KVQ_OK;
    while ((n = fread(chunk, 1, sizeof chunk, fp)) > 0)
        if (str_add(&f->data, &f->size, &cap, chunk, n)) {
            st = kvq_fail(err, KVQ_ERR_NOMEM, "%s: out of memory", path);
            break;
        }
    if (!st && ferror(fp)) st = kvq_fail(err, KVQ_ERR_IO, "%s: read failed", path);
    fclose(fp);
    if (!st && f->size && memchr(f->data, '\0', f->size))
        st = kvq_fail(err, KVQ_ERR_FORMAT, "%s: contains NUL bytes: not a kvq-sweep output", path);
    if (!st && f->size && f->data[0] == '{') f->fmt = KVQ_FMT_JSONL;
    return st;
}

kvq_status kvq_sweep_file_read(const char *path, kvq_sweep_file *f, kvq_error *err)
{
    memset(f, 0, sizeof *f);
    kvq_status st = read_whole(path, f, err);
    if (st) {
        kvq_sweep_file_free(f);
        return st;
    }
    char *cells = NULL, *keys = NULL;
    size_t clen = 0, ccap = 0, klen = 0, kcap = 0, ucap = 0, line = 0;
    int spec_col = -1, point_col = -1, ncols = 0;
    const char *d = f->data;
    size_t pos = 0;
    while (!st && pos < f->size) {
        const char *nl = memchr(d + pos, '\n', f->size - pos);
        if (!nl) { /* an interrupted write: not a row */
            f->partial = 1;
            break;
        }
        size_t b = pos, e = (size_t)(nl - d);
        pos = e + 1;
        line++;
        char spec[KVQ_SPEC_MAX], point[KVQ_SPEC_MAX];
        if (f->fmt == KVQ_FMT_CSV) {
            const char *c[512];
            int nf;
            if (csv_split(d + b, d + e, &cells, &clen, &ccap, c, 512, &nf)) {
                st = kvq_fail(err, KVQ_ERR_FORMAT, "%s: line %zu: malformed CSV quoting", path, line);
                break;
            }
            if (line == 1) { /* the header */
                ncols = nf;
                for (int i = 0; i < nf && i < 512; i++) {
                    if (!strcmp(c[i], "spec")) spec_col = i;
                    if (!strcmp(c[i], "point")) point_col = i;
                }
                if (spec_col < 0 || point_col < 0) {
                    st = kvq_fail(
                        err, KVQ_ERR_FORMAT,
                        "%s: line 1: expected a header with 'spec' and 'point' columns: not a kvq-sweep output", path);
                    break;
                }
                if (!(f->columns = strndup(d + b, e - b))) st = kvq_fail(err, KVQ_ERR_NOMEM, "out of memory");
                f->body = pos;
                f->end = pos;
                continue;
            }
            if (nf != ncols) {
                st = kvq_fail(err, KVQ_ERR_FORMAT, "%s: line %zu: expected %d fields like the header, got %d", path,
                              line, ncols, nf);
                break;
            }
            snprintf(spec, sizeof spec, "%s", c[spec_col]);
            snprintf(point, sizeof point, "%s", c[point_col]);
        } else {
            if (json_row(d + b, d + e, &keys, &klen, &kcap, spec, sizeof spec, point, sizeof point)) {
                st = kvq_fail(err, KVQ_ERR_FORMAT, "%s: line %zu: expected one flat JSON object", path, line);
                break;
            }
            if (!f->columns && !(f->columns = strdup(keys))) {
                st = kvq_fail(err, KVQ_ERR_NOMEM, "out of memory");
                break;
            }
            if (strcmp(keys, f->columns)) {
                st = kvq_fail(err, KVQ_ERR_FORMAT, "%s: line %zu: keys differ from line 1's", path, line);
                break;
            }
        }
        long pt;
        if (parse_point(point, &pt)) {
            st = kvq_fail(err, KVQ_ERR_FORMAT, "%s: line %zu: point '%s': expected a non-negative integer", path, line,
                          point);
            break;
        }
        if (!spec[0]) {
            st = kvq_fail(err, KVQ_ERR_FORMAT, "%s: line %zu: empty or missing 'spec'", path, line);
            break;
        }
        st = add_row(f, path, line, pt, spec, b, pos, &ucap, err);
        f->end = pos;
    }
    free(cells), free(keys);
    if (st) kvq_sweep_file_free(f);
    return st;
}

/* ------------------------------------------- a sweep's points and its OUT */

void kvq_sweep_select(const kvq_grid *g, long shard_i, long shard_n, unsigned char *state, size_t *nrun,
                      size_t *ninvalid)
{
    size_t npoints = kvq_grid_size(g);
    *nrun = *ninvalid = 0;
    for (size_t p = 0; p < npoints; p++) {
        state[p] = KVQ_POINT_OTHER;
        if ((long)(p % (size_t)shard_n) != shard_i) continue;
        kvq_spec sp;
        kvq_error e = {0};
        if (kvq_grid_spec(g, p, &sp, &e)) state[p] = KVQ_POINT_INVALID, (*ninvalid)++;
        else state[p] = KVQ_POINT_RUN, (*nrun)++;
    }
}

kvq_status kvq_sweep_reconcile(const char *path, const kvq_sweep_file *old, const kvq_grid *g, unsigned char *state,
                               size_t rows_per_point, size_t *keep, size_t *ncomplete, kvq_error *err)
{
    size_t npoints = kvq_grid_size(g);
    *keep = old->columns ? old->body : 0, *ncomplete = 0;
    for (size_t k = 0; k < old->nunits; k++) {
        const kvq_sweep_unit *u = &old->units[k];
        kvq_spec sp;
        kvq_error e = {0};
        int ours = u->point >= 0 && (size_t)u->point < npoints && state[u->point] == KVQ_POINT_RUN &&
                   kvq_grid_spec(g, (size_t)u->point, &sp, &e) == KVQ_OK && !strcmp(sp.text, u->spec);
        if (!ours)
            return kvq_fail(err, KVQ_ERR_FORMAT,
                            "%s: point %ld (%s) is not a pending point of this sweep and shard (another grid, "
                            "shard or a duplicate?)",
                            path, u->point, u->spec);
        if (u->nrows != rows_per_point) {
            if (k + 1 == old->nunits && u->nrows < rows_per_point) break; /* interrupted: run it again */
            return kvq_fail(err, KVQ_ERR_FORMAT,
                            "%s: point %ld has %zu rows, this sweep writes %zu per point (other dumps, --layers, "
                            "--heads or --per?)",
                            path, u->point, u->nrows, rows_per_point);
        }
        state[u->point] = KVQ_POINT_DONE, (*ncomplete)++;
        *keep = u->end;
    }
    return KVQ_OK;
}

/* ------------------------------------------------- a point's rows, as text */

/* A report of the grid's columns into a memory stream: kvq-analyze's, one
 * per grid key, then `point` (cols: nkeys + 1 entries of room). */
static kvq_report *grid_report(const kvq_grid *g, kvq_format fmt, FILE *ms, const char **cols)
{
    int nk = kvq_grid_nkeys(g);
    for (int k = 0; k < nk; k++) cols[k] = kvq_grid_key(g, k);
    cols[nk] = "point";
    return kvq_report_new(ms, fmt, cols, nk + 1);
}

kvq_status kvq_sweep_header(const kvq_grid *g, char **text, size_t *len)
{
    *text = NULL, *len = 0;
    const char **cols = calloc((size_t)kvq_grid_nkeys(g) + 1, sizeof *cols);
    FILE *ms = cols ? open_memstream(text, len) : NULL;
    kvq_report *rep = ms ? grid_report(g, KVQ_FMT_CSV, ms, cols) : NULL;
    kvq_status st = rep ? kvq_report_header(rep) : KVQ_ERR_NOMEM;
    if (rep && kvq_report_finish(rep) && !st) st = KVQ_ERR_NOMEM;
    if (ms && fclose(ms) && !st) st = KVQ_ERR_NOMEM;
    free(cols);
    if (!st && *len) (*text)[--*len] = '\0'; /* the columns, without the newline */
    if (st) free(*text), *text = NULL, *len = 0;
    return st;
}

/* Spec s of a as an analysis of its own: a's layers and heads (shared, not
 * to be freed) and a copy of its accumulators. */
static kvq_status spec_view(const kvq_analysis *a, int s, kvq_analysis *one)
{
    size_t nc = (size_t)a->nlayers * a->nheads;
    *one = *a;
    one->nspecs = 1;
    if (!(one->acc = kvq_alloc_array(nc ? nc : 1, sizeof *one->acc))) return KVQ_ERR_NOMEM;
    for (size_t c = 0; c < nc; c++) one->acc[c] = a->acc[c * a->nspecs + s];
    return KVQ_OK;
}

/* A point's text as it is made: its report on a memory stream. */
typedef struct {
    FILE *ms;
    kvq_report *rep;
    const char **cols, **extra; /* the grid's keys and `point`; the point's values */
    char pt[32];
} point_text;

kvq_status kvq_sweep_points_rows(const kvq_grid *g, const size_t *pts, int n, const kvq_sweep_dump *dumps, int ndumps,
                                 const kvq_analysis_opts *o, kvq_per per, kvq_format fmt, char **texts, size_t *lens,
                                 kvq_error *err)
{
    int nk = kvq_grid_nkeys(g);
    kvq_status st = KVQ_OK;
    for (int i = 0; i < n; i++) texts[i] = NULL, lens[i] = 0;
    kvq_spec *specs = kvq_alloc_array((size_t)n, sizeof *specs);
    point_text *pt = calloc((size_t)n, sizeof *pt);
    if (!specs || !pt) {
        st = kvq_fail(err, KVQ_ERR_NOMEM, "out of memory");
        goto out;
    }
    for (int i = 0; i < n && !st; i++) {
        if ((st = kvq_grid_spec(g, pts[i], &specs[i], err))) break;
        pt[i].cols = calloc((size_t)nk + 1, sizeof *pt[i].cols);
        pt[i].extra = calloc((size_t)nk + 1, sizeof *pt[i].extra);
        pt[i].ms = pt[i].cols && pt[i].extra ? open_memstream(&texts[i], &lens[i]) : NULL;
        if (!(pt[i].rep = pt[i].ms ? grid_report(g, fmt, pt[i].ms, pt[i].cols) : NULL)) {
            st = kvq_fail(err, KVQ_ERR_NOMEM, "out of memory");
            break;
        }
        kvq_report_omit_header(pt[i].rep);
        for (int k = 0; k < nk; k++) pt[i].extra[k] = kvq_grid_value(g, pts[i], k);
        snprintf(pt[i].pt, sizeof pt[i].pt, "%zu", pts[i]);
        pt[i].extra[nk] = pt[i].pt;
    }
    kvq_analysis_opts ao = *o;
    ao.specs = specs, ao.nspecs = n;
    for (int d = 0; d < ndumps && !st; d++) {
        kvq_analysis a;
        st = dumps[d].prep ? kvq_analyze_prepared(dumps[d].prep, &ao, &a, err)
                           : kvq_analyze_dump(dumps[d].dump, &ao, &a, err);
        if (st) break;
        for (int i = 0; i < n && !st; i++) { /* each point's rows, as its own analysis gives them */
            kvq_analysis one;
            if (!(st = spec_view(&a, i, &one))) {
                st = kvq_report_analysis(pt[i].rep, dumps[d].name, &one, &specs[i], per, pt[i].extra);
                free(one.acc);
            }
            if (st) st = kvq_fail(err, st, "%s", kvq_strerror(st));
        }
        kvq_analysis_free(&a);
    }
out:
    for (int i = 0; pt && i < n; i++) {
        if (pt[i].rep && st)
            kvq_report_discard(pt[i].rep);
        else if (pt[i].rep && kvq_report_finish(pt[i].rep))
            st = kvq_fail(err, KVQ_ERR_NOMEM, "out of memory");
        if (pt[i].ms && fclose(pt[i].ms) && !st) st = kvq_fail(err, KVQ_ERR_NOMEM, "out of memory");
        free(pt[i].cols), free(pt[i].extra);
    }
    for (int i = 0; st && i < n; i++) free(texts[i]), texts[i] = NULL, lens[i] = 0;
    free(specs), free(pt);
    return st;
}

kvq_status kvq_sweep_point_rows(const kvq_grid *g, size_t p, const kvq_sweep_dump *dumps, int ndumps,
                                const kvq_analysis_opts *o, kvq_per per, kvq_format fmt, char **text, size_t *len,
                                kvq_error *err)
{
    return kvq_sweep_points_rows(g, &p, 1, dumps, ndumps, o, per, fmt, text, len, err);
}

/* The slots of a batch's whole-layer specs stay within this. */
#define SWEEP_BATCH_BYTES ((double)(1u << 30))

int kvq_sweep_batch(const kvq_sweep_dump *dumps, int ndumps, const kvq_analysis_opts *o)
{
    if (o->device) return 1;
    int heads = 1;
    double slot = 0; /* the largest layer's K' and V' */
    for (int d = 0; d < ndumps; d++) {
        const kvq_dump_info *info = kvq_dump_get_info(dumps[d].dump);
        int h = o->heads ? o->nheads : info->num_kv_heads;
        double bytes = 2.0 * 4.0 * info->num_kv_heads * (double)info->seq_len * info->head_dim;
        if (h > heads) heads = h;
        if (bytes > slot) slot = bytes;
    }
    int b = kvq_threads(o->nthreads) / heads;
    if (slot > 0 && b > SWEEP_BATCH_BYTES / slot) b = (int)(SWEEP_BATCH_BYTES / slot);
    return b < 1 ? 1 : b;
}

/* spec.c — spec strings `name:key=value,...` (docs/quantizers.md): parsed against the
 * registry's table, defaults filled in, cross-key and shape checks; and
 * `mix(RANGE=SPEC;...)`, a spec per layer range (docs/quantizers.md#mix). */
#include "../internal.h"
#include "quant.h"

#include <limits.h>
#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

/* The pseudo-family of mixes: no keys of its own; kvq_quantize_layer,
 * the calibration and the reports resolve the layer's spec first. */
static const kvq_quantizer kvq_q_mix = {
    .name = "mix",
    .description = "per-layer specs: mix(RANGE=SPEC;...), e.g. mix(0-1=kivi:kbits=4,vbits=2;2-=kivi:bits=2)",
    .is_mix = 1,
};

/* ------------------------------------------------------------------ mix */

enum { MIX_MAX_ITEMS = 256, MIX_MAX_SPANS = 1024 };

/* One range element: layers lo..hi (hi = INT_MAX: to the last layer), of item `item`. */
typedef struct mix_span {
    int lo, hi, item;
} mix_span;

/* A mix's items as offsets into its text: range [r0, r1), spec [s0, s1). */
typedef struct mix_item {
    int r0, r1, s0, s1;
} mix_item;

typedef struct mix {
    int nitems, nspans;
    mix_item item[MIX_MAX_ITEMS];
    mix_span span[MIX_MAX_SPANS];
} mix;

static int parse_layer(const char *p, const char *end, int *out)
{
    if (p == end || *p < '0' || *p > '9') return -1;
    long v = 0;
    for (; p < end; p++) {
        if (*p < '0' || *p > '9') return -1;
        v = v * 10 + (*p - '0');
        if (v > 1000000) return -1;
    }
    *out = (int)v;
    return 0;
}

static void span_text(const mix_span *s, char *buf, size_t len)
{
    if (s->hi == INT_MAX) snprintf(buf, len, "%d-", s->lo);
    else if (s->hi == s->lo) snprintf(buf, len, "%d", s->lo);
    else snprintf(buf, len, "%d-%d", s->lo, s->hi);
}

/* Splits text = "mix(ITEM;ITEM;...)" into items and their spans; syntax and
 * overlaps only (the specs are parsed by the caller). */
static kvq_status mix_split(const char *text, mix *m, kvq_error *err)
{
    size_t len = strlen(text);
    m->nitems = m->nspans = 0;
    if (len < 6 || text[len - 1] != ')')
        return kvq_fail(err, KVQ_ERR_USAGE, "%s: expected mix(RANGE=SPEC;RANGE=SPEC;...)", text);
    int pos = 4, end = (int)len - 1;
    while (pos <= end) {
        int stop = pos, depth = 0; /* a tokens(...) item holds ';' of its own */
        for (; stop < end && (depth || text[stop] != ';'); stop++) depth += (text[stop] == '(') - (text[stop] == ')');
        const char *eq = memchr(text + pos, '=', (size_t)(stop - pos));
        if (stop == pos || !eq || eq == text + pos || eq + 1 == text + stop)
            return kvq_fail(err, KVQ_ERR_USAGE, "%s: '%.*s': expected RANGE=SPEC (e.g. 0-3=kivi:bits=2)", text,
                            stop - pos, text + pos);
        if (m->nitems == MIX_MAX_ITEMS)
            return kvq_fail(err, KVQ_ERR_USAGE, "%s: more than %d ranges", text, MIX_MAX_ITEMS);
        mix_item *it = &m->item[m->nitems];
        *it = (mix_item){pos, (int)(eq - text), (int)(eq - text) + 1, stop};
        /* the range: comma-separated a, a-b, a- (no empty element: "0-4," is refused) */
        if (text[it->r1 - 1] == ',')
            return kvq_fail(err, KVQ_ERR_USAGE, "%s: range '%.*s': expected layers as a, a-b, a- or a,b", text,
                            it->r1 - it->r0, text + it->r0);
        for (int a = it->r0; a < it->r1;) {
            int b = a;
            while (b < it->r1 && text[b] != ',') b++;
            const char *dash = memchr(text + a, '-', (size_t)(b - a));
            mix_span sp = {.item = m->nitems};
            int bad = dash ? parse_layer(text + a, dash, &sp.lo) ||
                                 (dash + 1 == text + b ? (sp.hi = INT_MAX, 0) : parse_layer(dash + 1, text + b, &sp.hi))
                           : parse_layer(text + a, text + b, &sp.lo);
            if (!dash) sp.hi = sp.lo;
            if (bad || sp.hi < sp.lo)
                return kvq_fail(err, KVQ_ERR_USAGE, "%s: range '%.*s': expected layers as a, a-b, a- or a,b", text,
                                it->r1 - it->r0, text + it->r0);
            if (m->nspans == MIX_MAX_SPANS)
                return kvq_fail(err, KVQ_ERR_USAGE, "%s: more than %d range elements", text, MIX_MAX_SPANS);
            for (int i = 0; i < m->nspans; i++) {
                const mix_span *o = &m->span[i];
                if (sp.lo <= o->hi && o->lo <= sp.hi) {
                    char x[32], y[32];
                    span_text(o, x, sizeof x), span_text(&sp, y, sizeof y);
                    return kvq_fail(err, KVQ_ERR_USAGE, "%s: layer %d is in two ranges (%s and %s)", text,
                                    sp.lo > o->lo ? sp.lo : o->lo, x, y);
                }
            }
            m->span[m->nspans++] = sp;
            a = b + 1;
        }
        m->nitems++;
        pos = stop + 1;
    }
    return KVQ_OK;
}

static kvq_status mix_item_spec(const char *text, const mix_item *it, kvq_spec *out, kvq_error *err)
{
    char sub[KVQ_SPEC_MAX];
    snprintf(sub, sizeof sub, "%.*s", it->s1 - it->s0, text + it->s0);
    if (!strncmp(sub, "mix(", 4)) return kvq_fail(err, KVQ_ERR_USAGE, "%s: a mix inside a mix", text);
    kvq_error e = {0};
    kvq_status st = kvq_spec_parse(sub, out, &e);
    if (st) return kvq_fail(err, st, "%s: range %.*s: %s", text, it->r1 - it->r0, text + it->r0, e.msg);
    return KVQ_OK;
}

/* --------------------------------- composite specs, taken apart once */

static kvq_status tokens_split(const char *text, kvq_tokens_parts *out, kvq_error *err);

/* A mix(...) or tokens(...) text taken apart: its items and spans and each
 * item's spec, or its SELECT, HI and LO.  Kept for the process (composite_of),
 * so that specs stay plain values, copied freely with their text as the key,
 * and every later use (each layer of each dump, the calibration, the report,
 * each DecodeCache.update) finds the parts instead of splitting the text
 * again.  A text that does not parse keeps its refusal. */
typedef struct composite {
    struct composite *next;
    kvq_status status;
    kvq_error err;          /* the refusal, when status is not KVQ_OK */
    mix *m;                 /* a mix: its items and spans; NULL for tokens(...) */
    kvq_spec *items;        /* a mix: [m->nitems] its items, parsed */
    kvq_tokens_parts parts; /* a tokens(...) */
    char text[KVQ_SPEC_MAX];
} composite;

enum { COMPOSITE_BUCKETS = 256 };
static pthread_mutex_t composite_lock = PTHREAD_MUTEX_INITIALIZER;
static composite *composites[COMPOSITE_BUCKETS];
static unsigned long composite_splits;

unsigned long kvq_spec_splits(void)
{
    pthread_mutex_lock(&composite_lock);
    unsigned long n = composite_splits;
    pthread_mutex_unlock(&composite_lock);
    return n;
}

static composite *composite_find(const char *text, unsigned bucket)
{
    composite *c = composites[bucket];
    while (c && strcmp(c->text, text)) c = c->next;
    return c;
}

/* c->text as a mix: split (the one call of mix_split), then each item parsed. */
static kvq_status mix_take_apart(composite *c)
{
    if (!(c->m = malloc(sizeof *c->m))) return kvq_fail(&c->err, KVQ_ERR_NOMEM, "out of memory");
    kvq_status st = mix_split(c->text, c->m, &c->err);
    if (!st && !(c->items = calloc((size_t)c->m->nitems, sizeof *c->items)))
        st = kvq_fail(&c->err, KVQ_ERR_NOMEM, "out of memory");
    for (int i = 0; !st && i < c->m->nitems; i++) st = mix_item_spec(c->text, &c->m->item[i], &c->items[i], &c->err);
    return st;
}

/* The parts of the composite spec `text` (mix(...) or tokens(...)), taken
 * apart on its first use in the process; its refusal (into err) after. */
static kvq_status composite_of(const char *text, const composite **out, kvq_error *err)
{
    unsigned h = 2166136261u; /* FNV-1a of the text */
    for (const char *p = text; *p; p++) h = (h ^ (unsigned char)*p) * 16777619u;
    unsigned bucket = h % COMPOSITE_BUCKETS;
    pthread_mutex_lock(&composite_lock);
    composite *c = composite_find(text, bucket);
    pthread_mutex_unlock(&composite_lock);
    if (!c) { /* taken apart outside the lock: an item may be a composite itself */
        composite *n = calloc(1, sizeof *n);
        if (!n) return kvq_fail(err, KVQ_ERR_NOMEM, "out of memory");
        snprintf(n->text, sizeof n->text, "%s", text);
        n->status = !strncmp(text, "mix(", 4) ? mix_take_apart(n) : tokens_split(text, &n->parts, &n->err);
        pthread_mutex_lock(&composite_lock);
        if (!(c = composite_find(text, bucket))) /* else another thread's came first */
            c = n, n->next = composites[bucket], composites[bucket] = n, n = NULL, composite_splits++;
        pthread_mutex_unlock(&composite_lock);
        if (n) free(n->m), free(n->items), free(n);
    }
    *out = c;
    if (c->status && err) *err = c->err;
    return c->status;
}

static kvq_status mix_parse(const char *text, kvq_spec *out, kvq_error *err)
{
    const composite *c;
    out->q = &kvq_q_mix;
    return composite_of(text, &c, err);
}

int kvq_spec_is_mix(const kvq_spec *spec) { return spec->q && spec->q->is_mix; }

/* The pseudo-family of tokens(SELECT; HI; LO): kvq_quantize_layer runs it
 * through kvq_tokens_quantize; the checks below descend into HI and LO. */
static const kvq_quantizer kvq_q_tokens = {
    .name = "tokens",
    .description = "tokens(SELECT; HI; LO): each head's important tokens at HI, the others at LO or dropped",
    .calib_free = free, /* a kvq_tokens_calib; its parts' states are the calibration's own */
    .is_tokens = 1,
};

int kvq_spec_is_tokens(const kvq_spec *spec) { return spec->q && spec->q->is_tokens; }
/* ------------------------------------------------------------- tokens */

/* [*b, *e) without surrounding blanks. */
static void trim(const char *text, int *b, int *e)
{
    while (*b < *e && (text[*b] == ' ' || text[*b] == '\t')) (*b)++;
    while (*e > *b && (text[*e - 1] == ' ' || text[*e - 1] == '\t')) (*e)--;
}

/* HI or LO: none, drop (LO only) or a plain spec. */
static kvq_status part_parse(const char *text, const char *what, const char *part, int allow_drop,
                             kvq_token_part *kind, kvq_spec *sp, kvq_error *err)
{
    if (!strcmp(part, "none")) return *kind = KVQ_PART_NONE, KVQ_OK;
    if (!strcmp(part, "drop")) {
        if (!allow_drop)
            return kvq_fail(err, KVQ_ERR_USAGE, "%s: HI is drop: the kept tokens must be kept (none or a spec)", text);
        return *kind = KVQ_PART_DROP, KVQ_OK;
    }
    *kind = KVQ_PART_SPEC;
    if (!strncmp(part, "mix(", 4) || !strncmp(part, "tokens(", 7))
        return kvq_fail(err, KVQ_ERR_USAGE, "%s: %s '%s': expected none%s or a plain spec (tokens(...) may sit in a "
                        "mix(...), not the other way round)", text, what, part, allow_drop ? ", drop" : "");
    kvq_error e = {0};
    kvq_status st = kvq_spec_parse(part, sp, &e);
    if (st) return kvq_fail(err, st, "%s: %s: %s", text, what, e.msg);
    return KVQ_OK;
}

int kvq_tokens_cut(const char *text, int cut[4])
{
    int len = (int)strlen(text), n = 1, depth = 0;
    cut[0] = 6;
    for (int i = 7; i < len - 1; i++) {
        depth += (text[i] == '(') - (text[i] == ')');
        if (depth == 0 && text[i] == ';') {
            if (n == 3) return 4;
            cut[n++] = i;
        }
    }
    cut[n] = len - 1;
    return n;
}

void kvq_tokens_part(const char *text, const int cut[4], int k, int *b, int *e)
{
    *b = cut[k] + 1, *e = cut[k + 1];
    trim(text, b, e);
}

static kvq_status tokens_split(const char *text, kvq_tokens_parts *out, kvq_error *err)
{
    memset(out, 0, sizeof *out);
    int len = (int)strlen(text), cut[4];
    if (len < 9 || strncmp(text, "tokens(", 7) || text[len - 1] != ')')
        return kvq_fail(err, KVQ_ERR_USAGE, "%s: expected tokens(SELECT; HI; LO)", text);
    if (kvq_tokens_cut(text, cut) != 3)
        return kvq_fail(err, KVQ_ERR_USAGE, "%s: expected three parts, tokens(SELECT; HI; LO)", text);
    char part[3][KVQ_SPEC_MAX];
    for (int k = 0; k < 3; k++) {
        int b, e;
        kvq_tokens_part(text, cut, k, &b, &e);
        if (b == e) return kvq_fail(err, KVQ_ERR_USAGE, "%s: an empty part: expected tokens(SELECT; HI; LO)", text);
        snprintf(part[k], sizeof part[k], "%.*s", e - b, text + b);
    }
    /* SELECT: a selector's name and keys */
    char name[64];
    snprintf(name, sizeof name, "%.*s", (int)strcspn(part[0], ":"), part[0]);
    const kvq_quantizer *sq = kvq_token_selector_find(name);
    if (!sq)
        return kvq_fail(err, KVQ_ERR_USAGE,
                        "%s: unknown selector '%s' (known: window, h2o, zipcache, snapkv, tova, knorm, random, keydiff)", text,
                        name);
    out->selector = kvq_token_selector_kind(sq);
    kvq_error e = {0};
    kvq_status st = kvq_spec_parse_as(sq, part[0], &out->sel, &e);
    if (st) return kvq_fail(err, st, "%s: %s", text, e.msg);
    if ((st = part_parse(text, "HI", part[1], 0, &out->hi_kind, &out->hi, err)) ||
        (st = part_parse(text, "LO", part[2], 1, &out->lo_kind, &out->lo, err)))
        return st;
    return KVQ_OK;
}

/* out->text holds text (kvq_spec_parse checked its length). */
static kvq_status tokens_parse(kvq_spec *out, kvq_error *err)
{
    const composite *c;
    out->q = &kvq_q_tokens;
    return composite_of(out->text, &c, err);
}

kvq_status kvq_tokens_parts_of(const kvq_spec *spec, const kvq_tokens_parts **out, kvq_error *err)
{
    const composite *c;
    *out = NULL;
    if (!kvq_spec_is_tokens(spec))
        return kvq_fail(err, KVQ_ERR_USAGE, "%s: expected tokens(SELECT; HI; LO)", spec->text);
    kvq_status st = composite_of(spec->text, &c, err);
    if (!st) *out = &c->parts;
    return st;
}

/* A mix's parts (NULL and the refusal if it has none). */
static kvq_status mix_of(const kvq_spec *spec, const composite **out, kvq_error *err)
{
    return composite_of(spec->text, out, err);
}

kvq_status kvq_spec_for_layer(const kvq_spec *spec, int layer, kvq_spec *out, kvq_error *err)
{
    if (!kvq_spec_is_mix(spec)) {
        if (out != spec) *out = *spec;
        return KVQ_OK;
    }
    const composite *c;
    kvq_status st = mix_of(spec, &c, err);
    if (st) return st;
    int item = -1;
    for (int i = 0; i < c->m->nspans; i++)
        if (c->m->span[i].lo <= layer && layer <= c->m->span[i].hi) item = c->m->span[i].item;
    if (item < 0) return kvq_fail(err, KVQ_ERR_USAGE, "%s: layer %d is in no range", spec->text, layer);
    *out = c->items[item];
    return KVQ_OK;
}

/* Every layer 0..nlayers−1 in a range of m, and no range beyond them. */
static kvq_status mix_check_layers(const char *text, const mix *m, int nlayers, kvq_error *err)
{
    kvq_status st = KVQ_OK;
    for (int i = 0; i < m->nspans && !st; i++)
        if (m->span[i].lo >= nlayers || (m->span[i].hi != INT_MAX && m->span[i].hi >= nlayers)) {
            char r[32];
            span_text(&m->span[i], r, sizeof r);
            st = kvq_fail(err, KVQ_ERR_USAGE, "%s: range %s: the model has %d layers (0..%d)", text, r, nlayers,
                          nlayers - 1);
        }
    for (int l = 0; l < nlayers && !st; l++) {
        int in = 0;
        for (int i = 0; i < m->nspans; i++) in |= m->span[i].lo <= l && l <= m->span[i].hi;
        if (!in) st = kvq_fail(err, KVQ_ERR_USAGE, "%s: layer %d is in no range (every layer needs one)", text, l);
    }
    return st;
}

kvq_status kvq_spec_check_layers(const kvq_spec *spec, int nlayers, kvq_error *err)
{
    if (!kvq_spec_is_mix(spec)) return KVQ_OK;
    const composite *c;
    kvq_status st = mix_of(spec, &c, err);
    return st ? st : mix_check_layers(spec->text, c->m, nlayers, err);
}

/* fn on spec and, for a tokens(...), on its HI and LO specs. */
static kvq_status each_leaf(const kvq_spec *spec, kvq_status (*fn)(const kvq_spec *, void *, kvq_error *), void *ud,
                            kvq_error *err);

/* Calls fn on every spec of a mix (or on the plain spec), and of a
 * tokens(...) on it and its HI and LO specs: for checks that hold for each
 * (shape, calibration, tensors read). */
static kvq_status each_spec(const kvq_spec *spec, kvq_status (*fn)(const kvq_spec *, void *, kvq_error *), void *ud,
                            kvq_error *err)
{
    if (!kvq_spec_is_mix(spec)) return each_leaf(spec, fn, ud, err);
    const composite *c;
    kvq_status st = mix_of(spec, &c, err);
    for (int i = 0; !st && i < c->m->nitems; i++) st = each_leaf(&c->items[i], fn, ud, err);
    return st;
}

static kvq_status each_leaf(const kvq_spec *spec, kvq_status (*fn)(const kvq_spec *, void *, kvq_error *), void *ud,
                            kvq_error *err)
{
    kvq_status st = fn(spec, ud, err); /* a tokens(...) itself too: its selector's queries */
    if (st || !kvq_spec_is_tokens(spec)) return st;
    const kvq_tokens_parts *tp;
    st = kvq_tokens_parts_of(spec, &tp, err);
    if (!st && tp->hi_kind == KVQ_PART_SPEC) st = fn(&tp->hi, ud, err);
    if (!st && tp->lo_kind == KVQ_PART_SPEC) st = fn(&tp->lo, ud, err);
    return st;
}

static kvq_status shape_of(const kvq_spec *spec, void *ud, kvq_error *err)
{
    int D = *(int *)ud;
    return spec->q->check_shape ? spec->q->check_shape(spec, D, err) : KVQ_OK;
}

kvq_status kvq_spec_check_shape(const kvq_spec *spec, int head_dim, kvq_error *err)
{
    return each_spec(spec, shape_of, &head_dim, err);
}

static kvq_status needs_calib_of(const kvq_spec *spec, void *ud, kvq_error *err)
{
    (void)err;
    char key[KVQ_SPEC_MAX];
    *(int *)ud |= spec->q->needs_calib || (spec->q->calib_key && spec->q->calib_key(spec, key, sizeof key));
    return KVQ_OK;
}

int kvq_spec_needs_calib(const kvq_spec *spec)
{
    int need = 0;
    each_spec(spec, needs_calib_of, &need, NULL);
    return need;
}

kvq_status kvq_spec_check_calib(const kvq_spec *spec, int have_calib, kvq_error *err)
{
    if (have_calib || !kvq_spec_needs_calib(spec)) return KVQ_OK;
    return kvq_fail(err, KVQ_ERR_USAGE, "%s: %s", spec->text, KVQ_NEEDS_CALIB);
}

static kvq_status flags_of(const kvq_spec *spec, void *ud, kvq_error *err)
{
    (void)err;
    *(unsigned *)ud |= spec->q->read_flags;
    const kvq_tokens_parts *tp; /* the selector's queries */
    if (kvq_spec_is_tokens(spec) && !kvq_tokens_parts_of(spec, &tp, NULL) &&
        kvq_token_selector_needs_queries(tp->selector))
        *(unsigned *)ud |= KVQ_READ_QUERY;
    return KVQ_OK;
}

unsigned kvq_spec_read_flags(const kvq_spec *spec)
{
    unsigned f = 0;
    each_spec(spec, flags_of, &f, NULL);
    return f;
}

/* ------------------------------------------------- a spec for a run */

/* A spec parsed once for a model's layers: a mix's items each parsed once
 * and every layer mapped to its item, a tokens(...) item taken apart once;
 * the tensors read and the calibration need read from them. */
struct kvq_resolved_spec {
    int nlayers, nitems, needs_calib;
    unsigned flags;
    int *item;                /* [nlayers]: the item that holds layer l */
    kvq_spec *spec;           /* [nitems]: a mix's items (else the spec itself) */
    const kvq_tokens_parts **parts; /* [nitems]: a tokens(...) item's parts (composite_of's), else NULL */
};

/* fn on an item and, for a tokens(...), on its HI and LO specs (each_leaf's order). */
static kvq_status item_walk(const kvq_resolved_spec *r, int i, kvq_status (*fn)(const kvq_spec *, void *, kvq_error *),
                            void *ud, kvq_error *err)
{
    const kvq_tokens_parts *tp = r->parts[i];
    kvq_status st = fn(&r->spec[i], ud, err);
    if (!st && tp && tp->hi_kind == KVQ_PART_SPEC) st = fn(&tp->hi, ud, err);
    if (!st && tp && tp->lo_kind == KVQ_PART_SPEC) st = fn(&tp->lo, ud, err);
    return st;
}

kvq_status kvq_spec_resolve(const kvq_spec *spec, int nlayers, kvq_resolved_spec **out, kvq_error *err)
{
    *out = NULL;
    kvq_resolved_spec *r = calloc(1, sizeof *r);
    const composite *c = NULL;
    const mix *m = NULL;
    kvq_status st = r ? KVQ_OK : kvq_fail(err, KVQ_ERR_NOMEM, "out of memory");
    if (!st && kvq_spec_is_mix(spec) && !(st = mix_of(spec, &c, err)))
        m = c->m, st = mix_check_layers(spec->text, m, nlayers, err);
    if (st) goto fail;
    r->nlayers = nlayers, r->nitems = m ? m->nitems : 1;
    r->item = calloc((size_t)(nlayers > 0 ? nlayers : 1), sizeof *r->item);
    r->spec = calloc((size_t)r->nitems, sizeof *r->spec), r->parts = calloc((size_t)r->nitems, sizeof *r->parts);
    if (!r->item || !r->spec || !r->parts) {
        st = kvq_fail(err, KVQ_ERR_NOMEM, "out of memory");
        goto fail;
    }
    for (int i = 0; i < r->nitems && !st; i++) {
        r->spec[i] = m ? c->items[i] : *spec;
        if (kvq_spec_is_tokens(&r->spec[i])) st = kvq_tokens_parts_of(&r->spec[i], &r->parts[i], err);
    }
    for (int l = 0; m && l < nlayers; l++)
        for (int k = 0; k < m->nspans; k++)
            if (m->span[k].lo <= l && l <= m->span[k].hi) r->item[l] = m->span[k].item;
    for (int i = 0; i < r->nitems && !st; i++) {
        item_walk(r, i, needs_calib_of, &r->needs_calib, NULL);
        item_walk(r, i, flags_of, &r->flags, NULL); /* with a selector's queries */
    }
    if (st) goto fail;
    *out = r;
    return KVQ_OK;
fail:
    kvq_resolved_spec_free(r);
    return st;
}

void kvq_resolved_spec_free(kvq_resolved_spec *r)
{
    if (!r) return;
    free(r->parts), free(r->spec), free(r->item), free(r);
}

const kvq_spec *kvq_resolved_spec_at(const kvq_resolved_spec *r, int layer)
{
    return &r->spec[layer >= 0 && layer < r->nlayers ? r->item[layer] : 0];
}

const kvq_tokens_parts *kvq_resolved_spec_parts(const kvq_resolved_spec *r, int layer)
{
    return r->parts[layer >= 0 && layer < r->nlayers ? r->item[layer] : 0];
}

unsigned kvq_resolved_spec_flags(const kvq_resolved_spec *r) { return r->flags; }
int kvq_resolved_spec_needs_calib(const kvq_resolved_spec *r) { return r->needs_calib; }

kvq_status kvq_resolved_spec_check_shape(const kvq_resolved_spec *r, int head_dim, kvq_error *err)
{
    kvq_status st = KVQ_OK;
    for (int i = 0; i < r->nitems && !st; i++) st = item_walk(r, i, shape_of, &head_dim, err);
    return st;
}

const kvq_spec *kvq_resolved_spec_continuation(const kvq_resolved_spec *r, int layer)
{
    const kvq_tokens_parts *tp = kvq_resolved_spec_parts(r, layer);
    if (!tp) return kvq_resolved_spec_at(r, layer);
    return tp->hi_kind == KVQ_PART_SPEC ? &tp->hi : NULL; /* HI none: exact (HI is never drop) */
}

/* ---------------------------------------------------------------- specs */

/* The values as the family's options struct (kvq_param.offset): ints for
 * INT and CHOICE, doubles for REAL; KVQ_ERR_INTERNAL for a table whose
 * field lies outside KVQ_OPTS_MAX (the registry test parses every family). */
static kvq_status fill_opts(kvq_spec *sp, kvq_error *err)
{
    for (int i = 0; i < sp->q->nparams; i++) {
        const kvq_param *p = &sp->q->params[i];
        if (!p->typed) continue;
        size_t size = p->type == KVQ_PARAM_REAL ? sizeof(double) : sizeof(int);
        if (p->offset > KVQ_OPTS_MAX - size)
            return kvq_fail(err, KVQ_ERR_INTERNAL, "%s: key %s: options field at byte %zu, beyond %d", sp->q->name,
                            p->key, p->offset, KVQ_OPTS_MAX);
        if (p->type == KVQ_PARAM_REAL) {
            double v = sp->val[i];
            memcpy(sp->opts.bytes + p->offset, &v, sizeof v);
        } else {
            int v = isnan(sp->val[i]) ? KVQ_UNSET : (int)sp->val[i];
            memcpy(sp->opts.bytes + p->offset, &v, sizeof v);
        }
    }
    return KVQ_OK;
}

/* The keys of text = "NAME[:key=value,...]" against q's table (NAME is q's,
 * checked by the caller): values checked, defaults filled in, the options
 * struct filled and q's cross-key check run.  out->text is text. */
kvq_status kvq_spec_parse_as(const kvq_quantizer *q, const char *text, kvq_spec *out, kvq_error *err)
{
    memset(out, 0, sizeof *out);
    size_t len = strlen(text);
    if (len >= KVQ_SPEC_MAX)
        return kvq_fail(err, KVQ_ERR_USAGE, "quantizer spec longer than %d characters", KVQ_SPEC_MAX - 1);
    memcpy(out->text, text, len + 1);
    char buf[KVQ_SPEC_MAX];
    memcpy(buf, text, len + 1);
    char *colon = strchr(buf, ':');
    out->q = q;
    for (int i = 0; i < q->nparams; i++) out->val[i] = NAN;

    if (colon && colon[1]) {
        char *save = NULL;
        for (char *item = strtok_r(colon + 1, ",", &save); item; item = strtok_r(NULL, ",", &save)) {
            char *eq = strchr(item, '=');
            if (!eq || eq == item || !eq[1])
                return kvq_fail(err, KVQ_ERR_USAGE, "%s: '%s': expected key=value", text, item);
            *eq = '\0';
            int k = kvq_spec_param_index(q, item);
            if (k < 0) {
                char keys[256];
                kvq_param_list_keys(q, keys, sizeof keys);
                return kvq_fail(err, KVQ_ERR_USAGE, "%s: unknown key '%s' for %s (keys: %s)", text, item, q->name,
                                keys);
            }
            if (out->given[k])
                return kvq_fail(err, KVQ_ERR_USAGE, "%s: key '%s' given twice", text, item);
            kvq_status st = kvq_param_value_parse(text, &q->params[k], eq + 1, &out->val[k], err);
            if (st) return st;
            out->given[k] = 1;
        }
    } else if (colon) {
        return kvq_fail(err, KVQ_ERR_USAGE, "%s: expected key=value after ':'", text);
    }
    for (int i = 0; i < q->nparams; i++) {
        if (out->given[i] || !q->params[i].def) continue;
        kvq_status st = kvq_param_value_parse(text, &q->params[i], q->params[i].def, &out->val[i], err);
        if (st) return st; /* a bad default is a bug in the table; the test suite parses them all */
    }
    kvq_status st = fill_opts(out, err);
    if (st) return st;
    return q->check ? q->check(out, err) : KVQ_OK;
}

kvq_status kvq_spec_parse(const char *text, kvq_spec *out, kvq_error *err)
{
    memset(out, 0, sizeof *out);
    size_t len = strlen(text);
    if (len == 0) return kvq_fail(err, KVQ_ERR_USAGE, "empty quantizer spec (expected NAME[:key=value,...])");
    if (len >= KVQ_SPEC_MAX)
        return kvq_fail(err, KVQ_ERR_USAGE, "quantizer spec longer than %d characters", KVQ_SPEC_MAX - 1);
    memcpy(out->text, text, len + 1);
    if (!strncmp(text, "mix(", 4)) return mix_parse(text, out, err);
    if (!strncmp(text, "tokens(", 7)) return tokens_parse(out, err);

    char buf[KVQ_SPEC_MAX];
    memcpy(buf, text, len + 1);
    char *colon = strchr(buf, ':');
    if (colon) *colon = '\0';
    const kvq_quantizer *q = kvq_quantizer_find(buf);
    if (!q) {
        char names[512];
        size_t o = 0;
        for (size_t i = 0; i < kvq_quantizer_count() && o < sizeof names; i++)
            o += snprintf(names + o, sizeof names - o, "%s%s", i ? ", " : "", kvq_quantizer_at(i)->name);
        return kvq_fail(err, KVQ_ERR_USAGE, "%s: unknown quantizer '%s' (known: %s; and none, mix(...), tokens(...))", text,
                        buf, names);
    }
    return kvq_spec_parse_as(q, text, out, err);
}

kvq_status kvq_spec_default(const kvq_quantizer *q, kvq_spec *out, kvq_error *err)
{
    char text[KVQ_SPEC_MAX];
    const char *ds = q->default_spec ? q->default_spec : "";
    snprintf(text, sizeof text, "%s%s%s", q->name, ds[0] ? ":" : "", ds);
    return kvq_spec_parse(text, out, err);
}


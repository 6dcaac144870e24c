/* registry.c — the one table of quantizers (SPEC §3.4), in the style of
 * ggml's type traits, plus spec-string parsing and the per-head runner.
 * Adding a quantizer: one new file with its kvq_quantizer, one line below. */
#include "../internal.h"
#include "quant.h"

#include <errno.h>
#include <math.h>
#include <omp.h>
#include <string.h>

static const kvq_quantizer *const registry[] = {
    &kvq_q_per_token,
    &kvq_q_per_channel,
    &kvq_q_kivi,
    &kvq_q_kcvt,
    &kvq_q_absmax,
    &kvq_q_gear,
    &kvq_q_gear_l,
    &kvq_q_cluster,
    &kvq_q_lloydmax,
    &kvq_q_fp8,
    &kvq_q_fp4,
    &kvq_q_tender,
    &kvq_q_ggml,
    &kvq_q_kvquant,
    &kvq_q_turboquant,
};

size_t kvq_quantizer_count(void) { return sizeof registry / sizeof registry[0]; }

const kvq_quantizer *kvq_quantizer_at(size_t i)
{
    return i < kvq_quantizer_count() ? registry[i] : NULL;
}

const kvq_quantizer *kvq_quantizer_find(const char *name)
{
    for (size_t i = 0; i < kvq_quantizer_count(); i++)
        if (!strcmp(registry[i]->name, name)) return registry[i];
    return NULL;
}

int kvq_spec_param_index(const kvq_quantizer *q, const char *key)
{
    for (int i = 0; i < q->nparams; i++)
        if (!strcmp(q->params[i].key, key)) return i;
    return -1;
}

/* Index of `word` among the '|'-separated `choices`, or -1. */
static int choice_index(const char *choices, const char *word)
{
    size_t wl = strlen(word);
    int idx = 0;
    for (const char *p = choices; *p; idx++) {
        const char *bar = strchr(p, '|');
        size_t len = bar ? (size_t)(bar - p) : strlen(p);
        if (len == wl && !strncmp(p, word, len)) return idx;
        if (!bar) break;
        p = bar + 1;
    }
    return -1;
}

/* The text of choice `idx` into buf. */
static void choice_name(const char *choices, int idx, char *buf, size_t len)
{
    const char *p = choices;
    for (int i = 0; i < idx && p; i++) {
        p = strchr(p, '|');
        if (p) p++;
    }
    if (!p) p = "?";
    const char *bar = strchr(p, '|');
    size_t n = bar ? (size_t)(bar - p) : strlen(p);
    snprintf(buf, len, "%.*s", (int)n, p);
}

static void list_keys(const kvq_quantizer *q, char *buf, size_t len)
{
    size_t o = 0;
    buf[0] = '\0';
    for (int i = 0; i < q->nparams && o < len; i++)
        o += snprintf(buf + o, len - o, "%s%s", i ? ", " : "", q->params[i].key);
}

/* Parses `text` as parameter `p` into *v. */
static kvq_status parse_value(const char *spec, const kvq_param *p, const char *text, double *v,
                              kvq_error *err)
{
    if (p->type == KVQ_PARAM_CHOICE) {
        int idx = choice_index(p->choices, text);
        if (idx < 0)
            return kvq_fail(err, KVQ_ERR_USAGE, "%s: %s=%s: expected one of %s", spec, p->key, text, p->choices);
        *v = idx;
        return KVQ_OK;
    }
    char *end;
    errno = 0;
    double d;
    if (p->type == KVQ_PARAM_INT) {
        long long n = strtoll(text, &end, 10);
        d = (double)n;
        if (errno || end == text || *end)
            return kvq_fail(err, KVQ_ERR_USAGE, "%s: %s=%s: expected an integer", spec, p->key, text);
    } else {
        d = strtod(text, &end);
        if (errno || end == text || *end || !isfinite(d))
            return kvq_fail(err, KVQ_ERR_USAGE, "%s: %s=%s: expected a number", spec, p->key, text);
    }
    if (d < p->min || d > p->max)
        return kvq_fail(err, KVQ_ERR_USAGE, "%s: %s=%s: out of range %g..%g", spec, p->key, text, p->min, p->max);
    *v = d;
    return KVQ_OK;
}

kvq_status kvq_param_parse(const kvq_quantizer *q, const char *key, const char *text, double *val,
                           kvq_error *err)
{
    int k = kvq_spec_param_index(q, key);
    if (k < 0) {
        char keys[256];
        list_keys(q, keys, sizeof keys);
        return kvq_fail(err, KVQ_ERR_USAGE, "%s: unknown key '%s' (keys: %s)", q->name, key, keys);
    }
    return parse_value(q->name, &q->params[k], text, val, err);
}

kvq_status kvq_spec_parse(const char *text, kvq_spec *out, kvq_error *err)
{
    memset(out, 0, sizeof *out);
    size_t len = strlen(text);
    if (len == 0) return kvq_fail(err, KVQ_ERR_USAGE, "empty quantizer spec (expected NAME[:key=value,...])");
    if (len >= KVQ_SPEC_MAX)
        return kvq_fail(err, KVQ_ERR_USAGE, "quantizer spec longer than %d characters", KVQ_SPEC_MAX - 1);
    memcpy(out->text, text, len + 1);

    char buf[KVQ_SPEC_MAX];
    memcpy(buf, text, len + 1);
    char *colon = strchr(buf, ':');
    if (colon) *colon = '\0';
    const kvq_quantizer *q = kvq_quantizer_find(buf);
    if (!q) {
        char names[512];
        size_t o = 0;
        for (size_t i = 0; i < kvq_quantizer_count() && o < sizeof names; i++)
            o += snprintf(names + o, sizeof names - o, "%s%s", i ? ", " : "", registry[i]->name);
        return kvq_fail(err, KVQ_ERR_USAGE, "%s: unknown quantizer '%s' (known: %s)", text, buf, names);
    }
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
                list_keys(q, keys, sizeof keys);
                return kvq_fail(err, KVQ_ERR_USAGE, "%s: unknown key '%s' for %s (keys: %s)", text, item, q->name, keys);
            }
            if (out->given[k])
                return kvq_fail(err, KVQ_ERR_USAGE, "%s: key '%s' given twice", text, item);
            kvq_status st = parse_value(text, &q->params[k], eq + 1, &out->val[k], err);
            if (st) return st;
            out->given[k] = 1;
        }
    } else if (colon) {
        return kvq_fail(err, KVQ_ERR_USAGE, "%s: expected key=value after ':'", text);
    }
    for (int i = 0; i < q->nparams; i++) {
        if (out->given[i] || !q->params[i].def) continue;
        kvq_status st = parse_value(text, &q->params[i], q->params[i].def, &out->val[i], err);
        if (st) return st; /* a bad default is a bug in the table; the test suite parses them all */
    }
    return q->check ? q->check(out, err) : KVQ_OK;
}

void kvq_spec_format_full(const kvq_spec *spec, char *buf, size_t len)
{
    const kvq_quantizer *q = spec->q;
    size_t o = (size_t)snprintf(buf, len, "%s", q->name);
    for (int i = 0; i < q->nparams && o < len; i++) {
        const kvq_param *p = &q->params[i];
        if (isnan(spec->val[i])) continue;
        if (p->quiet_default && !spec->given[i]) continue;
        char v[64];
        if (p->type == KVQ_PARAM_CHOICE) choice_name(p->choices, (int)spec->val[i], v, sizeof v);
        else snprintf(v, sizeof v, "%.17g", spec->val[i]);
        o += (size_t)snprintf(buf + o, len - o, "%c%s=%s", o == strlen(q->name) ? ':' : ',', p->key, v);
    }
}

kvq_status kvq_spec_default(const kvq_quantizer *q, kvq_spec *out, kvq_error *err)
{
    char text[KVQ_SPEC_MAX];
    const char *ds = q->default_spec ? q->default_spec : "";
    snprintf(text, sizeof text, "%s%s%s", q->name, ds[0] ? ":" : "", ds);
    return kvq_spec_parse(text, out, err);
}

int kvq_spec_needs_calib(const kvq_spec *spec)
{
    char key[KVQ_SPEC_MAX];
    if (spec->q->needs_calib) return 1;
    return spec->q->calib_key ? spec->q->calib_key(spec, key, sizeof key) : 0;
}

void kvq_registry_describe(FILE *f)
{
    for (size_t i = 0; i < kvq_quantizer_count(); i++) {
        const kvq_quantizer *q = registry[i];
        fprintf(f, "%-12s %s%s\n", q->name, q->description, q->needs_calib ? " [needs --calib]" : "");
        for (int k = 0; k < q->nparams; k++) {
            const kvq_param *p = &q->params[k];
            char kv[64], range[64];
            snprintf(kv, sizeof kv, "%s=%s", p->key, p->def ? p->def : "(unset)");
            if (p->type == KVQ_PARAM_CHOICE) snprintf(range, sizeof range, "%s", p->choices);
            else snprintf(range, sizeof range, "%g..%g", p->min, p->max);
            fprintf(f, "    %-16s %s [%s]\n", kv, p->help, range);
        }
    }
}

kvq_status kvq_quant_numeric_error(kvq_error *err, const kvq_spec *spec, const kvq_quant_ctx *ctx,
                                   const char *tensor, int head)
{
    int has_scale = kvq_spec_param_index(spec->q, "scale") >= 0;
    return kvq_fail(err, KVQ_ERR_NUMERIC,
                    "/layer_%03d, %s head %d: %s: scale or zero overflows fp16 (values beyond "
                    "+-65504)%s", ctx->layer, tensor, head, spec->text,
                    has_scale ? "; use scale=fp32" : "");
}

/* Per-head quantizers: tensor 0 (K) and 1 (V) of every head spread over
 * ctx->nthreads threads; the first failure in task order (independent of
 * scheduling) becomes the error. */
static kvq_status quantize_layer_direct(const kvq_spec *spec, const kvq_quant_ctx *ctx, const kvq_layer *in,
                                        kvq_quant_out *out, kvq_error *err);

kvq_status kvq_spec_check_shape(const kvq_spec *spec, int head_dim, kvq_error *err)
{
    return spec->q->check_shape ? spec->q->check_shape(spec, head_dim, err) : KVQ_OK;
}

kvq_status kvq_quantize_layer(const kvq_spec *spec, const kvq_quant_ctx *ctx, const kvq_layer *in,
                              kvq_quant_out *out, kvq_error *err)
{
    kvq_status st = kvq_spec_check_shape(spec, in->D, err);
    if (st) return st;
    if (kvq_spec_prerotate(spec)) return kvq_prerotate_quantize(spec, ctx, in, out, err, quantize_layer_direct);
    return quantize_layer_direct(spec, ctx, in, out, err);
}

static kvq_status quantize_layer_direct(const kvq_spec *spec, const kvq_quant_ctx *ctx, const kvq_layer *in,
                                        kvq_quant_out *out, kvq_error *err)
{
    if (spec->q->quantize) return spec->q->quantize(spec, ctx, in, out, err);
    kvq_status (*fn)(const kvq_spec *, const kvq_quant_ctx *, const kvq_layer *, kvq_quant_out *, int,
                     int, kvq_error *) = spec->q->quantize_head;
    int ntask = 2 * in->H;
    kvq_status *sts = calloc((size_t)ntask, sizeof *sts);
    kvq_error *errs = calloc((size_t)ntask, sizeof *errs);
    if (!sts || !errs) {
        free(sts), free(errs);
        return kvq_fail(err, KVQ_ERR_NOMEM, "out of memory");
    }
    int nt = kvq_threads(ctx->nthreads);
#pragma omp parallel for num_threads(nt) schedule(dynamic, 1)
    for (int i = 0; i < ntask; i++) sts[i] = fn(spec, ctx, in, out, i / in->H, i % in->H, &errs[i]);
    kvq_status st = KVQ_OK;
    int bad = 0;
    for (int i = 0; i < ntask && !st; i++) st = sts[i], bad = i;
    char msg[sizeof err->msg];
    snprintf(msg, sizeof msg, "%s", errs[bad].msg);
    free(sts), free(errs);
    const char *tensor = bad / in->H ? "value" : "key";
    if (!st) return KVQ_OK;
    if (msg[0])
        return kvq_fail(err, st, "%s: /layer_%03d, %s head %d: %s", spec->text, ctx->layer, tensor, bad % in->H, msg);
    if (st == KVQ_ERR_NUMERIC) return kvq_quant_numeric_error(err, spec, ctx, tensor, bad % in->H);
    if (st == KVQ_ERR_NOMEM) return kvq_fail(err, st, "%s: out of memory", spec->text);
    return kvq_fail(err, st, "%s: /layer_%03d, %s head %d: %s", spec->text, ctx->layer, tensor,
                    bad % in->H, kvq_strerror(st));
}

/* params.c — a quantizer's parameter table: keys, values checked against
 * their type and range, the full spec text, the message for a scale that
 * overflows fp16, and the count of first stages the families took from
 * another spec's output.  Reads only the quantizer's own table, so the
 * families may call it without reaching the registry. */
#include "../internal.h"
#include "quant.h"

#include <errno.h>
#include <math.h>
#include <string.h>

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

void kvq_param_list_keys(const kvq_quantizer *q, char *buf, size_t len)
{
    size_t o = 0;
    buf[0] = '\0';
    for (int i = 0; i < q->nparams && o < len; i++)
        o += snprintf(buf + o, len - o, "%s%s", i ? ", " : "", q->params[i].key);
}

kvq_status kvq_param_value_parse(const char *spec, const kvq_param *p, const char *text, double *v,
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
        return p->type == KVQ_PARAM_INT
                   ? kvq_fail(err, KVQ_ERR_USAGE, "%s: %s=%s: out of range %.0f..%.0f", spec, p->key, text, p->min,
                              p->max)
                   : kvq_fail(err, KVQ_ERR_USAGE, "%s: %s=%s: out of range %g..%g", spec, p->key, text, p->min, p->max);
    *v = d;
    return KVQ_OK;
}

kvq_status kvq_param_parse(const kvq_quantizer *q, const char *key, const char *text, double *val,
                           kvq_error *err)
{
    int k = kvq_spec_param_index(q, key);
    if (k < 0) {
        char keys[256];
        kvq_param_list_keys(q, keys, sizeof keys);
        return kvq_fail(err, KVQ_ERR_USAGE, "%s: unknown key '%s' (keys: %s)", q->name, key, keys);
    }
    return kvq_param_value_parse(q->name, &q->params[k], text, val, err);
}

void kvq_spec_format_full(const kvq_spec *spec, char *buf, size_t len)
{
    const kvq_quantizer *q = spec->q;
    if (q->is_mix || q->is_tokens) { /* a mix, a tokens(...): as given */
        snprintf(buf, len, "%s", spec->text);
        return;
    }
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

kvq_status kvq_quant_numeric_error(kvq_error *err, const kvq_spec *spec, const kvq_quant_ctx *ctx,
                                   const char *tensor, int head)
{
    int has_scale = kvq_spec_param_index(spec->q, "scale") >= 0;
    return kvq_fail(err, KVQ_ERR_NUMERIC,
                    "/layer_%03d, %s head %d: %s: scale or zero overflows fp16 (values beyond "
                    "+-65504)%s", ctx->layer, tensor, head, spec->text,
                    has_scale ? "; use scale=fp32" : "");
}

static unsigned long first_stages_taken;

void kvq_first_stage_taken(void) { __atomic_add_fetch(&first_stages_taken, 1, __ATOMIC_RELAXED); }

unsigned long kvq_first_stages_taken(void) { return __atomic_load_n(&first_stages_taken, __ATOMIC_RELAXED); }

/* spec.c — spec strings `name:key=value,...` (docs/quantizers.md): parsed against the
 * registry's table, defaults filled in, cross-key and shape checks. */
#include "../internal.h"
#include "quant.h"

#include <math.h>
#include <string.h>

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
            o += snprintf(names + o, sizeof names - o, "%s%s", i ? ", " : "", kvq_quantizer_at(i)->name);
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
    return q->check ? q->check(out, err) : KVQ_OK;
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

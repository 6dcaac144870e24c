/* calib.c — the --calib dump and the calibration states computed from it.
 *
 * A state belongs to (layer, quantizer, key): the quantizer's calib_key
 * says which specs share one (e.g. every `cluster` spec with the same
 * centroids).  States are computed on first use and kept until the run ends,
 * so several specs, dumps and sweep points pay for calibration once.  The
 * calibration layer is read once per layer however many states need it. */
#include "../internal.h"
#include "../quant/quant.h"

#include <stdlib.h>
#include <string.h>

typedef struct calib_entry {
    int layer;
    uint64_t seed;
    const kvq_quantizer *q;
    char key[KVQ_SPEC_MAX];
    void *state;
    struct calib_entry *next;
} calib_entry;

struct kvq_calib {
    kvq_dump *dump;
    calib_entry *entries;
    kvq_layer layer; /* the last calibration layer read */
    int layer_index; /* -1: none */
};

kvq_status kvq_calib_open(const char *path, kvq_calib **out, kvq_error *err)
{
    *out = NULL;
    kvq_calib *c = calloc(1, sizeof *c);
    if (!c) return kvq_fail(err, KVQ_ERR_NOMEM, "%s: out of memory", path);
    c->layer_index = -1;
    kvq_status st = kvq_dump_open(path, &c->dump, err);
    if (st) {
        free(c);
        return st;
    }
    *out = c;
    return KVQ_OK;
}

kvq_status kvq_calib_check(const kvq_calib *c, const char *dump_path, const kvq_dump_info *info,
                           kvq_error *err)
{
    const kvq_dump_info *ci = kvq_dump_get_info(c->dump);
    const char *cp = kvq_dump_path(c->dump);
    struct { const char *name; int have, want; } items[] = {
        {"num_layers", ci->num_layers, info->num_layers},
        {"num_kv_heads", ci->num_kv_heads, info->num_kv_heads},
        {"head_dim", ci->head_dim, info->head_dim},
    };
    for (size_t i = 0; i < sizeof items / sizeof items[0]; i++)
        if (items[i].have != items[i].want)
            return kvq_fail(err, KVQ_ERR_FORMAT,
                            "%s: /%s: expected %d as in %s (a calibration dump of the same model), got %d", cp,
                            items[i].name, items[i].want, dump_path, items[i].have);
    return KVQ_OK;
}

kvq_status kvq_calib_check_layer(const kvq_calib *c, int layer, int H, int D, kvq_error *err)
{
    const kvq_dump_info *ci = kvq_dump_get_info(c->dump);
    const char *cp = kvq_dump_path(c->dump);
    if (layer >= ci->num_layers)
        return kvq_fail(err, KVQ_ERR_USAGE, "%s: layer %d: the calibration dump has %d layers", cp, layer,
                        ci->num_layers);
    if (ci->num_kv_heads != H || ci->head_dim != D)
        return kvq_fail(err, KVQ_ERR_FORMAT,
                        "%s: expected %d KV heads of head_dim %d as in the arrays (a calibration dump of the same "
                        "model), got %d of %d",
                        cp, H, D, ci->num_kv_heads, ci->head_dim);
    return KVQ_OK;
}

/* A tokens(...)'s state: its HI's and LO's states (each kept as a plain
 * spec's, shared with it), paired once per (layer, seed, spec). */
static kvq_status tokens_state(kvq_calib *c, const kvq_spec *spec, int layer, uint64_t seed, int nthreads,
                               const void **state, kvq_error *err)
{
    for (calib_entry *e = c->entries; e; e = e->next)
        if (e->layer == layer && e->seed == seed && e->q == spec->q && !strcmp(e->key, spec->text)) {
            *state = e->state;
            return KVQ_OK;
        }
    const kvq_tokens_parts *tp = NULL;
    kvq_tokens_calib *tc = calloc(1, sizeof *tc);
    calib_entry *e = calloc(1, sizeof *e);
    kvq_status st = tc && e ? kvq_tokens_parts_of(spec, &tp, err) : kvq_fail(err, KVQ_ERR_NOMEM, "out of memory");
    for (int lo = 0; lo < 2 && !st; lo++) {
        const kvq_spec *p = lo ? &tp->lo : &tp->hi;
        if ((lo ? tp->lo_kind : tp->hi_kind) == KVQ_PART_SPEC)
            st = kvq_calib_state(c, p, layer, seed, nthreads, &tc->state[lo], err);
    }
    if (st) {
        free(tc), free(e);
        return st;
    }
    e->layer = layer, e->seed = seed, e->q = spec->q, e->state = tc;
    snprintf(e->key, sizeof e->key, "%s", spec->text);
    e->next = c->entries;
    c->entries = e;
    *state = tc;
    return KVQ_OK;
}

kvq_status kvq_calib_state(kvq_calib *c, const kvq_spec *spec, int layer, uint64_t seed,
                           int nthreads, const void **state, kvq_error *err)
{
    *state = NULL;
    kvq_spec sub;
    if (kvq_spec_is_mix(spec)) { /* the state of the layer's own spec */
        kvq_status st = kvq_spec_for_layer(spec, layer, &sub, err);
        if (st) return st;
        spec = &sub;
    }
    if (kvq_spec_is_tokens(spec)) return tokens_state(c, spec, layer, seed, nthreads, state, err);
    const kvq_quantizer *q = spec->q;
    char key[KVQ_SPEC_MAX];
    if (!q->calib_key || !q->calib_key(spec, key, sizeof key)) return KVQ_OK;
    for (calib_entry *e = c->entries; e; e = e->next)
        if (e->layer == layer && e->seed == seed && e->q == q && !strcmp(e->key, key)) {
            *state = e->state;
            return KVQ_OK;
        }
    kvq_status st;
    if (c->layer_index != layer) {
        kvq_layer_free(&c->layer);
        c->layer_index = -1;
        if ((st = kvq_dump_read_layer(c->dump, layer, KVQ_READ_KEY_PRE_ROPE, &c->layer, err))) return st;
        c->layer_index = layer;
    }
    calib_entry *e = calloc(1, sizeof *e);
    if (!e) return kvq_fail(err, KVQ_ERR_NOMEM, "out of memory");
    kvq_quant_ctx ctx = {.info = kvq_dump_get_info(c->dump), .layer = layer, .seed = seed, .nthreads = nthreads};
    if ((st = q->calibrate(spec, &ctx, &c->layer, &e->state, err))) {
        char msg[sizeof err->msg];
        snprintf(msg, sizeof msg, "%s", err ? err->msg : "");
        free(e);
        return kvq_fail(err, st, "%s: /layer_%03d: %s: calibration: %s", kvq_dump_path(c->dump), layer, spec->text,
                        msg);
    }
    e->layer = layer, e->seed = seed, e->q = q;
    snprintf(e->key, sizeof e->key, "%s", key);
    e->next = c->entries;
    c->entries = e;
    *state = e->state;
    return KVQ_OK;
}

size_t kvq_calib_count(const kvq_calib *c)
{
    size_t n = 0;
    for (const calib_entry *e = c->entries; e; e = e->next) n++;
    return n;
}

void kvq_calib_close(kvq_calib *c)
{
    if (!c) return;
    for (calib_entry *e = c->entries, *n; e; e = n) {
        n = e->next;
        if (e->q->calib_free) e->q->calib_free(e->state);
        free(e);
    }
    kvq_layer_free(&c->layer);
    kvq_dump_close(c->dump);
    free(c);
}

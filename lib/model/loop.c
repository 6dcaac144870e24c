/* loop.c — the two jobs of the models-in-the-loop tools (docs/models.md):
 * kvq_model_dump writes the exact forward pass's K/V/Q as kvq-dump/1, and
 * kvq_model_eval runs the exact model beside any number of quantized caches
 * (in passes bounded by memory) and reports each one's loss, KL and top-1
 * against the exact model. */
#include "../quant/quant.h"
#include "model.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

static kvq_status check_tokens(const kvq_model *m, const int *tokens, int T, kvq_error *err)
{
    if (T < 2)
        return kvq_fail(err, KVQ_ERR_USAGE, "%d token(s): the next-token loss needs at least 2 (BOS and one more)", T);
    for (int t = 0; t < T; t++)
        if (tokens[t] < 0 || tokens[t] >= m->info.vocab_size)
            return kvq_fail(err, KVQ_ERR_USAGE, "token %d at position %d: expected an id below the vocabulary size %d",
                            tokens[t], t, m->info.vocab_size);
    return KVQ_OK;
}

static void stream_free(kvq_fw_stream *s)
{
    free(s->x), free(s->lmax), free(s->lsum), free(s->ltgt), free(s->lw), free(s->amax), free(s->arg);
    memset(s, 0, sizeof *s);
}

static kvq_status stream_alloc(kvq_fw_stream *s, kvq_eval_item *item, const kvq_resolved_spec *spec, int T, int dim,
                               kvq_error *err)
{
    memset(s, 0, sizeof *s);
    s->item = item, s->spec = spec;
    size_t n = (size_t)T;
    s->x = kvq_alloc_array(n, (size_t)dim * sizeof(float));
    s->lmax = calloc(n, sizeof(double)), s->lsum = calloc(n, sizeof(double));
    s->ltgt = calloc(n, sizeof(double)), s->lw = calloc(n, sizeof(double));
    s->amax = calloc(n, sizeof(float)), s->arg = calloc(n, sizeof(int));
    if (!s->x || !s->lmax || !s->lsum || !s->ltgt || !s->lw || !s->amax || !s->arg) {
        stream_free(s);
        return kvq_fail(err, KVQ_ERR_NOMEM, "out of memory for a hidden state of %d tokens", T);
    }
    return KVQ_OK;
}

/* ---------------------------------------------------------------- dump */

typedef struct dump_job {
    kvq_dump_writer *w;
    const kvq_model *m;
    const int *map; /* model layer -> dump layer, or -1 */
} dump_job;

static kvq_status dump_layer(void *ud, int layer, const kvq_layer *L, kvq_error *err)
{
    dump_job *j = ud;
    if (j->map[layer] < 0) return KVQ_OK;
    kvq_status st = kvq_dump_writer_layer(j->w, j->map[layer], L, err);
    int W = kvq_model_layer_window(j->m, layer);
    if (!st && W > 0) st = kvq_dump_writer_layer_attr_int(j->w, j->map[layer], "sliding_window", W, err);
    return st;
}

kvq_status kvq_model_dump(kvq_model *m, const int *tokens, int T, const int *layers, int nlayers, const char *out_path,
                          int nthreads, double *mean_nll, kvq_error *err)
{
    const kvq_model_info *in = &m->info;
    kvq_status st = check_tokens(m, tokens, T, err);
    if (st) return st;
    int L = in->n_layers, nsel = layers ? nlayers : L;
    int *map = kvq_alloc_array((size_t)L, sizeof *map);
    kvq_fw_stream s = {0};
    dump_job job = {0};
    if (!map) return kvq_fail(err, KVQ_ERR_NOMEM, "out of memory");
    for (int l = 0; l < L; l++) map[l] = layers ? -1 : l;
    for (int i = 0; layers && i < nlayers; i++) {
        if (layers[i] < 0 || layers[i] >= L) {
            free(map);
            return kvq_fail(err, KVQ_ERR_USAGE, "%s: layer %d: expected 0..%d (the model has %d)", m->path, layers[i],
                            L - 1, L);
        }
        map[layers[i]] = i;
    }
    kvq_dump_info info = {.num_layers = nsel, .num_heads = in->n_heads, .num_kv_heads = in->n_kv_heads,
                          .head_dim = in->head_dim, .seq_len = T, .has_rope_theta = 1, .rope_theta = in->rope_theta,
                          .rope_style = in->rope_style};
    snprintf(info.model, sizeof info.model, "%s", in->name);
    if ((st = stream_alloc(&s, NULL, NULL, T, in->dim, err))) goto done;
    if ((st = kvq_dump_writer_create(out_path, &info, KVQ_F32, &job.w, err))) goto done;
    job.map = map, job.m = m;
    double scale = in->attn_scale > 0 ? in->attn_scale : 1.0 / sqrt((double)in->head_dim);
    if ((st = kvq_dump_writer_attr_real(job.w, "attn_scale", scale, err))) goto done;
    const char *base = strrchr(m->path, '/');
    if ((st = kvq_dump_writer_attr_string(job.w, "source_model", base ? base + 1 : m->path, err)) ||
        (st = kvq_dump_writer_attr_string(job.w, "source_format", in->format, err)) ||
        (st = kvq_dump_writer_attr_ints(job.w, "tokens", tokens, (size_t)T, err)) ||
        (st = kvq_dump_writer_attr_ints(job.w, "vocab_size", &in->vocab_size, 0, err)))
        goto done;
    if (layers && (st = kvq_dump_writer_attr_ints(job.w, "source_layers", layers, (size_t)nlayers, err))) goto done;
    if (kvq_model_rope_tabled(m)) { /* scaled RoPE: the exact angles as tables */
        kvq_rope r;
        if ((st = kvq_model_rope(m, T, in->rope_theta, in->rope_scale, &r, err))) goto done;
        size_t n = (size_t)T * (in->head_dim / 2);
        float *c = kvq_alloc_array(n, sizeof *c), *sn = kvq_alloc_array(n, sizeof *sn);
        if (c && sn) {
            for (size_t i = 0; i < n; i++) c[i] = (float)r.cos[i], sn[i] = (float)r.sin[i];
            st = kvq_dump_writer_rope_table(job.w, c, sn, err);
        } else {
            st = kvq_fail(err, KVQ_ERR_NOMEM, "out of memory");
        }
        free(c), free(sn);
        kvq_rope_free(&r);
        if (st) goto done;
    }
    kvq_fw_opts o = {
        .tokens = tokens, .T = T, .s = &s, .ns = 1, .nthreads = nthreads, .on_layer = dump_layer, .ud = &job};
    if ((st = kvq_forward(m, &o, err))) goto done;
    double nll = s.nll / (T - 1);
    if ((st = kvq_dump_writer_attr_real(job.w, "mean_nll", nll, err))) goto done;
    st = kvq_dump_writer_finish(job.w, err);
    job.w = NULL;
    if (!st && mean_nll) *mean_nll = nll;
done:
    kvq_dump_writer_abort(job.w);
    stream_free(&s);
    free(map);
    return st;
}

/* ---------------------------------------------------------------- eval */

typedef struct eval_progress {
    const kvq_eval_opts *o;
    int pass, npasses;
} eval_progress;

static void eval_tick(void *ud, int layer, int nlayers)
{
    eval_progress *p = ud;
    p->o->progress(p->o->ud, p->pass, p->npasses, layer, nlayers);
}

void kvq_eval_sums_add(kvq_eval_sums *a, const kvq_eval_sums *w)
{
    a->nll += w->nll, a->kl += w->kl, a->top1 += w->top1, a->positions += w->positions;
    a->k_bits += w->k_bits, a->v_bits += w->v_bits, a->elements += w->elements;
    a->ctx_k_bits += w->ctx_k_bits, a->ctx_v_bits += w->ctx_v_bits, a->ctx_elements += w->ctx_elements;
    a->cache_tokens += w->cache_tokens;
    double n = a->d_n + w->d_n;
    if (n > 0) {
        double delta = w->d_mean - a->d_mean;
        a->d_m2 += w->d_m2 + delta * delta * a->d_n * w->d_n / n;
        a->d_mean += delta * w->d_n / n;
        a->d_n = n;
    }
}

void kvq_eval_item_finish(kvq_eval_item *it, const kvq_eval_sums *a)
{
    double npos = a->positions;
    it->nll = a->nll / npos, it->kl = a->kl / npos, it->top1 = a->top1 / npos;
    it->k_bits = a->elements ? a->k_bits / a->elements : NAN, it->v_bits = a->elements ? a->v_bits / a->elements : NAN;
    it->positions = (int)npos;
    it->dnll_se = a->d_n > 1 ? sqrt(a->d_m2 / (a->d_n - 1)) / sqrt(a->d_n) : NAN;
    it->cache_tokens = a->cache_tokens / npos;
}

/* A stream's sums over one window's npos scored positions. */
static kvq_eval_sums stream_sums(const kvq_fw_stream *s, double npos)
{
    return (kvq_eval_sums){.nll = s->nll, .kl = s->kl, .top1 = s->top1, .positions = npos, .k_bits = s->k_bits,
                           .v_bits = s->v_bits, .elements = s->n_elem, .d_n = s->d_n, .d_mean = s->d_mean,
                           .d_m2 = s->d_m2, .ctx_k_bits = s->ctx_k_bits, .ctx_v_bits = s->ctx_v_bits,
                           .ctx_elements = s->ctx_elem,
                           .cache_tokens = s->cache_div > 0 ? s->cache_held / s->cache_div : 0};
}

/* One window: the exact model and the items, in passes bounded by memory. */
static kvq_status eval_window(kvq_model *m, const int *tokens, int T, int score_from, kvq_eval_item *items,
                              kvq_resolved_spec *const *res, int nitems,
                              const kvq_eval_opts *o, int w, int wi, size_t total, kvq_eval_sums *wsum,
                              kvq_eval_sums *wref, kvq_error *err)
{
    size_t per_win = (size_t)(T - 1 - score_from);
    const kvq_model_info *in = &m->info;
    size_t per = (size_t)T * ((size_t)in->dim * sizeof(float) + 4 * sizeof(double) + sizeof(float) + sizeof(int));
    size_t budget = o->max_bytes ? o->max_bytes : (size_t)4 << 30;
    int batch = (int)(budget / per > 0 ? budget / per : 1);
    if (batch > nitems) batch = nitems > 0 ? nitems : 1;
    int npasses = nitems ? (nitems + batch - 1) / batch : 1;
    kvq_fw_stream *s = calloc((size_t)batch + 1, sizeof *s);
    if (!s) return kvq_fail(err, KVQ_ERR_NOMEM, "out of memory");
    eval_progress ep = {o, 0, npasses};
    kvq_status st = KVQ_OK;
    for (int pass = 0; pass < npasses && !st; pass++) {
        int i0 = pass * batch, n = nitems - i0 < batch ? nitems - i0 : batch, ns = 0;
        st = stream_alloc(&s[ns++], NULL, NULL, T, in->dim, err); /* the exact model */
        for (int i = 0; i < n && !st; i++) st = stream_alloc(&s[ns++], &items[i0 + i], res[i0 + i], T, in->dim, err);
        ep.pass = pass;
        for (int i = 0; i < ns; i++) { /* row 0: the exact model (once), row 1 + k: item k */
            size_t at = (size_t)(i ? i0 + i : 0) * total + (size_t)wi * per_win;
            if (o->position_nll) s[i].pos_nll = i == 0 && pass ? NULL : o->position_nll + at;
            if (o->position_hit) s[i].pos_hit = i == 0 && pass ? NULL : o->position_hit + at;
        }
        kvq_fw_opts fo = {.tokens = tokens, .T = T, .s = s, .ns = ns, .nthreads = o->nthreads, .stride = o->stride,
                          .score_from = score_from, .context = o->context, .seed = o->seed, .calib = o->calib,
                          .progress = o->progress ? eval_tick : NULL, .progress_ud = &ep, .logit_pos = o->logit_pos,
                          .n_logit_pos = pass || wi ? 0 : o->n_logit_pos, .logits = o->logits};
        if (!st && !(st = kvq_forward(m, &fo, err))) {
            if (pass == 0) *wref = (kvq_eval_sums){.nll = s[0].nll, .positions = (double)per_win};
            for (int i = 1; i < ns; i++) wsum[i0 + i - 1] = stream_sums(&s[i], (double)per_win);
        }
        for (int i = 0; i < ns; i++) stream_free(&s[i]); /* a failed allocation left its stream zeroed */
    }
    free(s);
    return st;
}

/* Decode-time compression (a tokens(...) with target=, SPEC §3.11) needs
 * the decode policy; with keep= too, a context (PrefillDecodingPress). */
static kvq_status check_decoding(const kvq_eval_item *it, const kvq_resolved_spec *res, int nlayers, int context,
                                 kvq_error *err)
{
    for (int l = 0; res && l < nlayers; l++) {
        const kvq_tokens_parts *tp = kvq_resolved_spec_parts(res, l);
        const kvq_token_sel_opts *o = tp ? kvq_spec_opts(&tp->sel) : NULL;
        if (!o || o->target == KVQ_UNSET) continue;
        const char *text = kvq_resolved_spec_at(res, l)->text;
        if (it->policy != KVQ_POLICY_DECODE)
            return kvq_fail(err, KVQ_ERR_USAGE, "%s: target=%d compresses while decoding: expected --policy decode "
                            "(prefill compresses a whole cache once, by keep=)", text, o->target);
        int window = tp->selector == KVQ_SEL_WINDOW; /* its recent= is its keep= */
        if ((window ? o->recent > 0 : !isnan(o->keep)) && context <= 0)
            return kvq_fail(err, KVQ_ERR_USAGE, "%s: %s with target= compresses a context once, then while "
                            "decoding: expected --context N", text, window ? "window's recent=" : "keep=");
        if (!isnan(o->adaptive))
            return kvq_fail(err, KVQ_ERR_USAGE, "%s: adaptive= with target=: not supported (while decoding every head "
                            "keeps target tokens)", text);
        if (o->buffer == 0 && kvq_token_selector_needs_queries(tp->selector))
            return kvq_fail(err, KVQ_ERR_USAGE, "%s: buffer=0 leaves %s no queries to score with: expected buffer >= 1",
                            text, tp->sel.q->name);
    }
    return KVQ_OK;
}

kvq_status kvq_model_eval(kvq_model *m, const int *tokens, int T, kvq_eval_item *items, int nitems,
                          const kvq_eval_opts *o, double *nll_ref, kvq_error *err)
{
    const kvq_model_info *in = &m->info;
    int N = o->chunk > 0 ? o->chunk : T;
    if (o->chunk > 0 && (o->chunk < 4 || o->chunk > in->context_length))
        return kvq_fail(err, KVQ_ERR_USAGE, "--chunk %d: expected 4..%d (the model's context length)", o->chunk,
                        in->context_length);
    int W = o->chunk > 0 ? T / N : 1;
    if (o->chunks > 0 && W > o->chunks) W = o->chunks;
    if (W < 1)
        return kvq_fail(err, KVQ_ERR_USAGE, "%d tokens: fewer than one window of --chunk %d", T, o->chunk);
    int w0 = 0, w1 = W; /* a shard's windows */
    if (o->window_begin || o->window_end) {
        if (o->chunk <= 0 || o->window_begin < 0 || o->window_end > W || o->window_begin >= o->window_end)
            return kvq_fail(err, KVQ_ERR_USAGE, "windows [%d, %d): expected a non-empty range of the %d windows of "
                            "--chunk %d", o->window_begin, o->window_end, W, o->chunk);
        w0 = o->window_begin, w1 = o->window_end;
    }
    kvq_status st = check_tokens(m, tokens + (size_t)w0 * N, o->chunk > 0 ? (w1 - w0) * N : T, err);
    if (st) return st;
    kvq_dump_info shape = {.num_layers = in->n_layers, .num_heads = in->n_heads, .num_kv_heads = in->n_kv_heads,
                           .head_dim = in->head_dim, .seq_len = N};
    kvq_eval_sums *acc = NULL, *wsum = NULL;
    int *win = NULL;
    kvq_resolved_spec **res = calloc((size_t)nitems + 1, sizeof *res); /* each item's spec parsed once for the model */
    if (!res) return kvq_fail(err, KVQ_ERR_NOMEM, "out of memory");
    for (int i = 0; i < nitems && !st; i++) {
        const kvq_spec *sp = items[i].spec;
        if (items[i].layer < -1 || items[i].layer >= in->n_layers)
            st = kvq_fail(err, KVQ_ERR_USAGE, "%s: layer %d: expected 0..%d (or -1: every layer)", m->path,
                          items[i].layer, in->n_layers - 1);
        else if (sp && !(st = kvq_spec_resolve(sp, in->n_layers, &res[i], err)) && kvq_resolved_spec_needs_calib(res[i]) &&
                 !(st = kvq_spec_check_calib(sp, o->calib != NULL, err)))
            st = kvq_calib_check(o->calib, m->path, &shape, err);
    }
    for (int i = 0; i < nitems && !st; i++)
        st = check_decoding(&items[i], res[i], in->n_layers, o->context, err);
    if (!st && o->score_from && (o->score_from < (o->context > 0 ? o->context : 1) || o->score_from > N - 2))
        st = kvq_fail(err, KVQ_ERR_USAGE, "scoring from position %d: expected %d..%d", o->score_from,
                      o->context > 0 ? o->context : 1, N - 2);
    if (!st && o->context && (o->context < 1 || o->context > N - 2))
        st = kvq_fail(err, KVQ_ERR_USAGE, "a context of %d tokens: expected 1..%d (a context and at least one "
                      "scored position in %s of %d tokens)", o->context, N - 2, o->chunk > 0 ? "each window" : "the text", N);
    for (int i = 0; !st && i < o->n_logit_pos; i++)
        if (!o->logits || o->logit_pos[i] < 0 || o->logit_pos[i] >= N)
            st = kvq_fail(err, KVQ_ERR_USAGE,
                          "logits of position %d: expected a position below %d and an output array", o->logit_pos[i],
                          N);
    if (st) goto done;
    acc = calloc((size_t)nitems + 1, sizeof *acc), wsum = calloc((size_t)nitems + 1, sizeof *wsum);
    win = kvq_alloc_array((size_t)N, sizeof *win);
    if (!acc || !wsum || !win) {
        st = kvq_fail(err, KVQ_ERR_NOMEM, "out of memory");
        goto done;
    }
    /* llama.cpp's perplexity: each window starts with BOS when the tokenizer adds one */
    int bos = o->chunk > 0 && m->vocab.n && m->vocab.add_bos;
    /* the first scored position */
    int from = o->score_from > 0 ? o->score_from : o->context > 0 ? o->context : o->chunk > 0 ? N / 2 : 0;
    kvq_eval_sums ref = {0}, wref = {0};
    for (int w = w0; w < w1 && !st; w++) {
        memcpy(win, tokens + (size_t)w * N, (size_t)N * sizeof *win);
        if (bos) win[0] = m->vocab.bos;
        st = eval_window(m, win, N, from, items, res, nitems, o, w, w - w0,
                         (size_t)(w1 - w0) * (size_t)(N - 1 - from), wsum, &wref, err);
        if (!st && o->window_done) st = o->window_done(o->window_ud, w, &wref, wsum, err);
        if (st) break;
        kvq_eval_sums_add(&ref, &wref);
        for (int i = 0; i < nitems; i++) kvq_eval_sums_add(&acc[i], &wsum[i]);
        if (o->window_progress) o->window_progress(o->ud, w + 1 - w0, w1 - w0);
    }
    if (!st) {
        if (nll_ref) *nll_ref = ref.nll / ref.positions;
        for (int i = 0; i < nitems; i++) kvq_eval_item_finish(&items[i], &acc[i]);
    }
done:
    for (int i = 0; i < nitems; i++) kvq_resolved_spec_free(res[i]);
    free(res), free(acc), free(wsum), free(win);
    return st;
}

/* ------------------------------------------------------------ fingerprint */

uint64_t kvq_eval_fingerprint(const kvq_model *m, const int *tokens, int T, kvq_policy policy, const kvq_eval_opts *o,
                              const char *calib_path)
{
    uint64_t h = KVQ_FNV_SEED;
    size_t size = m->map_size, head = size < (1u << 20) ? size : (1u << 20);
    h = kvq_fnv1a(h, (const char *)&size, sizeof size);
    h = kvq_fnv1a(h, (const char *)m->map, head);
    h = kvq_fnv1a(h, (const char *)m->map + (size - head), head);
    h = kvq_fnv1a(h, (const char *)&T, sizeof T);
    h = kvq_fnv1a(h, (const char *)tokens, (size_t)T * sizeof *tokens);
    int v[4] = {(int)policy, policy == KVQ_POLICY_DECODE && o->stride > 1 ? o->stride : 1, o->chunk, o->chunk ? o->chunks : 0};
    h = kvq_fnv1a(h, (const char *)v, sizeof v);
    if (o->context) h = kvq_fnv1a(h, (const char *)&o->context, sizeof o->context); /* runs without it keep their hash */
    h = kvq_fnv1a(h, (const char *)&o->seed, sizeof o->seed);
    return kvq_fingerprint_file(h, calib_path);
}

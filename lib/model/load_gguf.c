/* load_gguf.c — a GGUF file as a model (SPEC §8): architecture `llama`
 * (interleaved RoPE on the converter's permuted Q/K weights) or `qwen2`
 * (QKV biases, `half` RoPE); hyper-parameters from `{arch}.*` metadata,
 * tensors bound by llama.cpp's names and checked against those shapes, and
 * the SentencePiece vocabulary when `tokenizer.ggml.model` is `llama`. */
#include "model.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

static kvq_status bind(kvq_model *m, kvq_wtensor *w, const char *name, int64_t cols, int64_t rows, int required,
                       kvq_error *err)
{
    const gguf_tensor *t = kvq_gguf_tensor(&m->gguf, name);
    memset(w, 0, sizeof *w);
    if (!t) {
        if (!required) return KVQ_OK;
        return kvq_fail(err, KVQ_ERR_FORMAT, "%s: tensor %s: missing (required by architecture %s)", m->path, name,
                        m->info.arch_name);
    }
    int64_t trows = t->ne[1] * t->ne[2] * t->ne[3];
    if (t->ne[0] != cols || trows != rows)
        return kvq_fail(err, KVQ_ERR_FORMAT, "%s: tensor %s: expected [%lld, %lld] (ne0 = columns), got [%lld, %lld]", m->path,
                        name, (long long)cols, (long long)rows, (long long)t->ne[0], (long long)trows);
    w->name = t->name, w->type = t->type, w->cols = cols, w->rows = rows, w->data = t->data;
    w->row_bytes = rows ? t->nbytes / (size_t)rows : 0;
    return KVQ_OK;
}

/* A required positive integer hyper-parameter `{arch}.suffix`. */
static kvq_status hparam(kvq_model *m, const char *suffix, int required, int64_t def, int64_t max, int *out,
                         kvq_error *err)
{
    char key[128];
    int64_t v;
    snprintf(key, sizeof key, "%s.%s", m->info.arch_name, suffix);
    int r = kvq_gguf_get_int(&m->gguf, key, &v);
    if (r == 0 && !required) v = def;
    else if (r == 0) return kvq_fail(err, KVQ_ERR_FORMAT, "%s: metadata %s: missing (required)", m->path, key);
    else if (r < 0) return kvq_fail(err, KVQ_ERR_FORMAT, "%s: metadata %s: expected an integer", m->path, key);
    if (v < 1 || v > max)
        return kvq_fail(err, KVQ_ERR_FORMAT, "%s: metadata %s: %lld: expected 1..%lld", m->path, key, (long long)v, (long long)max);
    *out = (int)v;
    return KVQ_OK;
}

static kvq_status load_vocab(kvq_model *m, kvq_error *err)
{
    const char *s;
    uint64_t len;
    kvq_gguf *g = &m->gguf;
    if (kvq_gguf_get_str(g, "tokenizer.ggml.model", &s, &len) != 1) {
        snprintf(m->tokenizer_missing, sizeof m->tokenizer_missing, "the file has no tokenizer.ggml.model");
        return KVQ_OK;
    }
    snprintf(m->info.tokenizer, sizeof m->info.tokenizer, "%.*s", (int)(len < 60 ? len : 60), s);
    if (strcmp(m->info.tokenizer, "llama")) {
        snprintf(m->tokenizer_missing, sizeof m->tokenizer_missing,
                 "tokenizer.ggml.model \"%s\" is not implemented (kvq reads the SentencePiece \"llama\" one)", m->info.tokenizer);
        return KVQ_OK;
    }
    const gguf_kv *tk = kvq_gguf_find(g, "tokenizer.ggml.tokens"), *sc = kvq_gguf_find(g, "tokenizer.ggml.scores");
    if (!tk || tk->type != GGUF_ARRAY || tk->arr_type != GGUF_STRING)
        return kvq_fail(err, KVQ_ERR_FORMAT, "%s: metadata tokenizer.ggml.tokens: expected an array of strings", m->path);
    if (sc && (sc->type != GGUF_ARRAY || sc->arr_type != GGUF_F32 || sc->n != tk->n))
        return kvq_fail(err, KVQ_ERR_FORMAT, "%s: metadata tokenizer.ggml.scores: expected %llu float32 values", m->path,
                        (unsigned long long)tk->n);
    if (tk->n != (uint64_t)m->info.vocab_size)
        return kvq_fail(err, KVQ_ERR_FORMAT, "%s: metadata tokenizer.ggml.tokens: %llu tokens, but token_embd has %d rows",
                        m->path, (unsigned long long)tk->n, m->info.vocab_size);
    kvq_vocab *v = &m->vocab;
    v->n = (int)tk->n;
    v->piece = calloc((size_t)v->n, sizeof *v->piece);
    v->score = calloc((size_t)v->n, sizeof *v->score);
    if (!v->piece || !v->score) return kvq_fail(err, KVQ_ERR_NOMEM, "%s: out of memory for the vocabulary", m->path);
    const uint8_t *p = tk->val; /* bounds were checked by the parser */
    for (int i = 0; i < v->n; i++) {
        uint64_t n;
        memcpy(&n, p, 8);
        if (!(v->piece[i] = malloc((size_t)n + 1))) return kvq_fail(err, KVQ_ERR_NOMEM, "%s: out of memory", m->path);
        memcpy(v->piece[i], p + 8, (size_t)n);
        v->piece[i][n] = '\0';
        p += 8 + n;
        if (sc) memcpy(&v->score[i], sc->val + 4 * (size_t)i, 4);
    }
    int64_t bos = 1, asp = 1;
    if (kvq_gguf_get_int(g, "tokenizer.ggml.bos_token_id", &bos) < 0 || bos < 0 || bos >= v->n)
        return kvq_fail(err, KVQ_ERR_FORMAT, "%s: metadata tokenizer.ggml.bos_token_id: expected a token id below %d", m->path, v->n);
    if (kvq_gguf_get_int(g, "tokenizer.ggml.add_space_prefix", &asp) < 0)
        return kvq_fail(err, KVQ_ERR_FORMAT, "%s: metadata tokenizer.ggml.add_space_prefix: expected a boolean", m->path);
    v->bos = (int)bos, v->add_space_prefix = asp != 0, v->space_is_u2581 = 1, v->byte_base = -1;
    m->info.has_tokenizer = 1;
    return kvq_vocab_index(v, err);
}

kvq_status kvq_model_load_gguf(kvq_model *m, kvq_error *err)
{
    kvq_status st = kvq_gguf_parse(&m->gguf, m->path, m->map, m->map_size, err);
    if (st) return st;
    kvq_gguf *g = &m->gguf;
    kvq_model_info *in = &m->info;
    const char *s;
    uint64_t len;
    snprintf(in->format, sizeof in->format, "GGUF v%u", g->version);
    if (kvq_gguf_get_str(g, "general.architecture", &s, &len) != 1)
        return kvq_fail(err, KVQ_ERR_FORMAT, "%s: metadata general.architecture: missing (required)", m->path);
    snprintf(in->arch_name, sizeof in->arch_name, "%.*s", (int)(len < 60 ? len : 60), s);
    if (!strcmp(in->arch_name, "llama")) in->arch = KVQ_ARCH_LLAMA;
    else if (!strcmp(in->arch_name, "qwen2")) in->arch = KVQ_ARCH_QWEN2;
    else
        return kvq_fail(err, KVQ_ERR_UNSUPPORTED, "%s: architecture \"%s\" is not supported (kvq runs llama and qwen2)",
                        m->path, in->arch_name);
    if (kvq_gguf_get_str(g, "general.name", &s, &len) == 1)
        snprintf(in->name, sizeof in->name, "%.*s", (int)(len < 250 ? len : 250), s);
    else
        snprintf(in->name, sizeof in->name, "%s", in->arch_name);
    const int64_t big = 1 << 20;
    if ((st = hparam(m, "block_count", 1, 0, 4096, &in->n_layers, err)) ||
        (st = hparam(m, "embedding_length", 1, 0, big, &in->dim, err)) ||
        (st = hparam(m, "feed_forward_length", 1, 0, 4 * big, &in->ffn_dim, err)) ||
        (st = hparam(m, "attention.head_count", 1, 0, 4096, &in->n_heads, err)) ||
        (st = hparam(m, "attention.head_count_kv", 0, in->n_heads, 4096, &in->n_kv_heads, err)) ||
        (st = hparam(m, "context_length", 0, 1 << 30, 1 << 30, &in->context_length, err)) ||
        (st = hparam(m, "attention.key_length", 0, in->dim / in->n_heads, 1 << 16, &in->head_dim, err)))
        return st;
    if (in->n_heads % in->n_kv_heads)
        return kvq_fail(err, KVQ_ERR_FORMAT, "%s: head_count %d is not a multiple of head_count_kv %d", m->path, in->n_heads, in->n_kv_heads);
    if (in->head_dim % 2)
        return kvq_fail(err, KVQ_ERR_FORMAT, "%s: head dimension %d: expected an even number (RoPE pairs)", m->path, in->head_dim);
    int n_rot;
    if ((st = hparam(m, "rope.dimension_count", 0, in->head_dim, 1 << 16, &n_rot, err))) return st;
    if (n_rot != in->head_dim)
        return kvq_fail(err, KVQ_ERR_UNSUPPORTED, "%s: %s.rope.dimension_count %d: partial rotary embeddings (head_dim %d) are not supported",
                        m->path, in->arch_name, n_rot, in->head_dim);
    char key[128];
    double v = 1e-5;
    snprintf(key, sizeof key, "%s.attention.layer_norm_rms_epsilon", in->arch_name);
    if (kvq_gguf_get_real(g, key, &v) < 0 || !(v > 0) || !(v < 1))
        return kvq_fail(err, KVQ_ERR_FORMAT, "%s: metadata %s: expected a small positive number", m->path, key);
    in->norm_eps = (float)v;
    v = 10000.0;
    snprintf(key, sizeof key, "%s.rope.freq_base", in->arch_name);
    if (kvq_gguf_get_real(g, key, &v) < 0 || !(v > 1) || !isfinite(v))
        return kvq_fail(err, KVQ_ERR_FORMAT, "%s: metadata %s: expected a number above 1", m->path, key);
    in->rope_theta = v;
    in->rope_style = in->arch == KVQ_ARCH_QWEN2 ? KVQ_ROPE_HALF : KVQ_ROPE_INTERLEAVED;

    const gguf_tensor *emb = kvq_gguf_tensor(g, "token_embd.weight");
    if (!emb) return kvq_fail(err, KVQ_ERR_FORMAT, "%s: tensor token_embd.weight: missing (required)", m->path);
    if (emb->ne[1] < 1 || emb->ne[1] > (1 << 24))
        return kvq_fail(err, KVQ_ERR_FORMAT, "%s: tensor token_embd.weight: %lld rows: expected a vocabulary of 1..2^24 tokens",
                        m->path, (long long)emb->ne[1]);
    in->vocab_size = (int)emb->ne[1];
    int dim = in->dim, qd = in->n_heads * in->head_dim, kd = in->n_kv_heads * in->head_dim, V = in->vocab_size;
    if ((st = bind(m, &m->tok_embd, "token_embd.weight", dim, V, 1, err)) ||
        (st = bind(m, &m->output_norm, "output_norm.weight", dim, 1, 1, err)) ||
        (st = bind(m, &m->output, "output.weight", dim, V, 0, err)) ||
        (st = bind(m, &m->rope_freqs, "rope_freqs.weight", in->head_dim / 2, 1, 0, err)))
        return st;
    in->tied_output = !m->output.data;
    if (in->tied_output) m->output = m->tok_embd;
    in->has_rope_freqs = m->rope_freqs.data != NULL;
    in->has_qkv_bias = in->arch == KVQ_ARCH_QWEN2;
    if (!(m->layer = calloc((size_t)in->n_layers, sizeof *m->layer)))
        return kvq_fail(err, KVQ_ERR_NOMEM, "%s: out of memory", m->path);
    for (int l = 0; l < in->n_layers; l++) {
        kvq_layer_weights *w = &m->layer[l];
        char n[12][64];
        const char *suffix[12] = {"attn_norm.weight", "attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_q.bias",
                                  "attn_k.bias", "attn_v.bias", "attn_output.weight", "ffn_norm.weight", "ffn_gate.weight",
                                  "ffn_up.weight", "ffn_down.weight"};
        for (int i = 0; i < 12; i++) snprintf(n[i], sizeof n[i], "blk.%d.%s", l, suffix[i]);
        int bias = in->has_qkv_bias;
        if ((st = bind(m, &w->attn_norm, n[0], dim, 1, 1, err)) || (st = bind(m, &w->wq, n[1], dim, qd, 1, err)) ||
            (st = bind(m, &w->wk, n[2], dim, kd, 1, err)) || (st = bind(m, &w->wv, n[3], dim, kd, 1, err)) ||
            (st = bind(m, &w->bq, n[4], qd, 1, bias, err)) || (st = bind(m, &w->bk, n[5], kd, 1, bias, err)) ||
            (st = bind(m, &w->bv, n[6], kd, 1, bias, err)) || (st = bind(m, &w->wo, n[7], qd, dim, 1, err)) ||
            (st = bind(m, &w->ffn_norm, n[8], dim, 1, 1, err)) || (st = bind(m, &w->w_gate, n[9], dim, in->ffn_dim, 1, err)) ||
            (st = bind(m, &w->w_up, n[10], dim, in->ffn_dim, 1, err)) || (st = bind(m, &w->w_down, n[11], in->ffn_dim, dim, 1, err)))
            return st;
    }
    return load_vocab(m, err);
}

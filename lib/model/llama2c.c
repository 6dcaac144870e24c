/* llama2c.c — Karpathy's llama2.c checkpoints, version 0 (docs/models.md): a
 * header of seven int32 (dim, hidden_dim, n_layers, n_heads, n_kv_heads,
 * vocab_size — negative when the classifier is not shared — and seq_len),
 * then float32 weights in a fixed order; and its tokenizer.bin.  The file
 * has no magic, so its size must be exactly what the header implies. */
#include "model.h"
#include "../formats/formats.h"

#include <errno.h>
#include <stdio.h>
#include <string.h>

/* A float32 matrix of `rows` rows of `cols` at *off (advanced). */
static void take_f32(kvq_model *m, kvq_wtensor *w, const char *name, size_t *off, int64_t cols, int64_t rows)
{
    w->name = name, w->type = KVQ_GGML_F32, w->cols = cols, w->rows = rows;
    w->data = (const uint8_t *)m->map + *off;
    w->row_bytes = (size_t)cols * 4;
    *off += (size_t)cols * (size_t)rows * 4;
}

static kvq_status load_tokenizer(kvq_model *m, const char *path, kvq_error *err)
{
    kvq_vocab *v = &m->vocab;
    FILE *f = fopen(path, "rb");
    if (!f) return kvq_fail(err, KVQ_ERR_IO, "%s: cannot open: %s", path, strerror(errno));
    kvq_status st = KVQ_OK;
    int32_t maxlen;
    v->n = m->info.vocab_size;
    v->piece = calloc((size_t)v->n, sizeof *v->piece);
    v->score = calloc((size_t)v->n, sizeof *v->score);
    if (!v->piece || !v->score) { st = kvq_fail(err, KVQ_ERR_NOMEM, "%s: out of memory", path); goto done; }
    if (fread(&maxlen, 4, 1, f) != 1 || maxlen < 1 || maxlen > (1 << 16)) {
        st = kvq_fail(err, KVQ_ERR_FORMAT, "%s: not a llama2.c tokenizer (expected max_token_length 1..65536 first)",
                      path);
        goto done;
    }
    for (int i = 0; i < v->n; i++) {
        int32_t len;
        if (fread(&v->score[i], 4, 1, f) != 1 || fread(&len, 4, 1, f) != 1) {
            st = kvq_fail(err, KVQ_ERR_FORMAT, "%s: token %d: truncated file (the model has %d tokens)", path, i, v->n);
            goto done;
        }
        if (len < 0 || len > maxlen) {
            st = kvq_fail(err, KVQ_ERR_FORMAT, "%s: token %d: length %d: expected 0..%d", path, i, len, maxlen);
            goto done;
        }
        if (!(v->piece[i] = malloc((size_t)len + 1))) {
            st = kvq_fail(err, KVQ_ERR_NOMEM, "%s: out of memory", path);
            goto done;
        }
        if (fread(v->piece[i], 1, (size_t)len, f) != (size_t)len) {
            st = kvq_fail(err, KVQ_ERR_FORMAT, "%s: token %d: truncated file", path, i);
            goto done;
        }
        v->piece[i][len] = '\0';
    }
    if (fgetc(f) != EOF) { /* llama2.c reads vocab_size entries; a longer file belongs to another model */
        st = kvq_fail(err, KVQ_ERR_FORMAT,
                      "%s: more tokens than the model's vocabulary of %d (a tokenizer of another model?)", path, v->n);
        goto done;
    }
    v->bos = 1, v->add_bos = 1, v->byte_base = 3, v->space_is_u2581 = 0, v->add_space_prefix = 1;
    if (v->n <= 258) {
        st = kvq_fail(err, KVQ_ERR_FORMAT, "%s: %d tokens: a llama2.c vocabulary has the 256 byte tokens after id 2",
                      path, v->n);
        goto done;
    }
    snprintf(m->info.tokenizer, sizeof m->info.tokenizer, "llama2.c");
    m->info.has_tokenizer = 1;
    st = kvq_vocab_index(v, err);
done:
    fclose(f);
    return st;
}

kvq_status kvq_model_load_llama2c(kvq_model *m, const char *tokenizer_path, kvq_error *err)
{
    int32_t h[7];
    kvq_model_info *in = &m->info;
    if (m->map_size < sizeof h)
        return kvq_fail(err, KVQ_ERR_FORMAT, "%s: not a model file (expected GGUF or a llama2.c checkpoint)", m->path);
    memcpy(h, m->map, sizeof h);
    if (!memcmp(m->map, "ak42", 4))
        return kvq_fail(err, KVQ_ERR_UNSUPPORTED,
                        "%s: llama2.c checkpoint of version 1 or later: kvq reads version 0 (legacy export)", m->path);
    int dim = h[0], hidden = h[1], L = h[2], Hq = h[3], H = h[4], vocab = h[5] < 0 ? -h[5] : h[5], T = h[6];
    int shared = h[5] > 0;
    if (dim < 1 || hidden < 1 || L < 1 || L > 4096 || Hq < 1 || H < 1 || h[5] == 0 || h[5] == INT32_MIN || T < 1 ||
        dim % Hq || Hq % H || (dim / Hq) % 2)
        return kvq_fail(
            err, KVQ_ERR_FORMAT,
            "%s: not a model file: no GGUF magic, and the llama2.c header (dim %d, hidden_dim %d, n_layers %d, "
            "n_heads %d, n_kv_heads %d, vocab_size %d, seq_len %d) is not a valid one",
            m->path, h[0], h[1], h[2], h[3], h[4], h[5], h[6]);
    int hd = dim / Hq;
    /* expected size in double: an absurd header cannot overflow the check */
    double floats = (double)vocab * dim + (double)L * (2.0 * dim + (double)dim * Hq * hd + 2.0 * dim * H * hd +
                                                        (double)Hq * hd * dim + 3.0 * dim * hidden) +
                    dim + (double)T * hd + (shared ? 0 : (double)vocab * dim);
    double expect = 28 + 4 * floats;
    if (expect != (double)m->map_size)
        return kvq_fail(err, KVQ_ERR_FORMAT,
                        "%s: not a model file: no GGUF magic, and as a llama2.c checkpoint (dim %d, %d layers, vocab "
                        "%d, seq_len %d) "
                        "it should have %.0f bytes, not %zu",
                        m->path, dim, L, vocab, T, expect, m->map_size);
    snprintf(in->format, sizeof in->format, "llama2.c v0");
    snprintf(in->arch_name, sizeof in->arch_name, "llama");
    in->arch = KVQ_ARCH_LLAMA;
    const char *base = strrchr(m->path, '/');
    snprintf(in->name, sizeof in->name, "%s", base ? base + 1 : m->path);
    char *dot = strrchr(in->name, '.');
    if (dot && dot != in->name) *dot = '\0';
    in->n_layers = L, in->dim = dim, in->ffn_dim = hidden, in->n_heads = Hq, in->n_kv_heads = H, in->head_dim = hd;
    in->vocab_size = vocab, in->context_length = T, in->norm_eps = 1e-5f, in->rope_theta = 10000.0;
    in->rope_style = KVQ_ROPE_INTERLEAVED, in->tied_output = shared;
    if (!(m->layer = calloc((size_t)L, sizeof *m->layer)))
        return kvq_fail(err, KVQ_ERR_NOMEM, "%s: out of memory", m->path);
    size_t off = 28;
    int qd = Hq * hd, kd = H * hd;
    take_f32(m, &m->tok_embd, "token_embedding_table", &off, dim, vocab);
    /* each weight kind is stored for all layers, one layer after another */
    for (int l = 0; l < L; l++) take_f32(m, &m->layer[l].attn_norm, "rms_att_weight", &off, dim, 1);
    for (int l = 0; l < L; l++) take_f32(m, &m->layer[l].wq, "wq", &off, dim, qd);
    for (int l = 0; l < L; l++) take_f32(m, &m->layer[l].wk, "wk", &off, dim, kd);
    for (int l = 0; l < L; l++) take_f32(m, &m->layer[l].wv, "wv", &off, dim, kd);
    for (int l = 0; l < L; l++) take_f32(m, &m->layer[l].wo, "wo", &off, qd, dim);
    for (int l = 0; l < L; l++) take_f32(m, &m->layer[l].ffn_norm, "rms_ffn_weight", &off, dim, 1);
    for (int l = 0; l < L; l++) take_f32(m, &m->layer[l].w_gate, "w1", &off, dim, hidden);
    for (int l = 0; l < L; l++) take_f32(m, &m->layer[l].w_down, "w2", &off, hidden, dim);
    for (int l = 0; l < L; l++) take_f32(m, &m->layer[l].w_up, "w3", &off, dim, hidden);
    take_f32(m, &m->output_norm, "rms_final_weight", &off, dim, 1);
    off += (size_t)T * (size_t)hd * 4; /* freq_cis_real and _imag: kvq computes RoPE itself */
    if (shared) m->output = m->tok_embd;
    else take_f32(m, &m->output, "wcls", &off, dim, vocab);
    if (!tokenizer_path) {
        snprintf(m->tokenizer_missing, sizeof m->tokenizer_missing,
                 "a llama2.c checkpoint carries no vocabulary (give --tokenizer tokenizer.bin)");
        return KVQ_OK;
    }
    return load_tokenizer(m, tokenizer_path, err);
}

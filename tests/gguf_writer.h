/* gguf_writer.h — writes small GGUF v3 files for kvq's tests and model
 * benchmark: metadata of every value type, tensors of any ggml type given
 * as raw block bytes, the aligned data section.  Also random weights of a
 * given type (block scales set to small finite halves, codes random) and a
 * tiny Llama/Qwen2 model built from them. */
#ifndef KVQ_GGUF_WRITER_H
#define KVQ_GGUF_WRITER_H

#include "formats/formats.h" /* ggml type ids, the reference formats */

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct gw_buf {
    uint8_t *p;
    size_t n, cap;
} gw_buf;

static inline void gw_put(gw_buf *b, const void *src, size_t n)
{
    if (b->n + n > b->cap) {
        size_t nc = b->cap ? b->cap : 4096;
        while (nc < b->n + n) nc *= 2;
        b->p = realloc(b->p, nc);
        if (!b->p) abort();
        b->cap = nc;
    }
    memcpy(b->p + b->n, src, n);
    b->n += n;
}
static inline void gw_u32(gw_buf *b, uint32_t v) { gw_put(b, &v, 4); }
static inline void gw_u64(gw_buf *b, uint64_t v) { gw_put(b, &v, 8); }
static inline void gw_str(gw_buf *b, const char *s) { gw_u64(b, strlen(s)); gw_put(b, s, strlen(s)); }

typedef struct gw_tensor {
    char name[96];
    uint32_t n_dims;
    uint64_t ne[4];
    uint32_t type;
    uint8_t *data;
    size_t nbytes;
} gw_tensor;

typedef struct gguf_w {
    gw_buf kv;
    uint64_t nkv;
    gw_tensor *t;
    int nt;
    uint32_t alignment;
} gguf_w;

/* metadata */
static inline void gw_key(gguf_w *w, const char *k, uint32_t type)
{
    gw_str(&w->kv, k);
    gw_u32(&w->kv, type);
    w->nkv++;
}
static inline void gw_kv_u32(gguf_w *w, const char *k, uint32_t v) { gw_key(w, k, 4); gw_u32(&w->kv, v); }
static inline void gw_kv_i32(gguf_w *w, const char *k, int32_t v) { gw_key(w, k, 5); gw_put(&w->kv, &v, 4); }
static inline void gw_kv_f32(gguf_w *w, const char *k, float v) { gw_key(w, k, 6); gw_put(&w->kv, &v, 4); }
static inline void gw_kv_bool(gguf_w *w, const char *k, int v)
{
    uint8_t b = (uint8_t)v;
    gw_key(w, k, 7);
    gw_put(&w->kv, &b, 1);
}
static inline void gw_kv_str(gguf_w *w, const char *k, const char *v) { gw_key(w, k, 8); gw_str(&w->kv, v); }
static inline void gw_kv_u64(gguf_w *w, const char *k, uint64_t v) { gw_key(w, k, 10); gw_u64(&w->kv, v); }
static inline void gw_kv_f64(gguf_w *w, const char *k, double v) { gw_key(w, k, 12); gw_put(&w->kv, &v, 8); }
static inline void gw_kv_arr_str(gguf_w *w, const char *k, int n, char *const *v)
{
    gw_key(w, k, 9);
    gw_u32(&w->kv, 8);
    gw_u64(&w->kv, (uint64_t)n);
    for (int i = 0; i < n; i++) gw_str(&w->kv, v[i]);
}
static inline void gw_kv_arr_f32(gguf_w *w, const char *k, int n, const float *v)
{
    gw_key(w, k, 9);
    gw_u32(&w->kv, 6);
    gw_u64(&w->kv, (uint64_t)n);
    gw_put(&w->kv, v, 4 * (size_t)n);
}
static inline void gw_kv_arr_i32(gguf_w *w, const char *k, int n, const int32_t *v)
{
    gw_key(w, k, 9);
    gw_u32(&w->kv, 5);
    gw_u64(&w->kv, (uint64_t)n);
    gw_put(&w->kv, v, 4 * (size_t)n);
}

/* A tensor of `type` with ne = {cols, rows} (rows 0: a vector), raw bytes copied. */
static inline void gw_tensor_raw(gguf_w *w, const char *name, uint32_t type, uint64_t cols, uint64_t rows,
                                 const void *data, size_t nbytes)
{
    w->t = realloc(w->t, (size_t)(w->nt + 1) * sizeof *w->t);
    gw_tensor *t = &w->t[w->nt++];
    memset(t, 0, sizeof *t);
    snprintf(t->name, sizeof t->name, "%s", name);
    t->n_dims = rows ? 2 : 1;
    t->ne[0] = cols, t->ne[1] = rows ? rows : 1;
    t->type = type;
    t->data = malloc(nbytes ? nbytes : 1);
    memcpy(t->data, data, nbytes);
    t->nbytes = nbytes;
}

/* Serialises the file into *out (malloc'ed). */
static inline void gw_serialise(gguf_w *w, uint8_t **out, size_t *len)
{
    gw_buf b = {0};
    uint32_t al = w->alignment ? w->alignment : 32;
    gw_put(&b, "GGUF", 4);
    gw_u32(&b, 3);
    gw_u64(&b, (uint64_t)w->nt);
    gw_u64(&b, w->nkv);
    gw_put(&b, w->kv.p, w->kv.n);
    uint64_t off = 0;
    for (int i = 0; i < w->nt; i++) {
        gw_tensor *t = &w->t[i];
        gw_str(&b, t->name);
        gw_u32(&b, t->n_dims);
        for (uint32_t d = 0; d < t->n_dims; d++) gw_u64(&b, d < 4 ? t->ne[d] : 1);
        gw_u32(&b, t->type);
        gw_u64(&b, off);
        off += (t->nbytes + al - 1) / al * al;
    }
    static const uint8_t zeros[64] = {0};
    while (b.n % al) gw_put(&b, zeros, 1);
    for (int i = 0; i < w->nt; i++) {
        gw_put(&b, w->t[i].data, w->t[i].nbytes);
        while (b.n % al) gw_put(&b, zeros, 1);
    }
    *out = b.p, *len = b.n;
}

static inline void gw_free(gguf_w *w)
{
    for (int i = 0; i < w->nt; i++) free(w->t[i].data);
    free(w->t), free(w->kv.p);
    memset(w, 0, sizeof *w);
}

static inline int gw_write_file(const char *path, const uint8_t *p, size_t n)
{
    FILE *f = fopen(path, "wb");
    if (!f) return -1;
    int ok = fwrite(p, 1, n, f) == n;
    return fclose(f) == 0 && ok ? 0 : -1;
}

/* Bytes of a GGUF value of `type` at p (below end), or 0 if it runs past end. */
static inline size_t gw_value_size(uint32_t type, const uint8_t *p, const uint8_t *end)
{
    static const size_t scalar[13] = {1, 1, 2, 2, 4, 4, 4, 1, 0, 0, 8, 8, 8};
    if (type > 12) return 0;
    if (type == 8) {
        uint64_t n;
        if (end - p < 8) return 0;
        memcpy(&n, p, 8);
        return n <= (uint64_t)(end - p) - 8 ? 8 + (size_t)n : 0;
    }
    if (type == 9) {
        uint32_t at;
        uint64_t n;
        if (end - p < 12) return 0;
        memcpy(&at, p, 4), memcpy(&n, p + 4, 8);
        size_t off = 12;
        for (uint64_t i = 0; i < n; i++) {
            size_t s = gw_value_size(at, p + off, end);
            if (!s) return 0;
            off += s;
        }
        return off;
    }
    return (size_t)(end - p) >= scalar[type] ? scalar[type] : 0;
}

/* Copies the metadata of the GGUF file at path whose keys start with
 * prefix (e.g. "tokenizer.": a real model's vocabulary) into w, bytes as
 * they are.  Returns the number copied, or -1 if the file cannot be read. */
static inline int gw_copy_kvs(gguf_w *w, const char *path, const char *prefix)
{
    FILE *f = fopen(path, "rb");
    if (!f) return -1;
    size_t cap = 1 << 20, n = 0;
    uint8_t *p = malloc(cap);
    for (size_t r; p && (r = fread(p + n, 1, cap - n, f)) > 0;) {
        n += r;
        if (n == cap) p = realloc(p, cap *= 2);
    }
    fclose(f);
    if (!p || n < 24 || memcmp(p, "GGUF", 4)) { free(p); return -1; }
    uint64_t nkv;
    memcpy(&nkv, p + 16, 8);
    const uint8_t *q = p + 24, *end = p + n;
    int copied = 0;
    for (uint64_t i = 0; i < nkv; i++) {
        size_t ks = gw_value_size(8, q, end);
        if (!ks || end - (q + ks) < 4) { free(p); return -1; }
        uint64_t klen;
        memcpy(&klen, q, 8);
        uint32_t type;
        memcpy(&type, q + ks, 4);
        size_t vs = gw_value_size(type, q + ks + 4, end);
        if (!vs) { free(p); return -1; }
        if (klen >= strlen(prefix) && !memcmp(q + 8, prefix, strlen(prefix))) {
            gw_put(&w->kv, q, ks + 4 + vs);
            w->nkv++, copied++;
        }
        q += ks + 4 + vs;
    }
    free(p);
    return copied;
}

/* ---------------------------------------------------- random weights */

static inline uint64_t gw_rand(uint64_t *s)
{
    *s ^= *s << 13, *s ^= *s >> 7, *s ^= *s << 17;
    return *s;
}

/* Byte offsets of the half-precision scale fields of a block, and the
 * largest |code × sub-scale| factor (so d = 0.3 / factor keeps values small). */
static inline int gw_half_fields(int type, int off[2], double *factor)
{
    switch (type) {
    case KVQ_GGML_Q4_0: off[0] = 0; *factor = 8; return 1;
    case KVQ_GGML_Q4_1: off[0] = 0, off[1] = 2; *factor = 15; return 2;
    case KVQ_GGML_Q5_0: off[0] = 0; *factor = 16; return 1;
    case KVQ_GGML_Q5_1: off[0] = 0, off[1] = 2; *factor = 31; return 2;
    case KVQ_GGML_Q8_0: off[0] = 0; *factor = 128; return 1;
    case KVQ_GGML_Q2_K: off[0] = 80, off[1] = 82; *factor = 45; return 2;
    case KVQ_GGML_Q3_K: off[0] = 108; *factor = 128; return 1;
    case KVQ_GGML_Q4_K: off[0] = 0, off[1] = 2; *factor = 945; return 2;
    case KVQ_GGML_Q5_K: off[0] = 0, off[1] = 2; *factor = 1953; return 2;
    case KVQ_GGML_Q6_K: off[0] = 208; *factor = 4064; return 1;
    case KVQ_GGML_IQ4_NL: off[0] = 0; *factor = 127; return 1;
    case KVQ_GGML_IQ4_XS: off[0] = 0; *factor = 127 * 32; return 1;
    default: return 0;
    }
}

/* rows × cols values of `type` (random codes, halves of magnitude ~amp/factor)
 * as raw bytes; *nbytes set.  f32/f16/bf16: N(0, amp)-ish uniform values. */
static inline uint8_t *gw_random_weights(int type, int64_t cols, int64_t rows, double amp, uint64_t seed,
                                         size_t *nbytes)
{
    int block;
    size_t bb;
    if (!kvq_ggml_type_size(type, &block, &bb)) abort();
    size_t nblocks = (size_t)(cols / block) * (size_t)rows, n = nblocks * bb;
    uint8_t *p = malloc(n ? n : 1);
    uint64_t s = seed * 2654435761u + 88172645463325252ull;
    if (type == KVQ_GGML_F32 || type == KVQ_GGML_F16 || type == KVQ_GGML_BF16) {
        for (size_t i = 0; i < nblocks; i++) {
            float v = (float)(amp * ((double)(gw_rand(&s) >> 11) / 9007199254740992.0 * 2 - 1));
            if (type == KVQ_GGML_F32) memcpy(p + 4 * i, &v, 4);
            else if (type == KVQ_GGML_F16) { uint16_t h = kvq_f32_to_f16(v); memcpy(p + 2 * i, &h, 2); }
            else { uint32_t u; memcpy(&u, &v, 4); uint16_t h = (uint16_t)(u >> 16); memcpy(p + 2 * i, &h, 2); }
        }
        *nbytes = n;
        return p;
    }
    for (size_t i = 0; i < n; i++) p[i] = (uint8_t)(gw_rand(&s) >> 32);
    int off[2];
    double factor;
    int nh = gw_half_fields(type, off, &factor);
    for (size_t b = 0; b < nblocks; b++)
        for (int k = 0; k < nh; k++) {
            double u = (double)(gw_rand(&s) >> 11) / 9007199254740992.0;
            uint16_t h = kvq_f32_to_f16((float)(amp / factor * (0.25 + 0.75 * u)));
            memcpy(p + b * bb + off[k], &h, 2);
        }
    *nbytes = n;
    return p;
}

/* A tiny model: arch "llama" or "qwen2", dim = Hq·D, weights of `wtype`
 * (norms f32 around 1), vocabulary of V pieces ("<unk>", "<s>", "</s>",
 * 256 byte pieces, then letters and merges) when V >= 300 — else no
 * tokenizer.  tied: no output.weight; freqs: a rope_freqs tensor. */
typedef struct gw_model_opts {
    const char *arch;
    int L, Hq, H, D, F, V, ctx;
    int wtype;
    int tied, freqs, with_vocab;
    uint64_t seed;
} gw_model_opts;

static inline void gw_weight(gguf_w *w, const char *name, int type, int64_t cols, int64_t rows, double amp,
                             uint64_t seed)
{
    size_t nb;
    uint8_t *p = gw_random_weights(type, cols, rows ? rows : 1, amp, seed, &nb);
    gw_tensor_raw(w, name, (uint32_t)type, (uint64_t)cols, (uint64_t)rows, p, nb);
    free(p);
}

static inline void gw_norm(gguf_w *w, const char *name, int64_t n, uint64_t seed)
{
    float *v = malloc((size_t)n * sizeof *v);
    uint64_t s = seed + 99;
    for (int64_t i = 0; i < n; i++) v[i] = (float)(0.8 + 0.4 * (double)(gw_rand(&s) >> 11) / 9007199254740992.0);
    gw_tensor_raw(w, name, KVQ_GGML_F32, (uint64_t)n, 0, v, (size_t)n * 4);
    free(v);
}

static inline void gw_tiny_model(gguf_w *w, const gw_model_opts *o)
{
    memset(w, 0, sizeof *w);
    char k[128];
    const char *a = o->arch;
    int dim = o->Hq * o->D, qd = o->Hq * o->D, kd = o->H * o->D;
    gw_kv_str(w, "general.architecture", a);
    gw_kv_str(w, "general.name", "tiny");
    snprintf(k, sizeof k, "%s.block_count", a), gw_kv_u32(w, k, (uint32_t)o->L);
    snprintf(k, sizeof k, "%s.context_length", a), gw_kv_u32(w, k, (uint32_t)o->ctx);
    snprintf(k, sizeof k, "%s.embedding_length", a), gw_kv_u32(w, k, (uint32_t)dim);
    snprintf(k, sizeof k, "%s.feed_forward_length", a), gw_kv_u32(w, k, (uint32_t)o->F);
    snprintf(k, sizeof k, "%s.attention.head_count", a), gw_kv_u32(w, k, (uint32_t)o->Hq);
    snprintf(k, sizeof k, "%s.attention.head_count_kv", a), gw_kv_u32(w, k, (uint32_t)o->H);
    snprintf(k, sizeof k, "%s.attention.layer_norm_rms_epsilon", a), gw_kv_f32(w, k, 1e-5f);
    snprintf(k, sizeof k, "%s.rope.freq_base", a), gw_kv_f32(w, k, 10000.0f);
    if (o->with_vocab) {
        int V = o->V, n = 0;
        char **tok = malloc((size_t)V * sizeof *tok);
        float *sc = malloc((size_t)V * sizeof *sc);
        const char *special[3] = {"<unk>", "<s>", "</s>"};
        for (; n < 3; n++) tok[n] = strdup(special[n]), sc[n] = 0;
        for (int b = 0; b < 256; b++, n++) {
            tok[n] = malloc(8);
            snprintf(tok[n], 8, "<0x%02X>", b);
            sc[n] = 0;
        }
        const char *letters = "abcdefghijklmnopqrstuvwxyz.,!";
        for (const char *c = letters; *c && n < V; c++, n++) {
            tok[n] = malloc(2);
            tok[n][0] = *c, tok[n][1] = 0;
            sc[n] = -100.0f - n;
        }
        if (n < V) tok[n] = strdup("\xe2\x96\x81"), sc[n] = -50.0f, n++;
        /* "▁x" pieces and a few longer ones, better scores for shorter ones */
        for (const char *c = letters; *c && n < V; c++, n++) {
            tok[n] = malloc(8);
            snprintf(tok[n], 8, "\xe2\x96\x81%c", *c);
            sc[n] = -10.0f - (float)(c - letters);
        }
        const char *words[] = {"\xe2\x96\x81the",
                               "\xe2\x96\x81th",
                               "he",
                               "in",
                               "\xe2\x96\x81"
                               "a",
                               "at",
                               "\xe2\x96\x81"
                               "cat",
                               "ca"};
        for (size_t i = 0; i < sizeof words / sizeof words[0] && n < V; i++, n++)
            tok[n] = strdup(words[i]), sc[n] = -(float)i;
        for (; n < V; n++) {
            tok[n] = malloc(16);
            snprintf(tok[n], 16, "zz%d", n);
            sc[n] = -1000.0f;
        }
        gw_kv_str(w, "tokenizer.ggml.model", "llama");
        gw_kv_arr_str(w, "tokenizer.ggml.tokens", V, tok);
        gw_kv_arr_f32(w, "tokenizer.ggml.scores", V, sc);
        gw_kv_u32(w, "tokenizer.ggml.bos_token_id", 1);
        for (int i = 0; i < V; i++) free(tok[i]);
        free(tok), free(sc);
    }
    uint64_t s = o->seed * 1000;
    gw_weight(w, "token_embd.weight", o->wtype, dim, o->V, 1.0, s++);
    gw_norm(w, "output_norm.weight", dim, s++);
    if (!o->tied) gw_weight(w, "output.weight", o->wtype, dim, o->V, 0.5, s++);
    if (o->freqs) {
        float *f = malloc((size_t)(o->D / 2) * sizeof *f);
        for (int i = 0; i < o->D / 2; i++) f[i] = 1.0f + (float)i;
        gw_tensor_raw(w, "rope_freqs.weight", KVQ_GGML_F32, (uint64_t)(o->D / 2), 0, f, (size_t)(o->D / 2) * 4);
        free(f);
    }
    double wa = 1.5 / sqrt((double)dim);
    for (int l = 0; l < o->L; l++) {
        char n[96];
#define GWN(sfx) (snprintf(n, sizeof n, "blk.%d.%s", l, sfx), n)
        gw_norm(w, GWN("attn_norm.weight"), dim, s++);
        gw_weight(w, GWN("attn_q.weight"), o->wtype, dim, qd, 4 * wa, s++);
        gw_weight(w, GWN("attn_k.weight"), o->wtype, dim, kd, 4 * wa, s++);
        gw_weight(w, GWN("attn_v.weight"), o->wtype, dim, kd, wa, s++);
        if (!strcmp(a, "qwen2")) {
            gw_weight(w, GWN("attn_q.bias"), KVQ_GGML_F32, qd, 0, 0.5, s++);
            gw_weight(w, GWN("attn_k.bias"), KVQ_GGML_F32, kd, 0, 0.5, s++);
            gw_weight(w, GWN("attn_v.bias"), KVQ_GGML_F32, kd, 0, 0.5, s++);
        }
        gw_weight(w, GWN("attn_output.weight"), o->wtype, qd, dim, wa, s++);
        gw_norm(w, GWN("ffn_norm.weight"), dim, s++);
        gw_weight(w, GWN("ffn_gate.weight"), o->wtype, dim, o->F, wa, s++);
        gw_weight(w, GWN("ffn_up.weight"), o->wtype, dim, o->F, wa, s++);
        gw_weight(w, GWN("ffn_down.weight"), o->wtype, o->F, dim, 1.5 / sqrt((double)o->F), s++);
#undef GWN
    }
}

#endif

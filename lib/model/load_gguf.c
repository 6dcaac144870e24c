/* load_gguf.c — a GGUF file as a model (docs/models.md), as llama.cpp v0.5.0's
 * src/models/ARCH.cpp reads the same file: `llama` (interleaved RoPE on the
 * converter's permuted Q/K weights), `qwen2` (QKV biases), `qwen3` (q/k
 * RMSNorm per head), `gemma3` (scaled embedding, q/k norms, post-norms,
 * GeGLU, sliding-window layers with their own RoPE base) and `phi3` (fused
 * QKV and gate/up, bound as row ranges); `half` RoPE for all but llama.
 * Hyper-parameters from `{arch}.*` metadata, tensors bound by llama.cpp's
 * names and checked against those shapes, and the SentencePiece vocabulary
 * when `tokenizer.ggml.model` is `llama`. */
#define _GNU_SOURCE /* qsort_r */
#include "model.h"

#include <ctype.h>
#include <math.h>
#include <stdio.h>
#include <string.h>

/* Binds rows [r0, r0 + rows) of tensor `name`, which must have `cols`
 * columns and `total` rows (a fused tensor is bound part by part). */
static kvq_status bind_rows(kvq_model *m, kvq_wtensor *w, const char *name, int64_t cols, int64_t total, int64_t r0,
                            int64_t rows, int required, kvq_error *err)
{
    const gguf_tensor *t = kvq_gguf_tensor(&m->gguf, name);
    memset(w, 0, sizeof *w);
    if (!t) {
        if (!required) return KVQ_OK;
        return kvq_fail(err, KVQ_ERR_FORMAT, "%s: tensor %s: missing (required by architecture %s)", m->path, name,
                        m->info.arch_name);
    }
    int64_t trows;
    if (__builtin_mul_overflow(t->ne[1], t->ne[2], &trows) || __builtin_mul_overflow(trows, t->ne[3], &trows))
        return kvq_fail(err, KVQ_ERR_FORMAT, "%s: tensor %s: dimensions %lld x %lld x %lld overflow", m->path, name,
                        (long long)t->ne[1], (long long)t->ne[2], (long long)t->ne[3]);
    if (t->ne[0] != cols || trows != total)
        return kvq_fail(err, KVQ_ERR_FORMAT, "%s: tensor %s: expected [%lld, %lld] (ne0 = columns), got [%lld, %lld]",
                        m->path, name, (long long)cols, (long long)total, (long long)t->ne[0], (long long)trows);
    w->name = t->name, w->type = t->type, w->cols = cols, w->rows = rows;
    w->row_bytes = total ? t->nbytes / (size_t)total : 0;
    w->data = t->data + (size_t)r0 * w->row_bytes;
    return KVQ_OK;
}

static kvq_status bind(kvq_model *m, kvq_wtensor *w, const char *name, int64_t cols, int64_t rows, int required,
                       kvq_error *err)
{
    return bind_rows(m, w, name, cols, rows, 0, rows, required, err);
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
        return kvq_fail(err, KVQ_ERR_FORMAT, "%s: metadata %s: %lld: expected 1..%lld", m->path, key, (long long)v,
                        (long long)max);
    *out = (int)v;
    return KVQ_OK;
}

/* Pre-tokenizer names (tokenizer.ggml.pre) as llama.cpp's llama_vocab::load groups them. */
static const struct {
    const char *name;
    kvq_bpe_pre pre;
} bpe_pres[] = {
    {"llama3", KVQ_PRE_LLAMA3},    {"llama-v3", KVQ_PRE_LLAMA3},   {"llama-bpe", KVQ_PRE_LLAMA3},
    {"falcon3", KVQ_PRE_LLAMA3},   {"falcon-h1", KVQ_PRE_LLAMA3},  {"pixtral", KVQ_PRE_LLAMA3},
    {"midm-2.0", KVQ_PRE_LLAMA3},  {"lfm2", KVQ_PRE_LLAMA3},       {"jina-v5-nano", KVQ_PRE_LLAMA3},
    {"qwen2", KVQ_PRE_QWEN2},      {"deepseek-r1-qwen", KVQ_PRE_QWEN2}, {"kormo", KVQ_PRE_QWEN2},
    {"f2llmv2", KVQ_PRE_QWEN2},    {"gpt-2", KVQ_PRE_GPT2},        {"phi-2", KVQ_PRE_GPT2},
    {"jina-es", KVQ_PRE_GPT2},     {"jina-de", KVQ_PRE_GPT2},      {"gigachat", KVQ_PRE_GPT2},
    {"jina-v2-es", KVQ_PRE_GPT2},  {"jina-v2-de", KVQ_PRE_GPT2},   {"a.x-4.0", KVQ_PRE_GPT2},
    {"mellum", KVQ_PRE_GPT2},      {"modern-bert", KVQ_PRE_GPT2},  {"default", KVQ_PRE_DEFAULT},
};

/* Texts llama.cpp's llama_vocab::load marks as control tokens whatever
 * their token_type says (end-of-generation and fill-in-the-middle names):
 * a user-defined token with one of these texts is not matched in the text. */
static const char *const control_looking[] = {
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<|return|>",
    "<|call|>",
    "<|flush|>",
    "<|calls|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "</s>",
    "<|eom_id|>",
    "<EOT>",
    "_<EOT>",
    "[EOT]",
    "[EOS]",
    "<|end_of_text|>",
    "<end_of_utterance>",
    "<eos>",
    "<turn|>",
    "<|tool_response>",
    "<\xef\xbd\x9c"
    "end\xe2\x96\x81of\xe2\x96\x81sentence\xef\xbd\x9c>",
    "[e~[",
    "<|fim_prefix|>",
    "<fim-prefix>",
    "<fim_prefix>",
    "<\xef\xbd\x9c"
    "fim\xe2\x96\x81"
    "begin\xef\xbd\x9c>",
    "<PRE>",
    "\xe2\x96\x81<PRE>",
    "<|code_prefix|>",
    "<|prefix|>",
    "<|fim_suffix|>",
    "<fim-suffix>",
    "<fim_suffix>",
    "<\xef\xbd\x9c"
    "fim\xe2\x96\x81hole\xef\xbd\x9c>",
    "<SUF>",
    "\xe2\x96\x81<SUF>",
    "<|code_suffix|>",
    "<|suffix|>",
    "<|fim_middle|>",
    "<fim-middle>",
    "<fim_middle>",
    "<\xef\xbd\x9c"
    "fim\xe2\x96\x81"
    "end\xef\xbd\x9c>",
    "<MID>",
    "\xe2\x96\x81<MID>",
    "<|code_middle|>",
    "<|middle|>",
    "<|fim_pad|>",
    "<fim-pad>",
    "<fim_pad>",
    "<PAD>",
    "[PAD]",
    "<|fim_repo|>",
    "<|repo_name|>",
    "<fim-repo>",
    "<REPO>",
    "<reponame>",
    "<|file_sep|>",
};

static int is_control_looking(const char *t)
{
    for (size_t i = 0; i < sizeof control_looking / sizeof control_looking[0]; i++)
        if (!strcmp(t, control_looking[i])) return 1;
    return 0;
}

/* An optional boolean `tokenizer.ggml.<key>`: *out unchanged when absent. */
static kvq_status tok_bool(kvq_model *m, const char *key, int *out, kvq_error *err)
{
    int64_t b;
    int r = kvq_gguf_get_int(&m->gguf, key, &b);
    if (r < 0) return kvq_fail(err, KVQ_ERR_FORMAT, "%s: metadata %s: expected a boolean", m->path, key);
    if (r) *out = b != 0;
    return KVQ_OK;
}

/* An optional token id `tokenizer.ggml.<key>` below n. */
static kvq_status tok_id(kvq_model *m, const char *key, int n, int *out, kvq_error *err)
{
    int64_t id;
    int r = kvq_gguf_get_int(&m->gguf, key, &id);
    if (r < 0 || (r && (id < 0 || id >= n)))
        return kvq_fail(err, KVQ_ERR_FORMAT, "%s: metadata %s: expected a token id below %d", m->path, key, n);
    if (r) *out = (int)id;
    return KVQ_OK;
}

static int special_longer(const void *a, const void *b, void *pieces)
{
    char **p = pieces;
    int x = *(const int *)a, y = *(const int *)b;
    size_t lx = strlen(p[x]), ly = strlen(p[y]);
    return lx != ly ? (lx < ly ? 1 : -1) : (x > y) - (x < y);
}

/* The vocabulary of tokenizer.ggml.model "llama" (SentencePiece) or "gpt2"
 * (byte-level BPE with a pre-tokenizer), as llama.cpp loads it: BOS/EOS
 * added as add_bos_token/add_eos_token say (defaults: SentencePiece BOS;
 * BPE none, llama-bpe BOS), user-defined tokens (token_type 4) matched in
 * the text before anything else, a piece given twice mapping to its last
 * id.  Anything else leaves the model without a tokenizer (a clear error
 * naming --tokens when --text is used). */
/* The vocabulary's pieces, scores and user-defined tokens (v->special), from
 * tokenizer.ggml.tokens, .scores (sc, may be NULL) and .token_type (ty, may be
 * NULL), with llama.cpp's rules for which user-defined tokens are matched. */
static kvq_status read_pieces(kvq_model *m, const gguf_kv *tk, const gguf_kv *sc, const gguf_kv *ty, kvq_error *err)
{
    kvq_vocab *v = &m->vocab;
    v->n = (int)tk->n;
    v->piece = calloc((size_t)v->n, sizeof *v->piece);
    v->score = calloc((size_t)v->n, sizeof *v->score);
    v->special = calloc((size_t)v->n, sizeof *v->special);
    if (!v->piece || !v->score || !v->special)
        return kvq_fail(err, KVQ_ERR_NOMEM, "%s: out of memory for the vocabulary", m->path);
    const uint8_t *p = tk->val; /* bounds were checked by the parser */
    for (int i = 0; i < v->n; i++) {
        uint64_t n;
        memcpy(&n, p, 8);
        if (!(v->piece[i] = malloc((size_t)n + 1))) return kvq_fail(err, KVQ_ERR_NOMEM, "%s: out of memory", m->path);
        memcpy(v->piece[i], p + 8, (size_t)n);
        v->piece[i][n] = '\0';
        p += 8 + n;
        if (sc) memcpy(&v->score[i], sc->val + 4 * (size_t)i, 4);
        int32_t type = 1;
        if (ty) memcpy(&type, ty->val + 4 * (size_t)i, 4);
        if (type == 4) v->special[v->nspecial++] = i; /* USER_DEFINED */
    }
    { /* control-looking texts are control tokens to llama.cpp (or, for "</s>" beside
       * "<|tool_response>", normal ones): never matched here */
        int k = 0;
        for (int i = 0; i < v->nspecial; i++)
            if (!is_control_looking(v->piece[v->special[i]])) v->special[k++] = v->special[i];
        v->nspecial = k;
    }
    /* llama.cpp: models named phi-3/phi3 strip whitespace after their special tokens */
    char lname[256];
    snprintf(lname, sizeof lname, "%s", m->info.name);
    for (char *c = lname; *c; c++) *c = (char)tolower((unsigned char)*c);
    v->special_rstrip = strstr(lname, "phi-3") || strstr(lname, "phi3");
    if (v->special_rstrip) { /* except <unk>, <s>, <|endoftext|> */
        int k = 0;
        for (int i = 0; i < v->nspecial; i++) {
            const char *t = v->piece[v->special[i]];
            if (strcmp(t, "<unk>") && strcmp(t, "<s>") && strcmp(t, "<|endoftext|>")) v->special[k++] = v->special[i];
        }
        v->nspecial = k; /* the others are control tokens, never matched here */
    }
    qsort_r(v->special, (size_t)v->nspecial, sizeof *v->special, special_longer, v->piece);
    return KVQ_OK;
}

/* BPE's merges (tokenizer.ggml.merges, mg), indexed. */
static kvq_status read_merges(kvq_model *m, const gguf_kv *mg, kvq_error *err)
{
    kvq_vocab *v = &m->vocab;
    v->add_space_prefix = 0;
    v->ignore_merges = v->pre == KVQ_PRE_LLAMA3;
    v->nmerge = mg->n;
    v->merge = calloc((size_t)mg->n + 1, sizeof *v->merge);
    v->merge_len = calloc((size_t)mg->n + 1, sizeof *v->merge_len);
    if (!v->merge || !v->merge_len) return kvq_fail(err, KVQ_ERR_NOMEM, "%s: out of memory for the merges", m->path);
    const uint8_t *p = mg->val;
    for (uint64_t i = 0; i < mg->n; i++) {
        uint64_t n;
        memcpy(&n, p, 8);
        if (n > UINT32_MAX)
            return kvq_fail(err, KVQ_ERR_FORMAT, "%s: merge %llu: absurd length", m->path, (unsigned long long)i);
        v->merge[i] = (const char *)p + 8, v->merge_len[i] = (uint32_t)n;
        p += 8 + n;
    }
    return kvq_bpe_index(v, err);
}

/* The tokenizer kind (tokenizer.ggml.model, and a BPE's pre-tokenizer): 1 with
 * *bpe set when kvq runs it; 0 with m->tokenizer_missing saying why not. */
static int tokenizer_kind(kvq_model *m, int *bpe)
{
    const char *s;
    uint64_t len;
    kvq_gguf *g = &m->gguf;
    if (kvq_gguf_get_str(g, "tokenizer.ggml.model", &s, &len) != 1) {
        snprintf(m->tokenizer_missing, sizeof m->tokenizer_missing, "the file has no tokenizer.ggml.model");
        return 0;
    }
    snprintf(m->info.tokenizer, sizeof m->info.tokenizer, "%.*s", (int)(len < 60 ? len : 60), s);
    *bpe = !strcmp(m->info.tokenizer, "gpt2");
    if (!*bpe && strcmp(m->info.tokenizer, "llama")) {
        snprintf(m->tokenizer_missing, sizeof m->tokenizer_missing,
                 "tokenizer.ggml.model \"%s\" is not implemented (kvq reads \"llama\" and \"gpt2\")",
                 m->info.tokenizer);
        return 0;
    }
    if (!*bpe) return 1;
    char pre[64] = "default";
    if (kvq_gguf_get_str(g, "tokenizer.ggml.pre", &s, &len) == 1)
        snprintf(pre, sizeof pre, "%.*s", (int)(len < 60 ? len : 60), s);
    for (size_t i = 0; i < sizeof bpe_pres / sizeof bpe_pres[0]; i++)
        if (!strcmp(pre, bpe_pres[i].name)) {
            m->vocab.pre = bpe_pres[i].pre;
            snprintf(m->info.tokenizer, sizeof m->info.tokenizer, "gpt2/%s", pre);
            return 1;
        }
    snprintf(m->tokenizer_missing, sizeof m->tokenizer_missing,
             "pre-tokenizer \"%s\" is not implemented (kvq runs llama-bpe, qwen2, gpt-2 and default)", pre);
    return 0;
}

static kvq_status load_vocab(kvq_model *m, kvq_error *err)
{
    kvq_gguf *g = &m->gguf;
    kvq_vocab *v = &m->vocab;
    int bpe = 0;
    if (!tokenizer_kind(m, &bpe)) return KVQ_OK;
    const gguf_kv *tk = kvq_gguf_find(g, "tokenizer.ggml.tokens"), *sc = kvq_gguf_find(g, "tokenizer.ggml.scores");
    const gguf_kv *ty = kvq_gguf_find(g, "tokenizer.ggml.token_type"), *mg = kvq_gguf_find(g, "tokenizer.ggml.merges");
    if (!tk || tk->type != GGUF_ARRAY || tk->arr_type != GGUF_STRING)
        return kvq_fail(err, KVQ_ERR_FORMAT, "%s: metadata tokenizer.ggml.tokens: expected an array of strings",
                        m->path);
    if (sc && (sc->type != GGUF_ARRAY || sc->arr_type != GGUF_F32 || sc->n != tk->n))
        return kvq_fail(err, KVQ_ERR_FORMAT, "%s: metadata tokenizer.ggml.scores: expected %llu float32 values",
                        m->path, (unsigned long long)tk->n);
    if (ty && (ty->type != GGUF_ARRAY || (ty->arr_type != GGUF_I32 && ty->arr_type != GGUF_U32) || ty->n != tk->n))
        return kvq_fail(err, KVQ_ERR_FORMAT, "%s: metadata tokenizer.ggml.token_type: expected %llu 32-bit integers",
                        m->path, (unsigned long long)tk->n);
    if (bpe && (!mg || mg->type != GGUF_ARRAY || mg->arr_type != GGUF_STRING || mg->n > (1u << 30)))
        return kvq_fail(err, KVQ_ERR_FORMAT, "%s: metadata tokenizer.ggml.merges: expected an array of strings (BPE)",
                        m->path);
    if (tk->n != (uint64_t)m->info.vocab_size)
        return kvq_fail(err, KVQ_ERR_FORMAT,
                        "%s: metadata tokenizer.ggml.tokens: %llu tokens, but token_embd has %d rows", m->path,
                        (unsigned long long)tk->n, m->info.vocab_size);
    kvq_status st;
    if ((st = read_pieces(m, tk, sc, ty, err))) return st;
    v->bos = bpe ? 11 : 1, v->eos = bpe ? 11 : 2;
    v->add_bos = !bpe || v->pre == KVQ_PRE_LLAMA3, v->add_eos = 0, v->add_space_prefix = !bpe;
    if ((st = tok_id(m, "tokenizer.ggml.bos_token_id", v->n, &v->bos, err)) ||
        (st = tok_id(m, "tokenizer.ggml.eos_token_id", v->n, &v->eos, err)) ||
        (st = tok_bool(m, "tokenizer.ggml.add_bos_token", &v->add_bos, err)) ||
        (st = tok_bool(m, "tokenizer.ggml.add_eos_token", &v->add_eos, err)) ||
        (st = tok_bool(m, "tokenizer.ggml.add_space_prefix", &v->add_space_prefix, err)))
        return st;
    if ((v->add_bos && v->bos >= v->n) || (v->add_eos && v->eos >= v->n))
        return kvq_fail(err, KVQ_ERR_FORMAT,
                        "%s: metadata tokenizer.ggml.bos/eos_token_id: expected a token id below %d", m->path, v->n);
    v->space_is_u2581 = !bpe, v->byte_base = -1, v->last_wins = 1;
    v->kind = bpe ? KVQ_TOK_BPE : KVQ_TOK_SPM;
    if (bpe && (st = read_merges(m, mg, err))) return st;
    m->info.has_tokenizer = 1;
    return kvq_vocab_index(v, err);
}

/* A real `{arch}.suffix` (absent: *v unchanged) that must lie in (lo, hi). */
static kvq_status hreal(kvq_model *m, const char *suffix, double lo, double hi, double *v, kvq_error *err)
{
    char key[128];
    snprintf(key, sizeof key, "%s.%s", m->info.arch_name, suffix);
    if (kvq_gguf_get_real(&m->gguf, key, v) < 0 || !(*v > lo) || !(*v < hi))
        return kvq_fail(err, KVQ_ERR_FORMAT, "%s: metadata %s: expected a number in (%g, %g)", m->path, key, lo, hi);
    return KVQ_OK;
}

/* An optional real `{arch}.suffix` (absent: *v unchanged): 0 (none) or a positive number below hi. */
static kvq_status hreal_or_none(kvq_model *m, const char *suffix, double hi, double *v, kvq_error *err)
{
    char key[128];
    snprintf(key, sizeof key, "%s.%s", m->info.arch_name, suffix);
    if (kvq_gguf_get_real(&m->gguf, key, v) < 0 || !(*v == 0 || (*v > 0 && *v < hi))) {
        if (isinf(hi))
            return kvq_fail(err, KVQ_ERR_FORMAT, "%s: metadata %s: expected 0 (none) or a positive finite number",
                            m->path, key);
        return kvq_fail(err, KVQ_ERR_FORMAT, "%s: metadata %s: expected 0 (none) or a positive number below %g", m->path,
                        key, hi);
    }
    return KVQ_OK;
}

/* RoPE scaling: none, or linear with a factor (llama.cpp's freq_scale = 1 / factor). */
static kvq_status rope_scaling(kvq_model *m, kvq_error *err)
{
    kvq_model_info *in = &m->info;
    char key[128];
    const char *s;
    uint64_t len;
    snprintf(key, sizeof key, "%s.rope.scaling.type", in->arch_name);
    int r = kvq_gguf_get_str(&m->gguf, key, &s, &len);
    if (r == 1 && !(len == 4 && !memcmp(s, "none", 4)) && !(len == 6 && !memcmp(s, "linear", 6)))
        return kvq_fail(err, KVQ_ERR_UNSUPPORTED,
                        "%s: metadata %s: \"%.*s\" RoPE scaling is not supported (kvq runs none and linear)", m->path,
                        key, (int)(len < 40 ? len : 40), s);
    double factor = 0;
    kvq_status st = hreal_or_none(m, "rope.scaling.factor", 1e6, &factor, err);
    if (st) return st;
    if (r == 1 && len == 4) factor = 0; /* "none" */
    in->rope_scale = factor > 0 ? 1.0 / factor : 1.0;
    return KVQ_OK;
}

/* gemma3's sliding-window layers: `attention.sliding_window` W > 0 and the
 * pattern (an array of per-layer flags, or every n-th layer global; n = 6
 * by default), as llama.cpp's load_swa_pattern. */
static kvq_status sliding_layers(kvq_model *m, kvq_error *err)
{
    kvq_model_info *in = &m->info;
    char key[128];
    int64_t W = 0, n = 6;
    snprintf(key, sizeof key, "%s.attention.sliding_window", in->arch_name);
    if (kvq_gguf_get_int(&m->gguf, key, &W) < 0 || W < 0 || W > (1 << 30))
        return kvq_fail(err, KVQ_ERR_FORMAT, "%s: metadata %s: expected a window of 0..2^30 positions", m->path, key);
    if (W == 0) return KVQ_OK;
    if (!(m->layer_swa = calloc((size_t)in->n_layers, 1)))
        return kvq_fail(err, KVQ_ERR_NOMEM, "%s: out of memory", m->path);
    snprintf(key, sizeof key, "%s.attention.sliding_window_pattern", in->arch_name);
    const gguf_kv *kv = kvq_gguf_find(&m->gguf, key);
    if (kv && kv->type == GGUF_ARRAY) {
        if ((kv->arr_type != GGUF_BOOL && kv->arr_type != GGUF_U8 && kv->arr_type != GGUF_I8) ||
            kv->n != (uint64_t)in->n_layers)
            return kvq_fail(err, KVQ_ERR_FORMAT, "%s: metadata %s: expected %d booleans (one per layer)", m->path, key,
                            in->n_layers);
        for (int l = 0; l < in->n_layers; l++) m->layer_swa[l] = kv->val[l] != 0;
    } else {
        if (kvq_gguf_get_int(&m->gguf, key, &n) < 0 || n < 0 || n > (1 << 20))
            return kvq_fail(err, KVQ_ERR_FORMAT, "%s: metadata %s: expected a layer period or per-layer flags", m->path,
                            key);
        for (int l = 0; l < in->n_layers; l++) m->layer_swa[l] = n == 0 || l % n < n - 1;
    }
    in->sliding_window = (int)W;
    for (int l = 0; l < in->n_layers; l++) in->n_swa_layers += m->layer_swa[l];
    in->rope_theta_swa = 10000.0;
    return hreal(m, "rope.freq_base_swa", 1, INFINITY, &in->rope_theta_swa, err);
}

/* gemma3's own: llama.cpp scales x by sqrt(n_embd) and Q by 1/sqrt(head_dim), or by
 * 1/sqrt(n_embd/n_head) for the 27B model (62 layers); a final logit soft-cap; sliding-window layers */
static kvq_status gemma3_hparams(kvq_model *m, kvq_error *err)
{
    kvq_model_info *in = &m->info;
    in->embed_scale = sqrtf((float)in->dim);
    in->attn_scale = 1.0f / sqrtf((float)(in->n_layers == 62 ? in->dim / in->n_heads : in->head_dim));
    double cap = 0;
    kvq_status st = hreal_or_none(m, "final_logit_softcapping", INFINITY, &cap, err);
    if (st || (st = sliding_layers(m, err))) return st;
    in->logit_softcap = cap > 0 ? (float)cap : 0.0f;
    return KVQ_OK;
}

/* The rows of kvq_archs.def: what tells one architecture from another. */
static const struct arch_row {
    const char *name;
    kvq_arch arch;
    kvq_rope_style rope_style;
    int qkv_bias, qk_norm, post_norms;
    kvq_ffn_act act;
    int fused_gate_up;
    kvq_status (*hparams)(kvq_model *m, kvq_error *err);
} archs[] = {
#define KVQ_ARCH(ident, nm, rope, bias, qkn, post, act, fused, hook) \
    {nm, KVQ_ARCH_##ident, rope, bias, qkn, post, act, fused, hook},
#include "../kvq_archs.def"
#undef KVQ_ARCH
};
enum { NARCHS = sizeof archs / sizeof archs[0] };

const char *kvq_arch_name(int i) { return i >= 0 && i < NARCHS ? archs[i].name : NULL; }

/* general.architecture against the rows: the model's settings, or "kvq runs a, b and c". */
static kvq_status load_arch(kvq_model *m, const struct arch_row **row, kvq_error *err)
{
    kvq_model_info *in = &m->info;
    const char *s;
    uint64_t len;
    if (kvq_gguf_get_str(&m->gguf, "general.architecture", &s, &len) != 1)
        return kvq_fail(err, KVQ_ERR_FORMAT, "%s: metadata general.architecture: missing (required)", m->path);
    snprintf(in->arch_name, sizeof in->arch_name, "%.*s", (int)(len < 60 ? len : 60), s);
    for (int i = 0; i < NARCHS; i++)
        if (strlen(archs[i].name) == len && !memcmp(archs[i].name, s, len)) {
            const struct arch_row *r = *row = &archs[i];
            in->arch = r->arch, in->rope_style = r->rope_style, in->has_qkv_bias = r->qkv_bias;
            in->has_qk_norm = r->qk_norm, in->has_post_norms = r->post_norms, in->ffn_act = r->act;
            return KVQ_OK;
        }
    char list[256] = "";
    for (int i = 0; i < NARCHS; i++) /* "a, b and c" */
        snprintf(list + strlen(list), sizeof list - strlen(list), "%s%s", i ? (i == NARCHS - 1 ? " and " : ", ") : "",
                 archs[i].name);
    return kvq_fail(err, KVQ_ERR_UNSUPPORTED, "%s: architecture \"%s\" is not supported (kvq runs %s)", m->path,
                    in->arch_name, list);
}

/* The hyper-parameters every architecture has (`{arch}.*`), checked. */
static kvq_status load_hparams(kvq_model *m, kvq_error *err)
{
    kvq_model_info *in = &m->info;
    const int64_t big = 1 << 20;
    kvq_status st;
    if ((st = hparam(m, "block_count", 1, 0, 4096, &in->n_layers, err)) ||
        (st = hparam(m, "embedding_length", 1, 0, big, &in->dim, err)) ||
        (st = hparam(m, "feed_forward_length", 1, 0, 4 * big, &in->ffn_dim, err)) ||
        (st = hparam(m, "attention.head_count", 1, 0, 4096, &in->n_heads, err)) ||
        (st = hparam(m, "attention.head_count_kv", 0, in->n_heads, 4096, &in->n_kv_heads, err)) ||
        (st = hparam(m, "context_length", 0, 1 << 30, 1 << 30, &in->context_length, err)) ||
        (st = hparam(m, "attention.key_length", 0, in->dim / in->n_heads, 1 << 16, &in->head_dim, err)))
        return st;
    int vlen;
    if ((st = hparam(m, "attention.value_length", 0, in->head_dim, 1 << 16, &vlen, err))) return st;
    if (vlen != in->head_dim)
        return kvq_fail(err, KVQ_ERR_UNSUPPORTED,
                        "%s: %s.attention.value_length %d differs from key_length %d (not supported)", m->path,
                        in->arch_name, vlen, in->head_dim);
    if (in->n_heads % in->n_kv_heads)
        return kvq_fail(err, KVQ_ERR_FORMAT, "%s: head_count %d is not a multiple of head_count_kv %d", m->path,
                        in->n_heads, in->n_kv_heads);
    if (in->head_dim % 2)
        return kvq_fail(err, KVQ_ERR_FORMAT, "%s: head dimension %d: expected an even number (RoPE pairs)", m->path,
                        in->head_dim);
    int n_rot;
    if ((st = hparam(m, "rope.dimension_count", 0, in->head_dim, 1 << 16, &n_rot, err))) return st;
    if (n_rot != in->head_dim)
        return kvq_fail(err, KVQ_ERR_UNSUPPORTED,
                        "%s: %s.rope.dimension_count %d: partial rotary embeddings (head_dim %d) are not supported",
                        m->path, in->arch_name, n_rot, in->head_dim);
    double v = 1e-5;
    if ((st = hreal(m, "attention.layer_norm_rms_epsilon", 0, 1, &v, err))) return st;
    in->norm_eps = (float)v;
    in->rope_theta = 10000.0;
    return (st = hreal(m, "rope.freq_base", 1, INFINITY, &in->rope_theta, err)) ? st : rope_scaling(m, err);
}

/* The model-wide tensors: embeddings, output norm and head (tied when absent), rope_freqs. */
static kvq_status bind_globals(kvq_model *m, kvq_error *err)
{
    kvq_model_info *in = &m->info;
    kvq_gguf *g = &m->gguf;
    const gguf_tensor *emb = kvq_gguf_tensor(g, "token_embd.weight");
    if (!emb) return kvq_fail(err, KVQ_ERR_FORMAT, "%s: tensor token_embd.weight: missing (required)", m->path);
    if (emb->ne[1] < 1 || emb->ne[1] > (1 << 24))
        return kvq_fail(err, KVQ_ERR_FORMAT,
                        "%s: tensor token_embd.weight: %lld rows: expected a vocabulary of 1..2^24 tokens", m->path,
                        (long long)emb->ne[1]);
    in->vocab_size = (int)emb->ne[1];
    int dim = in->dim, V = in->vocab_size;
    kvq_status st;
    if ((st = bind(m, &m->tok_embd, "token_embd.weight", dim, V, 1, err)) ||
        (st = bind(m, &m->output_norm, "output_norm.weight", dim, 1, 1, err)) ||
        (st = bind(m, &m->output, "output.weight", dim, V, 0, err)) ||
        (st = bind(m, &m->rope_freqs, "rope_freqs.weight", in->head_dim / 2, 1, 0, err)))
        return st;
    if (kvq_gguf_tensor(g, "blk.0.rope_factors_long.weight") || kvq_gguf_tensor(g, "blk.0.rope_factors_short.weight") ||
        kvq_gguf_tensor(g, "rope_factors_long.weight"))
        return kvq_fail(err, KVQ_ERR_UNSUPPORTED,
                        "%s: LongRoPE factor tensors (rope_factors_long/short) are not supported", m->path);
    in->tied_output = !m->output.data;
    if (in->tied_output) m->output = m->tok_embd;
    in->has_rope_freqs = m->rope_freqs.data != NULL;
    return KVQ_OK;
}

/* Layer l's tensors (fused [q | k | v] and, by the row, [gate | up] split as llama.cpp splits them). */
static kvq_status bind_layer(kvq_model *m, const struct arch_row *row, int l, kvq_error *err)
{
    const kvq_model_info *in = &m->info;
    kvq_layer_weights *w = &m->layer[l];
    int dim = in->dim, D = in->head_dim, qd = in->n_heads * D, kd = in->n_kv_heads * D, F = in->ffn_dim;
    int qkn = in->has_qk_norm, post = in->has_post_norms, bias = in->has_qkv_bias;
    static const char *const suffix[17] = {
        "attn_norm.weight", "attn_q.weight",   "attn_k.weight",   "attn_v.weight",      "attn_q.bias",
        "attn_k.bias",      "attn_v.bias",     "attn_output.weight", "ffn_norm.weight", "ffn_gate.weight",
        "ffn_up.weight",    "ffn_down.weight", "attn_q_norm.weight", "attn_k_norm.weight",
        "post_attention_norm.weight", "post_ffw_norm.weight", "attn_qkv.weight"};
    char n[17][64];
    for (int i = 0; i < 17; i++) snprintf(n[i], sizeof n[i], "blk.%d.%s", l, suffix[i]);
    kvq_status st;
    if (kvq_gguf_tensor(&m->gguf, n[16])) { /* fused [q | k | v] rows */
        int64_t tot = (int64_t)qd + 2 * kd;
        if ((st = bind_rows(m, &w->wq, n[16], dim, tot, 0, qd, 1, err)) ||
            (st = bind_rows(m, &w->wk, n[16], dim, tot, qd, kd, 1, err)) ||
            (st = bind_rows(m, &w->wv, n[16], dim, tot, qd + kd, kd, 1, err)))
            return st;
    } else if ((st = bind(m, &w->wq, n[1], dim, qd, 1, err)) || (st = bind(m, &w->wk, n[2], dim, kd, 1, err)) ||
               (st = bind(m, &w->wv, n[3], dim, kd, 1, err))) {
        return st;
    }
    if (row->fused_gate_up) { /* fused [gate | up] rows, as ggml_swiglu splits them */
        if ((st = bind_rows(m, &w->w_gate, n[10], dim, 2 * (int64_t)F, 0, F, 1, err)) ||
            (st = bind_rows(m, &w->w_up, n[10], dim, 2 * (int64_t)F, F, F, 1, err)))
            return st;
    } else if ((st = bind(m, &w->w_gate, n[9], dim, F, 1, err)) || (st = bind(m, &w->w_up, n[10], dim, F, 1, err))) {
        return st;
    }
    if ((st = bind(m, &w->attn_norm, n[0], dim, 1, 1, err)) || (st = bind(m, &w->bq, n[4], qd, 1, bias, err)) ||
        (st = bind(m, &w->bk, n[5], kd, 1, bias, err)) || (st = bind(m, &w->bv, n[6], kd, 1, bias, err)) ||
        (st = bind(m, &w->wo, n[7], qd, dim, 1, err)) || (st = bind(m, &w->ffn_norm, n[8], dim, 1, 1, err)) ||
        (st = bind(m, &w->w_down, n[11], F, dim, 1, err)) || (st = bind(m, &w->q_norm, n[12], D, 1, qkn, err)) ||
        (st = bind(m, &w->k_norm, n[13], D, 1, qkn, err)) ||
        (st = bind(m, &w->post_attn_norm, n[14], dim, 1, post, err)) ||
        (st = bind(m, &w->post_ffn_norm, n[15], dim, 1, post, err)))
        return st;
    if (!qkn) memset(&w->q_norm, 0, sizeof w->q_norm), memset(&w->k_norm, 0, sizeof w->k_norm);
    if (!post) memset(&w->post_attn_norm, 0, sizeof w->post_attn_norm), memset(&w->post_ffn_norm, 0, sizeof w->post_ffn_norm);
    return KVQ_OK;
}

/* A layer's tensors beyond block_count: llama.cpp refuses the file (its tensor count
 * does not match), rather than run a model cut short. */
static kvq_status check_extra_layers(const kvq_model *m, kvq_error *err)
{
    const kvq_gguf *g = &m->gguf;
    for (uint64_t i = 0; i < g->ntensors; i++) {
        const char *name = g->tensors[i].name;
        char *end;
        if (strncmp(name, "blk.", 4)) continue;
        long l = strtol(name + 4, &end, 10);
        if (end != name + 4 && *end == '.' && l >= m->info.n_layers)
            return kvq_fail(err, KVQ_ERR_FORMAT,
                            "%s: tensor %s: layer %ld, but %s.block_count is %d (llama.cpp refuses such a file)",
                            m->path, name, l, m->info.arch_name, m->info.n_layers);
    }
    return KVQ_OK;
}

kvq_status kvq_model_load_gguf(kvq_model *m, kvq_error *err)
{
    kvq_status st = kvq_gguf_parse(&m->gguf, m->path, m->map, m->map_size, err);
    if (st) return st;
    kvq_model_info *in = &m->info;
    const char *s;
    uint64_t len;
    const struct arch_row *row = NULL;
    snprintf(in->format, sizeof in->format, "GGUF v%u", m->gguf.version);
    if ((st = load_arch(m, &row, err))) return st;
    if (kvq_gguf_get_str(&m->gguf, "general.name", &s, &len) == 1)
        snprintf(in->name, sizeof in->name, "%.*s", (int)(len < 250 ? len : 250), s);
    else
        snprintf(in->name, sizeof in->name, "%s", in->arch_name);
    /* phi3: llama.cpp v0.5.0 disables Phi's sliding window ("Phi SWA is currently
     * disabled"), so kvq ignores phi3.attention.sliding_window too (no hook reads it) */
    if ((st = load_hparams(m, err)) || (row->hparams && (st = row->hparams(m, err))) || (st = bind_globals(m, err)))
        return st;
    if (!(m->layer = calloc((size_t)in->n_layers, sizeof *m->layer)))
        return kvq_fail(err, KVQ_ERR_NOMEM, "%s: out of memory", m->path);
    for (int l = 0; l < in->n_layers; l++)
        if ((st = bind_layer(m, row, l, err))) return st;
    if ((st = check_extra_layers(m, err))) return st;
    return load_vocab(m, err);
}

/* model.h — what the model files of libkvq share (docs/models.md): the GGUF
 * container, weight tensors as the forward pass sees them, the model
 * struct that the GGUF and llama2.c loaders fill, and the tokenizer. */
#ifndef KVQ_MODEL_H
#define KVQ_MODEL_H

#include "../internal.h"
#include "../formats/formats.h"

#include <stdint.h>

/* One weight tensor in a mapped file: `rows` rows of `cols` values of
 * `type` (GGUF ne[0] = cols; a vector has rows = 1), row-major. */
typedef struct kvq_wtensor {
    const char *name;
    int type;            /* kvq_ggml_type */
    int64_t cols, rows;
    const uint8_t *data; /* NULL: the tensor is absent */
    size_t row_bytes;
    int checked;         /* 1 once the forward pass has read every value finite */
} kvq_wtensor;

/* Rows [r0, r1) dequantized to float [r1 − r0][cols]. */
void kvq_wtensor_rows(const kvq_wtensor *t, int64_t r0, int64_t r1, float *out);

/* ------------------------------------------------------------- GGUF */

enum {
    GGUF_U8 = 0, GGUF_I8, GGUF_U16, GGUF_I16, GGUF_U32, GGUF_I32, GGUF_F32, GGUF_BOOL,
    GGUF_STRING, GGUF_ARRAY, GGUF_U64, GGUF_I64, GGUF_F64, GGUF_NTYPES
};

typedef struct gguf_kv {
    char *key;
    int type;           /* GGUF_* */
    int arr_type;       /* element type of an ARRAY */
    uint64_t n;         /* array length (1 for scalars) */
    const uint8_t *val; /* the value's bytes in the mapped file */
} gguf_kv;

typedef struct gguf_tensor {
    char *name;
    uint32_t n_dims;
    int64_t ne[4];
    int type;
    uint64_t offset;
    const uint8_t *data;
    size_t nbytes;
} gguf_tensor;

/* Open-addressing index of names: slot[i] = entry + 1 (0: empty). */
typedef struct gguf_index {
    uint64_t *slot;
    size_t n; /* a power of two */
} gguf_index;

typedef struct kvq_gguf {
    const char *path;
    const uint8_t *map;
    size_t size;
    uint32_t version;
    uint64_t nkv, ntensors;
    gguf_kv *kv;
    gguf_tensor *tensors;
    gguf_index kv_index, tensor_index; /* duplicates are refused while parsing: O(n) */
} kvq_gguf;

/* Parses and checks a mapped GGUF v2/v3 file: every key, value and tensor
 * info inside the file, sizes without overflow, data inside the file. */
kvq_status kvq_gguf_parse(kvq_gguf *g, const char *path, const uint8_t *map, size_t size,
                          kvq_error *err);
void kvq_gguf_free(kvq_gguf *g);
const gguf_kv *kvq_gguf_find(const kvq_gguf *g, const char *key);
const gguf_tensor *kvq_gguf_tensor(const kvq_gguf *g, const char *name);
/* Integer value of a scalar integer key (any width); 0 if absent, −1 if not an integer. */
int kvq_gguf_get_int(const kvq_gguf *g, const char *key, int64_t *out);
int kvq_gguf_get_real(const kvq_gguf *g, const char *key, double *out);
/* String value (not NUL-terminated): 1 and its bytes, 0 if absent/not a string. */
int kvq_gguf_get_str(const kvq_gguf *g, const char *key, const char **s, uint64_t *len);

/* --------------------------------------------------------- tokenizer */

/* Tokenizer kinds (GGUF tokenizer.ggml.model): SentencePiece-style "llama"
 * (and llama2.c) or byte-level BPE "gpt2" with a pre-tokenizer. */
typedef enum kvq_tok_kind { KVQ_TOK_SPM = 0, KVQ_TOK_BPE } kvq_tok_kind;
typedef enum kvq_bpe_pre { KVQ_PRE_GPT2 = 0, KVQ_PRE_LLAMA3, KVQ_PRE_QWEN2, KVQ_PRE_DEFAULT } kvq_bpe_pre;

typedef struct kvq_vocab {
    int n;
    char **piece;    /* [n] NUL-terminated token texts */
    float *score;    /* [n] */
    int bos, eos;
    int add_bos, add_eos; /* llama_tokenize(add_special = true) adds them */
    int byte_base;   /* llama2.c: byte b is token b + 3; -1: look up "<0xXX>" */
    int space_is_u2581; /* GGUF SentencePiece: spaces written as U+2581 */
    int add_space_prefix;
    int last_wins;   /* a piece given twice maps to its last id (llama.cpp's token_to_id), else its first */
    kvq_tok_kind kind;
    /* BPE: merges "left right" (in the mapped file) by rank, and their index */
    kvq_bpe_pre pre;
    int ignore_merges; /* llama3: a word that is a token is taken whole */
    uint64_t nmerge;
    const char **merge;
    uint32_t *merge_len;
    uint32_t *mslot; /* rank + 1, 0: empty */
    size_t nmslot;
    /* user-defined tokens, matched in the text before anything else (longest first) */
    int *special;
    int nspecial;
    int special_rstrip; /* phi-3 models: whitespace after a matched token is dropped */
    int stream_unsafe;  /* a piece holds a newline followed by printable ASCII: no streamed cuts */
    int space_cut_unsafe; /* a piece holds an ASCII letter followed by a space: no cuts at "x| y" */
    /* open-addressing hash of pieces → id */
    int *slot;
    size_t nslot;
} kvq_vocab;

/* Indexes the pieces (set kind, special and last_wins first) and decides stream_unsafe. */
kvq_status kvq_vocab_index(kvq_vocab *v, kvq_error *err);
/* BPE: the rank of merging pieces a [0, na) and b [0, nb), or -1. */
int kvq_bpe_rank(const kvq_vocab *v, const char *a, size_t na, const char *b, size_t nb);
/* BPE: indexes v->merge (first occurrence of a merge string wins). */
kvq_status kvq_bpe_index(kvq_vocab *v, kvq_error *err);
/* BPE: the pre-tokenizer's words of code points cp [0, n) (cls: their
 * kvq_cp_class), as lengths into *len (malloc'ed), *nw of them; -1: no memory. */
int kvq_bpe_pretokenize(kvq_bpe_pre pre, const uint32_t *cp, const unsigned char *cls, size_t n, size_t **len,
                        size_t *nw);
/* The most text kvq_model_tokenize_file holds at once without a place to cut it. */
#define KVQ_TEXT_UNCUT_MAX ((size_t)64 << 20)
/* kvq_model_tokenize_file reading `block` bytes at a time (tests cut small texts often). */
kvq_status kvq_tokenize_file_blocks(const kvq_model *m, const char *path, size_t max_tokens, size_t block, int **ids,
                                    size_t *nids, kvq_error *err);
/* Merging a text's symbols (SentencePiece and BPE alike): symbol i holds
 * bytes [off, off + len) (len 0: merged into its left neighbour); the best
 * candidate pair merges first — highest score, then leftmost (BPE scores a
 * pair −rank) — until no pair is a candidate. */
typedef struct kvq_sym {
    size_t off, len;
    int prev, next;
} kvq_sym;
typedef struct kvq_bigram {
    double score;
    int left, right;
    size_t len; /* the merged length when pushed: a stale entry differs */
} kvq_bigram;
typedef struct kvq_bigram_heap {
    kvq_bigram *b;
    size_t n, cap;
} kvq_bigram_heap;
int kvq_bigram_push(kvq_bigram_heap *h, kvq_bigram x);
/* try_pair pushes (l, r) when they may merge (l or r may be −1: nothing);
 * -1 from either: out of memory. */
typedef int kvq_try_pair_fn(void *ctx, const kvq_sym *sy, int l, int r, kvq_bigram_heap *h);
int kvq_merge_symbols(kvq_sym *sy, int ns, kvq_bigram_heap *h, kvq_try_pair_fn *try_pair, void *ctx);
/* FNV-1a of s [0, n) continuing from h (start with KVQ_FNV_SEED): the hash of
 * the vocabulary, merge and GGUF name indexes. */
#define KVQ_FNV_SEED 1469598103934665603ull
uint64_t kvq_fnv1a(uint64_t h, const char *s, size_t n);
/* Splits t [0, n) into one linked symbol per UTF-8 character (a stray or
 * cut byte is a character of its own) into sy; returns how many. */
int kvq_utf8_symbols(const char *t, size_t n, kvq_sym *sy);
/* Growable token list. */
typedef struct kvq_tokbuf {
    int *id;
    size_t n, cap;
} kvq_tokbuf;
int kvq_tokbuf_push(kvq_tokbuf *b, int id);
/* BPE: the tokens of one raw-text fragment (pre-tokenized, byte-encoded, merged). */
kvq_status kvq_bpe_encode(const kvq_vocab *v, const char *text, size_t n, kvq_tokbuf *out, kvq_error *err);
void kvq_vocab_free(kvq_vocab *v);
int kvq_vocab_lookup(const kvq_vocab *v, const char *s, size_t len);

/* ------------------------------------------------------------ model */

/* One block's tensors; q_norm, k_norm [head_dim] (qwen3, gemma3) and the
 * post-norms (gemma3) are absent in the other architectures.  Fused
 * tensors (phi3's attn_qkv, ffn_up) are bound as row ranges: wq, wk, wv
 * and w_gate, w_up view parts of one tensor. */
typedef struct kvq_layer_weights {
    kvq_wtensor attn_norm, wq, wk, wv, bq, bk, bv, q_norm, k_norm, wo, post_attn_norm, ffn_norm, w_gate, w_up, w_down,
        post_ffn_norm;
} kvq_layer_weights;
#define KVQ_LAYER_TENSORS 16

struct kvq_model {
    kvq_model_info info;
    char *path;
    void *map;
    size_t map_size;
    kvq_gguf gguf;
    kvq_wtensor tok_embd, output_norm, output, rope_freqs;
    kvq_layer_weights *layer; /* [n_layers] */
    unsigned char *layer_swa; /* [n_layers] 1: the layer uses the sliding window (NULL: none does) */
    kvq_vocab vocab;          /* n == 0: no tokenizer */
    char tokenizer_missing[160]; /* why --text cannot be used */
};

/* ----------------------------------------------------- forward pass */

/* One stream of the lockstep forward pass: the exact model (item NULL) or
 * one evaluated configuration.  Results are sums over the scored positions.
 * A configuration follows the exact stream (computes nothing of its own)
 * while every cache it has been given is bit-identical to the exact one —
 * `-q none`, the layers a --per-layer item leaves alone, a quantizer that
 * keeps these tokens exact — and leaves it, from the exact hidden state,
 * at the first layer whose cache differs. */
typedef struct kvq_fw_stream {
    kvq_eval_item *item;
    const kvq_resolved_spec *spec; /* item->spec parsed once for the model's layers (NULL: none) */
    float *x;            /* [T][dim] hidden state (once the stream has left the exact one) */
    int follows;         /* 1: the hidden state is still the exact stream's */
    double k_bits, v_bits, n_elem; /* stored bits and elements of the quantized layers */
    double ctx_k_bits, ctx_v_bits, ctx_elem; /* --context: those of the context's compressed cache */
    /* cache_tokens: Σ over the applied layers, KV heads and scored positions of
     * the tokens the cache holds (a whole number), and (heads × layers) */
    double cache_held, cache_div;
    double nll, kl, top1;          /* sums over the scored positions */
    double d_n, d_mean, d_m2;      /* Welford state of d_t = nll'_t − nll_t over them (not for s[0]) */
    double *pos_nll;               /* NULL or the NLL of each scored position t at [t − score_from] */
    unsigned char *pos_hit;        /* NULL or whether its arg-max is the target, at [t − score_from] */
    /* online log-softmax state of each position over the vocabulary chunks */
    double *lmax, *lsum, *ltgt, *lw; /* max, Σexp(z − max), target logit, KL cross term */
    float *amax;
    int *arg;
} kvq_fw_stream;

struct kvq_fw_opts {
    const int *tokens;
    int T;
    kvq_fw_stream *s; /* s[0]: the exact model */
    int ns;
    int nthreads, stride;
    int score_from; /* positions t < score_from are not scored (corpus windows score their second half) */
    int context;    /* > 0: --context's protocol (SPEC §3.11): the first `context` tokens compressed once */
    uint64_t seed;
    kvq_calib *calib;
    /* the exact stream's tensors of each layer: key, value, query [.][T][D]
     * post-RoPE, key_pre_rope (may be NULL) */
    kvq_status (*on_layer)(void *ud, int layer, const kvq_layer *L, kvq_error *err);
    void *ud;
    void (*progress)(void *ud, int layer, int nlayers);
    void *progress_ud;
    /* the exact stream's logits at these positions into logits [n][vocab] */
    const int *logit_pos;
    int n_logit_pos;
    float *logits;
};
typedef struct kvq_fw_opts kvq_fw_opts;

/* RoPE of the model for T positions with base theta and linear scale
 * (the model's rope_theta and rope_scale, or rope_theta_swa and 1 for
 * sliding-window layers), rope_freqs factors applied. */
kvq_status kvq_model_rope(const kvq_model *m, int T, double theta, double scale, kvq_rope *out, kvq_error *err);
/* Whether the angles need tables (factors or scaling) rather than theta alone. */
int kvq_model_rope_tabled(const kvq_model *m);
/* Runs the streams through every layer and the output head. */
kvq_status kvq_forward(kvq_model *m, const kvq_fw_opts *o, kvq_error *err);

kvq_status kvq_model_load_gguf(kvq_model *m, kvq_error *err);
kvq_status kvq_model_load_llama2c(kvq_model *m, const char *tokenizer_path, kvq_error *err);

#endif

/* kvq_model.h — part of libkvq's public API (kvq.h includes every part):
 * models in the loop (docs/models.md): GGUF and llama2.c models, tokenizers, kvq-dump, kvq-eval. */
#ifndef KVQ_API_MODEL_H
#define KVQ_API_MODEL_H

#include "kvq_analysis.h"

#ifdef __cplusplus
extern "C" {
#endif

/* -------------------------------------- models in the loop (docs/models.md) */

/* The architectures kvq runs: one row each in kvq_archs.def (KVQ_ARCH_LLAMA, ...). */
typedef enum kvq_arch {
#define KVQ_ARCH(ident, ...) KVQ_ARCH_##ident,
#include "kvq_archs.def"
#undef KVQ_ARCH
    KVQ_ARCH_COUNT
} kvq_arch;
/* Architecture i's general.architecture name ("llama", ...), or NULL past the last. */
const char *kvq_arch_name(int i);
/* The feed-forward's gate activation: silu (SwiGLU) or GELU, tanh form (GeGLU). */
typedef enum kvq_ffn_act { KVQ_ACT_SILU = 0, KVQ_ACT_GELU_TANH } kvq_ffn_act;

typedef struct kvq_model_info {
    char path[1024];
    char name[256];      /* general.name, or the llama2.c file's base name */
    char format[32];     /* "GGUF v3", "llama2.c v0" */
    char arch_name[64];  /* "llama", "qwen2", "qwen3", "gemma3", "phi3" */
    kvq_arch arch;
    int n_layers, dim, n_heads, n_kv_heads, head_dim, ffn_dim, vocab_size, context_length;
    float norm_eps;
    double rope_theta;
    kvq_rope_style rope_style; /* llama: interleaved (GGUF's permuted Q/K); qwen2: half */
    int has_rope_freqs;  /* a rope_freqs tensor divides each pair's frequency */
    double rope_scale;   /* linear RoPE scaling: angles × rope_scale (1: none; 0 read as 1) */
    int tied_output;     /* the output matrix is the token embedding */
    int has_qkv_bias;
    int has_qk_norm;     /* qwen3, gemma3: RMSNorm of each head's q and k before RoPE */
    int has_post_norms;  /* gemma3: RMSNorm of the attention and FFN outputs before the residual add */
    kvq_ffn_act ffn_act;
    float embed_scale;   /* the token embedding is multiplied by it (gemma3: sqrt(dim)); 0: 1 */
    float attn_scale;    /* softmax(attn_scale · q·k); 0: 1/sqrt(head_dim) */
    float logit_softcap; /* final logits c·tanh(z/c); 0: none */
    int sliding_window;  /* W of the sliding-window layers (0: none): p attends to p−W < k <= p */
    int n_swa_layers;    /* how many layers use it (kvq_model_layer_window says which) */
    double rope_theta_swa; /* RoPE base of the sliding-window layers */
    int has_tokenizer;   /* --text works */
    char tokenizer[64];  /* tokenizer.ggml.model, or "llama2.c" */
} kvq_model_info;

typedef struct kvq_model kvq_model;

/* Opens a GGUF v2/v3 file or a llama2.c v0 checkpoint (told by the magic;
 * tokenizer_path: llama2.c's tokenizer.bin, NULL for none).  The file is
 * mapped and checked; weights are dequantized later, a layer at a time. */
kvq_status kvq_model_open(const char *path, const char *tokenizer_path, kvq_model **out, kvq_error *err);
const kvq_model_info *kvq_model_get_info(const kvq_model *m);
/* The sliding window of `layer` (0: the layer attends to every earlier position). */
int kvq_model_layer_window(const kvq_model *m, int layer);
void kvq_model_close(kvq_model *m);
/* The model's SentencePiece tokenizer: BOS, then the text's tokens (*ids
 * malloc'ed).  KVQ_ERR_UNSUPPORTED naming --tokens if the model has none. */
kvq_status kvq_model_tokenize(const kvq_model *m, const char *text, size_t len, int **ids, size_t *n,
                              kvq_error *err);
/* One part of a prompt (a task's context, question or answer) as the
 * tokenizer gives it on its own: no BOS or EOS, the space prefix of a text's
 * start; an empty text gives no tokens (*ids may then be NULL). */
kvq_status kvq_model_tokenize_part(const kvq_model *m, const char *text, size_t len, int **ids, size_t *n,
                                   kvq_error *err);
/* The text file at `path`, tokenized as kvq_model_tokenize does, read and
 * tokenized in segments so that with max_tokens > 0 only as much of the file
 * is read as that many tokens need (cut after a newline followed by
 * printable ASCII, where no token can span); a NUL byte is KVQ_ERR_FORMAT. */
kvq_status kvq_model_tokenize_file(const kvq_model *m, const char *path, size_t max_tokens, int **ids, size_t *n,
                                   kvq_error *err);
/* Whitespace-separated token ids, each below vocab; `what` names the source. */
kvq_status kvq_tokens_parse(const char *what, const char *text, size_t len, int vocab, int **ids,
                            size_t *n, kvq_error *err);
/* The same, read from a file in blocks: at most max_tokens ids (0: all)
 * are read, so /dev/urandom or a huge file cost no more than they; a NUL
 * byte (/dev/zero, a binary file) is KVQ_ERR_FORMAT at the first block. */
kvq_status kvq_tokens_parse_file(const char *path, int vocab, size_t max_tokens, int **ids, size_t *n,
                                 kvq_error *err);

/* Writes kvq-dump/1 (atomically) of a forward pass over tokens[0..T): key,
 * value, query (post-RoPE, not prescaled) and key_pre_rope of the selected
 * layers (NULL: all; the dump's layers are renumbered 0..nlayers−1 and its
 * `source_layers` attribute lists the model's), RoPE attributes (and tables
 * when rope_freqs apply), `tokens` and `mean_nll`.  *mean_nll may be NULL. */
kvq_status kvq_model_dump(kvq_model *m, const int *tokens, int T, const int *layers, int nlayers,
                          const char *out_path, int nthreads, double *mean_nll, kvq_error *err);

typedef enum kvq_policy { KVQ_POLICY_PREFILL = 0, KVQ_POLICY_DECODE } kvq_policy;

/* One evaluated configuration: a quantizer (spec NULL: the exact cache,
 * `-q none`) applied in every layer (layer −1) or one layer only. */
typedef struct kvq_eval_item {
    const kvq_spec *spec;
    int layer;
    kvq_policy policy;
    /* results */
    double k_bits, v_bits;   /* stored bits per element, pooled over the quantized layers */
    double nll, kl, top1;    /* means over the scored positions (0..T−2, or each window's second half) */
    int positions;           /* how many positions were scored */
    double dnll_se;          /* standard error of dnll: sample std of the per-position differences / sqrt(positions) */
    double cache_tokens;     /* mean over the scored positions of the tokens the cache holds per KV head per layer */
} kvq_eval_item;

/* What a corpus evaluation pools over its windows for one configuration
 * (the exact model: nll and positions alone): sums over the scored
 * positions, the stored bits and elements of the quantized layers' caches,
 * and the Welford state (count, mean, squared deviations) of the
 * per-position dnll.  A window's sums are added in window order
 * (kvq_eval_sums_add, Chan's combination for the Welford state), so sums of
 * windows evaluated apart (kvq-eval --shard) merged in window order give the
 * numbers of one run bit for bit. */
typedef struct kvq_eval_sums {
    double nll, kl, top1, positions;
    double k_bits, v_bits, elements;
    double d_n, d_mean, d_m2;
    double ctx_k_bits, ctx_v_bits, ctx_elements; /* with a context: its compressed cache's bits and elements */
    double cache_tokens; /* Σ over the scored positions of the tokens held per KV head (mean over the layers) */
} kvq_eval_sums;
void kvq_eval_sums_add(kvq_eval_sums *acc, const kvq_eval_sums *w);
/* The item's results (nll, kl, top1 as means; bits per element; positions;
 * dnll_se) from its pooled sums. */
void kvq_eval_item_finish(kvq_eval_item *it, const kvq_eval_sums *s);

/* kvq-eval's result files (eval_files.c, docs/models.md#shards): a row's
 * identity (the configuration), the columns (a shard's rows add the window
 * and the sums the run pools), a row's cells (npos: 16 bytes for the
 * positions' text). */
typedef struct kvq_eval_row {
    const char *model, *quantizer, *spec, *policy;
    char layer[16];
} kvq_eval_row;
enum { KVQ_EVAL_NCOLS = 17 }; /* kvq_eval_cells fills this many */
const char *const *kvq_eval_columns(int shard, int *ncols);
void kvq_eval_cells(const kvq_eval_row *r, const kvq_eval_item *it, double nll_ref, const char *tokens, char *npos,
                    kvq_cell *row);
/* A corpus shard of a run: its file, the run's fingerprint (16 hex digits,
 * kvq_eval_fingerprint), "I/N", its items' rows, --chunk and the run's windows. */
typedef struct kvq_eval_shard_id {
    const char *path, *run, *shard;
    const kvq_eval_row *rows;
    int nitems, chunk, nwin;
} kvq_eval_shard_id;
/* A shard file t (read with kvq_csv_read) that a run of shard s resumes:
 * its header, then whole windows w0.. of this run's items in order (rows
 * of another run or shard, or more than the shard's windows, refused);
 * *done: those windows, *keep: the bytes they end at. */
kvq_status kvq_eval_shard_resume(const kvq_eval_shard_id *s, const kvq_csv *t, int w0, int w1, int *done, size_t *keep,
                                 kvq_error *err);
/* Window `window`'s rows of shard s (CSV, no header) to f: each item's row
 * with the sums the run pools (ref: the exact model's, sums: [nitems]). */
kvq_status kvq_eval_shard_rows(const kvq_eval_shard_id *s, int window, const kvq_eval_sums *ref,
                               const kvq_eval_sums *sums, FILE *f);
/* kvq-eval --merge: shard files read, checked to be the whole of one run
 * (one fingerprint, each shard and window once, every window, one exact
 * stream per window, sums a run can write) and their windows' sums pooled
 * in window order; _rows writes the rows of that run (bit for bit the
 * unsharded run's) to rep.  files must outlive the merge. */
typedef struct kvq_eval_merge kvq_eval_merge;
kvq_status kvq_eval_merge_open(const char *const *files, int nfiles, kvq_eval_merge **out, kvq_error *err);
long kvq_eval_merge_windows(const kvq_eval_merge *m);
int kvq_eval_merge_items(const kvq_eval_merge *m);
kvq_status kvq_eval_merge_rows(const kvq_eval_merge *m, kvq_report *rep);
void kvq_eval_merge_free(kvq_eval_merge *m);

typedef struct kvq_eval_opts {
    int stride;        /* decode: the cache is re-quantized every `stride` positions (1: exact decode) */
    uint64_t seed;
    int nthreads;      /* <= 0: all cores */
    kvq_calib *calib;  /* for specs that need one */
    size_t max_bytes;  /* bound on the hidden states kept at once (0: 4 GiB) */
    /* progress (may be NULL): called after each layer of each pass */
    void (*progress)(void *ud, int pass, int npasses, int layer, int nlayers);
    void *ud;
    /* corpus evaluation (docs/models.md, llama.cpp perplexity's protocol): chunk > 0
     * cuts the tokens into consecutive windows of `chunk` (the last partial
     * one dropped; the first token of each replaced by BOS when the model's
     * tokenizer adds one), evaluates each from an empty cache and scores
     * positions t >= chunk/2; `chunks` > 0 keeps only the first ones.
     * window_progress (may be NULL) is called after each window. */
    int chunk, chunks;
    void (*window_progress)(void *ud, int done, int total);
    /* a share of a corpus run (kvq-eval --shard): only windows [window_begin,
     * window_end) of the chunk's windows (both 0: all) */
    int window_begin, window_end;
    /* optional: after each window, its sums — the exact model's (ref) and
     * each item's (items[nitems]) — before they are pooled; a failure stops
     * the run with that status */
    kvq_status (*window_done)(void *ud, int window, const kvq_eval_sums *ref, const kvq_eval_sums *items,
                              kvq_error *err);
    void *window_ud; /* window_done's ud */
    /* optional: the NLL of every scored position, [nitems + 1][positions]
     * (row 0 the exact model, row 1 + i item i; windows one after another) */
    double *position_nll;
    /* optional: the exact model's logits at positions logit_pos[0..n_logit_pos)
     * (each below T) into logits [n_logit_pos][vocab_size], for checks
     * against another implementation */
    const int *logit_pos;
    int n_logit_pos;
    float *logits;
    /* the context protocol (kvq-eval --context, SPEC §3.11), 0: none: in
     * each window the first `context` tokens are prefilled exactly and each
     * item's cache of them compressed once (scores from their own queries);
     * the rest are teacher-forced on top (their own entries exact under
     * KVQ_POLICY_PREFILL, stored by the spec — a tokens(...)'s HI — under
     * KVQ_POLICY_DECODE) and only positions t >= context are scored (with
     * chunk too, in place of the second half) */
    int context;
    /* > 0: the first scored position, in place of `context` or the second
     * half (at least `context`): a task scores only its answer */
    int score_from;
    /* optional: whether each scored position's arg-max is its target token,
     * [nitems + 1][positions] laid out as position_nll */
    unsigned char *position_hit;
} kvq_eval_opts;

/* What an evaluation's numbers depend on, as 64 bits (FNV-1a): the model
 * file (its size, first and last MiB), the tokens, the policy and its
 * stride, the chunking, the context, the seed and the calibration file (size, first and
 * last MiB; NULL: none).  Not the threads: results do not depend on them.
 * kvq-alloc writes it beside every sensitivity row and refuses to resume or
 * merge rows of another. */
uint64_t kvq_eval_fingerprint(const kvq_model *m, const int *tokens, int T, kvq_policy policy,
                              const kvq_eval_opts *o, const char *calib_path);

/* Teacher-forced evaluation (docs/models.md): the exact model and every item's
 * quantized cache run together in lockstep (an item whose cache is still
 * exact computes nothing of its own); *nll_ref receives the exact model's mean NLL over the scored
 * positions (pooled over the windows with o->chunk). */
kvq_status kvq_model_eval(kvq_model *m, const int *tokens, int T, kvq_eval_item *items, int nitems,
                          const kvq_eval_opts *o, double *nll_ref, kvq_error *err);

/* ------------------------------------------- retrieval tasks (SPEC §8) */

/* What kvq-gen --task writes (docs/models.md#retrieval-tasks): needle (one fact "The
 * special magic number for W is D." in filler text), multikey (four such
 * facts, one asked), kv ("key: value." pairs, one key asked), mqar
 * ("key value" pairs, the question a key). */
typedef enum kvq_task_kind { KVQ_TASK_NEEDLE = 0, KVQ_TASK_MULTIKEY, KVQ_TASK_KV, KVQ_TASK_MQAR } kvq_task_kind;

/* One task: the prompt is BOS + context + question, the answer teacher-forced after it. */
typedef struct kvq_task {
    char *id;        /* NULL: none given */
    char *context, *question, *answer;
    double depth;    /* the fact's relative position in the context, 0..1; NAN: none */
    size_t line;     /* its line in the file (1-based); 0 when generated */
} kvq_task;

const char *kvq_task_kind_name(kvq_task_kind k);
int kvq_task_kind_parse(const char *name, kvq_task_kind *k); /* 0, or -1 for an unknown name */
/* Tokens of a text (without BOS); NULL in kvq_tasks_generate: kvq_task_approx_tokens. */
typedef size_t (*kvq_token_count_fn)(void *ud, const char *text, size_t len);
/* One token per run of letters, per digit and per other visible character:
 * the bundled model's tokenizer on generated text, an approximation elsewhere. */
size_t kvq_task_approx_tokens(const char *text, size_t len);
/* `count` seeded tasks of `kind` whose contexts hold as many units
 * (sentences or pairs) as fit in context_tokens tokens; depths spread evenly
 * over 0..1 (one task: 0.5).  *out: kvq_tasks_free(*out, count). */
kvq_status kvq_tasks_generate(kvq_task_kind kind, size_t count, int context_tokens, uint64_t seed,
                              kvq_token_count_fn count_fn, void *ud, kvq_task **out, kvq_error *err);
/* A task as one JSON object (no newline), with "task": kind when kind != NULL; malloc'ed, NULL: no memory. */
char *kvq_task_json(const kvq_task *t, const char *kind);
/* A JSON-lines task file's bytes (path names it in errors): one object per
 * non-blank line with string fields context, question, answer (not empty),
 * optional id (string) and depth (number in 0..1 or null); other fields are
 * ignored.  KVQ_ERR_FORMAT naming the file, the line and what is wrong. */
kvq_status kvq_tasks_parse(const char *path, const char *data, size_t size, kvq_task **out, size_t *n,
                           kvq_error *err);
void kvq_tasks_free(kvq_task *t, size_t n);

/* One task's result under one configuration (kvq_model_eval_tasks). */
typedef struct kvq_task_result {
    double nll;          /* −log p(answer | prompt): the answer tokens' NLL, summed */
    int exact;           /* 1: every answer token is the arg-max (greedy decoding gives the answer) */
    double k_bits, v_bits, elements; /* the context's compressed cache: stored bits, elements */
    int answer_tokens, context_tokens;
} kvq_task_result;

/* "task ID (line N)", "the task of line N" or "task I": how errors name a task. */
void kvq_task_name(const kvq_task *t, size_t index, char *buf, size_t len);
/* Every task tokenizes and fits the model's context: KVQ_ERR_FORMAT naming
 * the first that does not (an answer without tokens, too long a prompt). */
kvq_status kvq_model_check_tasks(const kvq_model *m, const kvq_task *tasks, size_t ntasks, kvq_error *err);
/* Tasks [t0, t1) (SPEC §8): each through kvq_model_eval with the context
 * protocol (context = BOS + the task's context, scored: the answer alone);
 * opts as for kvq_model_eval (its chunking, context and outputs are set
 * per task; window_progress, if set, is called after each task).  res:
 * [t1 − t0][nitems + 1], row 0 the exact model. */
kvq_status kvq_model_eval_tasks(kvq_model *m, const kvq_task *tasks, size_t t0, size_t t1, kvq_eval_item *items,
                                int nitems, const kvq_eval_opts *opts, kvq_task_result *res, kvq_error *err);

/* What one row reports: item `item` over the selected tasks (select NULL: all). */
typedef struct kvq_task_summary {
    int tasks;
    double nll_ref, nll, dnll, dnll_se; /* answer NLL (nats per answer); dnll_se over tasks */
    double exact_ref, exact, recall_drop;
    double k_bits, v_bits;              /* the contexts' caches, pooled by elements */
} kvq_task_summary;
void kvq_task_pool(const kvq_task_result *res, size_t ntasks, int nitems, int item, const unsigned char *select,
                   kvq_task_summary *out);

/* kvq-eval --tasks's result files (task_files.c): the rows of a run to f
 * (per configuration over all tasks and, with per_depth B > 0, one per
 * depth bucket), a shard's rows (one per task and configuration, tasks
 * [t0, t1) of ntasks; res holds only those), whether a file starts with a
 * shard's header, and the merge of shards into the rows of one run (bit for
 * bit), each task and configuration once and every one present. */
kvq_status kvq_task_rows(FILE *f, kvq_format fmt, const kvq_eval_row *rows, int nitems, const kvq_task_result *res,
                         const double *depth, size_t ntasks, double per_depth);
kvq_status kvq_task_shard_rows(FILE *f, const kvq_eval_row *rows, int nitems, const kvq_task_result *res,
                               const double *depth, size_t t0, size_t t1, size_t ntasks, const char *run);
int kvq_is_task_shard(const char *path);
typedef struct kvq_task_merge kvq_task_merge;
kvq_status kvq_task_merge_open(const char *const *files, int nfiles, kvq_task_merge **out, kvq_error *err);
size_t kvq_task_merge_tasks(const kvq_task_merge *m);
kvq_status kvq_task_merge_rows(const kvq_task_merge *m, FILE *f, kvq_format fmt, double per_depth);
void kvq_task_merge_free(kvq_task_merge *m);

#ifdef __cplusplus
}
#endif
#endif

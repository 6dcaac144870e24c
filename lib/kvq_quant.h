/* kvq_quant.h — part of libkvq's public API (kvq.h includes every part):
 * the quantizer registry and specs (docs/quantizers.md): a spec on a layer. */
#ifndef KVQ_API_QUANT_H
#define KVQ_API_QUANT_H

#include "kvq_dump.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---------------------------------- quantizer registry (docs/quantizers.md) */

typedef enum kvq_param_type { KVQ_PARAM_INT, KVQ_PARAM_REAL, KVQ_PARAM_CHOICE } kvq_param_type;

typedef struct kvq_param {
    const char *key;
    kvq_param_type type;
    const char *def;     /* default as text; NULL: unset unless given (e.g. kivi kbits) */
    double min, max;     /* inclusive range of INT/REAL values */
    const char *choices; /* CHOICE: "head|layer" */
    const char *help;
    int quiet_default;   /* left out of kvq_spec_format_full at its default (an option, e.g. prerotate) */
    /* Where the parsed value goes in the family's options struct, read with
     * kvq_spec_opts (KVQ_OPT(type, field) sets both): an int for INT and
     * CHOICE (the choice's index; KVQ_UNSET when a key without a default
     * is not given), a double for REAL (NaN when unset).  typed = 0: in
     * val[] only (e.g. the shared `prerotate` key). */
    int typed;
    size_t offset;
} kvq_param;

#define KVQ_OPT(type, field) .typed = 1, .offset = offsetof(type, field)
#define KVQ_UNSET (-2147483647 - 1) /* INT_MIN: an int option with no value */
#define KVQ_MAX_PARAMS 16
#define KVQ_SPEC_MAX 1024 /* a mix(...) holds a spec per range */
#define KVQ_OPTS_MAX 256  /* the largest options struct of a family */

/* A parsed spec string `name:key=value,...`. */
typedef struct kvq_spec {
    const struct kvq_quantizer *q;
    double val[KVQ_MAX_PARAMS];         /* number, or index into `choices`; NaN if unset */
    unsigned char given[KVQ_MAX_PARAMS]; /* set explicitly in the string */
    char text[KVQ_SPEC_MAX];            /* the string as given */
    union {
        double align;
        unsigned char bytes[KVQ_OPTS_MAX];
    } opts; /* the family's options struct, filled by kvq_spec_parse */
} kvq_spec;

/* The family's options as its own struct (its parameter table's KVQ_OPT
 * fields), parsed and checked once: `const my_opts *o = kvq_spec_opts(sp);`. */
static inline const void *kvq_spec_opts(const kvq_spec *spec) { return spec->opts.bytes; }

/* What a quantizer sees besides the layer. */
typedef struct kvq_quant_ctx {
    const kvq_dump_info *info;
    int layer;
    uint64_t seed;
    int nthreads;
    const void *calib;    /* the spec's calibration state for this layer (or NULL) */
    const kvq_rope *rope; /* the dump's RoPE when the quantizer asked for it (or NULL) */
    /* How the layer's attention is computed (scale, soft-cap, window), for
     * tokens(...)'s selectors; NULL: plain softmax(q·k/sqrt(D)). */
    const struct kvq_attn_mode *attn;
    /* [H][T]: the position of token t of head h when tokens(...) runs a spec
     * on its kept tokens only (kvq_token_pos); NULL: token t is at t. */
    const int *pos;
    /* 1: the caller compresses while decoding (kvq-eval --policy decode),
     * so a tokens(...) with target= compresses the context by its keep=
     * here; 0: target= is refused (it has no meaning on a whole cache). */
    int decoding;
    /* The output of the spec this spec's family names as its first stage
     * (turboquant's: lloydmax at b − 1 bits, b for variant=mse), holding
     * the head being quantized, when the caller ran that spec on the same
     * input (the analysis, for a spec that runs head by head: no prerotate,
     * mix or tokens(...) around it); NULL: the family computes it. */
    const struct kvq_quant_out *first_stage;
    /* What the family's layer_prepare found on this layer for its heads
     * (fp8's and fp4's tensor scales), at most KVQ_LAYER_STATE_MAX bytes;
     * NULL where the family has none or the caller left it to the family. */
    const void *layer_state;
} kvq_quant_ctx;
#define KVQ_LAYER_STATE_MAX 64

/* What a quantizer produces: K', V' [H][T][D] and the stored bits per head. */
typedef struct kvq_quant_out {
    float *key, *value;      /* [H][T][D], or from head head0 on (below) */
    double *k_bits, *v_bits; /* [H], filled by the quantizer */
    double *static_bytes;    /* [H], zeroed by the caller: bytes held once per model
                                whatever the sequence length (centres, codebooks, rotations) */
    /* Optional fused error sums, [2][H] (K heads, then V heads), zeroed by the
     * caller; NULL when not asked.  A quantizer may add each head's
     * reconstruction error here while the data is in cache (kvq_head_recon)
     * and set recon_done[tensor * H + h]; the driver computes the rest. */
    struct kvq_recon_acc *recon;
    unsigned char *recon_done;
    /* [H][T] (or NULL): 1 for a token kept in the cache, 0 for one a
     * tokens(...; drop) spec evicted (its K', V' rows are 0 and attention
     * must leave it out); *dropped is set to 1 when any is.  A spec that
     * drops tokens fails when the caller gives no keep buffer. */
    unsigned char *keep;
    int dropped;
    /* key and value hold head h at (h - head0)·T·D: 0 (a zeroed struct) for
     * the whole layer; h for one head's [T][D] (the analysis runs a family's
     * quantize_head into its metrics thread's buffer). */
    int head0;
} kvq_quant_out;

/* A quantizer of the registry (its definition, for the authors of a family,
 * is in quant/quant.h): read through these. */
typedef struct kvq_quantizer kvq_quantizer;
const char *kvq_quantizer_name(const kvq_quantizer *q);
const char *kvq_quantizer_description(const kvq_quantizer *q);
int kvq_quantizer_nparams(const kvq_quantizer *q);
const kvq_param *kvq_quantizer_param(const kvq_quantizer *q, int i);
int kvq_quantizer_in_default_set(const kvq_quantizer *q); /* part of kvq-analyze's default set */
unsigned kvq_quantizer_read_flags(const kvq_quantizer *q); /* KVQ_READ_* tensors it reads */
/* The keys of a non-default spec the tests run beside the default one ("bits=3,group=4"): NAME:KEYS */
const char *kvq_quantizer_example_spec(const kvq_quantizer *q);

size_t kvq_quantizer_count(void);
const kvq_quantizer *kvq_quantizer_at(size_t i);
const kvq_quantizer *kvq_quantizer_find(const char *name);
/* The token selectors of tokens(SELECT; HI; LO) (docs/quantizers.md#tokens),
 * described as families are (kvq_quantizer_name, _description, _param), and
 * whether selector i scores by attention (reads the queries). */
size_t kvq_selector_count(void);
const kvq_quantizer *kvq_selector_at(size_t i);
int kvq_selector_needs_queries(size_t i);

kvq_status kvq_spec_parse(const char *text, kvq_spec *out, kvq_error *err);
/* The quantizer's check_shape for heads of head_dim channels (KVQ_OK if it
 * has none); kvq_quantize_layer checks it too. */
kvq_status kvq_spec_check_shape(const kvq_spec *spec, int head_dim, kvq_error *err);
/* The spec q contributes to kvq-analyze's default set: "name", or
 * "name:default_spec" when it has one. */
kvq_status kvq_spec_default(const kvq_quantizer *q, kvq_spec *out, kvq_error *err);
/* Runs spec's quantizer on one layer: out->key/value [H][T][D], out->k_bits/v_bits [H]. */
kvq_status kvq_quantize_layer(const kvq_spec *spec, const kvq_quant_ctx *ctx, const kvq_layer *in,
                              kvq_quant_out *out, kvq_error *err);
/* Index of `key` in the quantizer's parameter table, or -1. */
int kvq_spec_param_index(const kvq_quantizer *q, const char *key);
/* Parses one value of parameter `key` of q (type and range; no cross-key
 * check).  KVQ_ERR_USAGE naming the quantizer's keys for an unknown key. */
kvq_status kvq_param_parse(const kvq_quantizer *q, const char *key, const char *text, double *val,
                           kvq_error *err);
/* Writes "name:key=value,..." with every parameter (defaults filled in). */
void kvq_spec_format_full(const kvq_spec *spec, char *buf, size_t len);
/* Writes the quantizer table for --list-quantizers. */
void kvq_registry_describe(FILE *f);
/* Does this spec need a --calib dump? (a mix: does any of its specs) */
int kvq_spec_needs_calib(const kvq_spec *spec);
/* The one calibration rule: KVQ_ERR_USAGE, "SPEC: " KVQ_NEEDS_CALIB, when
 * the spec needs a calibration dump and the caller has none (the tools add
 * how to give one). */
#define KVQ_NEEDS_CALIB "needs a calibration dump of the same model (a dump of another text)"
kvq_status kvq_spec_check_calib(const kvq_spec *spec, int have_calib, kvq_error *err);
/* The tensors the spec reads besides K and V (KVQ_READ_*; a mix: all of its specs'). */
unsigned kvq_spec_read_flags(const kvq_spec *spec);

/* How many composite specs (mix(...), tokens(...)) this process has taken
 * apart: each distinct text once, when it is first parsed, whatever uses it
 * later (layers, dumps, the calibration, reports, DecodeCache); for tests. */
unsigned long kvq_spec_splits(void);
/* How many head tensors this process's quantizers took from another spec's
 * output as their first stage (ctx->first_stage) instead of computing it;
 * for tests. */
unsigned long kvq_first_stages_taken(void);

/* Mixed precision (docs/quantizers.md#mix): `mix(RANGE=SPEC;RANGE=SPEC;...)`
 * runs each layer with the spec of the range that holds it; RANGE is a
 * layer list as --layers takes it (a-b, a- to the last layer, a,b).  A
 * plain spec is its own spec for every layer. */
int kvq_spec_is_mix(const kvq_spec *spec);
/* The spec that quantizes `layer` (KVQ_ERR_USAGE if no range holds it). */
kvq_status kvq_spec_for_layer(const kvq_spec *spec, int layer, kvq_spec *out, kvq_error *err);
/* Every layer 0..nlayers-1 in exactly one range and no range past the last
 * (else KVQ_ERR_USAGE naming the layer or the range); KVQ_OK for a plain spec. */
kvq_status kvq_spec_check_layers(const kvq_spec *spec, int nlayers, kvq_error *err);

/* A spec parsed once for a run on nlayers layers (a driver, the model
 * loop, kvq-alloc, the bindings): a mix's ranges checked (as
 * kvq_spec_check_layers) and resolved per layer, every item parsed once, a
 * tokens(...) taken apart once; what it reads and whether it needs
 * calibration known.  Run it with kvq_quantize_layer_in. */
typedef struct kvq_resolved_spec kvq_resolved_spec;
kvq_status kvq_spec_resolve(const kvq_spec *spec, int nlayers, kvq_resolved_spec **out, kvq_error *err);
void kvq_resolved_spec_free(kvq_resolved_spec *r);
/* Layer l's own spec (never a mix). */
const kvq_spec *kvq_resolved_spec_at(const kvq_resolved_spec *r, int layer);
unsigned kvq_resolved_spec_flags(const kvq_resolved_spec *r); /* as kvq_spec_read_flags */
int kvq_resolved_spec_needs_calib(const kvq_resolved_spec *r); /* as kvq_spec_needs_calib */
kvq_status kvq_resolved_spec_check_shape(const kvq_resolved_spec *r, int head_dim, kvq_error *err); /* as kvq_spec_check_shape */
/* The spec by which generation stores the tokens that follow a context
 * compressed once (kvq-eval --context with --policy decode): layer l's
 * spec, or a tokens(...)'s HI; NULL when HI is none (stored exactly). */
const kvq_spec *kvq_resolved_spec_continuation(const kvq_resolved_spec *r, int layer);
/* kvq_quantize_layer of layer ctx->layer's spec, with nothing parsed again. */
kvq_status kvq_quantize_layer_in(const kvq_resolved_spec *r, const kvq_quant_ctx *ctx, const kvq_layer *in,
                                 kvq_quant_out *out, kvq_error *err);

/* A calibration dump and the states computed from it, kept for the whole
 * run so that every dump, spec and sweep point sharing a state reuses it. */
typedef struct kvq_calib kvq_calib;
kvq_status kvq_calib_open(const char *path, kvq_calib **out, kvq_error *err);
/* Fails unless the calibration dump has the model shape of `info`
 * (layers, KV heads, head_dim). */
kvq_status kvq_calib_check(const kvq_calib *c, const char *dump_path, const kvq_dump_info *info,
                           kvq_error *err);
/* Fails unless the calibration dump has layer `layer`, H KV heads and
 * head_dim D (arrays given by a caller rather than a dump). */
kvq_status kvq_calib_check_layer(const kvq_calib *c, int layer, int H, int D, kvq_error *err);
/* The state of `spec` for `layer` (computed on first use); *state may be NULL. */
kvq_status kvq_calib_state(kvq_calib *c, const kvq_spec *spec, int layer, uint64_t seed,
                           int nthreads, const void **state, kvq_error *err);
/* Number of calibration states computed so far (each (layer, quantizer, key) once). */
size_t kvq_calib_count(const kvq_calib *c);
void kvq_calib_close(kvq_calib *c);

#ifdef __cplusplus
}
#endif
#endif

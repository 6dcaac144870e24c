/* test_registry.c — every registered quantizer, found by looping over the
 * registry (ggml's test-quantize-fns style), so a new family is covered by
 * its table entry alone: its default spec, its row's example_spec and one
 * spec with a key changed (the first alternative value that parses), each on a GQA layer with
 * pre-RoPE keys and RoPE, calibrated on a second layer where the spec asks:
 *   - results bit-identical at 1, 2 and 3 threads and at every SIMD level
 *     (portable, AVX2, all the CPU has);
 *   - every output finite, bits per element in (0, 64], static bytes >= 0;
 *   - relative reconstruction error of K and V below 1, and below the
 *     ceiling of the code's bit width (ggml's limits per type);
 *   - the same numbers from the row's plain reference (every row has one);
 *   - a second run is identical (no hidden state) and the input untouched;
 *   - where the analysis runs it head by head, each head alone is the same.
 * A few variants with code paths of their own are listed beside. */
#include "testutil.h"
#include "simd.h"

#include <float.h>

/* TC: the calibration layer's tokens, enough distinct vectors for vq's
 * default 256 centres per codebook */
enum { H = 2, HQ = 4, T = 48, D = 32, TC = 320 };

typedef struct run_result {
    float *k, *v;
    double kb[H], vb[H], sb[H];
} run_result;

static void fill_layer(kvq_layer *L, int ntok, uint64_t seed, const kvq_rope *rope)
{
    size_t n = (size_t)H * ntok * D;
    fill_normal(L->key_pre_rope, n, seed, 1.0);
    for (int h = 0; h < H; h++) /* outlier channels, as real keys have */
        for (int t = 0; t < ntok; t++) L->key_pre_rope[((size_t)h * ntok + t) * D + 3] *= 8.0f;
    memcpy(L->key, L->key_pre_rope, n * sizeof(float));
    for (int h = 0; h < H; h++)
        for (int t = 0; t < ntok; t++) kvq_rope_rotate(rope, L->key + ((size_t)h * ntok + t) * D, t, 0);
    fill_normal(L->value, n, seed + 1, 0.5);
    fill_normal(L->query, (size_t)HQ * ntok * D, seed + 2, 1.0);
}

/* The spec's calibration state on calib, set as ctx->calib, when the spec
 * asks for one (the caller frees it with calib_free); NULL otherwise. */
static void *calibrate(const kvq_spec *sp, const kvq_layer *calib, kvq_quant_ctx *ctx)
{
    kvq_error err = {0};
    void *state = NULL;
    char key[256];
    if (sp->q->calib_key && sp->q->calib_key(sp, key, sizeof key)) {
        ck_assert_msg(sp->q->calibrate(sp, ctx, calib, &state, &err) == KVQ_OK, "%s: calibrate: %s", sp->text, err.msg);
        ctx->calib = state;
    }
    return state;
}

/* One spec on L at `threads` threads and SIMD cap `simd` (-1: the
 * environment's), through the registered path or, with reference, the
 * family's plain reference (kvq_quantize_layer_reference).  1, or 0 for a
 * reference the family does not have (nothing allocated then). */
static int run(const kvq_spec *sp, const kvq_layer *L, const kvq_layer *calib, const kvq_rope *rope,
               int threads, int simd, int reference, run_result *r)
{
    kvq_error err = {0};
    size_t n = (size_t)H * T * D;
    r->k = malloc(n * sizeof(float)), r->v = malloc(n * sizeof(float));
    ck_assert(r->k && r->v);
    memset(r->sb, 0, sizeof r->sb);
    kvq_simd_cap(simd);
    kvq_quant_ctx ctx = {.layer = 1, .seed = 7, .nthreads = threads, .rope = rope};
    void *state = calibrate(sp, calib, &ctx);
    kvq_quant_out out = {.key = r->k, .value = r->v, .k_bits = r->kb, .v_bits = r->vb, .static_bytes = r->sb};
    kvq_status st = reference ? kvq_quantize_layer_reference(sp, &ctx, L, &out, &err)
                              : kvq_quantize_layer(sp, &ctx, L, &out, &err);
    if (state) sp->q->calib_free(state);
    kvq_simd_cap(-1);
    if (reference && st == KVQ_ERR_UNSUPPORTED && !err.msg[0]) {
        free(r->k), free(r->v);
        return 0;
    }
    ck_assert_msg(st == KVQ_OK, "%s (%s, %d threads, simd %d): %s", sp->text, reference ? "reference" : "registered",
                  threads, simd, err.msg);
    return 1;
}

static void same(const kvq_spec *sp, const run_result *a, const run_result *b, const char *what)
{
    size_t n = (size_t)H * T * D;
    ck_assert_msg(!memcmp(a->k, b->k, n * sizeof(float)) && !memcmp(a->v, b->v, n * sizeof(float)),
                  "%s: K'/V' differ %s", sp->text, what);
    ck_assert_msg(!memcmp(a->kb, b->kb, sizeof a->kb) && !memcmp(a->vb, b->vb, sizeof a->vb) &&
                      !memcmp(a->sb, b->sb, sizeof a->sb),
                  "%s: bits differ %s", sp->text, what);
}

static int references; /* specs compared with their family's reference */
static int by_head_specs; /* specs the analysis runs head by head */

/* A spec that the analysis runs head by head (kvq_spec_by_head): each head
 * of K and V quantized alone, last head first, into a buffer of one head
 * (kvq_quant_out.head0 = h) gives that head of the layer's run `base`, its
 * bits and static bytes included.  A family whose quantize_head wrote
 * another head, or read what an earlier head wrote, fails here. */
static void check_by_head(const kvq_spec *sp, const kvq_layer *L, const kvq_layer *calib, const kvq_rope *rope,
                          const run_result *base)
{
    if (!kvq_spec_by_head(sp, T, D)) return;
    by_head_specs++;
    kvq_error err = {0};
    kvq_quant_ctx ctx = {.layer = 1, .seed = 7, .nthreads = 1, .rope = rope};
    void *state = calibrate(sp, calib, &ctx);
    size_t TD = (size_t)T * D;
    float *buf = malloc(2 * TD * sizeof(float));
    double kb[H] = {0}, vb[H] = {0}, sb[H] = {0};
    kvq_recon_acc recon[2 * H] = {{0}};
    unsigned char done[2 * H] = {0};
    ck_assert(buf);
    for (int h = H - 1; h >= 0; h--) {
        memset(buf, 0xff, 2 * TD * sizeof(float)); /* NaN where nothing is written */
        kvq_quant_out out = {.key = buf,
                             .value = buf + TD,
                             .k_bits = kb,
                             .v_bits = vb,
                             .static_bytes = sb,
                             .recon = recon,
                             .recon_done = done,
                             .head0 = h};
        for (int tensor = 0; tensor < 2; tensor++)
            ck_assert_msg(kvq_quantize_one_head(sp, &ctx, L, &out, tensor, h, &err) == KVQ_OK, "%s: head %d: %s",
                          sp->text, h, err.msg);
        ck_assert_msg(!memcmp(buf, base->k + h * TD, TD * sizeof(float)) &&
                          !memcmp(buf + TD, base->v + h * TD, TD * sizeof(float)),
                      "%s: head %d alone differs from the layer's run", sp->text, h);
    }
    ck_assert_msg(!memcmp(kb, base->kb, sizeof kb) && !memcmp(vb, base->vb, sizeof vb) &&
                      !memcmp(sb, base->sb, sizeof sb),
                  "%s: bits of the heads alone differ from the layer's run", sp->text);
    if (state) sp->q->calib_free(state);
    free(buf);
}

/* The largest relative Frobenius error a spec may have at b code bits on
 * fill_layer's tensors (Gaussian; K with an outlier channel 8x the
 * others), as ggml's test-quantize-fns holds each type to a limit for its
 * bit width: a b-bit code halves its error per bit, so the ceiling is
 * 4·2^-b (the worst family at its width today: turboquant, 3.55·2^-b;
 * KVQ_TEST_VERBOSE=1 prints every spec's error and ceiling). */
static double error_ceiling(int bits) { return bits > 0 ? fmin(0.99, 4.0 * exp2(-bits)) : 1.0; }

/* The code bits of a tensor (0 = K, 1 = V): the spec's kbits / vbits where
 * set, else its bits; 0 for families whose precision is not a bits key
 * (fp8, fp4 and ggml are formats, held to their references and to the
 * method's own code in test_families). */
static int code_bits(const kvq_spec *sp, int tensor)
{
    int bits = 0;
    for (int i = 0; i < sp->q->nparams; i++) {
        const char *key = sp->q->params[i].key;
        if (isnan(sp->val[i])) continue;
        if (!strcmp(key, tensor ? "vbits" : "kbits")) return (int)sp->val[i];
        if (!strcmp(key, "bits")) bits = (int)sp->val[i];
    }
    return bits;
}

static double rel_error(const float *x, const float *y, size_t n)
{
    double e = 0, s = 0;
    for (size_t i = 0; i < n; i++) e += ((double)x[i] - y[i]) * ((double)x[i] - y[i]), s += (double)x[i] * x[i];
    return sqrt(e / s);
}

/* The first spec of q with one key changed from its default that parses
 * and runs on heads of D (prerotate last: the family's own keys first). */
static int alternative_spec(const kvq_quantizer *q, kvq_spec *out)
{
    for (int pass = 0; pass < 2; pass++)
        for (int i = 0; i < q->nparams; i++) {
            const kvq_param *p = &q->params[i];
            if ((pass == 0) == !strcmp(p->key, "prerotate")) continue;
            char vals[8][64];
            int nv = 0;
            if (p->type == KVQ_PARAM_CHOICE) {
                const char *c = p->choices;
                while (*c && nv < 8) {
                    size_t len = strcspn(c, "|");
                    snprintf(vals[nv++], sizeof vals[0], "%.*s", (int)len, c);
                    c += len + (c[len] == '|');
                }
            } else {
                double d = p->def ? atof(p->def) : p->min, cand[] = {d + 1, d * 2, d / 2, p->min, p->max};
                for (size_t k = 0; k < sizeof cand / sizeof cand[0]; k++)
                    snprintf(vals[nv++], sizeof vals[0], p->type == KVQ_PARAM_INT ? "%.0f" : "%g", cand[k]);
            }
            for (int k = 0; k < nv; k++) {
                if (p->def && !strcmp(vals[k], p->def)) continue;
                char text[2 * KVQ_SPEC_MAX];
                kvq_error err = {0};
                snprintf(text, sizeof text, "%.64s:%.64s=%.63s", q->name, p->key, vals[k]);
                if (kvq_spec_parse(text, out, &err) == KVQ_OK && kvq_spec_check_shape(out, D, &err) == KVQ_OK) return 1;
            }
        }
    return 0;
}

/* The typed options (kvq_spec_opts) hold the parsed values: ints for INT
 * and CHOICE (KVQ_UNSET where unset), doubles for REAL; no two fields of a
 * family overlap. */
static void check_typed_options(const kvq_spec *sp)
{
    const kvq_quantizer *q = sp->q;
    int typed = 0;
    for (int i = 0; i < q->nparams; i++) {
        const kvq_param *p = &q->params[i];
        if (!p->typed) continue;
        typed++;
        size_t size = p->type == KVQ_PARAM_REAL ? sizeof(double) : sizeof(int);
        for (int k = 0; k < i; k++) {
            const kvq_param *r = &q->params[k];
            size_t rsize = r->type == KVQ_PARAM_REAL ? sizeof(double) : sizeof(int);
            ck_assert_msg(!r->typed || p->offset + size <= r->offset || r->offset + rsize <= p->offset,
                          "%s: options fields of %s and %s overlap", q->name, p->key, r->key);
        }
        const unsigned char *at = (const unsigned char *)kvq_spec_opts(sp) + p->offset;
        if (p->type == KVQ_PARAM_REAL) {
            double v;
            memcpy(&v, at, sizeof v);
            ck_assert_msg(isnan(sp->val[i]) ? isnan(v) : v == sp->val[i], "%s: %s: options field %g, value %g",
                          sp->text, p->key, v, sp->val[i]);
        } else {
            int v;
            memcpy(&v, at, sizeof v);
            ck_assert_msg(isnan(sp->val[i]) ? v == KVQ_UNSET : v == (int)sp->val[i],
                          "%s: %s: options field %d, value %g", sp->text, p->key, v, sp->val[i]);
        }
    }
    /* every key of a family is a typed field, but the shared prerotate option */
    int shared = kvq_spec_param_index(q, "prerotate") >= 0;
    ck_assert_msg(typed == q->nparams - shared, "%s: %d of %d keys are typed options fields", q->name, typed,
                  q->nparams);
}

static void check_spec(const kvq_spec *sp, const kvq_layer *L, const kvq_layer *calib, const kvq_rope *rope)
{
    check_typed_options(sp);
    if (getenv("KVQ_TEST_VERBOSE")) fprintf(stderr, "registry: %s\n", sp->text);
    size_t n = (size_t)H * T * D;
    float *k0 = malloc(n * sizeof(float));
    memcpy(k0, L->key, n * sizeof(float));
    run_result base, other;
    run(sp, L, calib, rope, 1, -1, 0, &base);
    ck_assert_msg(!memcmp(k0, L->key, n * sizeof(float)), "%s wrote to its input", sp->text);
    for (size_t i = 0; i < n; i++)
        if (!isfinite(base.k[i]) || !isfinite(base.v[i])) ck_abort_msg("%s: non-finite output at %zu", sp->text, i);
    for (int h = 0; h < H; h++) {
        double kbe = base.kb[h] / ((double)T * D), vbe = base.vb[h] / ((double)T * D);
        ck_assert_msg(kbe > 0 && kbe <= 64 && vbe > 0 && vbe <= 64, "%s: head %d bits per element %g, %g", sp->text, h,
                      kbe, vbe);
        ck_assert_msg(base.sb[h] >= 0, "%s: static bytes %g", sp->text, base.sb[h]);
    }
    double ek = rel_error(L->key, base.k, n), ev = rel_error(L->value, base.v, n);
    ck_assert_msg(ek < 1 && ev < 1, "%s: relative error K %g, V %g", sp->text, ek, ev);
    /* the error ceiling of the code's bit width (test-quantize-fns' limits per type); a
     * code over several elements (vq) stores fewer bits per element than the code has */
    int kb = code_bits(sp, 0), vb = code_bits(sp, 1);
    double kbe = 0, vbe = 0;
    for (int h = 0; h < H; h++) kbe += base.kb[h] / ((double)H * T * D), vbe += base.vb[h] / ((double)H * T * D);
    if (kbe < kb) kb = (int)kbe;
    if (vbe < vb) vb = (int)vbe;
    if (getenv("KVQ_TEST_VERBOSE"))
        fprintf(stderr, "  K %d bits: %.4f (ceiling %.4f); V %d bits: %.4f (%.4f)\n", kb, ek, error_ceiling(kb), vb, ev,
                error_ceiling(vb));
    ck_assert_msg(ek <= error_ceiling(kb) && ev <= error_ceiling(vb),
                  "%s: relative error K %g at %d bits, V %g at %d bits: above the ceilings %g, %g", sp->text, ek, kb, ev,
                  vb, error_ceiling(kb), error_ceiling(vb));
    check_by_head(sp, L, calib, rope, &base);
    /* the family's plain reference (its row's .reference), where it has one: the same numbers */
    run_result ref;
    if (run(sp, L, calib, rope, 1, -1, 1, &ref)) {
        same(sp, &base, &ref, "from the family's reference");
        free(ref.k), free(ref.v);
        references++;
    }
    /* again, at 1 thread: no hidden state; then 2 and 3 threads; then each SIMD level */
    const struct { int threads, simd; const char *what;
    } variants[] = {{1, -1, "on a second run"},    {2, -1, "at 2 threads"},
                    {3, -1, "at 3 threads"},       {1, KVQ_SIMD_NONE, "with the portable paths"},
                    {2, KVQ_SIMD_AVX2, "at AVX2"}, {3, KVQ_SIMD_AVX512, "at AVX-512"}};
    for (size_t i = 0; i < sizeof variants / sizeof variants[0]; i++) {
        run(sp, L, calib, rope, variants[i].threads, variants[i].simd, 0, &other);
        same(sp, &base, &other, variants[i].what);
        free(other.k), free(other.v);
    }
    free(base.k), free(base.v), free(k0);
}

START_TEST(every_registered_quantizer)
{
    kvq_error err = {0};
    kvq_rope rope;
    ck_assert_int_eq(kvq_rope_from_theta(&rope, TC, D, 10000.0, KVQ_ROPE_HALF, &err), KVQ_OK);
    kvq_layer L, C;
    unsigned flags = KVQ_READ_QUERY | KVQ_READ_KEY_PRE_ROPE;
    ck_assert_int_eq(kvq_layer_alloc(&L, H, HQ, T, D, flags, &err), KVQ_OK);
    ck_assert_int_eq(kvq_layer_alloc(&C, H, HQ, TC, D, flags, &err), KVQ_OK);
    fill_layer(&L, T, 11, &rope);
    fill_layer(&C, TC, 23, &rope);
    ck_assert(kvq_quantizer_count() >= 15);
    int alternatives = 0;
    for (size_t i = 0; i < kvq_quantizer_count(); i++) {
        const kvq_quantizer *q = kvq_quantizer_at(i);
        kvq_spec sp;
        ck_assert_msg(kvq_spec_default(q, &sp, &err) == KVQ_OK, "%s: %s", q->name, err.msg);
        check_spec(&sp, &L, &C, &rope);
        /* the row's example_spec: parses, runs on this D, is not the default */
        const char *ex = kvq_quantizer_example_spec(q);
        ck_assert_msg(ex && *ex, "%s: the table row has no example_spec", q->name);
        char text[KVQ_SPEC_MAX], full_def[KVQ_SPEC_MAX], full_ex[KVQ_SPEC_MAX];
        snprintf(text, sizeof text, "%s:%s", q->name, ex);
        kvq_spec_format_full(&sp, full_def, sizeof full_def);
        ck_assert_msg(kvq_spec_parse(text, &sp, &err) == KVQ_OK && kvq_spec_check_shape(&sp, D, &err) == KVQ_OK,
                      "%s: %s", text, err.msg);
        kvq_spec_format_full(&sp, full_ex, sizeof full_ex);
        ck_assert_msg(strcmp(full_def, full_ex), "%s: the example spec is the default one", text);
        check_spec(&sp, &L, &C, &rope);
        if (alternative_spec(q, &sp)) {
            check_spec(&sp, &L, &C, &rope);
            alternatives++;
        }
    }
    ck_assert_int_eq(alternatives, (int)kvq_quantizer_count()); /* every family has a second spec */
    int with_reference = 0;
    for (size_t i = 0; i < kvq_quantizer_count(); i++) {
        const kvq_quantizer *q = kvq_quantizer_at(i);
        ck_assert_msg(!(q->reference && q->reference_head), "%s: both a reference and a reference_head", q->name);
        with_reference += q->reference || q->reference_head;
    }
    /* every row has a plain reference (docs/adding-a-quantizer.md: reference first) */
    ck_assert_int_eq(with_reference, (int)kvq_quantizer_count());
    ck_assert_int_eq(references, 3 * with_reference); /* default, example and changed-key spec of each */
    /* the families the analysis runs head by head (plan families, cluster, kvquant, lloydmax, turboquant, none) */
    ck_assert_msg(by_head_specs >= 20, "only %d specs run head by head", by_head_specs);
    /* variants with paths of their own that neither spec above takes (the
     * outliers: the default fractions leave none in rows of 32 or 48) */
    const char *extra[] = {"gear:lowrank=svd,span=layer", "gear:sparsity=0.25,span=layer,backbone=kcvt",
                           "gear:sparsity=0.3,group=5,rank=0", "kvquant:outliers=0.3,sink=3,codebook=uniform",
                           "kvquant:outliers=0.2,prerope=0", "lloydmax:rotate=hadamard", "fp8:scale=channel",
                           "fp8:format=e5m2,scale=token", "tender:span=head,chunk=7",
                           "tender:chunk=1,groups=64,alpha=3,scale=fp32", "fp4:format=nvfp4,global=tensor",
                           "fp4:format=nvfp4,global=token", "per-token:bits=3,prerotate=hadamard",
                           "per-token:span=layer", "kivi:residual=0,prerotate=qr"};
    for (size_t i = 0; i < sizeof extra / sizeof extra[0]; i++) {
        kvq_spec sp;
        ck_assert_msg(kvq_spec_parse(extra[i], &sp, &err) == KVQ_OK, "%s: %s", extra[i], err.msg);
        check_spec(&sp, &L, &C, &rope);
    }
    kvq_layer_free(&L), kvq_layer_free(&C);
    kvq_rope_free(&rope);
}
END_TEST

/* One range of stream tags: [first, first + n). */
typedef struct {
    const char *who;
    uint64_t first, n;
    const void *code; /* the quantize function: variants of one code may share their streams */
} tag_range;

static int ranges_meet(const tag_range *a, const tag_range *b)
{
    return a->first < b->first + b->n && b->first < a->first + a->n;
}

/* Stream tags come from the families' rows (docs/building-blocks.md#random-numbers):
 * no two families' ranges, nor a shared stream of internal.h, overlap; the
 * tags kept from before names are the five families' and the random
 * selector's (a new family takes its name's tag: this count never grows). */
START_TEST(stream_tags_disjoint)
{
    tag_range r[64] = {
        {"key/value", KVQ_STREAM_KEY, 2, NULL}, {"queries", KVQ_STREAM_QUERIES, 1, NULL},
        {"gen", KVQ_STREAM_GEN, 1, NULL},       {"rotation", KVQ_STREAM_ROTATE, 2, NULL},
        {"tasks", KVQ_STREAM_TASKS, 1, NULL},
    };
    int n = 5, kept = 0;
    for (size_t i = 0; i < kvq_quantizer_count() + kvq_selector_count(); i++) {
        const kvq_quantizer *q = i < kvq_quantizer_count() ? kvq_quantizer_at(i)
                                                           : kvq_selector_at(i - kvq_quantizer_count());
        if (!q->nstreams) continue;
        ck_assert_msg(!q->stream_tag_kept || q->stream_tag_kept < (1ull << 31), "%s: kept tag too high", q->name);
        kept += q->stream_tag_kept != 0;
        ck_assert(n < 64);
        r[n++] = (tag_range){q->name, kvq_family_stream(q, 0), q->nstreams,
                             q->quantize ? (const void *)q->quantize : (const void *)q->quantize_head};
        ck_assert(r[n - 1].first + q->nstreams > r[n - 1].first); /* no wrap-around */
    }
    ck_assert_int_eq(kept, 6);
    for (int a = 0; a < n; a++)
        for (int b = a + 1; b < n; b++) {
            int shared = r[a].code && r[a].code == r[b].code && r[a].first == r[b].first && r[a].n == r[b].n;
            ck_assert_msg(shared || !ranges_meet(&r[a], &r[b]), "%s and %s draw from the same stream tags", r[a].who,
                          r[b].who);
        }
    /* a name's tag: FNV-1a with the top bit set (FNV's published vectors for "a" and "") */
    ck_assert(kvq_stream_of_name("a") == (0xaf63dc4c8601ec8cull | 1ull << 63));
    ck_assert(kvq_stream_of_name("") == (0xcbf29ce484222325ull | 1ull << 63));
}
END_TEST

int main(void)
{
    Suite *s = suite_create("registry");
    TCase *tc = tcase_create("registry");
    tcase_add_test(tc, every_registered_quantizer);
    tcase_add_test(tc, stream_tags_disjoint);
    tcase_set_timeout(tc, 300);
    suite_add_tcase(s, tc);
    return run_suite(s);
}

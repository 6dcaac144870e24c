/* test_model.c — models in the loop (docs/models.md): ggml dequantization against
 * the block formulas (per element) and hand-worked blocks, the GGUF reader
 * on files the test writes (every value type, both architectures, tied and
 * separate output, rope_freqs, every weight type), the forward pass against
 * a plain reference written here, the tokenizer, kvq_model_eval's
 * invariants, every bad-input path, and — when ../shared/data/model is
 * present — the bundled dump reproduced from the GGUF and llama2.c files. */
#define _GNU_SOURCE /* memmem */
#include "gguf_writer.h"
#include "model/model.h"
#include "model/unicode.h"
#include "simd.h"
#include "testutil.h"
#include "formats/formats.h"

#include <cblas.h>

#include <stdio.h>

static const int all_types[] = {KVQ_GGML_F32, KVQ_GGML_F16, KVQ_GGML_BF16, KVQ_GGML_Q4_0, KVQ_GGML_Q4_1,
                                KVQ_GGML_Q5_0, KVQ_GGML_Q5_1, KVQ_GGML_Q8_0, KVQ_GGML_Q2_K, KVQ_GGML_Q3_K,
                                KVQ_GGML_Q4_K, KVQ_GGML_Q5_K, KVQ_GGML_Q6_K, KVQ_GGML_IQ4_NL, KVQ_GGML_IQ4_XS};
/* ggml-common.h's kvalues_iq4nl, written out again */
static const int iq4_levels[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};
enum { NTYPES = sizeof all_types / sizeof all_types[0] };

static float h16(const uint8_t *p) { return kvq_f16_to_f32((uint16_t)(p[0] | p[1] << 8)); }

/* Element i of one block, written straight from the block formulas. */
static float formula(int type, const uint8_t *b, int i)
{
    switch (type) {
    case KVQ_GGML_Q4_0: { int nib = i < 16 ? b[2 + i] & 15 : b[2 + i - 16] >> 4; return (float)(nib - 8) * h16(b); }
    case KVQ_GGML_Q4_1: {
        int nib = i < 16 ? b[4 + i] & 15 : b[4 + i - 16] >> 4;
        return (float)nib * h16(b) + h16(b + 2);
    }
    case KVQ_GGML_Q5_0: case KVQ_GGML_Q5_1: {
        int m = type == KVQ_GGML_Q5_1, o = m ? 4 : 2;
        uint32_t qh = (uint32_t)b[o] | (uint32_t)b[o + 1] << 8 | (uint32_t)b[o + 2] << 16 | (uint32_t)b[o + 3] << 24;
        int nib = i < 16 ? b[o + 4 + i] & 15 : b[o + 4 + i - 16] >> 4, q = nib | (int)((qh >> i) & 1) << 4;
        return m ? (float)q * h16(b) + h16(b + 2) : (float)(q - 16) * h16(b);
    }
    case KVQ_GGML_Q8_0: return (float)(int8_t)b[2 + i] * h16(b);
    case KVQ_GGML_Q2_K: {
        int n = i / 128, r = i % 128, g = r / 32, code = (b[16 + 32 * n + r % 32] >> (2 * g)) & 3, sc = b[i / 16];
        return h16(b + 80) * (float)(sc & 15) * (float)code - h16(b + 82) * (float)(sc >> 4);
    }
    case KVQ_GGML_Q3_K: {
        int n = i / 128, r = i % 128, g = r / 32, j = i / 16;
        const uint8_t *ps = b + 96;
        int lo = j < 8 ? ps[j] & 15 : ps[j - 8] >> 4, hi = (ps[8 + j % 4] >> (2 * (j / 4))) & 3;
        int code = ((b[32 + 32 * n + r % 32] >> (2 * g)) & 3) - ((b[i % 32] >> (i / 32)) & 1 ? 0 : 4);
        return h16(b + 108) * (float)((lo | hi << 4) - 32) * (float)code;
    }
    case KVQ_GGML_Q4_K: case KVQ_GGML_Q5_K: {
        int five = type == KVQ_GGML_Q5_K, c = i / 64, r = i % 64, is = 2 * c + r / 32;
        const uint8_t *s = b + 4, *qs = b + (five ? 48 : 16), *qh = b + 16;
        int sc = is < 4 ? s[is] & 63 : (s[is + 4] & 15) | (s[is - 4] >> 6) << 4;
        int mn = is < 4 ? s[is + 4] & 63 : (s[is + 4] >> 4) | (s[is] >> 6) << 4;
        int byte = qs[32 * c + r % 32], q = r < 32 ? byte & 15 : byte >> 4;
        if (five && (qh[r % 32] >> is & 1)) q += 16;
        return h16(b) * (float)sc * (float)q - h16(b + 2) * (float)mn;
    }
    case KVQ_GGML_Q6_K: {
        int n = i / 128, r = i % 128, l = r % 32, k = r / 32;
        int lo = k == 0   ? b[64 * n + l] & 15
                 : k == 1 ? b[64 * n + l + 32] & 15
                 : k == 2 ? b[64 * n + l] >> 4
                          : b[64 * n + l + 32] >> 4;
        int q = (lo | ((b[128 + 32 * n + l] >> (2 * k)) & 3) << 4) - 32;
        return h16(b + 208) * (float)(int8_t)b[192 + 8 * n + l / 16 + 2 * k] * (float)q;
    }
    case KVQ_GGML_IQ4_NL: {
        int nib = i < 16 ? b[2 + i] & 15 : b[2 + i - 16] >> 4;
        return h16(b) * (float)iq4_levels[nib];
    }
    case KVQ_GGML_IQ4_XS: { /* sub-block ib: 6-bit scale (4 low bits in scales_l, 2 high in scales_h) − 32 */
        int ib = i / 32, r = i % 32,
            ls = ((b[4 + ib / 2] >> 4 * (ib % 2)) & 15) | ((((b[2] | b[3] << 8) >> 2 * ib) & 3) << 4);
        int nib = r < 16 ? b[8 + 16 * ib + r] & 15 : b[8 + 16 * ib + r - 16] >> 4;
        return h16(b) * (float)(ls - 32) * (float)iq4_levels[nib];
    }
    case KVQ_GGML_F32: { float v; memcpy(&v, b + 4 * i, 4); return v; }
    case KVQ_GGML_F16: return h16(b + 2 * i);
    case KVQ_GGML_BF16: {
        uint32_t u = (uint32_t)(b[2 * i] | b[2 * i + 1] << 8) << 16;
        float v;
        memcpy(&v, &u, 4);
        return v;
    }
    }
    return NAN;
}

START_TEST(test_dequant_formulas)
{
    /* at every SIMD level (q6_K has an AVX2 path) */
    for (int ti = 0; ti < 3 * NTYPES; ti++) {
        kvq_simd_cap(ti / NTYPES == 0 ? KVQ_SIMD_NONE : ti / NTYPES == 1 ? KVQ_SIMD_AVX2 : -1);
        int type = all_types[ti % NTYPES], block;
        size_t bb, nb;
        ck_assert(kvq_ggml_type_size(type, &block, &bb));
        int n = block * 8;
        uint8_t *raw = gw_random_weights(type, n, 1, 1.0, 7 + ti, &nb);
        ck_assert_uint_eq(nb, bb * (size_t)(n / block));
        float *y = malloc((size_t)n * sizeof *y);
        kvq_ggml_dequantize(type, raw, y, (size_t)n);
        for (int i = 0; i < n; i++) {
            int blk = i / block;
            float want = formula(type, raw + (size_t)blk * bb, i % block);
            ck_assert_msg(memcmp(&want, &y[i], 4) == 0, "%s value %d (SIMD cap %d): %.9g, formula %.9g",
                          kvq_ggml_type_name(type), i, ti / NTYPES, (double)y[i], (double)want);
        }
        free(raw), free(y);
    }
    kvq_simd_cap(-1);
}
END_TEST

START_TEST(test_dequant_by_hand)
{
    float y[256];
    uint8_t b[256];
    /* q8_0: d = 0.5 (0x3800) */
    memset(b, 0, sizeof b);
    b[0] = 0x00, b[1] = 0x38, b[2] = 1, b[3] = (uint8_t)-2, b[4] = 127, b[5] = 0x80;
    kvq_ggml_dequantize(KVQ_GGML_Q8_0, b, y, 32);
    ck_assert(y[0] == 0.5f && y[1] == -1.0f && y[2] == 63.5f && y[3] == -64.0f && y[4] == 0.0f);
    /* q4_0: d = 2 (0x4000); qs[0] = 0x9F: value 0 = (15−8)·2, value 16 = (9−8)·2 */
    memset(b, 0, sizeof b);
    b[1] = 0x40, b[2] = 0x9F;
    kvq_ggml_dequantize(KVQ_GGML_Q4_0, b, y, 32);
    ck_assert(y[0] == 14.0f && y[16] == 2.0f && y[1] == -16.0f);
    /* q4_1: d = 1, m = −0.5: nibble 3 -> 2.5 */
    memset(b, 0, sizeof b);
    b[1] = 0x3C, b[2] = 0x00, b[3] = 0xB8, b[4] = 0x03;
    kvq_ggml_dequantize(KVQ_GGML_Q4_1, b, y, 32);
    ck_assert(y[0] == 2.5f && y[16] == -0.5f);
    /* q5_0: d = 1; qh bit 0 set, nibble 1 -> (1 | 16) − 16 = 1; value 1: 0 − 16 */
    memset(b, 0, sizeof b);
    b[1] = 0x3C, b[2] = 0x01, b[6] = 0x01;
    kvq_ggml_dequantize(KVQ_GGML_Q5_0, b, y, 32);
    ck_assert(y[0] == 1.0f && y[1] == -16.0f);
    /* q4_K: d = 1, dmin = 0.5, sub-block 0 scale 3 and min 2: 3·q − 1 */
    memset(b, 0, sizeof b);
    b[1] = 0x3C, b[3] = 0x38, b[4] = 3, b[8] = 2, b[16] = 0x05;
    kvq_ggml_dequantize(KVQ_GGML_Q4_K, b, y, 256);
    ck_assert(y[0] == 14.0f && y[1] == -1.0f && y[32] == 0.0f);
    /* q6_K: d = 0.25 (0x3400), scale 0 = 2, ql[0] = 0x0F, qh[0] = 0b10: q = (15 | 2<<4) − 32 = 15 */
    memset(b, 0, sizeof b);
    b[208] = 0x00, b[209] = 0x34, b[192] = 2, b[0] = 0x0F, b[128] = 0x02;
    kvq_ggml_dequantize(KVQ_GGML_Q6_K, b, y, 256);
    ck_assert(y[0] == 7.5f && y[1] == -16.0f);
    /* bf16 and f16 ones */
    uint8_t one[4] = {0x80, 0x3F, 0x00, 0x3C};
    kvq_ggml_dequantize(KVQ_GGML_BF16, one, y, 1);
    kvq_ggml_dequantize(KVQ_GGML_F16, one + 2, y + 1, 1);
    ck_assert(y[0] == 1.0f && y[1] == 1.0f);
    ck_assert_str_eq(kvq_ggml_type_name(KVQ_GGML_Q4_K), "q4_K");
    ck_assert(!kvq_ggml_type_size(99, NULL, NULL));
}
END_TEST

/* kvq_ggml_finite_by_scales, which lets the forward pass skip looking at
 * dequantized weights: where it says finite, every value is, even at the
 * largest half scales (±65504) and any codes; an inf or nan in any of a
 * block's half scales (the writer's own list of them) turns it off; the
 * float types and MXFP4 never claim it. */
START_TEST(test_finite_by_scales)
{
    static const uint16_t extreme[] = {0x7BFF, 0xFBFF}, bad[] = {0x7C00, 0xFC00, 0x7E00, 0x7C01};
    for (int ti = 0; ti < NTYPES; ti++) {
        int type = all_types[ti], block, off[2];
        size_t bb, nb;
        double factor;
        ck_assert(kvq_ggml_type_size(type, &block, &bb));
        int n = block * 4, nh = gw_half_fields(type, off, &factor);
        uint8_t *raw = gw_random_weights(type, n, 1, 1.0, 31 + ti, &nb);
        float *y = malloc((size_t)n * sizeof *y);
        ck_assert_int_eq(kvq_ggml_finite_by_scales(type, raw, (size_t)n), nh > 0);
        for (int e = 0; nh && e < 2; e++) { /* every code byte 0xFF (the largest values), then a spread of codes */
            for (size_t i = 0; i < nb; i++) raw[i] = e ? (uint8_t)(i * 37) : 0xFF;
            for (int b = 0; b < n / block; b++)
                for (int k = 0; k < nh; k++) memcpy(raw + (size_t)b * bb + off[k], &extreme[(b + k + e) % 2], 2);
            ck_assert(kvq_ggml_finite_by_scales(type, raw, (size_t)n));
            kvq_ggml_dequantize(type, raw, y, (size_t)n);
            ck_assert_msg(kvq_first_nonfinite(y, (size_t)n) == (size_t)n, "%s", kvq_ggml_type_name(type));
        }
        for (int k = 0; k < nh; k++) /* each half scale of the last block, inf or nan */
            for (size_t j = 0; j < sizeof bad / sizeof bad[0]; j++) {
                uint8_t keep[2], *at = raw + (size_t)(n / block - 1) * bb + off[k];
                memcpy(keep, at, 2), memcpy(at, &bad[j], 2);
                ck_assert_msg(!kvq_ggml_finite_by_scales(type, raw, (size_t)n), "%s, scale %d",
                              kvq_ggml_type_name(type), k);
                ck_assert(kvq_ggml_finite_by_scales(type, raw, (size_t)(n - block))); /* the blocks before */
                memcpy(at, keep, 2);
            }
        free(raw), free(y);
    }
    uint8_t mx[17] = {0xFE}; /* MXFP4's E8M0 scale 2^127: values past FLT_MAX */
    ck_assert(!kvq_ggml_finite_by_scales(KVQ_GGML_MXFP4, mx, 32));
    ck_assert(!kvq_ggml_finite_by_scales(99, mx, 32));
}
END_TEST

START_TEST(test_gguf_values)
{
    gguf_w w = {0};
    char *strs[2] = {"ab", ""};
    float fa[3] = {1, 2, 3};
    int32_t ia[2] = {-5, 7};
    gw_kv_u32(&w, "a.u32", 4000000000u);
    gw_kv_i32(&w, "a.i32", -12);
    gw_kv_f32(&w, "a.f32", 0.5f);
    gw_kv_bool(&w, "a.bool", 1);
    gw_kv_str(&w, "a.str", "hello");
    gw_kv_u64(&w, "a.u64", 1ull << 40);
    gw_kv_f64(&w, "a.f64", -2.25);
    gw_kv_arr_str(&w, "a.astr", 2, strs);
    gw_kv_arr_f32(&w, "a.af32", 3, fa);
    gw_kv_arr_i32(&w, "a.ai32", 2, ia);
    gw_kv_u32(&w, "general.alignment", 64);
    w.alignment = 64;
    float v[32] = {0};
    gw_tensor_raw(&w, "t", KVQ_GGML_F32, 32, 0, v, sizeof v);
    uint8_t *p;
    size_t n;
    gw_serialise(&w, &p, &n);
    kvq_gguf g;
    kvq_error err = {0};
    ck_assert_msg(kvq_gguf_parse(&g, "mem", p, n, &err) == KVQ_OK, "%s", err.msg);
    int64_t i;
    double d;
    const char *s;
    uint64_t len;
    ck_assert(kvq_gguf_get_int(&g, "a.u32", &i) == 1 && i == 4000000000ll);
    ck_assert(kvq_gguf_get_int(&g, "a.i32", &i) == 1 && i == -12);
    ck_assert(kvq_gguf_get_int(&g, "a.bool", &i) == 1 && i == 1);
    ck_assert(kvq_gguf_get_int(&g, "a.u64", &i) == 1 && i == (1ll << 40));
    ck_assert(kvq_gguf_get_real(&g, "a.f32", &d) == 1 && d == 0.5);
    ck_assert(kvq_gguf_get_real(&g, "a.f64", &d) == 1 && d == -2.25);
    ck_assert(kvq_gguf_get_int(&g, "a.f32", &i) == -1);
    ck_assert(kvq_gguf_get_int(&g, "missing", &i) == 0);
    ck_assert(kvq_gguf_get_str(&g, "a.str", &s, &len) == 1 && len == 5 && !memcmp(s, "hello", 5));
    const gguf_kv *kv = kvq_gguf_find(&g, "a.astr");
    ck_assert(kv && kv->type == GGUF_ARRAY && kv->arr_type == GGUF_STRING && kv->n == 2);
    kv = kvq_gguf_find(&g, "a.af32");
    ck_assert(kv && kv->arr_type == GGUF_F32 && kv->n == 3 && !memcmp(kv->val, fa, 12));
    const gguf_tensor *t = kvq_gguf_tensor(&g, "t");
    ck_assert(t && t->ne[0] == 32 && t->data == p + (t->data - p) && (size_t)(t->data - p) % 64 == 0);
    kvq_gguf_free(&g);
    /* every truncation is an error, never a read past the buffer (ASan) */
    for (size_t cut = 0; cut < n; cut++) {
        uint8_t *q = malloc(cut ? cut : 1);
        memcpy(q, p, cut);
        ck_assert_msg(kvq_gguf_parse(&g, "mem", q, cut, &err) != KVQ_OK, "a file cut at %zu bytes was accepted", cut);
        free(q);
    }
    free(p);
    gw_free(&w);
}
END_TEST

/* ------------------------------------------------- plain reference pass */

typedef struct ref_out {
    float *K, *V, *Q, *Kpre; /* [L][.][T][D] */
    double nll;
} ref_out;

static float *deq(const kvq_model *m, const kvq_wtensor *t)
{
    float *y = malloc((size_t)t->cols * (size_t)t->rows * sizeof *y);
    for (int64_t r = 0; r < t->rows; r++)
        kvq_ggml_dequantize(t->type, t->data + (size_t)r * t->row_bytes, y + (size_t)r * t->cols, (size_t)t->cols);
    (void)m;
    return y;
}

static void ref_norm(float *o, const float *x, const float *w, int n, float eps)
{
    double ss = 0;
    for (int i = 0; i < n; i++) ss += (double)x[i] * x[i];
    double sc = 1.0 / sqrt(ss / n + eps);
    for (int i = 0; i < n; i++) o[i] = (float)(w[i] * sc * x[i]);
}

static void ref_matvec(float *y, const float *W, const float *x, const float *b, int in, int out)
{
    for (int o = 0; o < out; o++) {
        double s = b ? b[o] : 0;
        for (int i = 0; i < in; i++) s += (double)W[(size_t)o * in + i] * x[i];
        y[o] = (float)s;
    }
}

/* The whole pass in plain loops: one position at a time, double sums. */
static void reference_pass(const kvq_model *m, const int *tok, int T, ref_out *r)
{
    const kvq_model_info *in = &m->info;
    int L = in->n_layers, dim = in->dim, Hq = in->n_heads, H = in->n_kv_heads, D = in->head_dim, F = in->ffn_dim;
    int qd = Hq * D, kd = H * D, V = in->vocab_size, G = Hq / H;
    float *x = calloc((size_t)T * dim, 4), *xn = malloc((size_t)dim * 4), *q = malloc((size_t)qd * 4);
    float *k = malloc((size_t)kd * 4), *v = malloc((size_t)kd * 4), *att = malloc((size_t)qd * 4),
          *o = malloc((size_t)dim * 4);
    float *g = malloc((size_t)F * 4), *u = malloc((size_t)F * 4), *lg = malloc((size_t)V * 4), *fr = NULL;
    r->K = malloc((size_t)L * kd * T * 4), r->V = malloc((size_t)L * kd * T * 4);
    r->Q = malloc((size_t)L * qd * T * 4), r->Kpre = malloc((size_t)L * kd * T * 4);
    float *E = deq(m, &m->tok_embd);
    for (int t = 0; t < T; t++) memcpy(x + (size_t)t * dim, E + (size_t)tok[t] * dim, (size_t)dim * 4);
    free(E);
    if (in->has_rope_freqs) fr = deq(m, &m->rope_freqs);
    for (int l = 0; l < L; l++) {
        const kvq_layer_weights *lw = &m->layer[l];
        float *an = deq(m, &lw->attn_norm), *wq = deq(m, &lw->wq), *wk = deq(m, &lw->wk), *wv = deq(m, &lw->wv);
        float *wo = deq(m, &lw->wo), *fn = deq(m, &lw->ffn_norm), *wg = deq(m, &lw->w_gate), *wu = deq(m, &lw->w_up);
        float *wd = deq(m, &lw->w_down);
        float *bq = lw->bq.data ? deq(m, &lw->bq) : NULL, *bk = lw->bk.data ? deq(m, &lw->bk) : NULL;
        float *bv = lw->bv.data ? deq(m, &lw->bv) : NULL;
        float *Kl = r->K + (size_t)l * kd * T, *Vl = r->V + (size_t)l * kd * T, *Ql = r->Q + (size_t)l * qd * T;
        float *Pl = r->Kpre + (size_t)l * kd * T;
        for (int t = 0; t < T; t++) { /* q, k, v of every position, RoPE'd, into [h][t][d] */
            ref_norm(xn, x + (size_t)t * dim, an, dim, in->norm_eps);
            ref_matvec(q, wq, xn, bq, dim, qd);
            ref_matvec(k, wk, xn, bk, dim, kd);
            ref_matvec(v, wv, xn, bv, dim, kd);
            for (int h = 0; h < H; h++) memcpy(Pl + ((size_t)h * T + t) * D, k + h * D, (size_t)D * 4);
            for (int hh = 0; hh < Hq + H; hh++) {
                float *vec = hh < Hq ? q + hh * D : k + (hh - Hq) * D;
                for (int i = 0; i < D / 2; i++) {
                    double ang = t * pow(in->rope_theta, -2.0 * i / D) / (fr ? fr[i] : 1.0);
                    int a = in->rope_style == KVQ_ROPE_HALF ? i : 2 * i,
                        b = in->rope_style == KVQ_ROPE_HALF ? i + D / 2 : 2 * i + 1;
                    double xa = vec[a], xb = vec[b];
                    vec[a] = (float)(xa * cos(ang) - xb * sin(ang));
                    vec[b] = (float)(xa * sin(ang) + xb * cos(ang));
                }
            }
            for (int j = 0; j < Hq; j++) memcpy(Ql + ((size_t)j * T + t) * D, q + j * D, (size_t)D * 4);
            for (int h = 0; h < H; h++) {
                memcpy(Kl + ((size_t)h * T + t) * D, k + h * D, (size_t)D * 4);
                memcpy(Vl + ((size_t)h * T + t) * D, v + h * D, (size_t)D * 4);
            }
        }
        float *xnew = malloc((size_t)T * dim * 4);
        for (int t = 0; t < T; t++) {
            for (int j = 0; j < Hq; j++) {
                int h = j / G;
                double *s = malloc((size_t)(t + 1) * sizeof *s), mx = -INFINITY, sum = 0;
                for (int uu = 0; uu <= t; uu++) {
                    double d = 0;
                    for (int c = 0; c < D; c++)
                        d += (double)Ql[((size_t)j * T + t) * D + c] * Kl[((size_t)h * T + uu) * D + c];
                    s[uu] = d / sqrt((double)D);
                    mx = s[uu] > mx ? s[uu] : mx;
                }
                for (int uu = 0; uu <= t; uu++) sum += (s[uu] = exp(s[uu] - mx));
                for (int c = 0; c < D; c++) {
                    double acc = 0;
                    for (int uu = 0; uu <= t; uu++) acc += s[uu] / sum * Vl[((size_t)h * T + uu) * D + c];
                    att[j * D + c] = (float)acc;
                }
                free(s);
            }
            float *xr = xnew + (size_t)t * dim;
            memcpy(xr, x + (size_t)t * dim, (size_t)dim * 4);
            ref_matvec(o, wo, att, NULL, qd, dim);
            for (int i = 0; i < dim; i++) xr[i] += o[i];
            ref_norm(xn, xr, fn, dim, in->norm_eps);
            ref_matvec(g, wg, xn, NULL, dim, F);
            ref_matvec(u, wu, xn, NULL, dim, F);
            for (int i = 0; i < F; i++) g[i] = (float)(g[i] / (1.0 + exp(-(double)g[i])) * u[i]);
            ref_matvec(o, wd, g, NULL, F, dim);
            for (int i = 0; i < dim; i++) xr[i] += o[i];
        }
        memcpy(x, xnew, (size_t)T * dim * 4);
        free(xnew);
        free(an), free(wq), free(wk), free(wv), free(wo), free(fn), free(wg), free(wu), free(wd), free(bq), free(bk),
            free(bv);
    }
    float *on = deq(m, &m->output_norm), *W = deq(m, &m->output);
    r->nll = 0;
    for (int t = 0; t + 1 < T; t++) {
        ref_norm(xn, x + (size_t)t * dim, on, dim, in->norm_eps);
        ref_matvec(lg, W, xn, NULL, dim, V);
        double mx = -INFINITY, s = 0;
        for (int i = 0; i < V; i++) mx = lg[i] > mx ? lg[i] : mx;
        for (int i = 0; i < V; i++) s += exp(lg[i] - mx);
        r->nll += mx + log(s) - lg[tok[t + 1]];
    }
    r->nll /= T - 1;
    free(on), free(W), free(fr);
    free(x), free(xn), free(q), free(k), free(v), free(att), free(o), free(g), free(u), free(lg);
}

static void ref_free(ref_out *r) { free(r->K), free(r->V), free(r->Q), free(r->Kpre); }

static char *write_model(const gw_model_opts *o)
{
    gguf_w w;
    gw_tiny_model(&w, o);
    uint8_t *p;
    size_t n;
    gw_serialise(&w, &p, &n);
    char *path = strdup("/tmp/kvq-model-XXXXXX.gguf");
    int fd = mkstemps(path, 5);
    ck_assert(fd >= 0);
    close(fd);
    ck_assert(gw_write_file(path, p, n) == 0);
    free(p);
    gw_free(&w);
    return path;
}

/* Serialises w (freed) into a temporary file; the caller unlinks it. */
static void write_temp(gguf_w *w, char path[static 32])
{
    uint8_t *p;
    size_t n;
    gw_serialise(w, &p, &n);
    gw_free(w);
    snprintf(path, 32, "/tmp/kvq-model-XXXXXX");
    int fd = mkstemp(path);
    ck_assert(fd >= 0);
    close(fd);
    ck_assert(gw_write_file(path, p, n) == 0);
    free(p);
}

static void random_tokens(int *tok, int T, int V, uint64_t seed)
{
    uint64_t s = seed * 7919 + 1;
    tok[0] = 1;
    for (int t = 1; t < T; t++) tok[t] = (int)(gw_rand(&s) % (uint64_t)V);
}

static double max_rel(const float *a, const float *b, size_t n)
{
    double mx = 0, e = 0;
    for (size_t i = 0; i < n; i++) {
        mx = fabs(b[i]) > mx ? fabs(b[i]) : mx;
        e = fabs(a[i] - b[i]) > e ? fabs(a[i] - b[i]) : e;
    }
    return e / (mx > 0 ? mx : 1);
}

/* The configurations the forward pass is checked on. */
static const gw_model_opts fw_cases[] = {
    {"llama", 2, 4, 2, 16, 96, 64, 256, KVQ_GGML_F32, 0, 0, 0, 1},
    {"llama", 2, 4, 4, 16, 96, 64, 256, KVQ_GGML_Q8_0, 1, 1, 0, 2},  /* tied output, rope_freqs, MHA */
    {"qwen2", 2, 4, 2, 16, 128, 96, 256, KVQ_GGML_F16, 0, 0, 0, 3},  /* QKV biases, half RoPE */
    {"qwen2", 1, 4, 1, 16, 64, 64, 256, KVQ_GGML_BF16, 1, 0, 0, 4},
    {"llama", 1, 4, 2, 8, 64, 64, 256, KVQ_GGML_Q4_0, 0, 0, 0, 5},
    {"llama", 1, 4, 2, 8, 64, 64, 256, KVQ_GGML_Q4_1, 0, 1, 0, 6},
    {"llama", 1, 4, 2, 8, 64, 64, 256, KVQ_GGML_Q5_0, 1, 0, 0, 7},
    {"llama", 1, 4, 2, 8, 64, 64, 256, KVQ_GGML_Q5_1, 0, 0, 0, 8},
    {"llama", 1, 4, 2, 64, 256, 64, 256, KVQ_GGML_Q2_K, 0, 0, 0, 9},
    {"llama", 1, 4, 2, 64, 256, 64, 256, KVQ_GGML_Q3_K, 1, 0, 0, 10},
    {"qwen2", 1, 4, 2, 64, 256, 64, 256, KVQ_GGML_Q4_K, 0, 1, 0, 11},
    {"llama", 1, 4, 2, 64, 256, 64, 256, KVQ_GGML_Q5_K, 0, 0, 0, 12},
    {"llama", 1, 4, 2, 8, 64, 64, 256, KVQ_GGML_IQ4_NL, 0, 0, 0, 14},
    {"llama", 1, 4, 2, 64, 256, 64, 256, KVQ_GGML_IQ4_XS, 1, 0, 0, 15},
    {"llama", 1, 4, 1, 64, 256, 64, 256, KVQ_GGML_Q6_K, 1, 0, 0, 13},
};

START_TEST(test_forward_against_reference)
{
    const gw_model_opts *o = &fw_cases[_i];
    char *path = write_model(o);
    kvq_model *m;
    kvq_error err = {0};
    ck_assert_msg(kvq_model_open(path, NULL, &m, &err) == KVQ_OK, "%s", err.msg);
    const kvq_model_info *in = kvq_model_get_info(m);
    ck_assert_int_eq(in->arch, !strcmp(o->arch, "qwen2") ? KVQ_ARCH_QWEN2 : KVQ_ARCH_LLAMA);
    ck_assert_int_eq(in->tied_output, o->tied);
    ck_assert_int_eq(in->has_rope_freqs, o->freqs);
    int T = 19, tok[19];
    random_tokens(tok, T, o->V, o->seed);
    char out[] = "/tmp/kvq-fwd-XXXXXX.h5";
    int fd = mkstemps(out, 3);
    close(fd);
    double nll;
    ck_assert_msg(kvq_model_dump(m, tok, T, NULL, 0, out, 2, &nll, &err) == KVQ_OK, "%s", err.msg);
    ref_out r;
    reference_pass(m, tok, T, &r);
    ck_assert_msg(close_rel(nll, r.nll, 1e-5, 1e-3), "%s: mean NLL %.9g, reference %.9g", kvq_ggml_type_name(o->wtype),
                  nll, r.nll);
    kvq_dump *d;
    ck_assert_msg(kvq_dump_open(out, &d, &err) == KVQ_OK, "%s", err.msg);
    const kvq_dump_info *di = kvq_dump_get_info(d);
    ck_assert_int_eq(di->num_layers, o->L);
    ck_assert_int_eq(di->rope_style, !strcmp(o->arch, "qwen2") ? KVQ_ROPE_HALF : KVQ_ROPE_INTERLEAVED);
    ck_assert_int_eq(di->has_rope_table, o->freqs);
    for (int l = 0; l < o->L; l++) {
        kvq_layer L;
        ck_assert(kvq_dump_read_layer(d, l, KVQ_READ_QUERY | KVQ_READ_KEY_PRE_ROPE, &L, &err) == KVQ_OK);
        size_t nk = (size_t)o->H * T * o->D, nq = (size_t)o->Hq * T * o->D;
        double ek = max_rel(L.key, r.K + l * nk, nk), ev = max_rel(L.value, r.V + l * nk, nk);
        double eq = max_rel(L.query, r.Q + l * nq, nq), ep = max_rel(L.key_pre_rope, r.Kpre + l * nk, nk);
        ck_assert_msg(ek < 1e-5 && ev < 1e-5 && eq < 1e-5 && ep < 1e-5, "%s layer %d: K %g V %g Q %g Kpre %g",
                      kvq_ggml_type_name(o->wtype), l, ek, ev, eq, ep);
        kvq_layer_free(&L);
    }
    kvq_dump_close(d);
    ref_free(&r);
    kvq_model_close(m);
    unlink(out), unlink(path), free(path);
}
END_TEST

/* --chunk (docs/models.md, llama.cpp perplexity's protocol) against a hand
 * computation: two windows of 16 of 37 tokens (the last 5 dropped), each
 * starting with BOS in place of its first token, scoring t = 8..14; the
 * exact model's per-position NLL from its logits (one plain evaluation of
 * each window), the quantized one's from plain evaluations of the same
 * windows, and dnll_se as the sample standard deviation of the differences
 * over the 14 positions / sqrt(14). */
START_TEST(test_chunk_by_hand)
{
    gw_model_opts o = {"llama", 2, 4, 2, 16, 96, 300, 256, KVQ_GGML_F32, 0, 0, 1, 23};
    char *path = write_model(&o);
    kvq_model *m;
    kvq_error err = {0};
    ck_assert_msg(kvq_model_open(path, NULL, &m, &err) == KVQ_OK, "%s", err.msg);
    const kvq_model_info *in = kvq_model_get_info(m);
    ck_assert(in->has_tokenizer);
    enum { N = 16, T = 37, W = 2, P = N - 1 - N / 2 };
    int tok[T];
    random_tokens(tok, T, o.V, 9);
    kvq_spec pt;
    ck_assert(kvq_spec_parse("per-token:bits=2,group=8", &pt, &err) == KVQ_OK);
    kvq_eval_item it = {.spec = &pt, .layer = -1};
    double ref, pos[2 * W * P];
    kvq_eval_opts eo = {.nthreads = 2, .chunk = N, .position_nll = pos};
    ck_assert_msg(kvq_model_eval(m, tok, T, &it, 1, &eo, &ref, &err) == KVQ_OK, "%s", err.msg);
    ck_assert_int_eq(it.positions, W * P);
    double hand_ref = 0, dsum = 0, d[W * P];
    for (int w = 0; w < W; w++) {
        int win[N], lp[N];
        memcpy(win, tok + w * N, sizeof win);
        win[0] = 1; /* the tiny vocabulary's BOS */
        for (int t = 0; t < N; t++) lp[t] = t;
        float *lg = malloc((size_t)N * in->vocab_size * sizeof *lg);
        kvq_eval_item pl = {.spec = &pt, .layer = -1};
        double plain_pos[2 * (N - 1)], plain_ref;
        kvq_eval_opts po = {.nthreads = 1, .logit_pos = lp, .n_logit_pos = N, .logits = lg, .position_nll = plain_pos};
        ck_assert_msg(kvq_model_eval(m, win, N, &pl, 1, &po, &plain_ref, &err) == KVQ_OK, "%s", err.msg);
        for (int t = N / 2; t < N - 1; t++) {
            const float *z = lg + (size_t)t * in->vocab_size;
            double mx = z[0], se = 0;
            for (int v = 1; v < in->vocab_size; v++) mx = z[v] > mx ? z[v] : mx;
            for (int v = 0; v < in->vocab_size; v++) se += exp((double)z[v] - mx);
            double nll = mx + log(se) - z[win[t + 1]]; /* from the logits, by hand */
            int k = w * P + t - N / 2;
            ck_assert_msg(fabs(pos[k] - nll) < 1e-9, "window %d position %d: %.12g, by hand %.12g", w, t, pos[k], nll);
            /* the windows are evaluated exactly as plain runs of the same tokens */
            ck_assert(pos[k] == plain_pos[t] && pos[W * P + k] == plain_pos[N - 1 + t]);
            hand_ref += nll;
            d[k] = pos[W * P + k] - pos[k];
            dsum += d[k];
        }
        free(lg);
    }
    ck_assert_msg(fabs(ref - hand_ref / (W * P)) < 1e-12, "nll_ref %.15g, by hand %.15g", ref, hand_ref / (W * P));
    double mean = dsum / (W * P), ss = 0;
    for (int k = 0; k < W * P; k++) ss += (d[k] - mean) * (d[k] - mean);
    double se = sqrt(ss / (W * P - 1)) / sqrt((double)(W * P));
    ck_assert_msg(close_rel(it.dnll_se, se, 1e-9, 1e-12) && se > 0, "dnll_se %.12g, direct %.12g", it.dnll_se, se);
    ck_assert_msg(fabs(it.nll - ref - mean) < 1e-12, "dnll %.12g, mean difference %.12g", it.nll - ref, mean);
    /* --chunks 1: the first window alone; a window longer than the tokens is refused */
    kvq_eval_opts e1 = {.nthreads = 2, .chunk = N, .chunks = 1};
    ck_assert(kvq_model_eval(m, tok, T, &it, 1, &e1, &ref, &err) == KVQ_OK && it.positions == P);
    kvq_eval_opts e2 = {.nthreads = 2, .chunk = 40};
    ck_assert(kvq_model_eval(m, tok, T, &it, 1, &e2, &ref, &err) == KVQ_ERR_USAGE &&
              strstr(err.msg, "fewer than one window"));
    kvq_model_close(m);
    unlink(path);
    free(path);
}
END_TEST

/* kvq_blas_rows_independent's claim on the forward pass's own shapes: where
 * it says 1 (this core's rows do not depend on the call's other rows, so
 * the forward stacks them), 600 rows in one call and in calls of 256, 256
 * and 88 agree bit for bit, with beta 0 and 1, at inner dimensions from
 * one of OpenBLAS's blocks to several and 512 columns. */
START_TEST(test_blas_rows_claim)
{
    if (!kvq_blas_rows_independent()) {
        fprintf(stderr,
                "test_blas_rows_claim: products stay in 256-row calls (OpenBLAS's %s kernels block the rows, "
                "or KVQ_BLAS_ROWS=tiles)\n",
                kvq_blas_core());
        return;
    }
    enum { R = 600, N = 512 };
    const int Ks[] = {64, 896, 4096};
    openblas_set_num_threads(1);
    for (int k = 0; k < 3; k++) {
        int K = Ks[k];
        float *x = malloc((size_t)R * K * sizeof *x), *w = malloc((size_t)N * K * sizeof *w);
        float *c1 = malloc((size_t)R * N * sizeof *c1), *c2 = malloc((size_t)R * N * sizeof *c2);
        fill_normal(x, (size_t)R * K, 3 + k, 1), fill_normal(w, (size_t)N * K, 7 + k, 0.1);
        for (int beta = 0; beta < 2; beta++) {
            fill_normal(c1, (size_t)R * N, 11, 1), memcpy(c2, c1, (size_t)R * N * sizeof *c1);
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, R, N, K, 1.0f, x, K, w, K, (float)beta, c1, N);
            for (int r = 0; r < R; r += 256)
                cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, R - r < 256 ? R - r : 256, N, K, 1.0f,
                            x + (size_t)r * K, K, w, K, (float)beta, c2 + (size_t)r * N, N);
            ck_assert_msg(!memcmp(c1, c2, (size_t)R * N * sizeof *c1), "K %d, beta %d: rows depend on the call", K,
                          beta);
        }
        free(x), free(w), free(c1), free(c2);
    }
}
END_TEST

START_TEST(test_eval_invariants)
{
    gw_model_opts o = {"llama", 3, 4, 2, 16, 96, 64, 256, KVQ_GGML_F32, 0, 0, 0, 21};
    char *path = write_model(&o);
    kvq_model *m;
    kvq_error err = {0};
    ck_assert(kvq_model_open(path, NULL, &m, &err) == KVQ_OK);
    int T = 40, tok[40];
    random_tokens(tok, T, o.V, 5);
    kvq_spec pt, kv, kvres;
    ck_assert(kvq_spec_parse("per-token:bits=4,group=8", &pt, &err) == KVQ_OK);
    ck_assert(kvq_spec_parse("kivi:bits=2,group=8,residual=16", &kv, &err) == KVQ_OK);
    ck_assert(kvq_spec_parse("kivi:bits=2,group=32,residual=64", &kvres, &err) == KVQ_OK); /* residual > T */
    kvq_eval_item it[] = {{.spec = NULL, .layer = -1, .policy = KVQ_POLICY_PREFILL},
                          {.spec = NULL, .layer = -1, .policy = KVQ_POLICY_DECODE},
                          {.spec = &pt, .layer = -1, .policy = KVQ_POLICY_PREFILL},
                          {.spec = &pt, .layer = -1, .policy = KVQ_POLICY_DECODE},
                          {.spec = &kv, .layer = -1, .policy = KVQ_POLICY_PREFILL},
                          {.spec = &kv, .layer = -1, .policy = KVQ_POLICY_DECODE},
                          {.spec = &kvres, .layer = -1, .policy = KVQ_POLICY_PREFILL},
                          {.spec = &kv, .layer = 0, .policy = KVQ_POLICY_PREFILL},
                          {.spec = &kv, .layer = 1, .policy = KVQ_POLICY_PREFILL},
                          {.spec = &kv, .layer = 2, .policy = KVQ_POLICY_PREFILL}};
    int n = sizeof it / sizeof it[0];
    double ref;
    kvq_eval_opts eo = {.stride = 1, .nthreads = 2};
    ck_assert_msg(kvq_model_eval(m, tok, T, it, n, &eo, &ref, &err) == KVQ_OK, "%s", err.msg);
    for (int i = 0; i < 2; i++) { /* the exact cache: nothing changes, 16 bits */
        ck_assert_msg(it[i].nll == ref && it[i].kl == 0 && it[i].top1 == 1, "none: nll %.17g ref %.17g kl %g",
                      it[i].nll, ref, it[i].kl);
        ck_assert(it[i].k_bits == 16 && it[i].v_bits == 16);
    }
    /* a stateless per-token quantizer: prefill and decode agree */
    ck_assert_msg(close_rel(it[2].nll, it[3].nll, 1e-5, 1) && fabs(it[2].kl - it[3].kl) < 1e-5,
                  "per-token prefill %.9g decode %.9g", it[2].nll, it[3].nll);
    ck_assert(it[2].nll != ref && it[2].kl > 0);
    /* KIVI: decode keeps recent tokens exact, prefill does not */
    ck_assert_msg(it[4].kl > it[5].kl, "kivi kl prefill %g decode %g", it[4].kl, it[5].kl);
    ck_assert(it[4].k_bits == it[5].k_bits && it[4].v_bits == it[5].v_bits);
    /* residual window longer than the text: nothing quantized */
    ck_assert(it[6].nll == ref && it[6].kl == 0 && it[6].k_bits == 16);
    /* one layer at a time: each moves the loss, less than all layers together */
    for (int i = 7; i < 10; i++) ck_assert(it[i].kl > 0 && it[i].kl < it[4].kl * 1.5);
    /* decode with a stride of T is one chunk: the prefill numbers */
    kvq_eval_item one = {.spec = &kv, .layer = -1, .policy = KVQ_POLICY_DECODE};
    eo.stride = T;
    ck_assert(kvq_model_eval(m, tok, T, &one, 1, &eo, &ref, &err) == KVQ_OK);
    ck_assert_msg(close_rel(one.nll, it[4].nll, 1e-6, 1), "stride T %.9g prefill %.9g", one.nll, it[4].nll);
    /* passes bounded by memory give the same numbers as one pass */
    kvq_eval_item two[2] = {it[4], it[2]};
    eo.stride = 1, eo.max_bytes = 1;
    ck_assert(kvq_model_eval(m, tok, T, two, 2, &eo, &ref, &err) == KVQ_OK);
    ck_assert(two[0].nll == it[4].nll && two[1].nll == it[2].nll);
    /* threads do not change the results */
    eo.nthreads = 1, eo.max_bytes = 0;
    ck_assert(kvq_model_eval(m, tok, T, two, 2, &eo, &ref, &err) == KVQ_OK);
    ck_assert(close_rel(two[0].nll, it[4].nll, 1e-6, 1));
    kvq_model_close(m);
    unlink(path), free(path);
}
END_TEST

/* A model written from o, T random tokens from seed, and the n
 * configurations text (item i on layer[i], -1: every layer) with -q none in
 * one run of kvq_model_eval with eo, in lockstep: the exact stream's
 * numbers are those of -q none alone, -q none rides to the end, and each
 * configuration's numbers equal its run alone, bit for bit. */
static void check_lockstep_alone(gw_model_opts o, int T, uint64_t seed, const char *const *text, const int *layer,
                                 int n, kvq_eval_opts eo)
{
    enum { MAXQ = 32 };
    char *path = write_model(&o);
    kvq_model *m;
    kvq_error err = {0};
    ck_assert_msg(kvq_model_open(path, NULL, &m, &err) == KVQ_OK, "%s", err.msg);
    int *tok = malloc((size_t)T * sizeof *tok);
    static kvq_spec sp[MAXQ];
    kvq_eval_item it[MAXQ + 1], alone = {.spec = NULL, .layer = -1};
    double ref, ref1;
    ck_assert(tok && n < MAXQ);
    random_tokens(tok, T, o.V, seed);
    for (int q = 0; q < n; q++) {
        ck_assert(kvq_spec_parse(text[q], &sp[q], &err) == KVQ_OK);
        it[q] = (kvq_eval_item){.spec = &sp[q], .layer = layer[q]};
    }
    it[n] = (kvq_eval_item){.spec = NULL, .layer = -1};
    ck_assert_msg(kvq_model_eval(m, tok, T, it, n + 1, &eo, &ref, &err) == KVQ_OK, "%s", err.msg);
    ck_assert(it[n].nll == ref && it[n].kl == 0);
    ck_assert_msg(kvq_model_eval(m, tok, T, &alone, 1, &eo, &ref1, &err) == KVQ_OK, "%s", err.msg);
    ck_assert_msg(ref1 == ref, "exact nll %.17g with the configurations, %.17g alone", ref, ref1);
    for (int q = 0; q < n; q++) {
        alone = (kvq_eval_item){.spec = &sp[q], .layer = layer[q]};
        ck_assert_msg(kvq_model_eval(m, tok, T, &alone, 1, &eo, &ref1, &err) == KVQ_OK, "%s", err.msg);
        ck_assert_msg(ref1 == ref && alone.nll == it[q].nll && alone.kl == it[q].kl && alone.top1 == it[q].top1 &&
                          alone.dnll_se == it[q].dnll_se,
                      "item %d (%s, layer %d): nll %.17g kl %.17g in lockstep, %.17g %.17g alone", q, text[q], layer[q],
                      it[q].nll, it[q].kl, alone.nll, alone.kl);
        ck_assert(it[q].kl > 0);
    }
    free(tok);
    kvq_model_close(m);
    unlink(path), free(path);
}

/* Lockstep (docs/models.md "How it runs"): every stream that computes a
 * layer shares its weight tiles — the query, key and value matrices among
 * the exact stream and those that left it before, the rest of the layer
 * among all — in groups of at most 16 streams; each configuration's
 * numbers in one run of 21 streams (quantizing layer 0, 1 or 2 alone, or
 * every layer; -q none riding to the end) equal its run alone, bit for
 * bit. */
START_TEST(test_lockstep_equals_alone)
{
    enum { NQ = 20 };
    static char text[NQ][64];
    const char *tp[NQ];
    int layer[NQ];
    for (int q = 0; q < NQ; q++) {
        snprintf(text[q], sizeof text[q], "per-token:bits=%d,group=8", 2 + q / 4);
        tp[q] = text[q], layer[q] = q % 4 == 3 ? -1 : q % 4;
    }
    gw_model_opts o = {"llama", 3, 4, 2, 16, 96, 64, 256, KVQ_GGML_Q8_0, 0, 0, 0, 23};
    check_lockstep_alone(o, 48, 9, tp, layer, NQ, (kvq_eval_opts){.nthreads = 2});
}
END_TEST

/* Lockstep in a last layer that computes only the scored rows (--chunk
 * 600: rows 256..599), on shapes past OpenBLAS's small products, so that
 * the streams' rows stack into one call per weight tile where the BLAS
 * core keeps rows independent (the rest's slots hold those rows one
 * stream after the other): as in a run of every row, each configuration
 * equals its run alone. */
START_TEST(test_lockstep_scored_rows)
{
    const char *text[] = {"per-token:bits=2,group=8", "per-token:bits=4,group=8", "kivi:bits=2,group=32,residual=64"};
    const int layer[] = {-1, -1, -1};
    gw_model_opts o = {"llama", 2, 4, 2, 32, 384, 300, 1024, KVQ_GGML_Q8_0, 0, 0, 1, 31};
    check_lockstep_alone(o, 600, 37, text, layer, 3, (kvq_eval_opts){.nthreads = 2, .chunk = 600});
}
END_TEST

/* What a pass leaves out is not missed (docs/models.md "How it runs"):
 * with --chunk 600 only rows 256.. reach the last layer's queries and the
 * head, yet each scored position equals a plain run of its window bit for
 * bit; a configuration whose cache is still exact rides on the exact
 * model (a KIVI residual window longer than the window: its numbers are
 * the exact ones), and one that leaves it mid-decode (residual 32: the
 * keys' first group is flushed when the cache holds 32 tokens) keeps the
 * exact NLL at the positions before. */
START_TEST(test_scored_rows_and_riding)
{
    gw_model_opts o = {"llama", 2, 4, 2, 16, 96, 300, 1024, KVQ_GGML_Q8_0, 0, 0, 1, 29};
    char *path = write_model(&o);
    kvq_model *m;
    kvq_error err = {0};
    ck_assert_msg(kvq_model_open(path, NULL, &m, &err) == KVQ_OK, "%s", err.msg);
    enum { N = 600, T = 1300, W = 2, P = N - 1 - N / 2 }; /* scored from 300: rows from 256 computed */
    static int tok[T];
    random_tokens(tok, T, o.V, 17);
    kvq_spec pt, rides, leaves;
    ck_assert(kvq_spec_parse("per-token:bits=2,group=8", &pt, &err) == KVQ_OK);
    ck_assert(kvq_spec_parse("kivi:bits=2,group=32,residual=1024", &rides, &err) == KVQ_OK);
    ck_assert(kvq_spec_parse("kivi:bits=2,group=32,residual=32", &leaves, &err) == KVQ_OK);
    kvq_eval_item it[] = {{.spec = &pt, .layer = -1}, {.spec = &rides, .layer = -1}, {.spec = NULL, .layer = -1}};
    static double pos[4 * W * P];
    kvq_eval_opts eo = {.nthreads = 2, .chunk = N, .position_nll = pos};
    double ref;
    ck_assert_msg(kvq_model_eval(m, tok, T, it, 3, &eo, &ref, &err) == KVQ_OK, "%s", err.msg);
    for (int i = 1; i < 3; i++) /* the exact numbers, exactly */
        ck_assert_msg(it[i].nll == ref && it[i].kl == 0 && it[i].top1 == 1 && it[i].dnll_se == 0,
                      "item %d: nll %.17g ref %.17g kl %g", i, it[i].nll, ref, it[i].kl);
    ck_assert(it[0].nll != ref && it[0].kl > 0);
    for (int w = 0; w < W; w++) {
        int win[N];
        memcpy(win, tok + w * N, sizeof win);
        win[0] = 1; /* the tiny vocabulary's BOS */
        static double plain[2 * (N - 1)];
        kvq_eval_item pl = {.spec = &pt, .layer = -1};
        double plain_ref;
        kvq_eval_opts po = {.nthreads = 1, .position_nll = plain};
        ck_assert_msg(kvq_model_eval(m, win, N, &pl, 1, &po, &plain_ref, &err) == KVQ_OK, "%s", err.msg);
        for (int t = N / 2; t < N - 1; t++) {
            int k = w * P + t - N / 2;
            ck_assert_msg(pos[k] == plain[t] && pos[W * P + k] == plain[N - 1 + t],
                          "window %d position %d: %.17g / %.17g, plain run %.17g / %.17g", w, t, pos[k],
                          pos[W * P + k], plain[t], plain[N - 1 + t]);
            ck_assert(pos[2 * W * P + k] == pos[k] && pos[3 * W * P + k] == pos[k]); /* riding: the exact NLL */
        }
    }
    /* decode, leaving the exact stream at the 32nd token of every layer */
    kvq_eval_item dec = {.spec = &leaves, .layer = -1, .policy = KVQ_POLICY_DECODE};
    static double dpos[2 * 99];
    kvq_eval_opts d1 = {.nthreads = 2, .position_nll = dpos};
    ck_assert_msg(kvq_model_eval(m, tok, 100, &dec, 1, &d1, &ref, &err) == KVQ_OK, "%s", err.msg);
    int differ = 0;
    for (int t = 0; t < 99; t++) {
        if (t < 31) ck_assert_msg(dpos[99 + t] == dpos[t], "position %d: %.17g, exact %.17g", t, dpos[99 + t], dpos[t]);
        differ += dpos[99 + t] != dpos[t];
    }
    ck_assert_msg(differ > 30, "only %d positions moved", differ);
    kvq_model_close(m);
    unlink(path), free(path);
}
END_TEST

/* The words a pre-tokenizer cuts text into, joined by '|'. */
static void pre_words(kvq_bpe_pre pre, const char *text, char *out, size_t cap)
{
    size_t n = strlen(text), ncp = 0, *len, nw;
    uint32_t cp[256];
    unsigned char cls[256];
    for (size_t i = 0; i < n;) {
        cp[ncp] = kvq_utf8_next((const unsigned char *)text, n, &i);
        cls[ncp] = (unsigned char)kvq_cp_class(cp[ncp]);
        ncp++;
    }
    ck_assert(kvq_bpe_pretokenize(pre, cp, cls, ncp, &len, &nw) == 0);
    size_t o = 0, at = 0;
    for (size_t w = 0; w < nw; w++) {
        if (w) out[o++] = '|';
        for (size_t c = at; c < at + len[w]; c++) { /* code points back to UTF-8 (tests use ASCII and a few others) */
            uint32_t u = cp[c];
            if (u < 0x80) out[o++] = (char)u;
            else if (u < 0x800) out[o++] = (char)(0xC0 | u >> 6), out[o++] = (char)(0x80 | (u & 63));
            else
                out[o++] = (char)(0xE0 | u >> 12), out[o++] = (char)(0x80 | ((u >> 6) & 63)),
                out[o++] = (char)(0x80 | (u & 63));
        }
        at += len[w];
        ck_assert(o < cap - 8);
    }
    out[o] = '\0';
    free(len);
}

/* The pre-tokenizers' regexes, worked by hand on small texts. */
START_TEST(test_pretokenizers)
{
    char w[1024];
    /* llama-bpe: contractions any case, an optional non-letter before letters, digits in threes,
     * punctuation with trailing newlines, \s*[\r\n]+, \s+(?!\S) leaving one space */
    pre_words(KVQ_PRE_LLAMA3, "I'M here, 12345 cats!!\n\n  ok   x", w, sizeof w);
    ck_assert_str_eq(w, "I|'M| here|,| |123|45| cats|!!\n\n| | ok|  | x");
    pre_words(KVQ_PRE_LLAMA3, "(abc) don't", w, sizeof w);
    ck_assert_str_eq(w, "(abc|)| don|'t");
    /* qwen2: the same with digits one at a time */
    pre_words(KVQ_PRE_QWEN2, "I'M here, 12345", w, sizeof w);
    ck_assert_str_eq(w, "I|'M| here|,| |1|2|3|4|5");
    /* gpt-2: contractions lower case only, ' ?\p{N}+' keeps digits together */
    pre_words(KVQ_PRE_GPT2, "I'M here, 12345 cats's", w, sizeof w);
    ck_assert_str_eq(w, "I|'|M| here|,| 12345| cats|'s");
    /* default: punctuation runs (and $+<=>^~|) first, then gpt-2, then \p{N}+, then ASCII-digit triples */
    pre_words(KVQ_PRE_DEFAULT, "Hello, world!! 12345 $x", w, sizeof w);
    ck_assert_str_eq(w, "Hello|,| world|!!| |123|45| |$|x");
    /* non-ASCII: a letter run (é), a number (٣, Arabic-Indic three), U+3000 as whitespace */
    pre_words(KVQ_PRE_LLAMA3, "caf\xc3\xa9 \xd9\xa3\xe3\x80\x80x", w, sizeof w);
    ck_assert_str_eq(w, "caf\xc3\xa9| |\xd9\xa3|\xe3\x80\x80x");
}
END_TEST

START_TEST(test_tokenizer)
{
    gw_model_opts o = {"llama", 1, 4, 2, 16, 96, 400, 256, KVQ_GGML_F32, 0, 0, 1, 31};
    char *path = write_model(&o);
    kvq_model *m;
    kvq_error err = {0};
    ck_assert(kvq_model_open(path, NULL, &m, &err) == KVQ_OK);
    ck_assert(kvq_model_get_info(m)->has_tokenizer);
    int *ids;
    size_t n;
    ck_assert_msg(kvq_model_tokenize(m, "the cat", 7, &ids, &n, &err) == KVQ_OK, "%s", err.msg);
    ck_assert_uint_eq(n, 3);
    ck_assert_int_eq(ids[0], 1);
    ck_assert_str_eq(m->vocab.piece[ids[1]], "\xe2\x96\x81the");
    ck_assert_str_eq(m->vocab.piece[ids[2]], "\xe2\x96\x81" "cat");
    free(ids);
    /* byte fallback: 'Q' and '\n' are not pieces */
    ck_assert(kvq_model_tokenize(m, "aQ\n", 3, &ids, &n, &err) == KVQ_OK);
    ck_assert_uint_eq(n, 4);
    ck_assert_str_eq(m->vocab.piece[ids[1]], "\xe2\x96\x81" "a");
    ck_assert_int_eq(ids[2], 3 + 'Q');
    ck_assert_int_eq(ids[3], 3 + '\n');
    free(ids);
    ck_assert(kvq_model_tokenize(m, "", 0, &ids, &n, &err) == KVQ_ERR_USAGE);
    ck_assert(strstr(err.msg, "nothing"));
    /* --tokens files */
    ck_assert(kvq_tokens_parse("t", " 1 2\n3 ", 7, 10, &ids, &n, &err) == KVQ_OK && n == 3 && ids[2] == 3);
    free(ids);
    ck_assert(kvq_tokens_parse("t", "1 10", 4, 10, &ids, &n, &err) == KVQ_ERR_FORMAT && strstr(err.msg, "\"10\""));
    ck_assert(kvq_tokens_parse("t", "1 x2", 4, 10, &ids, &n, &err) == KVQ_ERR_FORMAT);
    ck_assert(kvq_tokens_parse("t", "1 -2", 4, 10, &ids, &n, &err) == KVQ_ERR_FORMAT);
    ck_assert(kvq_tokens_parse("t", "99999999999999999999", 20, 10, &ids, &n, &err) == KVQ_ERR_FORMAT);
    ck_assert(kvq_tokens_parse("t", "  \n", 3, 10, &ids, &n, &err) == KVQ_ERR_FORMAT);
    /* a token id the model does not have */
    int bad[3] = {1, 5, 400};
    ck_assert(kvq_model_dump(m, bad, 3, NULL, 0, "/tmp/kvq-never.h5", 1, NULL, &err) == KVQ_ERR_USAGE);
    ck_assert(strstr(err.msg, "400") && strstr(err.msg, "position 2"));
    ck_assert(access("/tmp/kvq-never.h5", F_OK) != 0);
    kvq_model_close(m);
    unlink(path), free(path);
    /* a model without a vocabulary names --tokens */
    o.with_vocab = 0;
    path = write_model(&o);
    ck_assert(kvq_model_open(path, NULL, &m, &err) == KVQ_OK);
    ck_assert(kvq_model_tokenize(m, "a", 1, &ids, &n, &err) == KVQ_ERR_UNSUPPORTED);
    ck_assert(strstr(err.msg, "--tokens"));
    kvq_model_close(m);
    unlink(path), free(path);
}
END_TEST

/* ----------------------------------------------------------- bad input */

static kvq_status open_bytes(const uint8_t *p, size_t n, kvq_error *err)
{
    char path[] = "/tmp/kvq-bad-XXXXXX";
    int fd = mkstemp(path);
    ck_assert(fd >= 0);
    close(fd);
    ck_assert(gw_write_file(path, p, n) == 0);
    kvq_model *m = NULL;
    kvq_status st = kvq_model_open(path, NULL, &m, err);
    kvq_model_close(m);
    unlink(path);
    return st;
}

static void expect_bad(gguf_w *w, kvq_status want, const char *needle)
{
    uint8_t *p;
    size_t n;
    kvq_error err = {0};
    gw_serialise(w, &p, &n);
    kvq_status st = open_bytes(p, n, &err);
    ck_assert_msg(st == want && strstr(err.msg, needle), "status %d, message \"%s\" (expected \"%s\")", st, err.msg,
                  needle);
    ck_assert(!strchr(err.msg, '\n'));
    free(p);
    gw_free(w);
}

/* The model opens, but evaluating 3 tokens without a quantizer is refused
 * (KVQ_ERR_FORMAT) with a message containing needle. */
static void expect_eval_refused(gguf_w *w, const char *needle)
{
    char path[32];
    kvq_error err = {0};
    write_temp(w, path);
    kvq_model *m = NULL;
    ck_assert_msg(kvq_model_open(path, NULL, &m, &err) == KVQ_OK, "%s", err.msg);
    int toks[3] = {1, 2, 3};
    kvq_eval_item item = {.spec = NULL, .layer = -1};
    kvq_eval_opts eo = {.stride = 1, .nthreads = 1};
    double nll;
    ck_assert(kvq_model_eval(m, toks, 3, &item, 1, &eo, &nll, &err) == KVQ_ERR_FORMAT);
    ck_assert_msg(strstr(err.msg, needle), "%s (expected \"%s\")", err.msg, needle);
    kvq_model_close(m);
    unlink(path);
}

START_TEST(test_bad_models)
{
    gw_model_opts o = {"llama", 1, 4, 2, 8, 64, 32, 64, KVQ_GGML_F32, 0, 0, 0, 41};
    gguf_w w;
    kvq_error err = {0};
    /* unknown architecture, named */
    o.arch = "gptneox";
    gw_tiny_model(&w, &o);
    expect_bad(&w, KVQ_ERR_UNSUPPORTED, "\"gptneox\"");
    o.arch = "llama";
    /* missing metadata */
    gw_tiny_model(&w, &o);
    gguf_w w2 = {0};
    gw_kv_str(&w2, "general.architecture", "llama");
    w2.t = w.t, w2.nt = w.nt, w.t = NULL, w.nt = 0;
    gw_free(&w);
    expect_bad(&w2, KVQ_ERR_FORMAT, "llama.block_count");
    /* missing tensor */
    gw_tiny_model(&w, &o);
    for (int i = 0; i < w.nt; i++)
        if (!strcmp(w.t[i].name, "blk.0.ffn_up.weight"))
            snprintf(w.t[i].name, sizeof w.t[i].name, "blk.0.ffn_upx.weight");
    expect_bad(&w, KVQ_ERR_FORMAT, "blk.0.ffn_up.weight");
    /* wrong shape */
    gw_tiny_model(&w, &o);
    for (int i = 0; i < w.nt; i++)
        if (!strcmp(w.t[i].name, "blk.0.attn_k.weight")) w.t[i].ne[1] = 8, w.t[i].nbytes = 32 * 8 * 4;
    expect_bad(&w, KVQ_ERR_FORMAT, "blk.0.attn_k.weight: expected [32, 16]");
    /* a rope_freqs factor that is not positive, named with its index (the
     * file opens; the first forward pass refuses it) */
    o.freqs = 1;
    gw_tiny_model(&w, &o);
    o.freqs = 0;
    for (int i = 0; i < w.nt; i++)
        if (!strcmp(w.t[i].name, "rope_freqs.weight")) {
            float bad = -2.0f;
            memcpy(w.t[i].data + 4, &bad, 4);
        }
    expect_eval_refused(&w, "rope_freqs.weight: factor 1 is -2");
    /* a NaN weight, and weights so large that the hidden state overflows: exit 1 naming the
     * tensor (row, column) or the layer and position, never a result */
    for (int k = 0; k < 2; k++) {
        gw_tiny_model(&w, &o);
        for (int i = 0; i < w.nt; i++) {
            if (k == 0 && !strcmp(w.t[i].name, "blk.0.attn_q.weight")) {
                float nan = NAN;
                memcpy(w.t[i].data + 4 * (3 * 32 + 5), &nan, 4); /* row 3, column 5 */
            }
            if (k == 1 && !strcmp(w.t[i].name, "blk.0.ffn_down.weight"))
                for (size_t e = 0; e < w.t[i].nbytes / 4; e++) {
                    float big = 3e38f;
                    memcpy(w.t[i].data + 4 * e, &big, 4);
                }
        }
        expect_eval_refused(&w, k ? "layer 0, position 0: the hidden state is"
                                  : "tensor blk.0.attn_q.weight: row 3, column 5 is nan");
    }
    /* a q8_0 block whose scale is nan (its values too, though no value is
     * looked at where the scales are finite), named at the block's first value */
    o.wtype = KVQ_GGML_Q8_0;
    gw_tiny_model(&w, &o);
    o.wtype = KVQ_GGML_F32;
    for (int i = 0; i < w.nt; i++)
        if (!strcmp(w.t[i].name, "blk.0.ffn_up.weight")) {
            uint16_t nan16 = 0x7E00;
            memcpy(w.t[i].data + 34 * 5, &nan16, 2); /* row 5 (a row: one block of 34 bytes) */
        }
    expect_eval_refused(&w, "tensor blk.0.ffn_up.weight: row 5, column 0 is nan");
    /* the gate and up matrices both bad (their column tiles taken together, gemm_glu): the gate is named */
    o.wtype = KVQ_GGML_Q8_0;
    gw_tiny_model(&w, &o);
    o.wtype = KVQ_GGML_F32;
    for (int i = 0; i < w.nt; i++) {
        uint16_t nan16 = 0x7E00;
        if (!strcmp(w.t[i].name, "blk.0.ffn_up.weight")) memcpy(w.t[i].data + 34 * 2, &nan16, 2);
        if (!strcmp(w.t[i].name, "blk.0.ffn_gate.weight")) memcpy(w.t[i].data + 34 * 7, &nan16, 2);
    }
    expect_eval_refused(&w, "tensor blk.0.ffn_gate.weight: row 7, column 0 is nan");
    /* unknown ggml type, named */
    gw_tiny_model(&w, &o);
    w.t[0].type = 99;
    expect_bad(&w, KVQ_ERR_UNSUPPORTED, "ggml type 99");
    /* issue #36: a block_count below the file's layers (a truncated model would run), a bool
     * byte of 2, and the accepted ranges of the optional reals said as they are accepted */
    o.L = 2;
    gw_tiny_model(&w, &o);
    o.L = 1;
    {
        gguf_w w1 = {0}; /* the same tensors, block_count 1 */
        gw_kv_str(&w1, "general.architecture", "llama");
        gw_kv_u32(&w1, "llama.block_count", 1);
        gw_kv_u32(&w1, "llama.context_length", 64);
        gw_kv_u32(&w1, "llama.embedding_length", 32);
        gw_kv_u32(&w1, "llama.feed_forward_length", 64);
        gw_kv_u32(&w1, "llama.attention.head_count", 4);
        gw_kv_u32(&w1, "llama.attention.head_count_kv", 2);
        w1.t = w.t, w1.nt = w.nt, w.t = NULL, w.nt = 0;
        gw_free(&w);
        expect_bad(&w1, KVQ_ERR_FORMAT, "tensor blk.1.attn_norm.weight: layer 1, but llama.block_count is 1");
    }
    gw_tiny_model(&w, &o);
    gw_kv_bool(&w, "tokenizer.ggml.add_bos_token", 2);
    expect_bad(&w, KVQ_ERR_FORMAT, "tokenizer.ggml.add_bos_token: a bool of byte value 2: expected 0 or 1");
    gw_tiny_model(&w, &o);
    gw_kv_f32(&w, "llama.rope.scaling.factor", -0.5f);
    expect_bad(&w, KVQ_ERR_FORMAT, "llama.rope.scaling.factor: expected 0 (none) or a positive number below 1e+06");
    o.arch = "gemma3";
    gw_tiny_model(&w, &o);
    o.arch = "llama";
    gw_kv_f32(&w, "gemma3.final_logit_softcapping", -0.5f);
    expect_bad(&w, KVQ_ERR_FORMAT, "gemma3.final_logit_softcapping: expected 0 (none) or a positive finite number");
    /* a metadata key or a tensor name given twice */
    gw_tiny_model(&w, &o);
    gw_kv_u32(&w, "llama.block_count", 7);
    expect_bad(&w, KVQ_ERR_FORMAT, "metadata key llama.block_count appears twice");
    gw_tiny_model(&w, &o);
    memcpy(w.t[w.nt - 1].name, w.t[0].name, sizeof w.t[0].name);
    expect_bad(&w, KVQ_ERR_FORMAT, "appears twice");
    /* 100k tensor entries with the duplicate last: refused through the name
     * index (linear; the pairwise check took 48 s on such a file) */
    gw_tiny_model(&w, &o);
    w.t = realloc(w.t, (size_t)(w.nt + 100000) * sizeof *w.t); /* room at once: ASan's realloc always copies */
    for (int i = 0; i < 100000; i++) {
        gw_tensor *t = &w.t[w.nt++];
        memset(t, 0, sizeof *t);
        snprintf(t->name, sizeof t->name, "extra.%d", i % 99999);
        t->n_dims = 1, t->ne[0] = 1, t->ne[1] = 1, t->type = KVQ_GGML_F32, t->nbytes = 4;
        t->data = calloc(1, 4);
    }
    expect_bad(&w, KVQ_ERR_FORMAT, "tensor extra.0 appears twice");
    /* n_dims > 4 and absurd dimension */
    gw_tiny_model(&w, &o);
    w.t[1].n_dims = 5;
    uint8_t *p;
    size_t n;
    gw_serialise(&w, &p, &n); /* a fifth dimension of 1 */
    ck_assert(open_bytes(p, n, &err) == KVQ_ERR_FORMAT && strstr(err.msg, "5 dimensions"));
    free(p);
    gw_free(&w);
    /* ne = [0, 2^61, 7]: no bytes, but the rows overflow (UBSan caught the product); a tensor
     * name with a NUL byte in it */
    gw_tiny_model(&w, &o);
    for (int i = 0; i < w.nt; i++)
        if (!strcmp(w.t[i].name, "blk.0.attn_q.weight"))
            w.t[i].n_dims = 3, w.t[i].ne[0] = 0, w.t[i].ne[1] = 1ull << 61, w.t[i].ne[2] = 7, w.t[i].nbytes = 0;
    expect_bad(&w, KVQ_ERR_FORMAT, "blk.0.attn_q.weight: dimensions 2305843009213693952 x 7 x 1 overflow");
    gw_tiny_model(&w, &o);
    gw_serialise(&w, &p, &n);
    gw_free(&w);
    uint8_t *nm = memmem(p, n, "blk.0.attn_k.weight", 19);
    ck_assert(nm);
    nm[5] = '\0'; /* "blk.0\0attn_k.weight" */
    ck_assert(open_bytes(p, n, &err) == KVQ_ERR_FORMAT && strstr(err.msg, "holds a NUL byte"));
    free(p);
    /* tensor data past the end of the file */
    gw_tiny_model(&w, &o);
    gw_serialise(&w, &p, &n);
    ck_assert(open_bytes(p, n - 64, &err) == KVQ_ERR_FORMAT && strstr(err.msg, "past the end"));
    /* absurd counts and string lengths in the header */
    uint8_t *q = malloc(n);
    memcpy(q, p, n);
    uint64_t big = 1ull << 40;
    memcpy(q + 8, &big, 8);
    ck_assert(open_bytes(q, n, &err) == KVQ_ERR_FORMAT && strstr(err.msg, "cannot fit"));
    memcpy(q, p, n);
    memcpy(q + 24, &big, 8); /* the first key's length */
    ck_assert(open_bytes(q, n, &err) == KVQ_ERR_FORMAT && strstr(err.msg, "past the end"));
    memcpy(q, p, n);
    uint32_t v1 = 1;
    memcpy(q + 4, &v1, 4);
    ck_assert(open_bytes(q, n, &err) == KVQ_ERR_FORMAT && strstr(err.msg, "version 1"));
    /* wrong magic: neither GGUF nor a llama2.c checkpoint */
    memcpy(q, p, n);
    q[0] = 'X';
    ck_assert(open_bytes(q, n, &err) == KVQ_ERR_FORMAT && strstr(err.msg, "not a model file"));
    /* every truncation of the whole model file */
    for (size_t cut = 0; cut < n; cut += (cut < 4096 ? 1 : 61)) {
        kvq_gguf g;
        uint8_t *c = malloc(cut ? cut : 1);
        memcpy(c, p, cut);
        ck_assert_msg(kvq_gguf_parse(&g, "mem", c, cut, &err) != KVQ_OK, "cut at %zu accepted", cut);
        free(c);
    }
    free(q), free(p);
    gw_free(&w);
    /* a missing file */
    kvq_model *m;
    ck_assert(kvq_model_open("/nonexistent/model.gguf", NULL, &m, &err) == KVQ_ERR_IO &&
              strstr(err.msg, "/nonexistent"));
    /* llama2.c: a header whose size does not match */
    int32_t hdr[7] = {64, 172, 5, 8, 4, 512, 512};
    float zeros[64] = {0};
    gw_buf b = {0};
    gw_put(&b, hdr, sizeof hdr);
    gw_put(&b, zeros, sizeof zeros);
    ck_assert(open_bytes(b.p, b.n, &err) == KVQ_ERR_FORMAT && strstr(err.msg, "should have"));
    free(b.p);
}
END_TEST

/* Mutated models: a tiny GGUF (q8_0 weights, a vocabulary) with 1 to 4
 * bytes changed — mostly in the header, key-values and tensor table, some
 * anywhere — or cut short.  Each is refused with a one-line message or,
 * where it still parses, tokenizes and evaluates (or refuses to, again with
 * a message); under the ASan + UBSan build nothing reads out of bounds.
 * Deterministic: a fixed xorshift stream. */
START_TEST(test_mutated_models)
{
    gw_model_opts o = {"llama", 2, 4, 2, 8, 64, 400, 64, KVQ_GGML_Q8_0, 0, 0, 1, 5};
    gguf_w w;
    uint8_t *p, *q;
    size_t n;
    gw_tiny_model(&w, &o);
    gw_serialise(&w, &p, &n);
    gw_free(&w);
    q = malloc(n);
    char path[] = "/tmp/kvq-mut-XXXXXX";
    int fd = mkstemp(path);
    ck_assert(fd >= 0);
    close(fd);
    uint64_t x = 88172645463325252ull;
    int opened = 0, refused = 0;
    for (int it = 0; it < 400; it++) {
        memcpy(q, p, n);
        size_t len = n, head = n < 4096 ? n : 4096;
        int nm = 1 + it % 4;
        for (int k = 0; k < nm; k++) {
            x ^= x << 13, x ^= x >> 7, x ^= x << 17;
            size_t at = (x >> 8) % (it % 5 == 4 ? n : head);
            switch ((x >> 40) % 4) {
            case 0: q[at] ^= (uint8_t)(1u << ((x >> 50) % 8)); break;
            case 1: q[at] = 0xff; break;
            case 2: q[at] = 0; break;
            default: /* a length or count made absurd or small */
                if (at + 8 <= n) {
                    uint64_t v = (x >> 60) & 1 ? ~0ull >> ((x >> 33) % 40) : (x >> 20) % 70000;
                    memcpy(q + at, &v, 8);
                }
            }
        }
        if (it % 9 == 8) len = (size_t)(x >> 12) % n;
        ck_assert(gw_write_file(path, q, len) == 0);
        kvq_model *m = NULL;
        kvq_error err = {0};
        if (kvq_model_open(path, NULL, &m, &err) != KVQ_OK) {
            ck_assert_msg(err.msg[0] && !strchr(err.msg, '\n'), "mutation %d: refused without a one-line message", it);
            refused++;
            continue;
        }
        opened++;
        const kvq_model_info *in = kvq_model_get_info(m);
        int toks[5];
        for (int i = 0; i < 5; i++) toks[i] = (int)((x >> (8 * i)) % (uint64_t)in->vocab_size);
        kvq_eval_item item = {.spec = NULL, .layer = -1};
        kvq_eval_opts eo = {.stride = 1, .nthreads = 1};
        double nll;
        err.msg[0] = 0;
        if (kvq_model_eval(m, toks, 5, &item, 1, &eo, &nll, &err) != KVQ_OK)
            ck_assert_msg(err.msg[0], "mutation %d: eval failed without a message", it);
        if (in->has_tokenizer) {
            int *ids = NULL;
            size_t ni = 0;
            err.msg[0] = 0;
            if (kvq_model_tokenize(m, "Once upon a time", 16, &ids, &ni, &err) == KVQ_OK) ck_assert(ni >= 1);
            else ck_assert_msg(err.msg[0], "mutation %d: tokenize failed without a message", it);
            free(ids);
        }
        kvq_model_close(m);
    }
    printf("mutated models: %d refused, %d opened and evaluated\n", refused, opened);
    /* both outcomes occur, so both paths were exercised */
    ck_assert_msg(opened > 20 && refused > 20, "opened %d, refused %d", opened, refused);
    unlink(path);
    free(p), free(q);
}
END_TEST

/* -------------------------------------------------- the bundled model */

static const char *model_dir(void)
{
    static char dir[1024];
    const char *e = getenv("KVQ_MODEL_DIR");
    snprintf(dir, sizeof dir, "%s", e ? e : KVQ_SOURCE_ROOT "/../shared/data");
    char probe[1100];
    snprintf(probe, sizeof probe, "%s/model/stories260K.gguf", dir);
    return access(probe, R_OK) == 0 ? dir : NULL;
}

static void compare_with_bundled(const char *model, const char *tokenizer, int max_tokens)
{
    const char *dir = model_dir();
    char mp[1200], tp[1200], text[1200];
    snprintf(mp, sizeof mp, "%s/model/%s", dir, model);
    snprintf(tp, sizeof tp, "%s/model/%s", dir, tokenizer ? tokenizer : "");
    snprintf(text, sizeof text, "%s/texts/story_main.txt", dir);
    kvq_model *m;
    kvq_error err = {0};
    ck_assert_msg(kvq_model_open(mp, tokenizer ? tp : NULL, &m, &err) == KVQ_OK, "%s", err.msg);
    FILE *f = fopen(text, "rb");
    char buf[8192];
    size_t len = fread(buf, 1, sizeof buf, f);
    fclose(f);
    int *ids;
    size_t n;
    ck_assert(kvq_model_tokenize(m, buf, len, &ids, &n, &err) == KVQ_OK);
    ck_assert(n >= (size_t)max_tokens);
    char out[] = "/tmp/kvq-stories-XXXXXX.h5";
    close(mkstemps(out, 3));
    double nll;
    ck_assert_msg(kvq_model_dump(m, ids, max_tokens, NULL, 0, out, 2, &nll, &err) == KVQ_OK, "%s", err.msg);
    ck_assert_msg(fabs(nll - 1.3124) < 1e-4, "mean NLL %.6f, expected 1.3124", nll);
    kvq_dump *a, *b;
    ck_assert(kvq_dump_open(out, &a, &err) == KVQ_OK);
    ck_assert(kvq_dump_open(KVQ_SOURCE_ROOT "/data/stories260K.h5", &b, &err) == KVQ_OK);
    for (int l = 0; l < 5; l++) {
        kvq_layer x, y;
        unsigned fl = KVQ_READ_QUERY | KVQ_READ_KEY_PRE_ROPE;
        ck_assert(kvq_dump_read_layer(a, l, fl, &x, &err) == KVQ_OK &&
                  kvq_dump_read_layer(b, l, fl, &y, &err) == KVQ_OK);
        size_t nk = (size_t)4 * 512 * 8, nq = 2 * nk;
        const float *pa[4] = {x.key, x.value, x.query, x.key_pre_rope},
                    *pb[4] = {y.key, y.value, y.query, y.key_pre_rope};
        size_t cnt[4] = {nk, nk, nq, nk};
        for (int k = 0; k < 4; k++)
            for (size_t i = 0; i < cnt[k]; i++)
                ck_assert_msg(fabsf(pa[k][i] - pb[k][i]) <= 1e-4f * fmaxf(1.0f, fabsf(pb[k][i])),
                              "%s layer %d tensor %d [%zu]: %g vs %g", model, l, k, i, (double)pa[k][i],
                              (double)pb[k][i]);
        kvq_layer_free(&x), kvq_layer_free(&y);
    }
    /* the same token ids as the bundled dump */
    int *ta, *tb;
    size_t na, nb;
    ck_assert(kvq_dump_read_tokens(a, &ta, &na, &err) == KVQ_OK && kvq_dump_read_tokens(b, &tb, &nb, &err) == KVQ_OK);
    ck_assert(na == 512 && nb == 512 && !memcmp(ta, tb, 512 * sizeof *ta) && !memcmp(ta, ids, 512 * sizeof *ta));
    free(ta), free(tb);
    kvq_dump_close(a), kvq_dump_close(b);
    free(ids);
    kvq_model_close(m);
    unlink(out);
}

START_TEST(test_bundled_gguf)
{
    if (!model_dir()) { fprintf(stderr, "test_bundled_gguf: skipped: ../shared/data/model absent\n"); return; }
    compare_with_bundled("stories260K.gguf", NULL, 512);
}
END_TEST

START_TEST(test_bundled_llama2c)
{
    if (!model_dir()) { fprintf(stderr, "test_bundled_llama2c: skipped: ../shared/data/model absent\n"); return; }
    compare_with_bundled("stories260K.bin", "tok512.bin", 512);
    /* a tokenizer with more tokens than the model's vocabulary (another model's) is refused */
    char tp[1200], mp[1200], big[] = "/tmp/kvq-tok-XXXXXX";
    snprintf(tp, sizeof tp, "%s/model/tok512.bin", model_dir());
    snprintf(mp, sizeof mp, "%s/model/stories260K.bin", model_dir());
    FILE *in = fopen(tp, "rb"), *out = fdopen(mkstemp(big), "wb");
    ck_assert(in && out);
    for (int c; (c = fgetc(in)) != EOF;) fputc(c, out);
    float score = 0;
    int32_t len = 3;
    fwrite(&score, 4, 1, out), fwrite(&len, 4, 1, out), fwrite("xyz", 1, 3, out);
    fclose(in), fclose(out);
    kvq_model *m;
    kvq_error err = {0};
    ck_assert(kvq_model_open(mp, big, &m, &err) == KVQ_ERR_FORMAT);
    ck_assert_msg(strstr(err.msg, "more tokens than the model's vocabulary of 512"), "%s", err.msg);
    unlink(big);
}
END_TEST

int main(void)
{
    Suite *s = suite_create("model");
    TCase *tc = tcase_create("model");
    tcase_set_timeout(tc, 600);
    tcase_add_test(tc, test_dequant_formulas);
    tcase_add_test(tc, test_dequant_by_hand);
    tcase_add_test(tc, test_finite_by_scales);
    tcase_add_test(tc, test_gguf_values);
    tcase_add_loop_test(tc, test_forward_against_reference, 0, (int)(sizeof fw_cases / sizeof fw_cases[0]));
    tcase_add_test(tc, test_blas_rows_claim);
    tcase_add_test(tc, test_eval_invariants);
    tcase_add_test(tc, test_chunk_by_hand);
    tcase_add_test(tc, test_scored_rows_and_riding);
    tcase_add_test(tc, test_lockstep_equals_alone);
    tcase_add_test(tc, test_lockstep_scored_rows);
    tcase_add_test(tc, test_tokenizer);
    tcase_add_test(tc, test_pretokenizers);
    tcase_add_test(tc, test_bad_models);
    tcase_add_test(tc, test_mutated_models);
    tcase_add_test(tc, test_bundled_gguf);
    tcase_add_test(tc, test_bundled_llama2c);
    suite_add_tcase(s, tc);
    return run_suite(s);
}

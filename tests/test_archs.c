/* test_archs.c — the architectures of real models against llama.cpp, and
 * results that do not depend on the thread count (docs/models.md).
 *
 * ../shared/data/models-tiny/ holds tiny random-weight models in the GGUF
 * layout llama.cpp's converter writes (llama with Llama 3's shapes, qwen3,
 * gemma3 with sliding-window layers, phi3 with fused tensors) and llama.cpp's
 * own logits for 200 tokens of each (tiny-*.golden.h5).  Checked here:
 *  - the tokenizers: llama.cpp's ids for 15 texts, exactly (tiny-*.tokens.tsv);
 *  - the forward pass: max |Δlogit| <= 0.05 at the stored positions and
 *    |Δ mean NLL| <= 5e-4 (llama.cpp rounds activations to f16/q8_0 inside
 *    its products; a missing window or a wrong RoPE base moves logits by ~2);
 *  - every result bit-identical at 1, 2 and 3 threads (kvq_model_eval's
 *    columns and logits, kvq_model_dump's tensors);
 *  - prefill == decode, bit for bit, for quantizers whose reconstruction of
 *    a token depends on that token alone (per-token groups, fp8 per token,
 *    ggml), also through gemma3's sliding windows and with a decode stride.
 * Every test skips (with a line on stderr) when ../shared is absent. */
#include "testutil.h"
#include "model/model.h"

#include <hdf5.h>
#include <stdio.h>

static const char *archs[] = {"llama3", "qwen3", "gemma3", "phi3"};
enum { NARCH = 4, GT = 200, GPOS = 7 };

static int tiny_path(const char *arch, const char *ext, char *out, size_t n)
{
    const char *e = getenv("KVQ_MODEL_DIR");
    snprintf(out, n, "%s/models-tiny/tiny-%s.%s", e ? e : KVQ_SOURCE_ROOT "/../shared/data", arch, ext);
    return access(out, R_OK) == 0;
}

/* llama.cpp's reference for one tiny model. */
typedef struct golden {
    int tokens[GT], pos[GPOS];
    double mean_nll;
    float *logits; /* [GPOS][vocab] */
} golden;

/* A dataset of f read whole as type into buf (the HDF5 kvq links: no second
 * HDF5 through the high-level library). */
static herr_t read_whole(hid_t f, const char *name, hid_t type, void *buf)
{
    hid_t d = H5Dopen2(f, name, H5P_DEFAULT);
    herr_t h = d < 0 ? -1 : H5Dread(d, type, H5S_ALL, H5S_ALL, H5P_DEFAULT, buf);
    if (d >= 0) H5Dclose(d);
    return h;
}

static void golden_read(const char *path, int vocab, golden *g)
{
    hid_t f = H5Fopen(path, H5F_ACC_RDONLY, H5P_DEFAULT);
    ck_assert_msg(f >= 0, "%s: cannot open", path);
    hsize_t dims[2] = {0, 0};
    hid_t d = H5Dopen2(f, "/logits", H5P_DEFAULT), sp = d < 0 ? -1 : H5Dget_space(d);
    ck_assert(sp >= 0 && H5Sget_simple_extent_ndims(sp) == 2 && H5Sget_simple_extent_dims(sp, dims, NULL) == 2);
    H5Sclose(sp), H5Dclose(d);
    ck_assert_msg(dims[0] == GPOS && dims[1] == (hsize_t)vocab, "%s: logits [%llu, %llu]", path,
                  (unsigned long long)dims[0], (unsigned long long)dims[1]);
    g->logits = malloc((size_t)GPOS * (size_t)vocab * sizeof(float));
    hid_t a = H5Aopen_by_name(f, "/", "mean_nll", H5P_DEFAULT, H5P_DEFAULT);
    ck_assert(read_whole(f, "/tokens", H5T_NATIVE_INT, g->tokens) >= 0 &&
              read_whole(f, "/positions", H5T_NATIVE_INT, g->pos) >= 0 &&
              read_whole(f, "/logits", H5T_NATIVE_FLOAT, g->logits) >= 0 && a >= 0 &&
              H5Aread(a, H5T_NATIVE_DOUBLE, &g->mean_nll) >= 0);
    H5Aclose(a);
    H5Fclose(f);
}

static kvq_model *open_tiny(const char *arch)
{
    char p[1200];
    if (!tiny_path(arch, "gguf", p, sizeof p)) return NULL;
    kvq_model *m;
    kvq_error err = {0};
    ck_assert_msg(kvq_model_open(p, NULL, &m, &err) == KVQ_OK, "%s", err.msg);
    return m;
}

/* The tiny model and its golden, or NULL (a line on stderr) without ../shared. */
static kvq_model *open_case(const char *test, const char *arch, golden *g)
{
    kvq_model *m = open_tiny(arch);
    if (!m) {
        fprintf(stderr, "%s(%s): skipped: ../shared/data/models-tiny absent\n", test, arch);
        return NULL;
    }
    char gp[1200];
    ck_assert(tiny_path(arch, "golden.h5", gp, sizeof gp));
    golden_read(gp, kvq_model_get_info(m)->vocab_size, g);
    return m;
}

START_TEST(test_against_llama_cpp)
{
    const char *arch = archs[_i];
    kvq_model *m = open_tiny(arch);
    if (!m) {
        fprintf(stderr, "test_against_llama_cpp(%s): skipped: ../shared/data/models-tiny absent\n", arch);
        return;
    }
    const kvq_model_info *in = kvq_model_get_info(m);
    char gp[1200];
    ck_assert(tiny_path(arch, "golden.h5", gp, sizeof gp));
    golden g;
    golden_read(gp, in->vocab_size, &g);
    float *lg = malloc((size_t)GPOS * in->vocab_size * sizeof *lg);
    kvq_eval_opts o = {.nthreads = 2, .logit_pos = g.pos, .n_logit_pos = GPOS, .logits = lg};
    kvq_error err = {0};
    double nll;
    ck_assert_msg(kvq_model_eval(m, g.tokens, GT, NULL, 0, &o, &nll, &err) == KVQ_OK, "%s", err.msg);
    double worst = 0;
    size_t at = 0;
    for (size_t i = 0; i < (size_t)GPOS * in->vocab_size; i++)
        if (fabs((double)lg[i] - g.logits[i]) > worst) worst = fabs((double)lg[i] - g.logits[i]), at = i;
    fprintf(stderr, "%s (%s): max |dlogit| %.4f, mean NLL %.6f vs llama.cpp %.6f\n", arch, in->arch_name, worst, nll,
            g.mean_nll);
    ck_assert_msg(worst <= 0.05, "%s: logit of position %d, token %zu: %.5f, llama.cpp %.5f", arch,
                  g.pos[at / (size_t)in->vocab_size], at % (size_t)in->vocab_size, (double)lg[at],
                  (double)g.logits[at]);
    ck_assert_msg(fabs(nll - g.mean_nll) <= 5e-4, "%s: mean NLL %.6f, llama.cpp %.6f", arch, nll, g.mean_nll);
    if (!strcmp(arch, "gemma3")) { /* 5 of 6 layers local, window 64, their own RoPE base */
        ck_assert_int_eq(in->sliding_window, 64);
        ck_assert_int_eq(in->n_swa_layers, 5);
        ck_assert(kvq_model_layer_window(m, 0) == 64 && kvq_model_layer_window(m, 5) == 0);
        ck_assert(in->rope_theta_swa == 10000.0 && in->rope_theta == 1e6);
    }
    free(g.logits), free(lg);
    kvq_model_close(m);
}
END_TEST

/* ------------------------------------------------------ tokenizers */

/* llama_tokenize(add_special = true, parse_special = false) of the 15 texts
 * of ../shared/data/texts/tokenizer (prose, numbers, code, whitespace runs,
 * CJK, emoji, RTL scripts, combining marks, special-token strings as plain
 * text): Llama 3's and Qwen3's GPT-2 BPE (pre-tokenizers llama-bpe and
 * qwen2), Gemma 3's SentencePiece (no space prefix, user-defined tokens),
 * phi3 with Llama 3's vocabulary; every id equal. */
START_TEST(test_tokenizer_matches_llama_cpp)
{
    const char *arch = archs[_i];
    kvq_model *m = open_tiny(arch);
    if (!m) {
        fprintf(stderr, "test_tokenizer_matches_llama_cpp(%s): skipped: ../shared/data/models-tiny absent\n", arch);
        return;
    }
    char tp[1200];
    ck_assert(tiny_path(arch, "tokens.tsv", tp, sizeof tp));
    FILE *tsv = fopen(tp, "r");
    ck_assert(tsv);
    static char line[1 << 20], text[1 << 20];
    int ntexts = 0;
    while (fgets(line, sizeof line, tsv)) {
        char *tab = strchr(line, '\t');
        ck_assert_msg(tab, "%s: expected NAME<TAB>ids", tp);
        *tab = '\0';
        char path[1400], name[64];
        const char *e = getenv("KVQ_MODEL_DIR");
        snprintf(name, sizeof name, "%.60s", line);
        snprintf(path, sizeof path, "%s/texts/tokenizer/%s", e ? e : KVQ_SOURCE_ROOT "/../shared/data", name);
        FILE *f = fopen(path, "rb");
        ck_assert_msg(f, "%s: cannot open", path);
        size_t n = fread(text, 1, sizeof text, f);
        fclose(f);
        int *want = malloc(sizeof(int) * (strlen(tab + 1) / 2 + 2)), nw = 0;
        for (char *p = strtok(tab + 1, " \n"); p; p = strtok(NULL, " \n")) want[nw++] = atoi(p);
        int *ids;
        size_t k;
        kvq_error err = {0};
        ck_assert_msg(kvq_model_tokenize(m, text, n, &ids, &k, &err) == KVQ_OK, "%s %s: %s", arch, line, err.msg);
        size_t i = 0;
        while (i < k && i < (size_t)nw && ids[i] == want[i]) i++;
        ck_assert_msg(i == k && k == (size_t)nw, "%s %s: token %zu: kvq %d, llama.cpp %d (%zu and %d tokens)", arch,
                      line, i, i < k ? ids[i] : -1, i < (size_t)nw ? want[i] : -1, k, nw);
        /* streamed, read 7 and 61 bytes at a time: the same ids, and with max_tokens their prefix */
        for (size_t bs = 7; bs < 100; bs += 54) {
            int *sid;
            size_t sn;
            ck_assert_msg(kvq_tokenize_file_blocks(m, path, 0, bs, &sid, &sn, &err) == KVQ_OK, "%s", err.msg);
            ck_assert_msg(sn == k && !memcmp(sid, ids, k * sizeof *ids), "%s %s: streamed in %zu-byte blocks differs",
                          arch, name, bs);
            free(sid);
            ck_assert(kvq_tokenize_file_blocks(m, path, 5, bs, &sid, &sn, &err) == KVQ_OK);
            ck_assert(sn >= (k < 5 ? k : 5) && sn <= k && !memcmp(sid, ids, sn * sizeof *ids));
            free(sid);
        }
        free(ids), free(want);
        ntexts++;
    }
    fclose(tsv);
    ck_assert_int_eq(ntexts, 15);
    kvq_model_close(m);
}
END_TEST

/* ------------------------------------------------ thread independence */

static void eval_at(kvq_model *m, const int *tok, int T, kvq_eval_item *items, int n, int threads, int stride,
                    double *nll, float *logits, int *pos, int npos)
{
    kvq_eval_opts o = {.nthreads = threads, .stride = stride, .logit_pos = pos, .n_logit_pos = npos, .logits = logits};
    kvq_error err = {0};
    ck_assert_msg(kvq_model_eval(m, tok, T, items, n, &o, nll, &err) == KVQ_OK, "%s", err.msg);
}

static int same_bits(double a, double b) { return !memcmp(&a, &b, sizeof a); }

START_TEST(test_threads)
{
    const char *arch = _i ? "gemma3" : "llama3";
    golden g;
    kvq_model *m = open_case("test_threads", arch, &g);
    if (!m) return;
    const kvq_model_info *in = kvq_model_get_info(m);
    const char *specs[] = {"per-token:bits=4", "kivi:bits=2", "lloydmax:bits=2"};
    kvq_spec sp[3];
    kvq_error err = {0};
    for (int i = 0; i < 3; i++) ck_assert_msg(kvq_spec_parse(specs[i], &sp[i], &err) == KVQ_OK, "%s", err.msg);
    kvq_eval_item ref[4], it[4];
    double nll_ref, nll;
    size_t nl = (size_t)GPOS * in->vocab_size;
    float *l1 = malloc(nl * sizeof *l1), *l2 = malloc(nl * sizeof *l2);
    for (int i = 0; i < 3; i++) ref[i] = (kvq_eval_item){.spec = &sp[i], .layer = -1};
    ref[3] = (kvq_eval_item){.spec = &sp[0], .layer = 1};
    eval_at(m, g.tokens, GT, ref, 4, 1, 0, &nll_ref, l1, g.pos, GPOS);
    for (int nt = 2; nt <= 3; nt++) {
        memcpy(it, ref, sizeof it);
        eval_at(m, g.tokens, GT, it, 4, nt, 0, &nll, l2, g.pos, GPOS);
        ck_assert_msg(same_bits(nll, nll_ref), "%s: exact NLL at %d threads %.17g, at 1 %.17g", arch, nt, nll, nll_ref);
        ck_assert_msg(!memcmp(l1, l2, nl * sizeof *l1), "%s: logits differ between 1 and %d threads", arch, nt);
        for (int i = 0; i < 4; i++)
            ck_assert_msg(same_bits(it[i].nll, ref[i].nll) && same_bits(it[i].kl, ref[i].kl) &&
                              same_bits(it[i].top1, ref[i].top1) && same_bits(it[i].k_bits, ref[i].k_bits),
                          "%s: %s (layer %d) at %d threads: nll %.17g kl %.17g, at 1: %.17g %.17g", arch, specs[i % 3],
                          it[i].layer, nt, it[i].nll, it[i].kl, ref[i].nll, ref[i].kl);
    }
    /* the dump's tensors and mean NLL */
    char out[3][40];
    double dn[3];
    for (int k = 0; k < 3; k++) {
        snprintf(out[k], sizeof out[k], "/tmp/kvq-archs-XXXXXX.h5");
        close(mkstemps(out[k], 3));
        ck_assert_msg(kvq_model_dump(m, g.tokens, GT, NULL, 0, out[k], k + 1, &dn[k], &err) == KVQ_OK, "%s", err.msg);
    }
    ck_assert(same_bits(dn[0], dn[1]) && same_bits(dn[0], dn[2]));
    kvq_dump *d[3];
    for (int k = 0; k < 3; k++) ck_assert_msg(kvq_dump_open(out[k], &d[k], &err) == KVQ_OK, "%s", err.msg);
    for (int l = 0; l < in->n_layers; l++) {
        kvq_layer x[3];
        unsigned fl = KVQ_READ_QUERY | KVQ_READ_KEY_PRE_ROPE;
        for (int k = 0; k < 3; k++) ck_assert(kvq_dump_read_layer(d[k], l, fl, &x[k], &err) == KVQ_OK);
        size_t nk = (size_t)x[0].H * x[0].T * x[0].D, nq = (size_t)x[0].Hq * x[0].T * x[0].D;
        ck_assert(x[0].query != NULL);
        for (int k = 1; k < 3; k++)
            ck_assert_msg(!memcmp(x[0].key, x[k].key, nk * 4) && !memcmp(x[0].value, x[k].value, nk * 4) &&
                              !memcmp(x[0].query, x[k].query, nq * 4) &&
                              !memcmp(x[0].key_pre_rope, x[k].key_pre_rope, nk * 4),
                          "%s: dump layer %d differs between 1 and %d threads", arch, l, k + 1);
        for (int k = 0; k < 3; k++) kvq_layer_free(&x[k]);
    }
    for (int k = 0; k < 3; k++) kvq_dump_close(d[k]), unlink(out[k]);
    free(l1), free(l2), free(g.logits);
    kvq_model_close(m);
}
END_TEST

/* ------------------------------------------------- prefill == decode */

START_TEST(test_prefill_equals_decode)
{
    const char *arch = _i ? "gemma3" : "llama3";
    golden g;
    kvq_model *m = open_case("test_prefill_equals_decode", arch, &g);
    if (!m) return;
    const char *specs[] = {
        "per-token:bits=4",  "fp8:scale=token", "fp8:scale=none", "ggml", "ggml:ktype=q4_0,vtype=iq4_nl",
        "per-channel:bits=2"};
    enum { NS = 6 };
    kvq_spec sp[NS];
    kvq_error err = {0};
    kvq_eval_item it[3 * NS];
    for (int i = 0; i < NS; i++) {
        ck_assert_msg(kvq_spec_parse(specs[i], &sp[i], &err) == KVQ_OK, "%s", err.msg);
        for (int p = 0; p < 3; p++)
            it[3 * i + p] =
                (kvq_eval_item){.spec = &sp[i], .layer = -1, .policy = p ? KVQ_POLICY_DECODE : KVQ_POLICY_PREFILL};
    }
    double nll;
    int T = 100; /* past gemma3's window of 64 */
    /* decode at stride 1 (items 3i+1) and at stride 7 (3i+2, a second run) */
    eval_at(m, g.tokens, T, it, 3 * NS, 2, 1, &nll, NULL, NULL, 0);
    kvq_eval_item s7[NS];
    for (int i = 0; i < NS; i++) s7[i] = it[3 * i + 2];
    eval_at(m, g.tokens, T, s7, NS, 2, 7, &nll, NULL, NULL, 0);
    for (int i = 0; i < NS; i++) {
        const kvq_eval_item *pf = &it[3 * i], *dc = &it[3 * i + 1], *d7 = &s7[i];
        int stateless = i < NS - 1; /* per-channel groups span tokens: decode differs */
        fprintf(stderr, "%s %-30s dnll prefill %.6f decode %.6f decode/7 %.6f\n", arch, specs[i], pf->nll - nll,
                dc->nll - nll, d7->nll - nll);
        if (stateless)
            ck_assert_msg(same_bits(pf->nll, dc->nll) && same_bits(pf->kl, dc->kl) && same_bits(pf->top1, dc->top1) &&
                              same_bits(pf->nll, d7->nll) && same_bits(pf->kl, d7->kl),
                          "%s %s: prefill nll %.17g kl %.17g, decode %.17g %.17g, decode/7 %.17g", arch, specs[i],
                          pf->nll, pf->kl, dc->nll, dc->kl, d7->nll);
        else /* the check can fail: the policies do differ for a quantizer that groups tokens */
            ck_assert_msg(!same_bits(pf->nll, dc->nll), "%s %s: decode equals prefill", arch, specs[i]);
    }
    free(g.logits);
    kvq_model_close(m);
}
END_TEST

int main(void)
{
    Suite *s = suite_create("archs");
    TCase *tc = tcase_create("archs");
    tcase_set_timeout(tc, 600);
    tcase_add_loop_test(tc, test_against_llama_cpp, 0, NARCH);
    tcase_add_loop_test(tc, test_tokenizer_matches_llama_cpp, 0, NARCH);
    tcase_add_loop_test(tc, test_threads, 0, 2);
    tcase_add_loop_test(tc, test_prefill_equals_decode, 0, 2);
    suite_add_tcase(s, tc);
    return run_suite(s);
}

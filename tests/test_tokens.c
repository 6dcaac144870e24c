/* test_tokens.c — tokens(SELECT; HI; LO) (docs/quantizers.md#tokens, SPEC §3.11):
 * keep=1 is the spec itself (bits and outputs, no mask); window keeps
 * exactly its sinks and recent tokens; every selector's ranking on a
 * 6-token head worked by hand (uniform attention, ties to the later token);
 * the dgemm scores against plain loops (GQA, sliding window, soft-cap);
 * HI and LO equal the spec on the compacted sequence (kivi's groups and
 * residual of that sequence); bits by hand; the masked attention metrics
 * (attn_mass, attn_kl over the kept keys) by hand and fast against the
 * reference; AdaKV's head-adaptive budgets against the definition; thread
 * independence; the refusals. */
#include "testutil.h"

/* A layer of H KV heads, Hq query heads, T tokens, D channels: normal data
 * from seed (queries too). */
static void make_layer(kvq_layer *L, int H, int Hq, int T, int D, uint64_t seed)
{
    kvq_error err;
    ck_assert_int_eq(kvq_layer_alloc(L, H, Hq, T, D, KVQ_READ_QUERY, &err), KVQ_OK);
    fill_normal(L->key, (size_t)H * T * D, seed, 1.0);
    fill_normal(L->value, (size_t)H * T * D, seed + 1, 1.0);
    fill_normal(L->query, (size_t)Hq * T * D, seed + 2, 1.0);
}

typedef struct run_out {
    float *k, *v;
    double kb[8], vb[8], sb[8];
    unsigned char *keep;
    int dropped;
} run_out;

static kvq_status run_spec(const char *text, const kvq_layer *L, int threads, run_out *r, kvq_error *err)
{
    kvq_spec sp;
    kvq_status st = kvq_spec_parse(text, &sp, err);
    if (st) return st;
    size_t n = (size_t)L->H * L->T * L->D;
    r->k = calloc(n, sizeof(float)), r->v = calloc(n, sizeof(float));
    r->keep = malloc((size_t)L->H * L->T);
    memset(r->sb, 0, sizeof r->sb);
    kvq_dump_info info = {.num_kv_heads = L->H, .num_heads = L->Hq, .head_dim = L->D, .seq_len = L->T};
    kvq_quant_ctx ctx = {.info = &info, .layer = 2, .seed = 5, .nthreads = threads};
    kvq_quant_out out = {.key = r->k, .value = r->v, .k_bits = r->kb, .v_bits = r->vb, .static_bytes = r->sb,
                         .keep = r->keep};
    st = kvq_quantize_layer(&sp, &ctx, L, &out, err);
    r->dropped = out.dropped;
    return st;
}

static void run_free(run_out *r) { free(r->k), free(r->v), free(r->keep); }

START_TEST(tokens_keep_all_is_the_spec)
{
    enum { H = 2, Hq = 4, T = 48, D = 8 };
    kvq_layer L;
    make_layer(&L, H, Hq, T, D, 3);
    const char *specs[] = {"kivi:bits=2", "per-token:bits=3,group=4", "per-channel:bits=4", "lloydmax:bits=3",
                           "turboquant:bits=3", "fp8", "gear:bits=4", "tender", "absmax:bits=4"};
    const char *sels[] = {"h2o:keep=1", "snapkv:keep=1,obs=8", "knorm:keep=1", "random:keep=1",
                          "window:sinks=40,recent=8"};
    for (size_t s = 0; s < sizeof specs / sizeof specs[0]; s++)
        for (size_t k = 0; k < sizeof sels / sizeof sels[0]; k++)
            for (int lo = 0; lo < 2; lo++) {
                char text[256];
                snprintf(text, sizeof text, "tokens(%s; %s; %s)", sels[k], specs[s], lo ? "drop" : "kivi:bits=2");
                run_out a, b;
                kvq_error err = {0};
                ck_assert_msg(run_spec(specs[s], &L, 2, &a, &err) == KVQ_OK, "%s", err.msg);
                ck_assert_msg(run_spec(text, &L, 2, &b, &err) == KVQ_OK, "%s: %s", text, err.msg);
                size_t n = (size_t)H * T * D * sizeof(float);
                ck_assert_msg(!memcmp(a.k, b.k, n) && !memcmp(a.v, b.v, n), "%s: K', V' differ", text);
                for (int h = 0; h < H; h++) /* no mask, no positions: the bits are the spec's own */
                    ck_assert_msg(a.kb[h] == b.kb[h] && a.vb[h] == b.vb[h] && a.sb[h] == b.sb[h], "%s: bits", text);
                ck_assert(!b.dropped);
                for (int i = 0; i < H * T; i++) ck_assert(b.keep[i] == 1);
                run_free(&a), run_free(&b);
            }
    kvq_layer_free(&L);
}
END_TEST

START_TEST(tokens_window_keeps_sinks_and_recent)
{
    enum { H = 2, T = 20, D = 4 };
    kvq_layer L;
    make_layer(&L, H, H, T, D, 4);
    run_out r;
    kvq_error err = {0};
    ck_assert_msg(run_spec("tokens(window:sinks=3,recent=5; none; drop)", &L, 1, &r, &err) == KVQ_OK, "%s", err.msg);
    ck_assert(r.dropped);
    for (int h = 0; h < H; h++)
        for (int t = 0; t < T; t++) {
            int kept = t < 3 || t >= T - 5;
            ck_assert_int_eq(r.keep[h * T + t], kept);
            for (int c = 0; c < D; c++) {
                size_t i = ((size_t)h * T + t) * D + c;
                ck_assert(r.k[i] == (kept ? L.key[i] : 0.0f) && r.v[i] == (kept ? L.value[i] : 0.0f));
            }
        }
    /* bits by hand: 8 kept tokens at 16 bits, 32 bits of position each, shared by K and V */
    double want = (16.0 * 8 * D + 32.0 * 8 / 2) / (T * D);
    for (int h = 0; h < H; h++) ck_assert(r.kb[h] / (T * D) == want && r.vb[h] / (T * D) == want);
    run_free(&r);
    /* both stored: one mask bit per token, no positions */
    ck_assert_msg(run_spec("tokens(window:sinks=3,recent=5; none; none)", &L, 1, &r, &err) == KVQ_OK, "%s", err.msg);
    ck_assert(!r.dropped);
    for (int h = 0; h < H; h++) ck_assert(r.kb[h] == 16.0 * T * D + T / 2.0);
    run_free(&r);
    kvq_layer_free(&L);
}
END_TEST

/* The selection of spec on L: keep [H][T] and scores. */
static void select_of(const char *text, const kvq_layer *L, const kvq_attn_mode *mode, int threads,
                      unsigned char *keep, double *score)
{
    kvq_spec sp;
    const kvq_tokens_parts *tp;
    kvq_error err = {0};
    ck_assert_msg(kvq_spec_parse(text, &sp, &err) == KVQ_OK, "%s", err.msg);
    ck_assert_int_eq(kvq_tokens_parts_of(&sp, &tp, &err), KVQ_OK);
    ck_assert_msg(kvq_tokens_select(tp, L, mode, 9, 1, threads, keep, score, &err) == KVQ_OK, "%s", err.msg);
}

static void expect_kept(const char *text, const kvq_layer *L, const char *want)
{
    unsigned char keep[64];
    double score[64];
    select_of(text, L, NULL, 1, keep, score);
    char got[64];
    for (int t = 0; t < L->T; t++) got[t] = keep[t] ? '1' : '0';
    got[L->T] = '\0';
    ck_assert_msg(!strcmp(got, want), "%s: kept %s, expected %s", text, got, want);
}

START_TEST(tokens_rankings_by_hand)
{
    /* one KV head of 6 tokens, two query heads, zero queries: every row's
     * attention is uniform, A[t][u] = 1/(t+1) */
    enum { T = 6, D = 2 };
    kvq_layer L;
    make_layer(&L, 1, 2, T, D, 6);
    memset(L.query, 0, 2 * T * D * sizeof(float));
    unsigned char keep[T];
    double sc[T];
    /* h2o: Σ_{t>=u} 1/(t+1), falling with u */
    select_of("tokens(h2o:keep=0.5; none; drop)", &L, NULL, 1, keep, sc);
    double h2o[T];
    for (int u = 0; u < T; u++) {
        h2o[u] = 0;
        for (int t = u; t < T; t++) h2o[u] += 1.0 / (t + 1);
        ck_assert_msg(close_rel(sc[u], h2o[u], 1e-14, 0), "h2o[%d] = %.17g, expected %.17g", u, sc[u], h2o[u]);
    }
    expect_kept("tokens(h2o:keep=0.5; none; drop)", &L, "111000");
    expect_kept("tokens(h2o:keep=0.5,recent=1; none; drop)", &L, "110001");
    expect_kept("tokens(h2o:keep=0.2,sinks=1,recent=2; none; drop)", &L, "100011"); /* forced win over K = 1 */
    /* zipcache: the h2o sum over the T − u queries that see u */
    select_of("tokens(zipcache:keep=0.5; none; drop)", &L, NULL, 1, keep, sc);
    for (int u = 0; u < T; u++) ck_assert(close_rel(sc[u], h2o[u] / (T - u), 1e-14, 0));
    expect_kept("tokens(zipcache:keep=0.5; none; drop)", &L, "111000");
    /* snapkv obs=2 pool=3: u < 4 get (1/5 + 1/6)/2 = 11/60, pooled with
     * zero padding: 22/180, 33/180, 33/180, 22/180; the last 2 always kept;
     * the tie of u = 1, 2 goes to the later token */
    select_of("tokens(snapkv:keep=0.5,obs=2,pool=3; none; drop)", &L, NULL, 1, keep, sc);
    double snap[4] = {22.0 / 180, 33.0 / 180, 33.0 / 180, 22.0 / 180};
    for (int u = 0; u < 4; u++) ck_assert_msg(close_rel(sc[u], snap[u], 1e-14, 0), "snapkv[%d] = %.17g", u, sc[u]);
    ck_assert(isnan(sc[4]) && isnan(sc[5]));
    expect_kept("tokens(snapkv:keep=0.5,obs=2,pool=3; none; drop)", &L, "001011");
    /* tova: A[5][u] = 1/6 for every u < 5, all tied: the later tokens */
    select_of("tokens(tova:keep=0.5; none; drop)", &L, NULL, 1, keep, sc);
    for (int u = 0; u < 5; u++) ck_assert(close_rel(sc[u], 1.0 / 6, 1e-14, 0));
    expect_kept("tokens(tova:keep=0.5; none; drop)", &L, "000111");
    /* knorm: norms 1, 2, 1, 3, 2, 1 — the lowest first, ties to the later */
    float norms[T] = {1, 2, 1, 3, 2, 1};
    for (int u = 0; u < T; u++) L.key[u * D] = norms[u], L.key[u * D + 1] = 0;
    expect_kept("tokens(knorm:keep=0.5; none; drop)", &L, "101001");
    expect_kept("tokens(knorm:keep=0.34; none; drop)", &L, "001001"); /* K = round(2.04) = 2 */
    expect_kept("tokens(knorm:keep=0.67; none; drop)", &L, "101011"); /* K = 4: norm 2 at u = 4 before u = 1 */
    /* keydiff: keys (1,0) x3, (0,1), (1,1), (-1,0): the anchor is their normalised mean
     * (2 + 1/sqrt2, 1 + 1/sqrt2)/6 and the score -cos(k, anchor); the least typical first,
     * (-1,0) then (0,1), then the (1,0)s, the later first; (1,1) last */
    float kd[T][2] = {{1, 0}, {1, 0}, {1, 0}, {0, 1}, {1, 1}, {-1, 0}};
    for (int u = 0; u < T; u++) L.key[u * D] = kd[u][0], L.key[u * D + 1] = kd[u][1];
    select_of("tokens(keydiff:keep=0.5; none; drop)", &L, NULL, 1, keep, sc);
    double ax = (3 + sqrt(0.5) - 1) / 6.0, ay = (1 + sqrt(0.5)) / 6.0, an = sqrt(ax * ax + ay * ay);
    ck_assert_msg(close_rel(sc[5], ax / an, 1e-14, 0) && close_rel(sc[3], -ay / an, 1e-14, 0) &&
                      close_rel(sc[0], -ax / an, 1e-14, 0) && close_rel(sc[4], -(ax + ay) / sqrt(2) / an, 1e-14, 0),
                  "keydiff: %.17g %.17g %.17g %.17g", sc[5], sc[3], sc[0], sc[4]);
    expect_kept("tokens(keydiff:keep=0.5; none; drop)", &L, "001101");
    expect_kept("tokens(keydiff:keep=0.84; none; drop)", &L, "111101"); /* K = 5: (1,1) is the one left */
    /* window: keep is ignored */
    expect_kept("tokens(window:keep=0.9,sinks=1,recent=1; none; drop)", &L, "100001");
    /* random: the seeded stream of (seed, layer, head), K tokens */
    unsigned char k1[T], k2[T];
    select_of("tokens(random:keep=0.5; none; drop)", &L, NULL, 1, k1, sc);
    kvq_rng r;
    const kvq_quantizer *rnd = NULL; /* the random selector's row names its stream */
    for (size_t i = 0; i < kvq_selector_count(); i++)
        if (!strcmp(kvq_selector_at(i)->name, "random")) rnd = kvq_selector_at(i);
    ck_assert(rnd && rnd->nstreams == 1);
    kvq_rng_init(&r, 9, 1, 0, kvq_family_stream(rnd, 0));
    for (int u = 0; u < T; u++) ck_assert(sc[u] == kvq_rng_uniform(&r));
    select_of("tokens(random:keep=0.5; none; drop)", &L, NULL, 2, k2, sc);
    ck_assert(!memcmp(k1, k2, T) && k1[0] + k1[1] + k1[2] + k1[3] + k1[4] + k1[5] == 3);
    kvq_layer_free(&L);
}
END_TEST

/* Plain scores of one KV head: the mean over its G query heads of
 * Σ_t∈rows A[t][u], A as kvq's double softmax in `mode`. */
static void plain_columns(const kvq_layer *L, int h, int r0, const kvq_attn_mode *m, double *col)
{
    int T = L->T, D = L->D, G = L->Hq / L->H;
    memset(col, 0, (size_t)T * sizeof *col);
    double *s = malloc((size_t)T * sizeof *s);
    for (int j = h * G; j < (h + 1) * G; j++)
        for (int t = r0; t < T; t++) {
            int lo = m->window > 0 && t - m->window + 1 > 0 ? t - m->window + 1 : 0;
            double mx = -INFINITY, sum = 0;
            for (int u = lo; u <= t; u++) {
                double dot = 0;
                for (int c = 0; c < D; c++)
                    dot += (double)L->query[((size_t)j * T + t) * D + c] * L->key[((size_t)h * T + u) * D + c];
                double x = m->scale * dot;
                s[u] = m->softcap > 0 ? m->softcap * tanh(x / m->softcap) : x;
                mx = s[u] > mx ? s[u] : mx;
            }
            for (int u = lo; u <= t; u++) sum += s[u] = exp(s[u] - mx);
            for (int u = lo; u <= t; u++) col[u] += s[u] / sum / G;
        }
    free(s);
}

START_TEST(tokens_scores_against_plain_loops)
{
    enum { H = 2, Hq = 6, T = 150, D = 16 };
    kvq_layer L;
    make_layer(&L, H, Hq, T, D, 8);
    kvq_attn_mode modes[] = {{.scale = 0.25f}, {.scale = 0.3f, .softcap = 2.0f, .window = 40}};
    static unsigned char k1[H * T], k2[H * T];
    static double sc[H * T], sc2[H * T], col[T];
    for (int mi = 0; mi < 2; mi++) {
        select_of("tokens(h2o:keep=0.3; none; drop)", &L, &modes[mi], 1, k1, sc);
        select_of("tokens(h2o:keep=0.3; none; drop)", &L, &modes[mi], 2, k2, sc2);
        ck_assert(!memcmp(k1, k2, sizeof k1) && !memcmp(sc, sc2, sizeof sc)); /* threads */
        for (int h = 0; h < H; h++) {
            plain_columns(&L, h, 0, &modes[mi], col);
            for (int u = 0; u < T; u++)
                ck_assert_msg(close_rel(sc[h * T + u], col[u], 1e-12, 1e-12), "mode %d head %d u %d: %.17g vs %.17g",
                              mi, h, u, sc[h * T + u], col[u]);
            int n = 0;
            for (int u = 0; u < T; u++) n += k1[h * T + u];
            ck_assert_int_eq(n, 45); /* round(0.3 · 150) */
        }
    }
    kvq_layer_free(&L);
}
END_TEST

START_TEST(tokens_parts_on_the_compacted_sequence)
{
    /* HI and LO are the spec on a layer of just their tokens, in position
     * order: kivi's per-channel groups and residual window of that sequence */
    enum { H = 2, T = 40, D = 8 };
    kvq_layer L;
    make_layer(&L, H, H, T, D, 12);
    run_out r, a, b;
    kvq_error err = {0};
    const char *kivi = "kivi:bits=2,group=4,residual=4";
    char text[256];
    snprintf(text, sizeof text, "tokens(window:sinks=6,recent=6; %s; %s)", kivi, kivi);
    ck_assert_msg(run_spec(text, &L, 2, &r, &err) == KVQ_OK, "%s", err.msg);
    kvq_layer hi, lo;
    ck_assert_int_eq(kvq_layer_alloc(&hi, H, H, 12, D, 0, &err), KVQ_OK);
    ck_assert_int_eq(kvq_layer_alloc(&lo, H, H, T - 12, D, 0, &err), KVQ_OK);
    for (int h = 0; h < H; h++)
        for (int t = 0, i = 0, j = 0; t < T; t++) {
            int kept = t < 6 || t >= T - 6;
            kvq_layer *P = kept ? &hi : &lo;
            int at = kept ? i++ : j++;
            memcpy(P->key + ((size_t)h * P->T + at) * D, L.key + ((size_t)h * T + t) * D, D * sizeof(float));
            memcpy(P->value + ((size_t)h * P->T + at) * D, L.value + ((size_t)h * T + t) * D, D * sizeof(float));
        }
    ck_assert_int_eq(run_spec(kivi, &hi, 1, &a, &err), KVQ_OK);
    ck_assert_int_eq(run_spec(kivi, &lo, 1, &b, &err), KVQ_OK);
    for (int h = 0; h < H; h++) {
        for (int t = 0, i = 0, j = 0; t < T; t++) {
            int kept = t < 6 || t >= T - 6;
            const run_out *P = kept ? &a : &b;
            int at = kept ? i++ : j++, n = kept ? 12 : T - 12;
            ck_assert(!memcmp(r.k + ((size_t)h * T + t) * D, P->k + ((size_t)h * n + at) * D, D * sizeof(float)));
            ck_assert(!memcmp(r.v + ((size_t)h * T + t) * D, P->v + ((size_t)h * n + at) * D, D * sizeof(float)));
        }
        ck_assert(r.kb[h] == a.kb[h] + b.kb[h] + T / 2.0); /* + the mask, half on K */
        ck_assert(r.vb[h] == a.vb[h] + b.vb[h] + T / 2.0);
    }
    run_free(&r), run_free(&a), run_free(&b);
    kvq_layer_free(&hi), kvq_layer_free(&lo), kvq_layer_free(&L);
}
END_TEST

/* AdaKV (SPEC §3.11, round 2): α = 1 is the per-head selection; otherwise
 * each head keeps its top floor(α·K) and the layer's other H·K − Σ places
 * go to the best scores of all heads (ties: lower head, then lower token),
 * checked against a plain loop over the scores; the mean bits over heads
 * are the per-head budget's, the counts differ; HI and LO run per head as
 * one-head layers; the selection is thread-independent. */
START_TEST(tokens_adaptive_budgets)
{
    enum { H = 4, Hq = 8, T = 40, D = 8, K = 10 };
    kvq_layer L;
    make_layer(&L, H, Hq, T, D, 21);
    for (int t = 0; t < T; t++) /* head 3's keys loud, head 0's quiet: knorm keeps more of head 0 */
        for (int c = 0; c < D; c++) L.key[((size_t)3 * T + t) * D + c] *= 3, L.key[(size_t)t * D + c] *= 0.2f;
    unsigned char per[H * T], one[H * T], ada[H * T], ada4[H * T];
    double sc[H * T];
    select_of("tokens(knorm:keep=0.25; none; drop)", &L, NULL, 1, per, sc);
    select_of("tokens(knorm:keep=0.25,adaptive=1; none; drop)", &L, NULL, 1, one, NULL);
    ck_assert(!memcmp(per, one, sizeof per));
    for (int ai = 0; ai < 3; ai++) {
        double alpha = ai == 0 ? 0.0 : ai == 1 ? 0.2 : 0.5;
        char text[128];
        snprintf(text, sizeof text, "tokens(knorm:keep=0.25,adaptive=%g,sinks=1; none; drop)", alpha);
        select_of(text, &L, NULL, 1, ada, NULL);
        select_of(text, &L, NULL, 4, ada4, NULL);
        ck_assert(!memcmp(ada, ada4, sizeof ada));
        /* the plain definition */
        unsigned char want[H * T] = {0};
        int own = (int)floor(alpha * K), total = 0;
        for (int h = 0; h < H; h++) {
            want[h * T] = 1; /* the sink */
            for (int i = 1; i < own; i++) { /* the head's best, ties to the later token */
                int best = -1;
                for (int u = 0; u < T; u++)
                    if (!want[h * T + u] && (best < 0 || sc[h * T + u] >= sc[h * T + best])) best = u;
                want[h * T + best] = 1;
            }
        }
        for (int h = 0; h < H; h++)
            for (int u = 0; u < T; u++) total += want[h * T + u];
        while (total < H * K) { /* the layer's places: best score, lower head, lower token */
            int bh = -1, bu = -1;
            for (int h = 0; h < H; h++)
                for (int u = 0; u < T; u++)
                    if (!want[h * T + u] && (bh < 0 || sc[h * T + u] > sc[bh * T + bu])) bh = h, bu = u;
            want[bh * T + bu] = 1, total++;
        }
        ck_assert_msg(!memcmp(ada, want, sizeof ada), "%s: not the definition's selection", text);
        int n0 = 0, n3 = 0;
        for (int u = 0; u < T; u++) n0 += ada[u], n3 += ada[3 * T + u];
        ck_assert_msg(n0 > K && n3 < K, "%s: heads 0 and 3 keep %d and %d of %d", text, n0, n3, K);
        /* bits: each head its own positions; the mean is the per-head budget's */
        run_out r, p;
        kvq_error err = {0};
        ck_assert_msg(run_spec(text, &L, 2, &r, &err) == KVQ_OK, "%s", err.msg);
        ck_assert_msg(run_spec("tokens(knorm:keep=0.25,sinks=1; none; drop)", &L, 2, &p, &err) == KVQ_OK, "%s",
                      err.msg);
        double mean = 0, pmean = 0;
        for (int h = 0; h < H; h++) {
            int n = 0;
            for (int u = 0; u < T; u++) n += ada[h * T + u];
            ck_assert(r.kb[h] == 16.0 * n * D + 16.0 * n && r.vb[h] == r.kb[h]);
            mean += r.kb[h] / H, pmean += p.kb[h] / H;
        }
        ck_assert_msg(fabs(mean - pmean) < 1e-9, "%s: mean bits %g, per-head budget %g", text, mean, pmean);
        run_free(&r), run_free(&p);
    }
    /* ragged counts: HI and LO are the spec on each head's tokens as a one-head layer */
    const char *kivi = "kivi:bits=2,group=4,residual=4";
    char text[256];
    snprintf(text, sizeof text, "tokens(knorm:keep=0.25,adaptive=0.2; %s; per-token:bits=3)", kivi);
    select_of(text, &L, NULL, 1, ada, NULL);
    run_out r;
    kvq_error err = {0};
    ck_assert_msg(run_spec(text, &L, 3, &r, &err) == KVQ_OK, "%s", err.msg);
    for (int h = 0; h < H; h++) {
        int n = 0;
        for (int u = 0; u < T; u++) n += ada[h * T + u];
        for (int part = 0; part < 2; part++) {
            int m = part ? T - n : n, i = 0;
            kvq_layer P;
            ck_assert_int_eq(kvq_layer_alloc(&P, 1, Hq / H, m, D, 0, &err), KVQ_OK);
            for (int u = 0; u < T; u++)
                if (ada[h * T + u] == !part) {
                    memcpy(P.key + (size_t)i * D, L.key + ((size_t)h * T + u) * D, D * sizeof(float));
                    memcpy(P.value + (size_t)i++ * D, L.value + ((size_t)h * T + u) * D, D * sizeof(float));
                }
            run_out a;
            ck_assert_int_eq(run_spec(part ? "per-token:bits=3" : kivi, &P, 1, &a, &err), KVQ_OK);
            i = 0;
            for (int u = 0; u < T; u++)
                if (ada[h * T + u] == !part) {
                    ck_assert(!memcmp(r.k + ((size_t)h * T + u) * D, a.k + (size_t)i * D, D * sizeof(float)));
                    ck_assert(!memcmp(r.v + ((size_t)h * T + u) * D, a.v + (size_t)i++ * D, D * sizeof(float)));
                }
            run_free(&a), kvq_layer_free(&P);
        }
    }
    run_free(&r);
    kvq_layer_free(&L);
}
END_TEST

START_TEST(tokens_masked_attention_metrics)
{
    /* by hand: zero queries, uniform attention; the row at t = 3 keeps keys
     * 0 and 2 of 4: attn_mass = 1/2; with exact kept keys attn_kl = 0 and
     * the arg-max (key 0, the first of equals) is kept */
    enum { T = 4, D = 2 };
    float Q[T * D] = {0}, K[T * D], V[T * D], Kq[T * D], Vq[T * D];
    fill_normal(K, T * D, 1, 1.0), fill_normal(V, T * D, 2, 1.0);
    unsigned char keep[T] = {1, 0, 1, 0};
    for (int i = 0; i < T * D; i++) Kq[i] = keep[i / D] ? K[i] : 0, Vq[i] = keep[i / D] ? V[i] : 0;
    const float *kq[] = {Kq}, *vq[] = {Vq};
    const unsigned char *mq[] = {keep};
    int pos[] = {3};
    kvq_attn_acc fast = {0}, ref = {0};
    kvq_error err = {0};
    kvq_attn_mode plain = {0};
    float rows[D] = {0};
    ck_assert_int_eq(kvq_attention_rows_masked(rows, 1, K, V, T, D, plain, pos, 1, 1, kq, vq, mq, &fast, &err), KVQ_OK);
    ck_assert_int_eq(kvq_attention_head_ref_masked(Q, 1, K, V, T, D, plain, pos, 1, 1, kq, vq, mq, &ref, &err),
                     KVQ_OK);
    ck_assert(fast.rows == 1 && close_rel(fast.mass_sum, 0.5, 1e-7, 0) && fast.kl_sum == 0 && fast.top1_same == 1);
    ck_assert(ref.rows == 1 && close_rel(ref.mass_sum, 0.5, 1e-7, 0) && ref.kl_sum == 0 && ref.top1_same == 1);
    /* attn_rel: A = 1/4 everywhere, A' = 1/2 on the kept keys */
    ck_assert(close_rel(fast.a_diff2, 4 * 0.0625, 1e-6, 0) && close_rel(fast.a_ref2, 4 * 0.0625, 1e-6, 0));
    /* a row that keeps no key: no attention, mass 0, arg-max changed */
    unsigned char none[T] = {0, 0, 0, 0};
    const unsigned char *mn[] = {none};
    kvq_attn_acc z = {0};
    ck_assert_int_eq(kvq_attention_rows_masked(rows, 1, K, V, T, D, plain, pos, 1, 1, kq, vq, mn, &z, &err), KVQ_OK);
    ck_assert(z.mass_sum == 0 && z.top1_same == 0 && z.kl_sum == 0);

    /* fast against the reference on random data, several queries, GQA, a mode */
    enum { G = 2, T2 = 90, D2 = 8 };
    static float q2[G * T2 * D2], k2[T2 * D2], v2[T2 * D2], k2q[T2 * D2], v2q[T2 * D2];
    static unsigned char m2[T2];
    fill_normal(q2, G * T2 * D2, 3, 1.0), fill_normal(k2, T2 * D2, 4, 1.0), fill_normal(v2, T2 * D2, 5, 1.0);
    fill_normal(k2q, T2 * D2, 6, 0.1), fill_normal(v2q, T2 * D2, 7, 0.1);
    for (int t = 0; t < T2; t++) {
        m2[t] = t % 3 != 1;
        for (int c = 0; c < D2; c++) {
            k2q[t * D2 + c] = m2[t] ? k2[t * D2 + c] + k2q[t * D2 + c] : 0;
            v2q[t * D2 + c] = m2[t] ? v2[t * D2 + c] + v2q[t * D2 + c] : 0;
        }
    }
    int p2[] = {0, 1, 5, 40, 77, 89};
    kvq_attn_mode modes[] = {{0}, {.scale = 0.3f, .softcap = 3.0f, .window = 20}};
    for (int mi = 0; mi < 2; mi++) {
        const float *kk[] = {k2q}, *vv[] = {v2q};
        const unsigned char *mm[] = {m2};
        kvq_attn_acc f = {0}, r = {0};
        float *qr = malloc(sizeof(float) * G * 6 * D2);
        for (int j = 0; j < G; j++)
            for (int i = 0; i < 6; i++) memcpy(qr + (j * 6 + i) * D2, q2 + (j * T2 + p2[i]) * D2, D2 * sizeof(float));
        ck_assert_int_eq(kvq_attention_rows_masked(qr, G, k2, v2, T2, D2, modes[mi], p2, 6, 1, kk, vv, mm, &f, &err),
                         KVQ_OK);
        ck_assert_int_eq(
            kvq_attention_head_ref_masked(q2, G, k2, v2, T2, D2, modes[mi], p2, 6, 1, kk, vv, mm, &r, &err), KVQ_OK);
        free(qr);
        double *a = &f.rows, *b = &r.rows;
        for (size_t i = 0; i < sizeof f / sizeof(double); i++)
            ck_assert_msg(close_rel(a[i], b[i], 1e-5, 1e-9), "mode %d field %zu: %.9g vs %.9g", mi, i, a[i], b[i]);
        ck_assert(f.mass_sum > 0 && f.mass_sum < f.rows);
    }
}
END_TEST

START_TEST(tokens_refusals)
{
    kvq_spec sp;
    kvq_error err = {0};
    const char *bad[] = {"tokens(h2o; none; drop)",           /* keep required */
                         "tokens(nope:keep=0.5; none; drop)", /* selector */
                         "tokens(h2o:keep=0.5; drop; none)",  /* HI dropped */
                         "tokens(h2o:keep=0.5; none)",        /* two parts */
                         "tokens(h2o:keep=0.5; none; drop; none)",
                         "tokens(h2o:keep=0.5; mix(0-=kivi); drop)",
                         "tokens(snapkv:keep=0.5,pool=4; none; drop)",
                         "tokens(h2o:keep=0.5,obs=3; none; drop)", /* obs is snapkv's */
                         "tokens(window; none; drop)",
                         "tokens(h2o:keep=1.5; none; drop)",
                         "tokens(h2o:keep=0.5; kivi:bits=99; drop)",
                         "tokens(h2o:keep=0.5; ; drop)",
                         "tokens(h2o:keep=0.5,adaptive=1.5; none; drop)",
                         "tokens(h2o:keep=0.5,adaptive=-0.1; none; drop)",
                         "tokens(h2o:target=0,interval=4; none; drop)",
                         "tokens(h2o:target=8,interval=0; none; drop)",
                         "tokens(h2o:target=8,interval=4,buffer=-1; none; drop)",
                         "tokens(h2o:target=8; none; drop)",
                         "tokens(h2o:keep=0.5,interval=8; none; drop)",
                         "tokens(h2o:keep=0.5,buffer=8; none; drop)"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        ck_assert_msg(kvq_spec_parse(bad[i], &sp, &err) == KVQ_ERR_USAGE, "%s accepted", bad[i]);
        ck_assert(!strchr(err.msg, '\n'));
    }
    /* a tokens(...) in a mix */
    ck_assert_msg(kvq_spec_parse("mix(0-1=tokens(window:sinks=1,recent=2; none; drop);2-=kivi)", &sp, &err) == KVQ_OK,
                  "%s", err.msg);
    kvq_spec sub;
    ck_assert_int_eq(kvq_spec_for_layer(&sp, 1, &sub, &err), KVQ_OK);
    ck_assert_str_eq(sub.text, "tokens(window:sinks=1,recent=2; none; drop)");
    /* a selector that needs queries on a layer without them: one line, KVQ_ERR_FORMAT */
    kvq_layer L;
    ck_assert_int_eq(kvq_layer_alloc(&L, 1, 1, 8, 4, 0, &err), KVQ_OK);
    fill_normal(L.key, 32, 1, 1.0), fill_normal(L.value, 32, 2, 1.0);
    run_out r;
    ck_assert_int_eq(run_spec("tokens(snapkv:keep=0.5; none; drop)", &L, 1, &r, &err), KVQ_ERR_FORMAT);
    ck_assert_msg(strstr(err.msg, "queries") && !strchr(err.msg, '\n'), "%s", err.msg);
    run_free(&r);
    ck_assert_int_eq(run_spec("tokens(knorm:keep=0.5; none; drop)", &L, 1, &r, &err), KVQ_OK); /* no queries needed */
    run_free(&r);
    /* a caller without a mask buffer cannot take dropped tokens */
    ck_assert_int_eq(kvq_spec_parse("tokens(knorm:keep=0.5; none; drop)", &sp, &err), KVQ_OK);
    float k[32], v[32];
    double kb[1], vb[1], sb[1] = {0};
    kvq_quant_ctx ctx = {.layer = 0, .nthreads = 1};
    kvq_quant_out out = {.key = k, .value = v, .k_bits = kb, .v_bits = vb, .static_bytes = sb};
    ck_assert_int_eq(kvq_quantize_layer(&sp, &ctx, &L, &out, &err), KVQ_ERR_USAGE);
    /* target= compresses while decoding: refused on a whole cache */
    ck_assert_int_eq(run_spec("tokens(knorm:target=4,interval=2; none; drop)", &L, 1, &r, &err), KVQ_ERR_USAGE);
    ck_assert_msg(strstr(err.msg, "while decoding") && !strchr(err.msg, '\n'), "%s", err.msg);
    run_free(&r);
    kvq_layer_free(&L);
}
END_TEST

int main(void)
{
    Suite *s = suite_create("tokens");
    TCase *tc = tcase_create("tokens");
    tcase_add_test(tc, tokens_keep_all_is_the_spec);
    tcase_add_test(tc, tokens_window_keeps_sinks_and_recent);
    tcase_add_test(tc, tokens_rankings_by_hand);
    tcase_add_test(tc, tokens_scores_against_plain_loops);
    tcase_add_test(tc, tokens_parts_on_the_compacted_sequence);
    tcase_add_test(tc, tokens_adaptive_budgets);
    tcase_add_test(tc, tokens_masked_attention_metrics);
    tcase_add_test(tc, tokens_refusals);
    tcase_set_timeout(tc, 300);
    suite_add_tcase(s, tc);
    return run_suite(s);
}

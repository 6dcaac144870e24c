/* bench.c — kvq-bench: throughput of kvq-analyze's parts on a dump shaped
 * like Llama-3-8B (32 query heads, 8 KV heads, head_dim 128, 4096 tokens,
 * 4 layers; written once by kvq-gen's library call, float16).
 *   kvq-bench [BUILD_DIR]    (run by `meson test --benchmark`;
 *   KVQ_BENCH_ONLY=vq or =tokens runs that section alone)
 * Reports: read throughput; quantize + reconstruction-error elements/s on
 * one core per quantizer; attention-metric GFLOP/s against plain
 * cblas_sgemm on the same shapes; the whole default analysis wall time. */
#include "internal.h"
#include "quant/quant.h"

#include <cblas.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + 1e-9 * ts.tv_nsec;
}

static void die(const kvq_error *e)
{
    fprintf(stderr, "kvq-bench: error: %s\n", e->msg);
    exit(1);
}

/* Quantize + reconstruction error of one layer on `threads` threads: best
 * of `reps`; calib: the spec's calibration state (or NULL). */
static double bench_quant_with(const char *text, const kvq_layer *L, float *kq, float *vq, int threads,
                               int reps, const void *calib, const kvq_rope *rope)
{
    kvq_spec sp;
    kvq_error err = {0};
    if (kvq_spec_parse(text, &sp, &err)) die(&err);
    double kb[64], vb[64], sb[64], best = 1e30;
    kvq_recon_acc rc[128];
    unsigned char done[128];
    size_t hs = (size_t)L->T * L->D;
    for (int rep = 0; rep < reps; rep++) {
        /* as the driver: error sums fused into the quantizer where it offers it */
        memset(rc, 0, sizeof rc), memset(done, 0, sizeof done);
        kvq_quant_out out = {.key = kq, .value = vq, .k_bits = kb, .v_bits = vb, .static_bytes = sb,
                             .recon = rc, .recon_done = done};
        kvq_quant_ctx ctx = {.nthreads = threads, .calib = calib, .rope = rope};
        double t0 = now();
        if (kvq_quantize_layer(&sp, &ctx, L, &out, &err)) die(&err);
        kvq_acc acc = {0};
        for (int h = 0; h < L->H; h++) {
            if (!done[h]) kvq_recon_accumulate(&acc.k, L->key + h * hs, kq + h * hs, hs);
            if (!done[L->H + h]) kvq_recon_accumulate(&acc.v, L->value + h * hs, vq + h * hs, hs);
        }
        double dt = now() - t0;
        if (dt < best) best = dt;
    }
    return 2.0 * L->H * hs / best;
}

static double bench_quant(const char *text, const kvq_layer *L, float *kq, float *vq)
{
    return bench_quant_with(text, L, kq, vq, 1, 3, NULL, NULL);
}

/* The calibration dump of the benchmarks that calibrate: one Llama-3-8B-shaped
 * layer (another seed), written into dir once; its path in path. */
static void calib_dump(const char *dir, char *path, size_t len)
{
    kvq_error err = {0};
    snprintf(path, len, "%s/bench-llama3-8b-calib.h5", dir);
    if (access(path, R_OK) == 0) return;
    kvq_gen_opts o;
    kvq_gen_defaults(&o);
    o.num_layers = 1, o.num_heads = 32, o.num_kv_heads = 8, o.head_dim = 128, o.seq_len = 4096;
    o.rope_theta = 500000, o.rope_style = KVQ_ROPE_HALF, o.dtype = KVQ_F16, o.seed = 1;
    if (kvq_gen_write(path, &o, &err)) die(&err);
}

/* The error-reduction quantizers: elements/s on all cores, and cluster's
 * calibration on a second Llama-shaped dump (one layer). */
static void bench_error_reduction(const char *dir, kvq_dump *d, const kvq_layer *L, float *kq, float *vq)
{
    char path[1024];
    kvq_error err = {0};
    calib_dump(dir, path, sizeof path);
    int nt = omp_get_num_procs();
    const char *specs[] = {"gear:bits=2,lowrank=power", "gear:bits=2,lowrank=svd", "gear-l:bits=2",
                           "gear:bits=4,backbone=kcvt", "lloydmax:bits=2,rotate=qr", "lloydmax:bits=2,rotate=hadamard",
                           "lloydmax:bits=4,rotate=qr"};
    printf("\nerror-reduction quantizers, quantize + reconstruction error, %d cores (codebooks cached first):\n", nt);
    for (size_t i = 0; i < sizeof specs / sizeof specs[0]; i++) {
        bench_quant_with(specs[i], L, kq, vq, nt, 1, NULL, NULL); /* warm: codebook */
        printf("  %-40s %8.1f M elements/s\n", specs[i],
               bench_quant_with(specs[i], L, kq, vq, nt, 2, NULL, NULL) / 1e6);
    }
    kvq_calib *c;
    kvq_rope rope;
    if (kvq_calib_open(path, &c, &err) || kvq_dump_read_rope(d, &rope, &err)) die(&err);
    const char *cl[] = {"cluster:centroids=16", "cluster:centroids=64"};
    for (int i = 0; i < 2; i++) {
        kvq_spec sp;
        const void *state;
        if (kvq_spec_parse(cl[i], &sp, &err)) die(&err);
        double t0 = now();
        if (kvq_calib_state(c, &sp, 0, 0, nt, &state, &err)) die(&err);
        double tc = now() - t0;
        printf("  %-40s calibration (k-means of 8 heads x K/V, 4096 tokens) %.2f s; application %8.1f M elements/s\n",
               cl[i], tc, bench_quant_with(cl[i], L, kq, vq, nt, 2, state, &rope) / 1e6);
    }
    kvq_rope_free(&rope);
    kvq_calib_close(c);
}

/* vq (docs/quantizers.md#vq): training the codebooks of one Llama-3-8B-shaped
 * layer of calibration data (8 KV heads x 4096 tokens, K and V) on all cores,
 * then applying them, elements/s on one core beside per-token. */
static void bench_vq(const char *dir, const kvq_layer *L, float *kq, float *vq)
{
    char path[1024];
    kvq_error err = {0};
    calib_dump(dir, path, sizeof path);
    kvq_calib *c;
    if (kvq_calib_open(path, &c, &err)) die(&err);
    int nt = omp_get_num_procs();
    double pt = bench_quant("per-token:bits=2,group=32", L, kq, vq);
    printf("\nvq: codebooks trained on one calibration layer (8 KV heads x 4096 tokens, K and V, %d cores), then "
           "applied on one core (per-token:bits=2,group=32: %.0f M elements/s):\n", nt, pt / 1e6);
    const char *specs[] = {"vq:dims=8,bits=8", "vq:dims=4,bits=8", "vq:dims=4,bits=4,stages=2"};
    for (size_t i = 0; i < sizeof specs / sizeof specs[0]; i++) {
        kvq_spec sp;
        const void *state;
        if (kvq_spec_parse(specs[i], &sp, &err)) die(&err);
        double t0 = now();
        if (kvq_calib_state(c, &sp, 0, 0, nt, &state, &err)) die(&err);
        double tc = now() - t0;
        double r = bench_quant_with(specs[i], L, kq, vq, 1, 2, state, NULL);
        printf("  %-28s training %6.2f s   application %7.1f M elements/s  (%.1fx the time of per-token)\n", specs[i],
               tc, r / 1e6, pt / r);
    }
    kvq_calib_close(c);
}

/* tokens(...)'s selection on one layer, all cores: seconds per selector
 * beside one plain attention pass (S = Q·Kᵀ of every query head over every
 * query, by sgemm) — what "no more than one extra attention pass" means. */
static void bench_tokens(const kvq_layer *L)
{
    int nt = omp_get_num_procs(), T = L->T, D = L->D, G = L->Hq / L->H;
    float **S = calloc((size_t)nt, sizeof *S);
    for (int i = 0; i < nt; i++)
        if (!(S[i] = malloc((size_t)T * T * sizeof(float)))) {
            fprintf(stderr, "kvq-bench: out of memory for the attention scores\n");
            exit(1);
        }
    double best = 1e30;
    for (int rep = 0; rep < 2; rep++) {
        double t0 = now();
#pragma omp parallel for num_threads(nt) schedule(dynamic, 1)
        for (int j = 0; j < L->Hq; j++)
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, T, T, D, 1.0f, L->query + (size_t)j * T * D, D,
                        L->key + (size_t)(j / G) * T * D, D, 0.0f, S[omp_get_thread_num()], T);
        double dt = now() - t0;
        best = dt < best ? dt : best;
    }
    for (int i = 0; i < nt; i++) free(S[i]);
    free(S);
    printf("\ntokens(...) selection on one layer (%d query heads, %d tokens), %d cores; one attention pass "
           "(Q·Kᵀ of every query by sgemm): %.2f s\n", L->Hq, T, nt, best);
    const char *specs[] = {"tokens(window:sinks=4,recent=1020; none; drop)", "tokens(knorm:keep=0.25; none; drop)",
                           "tokens(random:keep=0.25; none; drop)", "tokens(tova:keep=0.25; none; drop)",
                           "tokens(snapkv:keep=0.25; none; drop)", "tokens(h2o:keep=0.25; none; drop)",
                           "tokens(zipcache:keep=0.25; none; drop)"};
    unsigned char *keep = malloc((size_t)L->H * T);
    const kvq_tokens_parts *tp;
    kvq_error err = {0};
    if (!keep) {
        fprintf(stderr, "kvq-bench: out of memory\n");
        exit(1);
    }
    for (size_t i = 0; i < sizeof specs / sizeof specs[0]; i++) {
        kvq_spec sp;
        if (kvq_spec_parse(specs[i], &sp, &err) || kvq_tokens_parts_of(&sp, &tp, &err)) die(&err);
        double b = 1e30;
        for (int rep = 0; rep < 2; rep++) {
            double t0 = now();
            if (kvq_tokens_select(tp, L, NULL, 0, 0, nt, keep, NULL, &err)) die(&err);
            double dt = now() - t0;
            b = dt < b ? dt : b;
        }
        printf("  %-42s %7.3f s  (%.2fx the attention pass)\n", specs[i], b, b / best);
    }
    free(keep);
}

/* Compression while decoding (SPEC §3.11): the cost of one compression step —
 * a selection over the S + I tokens held at HI, scored by the last I rows —
 * beside one decode-step attention of those I rows over the held keys. */
static void bench_tokens_online(const kvq_layer *L)
{
    enum { S = 1024, EVERY = 64 };
    int nt = omp_get_num_procs(), H = L->H, Hq = L->Hq, D = L->D, n = S + EVERY, G = Hq / H;
    if (L->T < n) return;
    kvq_layer C = {.H = H, .Hq = Hq, .T = n, .D = D};
    C.key = malloc((size_t)H * n * D * sizeof(float)), C.value = malloc((size_t)H * n * D * sizeof(float));
    C.query = malloc((size_t)Hq * n * D * sizeof(float));
    float **Sc = calloc((size_t)nt, sizeof *Sc);
    unsigned char *keep = malloc((size_t)H * n);
    const kvq_tokens_parts *tp;
    if (!C.key || !C.value || !C.query || !Sc || !keep) {
        fprintf(stderr, "kvq-bench: out of memory\n");
        exit(1);
    }
    for (int h = 0; h < H; h++) { /* the first n tokens of each head: the held set */
        memcpy(C.key + (size_t)h * n * D, L->key + (size_t)h * L->T * D, (size_t)n * D * sizeof(float));
        memcpy(C.value + (size_t)h * n * D, L->value + (size_t)h * L->T * D, (size_t)n * D * sizeof(float));
    }
    for (int j = 0; j < Hq; j++)
        memcpy(C.query + (size_t)j * n * D, L->query + (size_t)j * L->T * D, (size_t)n * D * sizeof(float));
    for (int i = 0; i < nt; i++)
        if (!(Sc[i] = malloc((size_t)EVERY * n * sizeof(float)))) exit(1);
    double best = 1e30;
    for (int rep = 0; rep < 5; rep++) { /* the EVERY rows' scores over the held keys, every query head */
        double t0 = now();
#pragma omp parallel for num_threads(nt) schedule(dynamic, 1)
        for (int j = 0; j < Hq; j++)
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, EVERY, n, D, 1.0f, C.query + ((size_t)j * n + n - EVERY) * D,
                        D, C.key + (size_t)(j / G) * n * D, D, 0.0f, Sc[omp_get_thread_num()], n);
        double dt = now() - t0;
        best = dt < best ? dt : best;
    }
    printf("\ncompression while decoding, one step: %d held tokens at HI -> %d, scored by the last %d rows, %d "
           "cores; those rows' attention (Q·Kᵀ by sgemm): %.2f ms\n", n, S, EVERY, nt, best * 1e3);
    const char *sels[] = {"window:sinks=4", "knorm", "keydiff", "random", "tova", "snapkv", "h2o", "zipcache"};
    kvq_error err = {0};
    for (size_t i = 0; i < sizeof sels / sizeof sels[0]; i++) {
        char text[160];
        snprintf(text, sizeof text, "tokens(%s%starget=%d,interval=%d; none; drop)", sels[i],
                 strchr(sels[i], ':') ? "," : ":", S, EVERY);
        kvq_spec sp;
        if (kvq_spec_parse(text, &sp, &err) || kvq_tokens_parts_of(&sp, &tp, &err)) die(&err);
        kvq_select_at at = {.target = S, .qrow0 = n - EVERY};
        double b = 1e30;
        for (int rep = 0; rep < 3; rep++) {
            double t0 = now();
            if (kvq_tokens_select_at(tp, &C, NULL, 0, 0, nt, &at, keep, NULL, &err)) die(&err);
            double dt = now() - t0;
            b = dt < b ? dt : b;
        }
        printf("  %-58s %8.2f ms  (%.1fx those rows' attention)\n", text, b * 1e3, b / best);
    }
    for (int i = 0; i < nt; i++) free(Sc[i]);
    free(Sc), free(keep), free(C.key), free(C.value), free(C.query);
}

int main(int argc, char **argv)
{
    const char *dir = argc > 1 ? argv[1] : ".";
    char path[1024];
    snprintf(path, sizeof path, "%s/bench-llama3-8b.h5", dir);
    kvq_error err = {0};
    if (access(path, R_OK) != 0) {
        kvq_gen_opts o;
        kvq_gen_defaults(&o);
        o.num_layers = 4, o.num_heads = 32, o.num_kv_heads = 8, o.head_dim = 128, o.seq_len = 4096;
        o.rope_theta = 500000, o.rope_style = KVQ_ROPE_HALF, o.dtype = KVQ_F16;
        double t0 = now();
        if (kvq_gen_write(path, &o, &err)) die(&err);
        printf("generated %s in %.1f s\n", path, now() - t0);
    }
    kvq_dump *d;
    if (kvq_dump_open(path, &d, &err)) die(&err);
    const kvq_dump_info *in = kvq_dump_get_info(d);
    printf("dump: %d layers, %d query heads, %d KV heads, head_dim %d, %d tokens, float16; %d cores\n",
           in->num_layers, in->num_heads, in->num_kv_heads, in->head_dim, in->seq_len, omp_get_num_procs());
    openblas_set_num_threads(1);

    kvq_layer L;
    double t0 = now();
    if (kvq_dump_read_layer(d, 0, KVQ_READ_QUERY | KVQ_READ_KEY_PRE_ROPE, &L, &err)) die(&err);
    double tread = now() - t0;
    size_t nel = (size_t)L.H * L.T * L.D * 3 + (size_t)L.Hq * L.T * L.D;
    printf("read layer 0 (K, V, Q, pre-RoPE K; float16 -> float32, finite check): %.3f s, %.0f M elements/s\n", tread,
           nel / tread / 1e6);

    size_t n = (size_t)L.H * L.T * L.D;
    /* outputs on cache lines, as the driver allocates them (kvq_alloc_lines) */
    float *kq = aligned_alloc(64, n * sizeof *kq), *vq = aligned_alloc(64, n * sizeof *vq);
    const char *only = getenv("KVQ_BENCH_ONLY");
    if (only && (!strcmp(only, "vq") || !strcmp(only, "tokens"))) { /* that section alone */
        if (!strcmp(only, "vq")) bench_vq(dir, &L, kq, vq);
        else bench_tokens(&L), bench_tokens_online(&L);
        kvq_layer_free(&L), free(kq), free(vq), kvq_dump_close(d);
        return 0;
    }
    const char *specs[] = {"per-token:bits=2,group=32", "per-channel:bits=2,group=32",
                           "kivi:bits=2,group=32,residual=128", "kcvt:bits=4", "absmax:bits=8",
                           "per-token:bits=2,group=32,span=layer"};
    printf("\nquantize + reconstruction error, one core (target >= 1000 M elements/s for per-token, per-channel, "
           "kivi):\n");
    for (size_t i = 0; i < sizeof specs / sizeof specs[0]; i++)
        printf("  %-40s %8.0f M elements/s\n", specs[i], bench_quant(specs[i], &L, kq, vq) / 1e6);

    /* fp8 and tender (docs/quantizers.md): the FP8 cast alone, then each
     * quantizer beside per-token on the same layer, one core */
    {
        double best[2] = {1e30, 1e30};
        for (int f = 0; f < 2; f++)
            for (int rep = 0; rep < 5; rep++) {
                double t1 = now();
                kvq_fp8_quantize_array(L.key, kq, n, 0.01f, (kvq_fp8_format)f);
                double dt = now() - t1;
                if (dt < best[f]) best[f] = dt;
            }
        printf(
            "\nFP8 cast x' = fp8(x/s)*s, one core (target >= 1000 M elements/s): e4m3 %.0f, e5m2 %.0f M elements/s\n",
            n / best[0] / 1e6, n / best[1] / 1e6);
        const char *fam[] = {"fp8", "fp8:scale=token", "fp8:scale=channel", "tender", "tender:span=head",
                             "tender:chunk=0,groups=16", "ggml", "ggml:ktype=q4_0,vtype=q4_0",
                             "ggml:ktype=iq4_nl,vtype=iq4_nl", "fp4:format=mxfp4", "fp4:format=nvfp4",
                             "fp4:format=nvfp4,global=tensor", "kvquant:codebook=uniform,prerope=0",
                             "turboquant", "turboquant:variant=mse", "per-token:bits=4,group=128,prerotate=hadamard"};
        double pt = bench_quant("per-token:bits=4,group=128", &L, kq, vq);
        printf("quantize + reconstruction error, one core, the families beside per-token:bits=4,group=128 (%.0f M "
               "elements/s;"
               " target for tender: within 2x):\n",
               pt / 1e6);
        for (size_t i = 0; i < sizeof fam / sizeof fam[0]; i++) {
            double r = bench_quant(fam[i], &L, kq, vq);
            printf("  %-40s %8.0f M elements/s  (%.2fx the time of per-token)\n", fam[i], r / 1e6, pt / r);
        }
    }

    /* attention: all 8 KV heads, 5 quantizers, one core */
    const int nq = 5;
    float *kqs[5], *vqs[5];
    for (int s = 0; s < nq; s++) {
        kvq_spec sp;
        double kb[64], vb[64];
        kqs[s] = malloc(n * sizeof(float)), vqs[s] = malloc(n * sizeof(float));
        if (kvq_spec_parse(specs[s], &sp, &err)) die(&err);
        kvq_quant_out out = {.key = kqs[s], .value = vqs[s], .k_bits = kb, .v_bits = vb};
        kvq_quant_ctx ctx = {.nthreads = 1};
        if (kvq_quantize_layer(&sp, &ctx, &L, &out, &err)) die(&err);
    }
    int G = L.Hq / L.H, T = L.T, D = L.D;
    bench_error_reduction(dir, d, &L, kq, vq);
    bench_vq(dir, &L, kq, vq);
    bench_tokens(&L);
    bench_tokens_online(&L);
    const int rows_list[] = {64, 512};
    printf("\nattention metrics, one core, %d quantizers (target >= 60%% of sgemm on the same shapes):\n", nq);
    for (int ri = 0; ri < 2; ri++) {
        int np = rows_list[ri];
        int *pos = malloc((size_t)np * sizeof *pos);
        for (int i = 0; i < np; i++) pos[i] = T - np + i;
        double best = 1e30;
        for (int rep = 0; rep < 2; rep++) {
            double ta = now();
            for (int h = 0; h < L.H; h++) {
                size_t off = (size_t)h * T * D;
                const float *kh[5], *vh[5];
                kvq_attn_acc acc[5] = {0};
                for (int s = 0; s < nq; s++) kh[s] = kqs[s] + off, vh[s] = vqs[s] + off;
                if (kvq_attention_head(L.query + off * G, G, L.key + off, L.value + off, T, D, (kvq_attn_mode){0}, pos,
                                       (size_t)np, nq, kh, vh, acc, &err)) die(&err);
            }
            double dt = now() - ta;
            if (dt < best) best = dt;
        }
        /* gemm flops: per query head, exact S and O, per quantizer S', A·V', A'·V'
         * (columns up to each chunk's last position: all T here) */
        double flops = (double)L.H * G * 2.0 * np * T * D * (2 + 3 * nq);
        /* the same gemm shapes through plain sgemm */
        float *A = malloc((size_t)np * T * sizeof *A), *S = malloc((size_t)np * T * sizeof *S);
        float *Q = malloc((size_t)np * D * sizeof *Q), *O = malloc((size_t)np * D * sizeof *O);
        memcpy(Q, L.query + (size_t)(T - np) * D, (size_t)np * D * sizeof *Q);
        for (size_t i = 0; i < (size_t)np * T; i++) A[i] = 1.0f / T;
        double tg = now();
        long calls = 0;
        for (int h = 0; h < L.H; h++)
            for (int j = 0; j < G; j++)
                for (int k = 0; k < 1 + nq; k++, calls++) {
                    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, np, T, D, 1.0f, Q, D,
                                L.key + (size_t)h * T * D, D, 0.0f, S, T);
                    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, np, D, T, 1.0f, A, T,
                                L.value + (size_t)h * T * D, D, 0.0f, O, D);
                    if (k > 0)
                        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, np, D, T, 1.0f, A, T,
                                    L.value + (size_t)h * T * D, D, 0.0f, O, D);
                }
        double tgemm = now() - tg;
        (void)calls;
        double g_attn = flops / best / 1e9, g_gemm = flops / tgemm / 1e9;
        printf("  last:%-4d  attention %6.1f GFLOP/s (%.3f s)   sgemm alone %6.1f GFLOP/s   ratio %3.0f%%\n",
               np, g_attn, best, g_gemm, 100 * g_attn / g_gemm);
        free(A), free(S), free(Q), free(O), free(pos);
    }
    for (int s = 0; s < nq; s++) free(kqs[s]), free(vqs[s]);
    kvq_layer_free(&L);
    free(kq), free(vq);

    /* the whole default analysis, all cores */
    kvq_spec sp[5];
    for (int s = 0; s < 5; s++) if (kvq_spec_parse(specs[s], &sp[s], &err)) die(&err);
    kvq_analysis_opts o = {.specs = sp, .nspecs = 5, .queries = {KVQ_Q_LAST, 64}};
    kvq_analysis a;
    t0 = now();
    if (kvq_analyze_dump(d, &o, &a, &err)) die(&err);
    printf("\nkvq_analyze_dump, 5 quantizers, 4 layers, last:64, all cores: %.2f s\n", now() - t0);
    kvq_analysis_free(&a);
    kvq_dump_close(d);
    return 0;
}

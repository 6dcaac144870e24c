/* bench_cuda.c — kvq-bench-cuda: the GPU path on the Llama-3-8B-shaped dump
 * kvq-bench writes (32 query heads, 8 KV heads, head_dim 128, 4096 tokens).
 *   kvq-bench-cuda [BUILD_DIR]    (run by `meson test --benchmark`)
 * Reports (docs/performance.md, issue targets):
 *   - device-to-device copy bandwidth (the reference: what a kernel that
 *     reads and writes each element once can reach);
 *   - quantize + reconstruction error of each plan quantizer, kernels only,
 *     on layer 0 and on the same layer tiled to 65536 tokens: elements/s and
 *     the fraction of that bandwidth (8 bytes moved per element: x read, x'
 *     written; target >= 60 %);
 *   - the attention metrics of 5 quantizers over all 8 KV heads (last:64,
 *     last:512): GFLOP/s of their products against cuBLAS sgemm alone on the
 *     score shape;
 *   - kvq_analyze_dump with --device cuda against the CPU, whole dump.
 * Without a GPU it says so and exits 77 (skipped). */
#include "analysis/device.h"
#include "internal.h"
#include "quant/quant.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

static void die(const kvq_error *e)
{
    fprintf(stderr, "kvq-bench-cuda: error: %s\n", e->msg);
    exit(1);
}

static const char *const specs[] = {"per-token:bits=2,group=32", "per-channel:bits=2,group=32",
                                    "kivi:bits=2,group=32,residual=128", "kcvt:bits=4", "absmax:bits=8"};
enum { NSPEC = 5 };

/* Kernel throughput of every plan on layer L (slot 0). */
static void bench_plans(kvq_device *dev, const kvq_layer *L, double copy_gbs)
{
    kvq_error err = {0};
    kvq_cuda *c = kvq_device_cuda(dev);
    const kvq_cuda_api *api = kvq_device_cuda_api(dev);
    if (kvq_device_set_layer(dev, L, 1, &err)) die(&err);
    double n = 2.0 * L->H * L->T * L->D; /* K and V */
    for (int s = 0; s < NSPEC; s++) {
        kvq_spec sp;
        kvq_plan plan;
        double sec;
        if (kvq_spec_parse(specs[s], &sp, &err)) die(&err);
        sp.q->plan(&sp, L->T, L->D, &plan);
        if (api->time_plan(c, &plan, 50, &sec, &err)) die(&err);
        double gbs = 8.0 * n / sec / 1e9;
        printf("  %-36s %9.0f M elements/s  %7.1f GB/s  %5.1f %% of copy bandwidth\n", specs[s], n / sec / 1e6, gbs,
               100 * gbs / copy_gbs);
    }
}

int main(int argc, char **argv)
{
    const char *dir = argc > 1 ? argv[1] : ".";
    char path[1024];
    snprintf(path, sizeof path, "%s/bench-llama3-8b.h5", dir);
    kvq_error err = {0};
    kvq_device *dev;
    if (kvq_device_open_cuda(&dev, &err)) {
        printf("kvq-bench-cuda: skipped: %s\n", err.msg);
        return 77;
    }
    kvq_cuda *c = kvq_device_cuda(dev);
    const kvq_cuda_api *api = kvq_device_cuda_api(dev);
    printf("device: %s\n", kvq_device_name(dev));
    if (access(path, R_OK) != 0) { /* the same dump as kvq-bench */
        kvq_gen_opts o;
        kvq_gen_defaults(&o);
        o.num_layers = 4, o.num_heads = 32, o.num_kv_heads = 8, o.head_dim = 128, o.seq_len = 4096;
        o.rope_theta = 500000, o.rope_style = KVQ_ROPE_HALF, o.dtype = KVQ_F16;
        if (kvq_gen_write(path, &o, &err)) die(&err);
    }
    kvq_dump *d;
    if (kvq_dump_open(path, &d, &err)) die(&err);
    kvq_layer L;
    if (kvq_dump_read_layer(d, 0, KVQ_READ_QUERY, &L, &err)) die(&err);
    int H = L.H, T = L.T, D = L.D, Hq = L.Hq, G = Hq / H;

    double copy_gbs;
    if (api->copy_bandwidth(c, (size_t)1 << 28, &copy_gbs, &err)) die(&err);
    printf("device-to-device copy (1 GiB, read + write): %.0f GB/s\n", copy_gbs);

    printf("\nquantize + reconstruction error, kernels only, layer 0 [%d][%d][%d] (target >= 60 %% of bandwidth):\n", H,
           T, D);
    bench_plans(dev, &L, copy_gbs);
    /* long context: the layer tiled to 65536 tokens */
    const int reps = 16;
    kvq_layer big = {.H = H, .T = T * reps, .D = D, .Hq = Hq};
    size_t nb = (size_t)H * big.T * D;
    big.key = malloc(nb * sizeof(float)), big.value = malloc(nb * sizeof(float));
    if (!big.key || !big.value) { fprintf(stderr, "kvq-bench-cuda: out of memory\n"); return 1; }
    for (int h = 0; h < H; h++)
        for (int r = 0; r < reps; r++) {
            size_t src = (size_t)h * T * D, dst = ((size_t)h * big.T + (size_t)r * T) * D;
            memcpy(big.key + dst, L.key + src, (size_t)T * D * sizeof(float));
            memcpy(big.value + dst, L.value + src, (size_t)T * D * sizeof(float));
        }
    printf("\nthe same, layer 0 tiled to [%d][%d][%d]:\n", H, big.T, D);
    bench_plans(dev, &big, copy_gbs);
    free(big.key), free(big.value);

    /* attention: 5 plan quantizers in slots 0..4, all KV heads */
    if (kvq_device_set_layer(dev, &L, NSPEC, &err)) die(&err);
    for (int s = 0; s < NSPEC; s++) {
        kvq_spec sp;
        kvq_plan plan;
        kvq_recon_acc rc[64] = {{0}};
        int bad;
        if (kvq_spec_parse(specs[s], &sp, &err)) die(&err);
        sp.q->plan(&sp, T, D, &plan);
        if (kvq_device_quantize_plan(dev, s, &plan, rc, &bad, &err)) die(&err);
    }
    printf(
        "\nattention metrics, %d quantizers, %d KV heads x %d query heads (cuBLAS sgemm alone on the score shape):\n",
        NSPEC, H, G);
    const int rows_list[] = {64, 512};
    for (int ri = 0; ri < 2; ri++) {
        int np = rows_list[ri];
        int *pos = malloc((size_t)np * sizeof *pos);
        float *q = malloc((size_t)Hq * np * D * sizeof *q);
        for (int i = 0; i < np; i++) pos[i] = T - np + i;
        for (int j = 0; j < Hq; j++)
            memcpy(q + (size_t)j * np * D, L.query + ((size_t)j * T + T - np) * D, (size_t)np * D * sizeof *q);
        if (kvq_device_set_queries(dev, q, Hq, pos, (size_t)np, 0, &err)) die(&err);
        double best = 1e30;
        for (int rep = 0; rep < 3; rep++) {
            double t0 = now();
            for (int h = 0; h < H; h++) {
                kvq_attn_acc acc[NSPEC] = {{0}};
                if (kvq_device_attention(dev, h, NSPEC, acc, &err)) die(&err);
            }
            double dt = now() - t0;
            if (dt < best) best = dt;
        }
        /* as kvq-bench: exact S and O, per quantizer S', A·V', A'·V' */
        double flops = (double)H * G * 2.0 * np * T * D * (2 + 3 * NSPEC), sg;
        if (api->time_sgemm(c, G * np, T, D, 20, &sg, &err)) die(&err);
        double g_attn = flops / best / 1e9, g_gemm = 2.0 * G * np * T * D / sg / 1e9;
        printf("  last:%-4d  attention %8.1f GFLOP/s (%.4f s)   sgemm alone %8.1f GFLOP/s   ratio %3.0f%%\n", np,
               g_attn, best, g_gemm, 100 * g_attn / g_gemm);
        free(pos), free(q);
    }
    kvq_layer_free(&L);

    /* the whole analysis, CPU against GPU */
    kvq_spec sp[NSPEC];
    for (int s = 0; s < NSPEC; s++)
        if (kvq_spec_parse(specs[s], &sp[s], &err)) die(&err);
    kvq_analysis_opts o = {.specs = sp, .nspecs = NSPEC, .queries = {KVQ_Q_LAST, 64}};
    kvq_analysis a;
    for (int k = 0; k < 2; k++) {
        o.device = k ? dev : NULL;
        double t0 = now();
        if (kvq_analyze_dump(d, &o, &a, &err)) die(&err);
        printf("%skvq_analyze_dump, %d quantizers, 4 layers, last:64, %s: %.2f s\n", k ? "" : "\n", NSPEC,
               k ? "--device cuda" : "--device cpu (all cores)", now() - t0);
        kvq_analysis_free(&a);
    }
    kvq_dump_close(d);
    kvq_device_close(dev);
    return 0;
}

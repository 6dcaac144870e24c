/* bench_model.c — kvq-bench-model: the forward pass at model scale.
 * Writes once a GGUF with two layers of Llama-3-8B's shapes (dim 4096, 32
 * query / 8 KV heads of 128, FFN 14336) in q4_K (output q6_K; vocabulary
 * 32000 to keep the file small), then times a 2048-token prefill
 * (kvq_model_eval with no quantizer: the exact model and its output head)
 * against OpenBLAS sgemm on the same weight-product shapes with the same
 * threads, and reports the ratio and the peak memory against
 * file + one layer in float32 + activations.
 *   kvq-bench-model [BUILD_DIR] [TOKENS]   (run by `meson test --benchmark`) */
#include "gguf_writer.h"

#include <cblas.h>
#include <omp.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + 1e-9 * ts.tv_nsec;
}

int main(int argc, char **argv)
{
    const char *dir = argc > 1 ? argv[1] : ".";
    int T = argc > 2 ? atoi(argv[2]) : 2048;
    gw_model_opts o = {"llama", 2, 32, 8, 128, 14336, 32000, 8192, KVQ_GGML_Q4_K, 0, 0, 0, 77};
    char path[4096];
    snprintf(path, sizeof path, "%s/bench-llama3-8b-2layers-q4_K.gguf", dir);
    struct stat sb;
    if (stat(path, &sb) != 0) {
        fprintf(stderr, "kvq-bench-model: writing %s (once)\n", path);
        gguf_w w;
        gw_tiny_model(&w, &o);
        for (int i = 0; i < w.nt; i++) /* llama.cpp's Q4_K_M keeps the output in q6_K */
            if (!strcmp(w.t[i].name, "output.weight")) {
                size_t nb;
                free(w.t[i].data);
                w.t[i].data = gw_random_weights(KVQ_GGML_Q6_K, 4096, o.V, 0.5, 5, &nb);
                w.t[i].nbytes = nb, w.t[i].type = KVQ_GGML_Q6_K;
            }
        uint8_t *p;
        size_t n;
        gw_serialise(&w, &p, &n);
        gw_free(&w);
        if (gw_write_file(path, p, n)) { perror(path); return 1; }
        free(p);
        stat(path, &sb);
    }
    kvq_model *m;
    kvq_error err = {0};
    if (kvq_model_open(path, NULL, &m, &err)) { fprintf(stderr, "kvq-bench-model: %s\n", err.msg); return 1; }
    const kvq_model_info *in = kvq_model_get_info(m);
    int *tok = malloc((size_t)T * sizeof *tok), nt = omp_get_num_procs();
    for (int t = 0; t < T; t++) tok[t] = t ? (int)((t * 7919u) % (unsigned)in->vocab_size) : 1;

    /* the forward pass: best of 2 */
    double best = 1e30, nll = 0;
    kvq_eval_opts eo = {.nthreads = nt};
    for (int r = 0; r < 2; r++) {
        double t0 = now();
        if (kvq_model_eval(m, tok, T, NULL, 0, &eo, &nll, &err)) {
            fprintf(stderr, "kvq-bench-model: %s\n", err.msg);
            return 1;
        }
        double t = now() - t0;
        best = t < best ? t : best;
    }
    struct rusage ru; /* the forward's peak, before this benchmark's own buffers */
    getrusage(RUSAGE_SELF, &ru);
    /* the same weight products as plain sgemm on float matrices */
    int dim = in->dim, qd = in->n_heads * in->head_dim, kd = in->n_kv_heads * in->head_dim, F = in->ffn_dim,
        V = in->vocab_size;
    int shapes[8][3] = {{dim, qd, 0}, {dim, kd, 0}, {dim, kd, 0}, {qd, dim, 0},
                        {dim, F, 0},  {dim, F, 0},  {F, dim, 0},  {dim, V, 1}};
    size_t maxw = (size_t)F * dim > (size_t)V * dim ? (size_t)F * dim : (size_t)V * dim;
    float *W = malloc(maxw * sizeof *W), *X = malloc((size_t)T * F * sizeof *X),
          *Y = malloc((size_t)T * (F > V ? F : V) * sizeof *Y);
    for (size_t i = 0; i < maxw; i++) W[i] = (float)((i % 97) - 48) * 1e-3f;
    for (size_t i = 0; i < (size_t)T * F; i++) X[i] = (float)((i % 89) - 44) * 1e-2f;
    openblas_set_num_threads(nt);
    double sg = 1e30, flops = 0;
    for (int r = 0; r < 2; r++) {
        double t0 = now();
        flops = 0;
        for (int s = 0; s < 8; s++) {
            int reps = shapes[s][2] ? 1 : in->n_layers, rows = shapes[s][2] ? T - 1 : T;
            for (int k = 0; k < reps; k++) {
                cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, rows, shapes[s][1], shapes[s][0], 1.0f, X,
                            shapes[s][0], W, shapes[s][0], 0.0f, Y, shapes[s][1]);
                flops += 2.0 * rows * shapes[s][1] * shapes[s][0];
            }
        }
        double t = now() - t0;
        sg = t < sg ? t : sg;
    }
    /* one kvq-alloc sensitivity pass (kvq-eval --per-layer: every layer alone quantized,
     * in lockstep with the exact model), for two grid points */
    const char *pass_specs[] = {"kivi:bits=2", "per-token:bits=4"};
    double pass_s[2];
    for (int p = 0; p < 2; p++) {
        kvq_spec sp;
        kvq_eval_item items[64];
        if (kvq_spec_parse(pass_specs[p], &sp, &err) || in->n_layers > 64) {
            fprintf(stderr, "kvq-bench-model: %s\n", err.msg);
            return 1;
        }
        for (int l = 0; l < in->n_layers; l++) items[l] = (kvq_eval_item){.spec = &sp, .layer = l};
        double t0 = now();
        if (kvq_model_eval(m, tok, T, items, in->n_layers, &eo, &nll, &err)) {
            fprintf(stderr, "kvq-bench-model: %s\n", err.msg);
            return 1;
        }
        pass_s[p] = now() - t0;
    }
    double layer_f32 = 4.0 * ((double)dim * (qd + 2 * kd) + (double)qd * dim + 3.0 * dim * F);
    /* what the forward pass of the exact model allocates besides the layer: its activations
     * (x, x̂, q, att, Q by head, k, v, K, V, pre-RoPE K, gate, up), the
     * output head's chunk of weights, two chunks of logits and the normed states, and the
     * attention scores of each thread */
    size_t lim = (16u << 20) / (size_t)(T - 1 > dim ? T - 1 : dim);
    double vc = lim < 256 ? 256 : lim > (size_t)V ? V : (double)lim;
    double act = 4.0 * T * (2.0 * dim + 3.0 * qd + 5.0 * kd + 2.0 * F) + 4.0 * vc * (dim + 2.0 * (T - 1)) +
                 4.0 * (T - 1) * dim + (double)nt * (8 << 20);
    printf("kvq-bench-model: %s, %d layers, %d tokens, %d threads\n", in->format, in->n_layers, T, nt);
    printf("  prefill + output head: %.2f s (%.1f GFLOP/s of weight products; mean NLL %.3f)\n", best,
           flops / best * 1e-9, nll);
    printf("  sgemm on the same shapes: %.2f s (%.1f GFLOP/s)\n", sg, flops / sg * 1e-9);
    printf("  ratio: %.0f %% of the sgemm rate (target >= 70 %%)\n", 100.0 * sg / best);
    printf("  peak memory of the forward pass %.0f MB; file %.0f MB + one layer in float32 %.0f MB + activations %.0f "
           "MB = %.0f MB\n",
           ru.ru_maxrss / 1024.0, sb.st_size / 1048576.0, layer_f32 / 1048576.0, act / 1048576.0,
           (sb.st_size + layer_f32 + act) / 1048576.0);
    for (int p = 0; p < 2; p++)
        printf("  kvq-alloc sensitivity pass (%d layers each alone quantized), %s: %.2f s = %.3f passes/s\n",
               in->n_layers, pass_specs[p], pass_s[p], 1.0 / pass_s[p]);
    free(W), free(X), free(Y), free(tok);
    kvq_model_close(m);
    return 0;
}

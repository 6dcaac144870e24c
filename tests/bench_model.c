/* bench_model.c — kvq-bench-model: the forward pass at model scale, and
 * kvq-eval beside llama.cpp's own llama-perplexity.
 * Writes once a GGUF with two layers of Llama-3-8B's shapes (dim 4096, 32
 * query / 8 KV heads of 128, FFN 14336) in q4_K, output q6_K (llama.cpp's
 * Q4_K_M), and a vocabulary of 128256: the real Llama 3 one copied from
 * ../shared/data/models-tiny/tiny-llama3.gguf when it is there (else a
 * synthetic SentencePiece one of the same size, and no llama.cpp
 * comparison: its tokenizer would differ).  Then:
 *   1. a 2048-token prefill (the exact model and its output head) against
 *      OpenBLAS sgemm on the same weight-product shapes with the same
 *      threads, and the peak memory against file + a weight tile per
 *      thread + activations;
 *   2. a kvq-alloc sensitivity pass (kvq-eval --per-layer: each layer alone
 *      quantized) for two grid points, in exact passes: the saving of
 *      starting each layer's run from the exact model's state;
 *   3. with LLAMA_PERPLEXITY=path/to/llama-perplexity (built by
 *      ../shared/tools/build-llama-perplexity.sh DIR; never a test
 *      dependency), one 512-token --chunk window of a generated text, run
 *      side by side: llama-perplexity once per KV-cache type (f16, q8_0,
 *      q4_0) against one kvq-eval run of the same three (-q none, ggml
 *      q8_0, ggml q4_0), seconds per configuration and their ratio;
 *      kvq-eval -q none alone (the exact pass: what -q none costs); and
 *      kvq-eval with llama-perplexity's own three caches (ggml f16, q8_0,
 *      q4_0: four streams with its exact one) against the three runs.
 * Every figure is printed with the machine, OpenBLAS's core and the sgemm
 * rate measured in the same run.
 *   kvq-bench-model [BUILD_DIR] [TOKENS]   (run by `meson test --benchmark`) */
#include "gguf_writer.h"
#include "formats/formats.h"

#include <cblas.h>
#include <fcntl.h>
#include <omp.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static const char *prog = "kvq-bench-model";

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + 1e-9 * ts.tv_nsec;
}

/* The model file (written once): 2 layers of Llama-3-8B, q4_K, output q6_K, 128256 tokens. */
static void write_model(const char *path, const char *vocab_src)
{
    gw_model_opts o = {"llama", 2, 32, 8, 128, 14336, 128256, 8192, KVQ_GGML_Q4_K, 0, 0, vocab_src ? 0 : 1, 77};
    fprintf(stderr, "%s: writing %s (once; %s vocabulary)\n", prog, path, vocab_src ? "Llama 3's" : "a synthetic");
    gguf_w w;
    gw_tiny_model(&w, &o);
    if (vocab_src && gw_copy_kvs(&w, vocab_src, "tokenizer.") <= 0) {
        fprintf(stderr, "%s: %s: cannot read its tokenizer\n", prog, vocab_src);
        exit(1);
    }
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
    char tmp[4200];
    snprintf(tmp, sizeof tmp, "%s.tmp", path);
    if (gw_write_file(tmp, p, n) || rename(tmp, path)) {
        perror(path);
        exit(1);
    }
    free(p);
}

/* A text of about `words` English words (seeded), for both tokenizers. */
static void write_text(const char *path, int words)
{
    static const char *const w[] = {"the", "little", "cat", "sat", "on", "a", "warm", "mat", "and", "looked", "at",
                                    "bird", "in", "tree", "while", "sun", "went", "down", "over", "quiet", "town",
                                    "she", "said", "that", "it", "was", "time", "to", "go", "home", "with", "her",
                                    "friend", "who", "liked", "red", "apples", "very", "much", "every", "day"};
    FILE *f = fopen(path, "w");
    if (!f) { perror(path); exit(1); }
    uint64_t s = 12345;
    for (int i = 0; i < words; i++) {
        const char *x = w[gw_rand(&s) % (sizeof w / sizeof w[0])];
        fprintf(f, "%s%s", x, i % 12 == 11 ? ".\n" : " ");
    }
    if (fclose(f)) { perror(path); exit(1); }
}

/* Runs argv with stdout (and stderr into errlog, when given) redirected;
 * returns the wall seconds, the peak RSS in MB in *rss_mb; a failure ends
 * the benchmark, or with may_fail returns -1. */
static double run_tool_or(char *const *argv, const char *errlog, double *rss_mb, int may_fail)
{
    fflush(NULL);
    double t0 = now();
    pid_t pid = fork();
    if (pid == 0) {
        int fd = open("/dev/null", O_WRONLY);
        if (fd < 0 || dup2(fd, STDOUT_FILENO) < 0) _exit(127);
        if (errlog) {
            int e = open(errlog, O_WRONLY | O_CREAT | O_TRUNC, 0644);
            if (e < 0 || dup2(e, STDERR_FILENO) < 0) _exit(127);
        }
        execv(argv[0], argv);
        _exit(127);
    }
    int status;
    struct rusage ru;
    if (pid < 0 || wait4(pid, &status, 0, &ru) != pid || !WIFEXITED(status) || WEXITSTATUS(status)) {
        if (may_fail) return -1;
        fprintf(stderr, "%s: %s failed%s%s\n", prog, argv[0], errlog ? "; see " : "", errlog ? errlog : "");
        exit(1);
    }
    if (rss_mb) *rss_mb = ru.ru_maxrss / 1024.0;
    return now() - t0;
}

static double run_tool(char *const *argv, const char *errlog, double *rss_mb)
{
    return run_tool_or(argv, errlog, rss_mb, 0);
}

/* llama-perplexity's own "N seconds per pass" from its log (-1 if absent). */
static double seconds_per_pass(const char *log)
{
    FILE *f = fopen(log, "r");
    char line[1024];
    double s = -1;
    while (f && fgets(line, sizeof line, f)) {
        char *p = strstr(line, " seconds per pass");
        if (!p) continue;
        while (p > line && (p[-1] == '.' || (p[-1] >= '0' && p[-1] <= '9'))) p--;
        s = atof(p);
    }
    if (f) fclose(f);
    return s;
}

static void cpu_name(char *buf, size_t n)
{
    FILE *f = fopen("/proc/cpuinfo", "r");
    char line[512];
    snprintf(buf, n, "unknown CPU");
    while (f && fgets(line, sizeof line, f))
        if (!strncmp(line, "model name", 10) && strchr(line, ':')) {
            snprintf(buf, n, "%s", strchr(line, ':') + 2);
            buf[strcspn(buf, "\n")] = 0;
            break;
        }
    if (f) fclose(f);
}

int main(int argc, char **argv)
{
    const char *dir = argc > 1 ? argv[1] : ".";
    int T = argc > 2 ? atoi(argv[2]) : 2048, nt = omp_get_num_procs();
    char path[4096], vocab[4096], text[4096], cpu[256];
    snprintf(vocab, sizeof vocab, "%s/../shared/data/models-tiny/tiny-llama3.gguf", KVQ_SOURCE_ROOT);
    int real_vocab = access(vocab, R_OK) == 0;
    snprintf(path, sizeof path, "%s/bench-llama3-8b-2layers-q4_K-%s.gguf", dir, real_vocab ? "llama3vocab" : "spm128k");
    struct stat sb;
    if (stat(path, &sb) != 0) {
        write_model(path, real_vocab ? vocab : NULL);
        stat(path, &sb);
    }
    cpu_name(cpu, sizeof cpu);
    kvq_model *m;
    kvq_error err = {0};
    if (kvq_model_open(path, NULL, &m, &err)) { fprintf(stderr, "%s: %s\n", prog, err.msg); return 1; }
    const kvq_model_info *in = kvq_model_get_info(m);
    int *tok = malloc((size_t)T * sizeof *tok);
    for (int t = 0; t < T; t++) tok[t] = t ? (int)((t * 7919u) % (unsigned)in->vocab_size) : 1;

    /* 1. the forward pass: best of 2 */
    double best = 1e30, nll = 0;
    kvq_eval_opts eo = {.nthreads = nt};
    for (int r = 0; r < 2; r++) {
        double t0 = now();
        if (kvq_model_eval(m, tok, T, NULL, 0, &eo, &nll, &err)) {
            fprintf(stderr, "%s: %s\n", prog, err.msg);
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
    free(W), free(X), free(Y);
    /* 2. one kvq-alloc sensitivity pass (kvq-eval --per-layer: every layer
     * alone quantized, in lockstep with the exact model), for two grid points */
    const char *pass_specs[] = {"kivi:bits=2", "per-token:bits=4"};
    double pass_s[2];
    for (int p = 0; p < 2; p++) {
        kvq_spec sp;
        kvq_eval_item items[64];
        if (kvq_spec_parse(pass_specs[p], &sp, &err) || in->n_layers > 64) {
            fprintf(stderr, "%s: %s\n", prog, err.msg);
            return 1;
        }
        for (int l = 0; l < in->n_layers; l++) items[l] = (kvq_eval_item){.spec = &sp, .layer = l};
        double t0 = now();
        if (kvq_model_eval(m, tok, T, items, in->n_layers, &eo, &nll, &err)) {
            fprintf(stderr, "%s: %s\n", prog, err.msg);
            return 1;
        }
        pass_s[p] = now() - t0;
    }
    /* what the forward pass allocates: a weight tile per thread (512 rows of
     * the widest matrix), its activations (the hidden state, x̂, x_o, q,
     * att, Q by head, k, v, K, V, pre-RoPE K, gate), the output head's
     * logits and normed states, and each thread's attention scores and up
     * activations of a column tile (not counted: OpenBLAS's own buffers,
     * the vocabulary's index) */
    double tiles = 4.0 * 512 * (F > dim ? F : dim) * nt;
    size_t lim = (16u << 20) / (size_t)(T - 1 > dim ? T - 1 : dim);
    double vc = lim >= (size_t)V ? V : (double)(lim / 512 * 512);
    double act = 4.0 * T * (3.0 * dim + 3.0 * qd + 5.0 * kd + F) + 4.0 * vc * T + 4.0 * T * dim +
                 (double)nt * 4.0 * (64 + 512) * T;
    printf("%s: %s; OpenBLAS %s core, %d threads\n", prog, cpu, openblas_get_corename(), nt);
    printf("  model: %s, %d layers, dim %d, vocabulary %d (%s)\n", in->format, in->n_layers, dim, V,
           real_vocab ? "Llama 3's" : "synthetic");
    printf("  prefill + output head, %d tokens: %.2f s (%.1f GFLOP/s of weight products; mean NLL %.3f)\n", T, best,
           flops / best * 1e-9, nll);
    printf("  sgemm on the same shapes: %.2f s (%.1f GFLOP/s)\n", sg, flops / sg * 1e-9);
    printf("  ratio: %.0f %% of the sgemm rate (target >= 70 %%)\n", 100.0 * sg / best);
    printf("  peak memory of the forward pass %.0f MB; file %.0f MB + weight tiles %.0f MB + activations %.0f MB = "
           "%.0f MB\n",
           ru.ru_maxrss / 1024.0, sb.st_size / 1048576.0, tiles / 1048576.0, act / 1048576.0,
           (sb.st_size + tiles + act) / 1048576.0);
    for (int p = 0; p < 2; p++)
        printf("  kvq-alloc sensitivity pass (%d layers each alone quantized), %s: %.2f s = %.2f exact passes "
               "(1 + %d if each item recomputed the exact layers before its own)\n",
               in->n_layers, pass_specs[p], pass_s[p], pass_s[p] / best, in->n_layers);
    kvq_model_close(m);
    free(tok);

    /* 3. kvq-eval beside llama-perplexity on one 512-token window */
    const char *llama = getenv("LLAMA_PERPLEXITY");
    snprintf(text, sizeof text, "%s/bench-text-2400w.txt", dir);
    if (stat(text, &sb) != 0) write_text(text, 2400);
    char kvq_eval[4200], ntb[16], log[4200];
    snprintf(kvq_eval, sizeof kvq_eval, "%s/tools/kvq-eval", dir);
    snprintf(ntb, sizeof ntb, "%d", nt);
    snprintf(log, sizeof log, "%s/bench-model-llama.log", dir);
    /* kvq-eval's runs: the same arguments, then each run's caches (-q) */
    enum { RUNS = 3, BASE = 12, MAXQ = 3, EVAL_ROUNDS = 3 };
    char *base[BASE] = {kvq_eval,   path, "--text",    text, "--chunk",    "512",
                        "--chunks", "1",  "--threads", ntb,  "--progress", "never"};
    const char *caches[RUNS][MAXQ] = {
        {"none", "ggml:ktype=q8_0,vtype=q8_0", "ggml:ktype=q4_0,vtype=q4_0"}, /* the three */
        {"none"},                                                             /* the exact pass alone */
        /* llama-perplexity's own three caches, each a stream beside kvq's exact one */
        {"ggml:ktype=f16,vtype=f16", "ggml:ktype=q8_0,vtype=q8_0", "ggml:ktype=q4_0,vtype=q4_0"}};
    char *runs[RUNS][BASE + 2 * MAXQ + 1];
    double kbest[RUNS], rss_of[RUNS];
    for (int k = 0; k < RUNS; k++) {
        int n = BASE;
        memcpy(runs[k], base, sizeof base);
        for (int q = 0; q < MAXQ && caches[k][q]; q++) runs[k][n++] = "-q", runs[k][n++] = (char *)caches[k][q];
        runs[k][n] = NULL, kbest[k] = 1e30, rss_of[k] = 0;
    }
    /* llama-perplexity's runs, one per cache type: llama.cpp v0.5.0's AMX
     * matmul (its repacked weights) crashes in some VMs whose CPUs list AMX
     * (seen on a 2-core Xeon): then every run is made with --no-repack, its
     * generic quantized dot products */
    const char *types[] = {"f16", "q8_0", "q4_0"};
    int with_llama = llama && real_vocab, no_repack = 0;
    double lp_pass[3], lp_wall[3], lp_rss[3], sum_pass = 0, sum_wall = 0;
    char *first[] = {(char *)llama, "-m", path, "-f", text, "-c", "512", "--chunks", "1", "-t", ntb, NULL};
    char *lp[3][sizeof first / sizeof first[0] + 5]; /* first's, -ctk T -ctv T, --no-repack */
    if (with_llama) {
        no_repack = run_tool_or(first, log, NULL, 1) < 0;
        for (int i = 0; i < 3; i++) {
            char **a = lp[i];
            int n = 0;
            for (char **f = first; *f; f++) a[n++] = *f; /* the same arguments, then the cache's */
            a[n++] = "-ctk", a[n++] = (char *)types[i], a[n++] = "-ctv", a[n++] = (char *)types[i];
            if (no_repack) a[n++] = "--no-repack";
            a[n] = NULL;
            lp_pass[i] = lp_wall[i] = 1e30;
        }
    }
    /* rounds taken in turn (kvq-eval's runs, then llama-perplexity's), the
     * best of each: a slow minute falls on both tools alike */
    for (int r = 0; r < EVAL_ROUNDS; r++) {
        for (int k = 0; k < RUNS; k++) {
            double mb, t = run_tool(runs[k], NULL, &mb);
            if (t < kbest[k]) kbest[k] = t, rss_of[k] = mb;
        }
        for (int i = 0; with_llama && i < 3; i++) {
            double rss, t = run_tool(lp[i], log, &rss), pp = seconds_per_pass(log);
            if (t < lp_wall[i]) lp_wall[i] = t, lp_rss[i] = rss;
            if (pp > 0 && pp < lp_pass[i]) lp_pass[i] = pp;
        }
    }
    double k3 = kbest[0], k1 = kbest[1], kg = kbest[2], rss3 = rss_of[0], rss1 = rss_of[1], rssg = rss_of[2];
    printf("  kvq-eval, one 512-token --chunk window (wall time, best of %d rounds taken in turn with "
           "llama-perplexity's, model loading and tokenizing included):\n",
           EVAL_ROUNDS);
    printf("    -q none alone (the exact pass): %.2f s, %.0f MB\n", k1, rss1);
    printf("    -q none + ggml q8_0 + ggml q4_0: %.2f s = %.2f s per configuration, %.0f MB\n", k3, k3 / 3, rss3);
    printf("    ggml f16 + q8_0 + q4_0 (four streams: the exact one and three caches): %.2f s, %.0f MB\n", kg, rssg);
    if (!with_llama) {
        printf("  llama-perplexity: %s\n", !real_vocab ? "no comparison without Llama 3's vocabulary (../shared)"
               : "set LLAMA_PERPLEXITY to its binary for the comparison (../shared/tools/build-llama-perplexity.sh "
                 "DIR builds llama.cpp v0.5.0's)");
        return 0;
    }
    if (no_repack)
        printf("  note: llama-perplexity failed with its repacked weights (see %s); its runs use --no-repack\n", log);
    for (int i = 0; i < 3; i++) sum_pass += lp_pass[i], sum_wall += lp_wall[i];
    printf("  llama-perplexity (%s), the same window, model, threads (best of %d):\n", llama, EVAL_ROUNDS);
    for (int i = 0; i < 3; i++)
        printf("    -ctk %s -ctv %s: %.2f s per pass (its own count), %.2f s wall, %.0f MB\n", types[i], types[i],
               lp_pass[i], lp_wall[i], lp_rss[i]);
    printf("  kvq-eval per configuration / llama-perplexity per pass: %.2f s / %.2f s = %.2f "
           "(wall against wall: %.2f s / %.2f s = %.2f)\n",
           k3 / 3, sum_pass / 3, k3 / 3 / (sum_pass / 3), k3 / 3, sum_wall / 3, k3 / sum_wall);
    printf("  kvq-eval -q none / llama-perplexity f16 cache: %.2f s / %.2f s per pass = %.2f\n", k1, lp_pass[0],
           k1 / lp_pass[0]);
    printf("  kvq-eval with llama-perplexity's three caches / its three runs: %.2f s / %.2f s wall = %.2f\n", kg,
           sum_wall, kg / sum_wall);
    return 0;
}

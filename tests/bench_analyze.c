/* bench_analyze.c — kvq-bench-analyze: kvq-analyze against its floor.
 * The attention metrics need, per layer and query head, two GEMMs for the
 * exact cache (S = Q·Kᵀ, A·V) and three per quantizer (S', A·V', A'·V'),
 * each 2·P·T·D FLOP for P query rows.  That is the floor; everything else
 * (reading, converting, quantizing, softmax) should be small beside it.
 * This runs the real tool (fork + exec, so start-up and loading count) on
 *   A: one Llama-3-8B-shaped layer (32 query / 8 KV heads, D 128, 4096
 *      tokens, float16), two 2-bit quantizers;
 *   B: four such layers of 8192 tokens, kvq-analyze's default set;
 *   B': B with as many per-token quantizers instead (the attention
 *      pipeline alone: B − B' is what the default set's quantizers cost),
 *      and that cost quantizer by quantizer on one of B's layers;
 * and prints the wall time (best of the runs), the floor (the FLOP count at
 * the sgemm rate measured here, in this run, on one query head's shapes
 * with the same threads: one single-threaded sgemm per thread, as kvq runs
 * them), their ratio and the tool's peak RSS; then the same against the
 * sgemm rate with operands that are not in cache, as kvq's never are, and
 * against the rate at the stacked shape kvq runs (a KV head's G query heads
 * in one product), which is faster than one head's: the strictest floor.
 * Then the kernel choice: one of B's layers as the tool runs against each
 * OpenBLAS core this CPU can run, forced (OPENBLAS_CORETYPE).  Last,
 * provenance: -o (the dump's SHA-256 in the record) against --no-hash, on
 * a file whose checksum kvq's cache holds and on a first run, and the CPU
 * time a first run adds.
 *   kvq-bench-analyze [BUILD_DIR]   (run by `meson test --benchmark`) */
#include "kvq.h"

#include <cblas.h>
#include <fcntl.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + 1e-9 * ts.tv_nsec;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

/* The median of v[0..n) (n odd), which it sorts. */
static double median(double *v, int n)
{
    qsort(v, (size_t)n, sizeof v[0], cmp_double);
    return v[n / 2];
}

/* The Llama-3-8B shape of every dump here, which report() counts FLOP by */
enum { HQ = 32, HKV = 8, HEAD_DIM = 128 };

static void make_dump(const char *path, int layers, int tokens)
{
    struct stat sb;
    if (stat(path, &sb) == 0) return;
    kvq_gen_opts o;
    kvq_gen_defaults(&o);
    o.num_layers = layers, o.num_heads = HQ, o.num_kv_heads = HKV, o.head_dim = HEAD_DIM, o.seq_len = tokens;
    o.rope_theta = 500000, o.rope_style = KVQ_ROPE_HALF, o.dtype = KVQ_F16;
    kvq_error err = {0};
    fprintf(stderr, "kvq-bench-analyze: writing %s (once)\n", path);
    if (kvq_gen_write(path, &o, &err)) {
        fprintf(stderr, "kvq-bench-analyze: %s\n", err.msg);
        exit(1);
    }
}

/* The environment variable `name` for the runs that follow: v, or unset
 * when v is NULL. */
static void set_env(const char *name, const char *v)
{
    if (v)
        setenv(name, v, 1);
    else
        unsetenv(name);
}

/* The provenance runs' arguments: A's analysis of dump into OUT, with
 * --no-hash when nohash; argv holds PROV_ARGS. */
enum { PROV_ARGS = 13 };
static void provenance_argv(char **argv, char *tool, char *out, int nohash, char *dump)
{
    char *base[] = {tool, "-q", "kivi:bits=2", "-q", "per-token:bits=2", "--per", "model", "-o", out};
    int n = 0;
    for (size_t i = 0; i < sizeof base / sizeof base[0]; i++) argv[n++] = base[i];
    if (nohash) argv[n++] = "--no-hash";
    argv[n++] = dump, argv[n] = NULL;
}

/* Runs argv with stdout to /dev/null; returns the wall seconds, the child's
 * peak RSS in MB and its CPU seconds (user + system, all its threads). */
static double run_tool_cpu(char *const *argv, double *rss_mb, double *cpu_s)
{
    fflush(NULL); /* nothing buffered here is written twice by the child */
    double t0 = now();
    pid_t pid = fork();
    if (pid == 0) {
        int fd = open("/dev/null", O_WRONLY);
        if (fd < 0 || dup2(fd, STDOUT_FILENO) < 0) _exit(127);
        execv(argv[0], argv);
        _exit(127);
    }
    int status;
    struct rusage ru;
    if (pid < 0 || wait4(pid, &status, 0, &ru) != pid || !WIFEXITED(status) || WEXITSTATUS(status)) {
        fprintf(stderr, "kvq-bench-analyze: %s failed\n", argv[0]);
        exit(1);
    }
    *rss_mb = ru.ru_maxrss / 1024.0;
    *cpu_s = ru.ru_utime.tv_sec + ru.ru_stime.tv_sec + (ru.ru_utime.tv_usec + ru.ru_stime.tv_usec) * 1e-6;
    return now() - t0;
}

/* run_tool_cpu without the CPU time. */
static double run_tool(char *const *argv, double *rss_mb)
{
    double cpu;
    return run_tool_cpu(argv, rss_mb, &cpu);
}

/* GFLOP/s of sgemm on one query head's shapes (P×D·D×T and P×T·T×D), one
 * single-threaded sgemm per thread on its own buffers, nt threads at once,
 * in two ways: *hot with one K matrix per thread, in cache from call to
 * call (the strict floor); *cold cycling through COLD_KEYS of them (more
 * than the last-level cache holds), so that the operand comes from memory,
 * as kvq's K' and V' do: each quantizer's output is read once per query
 * head after the others'.  The best of 10 rounds of each, alternating, as
 * the tool's times are the best of their runs (a shared machine's
 * neighbours move both by tens of percent). */
#define COLD_KEYS 16
static void sgemm_rates(int P, int T, int D, int nt, double *hot, double *cold)
{
    /* cold NULL: the hot rate only (10 rounds) */
    openblas_set_num_threads(1);
    double best[2] = {1e30, 1e30};
    int reps = 16;
#pragma omp parallel num_threads(nt)
    {
        float *Q = malloc(sizeof(float) * P * D), *S = malloc(sizeof(float) * P * T);
        float *O = malloc(sizeof(float) * P * D), *K[COLD_KEYS];
        for (int i = 0; i < P * D; i++) Q[i] = 1e-3f * (float)(i % 7);
        for (int b = 0; b < COLD_KEYS; b++) {
            K[b] = malloc(sizeof(float) * T * D);
            for (long i = 0; i < (long)T * D; i++) K[b][i] = 1e-3f * (float)(i % 5 + b);
        }
        for (int r = 0; r < (cold ? 20 : 10); r++) {
            int nkeys = cold && r % 2 ? COLD_KEYS : 1;
#pragma omp barrier
            double t0 = now();
            for (int k = 0; k < reps; k++) {
                const float *Kk = K[k % nkeys];
                cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, P, T, D, 1.0f, Q, D, Kk, D, 0.0f, S, T);
                cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, P, D, T, 1.0f, S, T, Kk, D, 0.0f, O, D);
            }
#pragma omp barrier
#pragma omp single
            {
                double dt = now() - t0;
                int k = cold ? r % 2 : 0;
                if (dt < best[k]) best[k] = dt;
            }
        }
        for (int b = 0; b < COLD_KEYS; b++) free(K[b]);
        free(Q), free(S), free(O);
    }
    double flop = 2.0 * 2.0 * P * T * D * reps * nt;
    *hot = flop / best[0] / 1e9;
    if (cold) *cold = flop / best[1] / 1e9;
}

/* The FLOP of `products` attention GEMMs (each 2·P·T·D) per query head, over `layers`. */
static double attention_flop(int layers, int T, double products, int P)
{
    return (double)layers * HQ * products * 2.0 * P * T * HEAD_DIM;
}

/* The default set as kvq-analyze runs it without --calib (it leaves out the
 * default specs that need one: cluster, kvquant's nuq): its quantizers'
 * names into names[0..DEFAULT_SET_MAX), their count returned. */
enum { DEFAULT_SET_MAX = 32 };
static int default_set(const char *names[DEFAULT_SET_MAX])
{
    int n = 0;
    for (size_t i = 0; i < kvq_quantizer_count() && n < DEFAULT_SET_MAX; i++) {
        const kvq_quantizer *q = kvq_quantizer_at(i);
        kvq_spec sp;
        kvq_error err = {0};
        if (kvq_quantizer_in_default_set(q) && !kvq_spec_default(q, &sp, &err) && !kvq_spec_needs_calib(&sp))
            names[n++] = kvq_quantizer_name(q);
    }
    return n;
}

/* The run against the strict floor (the target's: one query head's
 * shapes) and, for reference, against the floor with operands from memory
 * and against the sgemm rate at the stacked shape kvq runs: the G = HQ/HKV
 * query heads of a KV head in one product (M = G·P; attention.c's
 * group_heads), which OpenBLAS runs faster than M = P. */
static void report(const char *name, int layers, int T, int nspecs, int P, int nt, double t, double rss)
{
    const int G = HQ / HKV, D = HEAD_DIM;
    double flop = attention_flop(layers, T, 2 + 3.0 * nspecs, P), rate, cold, stacked;
    sgemm_rates(P, T, D, nt, &rate, &cold);
    sgemm_rates(G * P, T, D, nt, &stacked, NULL);
    double floor_s = flop / (rate * 1e9), cold_s = flop / (cold * 1e9), stacked_s = flop / (stacked * 1e9);
    printf("%s: %.3f s; floor %.3f s (%.1f GFLOP at %.1f GFLOP/s, sgemm on one query head's shapes, %d threads); "
           "ratio %.2fx (target <= 1.5x); peak RSS %.0f MB\n"
           "   with the GEMM operands read from memory, as kvq's are: floor %.3f s (%.1f GFLOP/s), ratio %.2fx\n"
           "   at the stacked shape kvq runs (M = %d rows, operands in cache): floor %.3f s (%.1f GFLOP/s), "
           "ratio %.2fx\n",
           name, t, floor_s, flop / 1e9, rate, nt, t / floor_s, rss, cold_s, cold, t / cold_s, G * P, stacked_s,
           stacked, t / stacked_s);
}

/* B by quantizer: on one layer of B's dump, the wall time of a base run
 * (per-token:bits=4 alone: not the default per-token spec, whose K' would
 * repeat the base's and take its scores) and of the base with each
 * default-set quantizer added (its default spec), the best of BYQ_RUNS
 * rounds taken in turn, so that a slow minute falls on every quantizer
 * alike.  A quantizer's increment over the base is its attention work
 * (what per-token's own increment is: its three products, softmax and
 * sums) plus its own work (rotations, low rank, searches): the increment
 * less per-token's is what B − B' spreads over the default set.  Alone,
 * a quantizer does all of its own work; in the default set TurboQuant
 * takes its first stage from `lloydmax`'s output, so its share of B is
 * smaller.  What a run pays once (the first touch of a quantizer's
 * buffers, its codebooks) counts whole on one layer, where B spreads it
 * over four. */
enum { BYQ_RUNS = 3 };
static void by_quantizer(char *tool, char *b_path, int T, int P, int nt)
{
    const char *names[DEFAULT_SET_MAX];
    int n = default_set(names);
    /* row 0: the base; row 1 + i: the base and names[i] */
    double best[DEFAULT_SET_MAX + 1], rss;
    for (int i = 0; i <= DEFAULT_SET_MAX; i++) best[i] = 1e30;
    for (int r = 0; r < BYQ_RUNS; r++)
        for (int i = 0; i <= n; i++) {
            char *argv[12];
            int a = 0;
            argv[a++] = tool, argv[a++] = "--per", argv[a++] = "model", argv[a++] = "--layers", argv[a++] = "0";
            argv[a++] = "-q", argv[a++] = "per-token:bits=4";
            if (i) argv[a++] = "-q", argv[a++] = (char *)names[i - 1];
            argv[a++] = b_path, argv[a] = NULL;
            double t = run_tool(argv, &rss);
            if (t < best[i]) best[i] = t;
        }
    double rate;
    sgemm_rates(P, T, HEAD_DIM, nt, &rate, NULL);
    /* one quantizer's three products on one layer, at the strict floor's rate */
    double share = attention_flop(1, T, 3, P) / (rate * 1e9), attn = 0;
    for (int i = 0; i < n; i++)
        if (!strcmp(names[i], "per-token")) attn = best[1 + i] - best[0];
    printf("B by quantizer, one layer of %d tokens (best of %d rounds): per-token:bits=4 alone %.3f s; each "
           "default-set quantizer added to it, its increment and its own work (the increment less per-token's "
           "%.3f s, %.2fx its three products' floor of %.3f s at %.1f GFLOP/s; what a run pays once counts "
           "whole here):\n",
           T, BYQ_RUNS, best[0], attn, attn / share, share, rate);
    for (int i = 0; i < n; i++)
        printf("   %-12s +%.3f s, own %+.3f s\n", names[i], best[1 + i] - best[0], best[1 + i] - best[0] - attn);
}

/* The cores worth forcing on this CPU: the best one it can run (libkvq's
 * probe, kvq_blas_core_for_cpu), Cooperlake beside SkylakeX where the CPU
 * has AVX512-BF16, and below an AVX-512 core the AVX2 ones, into cores[];
 * their count (0: not x86-64, or no AVX2 core: nothing to compare). */
enum { KC_MAX = 4, KC_RUNS = 3 };
static int forced_cores(const char *cores[KC_MAX])
{
    const char *top = kvq_blas_core_for_cpu();
    int n = 0, avx512 = top && !strcmp(top, "SkylakeX");
    if (avx512) {
        cores[n++] = "SkylakeX";
#if defined(__x86_64__) && defined(__GNUC__)
        if (__builtin_cpu_supports("avx512bf16")) cores[n++] = "Cooperlake";
#endif
    }
    if (avx512 || (top && (!strcmp(top, "Haswell") || !strcmp(top, "Zen")))) cores[n++] = "Haswell", cores[n++] = "Zen";
    return n;
}

/* The core line of `tool --version` ("core X, ..." up to the line's end)
 * into buf; "" when it cannot be run or read. */
static void tool_core(const char *tool, char *buf, size_t len)
{
    char cmd[4200], line[512];
    buf[0] = '\0';
    snprintf(cmd, sizeof cmd, "'%s' --version 2>/dev/null", tool);
    FILE *f = popen(cmd, "r");
    while (f && fgets(line, sizeof line, f)) {
        char *c = strstr(line, "core ");
        if (c && !buf[0]) {
            c[strcspn(c, "\n")] = '\0';
            snprintf(buf, len, "%s", c);
        }
    }
    if (f) pclose(f);
}

/* Kernel choice: one of B's layers with the default set, as the tool runs
 * (OpenBLAS's pick, kvq's restart's, or the core the environment sets)
 * against each core this CPU can run forced through OPENBLAS_CORETYPE, the
 * best of KC_RUNS rounds taken in turn; the tool's time against the
 * fastest.  The environment's OPENBLAS_CORETYPE is restored afterwards. */
static void kernel_choice(char *tool, char *b_path, int T)
{
    const char *cores[KC_MAX];
    int n = forced_cores(cores);
    if (!n) {
        printf("kernel choice: no x86-64 cores to compare on this CPU\n");
        return;
    }
    const char *env = getenv("OPENBLAS_CORETYPE");
    char *kept = env ? strdup(env) : NULL, own[512];
    tool_core(tool, own, sizeof own);
    /* the default set by name, as B counts it: kvq-analyze's note on the
     * specs it leaves out (those that need --calib) is not printed 15 times */
    const char *names[DEFAULT_SET_MAX];
    char *argv[2 * DEFAULT_SET_MAX + 7];
    int a = 0, nq = default_set(names);
    argv[a++] = tool, argv[a++] = "--per", argv[a++] = "model", argv[a++] = "--layers", argv[a++] = "0";
    for (int q = 0; q < nq; q++) argv[a++] = "-q", argv[a++] = (char *)names[q];
    argv[a++] = b_path, argv[a] = NULL;
    double best[KC_MAX + 1], rss; /* 0: as the tool runs; 1 + i: cores[i] */
    for (int i = 0; i <= n; i++) best[i] = 1e30;
    for (int r = 0; r < KC_RUNS; r++)
        for (int i = 0; i <= n; i++) {
            set_env("OPENBLAS_CORETYPE", i ? cores[i - 1] : kept);
            double t = run_tool(argv, &rss);
            if (t < best[i]) best[i] = t;
        }
    set_env("OPENBLAS_CORETYPE", kept);
    free(kept);
    double fastest = best[0];
    printf("kernel choice, one layer of %d tokens, default set (best of %d rounds): as the tool runs (%s) %.3f s;", T,
           KC_RUNS, own[0] ? own : "core unknown", best[0]);
    for (int i = 0; i < n; i++) {
        printf("%s OPENBLAS_CORETYPE=%s %.3f s", i ? "," : "", cores[i], best[1 + i]);
        if (best[1 + i] < fastest) fastest = best[1 + i];
    }
    printf("; the tool's choice %.3fx the fastest (target <= 1.15x)\n", best[0] / fastest);
}

int main(int argc, char **argv)
{
    if (argc > 2 || (argc == 2 && argv[1][0] == '-')) {
        fprintf(stderr, "usage: kvq-bench-analyze [BUILD_DIR]\n");
        return 2;
    }
    const char *dir = argc > 1 ? argv[1] : ".";
    char a_path[4096], b_path[4096], tool[4096];
    snprintf(a_path, sizeof a_path, "%s/bench-llama3-8b.h5", dir);
    snprintf(b_path, sizeof b_path, "%s/bench-llama3-8b-8k.h5", dir);
    snprintf(tool, sizeof tool, "%s/tools/kvq-analyze", dir);
    make_dump(a_path, 4, 4096);
    make_dump(b_path, 4, 8192);
    int nt = omp_get_num_procs(), P = 64;
    const char *default_names[DEFAULT_SET_MAX];
    int ndefault = default_set(default_names);
    printf("kvq-bench-analyze: %d cores; kvq-analyze --per model, --queries last:%d (the default)\n", nt, P);

    double rss, best = 1e30, best_rss = 0;
    char *ver[] = {tool, "--version", NULL};
    for (int r = 0; r < 3; r++) {
        double t = run_tool(ver, &rss);
        if (t < best) best = t, best_rss = rss;
    }
    printf("start-up: kvq-analyze --version %.3f s, peak RSS %.0f MB\n", best, best_rss);

    char *a[] = {tool, "-q", "kivi:bits=2", "-q", "per-token:bits=2", "--layers", "0", "--per", "model",
                 a_path, NULL};
    best = 1e30;
    for (int r = 0; r < 5; r++) {
        double t = run_tool(a, &rss);
        if (t < best) best = t, best_rss = rss;
    }
    report("A  1 layer x 4096 tokens, kivi:bits=2 + per-token:bits=2", 1, 4096, 2, P, nt, best, best_rss);

    char *b[] = {tool, "--per", "model", b_path, NULL};
    best = 1e30;
    for (int r = 0; r < 2; r++) {
        double t = run_tool(b, &rss);
        if (t < best) best = t, best_rss = rss;
    }
    char name[128];
    snprintf(name, sizeof name, "B  4 layers x 8192 tokens, default set (%d quantizers)", ndefault);
    report(name, 4, 8192, ndefault, P, nt, best, best_rss);

    /* B': B's attention work (the same dump, as many quantizers, the same
     * products) with quantizers that cost little of their own, per-token at
     * other bits and groups: the attention pipeline against the floor,
     * apart from what the default set's quantizers cost themselves
     * (rotations, GEAR's low rank in double, searches). */
    enum { MAXQ = 14 };
    char cheap[MAXQ][48], *bp[2 * MAXQ + 5];
    int nb = 0, nq = ndefault < MAXQ ? ndefault : MAXQ;
    bp[nb++] = tool;
    for (int i = 0; i < nq; i++) {
        snprintf(cheap[i], sizeof cheap[i], "per-token:bits=%d%s", 2 + i % 7, i < 7 ? "" : ",group=64");
        bp[nb++] = "-q", bp[nb++] = cheap[i];
    }
    bp[nb++] = "--per", bp[nb++] = "model", bp[nb++] = b_path, bp[nb] = NULL;
    best = 1e30;
    for (int r = 0; r < 2; r++) {
        double t = run_tool(bp, &rss);
        if (t < best) best = t, best_rss = rss;
    }
    snprintf(name, sizeof name, "B' B's attention work, %d per-token quantizers (B less the quantizers' own work)", nq);
    report(name, 4, 8192, nq, P, nt, best, best_rss);

    by_quantizer(tool, b_path, 8192, P, nt);
    kernel_choice(tool, b_path, 8192);

    /* provenance: A's analysis of a one-layer dump (56 MB) with -o, which
     * hashes the dump (and OUT) into OUT.meta.json while it works, against
     * --no-hash: a run on a file an earlier run hashed (its checksum from
     * kvq's cache, as every run after the first), and a first run on it
     * (KVQ_HASH_CACHE=off: the whole file through SHA-256); alternating, the
     * medians of 15 runs of each */
    char one[4096], out1[4096], out2[4096], out3[4096];
    snprintf(one, sizeof one, "%s/bench-llama3-8b-1layer.h5", dir);
    snprintf(out1, sizeof out1, "%s/bench-provenance.csv", dir);
    snprintf(out2, sizeof out2, "%s/bench-provenance-nohash.csv", dir);
    snprintf(out3, sizeof out3, "%s/bench-provenance-first.csv", dir);
    make_dump(one, 1, 4096);
    char *h[PROV_ARGS], *nh[PROV_ARGS], *hf[PROV_ARGS];
    provenance_argv(h, tool, out1, 0, one);
    provenance_argv(nh, tool, out2, 1, one);
    provenance_argv(hf, tool, out3, 0, one);
    enum { R = 15 };
    double th[R], tf[R], tn[R], cf[R], cn[R];
    const char *cache = getenv("KVQ_HASH_CACHE");
    char *kept = cache ? strdup(cache) : NULL;
    sleep(2);          /* a file younger than two seconds is not cached */
    run_tool(h, &rss); /* its checksum into the cache */
    for (int r = 0; r < R; r++) {
        set_env("KVQ_HASH_CACHE", kept);
        th[r] = run_tool(h, &rss), tn[r] = run_tool_cpu(nh, &rss, &cn[r]);
        set_env("KVQ_HASH_CACHE", "off");
        tf[r] = run_tool_cpu(hf, &rss, &cf[r]);
    }
    set_env("KVQ_HASH_CACHE", kept);
    free(kept);
    /* the cached runs' record says whether the checksum came from the cache */
    char meta[4200], rec[8192] = "";
    snprintf(meta, sizeof meta, "%s.meta.json", out1);
    FILE *mf = fopen(meta, "r");
    size_t got = mf ? fread(rec, 1, sizeof rec - 1, mf) : 0;
    if (mf) fclose(mf);
    rec[got] = '\0';
    const char *cached = strstr(rec, "\"sha256_cached\": true") ? "" : " (but its record says it was not cached)";
    double cached_s = median(th, R), first_s = median(tf, R), nohash_s = median(tn, R);
    double first_cpu = median(cf, R), nohash_cpu = median(cn, R);
    struct stat sb;
    stat(one, &sb);
    printf("provenance: -o with the %.0f MB dump's SHA-256 from kvq's cache%s %.3f s; hashed whole (a first run on the "
           "file: libcrypto, in a thread) %.3f s; --no-hash %.3f s (medians of %d alternating runs): %.3fx and "
           "%.3fx (target <= 1.08x)\n",
           sb.st_size / 1048576.0, cached, cached_s, first_s, nohash_s, R, cached_s / nohash_s, first_s / nohash_s);
    /* what a first run costs in CPU: where the run keeps every core busy, its
     * wall time grows by that spread over them (docs/performance.md) */
    double added = first_cpu - nohash_cpu;
    printf("   CPU time (medians): a first run %.3f s, --no-hash %.3f s: the hash adds %.0f ms of CPU, %.0f ms "
           "spread over the %d cores (%.3fx)\n",
           first_cpu, nohash_cpu, 1e3 * added, 1e3 * added / nt, nt, (nohash_s + added / nt) / nohash_s);
    return 0;
}

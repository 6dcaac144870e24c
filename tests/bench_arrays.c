/* bench_arrays.c — kvq-bench-arrays: kvq_quantize_arrays (the entry point
 * of the Python package) timed in C on raw float32 K and V, the baseline
 * tests/bench_python.py compares kvq.quantize against.
 *     kvq-bench-arrays K.f32 V.f32 H T D THREADS REPS SPEC...
 * prints "SPEC best_seconds" per spec. */
#include "cli.h" /* cli_tune_malloc: the C baseline runs as the tools do */
#include "analysis/analysis.h"

#include <stdio.h>
#include <stdlib.h>
#include <time.h>

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + 1e-9 * ts.tv_nsec;
}

static float *read_raw(const char *path, size_t n)
{
    FILE *f = fopen(path, "rb");
    float *x = aligned_alloc(64, (n * sizeof *x + 63) / 64 * 64);
    if (!f || !x || fread(x, sizeof *x, n, f) != n) {
        fprintf(stderr, "kvq-bench-arrays: %s: cannot read %zu floats\n", path, n);
        exit(1);
    }
    fclose(f);
    return x;
}

int main(int argc, char **argv)
{
    if (argc < 9) {
        fprintf(stderr, "usage: kvq-bench-arrays K.f32 V.f32 H T D THREADS REPS SPEC...\n");
        return 2;
    }
    cli_tune_malloc();
    int H = atoi(argv[3]), T = atoi(argv[4]), D = atoi(argv[5]), nt = atoi(argv[6]), reps = atoi(argv[7]);
    size_t n = (size_t)H * T * D;
    float *k = read_raw(argv[1], n), *v = read_raw(argv[2], n);
    size_t bytes = (n * sizeof(float) + 63) / 64 * 64; /* line-aligned, as the driver's outputs */
    float *kq = aligned_alloc(64, bytes), *vq = aligned_alloc(64, bytes);
    kvq_acc *acc = calloc((size_t)H, sizeof *acc);
    if (!kq || !vq || !acc) return 1;
    kvq_error err = {0};
    for (int s = 8; s < argc; s++) {
        double best = 1e30;
        for (int r = 0; r < reps; r++) {
            double t0 = now();
            kvq_arrays_opts o = {.spec = argv[s], .nthreads = nt};
            if (kvq_quantize_arrays(&o, H, T, D, k, v, NULL, kq, vq, acc, &err)) {
                fprintf(stderr, "kvq-bench-arrays: %s: %s\n", argv[s], err.msg);
                return 1;
            }
            double t = now() - t0;
            if (t < best) best = t;
        }
        printf("%s %.6f\n", argv[s], best);
    }
    free(k), free(v), free(kq), free(vq), free(acc);
    return 0;
}

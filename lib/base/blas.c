/* blas.c — which OpenBLAS kernels run (docs/performance.md#blas-kernels).
 * OpenBLAS picks its kernels ("core") from the CPUID's family and model; on
 * cloud VMs that mask them it falls back to an old core — Prescott, its
 * 2004 SSE3 kernels, a fifth of the sgemm rate of the AVX-512 ones on the
 * same machine.  kvq probes the instruction sets itself (GCC's CPU check,
 * which also asks the OS whether it saves the wide registers) and says
 * which core this CPU can run when OpenBLAS's choice is below it; the tools
 * then restart once with OPENBLAS_CORETYPE set (tools/cli.c,
 * cli_blas_setup), and the Python package sets it before OpenBLAS loads.
 * A core the user set is never changed. */
#include "../kvq.h"

#include <cblas.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

/* The instruction-set level of an x86-64 OpenBLAS core name (its DYNAMIC_ARCH
 * corename table): 0 SSE, 1 AVX, 2 AVX2 + FMA, 3 AVX-512; -1 a name this
 * table does not know (another architecture, a newer core): left alone. */
static int core_level(const char *name)
{
    static const struct {
        const char *name;
        int level;
    } cores[] = {{"Katmai", 0},       {"Coppermine", 0},  {"Northwood", 0},      {"Prescott", 0},
                 {"Banias", 0},       {"Atom", 0},        {"Core2", 0},          {"Penryn", 0},
                 {"Dunnington", 0},   {"Nehalem", 0},     {"Athlon", 0},         {"Opteron", 0},
                 {"Opteron_SSE3", 0}, {"Barcelona", 0},   {"Nano", 0},           {"Bobcat", 0},
                 {"Sandybridge", 1},  {"Bulldozer", 1},   {"Piledriver", 1},     {"Steamroller", 1},
                 {"Haswell", 2},      {"Excavator", 2},   {"Zen", 2},            {"SkylakeX", 3},
                 {"Cooperlake", 3},   {"SapphireRapids", 3}};
    for (size_t i = 0; name && i < sizeof cores / sizeof cores[0]; i++)
        if (!strcasecmp(name, cores[i].name)) return cores[i].level;
    return -1;
}

/* The best core this CPU can run, and its level (-1, NULL: not x86-64 or unknown). */
static const char *cpu_core(int *level)
{
    *level = -1;
#if defined(__x86_64__) && defined(__GNUC__)
    __builtin_cpu_init();
    int amd = __builtin_cpu_is("amd");
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl") &&
        __builtin_cpu_supports("avx512cd"))
        return *level = 3, "SkylakeX";
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
        return *level = 2, amd ? "Zen" : "Haswell"; /* OpenBLAS's Zen kernels are Haswell's, tuned */
    if (__builtin_cpu_supports("avx")) return *level = 1, amd ? "Bulldozer" : "Sandybridge";
    return *level = 0, NULL;
#else
    return NULL;
#endif
}

const char *kvq_blas_core(void)
{
    const char *c = openblas_get_corename();
    return c ? c : "unknown";
}

const char *kvq_blas_core_for_cpu(void)
{
    int level;
    return cpu_core(&level);
}

const char *kvq_blas_core_detected(void)
{
    const char *t = getenv("KVQ_TEST_BLAS_DETECTED"); /* tests: as if OpenBLAS had chosen this */
    return t && *t ? t : kvq_blas_core();
}

const char *kvq_blas_core_wanted(void)
{
    /* OpenBLAS picks its core once, when it loads, and only DYNAMIC_ARCH
     * builds can pick another */
    const char *cfg = openblas_get_config();
    if (!cfg || !strstr(cfg, "DYNAMIC_ARCH")) return NULL;
    int have = core_level(kvq_blas_core_detected()), level;
    const char *best = cpu_core(&level);
    return best && have >= 0 && have < level ? best : NULL;
}

static char package_choice[32]; /* kvq_blas_note_choice's core ("" none) */

void kvq_blas_note_choice(const char *core)
{
    if (core && core_level(core) >= 0 && strlen(core) < sizeof package_choice)
        snprintf(package_choice, sizeof package_choice, "%s", core);
}

void kvq_blas_core_source(char *buf, size_t len)
{
    const char *user = getenv("OPENBLAS_CORETYPE"), *kvq = getenv("KVQ_BLAS_CORE_DETECTED");
    int user_ok = user && core_level(user) >= 0, kvq_ok = kvq && core_level(kvq) >= 0;
    if (package_choice[0] && (!user || !*user))
        snprintf(buf, len, "chosen by the kvq package before OpenBLAS loaded (OPENBLAS_CORETYPE=%s)", package_choice);
    else if (user && *user && !user_ok)
        snprintf(buf, len, "OPENBLAS_CORETYPE set to a value that is not an OpenBLAS core name; detected by OpenBLAS");
    else if (user_ok && kvq_ok)
        snprintf(buf, len, "chosen by kvq (OPENBLAS_CORETYPE=%s; OpenBLAS detected %s)", user, kvq);
    else if (user_ok && kvq && *kvq)
        snprintf(buf, len, "OPENBLAS_CORETYPE=%s (KVQ_BLAS_CORE_DETECTED holds no core name)", user);
    else if (user_ok)
        snprintf(buf, len, "OPENBLAS_CORETYPE=%s", user);
    else
        snprintf(buf, len, "detected by OpenBLAS");
}

/* The probe behind kvq_blas_rows_independent: R rows of random operands
 * (a fixed generator) in one call against the same rows in calls of 256,
 * 256 and R − 512, for an inner dimension K over several of OpenBLAS's
 * blocks and one within one, with beta 0 and 1.  1: the same bits. */
static int rows_probe(void)
{
    enum { R = 600, N = 200, KMAX = 1000 };
    float *x = malloc((size_t)R * KMAX * sizeof *x), *w = malloc((size_t)N * KMAX * sizeof *w);
    float *c1 = malloc((size_t)R * N * sizeof *c1), *c2 = malloc((size_t)R * N * sizeof *c2);
    int same = x && w && c1 && c2;
    uint32_t s = 12345;
    for (size_t i = 0; same && i < (size_t)(R + N) * KMAX; i++) /* x, then w */
        *(i < (size_t)R * KMAX ? &x[i] : &w[i - (size_t)R * KMAX]) =
            (float)((s = s * 1664525u + 1013904223u) >> 8) * 0x1p-24f - 0.5f;
    const int Ks[] = {KMAX, 48}, nt = openblas_get_num_threads();
    openblas_set_num_threads(1); /* as kvq's products run */
    for (int k = 0; same && k < 2; k++)
        for (int beta = 0; same && beta < 2; beta++) {
            int K = Ks[k];
            for (size_t i = 0; i < (size_t)R * N; i++) c1[i] = c2[i] = (float)i * 0x1p-20f;
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, R, N, K, 1.0f, x, K, w, K, (float)beta, c1, N);
            for (int r = 0; r < R; r += 256)
                cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, R - r < 256 ? R - r : 256, N, K, 1.0f,
                            x + (size_t)r * K, K, w, K, (float)beta, c2 + (size_t)r * N, N);
            same = !memcmp(c1, c2, (size_t)R * N * sizeof *c1);
        }
    openblas_set_num_threads(nt);
    free(x), free(w), free(c1), free(c2);
    return same;
}

int kvq_blas_rows_independent(void)
{
    static int known = -1; /* the probe's answer, once per process */
    int v = __atomic_load_n(&known, __ATOMIC_ACQUIRE);
    if (v >= 0) return v;
    const char *env = getenv("KVQ_BLAS_ROWS");
    v = env && !strcmp(env, "tiles") ? 0 : rows_probe();
    __atomic_store_n(&known, v, __ATOMIC_RELEASE);
    return v;
}

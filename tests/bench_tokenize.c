/* bench_tokenize.c — kvq-bench-tokenize: streamed tokenization (docs/models.md).
 * Writes once a 24 MB English-like text and a small SentencePiece model,
 * then tokenizes the text with --max-tokens 8 (only the first block is
 * read) and whole, each in a child process, and reports the time and the
 * child's peak memory.
 *   kvq-bench-tokenize [BUILD_DIR]   (run by `meson test --benchmark`) */
#include "gguf_writer.h"
#include "formats/formats.h"

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

int main(int argc, char **argv)
{
    const char *dir = argc > 1 ? argv[1] : ".";
    char model[4096], text[4096];
    snprintf(model, sizeof model, "%s/bench-tokenize.gguf", dir);
    snprintf(text, sizeof text, "%s/bench-tokenize-24MB.txt", dir);
    gw_model_opts o = {"llama", 1, 4, 2, 16, 64, 300, 1 << 20, KVQ_GGML_F32, 0, 0, 1, 31};
    gguf_w w;
    gw_tiny_model(&w, &o);
    uint8_t *p;
    size_t n;
    gw_serialise(&w, &p, &n);
    gw_free(&w);
    if (gw_write_file(model, p, n)) { perror(model); return 1; }
    free(p);
    struct stat sb;
    if (stat(text, &sb) != 0 || sb.st_size < 24000000) {
        FILE *f = fopen(text, "wb");
        if (!f) { perror(text); return 1; }
        const char *line = "the cat sat at the inn, and a cat ran in the rain.\n";
        for (size_t done = 0; done < 24000000; done += strlen(line)) fputs(line, f);
        fclose(f);
    }
    printf("kvq-bench-tokenize: %s (24 MB), SentencePiece vocabulary of %d\n", text, o.V);
    for (int mode = 0; mode < 2; mode++) {
        fflush(stdout);
        double t0 = now();
        pid_t pid = fork();
        if (pid == 0) {
            kvq_model *m;
            kvq_error err = {0};
            int *ids;
            size_t k;
            if (kvq_model_open(model, NULL, &m, &err) ||
                kvq_model_tokenize_file(m, text, mode ? 0 : 8, &ids, &k, &err)) {
                fprintf(stderr, "kvq-bench-tokenize: %s\n", err.msg);
                _exit(1);
            }
            printf("  %-16s %zu tokens", mode ? "whole text:" : "--max-tokens 8:", k);
            fflush(stdout);
            _exit(0);
        }
        int status;
        struct rusage ru;
        if (pid < 0 || wait4(pid, &status, 0, &ru) < 0 || !WIFEXITED(status) || WEXITSTATUS(status)) return 1;
        printf(", %.3f s, peak memory %.0f MB\n", now() - t0, ru.ru_maxrss / 1024.0);
    }
    unlink(model);

    /* Gemma 3's vocabulary (../shared): user-defined whitespace tokens cut out
     * of whitespace runs; the time must grow linearly with the text */
    char gemma[4096];
    snprintf(gemma, sizeof gemma, "%s/../shared/data/models-tiny/tiny-gemma3.gguf", KVQ_SOURCE_ROOT);
    kvq_model *g;
    kvq_error err = {0};
    if (access(gemma, R_OK) || kvq_model_open(gemma, NULL, &g, &err)) {
        printf("  Gemma 3 whitespace runs: skipped (no %s)\n", gemma);
        return 0;
    }
    printf("  Gemma 3's vocabulary, \"\\r\\n\\t\" repeated (whitespace runs cut by its user-defined tokens):\n");
    double prev = 0;
    for (size_t len = 100000; len <= 800000; len *= 2) {
        char *t = malloc(len);
        for (size_t i = 0; i < len; i++) t[i] = "\r\n\t"[i % 3];
        int *ids;
        size_t k;
        double t0 = now();
        if (kvq_model_tokenize(g, t, len, &ids, &k, &err)) {
            fprintf(stderr, "kvq-bench-tokenize: %s\n", err.msg);
            return 1;
        }
        double dt = now() - t0;
        printf("    %6zu characters: %zu tokens, %.3f s%s", len, k, dt, prev > 0 ? "" : "\n");
        if (prev > 0) printf(" (x%.2f for twice the text)\n", dt / prev);
        prev = dt;
        free(ids), free(t);
    }
    kvq_model_close(g);
    return 0;
}

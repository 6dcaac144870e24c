/* fingerprint.c — a run's identity for shard files (docs/models.md#shards):
 * FNV-1a over bytes, and over a file's size and its first and last MiB (an
 * input known without reading it whole).  kvq-eval, kvq-alloc and kvq-sweep
 * write it beside their shards' rows; --resume and --merge refuse another. */
#include "kvq_base.h"

#include <stdio.h>
#include <stdlib.h>

uint64_t kvq_fingerprint_bytes(uint64_t h, const void *p, size_t n)
{
    const unsigned char *s = p;
    for (size_t i = 0; i < n; i++) h = (h ^ s[i]) * 1099511628211ull;
    return h;
}

uint64_t kvq_fingerprint_file(uint64_t h, const char *path)
{
    FILE *f = path ? fopen(path, "rb") : NULL;
    if (!f) return kvq_fingerprint_bytes(h, "-", 1);
    enum { MIB = 1 << 20 };
    char *buf = malloc(MIB);
    long long size = -1;
    if (buf && fseek(f, 0, SEEK_END) == 0 && (size = ftell(f)) >= 0 && fseek(f, 0, SEEK_SET) == 0) {
        h = kvq_fingerprint_bytes(h, &size, sizeof size);
        size_t n = fread(buf, 1, MIB, f);
        h = kvq_fingerprint_bytes(h, buf, n);
        if (size > MIB && fseek(f, size - MIB, SEEK_SET) == 0) h = kvq_fingerprint_bytes(h, buf, fread(buf, 1, MIB, f));
    }
    free(buf);
    fclose(f);
    return h;
}

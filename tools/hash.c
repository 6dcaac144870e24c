/* hash.c — SHA-256 for the provenance record (meta.c), through OpenSSL's
 * libcrypto (SHA-NI or AVX2 where the CPU has them: 1.4-1.7 GB/s against
 * ~230 MB/s for a plain C loop), a background hasher that hashes a run's
 * inputs while the run works, so that provenance costs no wall time when a
 * core is free for it, and a cache of the checksums of unchanged files, so
 * that a run on a file an earlier run hashed does not read it again. */
#define _GNU_SOURCE /* SCHED_IDLE */
#include "cli.h"

#include <errno.h>
#include <fcntl.h>
#include <openssl/evp.h>
#include <pthread.h>
#include <sched.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

static void to_hex(const unsigned char *md, char hex[65])
{
    static const char digits[] = "0123456789abcdef";
    for (int i = 0; i < 32; i++) hex[2 * i] = digits[md[i] >> 4], hex[2 * i + 1] = digits[md[i] & 15];
    hex[64] = '\0';
}

/* The SHA-256 of the file's first `limit` bytes (all of it when limit < 0),
 * read with read(2) in 4 MB pieces; *stop (when given) set by another
 * thread ends it early.  0, or -1 with *saved_errno (EIO for a file shorter
 * than limit, ECANCELED when stopped). */
static int hash_fd_prefix(int fd, long long limit, const volatile int *stop, char hex[65], int *saved_errno)
{
    enum { CHUNK = 4 << 20 };
    unsigned char md[32], *buf = malloc(CHUNK);
    EVP_MD_CTX *ctx = EVP_MD_CTX_new();
    int rc = -1;
    *saved_errno = ENOMEM;
    if (!buf || !ctx || EVP_DigestInit_ex(ctx, EVP_sha256(), NULL) != 1) goto done;
    long long left = limit;
    for (;;) {
        if (stop && *stop) { *saved_errno = ECANCELED; goto done; }
        size_t want = limit < 0 || left > CHUNK ? CHUNK : (size_t)left;
        if (!want) break;
        ssize_t n = read(fd, buf, want);
        if (n < 0 && errno == EINTR) continue;
        if (n < 0) { *saved_errno = errno; goto done; }
        if (n == 0) {
            if (limit >= 0) { *saved_errno = EIO; goto done; } /* shorter than when it was recorded */
            break;
        }
        if (EVP_DigestUpdate(ctx, buf, (size_t)n) != 1) { *saved_errno = EIO; goto done; }
        left -= n;
    }
    unsigned int len = 0;
    if (EVP_DigestFinal_ex(ctx, md, &len) != 1 || len != 32) { *saved_errno = EIO; goto done; }
    to_hex(md, hex);
    *saved_errno = 0;
    rc = 0;
done:
    EVP_MD_CTX_free(ctx);
    free(buf);
    return rc;
}

int cli_sha256_file_prefix(const char *path, long long limit, char hex[65], int *saved_errno)
{
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) { *saved_errno = errno; return -1; }
    int rc = hash_fd_prefix(fd, limit, NULL, hex, saved_errno);
    close(fd);
    return rc;
}

int cli_sha256_file(const char *path, char hex[65], int *saved_errno)
{
    return cli_sha256_file_prefix(path, -1, hex, saved_errno);
}

int cli_sha256_mem(const void *p, size_t n, char hex[65])
{
    unsigned char md[32];
    unsigned int len = 0;
    if (EVP_Digest(p, n, md, &len, EVP_sha256(), NULL) != 1 || len != 32) return -1;
    to_hex(md, hex);
    return 0;
}

/* ------------------------------------------------------ background hashing */

struct cli_hash_job {
    char *path;
    long long size; /* the bytes hashed: the size when the input was recorded */
    char sha[65];
    int err, done;
    struct cli_hash_job *next;
};

struct cli_hasher {
    pthread_t tid;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    cli_hash_job *head, *tail, *next; /* every job; the next to hash */
    volatile int stop;
    int started;
};

static void *hasher_main(void *arg)
{
    cli_hasher *h = arg;
#ifdef SCHED_IDLE
    /* a core the run leaves idle (reading, serial phases) is the hash's;
     * the run's threads come first, and the record waits for the rest */
    struct sched_param sp = {0};
    pthread_setschedparam(pthread_self(), SCHED_IDLE, &sp);
#endif
    for (;;) {
        pthread_mutex_lock(&h->mu);
        while (!h->next && !h->stop) pthread_cond_wait(&h->cv, &h->mu);
        cli_hash_job *j = h->stop ? NULL : h->next;
        if (j) h->next = j->next;
        pthread_mutex_unlock(&h->mu);
        if (!j) return NULL;
        char sha[65] = "";
        int err, fd = open(j->path, O_RDONLY | O_CLOEXEC);
        if (fd < 0) err = errno;
        else {
            hash_fd_prefix(fd, j->size, &h->stop, sha, &err);
            close(fd);
        }
        pthread_mutex_lock(&h->mu);
        memcpy(j->sha, sha, sizeof sha);
        j->err = err, j->done = 1;
        pthread_cond_broadcast(&h->cv);
        pthread_mutex_unlock(&h->mu);
    }
}

cli_hasher *cli_hasher_new(void)
{
    cli_hasher *h = calloc(1, sizeof *h);
    if (!h) return NULL;
    if (pthread_mutex_init(&h->mu, NULL)) { free(h); return NULL; }
    if (pthread_cond_init(&h->cv, NULL)) { pthread_mutex_destroy(&h->mu); free(h); return NULL; }
    return h;
}

cli_hash_job *cli_hasher_add(cli_hasher *h, const char *path, long long size)
{
    cli_hash_job *j = calloc(1, sizeof *j);
    if (!j || !(j->path = strdup(path))) { free(j); return NULL; }
    j->size = size;
    pthread_mutex_lock(&h->mu);
    if (!h->started) { /* the thread starts with the first input */
        if (pthread_create(&h->tid, NULL, hasher_main, h)) {
            pthread_mutex_unlock(&h->mu);
            free(j->path), free(j);
            return NULL;
        }
        h->started = 1;
    }
    if (h->tail) h->tail->next = j;
    else h->head = j;
    h->tail = j;
    if (!h->next) h->next = j;
    pthread_cond_broadcast(&h->cv);
    pthread_mutex_unlock(&h->mu);
    return j;
}

int cli_hash_job_wait(cli_hasher *h, cli_hash_job *j, char hex[65], int *saved_errno)
{
    pthread_mutex_lock(&h->mu);
    while (!j->done) pthread_cond_wait(&h->cv, &h->mu);
    pthread_mutex_unlock(&h->mu);
    *saved_errno = j->err;
    if (j->err) return -1;
    memcpy(hex, j->sha, 65);
    return 0;
}

int cli_hash_job_done(cli_hasher *h, cli_hash_job *j)
{
    pthread_mutex_lock(&h->mu);
    int done = j->done;
    pthread_mutex_unlock(&h->mu);
    return done;
}

void cli_hasher_free(cli_hasher *h)
{
    if (!h) return;
    pthread_mutex_lock(&h->mu);
    h->stop = 1; /* an unfinished hash is not wanted any more */
    pthread_cond_broadcast(&h->cv);
    pthread_mutex_unlock(&h->mu);
    if (h->started) pthread_join(h->tid, NULL);
    for (cli_hash_job *j = h->head, *n; j; j = n) {
        n = j->next;
        free(j->path), free(j);
    }
    pthread_cond_destroy(&h->cv);
    pthread_mutex_destroy(&h->mu);
    free(h);
}

/* ------------------------------------------ checksums of unchanged files */

/* Where the known checksums are kept: $KVQ_HASH_CACHE ("off": nowhere),
 * else $XDG_CACHE_HOME/kvq/sha256, else $HOME/.cache/kvq/sha256.  0 and
 * the path in buf, or -1. */
static int cache_path(char *buf, size_t len)
{
    const char *env = getenv("KVQ_HASH_CACHE"), *xdg = getenv("XDG_CACHE_HOME"), *home = getenv("HOME");
    int n;
    if (env && *env) {
        if (!strcmp(env, "off")) return -1;
        n = snprintf(buf, len, "%s", env);
    } else if (xdg && *xdg) n = snprintf(buf, len, "%s/kvq/sha256", xdg);
    else if (home && *home) n = snprintf(buf, len, "%s/.cache/kvq/sha256", home);
    else return -1;
    return n > 0 && (size_t)n < len ? 0 : -1;
}

/* A file state as the cache's key: device, inode, size, mtime and ctime to the nanosecond. */
static void cache_key(const struct stat *st, char *buf, size_t len)
{
    snprintf(buf, len, "%llu %llu %lld %lld.%09ld %lld.%09ld", (unsigned long long)st->st_dev,
             (unsigned long long)st->st_ino, (long long)st->st_size, (long long)st->st_mtim.tv_sec,
             (long)st->st_mtim.tv_nsec, (long long)st->st_ctim.tv_sec, (long)st->st_ctim.tv_nsec);
}

enum { CACHE_MAX_BYTES = 1 << 20 }; /* about 6000 files; a full cache starts over */

int cli_hash_cache_lookup(const struct stat *st, char hex[65])
{
    char path[4096], key[160], line[4096 + 256];
    if (!S_ISREG(st->st_mode) || cache_path(path, sizeof path)) return -1;
    FILE *f = fopen(path, "r");
    if (!f) return -1;
    cache_key(st, key, sizeof key);
    size_t kl = strlen(key);
    int found = -1;
    while (found && fgets(line, sizeof line, f)) { /* "KEY SHA256 PATH\n"; a torn line matches nothing */
        size_t n = strlen(line);
        if (n < kl + 66 || line[n - 1] != '\n' || strncmp(line, key, kl) || line[kl] != ' ' || line[kl + 65] != ' ')
            continue;
        int ok = 1;
        for (int i = 0; i < 64 && ok; i++) ok = strchr("0123456789abcdef", line[kl + 1 + i]) && line[kl + 1 + i];
        if (ok) memcpy(hex, line + kl + 1, 64), hex[64] = '\0', found = 0;
    }
    fclose(f);
    return found;
}

void cli_hash_cache_store(const char *file, const struct stat *st, const char hex[65])
{
    char path[4096], key[160], dir[4096];
    struct timespec now;
    clock_gettime(CLOCK_REALTIME, &now);
    /* a file changed in the last two seconds may change again within the
     * same timestamp of a coarse file-system clock: not kept */
    if (!S_ISREG(st->st_mode) || now.tv_sec - st->st_ctim.tv_sec < 2 || cache_path(path, sizeof path)) return;
    snprintf(dir, sizeof dir, "%s", path);
    for (char *p = dir + 1; *p; p++) /* its directories, as mkdir -p */
        if (*p == '/') *p = '\0', mkdir(dir, 0755), *p = '/';
    struct stat cs;
    if (stat(path, &cs) == 0 && cs.st_size > CACHE_MAX_BYTES) unlink(path);
    int fd = open(path, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0644);
    if (fd < 0) return; /* a cache, not a result: nothing to say */
    char line[4096 + 256], *abs = realpath(file, NULL); /* the path, for a reader of the cache */
    const char *name = abs ? abs : file;
    cache_key(st, key, sizeof key);
    int n = snprintf(line, sizeof line, "%s %s %s\n", key, hex, name);
    if (n > 0 && (size_t)n < sizeof line && !strchr(name, '\n')) {
        ssize_t w = write(fd, line, (size_t)n); /* one append: lines of concurrent runs do not interleave */
        (void)w;
    }
    free(abs);
    close(fd);
}

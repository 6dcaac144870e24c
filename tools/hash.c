/* hash.c — SHA-256 for the provenance record (meta.c), through OpenSSL's
 * libcrypto (SHA-NI or AVX2 where the CPU has them: 1.4-1.5 GB/s against
 * ~230 MB/s for a plain C loop), and a background hasher that hashes a
 * run's inputs while the run works, so that provenance costs no wall time
 * when a core is free for it. */
#define _GNU_SOURCE /* SCHED_IDLE */
#include "cli.h"

#include <errno.h>
#include <fcntl.h>
#include <openssl/evp.h>
#include <pthread.h>
#include <sched.h>
#include <stdlib.h>
#include <string.h>
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

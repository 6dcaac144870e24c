/* error.c — status codes, their strings and the detail message helper. */
#include "../internal.h"
#include "kvq_config.h"

#include <pthread.h>
#include <stdio.h>
#include <string.h>

const char *kvq_strerror(kvq_status st)
{
    switch (st) {
    case KVQ_OK: return "success";
    case KVQ_ERR_USAGE: return "invalid argument";
    case KVQ_ERR_IO: return "input/output error";
    case KVQ_ERR_FORMAT: return "malformed dump";
    case KVQ_ERR_NOMEM: return "out of memory";
    case KVQ_ERR_NUMERIC: return "value not representable";
    case KVQ_ERR_UNSUPPORTED: return "not supported";
    case KVQ_ERR_INTERNAL: return "internal library failure";
    }
    return "unknown status";
}

const char *kvq_version(void) { return KVQ_VERSION; }

kvq_status kvq_fail(kvq_error *err, kvq_status st, const char *fmt, ...)
{
    if (err) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(err->msg, sizeof err->msg, fmt, ap);
        va_end(ap);
        /* keep the message on one line */
        for (char *p = err->msg; *p; p++)
            if (*p == '\n' || *p == '\r') *p = ' ';
        err->status = st;
    }
    return st;
}

void *kvq_alloc_array(size_t n, size_t size)
{
    size_t bytes;
    if (!kvq_mul_size(n, size, &bytes)) return NULL;
    return malloc(bytes ? bytes : 1);
}

void *kvq_alloc_lines(size_t bytes)
{
    size_t rounded = (bytes + 63) & ~(size_t)63;
    if (rounded < bytes) return NULL;
    return aligned_alloc(64, rounded ? rounded : 64);
}

/* ------------------------------------------------------------- notes */

/* The first note of each kind — the lowest `order` the callers give, so
 * that the note said does not depend on which thread came first — and how
 * many more came (any thread). */
static pthread_mutex_t note_lock = PTHREAD_MUTEX_INITIALIZER;
static char note_text[KVQ_NOTE_KINDS][512];
static long note_more[KVQ_NOTE_KINDS];
static uint64_t note_order[KVQ_NOTE_KINDS];

void kvq_note(kvq_note_kind kind, uint64_t order, const char *fmt, ...)
{
    if ((int)kind < 0 || kind >= KVQ_NOTE_KINDS) return;
    pthread_mutex_lock(&note_lock);
    int first = !note_text[kind][0];
    if (!first) note_more[kind]++;
    if (first || order < note_order[kind]) {
        note_order[kind] = order;
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(note_text[kind], sizeof note_text[kind], fmt, ap);
        va_end(ap);
        for (char *p = note_text[kind]; *p; p++)
            if (*p == '\n' || *p == '\r') *p = ' ';
    }
    pthread_mutex_unlock(&note_lock);
}

size_t kvq_take_notes(char *buf, size_t len)
{
    size_t used = 0;
    if (buf && len) buf[0] = '\0';
    else len = 0;
    pthread_mutex_lock(&note_lock);
    for (int k = 0; k < KVQ_NOTE_KINDS; k++) {
        if (!note_text[k][0]) continue;
        char more[64] = "";
        if (note_more[k]) snprintf(more, sizeof more, " (and %ld more like it)", note_more[k]);
        int n = snprintf(len ? buf + (used < len ? used : len - 1) : NULL, used < len ? len - used : 0, "%s%s\n",
                         note_text[k], more);
        used += n > 0 ? (size_t)n : 0;
        note_text[k][0] = '\0', note_more[k] = 0;
    }
    pthread_mutex_unlock(&note_lock);
    return used;
}

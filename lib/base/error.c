/* error.c — status codes, their strings and the detail message helper. */
#include "../internal.h"
#include "kvq_config.h"

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

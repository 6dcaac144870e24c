/* gguf.c — the GGUF v2/v3 container (llama.cpp's model format, docs/models.md):
 * header, metadata key/values of every type (arrays included), tensor
 * infos and the aligned data section, read from a mapped file.  Every
 * length, count and offset is checked against the bytes that remain, so a
 * truncated or hostile file is an error naming what was wrong, never a read
 * out of bounds. */
#include "model.h"
#include "../formats/formats.h"

#include <stdio.h>
#include <string.h>

#define GGUF_MAGIC 0x46554747u /* "GGUF" little-endian */
#define GGUF_DEFAULT_ALIGNMENT 32

typedef struct cursor {
    const uint8_t *p, *end;
    const char *path;
    kvq_error *err;
} cursor;

static const size_t scalar_size[GGUF_NTYPES] = {
    [GGUF_U8] = 1, [GGUF_I8] = 1, [GGUF_U16] = 2, [GGUF_I16] = 2, [GGUF_U32] = 4, [GGUF_I32] = 4,
    [GGUF_F32] = 4, [GGUF_BOOL] = 1, [GGUF_U64] = 8, [GGUF_I64] = 8, [GGUF_F64] = 8};

static int take(cursor *c, void *dst, size_t n)
{
    if ((size_t)(c->end - c->p) < n) return -1;
    memcpy(dst, c->p, n);
    c->p += n;
    return 0;
}

static int skip(cursor *c, size_t n)
{
    if ((size_t)(c->end - c->p) < n) return -1;
    c->p += n;
    return 0;
}

static uint64_t rd_u64(const uint8_t *p)
{
    uint64_t v;
    memcpy(&v, p, 8);
    return v;
}

/* A GGUF string (u64 length + bytes): the bytes stay in the file. */
static kvq_status take_string(cursor *c, const char *what, const uint8_t **s, uint64_t *len)
{
    uint64_t n;
    if (take(c, &n, 8))
        return kvq_fail(c->err, KVQ_ERR_FORMAT, "%s: %s: truncated file (string length past the end)", c->path, what);
    if (n > (uint64_t)(c->end - c->p))
        return kvq_fail(c->err, KVQ_ERR_FORMAT, "%s: %s: string of %llu bytes runs past the end of the file",
                        c->path, what, (unsigned long long)n);
    *s = c->p, *len = n;
    c->p += n;
    return KVQ_OK;
}

static char *dup_bytes(const uint8_t *s, uint64_t n)
{
    char *d = malloc((size_t)n + 1);
    if (!d) return NULL;
    memcpy(d, s, (size_t)n);
    d[n] = '\0';
    return d;
}

/* The name of the i-th key or tensor (`kind`), as a NUL-terminated copy. */
static kvq_status take_name(cursor *c, const char *kind, uint64_t i, char **out)
{
    const uint8_t *s = NULL;
    uint64_t len = 0;
    char what[64];
    snprintf(what, sizeof what, "%s %llu", kind, (unsigned long long)i);
    kvq_status st = take_string(c, what, &s, &len);
    if (st) return st;
    if (memchr(s, '\0', (size_t)len))
        return kvq_fail(c->err, KVQ_ERR_FORMAT, "%s: %s: the name holds a NUL byte", c->path, what);
    if (!(*out = dup_bytes(s, len))) return kvq_fail(c->err, KVQ_ERR_NOMEM, "%s: out of memory", c->path);
    return KVQ_OK;
}

static uint64_t name_hash(const char *s) { return kvq_fnv1a(KVQ_FNV_SEED, s, strlen(s)); }

static int index_init(gguf_index *x, uint64_t count)
{
    size_t n = 16;
    while (n < 2 * count + 16) n *= 2;
    x->slot = calloc(n, sizeof *x->slot);
    x->n = x->slot ? n : 0;
    return x->slot ? 0 : -1;
}

/* The entry named `name` (names[i] for the entries inserted so far), or -1. */
static int64_t index_find(const gguf_index *x, const char *name, const char *(*name_of)(const kvq_gguf *, uint64_t),
                          const kvq_gguf *g)
{
    if (!x->n) return -1;
    for (size_t i = name_hash(name) & (x->n - 1);; i = (i + 1) & (x->n - 1)) {
        if (!x->slot[i]) return -1;
        if (!strcmp(name_of(g, x->slot[i] - 1), name)) return (int64_t)(x->slot[i] - 1);
    }
}

/* Inserts entry e; returns the earlier entry of the same name, or -1. */
static int64_t index_insert(gguf_index *x, uint64_t e, const char *(*name_of)(const kvq_gguf *, uint64_t),
                            const kvq_gguf *g)
{
    const char *name = name_of(g, e);
    size_t i = name_hash(name) & (x->n - 1);
    for (; x->slot[i]; i = (i + 1) & (x->n - 1))
        if (!strcmp(name_of(g, x->slot[i] - 1), name)) return (int64_t)(x->slot[i] - 1);
    x->slot[i] = e + 1;
    return -1;
}

static const char *kv_name(const kvq_gguf *g, uint64_t i) { return g->kv[i].key; }
static const char *tensor_name(const kvq_gguf *g, uint64_t i) { return g->tensors[i].name; }

void kvq_gguf_free(kvq_gguf *g)
{
    if (!g) return;
    free(g->kv_index.slot), free(g->tensor_index.slot);
    for (uint64_t i = 0; g->kv && i < g->nkv; i++) free(g->kv[i].key);
    for (uint64_t i = 0; g->tensors && i < g->ntensors; i++) free(g->tensors[i].name);
    free(g->kv), free(g->tensors);
    memset(g, 0, sizeof *g);
}

kvq_status kvq_gguf_parse(kvq_gguf *g, const char *path, const uint8_t *map, size_t size, kvq_error *err)
{
    memset(g, 0, sizeof *g);
    g->path = path, g->map = map, g->size = size;
    cursor c = {map, map + size, path, err};
    uint32_t magic;
    kvq_status st;
    if (take(&c, &magic, 4) || magic != GGUF_MAGIC)
        return kvq_fail(err, KVQ_ERR_FORMAT, "%s: not a GGUF file (expected the magic \"GGUF\")", path);
    if (take(&c, &g->version, 4) || take(&c, &g->ntensors, 8) || take(&c, &g->nkv, 8))
        return kvq_fail(err, KVQ_ERR_FORMAT, "%s: truncated GGUF header", path);
    if (g->version != 2 && g->version != 3)
        return kvq_fail(err, KVQ_ERR_FORMAT, "%s: GGUF version %u: expected 2 or 3", path, g->version);
    /* every key/value takes at least 12 bytes, every tensor info at least 28 */
    if (g->nkv > size / 12 || g->ntensors > size / 28)
        return kvq_fail(err, KVQ_ERR_FORMAT,
                        "%s: GGUF header: %llu keys and %llu tensors cannot fit in a file of %zu bytes", path,
                        (unsigned long long)g->nkv, (unsigned long long)g->ntensors, size);
    g->kv = calloc((size_t)g->nkv + 1, sizeof *g->kv);
    g->tensors = calloc((size_t)g->ntensors + 1, sizeof *g->tensors);
    if (!g->kv || !g->tensors || index_init(&g->kv_index, g->nkv) || index_init(&g->tensor_index, g->ntensors)) {
        kvq_gguf_free(g);
        return kvq_fail(err, KVQ_ERR_NOMEM, "%s: out of memory for the GGUF index", path);
    }
    uint64_t alignment = GGUF_DEFAULT_ALIGNMENT;
    for (uint64_t i = 0; i < g->nkv; i++) {
        gguf_kv *kv = &g->kv[i];
        const uint8_t *s = NULL;
        uint64_t len = 0;
        if ((st = take_name(&c, "metadata key", i, &kv->key))) goto fail;
        if (index_insert(&g->kv_index, i, kv_name, g) >= 0) {
            st = kvq_fail(err, KVQ_ERR_FORMAT, "%s: metadata key %s appears twice", path, kv->key);
            goto fail;
        }
        uint32_t type;
        if (take(&c, &type, 4)) {
            st = kvq_fail(err, KVQ_ERR_FORMAT, "%s: %s: truncated file (value type past the end)", path, kv->key);
            goto fail;
        }
        if (type >= GGUF_NTYPES) {
            st = kvq_fail(err, KVQ_ERR_FORMAT, "%s: %s: unknown GGUF value type %u", path, kv->key, type);
            goto fail;
        }
        kv->type = (int)type, kv->n = 1;
        int et = (int)type;
        if (type == GGUF_ARRAY) {
            uint32_t at;
            if (take(&c, &at, 4) || take(&c, &kv->n, 8)) {
                st = kvq_fail(err, KVQ_ERR_FORMAT, "%s: %s: truncated array header", path, kv->key);
                goto fail;
            }
            if (at >= GGUF_NTYPES || at == GGUF_ARRAY) {
                st = kvq_fail(err, KVQ_ERR_FORMAT, "%s: %s: array of unsupported element type %u", path, kv->key, at);
                goto fail;
            }
            kv->arr_type = et = (int)at;
        }
        kv->val = c.p;
        if (et == GGUF_STRING) {
            for (uint64_t k = 0; k < kv->n; k++)
                if ((st = take_string(&c, kv->key, &s, &len))) goto fail;
        } else {
            uint64_t es = scalar_size[et];
            if (kv->n > (uint64_t)(c.end - c.p) / es) {
                st = kvq_fail(err, KVQ_ERR_FORMAT, "%s: %s: %llu values run past the end of the file", path, kv->key,
                              (unsigned long long)kv->n);
                goto fail;
            }
            if (et == GGUF_BOOL) /* a bool is the byte 0 or 1, as gguf.cpp reads it */
                for (uint64_t k = 0; k < kv->n; k++)
                    if (c.p[k] > 1) {
                        st = kvq_fail(err, KVQ_ERR_FORMAT, "%s: %s: a bool of byte value %u: expected 0 or 1", path,
                                      kv->key, (unsigned)c.p[k]);
                        goto fail;
                    }
            skip(&c, (size_t)(kv->n * es));
        }
        if (!strcmp(kv->key, "general.alignment")) {
            int64_t a;
            if (kvq_gguf_get_int(g, "general.alignment", &a) != 1 || a <= 0 || a > (1 << 20) || (a & (a - 1))) {
                st = kvq_fail(err, KVQ_ERR_FORMAT, "%s: general.alignment: expected a power of two", path);
                goto fail;
            }
            alignment = (uint64_t)a;
        }
    }
    for (uint64_t i = 0; i < g->ntensors; i++) {
        gguf_tensor *t = &g->tensors[i];
        if ((st = take_name(&c, "tensor info", i, &t->name))) goto fail;
        if (take(&c, &t->n_dims, 4)) {
            st = kvq_fail(err, KVQ_ERR_FORMAT, "%s: tensor %s: truncated tensor info", path, t->name);
            goto fail;
        }
        if (t->n_dims < 1 || t->n_dims > 4) {
            st = kvq_fail(err, KVQ_ERR_FORMAT, "%s: tensor %s: %u dimensions: expected 1 to 4", path, t->name,
                          t->n_dims);
            goto fail;
        }
        for (int d = 0; d < 4; d++) t->ne[d] = 1;
        for (uint32_t d = 0; d < t->n_dims; d++) {
            uint64_t ne;
            if (take(&c, &ne, 8)) {
                st = kvq_fail(err, KVQ_ERR_FORMAT, "%s: tensor %s: truncated tensor info", path, t->name);
                goto fail;
            }
            if (ne > (uint64_t)INT64_MAX / 2) {
                st = kvq_fail(err, KVQ_ERR_FORMAT, "%s: tensor %s: dimension %u of %llu is absurd", path, t->name, d,
                              (unsigned long long)ne);
                goto fail;
            }
            t->ne[d] = (int64_t)ne;
        }
        uint32_t type;
        if (take(&c, &type, 4) || take(&c, &t->offset, 8)) {
            st = kvq_fail(err, KVQ_ERR_FORMAT, "%s: tensor %s: truncated tensor info", path, t->name);
            goto fail;
        }
        t->type = (int)type;
        if (index_insert(&g->tensor_index, i, tensor_name, g) >= 0) {
            st = kvq_fail(err, KVQ_ERR_FORMAT, "%s: tensor %s appears twice", path, t->name);
            goto fail;
        }
    }
    /* the data section starts at the next multiple of the alignment */
    size_t hdr = (size_t)(c.p - map);
    size_t data0 = (size_t)((hdr + alignment - 1) / alignment * alignment);
    if (data0 > size && g->ntensors) {
        st = kvq_fail(err, KVQ_ERR_FORMAT, "%s: truncated file: no data section after the tensor infos", path);
        goto fail;
    }
    for (uint64_t i = 0; i < g->ntensors; i++) {
        gguf_tensor *t = &g->tensors[i];
        int block;
        size_t bbytes;
        if (!kvq_ggml_type_size(t->type, &block, &bbytes)) {
            st = kvq_fail(err, KVQ_ERR_UNSUPPORTED,
                          "%s: tensor %s: ggml type %d is not one kvq reads (f32, f16, bf16, q4_0, q4_1, q5_0, q5_1, "
                          "q8_0, q2_K..q6_K)",
                          path, t->name, t->type);
            goto fail;
        }
        if (t->ne[0] % block) {
            st = kvq_fail(err, KVQ_ERR_FORMAT,
                          "%s: tensor %s: row of %lld values is not a multiple of the %s block (%d)", path, t->name,
                          (long long)t->ne[0], kvq_ggml_type_name(t->type), block);
            goto fail;
        }
        size_t rows = 1, bytes;
        for (int d = 1; d < 4; d++)
            if (!kvq_mul_size(rows, (size_t)t->ne[d], &rows)) rows = SIZE_MAX;
        if (rows == SIZE_MAX || !kvq_mul_size((size_t)(t->ne[0] / block), bbytes, &bytes) ||
            !kvq_mul_size(bytes, rows, &bytes)) {
            st = kvq_fail(err, KVQ_ERR_FORMAT, "%s: tensor %s: size overflows", path, t->name);
            goto fail;
        }
        if (t->offset % alignment || t->offset > size - data0 || bytes > size - data0 - t->offset) {
            st = kvq_fail(err, KVQ_ERR_FORMAT,
                          "%s: tensor %s: data [%llu, +%zu) lies past the end of the file (data section of %zu bytes) "
                          "or is misaligned",
                          path, t->name, (unsigned long long)t->offset, bytes, size > data0 ? size - data0 : 0);
            goto fail;
        }
        t->data = map + data0 + t->offset;
        t->nbytes = bytes;
    }
    return KVQ_OK;
fail:
    kvq_gguf_free(g);
    return st;
}

const gguf_kv *kvq_gguf_find(const kvq_gguf *g, const char *key)
{
    int64_t i = index_find(&g->kv_index, key, kv_name, g);
    return i < 0 ? NULL : &g->kv[i];
}

const gguf_tensor *kvq_gguf_tensor(const kvq_gguf *g, const char *name)
{
    int64_t i = index_find(&g->tensor_index, name, tensor_name, g);
    return i < 0 ? NULL : &g->tensors[i];
}

int kvq_gguf_get_int(const kvq_gguf *g, const char *key, int64_t *out)
{
    const gguf_kv *kv = kvq_gguf_find(g, key);
    if (!kv) return 0;
    const uint8_t *p = kv->val;
    switch (kv->type) {
    case GGUF_U8: *out = p[0]; return 1;
    case GGUF_I8: *out = (int8_t)p[0]; return 1;
    case GGUF_BOOL: *out = p[0] != 0; return 1;
    case GGUF_U16: { uint16_t v; memcpy(&v, p, 2); *out = v; return 1; }
    case GGUF_I16: { int16_t v; memcpy(&v, p, 2); *out = v; return 1; }
    case GGUF_U32: { uint32_t v; memcpy(&v, p, 4); *out = v; return 1; }
    case GGUF_I32: { int32_t v; memcpy(&v, p, 4); *out = v; return 1; }
    case GGUF_U64: { uint64_t v = rd_u64(p); if (v > INT64_MAX) return -1; *out = (int64_t)v; return 1; }
    case GGUF_I64: { int64_t v; memcpy(&v, p, 8); *out = v; return 1; }
    default: return -1;
    }
}

int kvq_gguf_get_real(const kvq_gguf *g, const char *key, double *out)
{
    const gguf_kv *kv = kvq_gguf_find(g, key);
    if (!kv) return 0;
    if (kv->type == GGUF_F32) { float v; memcpy(&v, kv->val, 4); *out = v; return 1; }
    if (kv->type == GGUF_F64) { memcpy(out, kv->val, 8); return 1; }
    int64_t i;
    if (kvq_gguf_get_int(g, key, &i) == 1) { *out = (double)i; return 1; }
    return -1;
}

int kvq_gguf_get_str(const kvq_gguf *g, const char *key, const char **s, uint64_t *len)
{
    const gguf_kv *kv = kvq_gguf_find(g, key);
    if (!kv || kv->type != GGUF_STRING) return 0;
    *len = rd_u64(kv->val);
    *s = (const char *)kv->val + 8;
    return 1;
}

/* vocab.c — what both tokenizers (tokenizer.c: SentencePiece; bpe.c:
 * byte-level BPE) build on: the vocabulary's hash index, UTF-8 characters
 * as symbols, the bigram heap and the merge loop (each tokenizer says which
 * adjacent pairs may merge and how they rank), and the growing token list. */
#include "model.h"

#include <ctype.h>

#include <stdlib.h>
#include <string.h>

uint64_t kvq_fnv1a(uint64_t h, const char *s, size_t n) { return kvq_fingerprint_bytes(h, s, n); }

kvq_status kvq_vocab_index(kvq_vocab *v, kvq_error *err)
{
    size_t ns = 16;
    while (ns < 2 * (size_t)v->n) ns *= 2;
    if (!(v->slot = malloc(ns * sizeof *v->slot)))
        return kvq_fail(err, KVQ_ERR_NOMEM, "out of memory for the vocabulary index");
    for (size_t i = 0; i < ns; i++) v->slot[i] = -1;
    v->nslot = ns;
    for (int id = 0; id < v->n; id++) {
        size_t len = strlen(v->piece[id]);
        size_t s = kvq_fnv1a(KVQ_FNV_SEED, v->piece[id], len) & (ns - 1);
        for (; v->slot[s] >= 0; s = (s + 1) & (ns - 1))
            if (!strcmp(v->piece[v->slot[s]], v->piece[id])) break; /* a piece given twice */
        if (v->slot[s] < 0 || v->last_wins) v->slot[s] = id;
    }
    /* streamed tokenization cuts after a newline followed by printable ASCII: no piece that
     * the text is matched against (SentencePiece: all; BPE: the user-defined ones, the others
     * are byte-encoded) may hold such a pair */
    int n = v->kind == KVQ_TOK_BPE ? v->nspecial : v->n;
    for (int i = 0; i < n && !v->stream_unsafe; i++) {
        const char *t = v->piece[v->kind == KVQ_TOK_BPE ? v->special[i] : i];
        for (const char *c = strchr(t, '\n'); c && !v->stream_unsafe; c = strchr(c + 1, '\n'))
            v->stream_unsafe = c[1] > ' ' && c[1] < 0x7F;
    }
    /* ... and between two ASCII letters at a space ("x| y"): no such piece may hold an
     * ASCII letter followed by a space (SentencePiece's U+2581 too); BPE's pre-tokenizers
     * start a word at that space, so only its user-defined tokens matter */
    for (int i = 0; i < n && !v->space_cut_unsafe; i++) {
        const unsigned char *t = (const unsigned char *)v->piece[v->kind == KVQ_TOK_BPE ? v->special[i] : i];
        for (; *t && !v->space_cut_unsafe; t++)
            v->space_cut_unsafe = isalpha(*t) && *t < 0x80 &&
                                  (t[1] == ' ' || (t[1] == 0xE2 && t[2] == 0x96 && t[3] == 0x81));
    }
    return KVQ_OK;
}

int kvq_vocab_lookup(const kvq_vocab *v, const char *s, size_t len)
{
    if (!v->nslot) return -1;
    for (size_t i = kvq_fnv1a(KVQ_FNV_SEED, s, len) & (v->nslot - 1);; i = (i + 1) & (v->nslot - 1)) {
        int id = v->slot[i];
        if (id < 0) return -1;
        if (!strncmp(v->piece[id], s, len) && v->piece[id][len] == '\0') return id;
    }
}

void kvq_vocab_free(kvq_vocab *v)
{
    for (int i = 0; v->piece && i < v->n; i++) free(v->piece[i]);
    free(v->piece), free(v->score), free(v->slot), free(v->merge), free(v->merge_len), free(v->mslot), free(v->special);
    memset(v, 0, sizeof *v);
}

/* ------------------------------------------------------------ encode */

/* max-heap on (score, then smaller left) */
static int bigram_before(const kvq_bigram *a, const kvq_bigram *b)
{
    return a->score > b->score || (a->score == b->score && a->left < b->left);
}

int kvq_bigram_push(kvq_bigram_heap *h, kvq_bigram x)
{
    if (h->n == h->cap) {
        size_t nc = h->cap ? 2 * h->cap : 256;
        kvq_bigram *nb = realloc(h->b, nc * sizeof *nb);
        if (!nb) return -1;
        h->b = nb, h->cap = nc;
    }
    size_t i = h->n++;
    while (i && bigram_before(&x, &h->b[(i - 1) / 2])) {
        h->b[i] = h->b[(i - 1) / 2];
        i = (i - 1) / 2;
    }
    h->b[i] = x;
    return 0;
}

static kvq_bigram heap_pop(kvq_bigram_heap *h)
{
    kvq_bigram top = h->b[0], last = h->b[--h->n];
    size_t i = 0;
    for (;;) {
        size_t c = 2 * i + 1;
        if (c >= h->n) break;
        if (c + 1 < h->n && bigram_before(&h->b[c + 1], &h->b[c])) c++;
        if (!bigram_before(&h->b[c], &last)) break;
        h->b[i] = h->b[c];
        i = c;
    }
    if (h->n) h->b[i] = last;
    return top;
}

int kvq_merge_symbols(kvq_sym *sy, int ns, kvq_bigram_heap *h, kvq_try_pair_fn *try_pair, void *ctx)
{
    h->n = 0;
    for (int i = 0; i + 1 < ns; i++)
        if (try_pair(ctx, sy, i, i + 1, h)) return -1;
    while (h->n) {
        kvq_bigram b = heap_pop(h);
        kvq_sym *l = &sy[b.left], *r = &sy[b.right];
        if (!l->len || !r->len || l->len + r->len != b.len || l->next != b.right) continue; /* stale */
        l->len += r->len;
        r->len = 0;
        l->next = r->next;
        if (r->next >= 0) sy[r->next].prev = b.left;
        if (try_pair(ctx, sy, l->prev, b.left, h) || try_pair(ctx, sy, b.left, l->next, h)) return -1;
    }
    return 0;
}

static size_t utf8_len(unsigned char c)
{
    if (c < 0x80) return 1;
    if ((c & 0xE0) == 0xC0) return 2;
    if ((c & 0xF0) == 0xE0) return 3;
    if ((c & 0xF8) == 0xF0) return 4;
    return 1; /* a stray byte is a character of its own */
}

int kvq_utf8_symbols(const char *t, size_t n, kvq_sym *sy)
{
    int ns = 0;
    for (size_t i = 0; i < n; ns++) {
        size_t len = utf8_len((unsigned char)t[i]);
        if (len > n - i) len = n - i;
        sy[ns] = (kvq_sym){i, len, ns - 1, -1};
        if (ns) sy[ns - 1].next = ns;
        i += len;
    }
    return ns;
}

int kvq_tokbuf_push(kvq_tokbuf *b, int id)
{
    if (b->n == b->cap) {
        size_t nc = b->cap ? 2 * b->cap : 256;
        int *ni = realloc(b->id, nc * sizeof *ni);
        if (!ni) return -1;
        b->id = ni, b->cap = nc;
    }
    b->id[b->n++] = id;
    return 0;
}

/* tokenizer.c — SentencePiece-style BPE with scores (docs/models.md): GGUF's
 * `tokenizer.ggml.model = llama` and llama2.c's tokenizer.bin.  The text is
 * split into UTF-8 characters (spaces written as U+2581 for GGUF, a space
 * prefix added), then the adjacent pair whose concatenation is the
 * best-scoring vocabulary piece is merged, leftmost first on ties, until no
 * pair is in the vocabulary — llama2.c's `encode`, run with a heap so long
 * texts take O(n log n).  Characters left outside the vocabulary become
 * their UTF-8 bytes (byte fallback).  BOS comes first.  Also the reader of
 * `--tokens` files. */
#define _GNU_SOURCE /* memmem */
#include "model.h"

#include <ctype.h>
#include <errno.h>
#include <stdio.h>
#include <string.h>

typedef struct spm_ctx {
    const kvq_vocab *v;
    const char *text;
} spm_ctx;

/* SentencePiece: (l, r) may merge if their concatenation is a piece, scored by it. */
static int spm_pair(void *ctx, const kvq_sym *sy, int l, int r, kvq_bigram_heap *h)
{
    const spm_ctx *c = ctx;
    if (l < 0 || r < 0) return 0;
    size_t len = sy[l].len + sy[r].len;
    int id = kvq_vocab_lookup(c->v, c->text + sy[l].off, len);
    if (id < 0) return 0;
    return kvq_bigram_push(h, (kvq_bigram){c->v->score[id], l, r, len});
}

/* SentencePiece: one raw-text fragment (space prefix when asked) into out. */
static kvq_status spm_encode(const kvq_model *m, const char *text, size_t n, int space_prefix, kvq_tokbuf *out,
                             kvq_error *err)
{
    const kvq_vocab *v = &m->vocab;
    /* normalise: optional space prefix, spaces as U+2581 for GGUF vocabularies */
    const char *sp = v->space_is_u2581 ? "\xe2\x96\x81" : " ";
    size_t spl = strlen(sp), cap = (n + 1) * spl + 1, tl = 0;
    char *t = malloc(cap);
    kvq_sym *sy = kvq_alloc_array(cap, sizeof *sy); /* at most one symbol per byte of the normalised text */
    kvq_bigram_heap h = {0};
    kvq_status st = KVQ_OK;
    if (!t || !sy) { st = kvq_fail(err, KVQ_ERR_NOMEM, "out of memory tokenizing %zu bytes", n); goto done; }
    if (n && space_prefix) memcpy(t, sp, spl), tl = spl;
    for (size_t i = 0; i < n; i++) {
        if (text[i] == ' ') memcpy(t + tl, sp, spl), tl += spl;
        else t[tl++] = text[i];
    }
    t[tl] = '\0';
    int ns = kvq_utf8_symbols(t, tl, sy);
    spm_ctx ctx = {v, t};
    if (kvq_merge_symbols(sy, ns, &h, spm_pair, &ctx)) goto oom;
    for (int i = 0; ns && i >= 0; i = sy[i].next) {
        int id = kvq_vocab_lookup(v, t + sy[i].off, sy[i].len);
        if (id >= 0) {
            if (kvq_tokbuf_push(out, id)) goto oom;
            continue;
        }
        for (size_t j = 0; j < sy[i].len; j++) { /* byte fallback */
            unsigned char c = (unsigned char)t[sy[i].off + j];
            int bid;
            if (v->byte_base >= 0) {
                bid = v->byte_base + c;
            } else {
                char hex[8];
                snprintf(hex, sizeof hex, "<0x%02X>", c);
                bid = kvq_vocab_lookup(v, hex, strlen(hex));
            }
            if (bid < 0 || bid >= v->n) {
                st = kvq_fail(err, KVQ_ERR_FORMAT,
                              "%s: byte 0x%02X of the text has no token (no <0x%02X> byte-fallback piece)", m->path, c,
                              c);
                goto done;
            }
            if (kvq_tokbuf_push(out, bid)) goto oom;
        }
    }
    goto done;
oom:
    st = kvq_fail(err, KVQ_ERR_NOMEM, "out of memory tokenizing");
done:
    free(t), free(sy), free(h.b);
    return st;
}

/* A piece of the text: raw text [off, off + len), or a matched user-defined token. */
typedef struct fragment {
    size_t off, len;
    int token; /* -1: raw text */
} fragment;

/* Appends fragment x to *f (growing it). */
static int push_fragment(fragment **f, size_t *n, size_t *cap, fragment x)
{
    if (*n == *cap) {
        size_t nc = *cap ? 2 * *cap : 16;
        fragment *g = realloc(*f, nc * sizeof *g);
        if (!g) return -1;
        *f = g, *cap = nc;
    }
    (*f)[(*n)++] = x;
    return 0;
}

/* llama.cpp's tokenizer_st_partition with parse_special = false: each
 * user-defined token, longest first, is cut out of every raw fragment at
 * each of its occurrences (left to right); with rstrip, whitespace after
 * it is dropped.  *out is the fragment list (malloc'ed).  Each token is one
 * pass that writes a new list — the fragments are never moved in place —
 * so the cost is linear in the text for each token (a list rewritten per
 * occurrence was quadratic on whitespace runs: 38.6 s for 400 KB). */
static int partition(const kvq_vocab *v, const char *text, size_t n, fragment **out, size_t *nout)
{
    size_t cap = 16, nf = 1;
    fragment *f = malloc(cap * sizeof *f);
    if (!f) return -1;
    f[0] = (fragment){0, n, -1};
    for (int k = 0; k < v->nspecial; k++) {
        const char *tok = v->piece[v->special[k]];
        size_t tl = strlen(tok), ng = 0, gcap = 0;
        if (!tl) continue;
        fragment *g = NULL;
        int bad = 0;
        for (size_t i = 0; i < nf && !bad; i++) {
            if (f[i].token >= 0) {
                bad = push_fragment(&g, &ng, &gcap, f[i]);
                continue;
            }
            size_t off = f[i].off, end = f[i].off + f[i].len;
            const char *hit;
            while (!bad && off < end && (hit = memmem(text + off, end - off, tok, tl))) {
                size_t at = (size_t)(hit - text), r = at + tl;
                if (v->special_rstrip)
                    while (r < end && isspace((unsigned char)text[r])) r++;
                if (at > off) bad = push_fragment(&g, &ng, &gcap, (fragment){off, at - off, -1});
                if (!bad) bad = push_fragment(&g, &ng, &gcap, (fragment){at, tl, v->special[k]});
                off = r; /* the right remainder, searched again */
            }
            if (!bad && off < end) bad = push_fragment(&g, &ng, &gcap, (fragment){off, end - off, -1});
        }
        if (bad) {
            free(f), free(g);
            return -1;
        }
        free(f);
        f = g, nf = ng, cap = gcap;
        if (!f) { /* the text was one token, cut away whole */
            nf = 0;
            break;
        }
    }
    *out = f, *nout = nf;
    return 0;
}

/* Tokenization in segments: BOS, then each segment of the text (cut where
 * no token or word can span the cut), then EOS. */
typedef struct tok_state {
    kvq_tokbuf out;
    int prev_special; /* SentencePiece: a space prefix at the start and after each matched token */
    size_t ntext;     /* tokens of the text itself */
} tok_state;

static kvq_status tok_segment(const kvq_model *m, tok_state *ts, const char *text, size_t n, kvq_error *err)
{
    const kvq_vocab *v = &m->vocab;
    fragment *f = NULL;
    size_t nf = 0;
    kvq_status st = KVQ_OK;
    if (n && partition(v, text, n, &f, &nf))
        return kvq_fail(err, KVQ_ERR_NOMEM, "out of memory tokenizing %zu bytes", n);
    for (size_t i = 0; i < nf && !st; i++) {
        size_t before = ts->out.n;
        if (f[i].token >= 0) {
            if (kvq_tokbuf_push(&ts->out, f[i].token)) st = kvq_fail(err, KVQ_ERR_NOMEM, "out of memory tokenizing");
            ts->prev_special = 1;
        } else if (v->kind == KVQ_TOK_BPE) {
            st = kvq_bpe_encode(v, text + f[i].off, f[i].len, &ts->out, err);
        } else {
            st = spm_encode(m, text + f[i].off, f[i].len, v->add_space_prefix && ts->prev_special, &ts->out, err);
            ts->prev_special = 0;
        }
        ts->ntext += ts->out.n - before;
    }
    free(f);
    return st;
}

static kvq_status tok_begin(const kvq_model *m, tok_state *ts, kvq_error *err)
{
    const kvq_vocab *v = &m->vocab;
    memset(ts, 0, sizeof *ts);
    ts->prev_special = 1;
    if (!v->n)
        return kvq_fail(err, KVQ_ERR_UNSUPPORTED, "%s: cannot tokenize --text: %s; give token ids with --tokens FILE",
                        m->path, m->tokenizer_missing);
    if (v->add_bos && kvq_tokbuf_push(&ts->out, v->bos))
        return kvq_fail(err, KVQ_ERR_NOMEM, "out of memory tokenizing");
    return KVQ_OK;
}

static kvq_status tok_end(const kvq_model *m, tok_state *ts, int at_eof, int **ids, size_t *nids, kvq_error *err)
{
    const kvq_vocab *v = &m->vocab;
    if (at_eof && v->add_eos && kvq_tokbuf_push(&ts->out, v->eos))
        return kvq_fail(err, KVQ_ERR_NOMEM, "out of memory tokenizing");
    if (!ts->ntext) return kvq_fail(err, KVQ_ERR_USAGE, "the text tokenizes to nothing (an empty text)");
    *ids = ts->out.id, *nids = ts->out.n, ts->out.id = NULL;
    return KVQ_OK;
}

kvq_status kvq_model_tokenize(const kvq_model *m, const char *text, size_t n, int **ids, size_t *nids, kvq_error *err)
{
    tok_state ts;
    *ids = NULL, *nids = 0;
    kvq_status st = tok_begin(m, &ts, err);
    if (!st) st = tok_segment(m, &ts, text, n, err);
    if (!st) st = tok_end(m, &ts, 1, ids, nids, err);
    free(ts.out.id);
    return st;
}

kvq_status kvq_model_tokenize_part(const kvq_model *m, const char *text, size_t n, int **ids, size_t *nids,
                                   kvq_error *err)
{
    tok_state ts;
    *ids = NULL, *nids = 0;
    kvq_status st = tok_begin(m, &ts, err);
    if (!st) st = tok_segment(m, &ts, text, n, err);
    if (!st) {
        size_t skip = m->vocab.add_bos ? 1 : 0; /* tok_begin's BOS */
        if (skip) memmove(ts.out.id, ts.out.id + skip, (ts.out.n - skip) * sizeof *ts.out.id);
        *nids = ts.out.n - skip, *ids = ts.out.id, ts.out.id = NULL;
    }
    free(ts.out.id);
    return st;
}

/* A cut before text[p] is safe (no pre-tokenizer word, SentencePiece merge
 * or user-defined token crosses it) when text[p − 1] is a newline and
 * text[p] printable ASCII other than space, unless a piece holds such a pair
 * (v->stream_unsafe); or when text[p] is a space between two ASCII letters,
 * unless a piece holds a letter followed by a space (v->space_cut_unsafe).
 * The last such cut in (from, n), or 0. */
static size_t last_safe_cut(const kvq_vocab *v, const char *b, size_t from, size_t n)
{
    for (size_t p = n; p-- > (from > 1 ? from : 1);) {
        if (!v->stream_unsafe && b[p - 1] == '\n' && b[p] > ' ' && b[p] < 0x7F) return p;
        if (!v->space_cut_unsafe && b[p] == ' ' && p + 1 < n && isalpha((unsigned char)b[p - 1]) &&
            (unsigned char)b[p - 1] < 0x80 && isalpha((unsigned char)b[p + 1]) && (unsigned char)b[p + 1] < 0x80)
            return p;
    }
    return 0;
}

kvq_status kvq_model_tokenize_file(const kvq_model *m, const char *path, size_t max_tokens, int **ids, size_t *nids,
                                   kvq_error *err)
{
    return kvq_tokenize_file_blocks(m, path, max_tokens, 1 << 16, ids, nids, err);
}

kvq_status kvq_tokenize_file_blocks(const kvq_model *m, const char *path, size_t max_tokens, size_t BLOCK, int **ids,
                                    size_t *nids, kvq_error *err)
{
    tok_state ts;
    *ids = NULL, *nids = 0;
    kvq_status st = tok_begin(m, &ts, err);
    if (st) return st;
    FILE *f = fopen(path, "rb");
    if (!f) {
        free(ts.out.id);
        return kvq_fail(err, KVQ_ERR_IO, "%s: cannot open: %s", path, strerror(errno));
    }
    char *buf = NULL;
    size_t len = 0, cap = 0, offset = 0; /* offset: bytes of the file before buf */
    int eof = 0;
    while (!st && !eof) {
        if (len > KVQ_TEXT_UNCUT_MAX) { /* memory stays bounded by what the tokens need */
            st = kvq_fail(err, KVQ_ERR_FORMAT,
                          "%s: %zu MB from byte %zu hold no place where tokens can be cut (a newline before "
                          "printable ASCII, a space between letters): give the text in lines, or token ids "
                          "with --tokens", path, len >> 20, offset);
            break;
        }
        if (cap - len < BLOCK) { /* a long line without cuts: the buffer grows geometrically */
            size_t nc = cap < BLOCK ? 2 * BLOCK : 2 * cap;
            char *nb = realloc(buf, nc);
            if (!nb) { st = kvq_fail(err, KVQ_ERR_NOMEM, "%s: out of memory reading the text", path); break; }
            buf = nb, cap = nc;
        }
        size_t got = fread(buf + len, 1, BLOCK, f);
        if (got == 0) {
            if (ferror(f)) { st = kvq_fail(err, KVQ_ERR_IO, "%s: read failed: %s", path, strerror(errno)); break; }
            eof = 1;
        }
        const char *nul = memchr(buf + len, '\0', got);
        if (nul) {
            st = kvq_fail(err, KVQ_ERR_FORMAT, "%s: not a text file (a NUL byte at offset %zu)", path,
                          offset + (size_t)(nul - buf));
            break;
        }
        len += got;
        size_t cut = eof ? len : last_safe_cut(&m->vocab, buf, len - got, len); /* 0: the rest has no cut */
        if (!cut) continue;
        if ((st = tok_segment(m, &ts, buf, cut, err))) break;
        memmove(buf, buf + cut, len - cut);
        len -= cut, offset += cut;
        if (max_tokens && ts.out.n >= max_tokens) break; /* the rest cannot change these tokens */
    }
    fclose(f);
    free(buf);
    if (!st) st = tok_end(m, &ts, eof && !len, ids, nids, err);
    free(ts.out.id);
    return st;
}

/* Parses text[0, n) as ids into b (the token index for messages from b->n),
 * stopping at max ids (0: all). */
static kvq_status parse_ids(const char *what, const char *text, size_t n, int vocab, size_t max, kvq_tokbuf *b,
                            kvq_error *err)
{
    size_t i = 0;
    while (i < n && (!max || b->n < max)) {
        if (isspace((unsigned char)text[i])) { i++; continue; }
        size_t j = i;
        long long val = 0;
        while (j < n && isdigit((unsigned char)text[j]) && val <= (long long)INT32_MAX)
            val = val * 10 + (text[j++] - '0');
        if (j == i || (j < n && !isspace((unsigned char)text[j])) || val >= vocab) {
            size_t e = j;
            while (e < n && !isspace((unsigned char)text[e]) && e - i < 32) e++;
            return kvq_fail(err, KVQ_ERR_FORMAT, "%s: token %zu \"%.*s\": expected a token id 0..%d (whitespace-separated)",
                            what, b->n, (int)(e - i), text + i, vocab - 1);
        }
        if (kvq_tokbuf_push(b, (int)val)) return kvq_fail(err, KVQ_ERR_NOMEM, "%s: out of memory", what);
        i = j;
    }
    return KVQ_OK;
}

kvq_status kvq_tokens_parse_file(const char *path, int vocab, size_t max_tokens, int **ids, size_t *nids,
                                 kvq_error *err)
{
    enum { BLOCK = 1 << 16, WORD = 64 }; /* an id is never longer than WORD characters */
    *ids = NULL, *nids = 0;
    FILE *f = fopen(path, "rb");
    if (!f) return kvq_fail(err, KVQ_ERR_IO, "%s: cannot open: %s", path, strerror(errno));
    char *buf = malloc(BLOCK + WORD);
    kvq_tokbuf b = {0};
    kvq_status st = buf ? KVQ_OK : kvq_fail(err, KVQ_ERR_NOMEM, "%s: out of memory", path);
    size_t len = 0, offset = 0; /* offset: bytes of the file before buf */
    int eof = 0;
    while (!st && !eof && (!max_tokens || b.n < max_tokens)) {
        size_t got = fread(buf + len, 1, BLOCK, f);
        if (got == 0) {
            if (ferror(f)) { st = kvq_fail(err, KVQ_ERR_IO, "%s: read failed: %s", path, strerror(errno)); break; }
            eof = 1;
        }
        const char *nul = memchr(buf + len, '\0', got);
        if (nul) { /* /dev/zero, a binary file: at the first block */
            st = kvq_fail(err, KVQ_ERR_FORMAT, "%s: not a text file (a NUL byte at offset %zu)", path,
                          offset + (size_t)(nul - buf));
            break;
        }
        len += got;
        size_t cut = len; /* parse up to the last whitespace; the word after it may go on */
        if (!eof) {
            while (cut > 0 && !isspace((unsigned char)buf[cut - 1])) cut--;
            if (len - cut > WORD) cut = len; /* a word too long to be an id: its error names it */
        }
        if ((st = parse_ids(path, buf, cut, vocab, max_tokens, &b, err))) break;
        memmove(buf, buf + cut, len - cut);
        len -= cut, offset += cut;
    }
    fclose(f);
    free(buf);
    if (!st && b.n == 0)
        st = kvq_fail(err, KVQ_ERR_FORMAT, "%s: no token ids (expected whitespace-separated integers)", path);
    if (st) {
        free(b.id);
        return st;
    }
    *ids = b.id, *nids = b.n;
    return KVQ_OK;
}

kvq_status kvq_tokens_parse(const char *what, const char *text, size_t n, int vocab, int **ids, size_t *nids,
                            kvq_error *err)
{
    size_t cap = 256, k = 0, i = 0;
    int *out = malloc(cap * sizeof *out);
    *ids = NULL, *nids = 0;
    if (!out) return kvq_fail(err, KVQ_ERR_NOMEM, "%s: out of memory", what);
    while (i < n) {
        if (isspace((unsigned char)text[i])) { i++; continue; }
        size_t j = i;
        long long val = 0;
        while (j < n && isdigit((unsigned char)text[j]) && val <= (long long)INT32_MAX)
            val = val * 10 + (text[j++] - '0');
        if (j == i || (j < n && !isspace((unsigned char)text[j])) || val >= vocab) {
            size_t e = j;
            while (e < n && !isspace((unsigned char)text[e]) && e - i < 32) e++;
            kvq_status st = kvq_fail(err, KVQ_ERR_FORMAT,
                                     "%s: token %zu \"%.*s\": expected a token id 0..%d (whitespace-separated)", what,
                                     k, (int)(e - i), text + i, vocab - 1);
            free(out);
            return st;
        }
        if (k == cap) {
            int *no = realloc(out, 2 * cap * sizeof *no);
            if (!no) { free(out); return kvq_fail(err, KVQ_ERR_NOMEM, "%s: out of memory", what); }
            out = no, cap *= 2;
        }
        out[k++] = (int)val;
        i = j;
    }
    if (k == 0) {
        free(out);
        return kvq_fail(err, KVQ_ERR_FORMAT, "%s: no token ids (expected whitespace-separated integers)", what);
    }
    *ids = out, *nids = k;
    return KVQ_OK;
}

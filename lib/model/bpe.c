/* bpe.c — byte-level BPE (GGUF tokenizer.ggml.model = "gpt2"), as
 * llama.cpp's llm_tokenizer_bpe_session tokenizes a raw-text fragment
 * (docs/models.md):
 *  1. pre-tokenize: split the text's code points into words with the
 *     pre-tokenizer's regex, hand-coded as llama.cpp's unicode.cpp codes
 *     them — `llama-bpe` (Llama 3: contractions, an optional non-letter
 *     before letters, digits in threes, punctuation runs, newline runs,
 *     whitespace), `qwen2` (the same, digits one at a time), `gpt-2`, and
 *     `default` (four regexes applied in turn);
 *  2. byte-encode each word (GPT-2's bytes_to_unicode map);
 *  3. merge adjacent symbols by merge rank, lowest first (leftmost on
 *     ties), until no pair has a rank; Llama 3 takes a word that is itself
 *     a token whole (ignore_merges);
 *  4. look each symbol up; one that is not a token falls back to its bytes.
 * Code-point classes come from unicode.c; invalid UTF-8 becomes U+FFFD. */
#include "model.h"
#include "unicode.h"

#include <stdlib.h>
#include <string.h>

/* ------------------------------------------------------------ merges */

kvq_status kvq_bpe_index(kvq_vocab *v, kvq_error *err)
{
    size_t ns = 16;
    while (ns < 2 * (size_t)v->nmerge) ns *= 2;
    if (!(v->mslot = calloc(ns, sizeof *v->mslot)))
        return kvq_fail(err, KVQ_ERR_NOMEM, "out of memory for the BPE merges");
    v->nmslot = ns;
    for (uint64_t r = 0; r < v->nmerge; r++) {
        size_t s = kvq_fnv1a(KVQ_FNV_SEED, v->merge[r], v->merge_len[r]) & (ns - 1);
        int dup = 0;
        for (; v->mslot[s]; s = (s + 1) & (ns - 1)) {
            uint32_t o = v->mslot[s] - 1;
            if (v->merge_len[o] == v->merge_len[r] && !memcmp(v->merge[o], v->merge[r], v->merge_len[r])) {
                dup = 1;
                break;
            }
        }
        if (!dup) v->mslot[s] = (uint32_t)r + 1; /* the first occurrence keeps its rank (llama.cpp's emplace) */
    }
    return KVQ_OK;
}

int kvq_bpe_rank(const kvq_vocab *v, const char *a, size_t na, const char *b, size_t nb)
{
    /* merge strings are "left right" (llama.cpp splits them at the first space after index 0) */
    uint64_t h = kvq_fnv1a(kvq_fnv1a(kvq_fnv1a(KVQ_FNV_SEED, a, na), " ", 1), b, nb);
    size_t len = na + 1 + nb;
    for (size_t s = h & (v->nmslot - 1);; s = (s + 1) & (v->nmslot - 1)) {
        if (!v->mslot[s]) return -1;
        uint32_t r = v->mslot[s] - 1;
        const char *m = v->merge[r];
        if (v->merge_len[r] == len && !memcmp(m, a, na) && m[na] == ' ' && !memcmp(m + na + 1, b, nb)) return (int)r;
    }
}

/* ---------------------------------------------------- pre-tokenizers */

enum { IN_RANGE = 16, OUT_OF_RANGE = 0xFFFFFFFFu };

/* One segment [ini, end) of the code points, and the words cut from it. */
typedef struct splitter {
    const uint32_t *cp;
    const unsigned char *cls; /* kvq_cp_class per code point */
    size_t ini, end, prev;
    size_t *len; /* word lengths in code points */
    size_t n, cap;
    int oom;
} splitter;

static uint32_t get(const splitter *s, size_t p) { return p >= s->ini && p < s->end ? s->cp[p] : OUT_OF_RANGE; }
/* llama.cpp's flags: 0 out of range, never 0 inside (IN_RANGE stands for its other categories) */
static unsigned fl(const splitter *s, size_t p) { return p >= s->ini && p < s->end ? s->cls[p] | IN_RANGE : 0; }

static size_t add(splitter *s, size_t end)
{
    size_t len = end - s->prev;
    if (len) {
        if (s->n == s->cap) {
            size_t nc = s->cap ? 2 * s->cap : 64;
            size_t *nl = realloc(s->len, nc * sizeof *nl);
            if (!nl) { s->oom = 1; return len; }
            s->len = nl, s->cap = nc;
        }
        s->len[s->n++] = len;
    }
    s->prev = end;
    return len;
}

static uint32_t ascii_lower(uint32_t c) { return c >= 'A' && c <= 'Z' ? c + 32 : c; }

/* 's|'t|'re|'ve|'m|'ll|'d (fold: case-insensitive, as llama3/qwen2): the length matched, or 0. */
static size_t contraction(const splitter *s, size_t pos, int fold)
{
    if (get(s, pos) != '\'' || pos + 1 >= s->end) return 0;
    uint32_t a = get(s, pos + 1);
    if (fold) a = ascii_lower(a);
    if (a == 's' || a == 't' || a == 'm' || a == 'd') return 2;
    if (pos + 2 >= s->end) return 0;
    uint32_t b = get(s, pos + 2);
    if (fold) b = ascii_lower(b);
    return (a == 'r' && b == 'e') || (a == 'v' && b == 'e') || (a == 'l' && b == 'l') ? 3 : 0;
}

#define LNS (KVQ_CP_LETTER | KVQ_CP_NUMBER | KVQ_CP_SPACE)

/* Whitespace at pos: \s+(?!\S) leaves the last one for the next word, \s+ takes all. */
static void whitespace_run(splitter *s, size_t *pos, size_t nws)
{
    if (nws > 1 && get(s, *pos + nws) != OUT_OF_RANGE) *pos += nws - 1;
    else if (nws > 0) *pos += nws;
    else *pos += 1; /* no match: one code point alone */
    add(s, *pos);
}

/* GPT-2: 's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+ */
static void split_gpt2(splitter *s)
{
    for (size_t pos = s->ini; pos < s->end && !s->oom;) {
        uint32_t cpt = get(s, pos);
        size_t k = contraction(s, pos, 0);
        if (k) { pos += add(s, pos + k); continue; }
        unsigned f2 = cpt == ' ' ? fl(s, pos + 1) : fl(s, pos);
        unsigned want = f2 & KVQ_CP_LETTER ? KVQ_CP_LETTER : f2 & KVQ_CP_NUMBER ? KVQ_CP_NUMBER : 0;
        if (want) { /* <space>?\p{L}+ or <space>?\p{N}+ */
            pos += cpt == ' ';
            while (f2 & want) f2 = fl(s, ++pos);
            add(s, pos);
            continue;
        }
        if (!(f2 & LNS) && f2) { /* <space>?[^\s\p{L}\p{N}]+ */
            pos += cpt == ' ';
            while (!(f2 & LNS) && f2) f2 = fl(s, ++pos);
            add(s, pos);
            continue;
        }
        size_t nws = 0;
        while (fl(s, pos + nws) & KVQ_CP_SPACE) nws++;
        whitespace_run(s, &pos, nws);
    }
}

/* Llama 3 (digits = 3) and Qwen2 (digits = 1):
 * (?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+ */
static void split_llama3(splitter *s, int digits)
{
    for (size_t pos = s->ini; pos < s->end && !s->oom;) {
        uint32_t cpt = get(s, pos);
        unsigned f = fl(s, pos);
        size_t k = contraction(s, pos, 1);
        if (k) { pos += add(s, pos + k); continue; }
        if (!(cpt == '\r' || cpt == '\n' || (f & KVQ_CP_NUMBER)) &&
            ((f & KVQ_CP_LETTER) || (fl(s, pos + 1) & KVQ_CP_LETTER))) {
            pos++; /* [^\r\n\p{L}\p{N}]?\p{L}+ */
            while (fl(s, pos) & KVQ_CP_LETTER) pos++;
            add(s, pos);
            continue;
        }
        if (f & KVQ_CP_NUMBER) { /* \p{N}{1,digits} */
            size_t ini = pos;
            while (fl(s, pos) & KVQ_CP_NUMBER)
                if (++pos - ini >= (size_t)digits) add(s, pos), ini = pos;
            add(s, pos);
            continue;
        }
        unsigned f2 = cpt == ' ' ? fl(s, pos + 1) : f;
        if (!(f2 & LNS) && f) { /* <space>?[^\s\p{L}\p{N}]+[\r\n]* */
            pos += cpt == ' ';
            while (!(f2 & LNS) && f2) f2 = fl(s, ++pos);
            for (uint32_t c2 = get(s, pos); c2 == '\r' || c2 == '\n';) c2 = get(s, ++pos);
            add(s, pos);
            continue;
        }
        size_t nws = 0, last_rn = 0;
        while (fl(s, pos + nws) & KVQ_CP_SPACE) {
            uint32_t c2 = get(s, pos + nws);
            if (c2 == '\r' || c2 == '\n') last_rn = pos + nws + 1;
            nws++;
        }
        if (last_rn) { /* \s*[\r\n]+ */
            pos = last_rn;
            add(s, pos);
            continue;
        }
        whitespace_run(s, &pos, nws);
    }
}

/* One "isolated" regex split of the default pre-tokenizer (std::regex in
 * llama.cpp): runs of code points for which in(c) holds are words, and
 * so is each gap between them; with `three`, runs are cut into ASCII-digit
 * triples (the regex [0-9][0-9][0-9]: the matches are the triples). */
static void split_runs(splitter *s, int (*in)(uint32_t c, unsigned cls), int three)
{
    size_t pos = s->ini;
    while (pos < s->end && !s->oom) {
        if (!in(s->cp[pos], s->cls[pos])) { pos++; continue; }
        size_t b = pos;
        while (pos < s->end && in(s->cp[pos], s->cls[pos]) && (!three || pos - b < 3)) pos++;
        if (three && pos - b < 3) continue; /* fewer than three digits: no match here */
        add(s, b); /* the gap before */
        add(s, pos);
    }
    add(s, s->end);
}

static int in_punct(uint32_t c, unsigned cls)
{
    return (cls & KVQ_CP_PUNCT) || (c < 128 && c && strchr("$+<=>^~|", (int)c));
}
static int in_number(uint32_t c, unsigned cls) { (void)c; return (cls & KVQ_CP_NUMBER) != 0; }
static int in_digit(uint32_t c, unsigned cls) { (void)cls; return c >= '0' && c <= '9'; }

/* Runs the pre-tokenizer over cp [0, n): word lengths into *len, *nw. */
int kvq_bpe_pretokenize(kvq_bpe_pre pre, const uint32_t *cp, const unsigned char *cls, size_t n, size_t **len,
                        size_t *nw)
{
    size_t *seg = malloc(sizeof *seg), nseg = 1;
    if (!seg) return -1;
    seg[0] = n;
    int passes = pre == KVQ_PRE_DEFAULT ? 4 : 1;
    for (int pass = 0; pass < passes; pass++) {
        splitter s = {.cp = cp, .cls = cls};
        size_t start = 0;
        for (size_t i = 0; i < nseg && !s.oom; i++) {
            s.ini = s.prev = start, s.end = start + seg[i];
            start = s.end;
            if (pre == KVQ_PRE_LLAMA3) split_llama3(&s, 3);
            else if (pre == KVQ_PRE_QWEN2) split_llama3(&s, 1);
            else if (pre == KVQ_PRE_GPT2 || pass == 1) split_gpt2(&s);
            else split_runs(&s, pass == 0 ? in_punct : pass == 2 ? in_number : in_digit, pass == 3);
        }
        free(seg);
        if (s.oom) { free(s.len); return -1; }
        seg = s.len, nseg = s.n;
    }
    *len = seg, *nw = nseg;
    return 0;
}

/* ------------------------------------------------------------ encode */

/* GPT-2's bytes_to_unicode: printable bytes stand for themselves, the
 * others for 256, 257, … in byte order; as UTF-8 (1 or 2 bytes). */
static void byte_char(unsigned b, char out[3], size_t *n)
{
    unsigned cp;
    if ((b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF)) {
        cp = b;
    } else {
        unsigned k = 0; /* how many unprintable bytes come before b */
        for (unsigned c = 0; c < b; c++)
            k += !((c >= 0x21 && c <= 0x7E) || (c >= 0xA1 && c <= 0xAC) || (c >= 0xAE && c <= 0xFF));
        cp = 256 + k;
    }
    if (cp < 0x80) out[0] = (char)cp, *n = 1;
    else out[0] = (char)(0xC0 | cp >> 6), out[1] = (char)(0x80 | (cp & 0x3F)), *n = 2;
}

static size_t put_utf8(uint32_t c, char *o)
{
    if (c < 0x80) { o[0] = (char)c; return 1; }
    if (c < 0x800) { o[0] = (char)(0xC0 | c >> 6), o[1] = (char)(0x80 | (c & 0x3F)); return 2; }
    if (c < 0x10000) {
        o[0] = (char)(0xE0 | c >> 12), o[1] = (char)(0x80 | ((c >> 6) & 0x3F)), o[2] = (char)(0x80 | (c & 0x3F));
        return 3;
    }
    o[0] = (char)(0xF0 | c >> 18), o[1] = (char)(0x80 | ((c >> 12) & 0x3F)), o[2] = (char)(0x80 | ((c >> 6) & 0x3F));
    o[3] = (char)(0x80 | (c & 0x3F));
    return 4;
}

typedef struct bpe_ctx {
    const kvq_vocab *v;
    const char *w;
} bpe_ctx;

/* BPE: (l, r) may merge if the merges list them, lower rank first. */
static int bpe_pair(void *ctx, const kvq_sym *sy, int l, int r, kvq_bigram_heap *h)
{
    const bpe_ctx *c = ctx;
    if (l < 0 || r < 0) return 0;
    int rank = kvq_bpe_rank(c->v, c->w + sy[l].off, sy[l].len, c->w + sy[r].off, sy[r].len);
    return rank < 0 ? 0 : kvq_bigram_push(h, (kvq_bigram){-(double)rank, l, r, sy[l].len + sy[r].len});
}

/* One byte-encoded word w [0, n) into tokens. */
static int encode_word(const kvq_vocab *v, const char *w, size_t n, kvq_sym *sy, kvq_bigram_heap *h, kvq_tokbuf *out)
{
    int id;
    if (v->ignore_merges && (id = kvq_vocab_lookup(v, w, n)) >= 0) return kvq_tokbuf_push(out, id);
    int ns = kvq_utf8_symbols(w, n, sy);
    bpe_ctx ctx = {v, w};
    if (kvq_merge_symbols(sy, ns, h, bpe_pair, &ctx)) return -1;
    for (int i = 0; ns && i >= 0; i = sy[i].next) {
        if ((id = kvq_vocab_lookup(v, w + sy[i].off, sy[i].len)) >= 0) {
            if (kvq_tokbuf_push(out, id)) return -1;
            continue;
        }
        for (size_t j = 0; j < sy[i].len; j++) /* llama.cpp: each byte as a one-byte piece, if there is one */
            if ((id = kvq_vocab_lookup(v, w + sy[i].off + j, 1)) >= 0 && kvq_tokbuf_push(out, id)) return -1;
    }
    return 0;
}

kvq_status kvq_bpe_encode(const kvq_vocab *v, const char *text, size_t n, kvq_tokbuf *out, kvq_error *err)
{
    const unsigned char *t = (const unsigned char *)text;
    uint32_t *cp = malloc((n + 1) * sizeof *cp);
    unsigned char *cls = malloc(n + 1);
    char *w = malloc(8 * n + 8); /* a word's bytes, each byte-encoded in at most 2 */
    kvq_sym *sy = malloc((8 * n + 8) * sizeof *sy);
    size_t *len = NULL, nw = 0, ncp = 0;
    kvq_bigram_heap h = {0};
    kvq_status st = KVQ_OK;
    if (!cp || !cls || !w || !sy) goto oom;
    for (size_t i = 0; i < n;) {
        cp[ncp] = kvq_utf8_next(t, n, &i);
        cls[ncp] = (unsigned char)kvq_cp_class(cp[ncp]);
        ncp++;
    }
    if (kvq_bpe_pretokenize(v->pre, cp, cls, ncp, &len, &nw)) goto oom;
    for (size_t k = 0, at = 0; k < nw; at += len[k++]) {
        size_t wl = 0;
        for (size_t c = at; c < at + len[k]; c++) { /* the word's UTF-8, each byte byte-encoded */
            char u[4];
            size_t un = put_utf8(cp[c], u), bn;
            for (size_t b = 0; b < un; b++, wl += bn) byte_char((unsigned char)u[b], w + wl, &bn);
        }
        if (encode_word(v, w, wl, sy, &h, out)) goto oom;
    }
    goto done;
oom:
    st = kvq_fail(err, KVQ_ERR_NOMEM, "out of memory tokenizing %zu bytes", n);
done:
    free(cp), free(cls), free(w), free(sy), free(len), free(h.b);
    return st;
}

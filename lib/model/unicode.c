/* unicode.c — code-point classes and UTF-8 decoding for the tokenizers
 * (docs/models.md), as llama.cpp's unicode.cpp does them; the tables are
 * generated (unicode_data.c, tools/gen_unicode_tables.py). */
#include "unicode.h"

static int in_ranges(const kvq_cp_range *r, size_t n, uint32_t c)
{
    size_t lo = 0, hi = n; /* first range with hi >= c */
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        if (r[mid].hi < c) lo = mid + 1;
        else hi = mid;
    }
    return lo < n && r[lo].lo <= c;
}

unsigned kvq_cp_class(uint32_t c)
{
    if (c < 128) { /* ASCII without a search */
        if ((c | 32) >= 'a' && (c | 32) <= 'z') return KVQ_CP_LETTER;
        if (c >= '0' && c <= '9') return KVQ_CP_NUMBER;
        if (c == ' ' || (c >= 9 && c <= 13)) return KVQ_CP_SPACE;
        return in_ranges(kvq_ucd_punct, kvq_ucd_punct_n, c) ? KVQ_CP_PUNCT : 0;
    }
    unsigned k = 0;
    if (in_ranges(kvq_ucd_letter, kvq_ucd_letter_n, c)) k |= KVQ_CP_LETTER;
    if (in_ranges(kvq_ucd_number, kvq_ucd_number_n, c)) k |= KVQ_CP_NUMBER;
    if (in_ranges(kvq_ucd_punct, kvq_ucd_punct_n, c)) k |= KVQ_CP_PUNCT;
    if (in_ranges(kvq_ucd_space, kvq_ucd_space_n, c)) k |= KVQ_CP_SPACE;
    return k;
}

uint32_t kvq_utf8_next(const unsigned char *s, size_t n, size_t *i)
{
    size_t p = *i;
    unsigned char b = s[p];
    int len = !(b & 0x80) ? 1 : !(b & 0x40) ? 0 : !(b & 0x20) ? 2 : !(b & 0x10) ? 3 : !(b & 0x08) ? 4 : 0;
    if (len == 0 || p + (size_t)len > n) goto invalid;
    for (int k = 1; k < len; k++)
        if ((s[p + k] & 0xC0) != 0x80) goto invalid;
    uint32_t c = len == 1 ? b : len == 2 ? b & 0x1Fu : len == 3 ? b & 0x0Fu : b & 0x07u;
    for (int k = 1; k < len; k++) c = c << 6 | (s[p + k] & 0x3Fu);
    *i = p + (size_t)len;
    return c;
invalid:
    *i = p + 1;
    return 0xFFFD;
}

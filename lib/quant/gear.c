/* gear.c — GEAR (docs/quantizers.md#gear): a quantized backbone, exact sparse outliers and
 * a low-rank correction of what is left.
 *
 * Per layer and tensor:
 *   1. outliers: in each row (K: a channel over its T tokens; V: a token over
 *      its head's D channels, or over all H·D with span=layer), the k =
 *      floor(sparsity·n/2) largest and then the k smallest of the remaining
 *      values (ties: lower index) are kept at fp16; in the copy that the
 *      backbone sees they become the row mean (outliers included);
 *   2. backbone D̂ on that copy: kivi (K per-channel / V per-token groups of
 *      `group`, no residual window) or kcvt; outlier positions then take
 *      their fp16 values (D̂ + S);
 *   3. low rank per head on E = X − (D̂ + S): truncated SVD or GEAR's power
 *      iteration; X' = D̂ + S + L.
 * Bits: backbone codes + scales/zeros, 16 + 32 per outlier, r·(T + D)·16 per head. */
#include "../internal.h"
#include "quant.h"
#include "../simd.h"

#include <math.h>
#include <omp.h>
#include <string.h>

enum { BACKBONE_KIVI, BACKBONE_KCVT }; /* backbone's choices */
enum { LOWRANK_POWER, LOWRANK_SVD };   /* lowrank's choices */
typedef struct gear_opts {
    int bits, group, backbone, rank;
    double sparsity;
    int lowrank, loop;
    int span; /* 0 head, 1 layer */
} gear_opts;

#define GEAR_PARAMS(sparsity_default)                                                                              \
    {                                                                                                              \
        {.key = "bits", .type = KVQ_PARAM_INT, .def = "2", .min = 1, .max = 16, .help = "backbone bits per code",  \
         KVQ_OPT(gear_opts, bits)},                                                                                \
        {.key = "group", .type = KVQ_PARAM_INT, .def = "32", .min = 1, .max = 1e9,                                 \
         .help = "kivi backbone group: tokens for K, channels for V", KVQ_OPT(gear_opts, group)},                  \
        {.key = "backbone", .type = KVQ_PARAM_CHOICE, .def = "kivi", .choices = "kivi|kcvt",                       \
         .help = "quantizer under the corrections", KVQ_OPT(gear_opts, backbone)},                                 \
        {.key = "rank", .type = KVQ_PARAM_INT, .def = "4", .min = 0, .max = 1e6,                                   \
         .help = "rank of the low-rank part per head (0 = none)", KVQ_OPT(gear_opts, rank)},                       \
        {.key = "sparsity", .type = KVQ_PARAM_REAL, .def = sparsity_default, .min = 0, .max = 1,                   \
         .help = "fraction of each row kept as exact outliers", KVQ_OPT(gear_opts, sparsity)},                     \
        {.key = "lowrank", .type = KVQ_PARAM_CHOICE, .def = "power", .choices = "power|svd",                       \
         .help = "GEAR's power iteration or truncated SVD", KVQ_OPT(gear_opts, lowrank)},                          \
        {.key = "loop", .type = KVQ_PARAM_INT, .def = "3", .min = 1, .max = 1000, .help = "power-iteration passes", \
         KVQ_OPT(gear_opts, loop)},                                                                                \
        {.key = "span", .type = KVQ_PARAM_CHOICE, .def = "head", .choices = "head|layer",                          \
         .help = "V rows and groups: one head, or all heads of the token", KVQ_OPT(gear_opts, span)},              \
    }

static const kvq_param gear_params[] = GEAR_PARAMS("0.02");
static const kvq_param gear_l_params[] = GEAR_PARAMS("0");

static kvq_status gear_l_check(const kvq_spec *sp, kvq_error *err)
{
    const gear_opts *o = kvq_spec_opts(sp);
    if (o->sparsity != 0.0)
        return kvq_fail(err, KVQ_ERR_USAGE, "%s: sparsity: gear-l has no outliers (use gear)", sp->text);
    return KVQ_OK;
}

/* ------------------------------------------------------------ outliers */


static int cmp_float(const void *a, const void *b)
{
    float x = *(const float *)a, y = *(const float *)b;
    return (x > y) - (x < y);
}

/* The k-th smallest (0-based) of v[0..n) by value, reordering v: quickselect
 * (median-of-three pivot, three-way partition), O(n) expected; after
 * 2·log2(n) + 8 rounds without finishing, the range left is sorted instead,
 * so no input costs more than O(n log n). */
static float select_kth(float *v, int n, int k)
{
    int lo = 0, hi = n - 1, budget = 8;
    for (int m = n; m > 1; m >>= 1) budget += 2;
    while (hi > lo) {
        if (budget-- == 0) {
            qsort(v + lo, (size_t)(hi - lo + 1), sizeof *v, cmp_float);
            return v[k];
        }
        float a = v[lo], b = v[lo + (hi - lo) / 2], c = v[hi];
        float pivot = a < b ? (b < c ? b : a < c ? c : a) : (a < c ? a : b < c ? c : b);
        /* v[lo..lt) < pivot, v[lt..i) == pivot, v(gt..hi] > pivot */
        int lt = lo, i = lo, gt = hi;
        while (i <= gt) {
            float x = v[i];
            if (x < pivot) v[i++] = v[lt], v[lt++] = x;
            else if (x > pivot) v[i] = v[gt], v[gt--] = x;
            else i++;
        }
        if (k < lt) hi = lt - 1;
        else if (k > gt) lo = gt + 1;
        else return pivot;
    }
    return v[k];
}

/* The longest list a top_k_scan keeps: beyond it, selections cost less. */
#define GEAR_SCAN_MAX 64

/* The k best of row (largest or smallest) not in skip, best first, into
 * idx: one pass keeping a sorted list of k, O(n) when few values beat the
 * k-th (the usual case for small k).  Indices arrive in increasing order, so
 * an equal value never displaces a kept one: ties go to the lower index. */
static void top_k_scan(const float *row, int n, int k, int largest, const unsigned char *skip, float *val, int *idx)
{
    int cnt = 0;
    for (int i = 0; i < n; i++) {
        if (skip && skip[i]) continue;
        float v = row[i];
        if (cnt == k && !(largest ? v > val[k - 1] : v < val[k - 1])) continue;
        int p = cnt < k ? cnt++ : k - 1;
        while (p > 0 && (largest ? v > val[p - 1] : v < val[p - 1])) val[p] = val[p - 1], idx[p] = idx[p - 1], p--;
        val[p] = v, idx[p] = i;
    }
}

/* A cut for the `count` most extreme values of a long row (largest: the
 * highest): the value whose rank from that end, in an evenly strided sample
 * of GEAR_SAMPLE values, matches about 2·count + 64 values of the row, so
 * that usually a few hundred values of the row lie at or beyond it.  0: no
 * cut worth taking (a short row, or count a large part of it). */
#define GEAR_SAMPLE 512
static int sample_cut(const float *row, int n, int count, int largest, float *cut)
{
    if (n < 4 * GEAR_SAMPLE) return 0;
    float s[GEAR_SAMPLE];
    for (int i = 0; i < GEAR_SAMPLE; i++) s[i] = row[(size_t)i * (size_t)n / GEAR_SAMPLE];
    long rank = (2L * count + 64) * GEAR_SAMPLE / n + 1;
    if (rank >= GEAR_SAMPLE / 2) return 0;
    if (rank < GEAR_SCAN_MAX) { /* the same value by a scan: fewer mispredicted branches */
        float val[GEAR_SCAN_MAX];
        int idx[GEAR_SCAN_MAX];
        top_k_scan(s, GEAR_SAMPLE, (int)rank + 1, largest, NULL, val, idx);
        *cut = val[rank];
    } else {
        *cut = select_kth(s, GEAR_SAMPLE, (int)(largest ? GEAR_SAMPLE - 1 - rank : rank));
    }
    return 1;
}

/* Marks in sel the `count` first of the unmarked values of row in the order
 * (value, index) — ascending values (largest = 0) or descending (1): all
 * beyond the threshold, then the lowest indices of the run equal to it.
 * The threshold (the count-th value in that order) is selected among the
 * unmarked values at or beyond a sampled cut when at least `count` of them
 * are: every value beyond the threshold is then among them, so it is the
 * same threshold as over all unmarked values.  When fewer pass the cut, it
 * is selected over all unmarked values.
 * v: n floats of scratch. */
static void mark_extreme(const float *row, int n, int count, int largest, unsigned char *sel, float *v)
{
    int m = 0;
    float cut;
    if (sample_cut(row, n, count, largest, &cut))
        for (int i = 0; i < n; i++) { /* appends without a branch: m <= i < n */
            float x = row[i];
            v[m] = x;
            m += (sel[i] == 0) & (largest ? x >= cut : x <= cut);
        }
    if (m < count) {
        m = 0;
        for (int i = 0; i < n; i++)
            if (!sel[i]) v[m++] = row[i];
    }
    float th = select_kth(v, m, largest ? m - count : count - 1);
    int beyond = 0;
    for (int i = 0; i < n; i++)
        if (!sel[i] && (largest ? row[i] > th : row[i] < th)) sel[i] = 1, beyond++;
    for (int i = 0, need = count - beyond; i < n && need > 0; i++)
        if (!sel[i] && row[i] == th) sel[i] = 1, need--;
}

/* mark_extreme for the k largest and then the k smallest of the rest, their
 * candidates gathered in one pass and marked in one more, where the two
 * sampled cuts leave a gap (lo < hi): every value the largest marks is at
 * or above hi, so none of the smallest's candidates (at or below lo) is
 * marked, and the two selections neither see nor touch each other's values
 * — the marks mark_extreme makes, in half the passes.  Otherwise (a short
 * row, no gap, or a cut that catches fewer than k) the two calls.
 * v: 2n floats of scratch. */
static void mark_both_extremes(const float *row, int n, int k, unsigned char *sel, float *v)
{
    float hi, lo, *vh = v, *vl = v + n;
    int mh = 0, ml = 0;
    if (sample_cut(row, n, k, 1, &hi) && sample_cut(row, n, k, 0, &lo) && lo < hi) {
        for (int i = 0; i < n; i++) { /* appends without a branch: mh, ml <= i < n */
            float x = row[i];
            vh[mh] = x, vl[ml] = x;
            mh += x >= hi, ml += x <= lo;
        }
    }
    if (mh < k || ml < k) {
        mark_extreme(row, n, k, 1, sel, v);
        mark_extreme(row, n, k, 0, sel, v);
        return;
    }
    float th_hi = select_kth(vh, mh, mh - k), th_lo = select_kth(vl, ml, k - 1);
    int need_hi = k, need_lo = k, first_hi = n, first_lo = n;
    for (int i = 0; i < n; i++) { /* vectorised: the marks, their counts, each threshold's first index */
        float x = row[i];
        int up = x > th_hi, down = x < th_lo;
        sel[i] = (unsigned char)(up | down), need_hi -= up, need_lo -= down;
        int at_hi = x == th_hi ? i : n, at_lo = x == th_lo ? i : n;
        first_hi = at_hi < first_hi ? at_hi : first_hi, first_lo = at_lo < first_lo ? at_lo : first_lo;
    }
    if (need_hi == 1 && need_lo == 1) { /* the usual case: each threshold's value is needed once */
        sel[first_hi] = sel[first_lo] = 1;
        return;
    }
    for (int i = 0; i < n && (need_hi > 0 || need_lo > 0); i++) {
        if (need_hi > 0 && row[i] == th_hi) sel[i] = 1, need_hi--;
        else if (need_lo > 0 && row[i] == th_lo) sel[i] = 1, need_lo--;
    }
}

/* k = 1 (rows of 100 to 149 values, as V's 128 channels with sparsity
 * 0.02): what the two top_k_scan calls mark — the first index of the largest
 * value, then the first other index of the smallest value — from one pass for
 * the row's largest and smallest value (in 16 independent lanes) and two
 * searches for their first indices.  If the smallest value's only index is
 * the largest's, all values are equal and the search finds index 1.
 * 0: the row holds a NaN (which top_k_scan orders by position; not marked). */
static int mark_one_each(const float *row, int n, unsigned char *sel)
{
    enum { L = 16 };
    float hi[L], lo[L];
    int nan[L] = {0}, i = 0;
    for (int l = 0; l < L; l++) hi[l] = lo[l] = row[0];
    for (; i + L <= n; i += L)
        for (int l = 0; l < L; l++) {
            float x = row[i + l];
            hi[l] = x > hi[l] ? x : hi[l], lo[l] = x < lo[l] ? x : lo[l], nan[l] |= x != x;
        }
    for (; i < n; i++) {
        float x = row[i];
        hi[0] = x > hi[0] ? x : hi[0], lo[0] = x < lo[0] ? x : lo[0], nan[0] |= x != x;
    }
    float mx = hi[0], mn = lo[0];
    for (int l = 1; l < L; l++) {
        mx = hi[l] > mx ? hi[l] : mx, mn = lo[l] < mn ? lo[l] : mn;
        nan[0] |= nan[l];
    }
    if (nan[0]) return 0;
    int top = 0, bottom = 0;
    while (row[top] != mx) top++;
    while (bottom == top || row[bottom] != mn) bottom++;
    sel[top] = sel[bottom] = 1;
    return 1;
}

/* The means GEAR gives the outliers in the backbone's copy, of nb <=
 * GEAR_BLOCK rows rows[b·n ..][0..n): per row the sum in double, in index
 * order (the rows side by side, so that the sums run in parallel), over all
 * n values, outliers included. */
#define GEAR_BLOCK KVQ_CHANNEL_BLOCK
static void row_means(const float *rows, int nb, int n, float *mean)
{
    double sum[GEAR_BLOCK] = {0};
    for (int e = 0; e < n; e++)
        for (int b = 0; b < nb; b++) sum[b] += rows[(size_t)b * n + e];
    for (int b = 0; b < nb; b++) mean[b] = (float)(sum[b] / n);
}

/* Marks in sel (zeroed) the k > 0 largest values of row[0..n), then the k
 * smallest of the rest (ties: lower index first).  r: n scratch entries. */
static void mark_row_outliers(const float *row, int n, int k, unsigned char *sel, float *scratch)
{
    if (k == 1 && mark_one_each(row, n, sel)) return;
    if (k <= GEAR_SCAN_MAX) { /* scans; r doubles as the value/index lists */
        float *val = scratch;
        int *idx = (int *)(scratch + k); /* 2k <= n */
        top_k_scan(row, n, k, 1, NULL, val, idx);
        for (int j = 0; j < k; j++) sel[idx[j]] = 1;
        top_k_scan(row, n, k, 0, sel, val, idx);
        for (int j = 0; j < k; j++) sel[idx[j]] = 1;
    } else { /* selections, O(n): the largest k, then the smallest k of the rest */
        mark_both_extremes(row, n, k, sel, scratch);
    }
}

/* Row row[0..n): marks the k largest values, then the k smallest of the
 * rest (ties: lower index first) in sel, and replaces them by the row mean
 * in work (a copy of row).  r: n scratch entries. */
void kvq_gear_row_outliers(const float *row, float *work, unsigned char *sel, int n, int k, float *scratch)
{
    memset(sel, 0, (size_t)n);
    if (k <= 0) return;
    mark_row_outliers(row, n, k, sel, scratch);
    if (!work) return; /* only the selection (kvquant keeps outliers without replacement) */
    float mean;
    row_means(row, 1, n, &mean);
    for (int i = 0; i < n; i++)
        if (sel[i]) work[i] = mean;
}

/* ------------------------------------------------------------- a tensor */

typedef struct {
    const kvq_spec *sp;
    const gear_opts *o; /* sp's options */
    const kvq_quant_ctx *ctx;
    int tensor, H, T, D;
    const float *x; /* [H][T][D] */
    float *y;       /* [H][T][D]: output */
    float *w;       /* the copies the backbone quantizes: V with span=layer the layer's
                     * [H][T][D]; otherwise [nt][T][D], each thread's of its head */
    int nt;         /* threads, at most H */
    size_t *opos;   /* [H][cap]: outlier offsets within each head's [T][D] */
    size_t *nout;   /* [H]: outliers of each head */
    size_t cap;     /* room per head in opos */
    double *bits;   /* [H] */
    int head0;      /* y, opos and nout start at this head: 0, or h for one head (gear_head) */
    int bad_head;   /* out: the first failing head */
} gear_job;

/* Head h's output [T][D], outlier offsets and their count. */
static float *job_y(const gear_job *j, int h) { return j->y + (size_t)(h - j->head0) * j->T * j->D; }
static size_t *job_opos(const gear_job *j, int h) { return j->opos + (size_t)(h - j->head0) * j->cap; }
static size_t *job_nout(const gear_job *j, int h) { return j->nout + (h - j->head0); }

/* Whether the tensor's rows are tokens over all heads (V with span=layer). */
static int span_layer(const gear_job *j) { return j->tensor == 1 && j->o->span == 1; }

/* Outliers per row (k largest + k smallest) and rows per head, for head
 * rows (h >= 0) or layer rows (span=layer: a token over all heads). */
static int row_count(const gear_job *j, int layer_rows) { return layer_rows || j->tensor == 1 ? j->T : j->D; }
static int row_len(const gear_job *j, int layer_rows)
{
    return layer_rows ? j->H * j->D : j->tensor == 1 ? j->D : j->T;
}
static int row_k(const gear_job *j, int n) { return (int)floor(j->o->sparsity * n / 2.0); }

/* sel[e0..e0 + 8) ∩ [0, n) (bytes 0 or 1) as a word with bit 8·i set for
 * sel[e0 + i]: its set bits in increasing order are the marked indices. */
static inline uint64_t marks8(const unsigned char *sel, int e0, int n)
{
    uint64_t m = 0;
    if (e0 + 8 > n) {
        for (int e = e0; e < n; e++) m |= (uint64_t)sel[e] << 8 * (e - e0);
        return m;
    }
    memcpy(&m, sel + e0, 8);
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    m = __builtin_bswap64(m);
#endif
    return m;
}

/* Step 1 for the rows of head h into w, a copy of that head's [T][D], or of
 * the whole layer (h < 0, V span=layer) into w, a copy of [H][T][D]; and the
 * outlier lists: only the outliers are written.  Rows are gathered
 * GEAR_BLOCK at a time: K's rows are columns of [T][D] (so each cache line
 * is read once), V's rows are tokens (a head's D channels, or with h < 0
 * each head's D in turn). */
static kvq_status mark_outliers(gear_job *j, int h, float *w)
{
    int layer_rows = h < 0, by_token = layer_rows || j->tensor == 1;
    int n = row_len(j, layer_rows), nrows = row_count(j, layer_rows), k = row_k(j, n);
    size_t T = (size_t)j->T, D = (size_t)j->D;
    if (k <= 0) return KVQ_OK;
    float *rows = kvq_alloc_array((size_t)GEAR_BLOCK * n, sizeof *rows), *r = kvq_alloc_array((size_t)n, 2 * sizeof *r);
    unsigned char *sel = malloc((size_t)n);
    /* K: the outliers as bits of [T][W words] and each channel's mean, written to w and the
     * list afterwards in memory order (a channel's outliers lie one token row apart) */
    size_t W = (D + 63) / 64;
    uint64_t *bit = by_token ? NULL : kvq_alloc_array(T * W, sizeof *bit);
    float *chmean = by_token ? NULL : kvq_alloc_array(D, sizeof *chmean);
    if (!rows || !r || !sel || (!by_token && (!bit || !chmean))) {
        free(rows), free(r), free(sel), free(bit), free(chmean);
        return KVQ_ERR_NOMEM;
    }
    if (bit) memset(bit, 0, T * W * sizeof *bit);
    for (int rw0 = 0; rw0 < nrows; rw0 += GEAR_BLOCK) {
        int nb = nrows - rw0 < GEAR_BLOCK ? nrows - rw0 : GEAR_BLOCK;
        if (layer_rows) { /* tokens rw0.. over every head's channels */
            for (int b = 0; b < nb; b++)
                for (int hh = 0; hh < j->H; hh++)
                    memcpy(rows + (size_t)b * n + hh * D, j->x + ((size_t)hh * T + rw0 + b) * D, D * sizeof *rows);
        } else if (by_token) { /* V: tokens rw0.. of head h, contiguous */
            memcpy(rows, j->x + ((size_t)h * T + rw0) * D, (size_t)nb * D * sizeof *rows);
        } else { /* K: channels rw0.. over the tokens */
            kvq_gather_channels(j->x + (size_t)h * T * D + rw0, D, nb, n, rows);
        }
        float mean[GEAR_BLOCK];
        row_means(rows, nb, n, mean);
        for (int b = 0; b < nb; b++) {
            kvq_gear_row_outliers(rows + (size_t)b * n, NULL, sel, n, k, r);
            size_t rw = (size_t)rw0 + b;
            if (chmean) chmean[rw] = mean[b];
            for (int e0 = 0; e0 < n; e0 += 8) /* 2k of n marked: eight at a time, by their bits */
                for (uint64_t m = marks8(sel, e0, n); m; m &= m - 1) {
                    int e = e0 + __builtin_ctzll(m) / 8;
                    if (bit) { /* K: channel rw at token e */
                        bit[(size_t)e * W + rw / 64] |= (uint64_t)1 << (rw % 64);
                        continue;
                    }
                    /* head and offset in its [T][D]: a V row is token rw over
                     * the channels e (with layer rows, e = head·D + channel) */
                    int hh = layer_rows ? e / (int)D : h;
                    size_t at = layer_rows ? rw * D + (size_t)e % D : rw * D + (size_t)e;
                    w[(layer_rows ? (size_t)hh * T * D : 0) + at] = mean[b];
                    job_opos(j, hh)[(*job_nout(j, hh))++] = at;
                }
        }
    }
    if (bit) /* K's outliers token by token, channels ascending */
        for (size_t t = 0; t < T; t++)
            for (size_t wd = 0; wd < W; wd++)
                for (uint64_t m = bit[t * W + wd]; m; m &= m - 1) {
                    size_t c = wd * 64 + (size_t)__builtin_ctzll(m), at = t * D + c;
                    w[at] = chmean[c];
                    job_opos(j, h)[(*job_nout(j, h))++] = at;
                }
    free(rows), free(r), free(sel), free(bit), free(chmean);
    return KVQ_OK;
}

/* Step 2 for head h (span=head or K) from w, its [T][D] with the outliers
 * replaced: backbone codes into y. */
static kvq_status head_backbone(gear_job *j, int h, const float *w)
{
    int T = j->T, D = j->D, bits = j->o->bits, G = j->o->group;
    int kcvt = j->o->backbone == BACKBONE_KCVT;
    if (j->tensor == 0)
        return kvq_quant_head_per_channel(w, job_y(j, h), T, D, 0, T, bits, kcvt ? T : G, KVQ_SCALE_FP16, &j->bits[h],
                                          NULL);
    return kvq_quant_head_per_token(w, job_y(j, h), T, D, 0, T, bits, kcvt ? D : G, KVQ_SCALE_FP16, &j->bits[h], NULL);
}

/* E = X − (D̂ + S) in double (the difference taken in float), and
 * X' = D̂ + S + L from it (L rounded to float, then added): element by
 * element, compiled for AVX2 too. */
KVQ_BODY void residual_body(const float *restrict x, const float *restrict y, double *restrict e, size_t n)
{
    for (size_t i = 0; i < n; i++) e[i] = (double)(x[i] - y[i]);
}
KVQ_BODY void add_low_rank_body(float *restrict y, const double *restrict e, size_t n)
{
    for (size_t i = 0; i < n; i++) y[i] += (float)e[i];
}
static void residual_plain(const float *x, const float *y, double *e, size_t n) { residual_body(x, y, e, n); }
static void add_low_rank_plain(float *y, const double *e, size_t n) { add_low_rank_body(y, e, n); }
#ifdef KVQ_AVX2_CLONES
KVQ_TARGET_AVX2 static void residual_avx2(const float *x, const float *y, double *e, size_t n)
{
    residual_body(x, y, e, n);
}
KVQ_TARGET_AVX2 static void add_low_rank_avx2(float *y, const double *e, size_t n) { add_low_rank_body(y, e, n); }
KVQ_TARGET_AVX512 static void residual_avx512(const float *x, const float *y, double *e, size_t n)
{
    residual_body(x, y, e, n);
}
KVQ_TARGET_AVX512 static void add_low_rank_avx512(float *y, const double *e, size_t n) { add_low_rank_body(y, e, n); }
#endif
static void residual(const float *x, const float *y, double *e, size_t n) { KVQ_PICK_CLONE(residual)(x, y, e, n); }
static void add_low_rank(float *y, const double *e, size_t n) { KVQ_PICK_CLONE(add_low_rank)(y, e, n); }

/* Step 2b at offset p: the exact value back at fp16 (D̂ + S);
 * KVQ_ERR_NUMERIC where it overflows fp16. */
static kvq_status restore_outlier(const float *x, float *y, size_t p)
{
    y[p] = kvq_round_f16(x[p]);
    return isfinite(y[p]) ? KVQ_OK : KVQ_ERR_NUMERIC;
}

/* Steps 2b and 3 for head h: outliers back at fp16, then the low rank
 * (the power iteration's residual pass restores them on its way). */
static kvq_status head_finish(gear_job *j, int h, kvq_error *err)
{
    int T = j->T, D = j->D;
    size_t off = (size_t)h * T * D, n = (size_t)T * D;
    const float *x = j->x + off;
    float *y = job_y(j, h);
    const size_t *opos = job_opos(j, h), nout = *job_nout(j, h);
    j->bits[h] += (double)nout * (16.0 + 32.0);
    int r = j->o->rank, m = T < D ? T : D;
    if (r > m) r = m;
    kvq_status st = KVQ_OK;
    if (r > 0 && j->o->lowrank == LOWRANK_POWER) { /* E formed in double and L added from it: no float copies */
        double *e = kvq_alloc_array(n, sizeof *e);
        if (!e) return KVQ_ERR_NOMEM;
        /* E = X − (D̂ + S), in float, a chunk at a time: the pass brings the
         * chunk into cache, then its outliers (opos ascends) go back at fp16
         * and their E is taken again */
        enum { CHUNK = 1024 };
        size_t i = 0;
        for (size_t c0 = 0; c0 < n && !st; c0 += CHUNK) {
            size_t c1 = n - c0 < CHUNK ? n : c0 + CHUNK;
            residual(x + c0, y + c0, e + c0, c1 - c0);
            for (; i < nout && opos[i] < c1 && !st; i++) {
                st = restore_outlier(x, y, opos[i]);
                e[opos[i]] = (double)(x[opos[i]] - y[opos[i]]);
            }
        }
        if (!st && i < nout) /* a list out of order: outliers left behind */
            st = kvq_fail(err, KVQ_ERR_INTERNAL, "outlier offsets out of order");
        if (!st) {
            kvq_rng rng;
            kvq_rng_init(&rng, j->ctx->seed, (uint64_t)j->ctx->layer, (uint64_t)h,
                         kvq_family_stream(j->sp->q, (uint64_t)j->tensor));
            st = kvq_lowrank_power_d(e, T, D, r, j->o->loop, &rng, err);
        }
        if (!st) add_low_rank(y, e, n); /* X' = D̂ + S + L */
        free(e);
    } else {
        for (size_t i = 0; i < nout && !st; i++) st = restore_outlier(x, y, opos[i]);
        if (st || r <= 0) return st;
        float *E = kvq_alloc_array(n, sizeof *E), *L = kvq_alloc_array(n, sizeof *L);
        if (!E || !L) {
            st = KVQ_ERR_NOMEM;
        } else {
            for (size_t i = 0; i < n; i++) E[i] = x[i] - y[i];
            st = kvq_lowrank_svd(E, T, D, r, L, err);
            if (!st)
                for (size_t i = 0; i < n; i++) y[i] += L[i];
        }
        free(E), free(L);
    }
    if (!st) j->bits[h] += 16.0 * r * (double)(T + D);
    return st;
}

/* Whether tensor's rows have outliers to replace, so that the backbone
 * quantizes a copy of x (with sparsity 0 it quantizes x itself). */
static int needs_copy(const gear_job *j) { return row_k(j, row_len(j, span_layer(j))) > 0; }

/* Steps 1 to 3 for head h of a tensor whose rows are the head's (not V with
 * span=layer): the head copied into w ([T][D]) and its outliers marked
 * there, when it has any, then the backbone and the rest. */
static kvq_status head_all_steps(gear_job *j, int h, float *w, kvq_error *err)
{
    size_t hn = (size_t)j->T * j->D;
    const float *src = j->x + (size_t)h * hn;
    kvq_status s = KVQ_OK;
    if (needs_copy(j)) {
        memcpy(w, src, hn * sizeof *w);
        s = mark_outliers(j, h, w), src = w;
    }
    if (!s) s = head_backbone(j, h, src);
    return s ? s : head_finish(j, h, err);
}

static kvq_status gear_tensor(gear_job *j, kvq_error *err)
{
    int H = j->H, copy = needs_copy(j);
    int layer_span = span_layer(j);
    size_t hn = (size_t)j->T * j->D; /* one head's [T][D] */
    kvq_status *sts = calloc((size_t)H, sizeof *sts);
    kvq_error *errs = calloc((size_t)H, sizeof *errs);
    if (!sts || !errs) {
        free(sts), free(errs);
        return KVQ_ERR_NOMEM;
    }
    kvq_status st = KVQ_OK;
    if (layer_span) {
        int kcvt = j->o->backbone == BACKBONE_KCVT;
        const float *src = j->x;
        if (copy) {
            memcpy(j->w, j->x, (size_t)H * hn * sizeof *j->w);
            st = mark_outliers(j, -1, j->w), src = j->w;
        }
        if (!st)
            st = kvq_quant_layer_per_token_span(src, j->y, H, j->T, j->D, 0, j->T, j->o->bits,
                                                kcvt ? H * j->D : j->o->group, KVQ_SCALE_FP16, j->bits);
    }
    /* each head copied on the thread that then marks and quantizes it,
     * into that thread's buffer (still in its cache for the backbone) */
#pragma omp parallel for num_threads(j->nt) schedule(dynamic, 1)
    for (int h = 0; h < H; h++) {
        if (st) continue;
        float *w = copy && !layer_span ? j->w + (size_t)omp_get_thread_num() * hn : NULL;
        sts[h] = layer_span ? head_finish(j, h, &errs[h]) : head_all_steps(j, h, w, &errs[h]);
    }
    for (int h = 0; h < H && !st; h++)
        if (sts[h]) {
            st = sts[h];
            j->bad_head = h;
            snprintf(err->msg, sizeof err->msg, "%s", errs[h].msg); /* may be empty */
        }
    free(sts), free(errs);
    return st;
}

/* Room per head for the outlier offsets of tensor's rows: head rows hold k
 * per row, layer rows spread theirs over the heads, at most D per token and head. */
static int outlier_room(const gear_job *j, size_t *cap)
{
    int layer_rows = span_layer(j);
    int n = row_len(j, layer_rows);
    size_t per_row = 2 * (size_t)row_k(j, n);
    if (layer_rows && per_row > (size_t)j->D) per_row = (size_t)j->D;
    return kvq_mul_size((size_t)row_count(j, layer_rows), per_row, cap);
}

/* The job of one tensor of the layer `in` into out (the whole layer's), on nt threads. */
static gear_job job_of(const kvq_spec *sp, const kvq_quant_ctx *ctx, const kvq_layer *in, kvq_quant_out *out,
                       int tensor, int nt)
{
    return (gear_job){.sp = sp,
                      .o = kvq_spec_opts(sp),
                      .ctx = ctx,
                      .tensor = tensor,
                      .H = in->H,
                      .T = in->T,
                      .D = in->D,
                      .nt = nt,
                      .x = tensor ? in->value : in->key,
                      .y = tensor ? out->value : out->key,
                      .bits = tensor ? out->v_bits : out->k_bits};
}

static kvq_status gear_layer(const kvq_spec *sp, const kvq_quant_ctx *ctx, const kvq_layer *in,
                             kvq_quant_out *out, kvq_error *err)
{
    int H = in->H, T = in->T, D = in->D, nt = kvq_threads(ctx->nthreads);
    if (nt > H) nt = H;
    if (nt < 1) nt = 1;
    size_t cap[2], room = 0, wn = 0; /* wn: floats of the copies (gear_job.w) */
    gear_job job[2];
    for (int tensor = 0; tensor < 2; tensor++) {
        gear_job *j = &job[tensor];
        *j = job_of(sp, ctx, in, out, tensor, nt);
        if (!outlier_room(j, &cap[tensor])) return kvq_fail(err, KVQ_ERR_NOMEM, "%s: outlier lists overflow", sp->text);
        if (cap[tensor] > room) room = cap[tensor];
        size_t need = !needs_copy(j) ? 0 : (size_t)(span_layer(j) ? H : nt) * T * D;
        if (need > wn) wn = need;
    }
    float *w = wn ? kvq_alloc_array(wn, sizeof *w) : NULL;
    size_t *opos = room <= SIZE_MAX / sizeof *opos ? kvq_alloc_array((size_t)H, room * sizeof *opos) : NULL;
    size_t *nout = calloc((size_t)H, sizeof *nout);
    kvq_status st = KVQ_OK;
    if ((wn && !w) || !opos || !nout) {
        st = kvq_fail(err, KVQ_ERR_NOMEM, "%s: out of memory", sp->text);
        goto out;
    }
    for (int tensor = 0; tensor < 2 && !st; tensor++) {
        gear_job *j = &job[tensor];
        j->w = w, j->opos = opos, j->nout = nout, j->cap = cap[tensor];
        memset(nout, 0, (size_t)H * sizeof *nout);
        kvq_error e = {0};
        st = gear_tensor(j, &e);
        const char *tname = tensor ? "value" : "key";
        if (st == KVQ_ERR_NUMERIC && !e.msg[0])
            st = kvq_quant_numeric_error(err, sp, ctx, tname, j->bad_head);
        else if (st)
            st = kvq_fail(err, st, "%s: /layer_%03d, %s head %d: %s", sp->text, ctx->layer, tname,
                          j->bad_head, e.msg[0] ? e.msg : kvq_strerror(st));
    }
out:
    free(w), free(opos), free(nout);
    return st;
}

/* V with span=layer: its rows are tokens across the heads. */
static int gear_couples_heads(const kvq_spec *sp) { return ((const gear_opts *)kvq_spec_opts(sp))->span == 1; }

/* One tensor of head h (quantize_head, for the analysis's head loop): the
 * steps gear_layer's per-head loop runs, with the head's own copy and
 * outlier list; the same bits. */
static kvq_status gear_head(const kvq_spec *sp, const kvq_quant_ctx *ctx, const kvq_layer *in, kvq_quant_out *out,
                            int tensor, int h, kvq_error *err)
{
    gear_job j = job_of(sp, ctx, in, out, tensor, 1);
    if (span_layer(&j)) return kvq_fail(err, KVQ_ERR_INTERNAL, "%s: span=layer runs on the whole layer", sp->text);
    size_t cap, nout = 0;
    if (!outlier_room(&j, &cap)) return kvq_fail(err, KVQ_ERR_NOMEM, "%s: outlier lists overflow", sp->text);
    float *w = needs_copy(&j) ? kvq_alloc_array((size_t)in->T * in->D, sizeof *w) : NULL;
    size_t *opos = kvq_alloc_array(cap ? cap : 1, sizeof *opos);
    kvq_status st = (needs_copy(&j) && !w) || !opos ? KVQ_ERR_NOMEM : KVQ_OK;
    if (!st) {
        j.w = w, j.opos = opos, j.nout = &nout, j.cap = cap, j.head0 = h; /* opos and nout of head h alone */
        j.y = kvq_head_out(out, in, tensor, h);
        st = head_all_steps(&j, h, w, err);
    }
    free(w), free(opos);
    return st;
}

/* ------------------------------------------------------------ the reference */

/* One value of a row with its index, ordered for the outlier rule. */
typedef struct { float v; int i; } ranked;
static int larger_first(const void *a, const void *b)
{
    const ranked *x = a, *y = b;
    if (x->v != y->v) return x->v > y->v ? -1 : 1;
    return (x->i > y->i) - (x->i < y->i); /* ties: the lower index first */
}
static int smaller_first(const void *a, const void *b)
{
    const ranked *x = a, *y = b;
    if (x->v != y->v) return x->v < y->v ? -1 : 1;
    return (x->i > y->i) - (x->i < y->i);
}

kvq_status kvq_gear_row_outliers_ref(const float *row, unsigned char *sel, int n, int k)
{
    memset(sel, 0, (size_t)n);
    if (k <= 0) return KVQ_OK;
    ranked *r = kvq_alloc_array((size_t)n, sizeof *r);
    if (!r) return KVQ_ERR_NOMEM;
    /* the k largest: the first k in (value descending, index ascending) */
    for (int i = 0; i < n; i++) r[i] = (ranked){row[i], i};
    qsort(r, (size_t)n, sizeof *r, larger_first);
    for (int j = 0; j < k; j++) sel[r[j].i] = 1;
    /* then the k smallest of the rest: the first k in (value, index) ascending */
    int m = 0;
    for (int i = 0; i < n; i++)
        if (!sel[i]) r[m++] = (ranked){row[i], i};
    qsort(r, (size_t)m, sizeof *r, smaller_first);
    for (int j = 0; j < k; j++) sel[r[j].i] = 1;
    free(r);
    return KVQ_OK;
}

/* Element (head, token, channel) of [H][T][D]. */
#define AT(h, t, c) (((size_t)(h) * T + (size_t)(t)) * D + (size_t)(c))

/* One tensor x [H][T][D] into y as docs/quantizers.md#gear writes it, on one
 * thread: *bad_head names the head of a failure. */
static kvq_status gear_tensor_ref(const kvq_spec *sp, const kvq_quant_ctx *ctx, int tensor, const float *x,
                                  float *y, double *bits, int H, int T, int D, int *bad_head, kvq_error *err)
{
    const gear_opts *o = kvq_spec_opts(sp);
    int layer_rows = tensor == 1 && o->span == 1, kcvt = o->backbone == BACKBONE_KCVT;
    size_t N = (size_t)H * T * D, W = (size_t)H * D, longest = (size_t)(T > D ? T : D);
    if (layer_rows && W > longest) longest = W;
    float *w = kvq_alloc_array(N, sizeof *w), *row = kvq_alloc_array(longest, sizeof *row);
    float *E = kvq_alloc_array((size_t)T * D, sizeof *E), *L = kvq_alloc_array((size_t)T * D, sizeof *L);
    unsigned char *outlier = calloc(N ? N : 1, 1), *sel = malloc(longest);
    size_t *pos = kvq_alloc_array(longest, sizeof *pos);
    kvq_status st = KVQ_OK;
    *bad_head = 0;
    if (!w || !row || !E || !L || !outlier || !sel || !pos) {
        st = kvq_fail(err, KVQ_ERR_NOMEM, "%s: out of memory", sp->text);
        goto out;
    }
    memcpy(w, x, N * sizeof *w);
    /* 1. outliers, row by row: K a channel of a head over its tokens, V a
     * token of a head over its channels, or (span=layer) over all H·D */
    int nrows = layer_rows ? T : H * (tensor ? T : D), n = layer_rows ? (int)W : tensor ? D : T;
    int k = (int)floor(o->sparsity * n / 2.0);
    for (int rw = 0; rw < nrows && k > 0; rw++) {
        for (int e = 0; e < n; e++) {
            int h = layer_rows ? e / D : rw / (tensor ? T : D);
            int t = layer_rows ? rw : tensor ? rw % T : e;
            int c = layer_rows ? e % D : tensor ? e : rw % D;
            pos[e] = AT(h, t, c);
            row[e] = x[pos[e]];
        }
        if ((st = kvq_gear_row_outliers_ref(row, sel, n, k))) {
            st = kvq_fail(err, st, "%s: out of memory", sp->text);
            goto out;
        }
        double sum = 0.0; /* the mean of the whole row, outliers included */
        for (int e = 0; e < n; e++) sum += row[e];
        for (int e = 0; e < n; e++)
            if (sel[e]) w[pos[e]] = (float)(sum / n), outlier[pos[e]] = 1;
    }
    /* 2. the backbone on that copy: kivi's groups (per channel for K, per
     * token for V, over a head or the layer) or kcvt's (a whole channel, a
     * whole token) */
    kvq_step step = {tensor == 0 ? KVQ_STEP_CHANNEL : layer_rows ? KVQ_STEP_TOKEN_LAYER : KVQ_STEP_TOKEN, 0, T,
                     o->bits, !kcvt ? o->group : tensor == 0 ? T : layer_rows ? (int)W : D, KVQ_SCALE_FP16};
    st = kvq_step_reference(&step, w, y, H, T, D, row, bad_head);
    for (int h = 0; h < H; h++) bits[h] = kvq_step_bits(&step, H, D, h);
    if (st) goto out;
    /* 2b. the outliers at fp16 (D̂ + S), 16 + 32 bits each */
    for (int h = 0; h < H && !st; h++) {
        size_t count = 0;
        for (size_t i = AT(h, 0, 0); i < AT(h + 1, 0, 0); i++)
            if (outlier[i]) {
                y[i] = kvq_round_f16(x[i]);
                if (!isfinite(y[i])) *bad_head = h, st = KVQ_ERR_NUMERIC;
                count++;
            }
        bits[h] += (double)count * (16.0 + 32.0);
    }
    /* 3. the low rank of E = X − (D̂ + S) per head; X' = D̂ + S + L */
    int r = o->rank < (T < D ? T : D) ? o->rank : (T < D ? T : D);
    for (int h = 0; h < H && !st && r > 0; h++) {
        *bad_head = h;
        for (size_t i = 0; i < (size_t)T * D; i++) E[i] = x[AT(h, 0, 0) + i] - y[AT(h, 0, 0) + i];
        if (o->lowrank == LOWRANK_SVD) {
            st = kvq_lowrank_svd(E, T, D, r, L, err);
        } else {
            kvq_rng rng;
            kvq_rng_init(&rng, ctx->seed, (uint64_t)ctx->layer, (uint64_t)h,
                         kvq_family_stream(sp->q, (uint64_t)tensor));
            st = kvq_lowrank_power(E, T, D, r, o->loop, &rng, L, err);
        }
        for (size_t i = 0; i < (size_t)T * D && !st; i++) y[AT(h, 0, 0) + i] += L[i];
        if (!st) bits[h] += 16.0 * r * (double)(T + D);
    }
out:
    free(w), free(row), free(E), free(L), free(outlier), free(sel), free(pos);
    return st;
}
#undef AT

/* The reference (.reference): gear_layer's numbers from the definition, one
 * row, group and head at a time, the outliers by sorting.  The low-rank
 * factorisations are the shared ones (LAPACKE, BLAS). */
static kvq_status gear_reference(const kvq_spec *sp, const kvq_quant_ctx *ctx, const kvq_layer *in,
                                 kvq_quant_out *out, kvq_error *err)
{
    for (int tensor = 0; tensor < 2; tensor++) {
        int bad = 0;
        kvq_error e = {0};
        const char *tname = tensor ? "value" : "key";
        kvq_status st = gear_tensor_ref(sp, ctx, tensor, tensor ? in->value : in->key, tensor ? out->value : out->key,
                                        tensor ? out->v_bits : out->k_bits, in->H, in->T, in->D, &bad, &e);
        if (st == KVQ_ERR_NUMERIC && !e.msg[0]) return kvq_quant_numeric_error(err, sp, ctx, tname, bad);
        if (st == KVQ_ERR_NOMEM) return kvq_fail(err, st, "%s", e.msg);
        if (st)
            return kvq_fail(err, st, "%s: /layer_%03d, %s head %d: %s", sp->text, ctx->layer, tname, bad,
                            e.msg[0] ? e.msg : kvq_strerror(st));
    }
    return KVQ_OK;
}

const kvq_quantizer kvq_q_gear = {
    .name = "gear",
    .description = "GEAR: kivi/kcvt backbone + exact sparse outliers + low-rank residual",
    .example_spec = "lowrank=svd,rank=2",
    .params = gear_params,
    .nparams = sizeof gear_params / sizeof gear_params[0],
    .in_default_set = 1,
    .default_spec = "",
    .quantize = gear_layer,
    .quantize_head = gear_head,
    .couples_heads = gear_couples_heads,
    .reference = gear_reference,
    .nstreams = 2, /* the power iteration's start of K and of V */
    .stream_tag_kept = 6,
};

const kvq_quantizer kvq_q_gear_l = {
    .name = "gear-l",
    .description = "GEAR-L: gear without outliers (sparsity=0): backbone + low rank",
    .example_spec = "backbone=kcvt",
    .params = gear_l_params,
    .nparams = sizeof gear_l_params / sizeof gear_l_params[0],
    .check = gear_l_check,
    .quantize = gear_layer,
    .quantize_head = gear_head,
    .couples_heads = gear_couples_heads,
    .reference = gear_reference,
    .nstreams = 2, /* the power iteration's start of K and of V */
    .stream_tag_kept = 6,
};

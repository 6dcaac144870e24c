/* kvq_metrics.h — part of libkvq's public API (kvq.h includes every part):
 * metrics (docs/metrics.md): reconstruction and attention. */
#ifndef KVQ_API_METRICS_H
#define KVQ_API_METRICS_H

#include "kvq_quant.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ------------------------------------------------ metrics (docs/metrics.md) */

/* Sums for one tensor's reconstruction error; merged by adding. */
typedef struct kvq_recon_acc {
    double n;         /* elements */
    double sum_x2;    /* Σ x² */
    double sum_e2;    /* Σ e², e = x − x' */
    double sum_abs_e; /* Σ |e| */
    double max_abs;   /* max |e| */
    double bits;      /* stored bits */
} kvq_recon_acc;

typedef struct kvq_attn_acc {
    double rows;          /* query rows (query heads × positions) */
    double s_ref2, s_diff2;
    double a_ref2, a_diff2;
    double kl_sum;
    double top1_same;
    double o_ref2, o_diff2, o_joint_diff2;
    double mass_sum; /* Σ over rows of the kept keys' share of A (1 a row when nothing is dropped) */
} kvq_attn_acc;

typedef struct kvq_acc {
    kvq_recon_acc k, v;
    double static_bytes; /* summed over pooled (layer, head) cells */
    int has_attn;
    kvq_attn_acc attn;
} kvq_acc;

/* A row of kvq-analyze's metrics: has_attn (the attention columns are
 * meaningful), then one double per row of kvq_metric_cols.def, in its order. */
typedef struct kvq_metrics {
    int has_attn;
#define KVQ_METRIC(column, sums, table, value) double column;
#include "kvq_metric_cols.def"
#undef KVQ_METRIC
} kvq_metrics;

/* The metric columns, for bindings and tools that list them: column i's name
 * and flags (KVQ_METRIC_ATTN: an attention column, KVQ_METRIC_TABLE: the table
 * shows it); 0 past the last (i counts from 0), else 1. */
enum { KVQ_METRIC_ATTN = 1u, KVQ_METRIC_TABLE = 2u };
int kvq_metric_column(int i, const char **name, unsigned *flags);
/* Column i's value in m (i below the number of columns kvq_metric_column names). */
double kvq_metric_value(const kvq_metrics *m, int i);

/* Adds the error of xq against x (n elements) to `acc` (bits untouched). */
void kvq_recon_accumulate(kvq_recon_acc *acc, const float *x, const float *xq, size_t n);
void kvq_recon_accumulate_ref(kvq_recon_acc *acc, const float *x, const float *xq, size_t n);
/* kvq_recon_accumulate of xq[i] into acc[i] for i < m, the same sums, with x
 * read once for every four of them where the CPU has AVX-512. */
void kvq_recon_accumulate_many(kvq_recon_acc *const *acc, const float *x, const float *const *xq, int m, size_t n);
void kvq_acc_merge(kvq_acc *dst, const kvq_acc *src);
void kvq_metrics_finalize(const kvq_acc *acc, kvq_metrics *m);

/* Query positions (docs/metrics.md). */
typedef enum kvq_query_kind { KVQ_Q_LAST, KVQ_Q_ALL, KVQ_Q_EVERY, KVQ_Q_RANDOM } kvq_query_kind;
typedef struct kvq_query_sel {
    kvq_query_kind kind;
    long n;
} kvq_query_sel;

kvq_status kvq_query_sel_parse(const char *text, kvq_query_sel *out, kvq_error *err);
/* Sorted positions for a sequence of T tokens; *pos is malloc'ed. */
kvq_status kvq_query_positions(const kvq_query_sel *sel, int T, uint64_t seed, int **pos,
                               size_t *npos, kvq_error *err);

/* How the model turns q·k into attention (docs/dump-format.md): softmax(scale · q·k)
 * (prescaled: the queries already carry the scale), each score soft-capped
 * c·tanh(s/c) when softcap > 0, over the causal keys p − window < k <= p
 * (window 0: all of 0..p).  scale 0 (or 1/sqrt(D) within 1e-6) is the plain
 * attention, computed as a division by sqrt(D) (docs/metrics.md's order). */
typedef struct kvq_attn_mode {
    int prescaled;
    float scale, softcap;
    int window;
} kvq_attn_mode;
/* The mode of a dump's layer (root attn_scale, attn_softcap, query_prescaled,
 * the layer's sliding_window). */
kvq_attn_mode kvq_dump_attn_mode(const kvq_dump *d, int layer);
/* 1 when the mode is plain causal softmax(q·k/sqrt(D)) (what the GPU path computes). */
int kvq_attn_mode_plain(const kvq_attn_mode *m, int D);

/* Attention metrics of one KV head for several quantizers at once (docs/metrics.md).
 * Q: the G query heads reading this KV head, [G][T][D].  K, V: [T][D].
 * Kq[i], Vq[i]: quantizer i's reconstruction, [T][D].  acc[i] receives the
 * sums.  Score matrices go through cblas_sgemm in row chunks of bounded size. */
kvq_status kvq_attention_head(const float *Q, int G, const float *K, const float *V, int T, int D,
                              kvq_attn_mode mode, const int *pos, size_t npos, int nquant,
                              const float *const *Kq, const float *const *Vq, kvq_attn_acc *acc,
                              kvq_error *err);
/* The same with only the query rows at pos: Qrows [G][npos][D] (what
 * kvq_dump_read_query_rows reads, one KV head's G query heads). */
kvq_status kvq_attention_rows(const float *Qrows, int G, const float *K, const float *V, int T, int D,
                              kvq_attn_mode mode, const int *pos, size_t npos, int nquant,
                              const float *const *Kq, const float *const *Vq, kvq_attn_acc *acc,
                              kvq_error *err);
/* The same where quantizer i's cache dropped tokens: Mq[i] [T] (1 kept, 0
 * dropped) or NULL (Mq NULL: none dropped).  A dropped key is absent from
 * A' (softmax over the rest); attn_kl compares A restricted to the kept
 * keys and renormalised with A'; mass_sum adds the kept share of A. */
kvq_status kvq_attention_rows_masked(const float *Qrows, int G, const float *K, const float *V, int T, int D,
                                     kvq_attn_mode mode, const int *pos, size_t npos, int nquant,
                                     const float *const *Kq, const float *const *Vq,
                                     const unsigned char *const *Mq, kvq_attn_acc *acc, kvq_error *err);
/* A thread's scratch for the two calls below (_ws), kept from head to head
 * by a caller that makes many, so that no head's workspace is fresh memory
 * (a page fault a page); grown as needed, freed by kvq_attn_ws_free. */
typedef struct kvq_attn_ws kvq_attn_ws;
kvq_attn_ws *kvq_attn_ws_new(void); /* NULL: out of memory */
void kvq_attn_ws_free(kvq_attn_ws *ws);
kvq_status kvq_attention_rows_ws(const float *Qrows, int G, const float *K, const float *V, int T, int D,
                                 kvq_attn_mode mode, const int *pos, size_t npos, int nquant, const float *const *Kq,
                                 const float *const *Vq, const unsigned char *const *Mq, kvq_attn_acc *acc,
                                 kvq_attn_ws *ws, kvq_error *err);
/* The same for more quantizers of the head that the last call on ws
 * compared (the same Qrows, K, V, mode and pos): where that call's rows fit
 * one chunk for all G heads (the default last:64 does), its exact side is
 * still in ws and is not computed again; else it is.  The same sums. */
kvq_status kvq_attention_rows_ws_more(const float *Qrows, int G, const float *K, const float *V, int T, int D,
                                      kvq_attn_mode mode, const int *pos, size_t npos, int nquant,
                                      const float *const *Kq, const float *const *Vq, const unsigned char *const *Mq,
                                      kvq_attn_acc *acc, kvq_attn_ws *ws, kvq_error *err);
/* The exact side of one KV head's attention (query rows, S, A, O in the
 * chunks kvq_attention_head uses), computed once and kept, so that any number
 * of later quantizers are compared against it with bit-identical sums. */
typedef struct kvq_attn_ref kvq_attn_ref;
kvq_status kvq_attn_ref_new(const float *Q, int G, const float *K, const float *V, int T, int D,
                            kvq_attn_mode mode, const int *pos, size_t npos, kvq_attn_ref **out,
                            kvq_error *err);
/* The same from the query rows at pos, Qrows [G][npos][D]. */
kvq_status kvq_attn_ref_new_rows(const float *Qrows, int G, const float *K, const float *V, int T, int D,
                                 kvq_attn_mode mode, const int *pos, size_t npos, kvq_attn_ref **out,
                                 kvq_error *err);
/* Same sums as kvq_attention_head with the K, V, Q the reference was built from. */
kvq_status kvq_attn_ref_compare(const kvq_attn_ref *ref, int nquant, const float *const *Kq,
                                const float *const *Vq, kvq_attn_acc *acc, kvq_error *err);
kvq_status kvq_attn_ref_compare_masked(const kvq_attn_ref *ref, int nquant, const float *const *Kq,
                                       const float *const *Vq, const unsigned char *const *Mq, kvq_attn_acc *acc,
                                       kvq_error *err);
kvq_status kvq_attn_ref_compare_ws(const kvq_attn_ref *ref, int nquant, const float *const *Kq, const float *const *Vq,
                                   const unsigned char *const *Mq, kvq_attn_acc *acc, kvq_attn_ws *ws, kvq_error *err);
/* Memory kvq_attn_ref_new will hold for these shapes, in bytes. */
size_t kvq_attn_ref_bytes(int G, int T, int D, const int *pos, size_t npos);
void kvq_attn_ref_free(kvq_attn_ref *ref);
/* Plain reference of the same (no BLAS, no chunking), for tests. */
kvq_status kvq_attention_head_ref(const float *Q, int G, const float *K, const float *V, int T,
                                  int D, kvq_attn_mode mode, const int *pos, size_t npos,
                                  int nquant, const float *const *Kq, const float *const *Vq,
                                  kvq_attn_acc *acc, kvq_error *err);
kvq_status kvq_attention_head_ref_masked(const float *Q, int G, const float *K, const float *V, int T, int D,
                                         kvq_attn_mode mode, const int *pos, size_t npos, int nquant,
                                         const float *const *Kq, const float *const *Vq,
                                         const unsigned char *const *Mq, kvq_attn_acc *acc, kvq_error *err);

#ifdef __cplusplus
}
#endif
#endif

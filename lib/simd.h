/* simd.h — run-time selected SIMD versions of libkvq's hot loops (see
 * simd_avx512.c).  Internal; each has a plain C reference it must equal. */
#ifndef KVQ_SIMD_H
#define KVQ_SIMD_H

#include "kvq.h"

/* 1 if the AVX-512 paths are in use (CPU support, not disabled). */
int kvq_simd_active(void);
/* 1 if the AVX2 + FMA paths may run (loops compiled a second time with a
 * target attribute, and simd_avx2.c): CPU support and not disabled. */
int kvq_simd_avx2_active(void);

/* A plain C loop compiled a second time for AVX2 (no FMA: the same
 * arithmetic, wider vectors): its body a KVQ_BODY function, called from a
 * plain wrapper and, where KVQ_AVX2_CLONES is defined, from a
 * KVQ_TARGET_AVX2 one; kvq_simd_avx2_active() picks at run time.  An
 * element-wise loop (no reduction whose order the width would change) may
 * have a KVQ_TARGET_AVX512 copy too, picked by kvq_simd_active().  Copies
 * named NAME_plain, NAME_avx2 and NAME_avx512 are called through
 * KVQ_PICK_CLONE(NAME)(args...): the widest the run may use. */
#define KVQ_BODY static inline __attribute__((always_inline))
#if defined(__x86_64__) && defined(__GNUC__)
#define KVQ_AVX2_CLONES 1
#define KVQ_TARGET_AVX2 __attribute__((target("avx2")))
#define KVQ_TARGET_AVX512 __attribute__((target("avx512f,avx512vl,avx512dq"))) /* kvq_simd_active()'s features */
#define KVQ_PICK_CLONE(name) (kvq_simd_active() ? name##_avx512 : kvq_simd_avx2_active() ? name##_avx2 : name##_plain)
#else
#define KVQ_PICK_CLONE(name) name##_plain
#endif
/* The highest SIMD level the paths may use: none (the portable paths),
 * AVX2 (+ FMA where a kernel asks for it) or AVX-512 (all the CPU has, the
 * default).  KVQ_SIMD=none|avx2|avx512 in the environment sets it (read at
 * first use; anything else: the default), so that a run can be timed or
 * checked at a lower level; kvq_simd_cap overrides it (-1: back to the
 * environment's). */
enum { KVQ_SIMD_NONE = 0, KVQ_SIMD_AVX2 = 1, KVQ_SIMD_AVX512 = 2 };
void kvq_simd_cap(int level);
/* Tests: 0 forces the portable paths, 1 goes back to the environment's
 * level (kvq_simd_cap(KVQ_SIMD_NONE) and kvq_simd_cap(-1)). */
void kvq_simd_force(int on);

/* U per token: nrows rows of D, groups of G consecutive channels.  recon
 * (unless NULL) gets the error sums of the block, computed from registers.
 * Output to a 64-byte aligned y with whole-vector groups, of at least
 * KVQ_STREAM_MIN_BYTES, is streamed (non-temporal stores, fenced before
 * return); kvq_simd_stream_min sets that size (tests: 0 streams every
 * aligned output). */
enum { KVQ_STREAM_MIN_BYTES = 16 << 20 };
void kvq_simd_stream_min(size_t bytes);
kvq_status kvq_u_rows_avx512(const float *x, float *y, size_t nrows, size_t D, size_t G, int bits,
                             int fp16, kvq_recon_acc *recon);
/* U per channel over a block of n rows of D channels; recon and stores as above. */
kvq_status kvq_u_channels_avx512(const float *x, float *y, size_t n, size_t D, int bits, int fp16,
                                 kvq_recon_acc *recon);
/* AVX2 U per token, as kvq_u_rows_avx512 without the fused error (the
 * caller adds it): groups of G consecutive channels, G a multiple of 8
 * (KVQ_ERR_UNSUPPORTED otherwise: the caller runs the reference). */
kvq_status kvq_u_rows_avx2(const float *x, float *y, size_t nrows, size_t D, size_t G, int bits, int fp16);
/* Reconstruction sums (as kvq_recon_accumulate); of m outputs of the same x, x read once for four. */
void kvq_recon_avx512(kvq_recon_acc *acc, const float *x, const float *y, size_t n);
void kvq_recon_many_avx512(kvq_recon_acc *const *acc, const float *x, const float *const *y, int m, size_t n);

/* exp(x) for x <= 0 over n values, within 2 ulp of expf (tests check). */
void kvq_exp_avx512(const float *x, float *y, size_t n);
/* softmax_row of attention.c on the causal prefix s[0..n): scales (divides)
 * unless prescaled, writes a[0..n) = softmax and a[n..ncol) = 0, returns the
 * max, Σ exp(s − max) in double and the first arg-max. */
void kvq_softmax_avx512(float *s, float *a, size_t n, size_t ncol, float scale, int prescaled,
                        float *m_out, double *sum_out, int *argmax_out);
/* One row's Σ (s − s')², Σ (a − a')² and KL(A‖A') from both log-softmaxes
 * (terms where a = 0 skipped), added to *sd2, *ad2, *kl. */
void kvq_row_compare_avx512(const float *s, const float *a, const float *sq, const float *aq, size_t n,
                            double m, double lse, double mq, double lseq, double *sd2, double *ad2,
                            double *kl);
/* The fused softmax + comparisons (AVX-512 below, AVX2 further on) share this type, so that a
 * caller picks one once. */
typedef void kvq_softmax_compare_fn(const float *s, const float *a, float *sq, float *aq, size_t n, size_t ncol,
                                    float scale, int prescaled, double m, double lse, float *mq_out,
                                    double *sumq_out, int *argmaxq_out, double *sd2, double *ad2, double *kl);
/* kvq_softmax_avx512 of the quantized row (sq into aq) and
 * kvq_row_compare_avx512 of (s, a) against it in one call, its last pass
 * fused: the same values and sums.  m, lse: the exact row's; *mq_out,
 * *sumq_out, *argmaxq_out as the softmax's. */
void kvq_softmax_compare_avx512(const float *s, const float *a, float *sq, float *aq, size_t n, size_t ncol,
                                float scale, int prescaled, double m, double lse, float *mq_out,
                                double *sumq_out, int *argmaxq_out, double *sd2, double *ad2, double *kl);

/* AVX2 + FMA versions of the three above (simd_avx2.c), for CPUs without
 * AVX-512: the same arithmetic, so the same values.  The metrics call the
 * row comparison fused with the softmax (below); the tests compare that
 * with kvq_softmax_avx2 + kvq_row_compare_avx2. */
void kvq_exp_avx2(const float *x, float *y, size_t n);
void kvq_softmax_avx2(float *s, float *a, size_t n, size_t ncol, float scale, int prescaled,
                      float *m_out, double *sum_out, int *argmax_out);
void kvq_row_compare_avx2(const float *s, const float *a, const float *sq, const float *aq, size_t n,
                          double m, double lse, double mq, double lseq, double *sd2, double *ad2,
                          double *kl);
/* kvq_softmax_avx2 of the quantized row (sq into aq) and kvq_row_compare_avx2
 * of (s, a) against it in one call, its last pass fused: the same values and
 * sums.  m, lse: the exact row's; *mq_out, *sumq_out, *argmaxq_out as the softmax's. */
void kvq_softmax_compare_avx2(const float *s, const float *a, float *sq, float *aq, size_t n, size_t ncol,
                              float scale, int prescaled, double m, double lse, float *mq_out,
                              double *sumq_out, int *argmaxq_out, double *sd2, double *ad2, double *kl);

#endif

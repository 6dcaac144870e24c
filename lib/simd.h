/* simd.h — run-time selected SIMD versions of libkvq's hot loops (see
 * simd_avx512.c).  Internal; each has a plain C reference it must equal. */
#ifndef KVQ_SIMD_H
#define KVQ_SIMD_H

#include "kvq.h"

/* 1 if the AVX-512 paths are in use (CPU support, not disabled). */
int kvq_simd_active(void);
/* Tests: 0 forces the portable paths, 1 re-enables SIMD where supported. */
void kvq_simd_force(int on);

/* U per token: nrows rows of D, groups of G consecutive channels.  recon
 * (unless NULL) gets the error sums of the block, computed from registers.
 * Output to a 64-byte aligned y with whole-vector groups is streamed
 * (non-temporal stores, fenced before return). */
kvq_status kvq_u_rows_avx512(const float *x, float *y, size_t nrows, size_t D, size_t G, int bits,
                             int fp16, kvq_recon_acc *recon);
/* U per channel over a block of n rows of D channels; recon and stores as above. */
kvq_status kvq_u_channels_avx512(const float *x, float *y, size_t n, size_t D, int bits, int fp16,
                                 kvq_recon_acc *recon);
/* Reconstruction sums (as kvq_recon_accumulate). */
void kvq_recon_avx512(kvq_recon_acc *acc, const float *x, const float *y, size_t n);

#endif

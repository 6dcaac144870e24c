/* formats.h — the number formats room (public to the tests, not to the tools):
 * FP8's cast, ggml's block types and the FP4 micro-scaled formats. */
#ifndef KVQ_ROOM_FORMATS_H
#define KVQ_ROOM_FORMATS_H

#include "../internal.h"

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* FP8 (docs/quantizers.md#fp8): the OCP formats.  kvq_fp8_cast_ref(y) is y rounded to the
 * nearest finite value of the format (ties to the even code, |y| beyond
 * the largest finite value saturating to it, subnormals kept, NaN kept);
 * the definition, by integer bit manipulation. */
typedef enum kvq_fp8_format { KVQ_FP8_E4M3 = 0, KVQ_FP8_E5M2 = 1 } kvq_fp8_format;
float kvq_fp8_cast_ref(float y, kvq_fp8_format format);
/* The largest finite value: 448 (e4m3) or 57344 (e5m2). */
float kvq_fp8_max(kvq_fp8_format format);
/* y[i] = fp8(x[i] / s) · s (float32 divide), the vectorised hot loop (s
 * finite and > 0, x finite); equal to the reference. */
void kvq_fp8_quantize_array(const float *x, float *y, size_t n, float s, kvq_fp8_format format);
/* Rows x, y [rows][D]; column c scaled by s[c]: y = fp8(x / s[c]) · s[c]. */
void kvq_fp8_quantize_columns(const float *x, float *y, size_t rows, size_t D, const float *s,
                              kvq_fp8_format format);


/* ------------------------------------------------- ggml and FP4 formats */

/* ggml weight types kvq dequantizes (the GGUF tensor type ids). */
typedef enum kvq_ggml_type {
    KVQ_GGML_F32 = 0, KVQ_GGML_F16 = 1, KVQ_GGML_Q4_0 = 2, KVQ_GGML_Q4_1 = 3, KVQ_GGML_Q5_0 = 6,
    KVQ_GGML_Q5_1 = 7, KVQ_GGML_Q8_0 = 8, KVQ_GGML_Q2_K = 10, KVQ_GGML_Q3_K = 11, KVQ_GGML_Q4_K = 12,
    KVQ_GGML_Q5_K = 13, KVQ_GGML_Q6_K = 14, KVQ_GGML_IQ4_NL = 20, KVQ_GGML_IQ4_XS = 23,
    KVQ_GGML_BF16 = 30, KVQ_GGML_MXFP4 = 39, KVQ_GGML_NVFP4 = 40
} kvq_ggml_type;

/* Values and bytes per block of `type`; 0 if kvq does not read the type. */
int kvq_ggml_type_size(int type, int *block_values, size_t *block_bytes);
const char *kvq_ggml_type_name(int type); /* "q4_K", ...; NULL if unknown */
/* n values (a multiple of the block) of `type` at src, as ggml's
 * dequantize_row_<type> computes them, bit for bit. */
void kvq_ggml_dequantize(int type, const void *src, float *dst, size_t n);
/* 1 when the n values of `type` at src dequantize to finite floats for
 * certain: a block format whose values are small integers times its half
 * scales, and every such scale finite; 0 when unknown (other types, or a
 * scale that is inf or nan): then look at the values. */
int kvq_ggml_finite_by_scales(int type, const void *src, size_t n);
/* n values (a multiple of the block for block types) of x to `type` at dst,
 * as ggml's quantize_row_<type>_ref (f16, bf16: round to nearest even), bit
 * for bit: the KV-cache types q8_0, q4_0, q4_1, q5_0, q5_1, iq4_nl, f16,
 * bf16, and mxfp4, nvfp4.  Returns 0 for any other type. */
int kvq_ggml_quantize_ref(int type, const float *x, void *dst, size_t n);
/* The same bytes, q8_0's blocks through loops that vectorise (the other
 * types through the reference). */
int kvq_ggml_quantize(int type, const float *x, void *dst, size_t n);

/* FP4 micro-scaled formats (docs/quantizers.md#fp4, formats/fp4.c), ggml's bit for bit.
 * Element values are doubled (kvq_e2m1_doubled[code]) and scales halved,
 * as in ggml: value = doubled · half-scale. */
#define KVQ_MXFP4_BLOCK 32 /* values per E8M0 scale */
#define KVQ_NVFP4_BLOCK 16 /* values per UE4M3 scale (ggml's nvfp4 blocks hold four) */
extern const int8_t kvq_e2m1_doubled[16];
uint8_t kvq_e8m0_mxfp4(float amax);    /* floor(log2 amax) − 2 + 127, 0 for 0 (and below 2^-125) */
float kvq_e8m0_half(uint8_t e);        /* 2^(e − 128) */
uint8_t kvq_ue4m3_encode(float x);     /* ggml_fp32_to_ue4m3: [256, 448] all give 448 (0x7E) */
uint8_t kvq_ue4m3_encode_rne(float x); /* E4M3 nearest even, saturating at 448: the code */
float kvq_ue4m3_half(uint8_t u);       /* half the unsigned E4M3 value */
int kvq_e2m1_index(float x, float d);  /* the code minimising |doubled·d − x|, first of equals */
/* One MXFP4 block: 32 values → 17 bytes (ggml's block_mxfp4) and back. */
void kvq_mxfp4_block_ref(const float *x, uint8_t *blk);
void kvq_mxfp4_block_dequantize(const uint8_t *blk, float *y);
/* One NVFP4 block of 16 values with second-level scale g: its UE4M3 scale
 * of amax/6/g (rne = 0: ggml's encoder, with g = 1 ggml's nvfp4; rne = 1:
 * E4M3 nearest even, the two-level scheme) and 8 bytes of codes; returns
 * the half-scale (decoded scale · g) the codes were chosen with. */
float kvq_nvfp4_block_ref(const float *x, float g, int rne, uint8_t *scale, uint8_t *qs);
void kvq_nvfp4_block_dequantize(uint8_t scale, const uint8_t *qs, float g, float *y);
/* The fast path the fp4 family runs, equal to the above bit for bit: a
 * block's half-scale, then y = the E2M1 value nearest each x at half-scale d
 * (kvq_e2m1_doubled[kvq_e2m1_index(x, d)] · d), n values, vectorised. */
float kvq_mxfp4_block_scale(const float *x);
float kvq_nvfp4_block_scale(const float *x, float g, int rne);
void kvq_fp4_round(const float *x, float *y, int n, float d);

#ifdef __cplusplus
}
#endif

#endif

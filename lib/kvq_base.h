/* kvq_base.h — part of libkvq's public API (kvq.h includes every part):
 * errors and half floats: what every part of libkvq returns and shares. */
#ifndef KVQ_API_BASE_H
#define KVQ_API_BASE_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#ifdef __cplusplus
extern "C" {
#endif

/* ------------------------------------------------------------------ errors */

typedef enum kvq_status {
    KVQ_OK = 0,
    KVQ_ERR_USAGE,       /* bad spec string or option value (tools exit 2) */
    KVQ_ERR_IO,          /* cannot open, read or write a file */
    KVQ_ERR_FORMAT,      /* input is not a valid kvq-dump/1 file */
    KVQ_ERR_NOMEM,       /* allocation failed or size overflows */
    KVQ_ERR_NUMERIC,     /* a value cannot be represented (e.g. fp16 scale) */
    KVQ_ERR_UNSUPPORTED, /* a feature this build or input does not offer */
    KVQ_ERR_INTERNAL     /* a LAPACK or other library call failed */
} kvq_status;

/* Detail for the last failure: one line, no trailing newline. */
typedef struct kvq_error {
    kvq_status status;
    char msg[1024];
} kvq_error;

const char *kvq_strerror(kvq_status st);
const char *kvq_version(void);
/* What this libkvq is, as provenance records it (docs/tools.md#provenance):
 * its version; the git commit it was built from (40 hex digits, "-dirty"
 * appended when the work tree had changes; "" when not built from a git
 * checkout); the SIMD level its paths use now ("none", "avx2", "avx512":
 * the CPU's, capped by KVQ_SIMD); the BLAS (OpenBLAS's configuration
 * string); and whether the CUDA module was built with it. */
typedef struct kvq_build_info {
    const char *version, *commit, *simd, *blas, *blas_core;
    int cuda_built;
} kvq_build_info;
void kvq_get_build_info(kvq_build_info *info);
/* OpenBLAS's kernels (docs/performance.md#blas-kernels): the core in use
 * (openblas_get_corename); the one OpenBLAS chose itself (the same unless
 * KVQ_TEST_BLAS_DETECTED=NAME in the environment, for tests, says it chose
 * NAME); the best core this CPU can run (NULL: not x86-64); that core when
 * it is above OpenBLAS's choice and OpenBLAS can switch (a DYNAMIC_ARCH
 * build), else NULL — what the tools restart with. */
const char *kvq_blas_core(void);
const char *kvq_blas_core_detected(void);
const char *kvq_blas_core_for_cpu(void);
const char *kvq_blas_core_wanted(void);
/* Why that core: "detected by OpenBLAS", "OPENBLAS_CORETYPE=X" (the user's),
 * "chosen by kvq (OPENBLAS_CORETYPE=X; OpenBLAS detected Y)" (a tool's
 * restart) or "chosen by the kvq package ..." (kvq_blas_note_choice).  Only
 * OpenBLAS core names from the environment are quoted: another value is
 * said to be one, not copied (it may hold anything, a newline included). */
void kvq_blas_core_source(char *buf, size_t len);
/* The Python package set OPENBLAS_CORETYPE=core before OpenBLAS loaded (and
 * took it out of the environment again, so that the processes it starts
 * record no choice they did not make): kvq_blas_core_source says so.  A
 * name that is not an OpenBLAS core is ignored. */
void kvq_blas_note_choice(const char *core);
/* Notes: what a call did that is not an error but should be said (the
 * library never prints): the first of each kind, and how many more like it
 * came, from any thread.  kvq_take_notes writes them, one line each, into
 * buf (at most len bytes, NUL-terminated), clears them and returns the
 * length they need; the tools print each line as "PROG: note: ...". */
typedef enum kvq_note_kind {
    KVQ_NOTE_VQ_FEW_DISTINCT, /* a vq codebook trained on at most 2^bits distinct sub-vectors (SPEC 3.10) */
    KVQ_NOTE_KINDS
} kvq_note_kind;
size_t kvq_take_notes(char *buf, size_t len);
/* A run's fingerprint, built piece by piece from KVQ_FINGERPRINT_SEED: FNV-1a
 * of n bytes, and of a file's size and its first and last MiB ("-" for a
 * file that cannot be read).  Shard files carry it (docs/models.md#shards). */
#define KVQ_FINGERPRINT_SEED 1469598103934665603ull
uint64_t kvq_fingerprint_bytes(uint64_t h, const void *p, size_t n);
uint64_t kvq_fingerprint_file(uint64_t h, const char *path);
/* The threads a call given nthreads = requested uses: requested when > 0,
 * else the processors this process may run on. */
int kvq_threads(int requested);
/* The most threads a call may ask for (the tools' --threads, the bindings' threads=). */
#define KVQ_MAX_THREADS 4096

/* ------------------------------------------------------- numeric helpers */

/* float32 -> IEEE binary16 with round-half-to-even (overflow -> inf). */
uint16_t kvq_f32_to_f16(float x);
float kvq_f16_to_f32(uint16_t h);
/* x rounded to the nearest fp16 value, returned as float32. */
float kvq_round_f16(float x);
/* Bulk conversions; use F16C when the CPU has it (checked at run time). */
void kvq_f16_to_f32_array(const uint16_t *src, float *dst, size_t n);
void kvq_f16_to_f32_array_ref(const uint16_t *src, float *dst, size_t n);
void kvq_f32_to_f16_array(const float *src, uint16_t *dst, size_t n);

#ifdef __cplusplus
}
#endif
#endif

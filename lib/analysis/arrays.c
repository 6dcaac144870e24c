/* arrays.c — kvq on arrays the caller holds, for bindings (Python's kvq
 * package, over ctypes) that cannot build kvq's structs: a quantizer on one
 * layer measured exactly as kvq-analyze measures a dump's layer, and a
 * whole analysis written as the CSV kvq-analyze prints.  Spec strings,
 * plain arrays and kvq_acc sums in, kvq_status and kvq_error out. */
#define _GNU_SOURCE /* open_memstream */
#include "../internal.h"
#include "analysis.h"
#include "../quant/quant.h"

#include <math.h>
#include <stddef.h>
#include <stdio.h>
#include <string.h>

void kvq_free(void *p) { free(p); }

/* The structs python/kvq/_lib.py mirrors, every field in order. */
#define ABI(T, f) {#T, #f, offsetof(T, f), sizeof(T)}
static const struct abi_field {
    const char *type, *field;
    size_t offset, size;
} abi[] = {
    ABI(kvq_error, status), ABI(kvq_error, msg),
    ABI(kvq_recon_acc, n), ABI(kvq_recon_acc, sum_x2), ABI(kvq_recon_acc, sum_e2), ABI(kvq_recon_acc, sum_abs_e),
    ABI(kvq_recon_acc, max_abs), ABI(kvq_recon_acc, bits),
    ABI(kvq_attn_acc, rows), ABI(kvq_attn_acc, s_ref2), ABI(kvq_attn_acc, s_diff2), ABI(kvq_attn_acc, a_ref2),
    ABI(kvq_attn_acc, a_diff2), ABI(kvq_attn_acc, kl_sum), ABI(kvq_attn_acc, top1_same), ABI(kvq_attn_acc, o_ref2),
    ABI(kvq_attn_acc, o_diff2), ABI(kvq_attn_acc, o_joint_diff2), ABI(kvq_attn_acc, mass_sum),
    ABI(kvq_acc, k), ABI(kvq_acc, v), ABI(kvq_acc, static_bytes), ABI(kvq_acc, has_attn), ABI(kvq_acc, attn),
    ABI(kvq_metrics, has_attn),
#define KVQ_METRIC(column, sums, table, value) ABI(kvq_metrics, column),
#include "../kvq_metric_cols.def"
#undef KVQ_METRIC
    ABI(kvq_param, key), ABI(kvq_param, type), ABI(kvq_param, def), ABI(kvq_param, min), ABI(kvq_param, max),
    ABI(kvq_param, choices), ABI(kvq_param, help), ABI(kvq_param, quiet_default), ABI(kvq_param, typed),
    ABI(kvq_param, offset),
    ABI(kvq_spec, q), ABI(kvq_spec, val), ABI(kvq_spec, given), ABI(kvq_spec, text), ABI(kvq_spec, opts),
    ABI(kvq_dump_info, model), ABI(kvq_dump_info, num_layers), ABI(kvq_dump_info, num_heads),
    ABI(kvq_dump_info, num_kv_heads), ABI(kvq_dump_info, head_dim), ABI(kvq_dump_info, seq_len),
    ABI(kvq_dump_info, has_rope_theta), ABI(kvq_dump_info, rope_theta), ABI(kvq_dump_info, rope_style),
    ABI(kvq_dump_info, query_prescaled), ABI(kvq_dump_info, has_query), ABI(kvq_dump_info, has_key_pre_rope),
    ABI(kvq_dump_info, has_rope_table), ABI(kvq_dump_info, key_dtype), ABI(kvq_dump_info, value_dtype),
    ABI(kvq_dump_info, query_dtype), ABI(kvq_dump_info, attn_scale), ABI(kvq_dump_info, attn_softcap),
    ABI(kvq_dump_info, window_layers),
    ABI(kvq_layer, H), ABI(kvq_layer, Hq), ABI(kvq_layer, T), ABI(kvq_layer, D), ABI(kvq_layer, key),
    ABI(kvq_layer, value), ABI(kvq_layer, query), ABI(kvq_layer, key_pre_rope),
    ABI(kvq_attn_mode, prescaled), ABI(kvq_attn_mode, scale), ABI(kvq_attn_mode, softcap),
    ABI(kvq_attn_mode, window),
    ABI(kvq_rope, T), ABI(kvq_rope, D), ABI(kvq_rope, style), ABI(kvq_rope, cos), ABI(kvq_rope, sin),
    ABI(kvq_arrays_opts, spec), ABI(kvq_arrays_opts, layer), ABI(kvq_arrays_opts, seed),
    ABI(kvq_arrays_opts, nthreads), ABI(kvq_arrays_opts, rope_cos), ABI(kvq_arrays_opts, rope_sin),
    ABI(kvq_arrays_opts, rope_theta), ABI(kvq_arrays_opts, rope_style), ABI(kvq_arrays_opts, calib),
    ABI(kvq_arrays_opts, query), ABI(kvq_arrays_opts, num_heads), ABI(kvq_arrays_opts, keep),
    ABI(kvq_analyze_csv_opts, label), ABI(kvq_analyze_csv_opts, specs), ABI(kvq_analyze_csv_opts, nspecs),
    ABI(kvq_analyze_csv_opts, per), ABI(kvq_analyze_csv_opts, layers), ABI(kvq_analyze_csv_opts, nlayers),
    ABI(kvq_analyze_csv_opts, heads), ABI(kvq_analyze_csv_opts, nheads), ABI(kvq_analyze_csv_opts, queries),
    ABI(kvq_analyze_csv_opts, calib), ABI(kvq_analyze_csv_opts, seed), ABI(kvq_analyze_csv_opts, nthreads),
    ABI(kvq_analysis_row, layer), ABI(kvq_analysis_row, head), ABI(kvq_analysis_row, quantizer),
    ABI(kvq_analysis_row, spec), ABI(kvq_analysis_row, m),
    ABI(kvq_dump_mem, name), ABI(kvq_dump_mem, model), ABI(kvq_dump_mem, layers), ABI(kvq_dump_mem, nlayers),
    ABI(kvq_dump_mem, windows), ABI(kvq_dump_mem, rope_theta), ABI(kvq_dump_mem, rope_style),
    ABI(kvq_dump_mem, rope_cos), ABI(kvq_dump_mem, rope_sin), ABI(kvq_dump_mem, query_prescaled),
    ABI(kvq_dump_mem, attn_scale), ABI(kvq_dump_mem, attn_softcap),
    ABI(kvq_task, id), ABI(kvq_task, context), ABI(kvq_task, question), ABI(kvq_task, answer), ABI(kvq_task, depth),
    ABI(kvq_task, line),
};
#undef ABI

int kvq_abi_field(int i, const char **type, const char **field, size_t *offset, size_t *size)
{
    if (i < 0 || (size_t)i >= sizeof abi / sizeof abi[0]) return 0;
    *type = abi[i].type, *field = abi[i].field, *offset = abi[i].offset, *size = abi[i].size;
    return 1;
}

/* The threads a call of the bindings uses: the caller's (1..KVQ_MAX_THREADS,
 * as the tools' --threads), or for 0 as many as the work keeps busy — a
 * thread per 2^18 elements up to the cores — so that the small calls of a
 * decode loop run on the calling thread alone and pay for no idle workers
 * (they spin after each parallel region; on a loaded machine that cost
 * 6-24 ms a call).  Results do not depend on the thread count. */
static kvq_status binding_threads(int requested, size_t work, int *nt, kvq_error *err)
{
    if (requested < 0 || requested > KVQ_MAX_THREADS)
        return kvq_fail(err, KVQ_ERR_USAGE, "threads %d: expected 0 (automatic) or 1..%d", requested,
                        KVQ_MAX_THREADS);
    if (requested > 0) {
        *nt = requested;
        return KVQ_OK;
    }
    size_t want = work >> 18;
    int cores = kvq_threads(0);
    *nt = want < 1 ? 1 : want > (size_t)cores ? cores : (int)want;
    return KVQ_OK;
}

/* The first non-finite value of an [H][T][D] tensor, named by head, token
 * and channel, as the dump reader names one in a file. */
static kvq_status check_finite(const char *what, const float *x, int H, int T, int D, kvq_error *err)
{
    size_t n = (size_t)H * T * D, i = kvq_first_nonfinite(x, n);
    if (i >= n) return KVQ_OK;
    size_t per = (size_t)T * D;
    return kvq_fail(err, KVQ_ERR_FORMAT, "%s: head %zu, token %zu, channel %zu: expected a finite value, got %g", what,
                    i / per, i % per / D, i % D, (double)x[i]);
}

kvq_status kvq_quantize_arrays(const kvq_arrays_opts *o, int H, int T, int D, const float *key, const float *value,
                               const float *key_pre_rope, float *key_out, float *value_out, kvq_acc *head_acc,
                               kvq_error *err)
{
    if (!o) return kvq_fail(err, KVQ_ERR_USAGE, "the options are required");
    const char *spec_text = o->spec;
    int layer = o->layer, nthreads = o->nthreads;
    uint64_t seed = o->seed;
    const double *rope_cos = o->rope_cos, *rope_sin = o->rope_sin;
    double rope_theta = o->rope_theta;
    kvq_rope_style rope_style = o->rope_style;
    kvq_calib *calib = o->calib;
    kvq_spec sp;
    size_t bytes;
    if (H <= 0 || T <= 0 || D <= 0)
        return kvq_fail(err, KVQ_ERR_USAGE, "expected [H,T,D] with H, T, D > 0, got [%d,%d,%d]", H, T, D);
    if (!kvq_tensor_bytes((size_t)H, (size_t)T, (size_t)D, &bytes))
        return kvq_fail(err, KVQ_ERR_NOMEM, "[%d,%d,%d]: the size overflows", H, T, D);
    if (layer < 0) return kvq_fail(err, KVQ_ERR_USAGE, "layer %d: expected 0 or more", layer);
    if (!key || !value || !key_out || !value_out || !head_acc)
        return kvq_fail(err, KVQ_ERR_USAGE, "key, value and the outputs are required");
    kvq_status st = kvq_spec_parse(spec_text ? spec_text : "", &sp, err);
    if (st) return st;
    if ((st = kvq_spec_check_shape(&sp, D, err))) return st;
    if ((st = kvq_spec_check_calib(&sp, calib != NULL, err))) return st;
    int Hq = o->query ? o->num_heads : H;
    if (o->query && (Hq <= 0 || Hq % H))
        return kvq_fail(err, KVQ_ERR_USAGE, "query: %d heads: expected a multiple of the %d key heads", Hq, H);
    if ((st = check_finite("key", key, H, T, D, err)) || (st = check_finite("value", value, H, T, D, err)) ||
        (key_pre_rope && (st = check_finite("key_pre_rope", key_pre_rope, H, T, D, err))) ||
        (o->query && (st = check_finite("query", o->query, Hq, T, D, err))))
        return st;
    if (calib && kvq_spec_needs_calib(&sp) && (st = kvq_calib_check_layer(calib, layer, H, D, err))) return st;

    /* RoPE as a dump gives it: tables win over theta (docs/dump-format.md); finite, as a dump's must be */
    kvq_rope rope = {0};
    int have_rope = 0;
    if (!rope_cos != !rope_sin)
        return kvq_fail(err, KVQ_ERR_USAGE, "rope: %s given without %s", rope_cos ? "cos" : "sin",
                        rope_cos ? "sin" : "cos");
    if (rope_theta != 0 && !(isfinite(rope_theta) && rope_theta > 0))
        return kvq_fail(err, KVQ_ERR_USAGE, "rope theta %g: expected a positive finite number (0: none)", rope_theta);
    for (size_t i = 0; rope_cos && i < (size_t)T * (size_t)(D / 2); i++)
        if (!isfinite(rope_cos[i]) || !isfinite(rope_sin[i]))
            return kvq_fail(err, KVQ_ERR_FORMAT, "rope: %s[%zu][%zu] = %g: expected a finite number",
                            isfinite(rope_cos[i]) ? "sin" : "cos", i / (size_t)(D / 2), i % (size_t)(D / 2),
                            isfinite(rope_cos[i]) ? rope_sin[i] : rope_cos[i]);
    if (rope_cos && rope_sin) {
        if (rope_style != KVQ_ROPE_INTERLEAVED && rope_style != KVQ_ROPE_HALF)
            return kvq_fail(err, KVQ_ERR_USAGE, "rope tables need a style (interleaved or half)");
        if (D % 2) return kvq_fail(err, KVQ_ERR_USAGE, "rope: head_dim %d is odd", D);
        rope = (kvq_rope){.T = T, .D = D, .style = rope_style, .cos = (double *)rope_cos, .sin = (double *)rope_sin};
        have_rope = 1;
    } else if (rope_theta > 0) {
        if ((st = kvq_rope_from_theta(&rope, T, D, rope_theta, rope_style, err))) return st;
        have_rope = 2; /* owned */
    }

    int nt = 1;
    if ((st = binding_threads(nthreads, (size_t)H * T * D, &nt, err))) {
        if (have_rope == 2) kvq_rope_free(&rope);
        return st;
    }
    kvq_blas_serial(); /* parallelism is ours, over heads */
    kvq_layer L = {.H = H, .Hq = Hq, .T = T, .D = D, .key = (float *)key, .value = (float *)value,
                   .key_pre_rope = (float *)key_pre_rope, .query = (float *)o->query};
    kvq_dump_info info = {.num_layers = layer + 1, .num_heads = Hq, .num_kv_heads = H, .head_dim = D, .seq_len = T,
                          .rope_style = rope_style, .has_rope_theta = rope_theta > 0, .rope_theta = rope_theta,
                          .has_key_pre_rope = key_pre_rope != NULL, .has_rope_table = have_rope == 1};
    snprintf(info.model, sizeof info.model, "arrays");
    kvq_quant_ctx ctx = {.info = &info, .layer = layer, .seed = seed, .nthreads = nt, .rope = have_rope ? &rope : NULL};
    kvq_quant_out q = {.key = key_out, .value = value_out};
    q.k_bits = calloc((size_t)H, sizeof(double)), q.v_bits = calloc((size_t)H, sizeof(double));
    q.static_bytes = calloc((size_t)H, sizeof(double));
    q.recon = calloc(2 * (size_t)H, sizeof *q.recon);
    q.recon_done = calloc(2 * (size_t)H, 1);
    q.keep = o->keep ? o->keep : malloc((size_t)H * T); /* tokens(...; drop): dropped rows come back as zeros */
    if (!q.k_bits || !q.v_bits || !q.static_bytes || !q.recon || !q.recon_done || !q.keep)
        st = kvq_fail(err, KVQ_ERR_NOMEM, "out of memory");
    if (!st && calib) st = kvq_calib_state(calib, &sp, layer, seed, nt, &ctx.calib, err);
    if (!st) memset(q.keep, 1, (size_t)H * T); /* every token, unless a tokens(...) selects */
    if (!st) st = kvq_quantize_layer(&sp, &ctx, &L, &q, err);
    for (int h = 0; h < H && !st; h++) {
        memset(&head_acc[h], 0, sizeof head_acc[h]);
        kvq_quant_head_acc(&L, &q, h, &head_acc[h]);
    }
    free(q.k_bits), free(q.v_bits), free(q.static_bytes), free(q.recon), free(q.recon_done);
    if (!o->keep) free(q.keep);
    if (have_rope == 2) kvq_rope_free(&rope);
    return st;
}

kvq_status kvq_select_arrays(const kvq_arrays_opts *o, int H, int T, int D, const float *key, int target, int qrow0,
                             unsigned char *keep, kvq_error *err)
{
    if (!o || !key || !keep) return kvq_fail(err, KVQ_ERR_USAGE, "the options, key and keep are required");
    if (H <= 0 || T <= 0 || D <= 0)
        return kvq_fail(err, KVQ_ERR_USAGE, "expected [H,T,D] with H, T, D > 0, got [%d,%d,%d]", H, T, D);
    if (target < 0 || qrow0 < 0 || qrow0 > T)
        return kvq_fail(err, KVQ_ERR_USAGE, "target %d, first query row %d: expected target >= 0 and a row in 0..%d",
                        target, qrow0, T);
    kvq_spec sp;
    const kvq_tokens_parts *tp;
    kvq_status st = kvq_spec_parse(o->spec ? o->spec : "", &sp, err);
    if (st || (st = kvq_tokens_parts_of(&sp, &tp, err))) return st;
    int Hq = o->query ? o->num_heads : H;
    if (o->query && (Hq <= 0 || Hq % H))
        return kvq_fail(err, KVQ_ERR_USAGE, "query: %d heads: expected a multiple of the %d key heads", Hq, H);
    if ((st = check_finite("key", key, H, T, D, err)) || (o->query && (st = check_finite("query", o->query, Hq, T, D, err))))
        return st;
    int nt = 1;
    if ((st = binding_threads(o->nthreads, (size_t)H * T * D, &nt, err))) return st;
    kvq_blas_serial();
    kvq_layer L = {.H = H, .Hq = Hq, .T = T, .D = D, .key = (float *)key, .value = (float *)key,
                   .query = (float *)o->query};
    kvq_select_at at = {.target = target, .qrow0 = qrow0};
    return kvq_tokens_select_at(tp, &L, NULL, o->seed, o->layer, nt, target > 0 ? &at : NULL, keep, NULL, err);
}

/* One analysis of the bindings: the specs parsed, the dump (a file, or in memory), its sums. */
typedef struct binding_run {
    kvq_spec *specs;
    kvq_dump *d;
    kvq_analysis a;
} binding_run;

static void binding_run_free(binding_run *r)
{
    kvq_analysis_free(&r->a);
    kvq_dump_close(r->d);
    free(r->specs);
}

/* kvq-analyze on the file at path, or (path NULL) on the dump in memory m, with ao's options. */
static kvq_status binding_analyze(const char *path, const kvq_dump_mem *m, const kvq_analyze_csv_opts *ao,
                                  binding_run *r, kvq_error *err)
{
    memset(r, 0, sizeof *r);
    if (!ao) return kvq_fail(err, KVQ_ERR_USAGE, "the options are required");
    if (!path && !m) return kvq_fail(err, KVQ_ERR_USAGE, "no dump given");
    int nspecs = ao->nspecs, nthreads = ao->nthreads;
    if (nspecs <= 0) return kvq_fail(err, KVQ_ERR_USAGE, "no quantizer spec given");
    if (nthreads < 0 || nthreads > KVQ_MAX_THREADS)
        return kvq_fail(err, KVQ_ERR_USAGE, "threads %d: expected 0 (all cores) or 1..%d", nthreads, KVQ_MAX_THREADS);
    if (ao->per != KVQ_PER_HEAD && ao->per != KVQ_PER_LAYER && ao->per != KVQ_PER_MODEL)
        return kvq_fail(err, KVQ_ERR_USAGE, "per: expected head, layer or model");
    if (!(r->specs = kvq_alloc_array((size_t)nspecs, sizeof *r->specs)))
        return kvq_fail(err, KVQ_ERR_NOMEM, "out of memory");
    kvq_status st = KVQ_OK;
    kvq_analysis_opts o = {.specs = r->specs, .nspecs = nspecs, .layers = ao->layers, .nlayers = ao->nlayers,
                           .heads = ao->heads, .nheads = ao->nheads, .seed = ao->seed, .nthreads = nthreads,
                           .calib = ao->calib};
    for (int s = 0; s < nspecs && !st; s++) st = kvq_spec_parse(ao->specs[s], &r->specs[s], err);
    if (!st) st = kvq_query_sel_parse(ao->queries ? ao->queries : "last:64", &o.queries, err);
    if (!st) st = path ? kvq_dump_open(path, &r->d, err) : kvq_dump_from_memory(m, &r->d, err);
    if (!st) st = kvq_analyze_dump(r->d, &o, &r->a, err);
    if (st) binding_run_free(r);
    return st;
}

/* kvq_analyze_csv on the file at path, or (path NULL) on the dump in memory m. */
static kvq_status analyze_csv(const char *path, const kvq_dump_mem *m, const kvq_analyze_csv_opts *ao, char **csv,
                              kvq_error *err)
{
    *csv = NULL;
    binding_run run;
    kvq_status st = binding_analyze(path, m, ao, &run, err);
    if (st) return st;
    char *buf = NULL;
    size_t len = 0;
    FILE *f = NULL;
    kvq_report *r = NULL;
    if (!(f = open_memstream(&buf, &len)) || !(r = kvq_report_new(f, KVQ_FMT_CSV, NULL, 0)))
        st = kvq_fail(err, KVQ_ERR_NOMEM, "out of memory");
    if (!st && (st = kvq_report_analysis(r, ao->label ? ao->label : kvq_dump_path(run.d), &run.a, run.specs, ao->per,
                                         NULL)))
        kvq_fail(err, st, "out of memory for the rows");
    if (r) {
        kvq_status fst = st ? (kvq_report_discard(r), KVQ_OK) : kvq_report_finish(r);
        if (!st && fst) st = kvq_fail(err, fst, "out of memory for the rows");
    }
    if (f && fclose(f) && !st) st = kvq_fail(err, KVQ_ERR_NOMEM, "out of memory for the rows");
    if (!st) *csv = buf;
    else free(buf);
    binding_run_free(&run);
    return st;
}

kvq_status kvq_analyze_csv(const char *path, const kvq_analyze_csv_opts *o, char **csv, kvq_error *err)
{
    if (!path) return *csv = NULL, kvq_fail(err, KVQ_ERR_USAGE, "no dump given");
    return analyze_csv(path, NULL, o, csv, err);
}

kvq_status kvq_analyze_csv_memory(const kvq_dump_mem *m, const kvq_analyze_csv_opts *o, char **csv, kvq_error *err)
{
    if (!m) return *csv = NULL, kvq_fail(err, KVQ_ERR_USAGE, "no dump given");
    return analyze_csv(NULL, m, o, csv, err);
}

/* kvq_analyze_rows' rows, filled in kvq_analysis_each_row's order. */
typedef struct row_sink {
    kvq_analysis_row *rows;
    size_t n, cap;
} row_sink;

static kvq_status sink_row(void *ud, int layer, int head, const kvq_spec *spec, const char *text, const kvq_metrics *m)
{
    row_sink *s = ud;
    if (s->n == s->cap) return KVQ_ERR_INTERNAL; /* more rows than the analysis has: cannot happen */
    kvq_analysis_row *r = &s->rows[s->n++];
    r->layer = layer, r->head = head, r->quantizer = spec->q->name, r->m = *m;
    snprintf(r->spec, sizeof r->spec, "%s", text);
    return KVQ_OK;
}

kvq_status kvq_analyze_rows(const char *path, const kvq_dump_mem *m, const kvq_analyze_csv_opts *o,
                            kvq_analysis_row **rows, size_t *nrows, kvq_error *err)
{
    *rows = NULL, *nrows = 0;
    if (path && m) return kvq_fail(err, KVQ_ERR_USAGE, "a dump file or a dump in memory, not both");
    binding_run run;
    kvq_status st = binding_analyze(path, m, o, &run, err);
    if (st) return st;
    size_t groups = o->per == KVQ_PER_HEAD ? (size_t)run.a.nlayers * run.a.nheads
                    : o->per == KVQ_PER_LAYER ? (size_t)run.a.nlayers : 1;
    row_sink s = {.cap = groups * (size_t)run.a.nspecs};
    if (!(s.rows = kvq_alloc_array(s.cap ? s.cap : 1, sizeof *s.rows)))
        st = kvq_fail(err, KVQ_ERR_NOMEM, "out of memory");
    if (!st && (st = kvq_analysis_each_row(&run.a, run.specs, o->per, sink_row, &s)))
        kvq_fail(err, st, "the analysis has more rows than its layers, heads and specs");
    binding_run_free(&run);
    if (st) return free(s.rows), st;
    *rows = s.rows, *nrows = s.n;
    return KVQ_OK;
}

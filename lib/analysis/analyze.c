/* analyze.c — the analysis driver behind kvq-analyze and kvq-sweep.
 *
 * For each selected layer (read one at a time, on the calling thread: HDF5
 * is not thread-safe): every quantizer that couples the heads reconstructs
 * the whole layer (its own threads over heads), then the metrics run in
 * parallel over the selected KV heads: each head's thread first quantizes
 * that head with the quantizers that run head by head (spec_by_head), into
 * its own buffer, then computes the exact attention of the head once for
 * all quantizers and compares.
 * Each (layer, head, quantizer) has its own accumulator and pooling happens
 * later in a fixed order, so results do not depend on the thread count.
 *
 * With a GPU (opts.device): the layer goes to the device once, the plan
 * quantizers run there (the others on the CPU, their K', V' copied over),
 * and the attention metrics of every head run there. */
#include "device.h"
#include "../internal.h"
#include "../quant/quant.h"
#include "analysis.h"

#include <cblas.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>


/* Selected indices: the given list (checked against n) or 0..n-1. */
static kvq_status pick(const char *path, const char *what, const int *list, int nlist, int n,
                       int **out, int *nout, kvq_error *err)
{
    int cnt = list ? nlist : n;
    int *v = kvq_alloc_array((size_t)(cnt > 0 ? cnt : 1), sizeof *v);
    if (!v) return kvq_fail(err, KVQ_ERR_NOMEM, "out of memory");
    for (int i = 0; i < cnt; i++) {
        v[i] = list ? list[i] : i;
        if (v[i] < 0 || v[i] >= n) {
            free(v);
            return kvq_fail(err, KVQ_ERR_USAGE, "%s: %s %d: expected 0..%d (the dump has %d)", path, what, list[i],
                            n - 1, n);
        }
    }
    *out = v;
    *nout = cnt;
    return KVQ_OK;
}

void kvq_analysis_free(kvq_analysis *a)
{
    if (!a) return;
    free(a->layers);
    free(a->heads);
    free(a->acc);
    memset(a, 0, sizeof *a);
}

/* What does not depend on the quantizer: the selection, the query positions,
 * the RoPE, and (cached mode) the selected layers and each head's exact
 * attention.  Streamed mode (layers == NULL) reads each layer per analysis. */
struct kvq_prepared {
    kvq_dump *d;
    const kvq_dump_info *info;
    const char *path;
    int nl, nh, *layers, *heads;
    int *pos;
    size_t npos;
    uint64_t seed;
    unsigned flags; /* tensors read besides K, V */
    kvq_rope rope;  /* rope.cos != NULL: the dump's RoPE was read */
    kvq_layer *L;   /* [nl] cached layers without `query`, or NULL */
    kvq_attn_ref **ref; /* [nl][nh] when cached for the CPU and the dump has queries */
    float **qsel;       /* [nl] query rows [Hq][npos][D] when cached for a device */
};

void kvq_prepared_free(kvq_prepared *p)
{
    if (!p) return;
    for (int li = 0; p->L && li < p->nl; li++) kvq_layer_free(&p->L[li]);
    for (size_t i = 0; p->ref && i < (size_t)p->nl * p->nh; i++) kvq_attn_ref_free(p->ref[i]);
    for (int li = 0; p->qsel && li < p->nl; li++) free(p->qsel[li]);
    free(p->L), free(p->ref), free(p->qsel), free(p->layers), free(p->heads), free(p->pos);
    kvq_rope_free(&p->rope);
    free(p);
}

/* Selection, positions and RoPE (no tensors yet). */
static kvq_status prepare_common(kvq_dump *d, const kvq_analysis_opts *o, unsigned flags,
                                 kvq_prepared **out, kvq_error *err)
{
    kvq_prepared *p = calloc(1, sizeof *p);
    *out = NULL;
    if (!p) return kvq_fail(err, KVQ_ERR_NOMEM, "out of memory");
    p->d = d, p->info = kvq_dump_get_info(d), p->path = kvq_dump_path(d);
    p->seed = o->seed, p->flags = flags;
    kvq_status st;
    if ((st = pick(p->path, "layer", o->layers, o->nlayers, p->info->num_layers, &p->layers, &p->nl, err)) ||
        (st = pick(p->path, "KV head", o->heads, o->nheads, p->info->num_kv_heads, &p->heads, &p->nh, err)) ||
        (p->info->has_query &&
         (st = kvq_query_positions(&o->queries, p->info->seq_len, o->seed, &p->pos, &p->npos, err)))) {
        kvq_prepared_free(p);
        return st;
    }
    /* quantizers that read pre-RoPE keys may re-apply RoPE: give them the
     * dump's RoPE if it has one (they report its absence if they need it);
     * a RoPE the dump declares but that cannot be used (a NaN in its tables,
     * an odd head_dim) is an error here, named as what it is */
    const kvq_dump_info *di = p->info;
    if ((flags & KVQ_READ_KEY_PRE_ROPE) && di->rope_style != KVQ_ROPE_UNSET &&
        (di->has_rope_table || di->has_rope_theta) && (st = kvq_dump_read_rope(d, &p->rope, err))) {
        kvq_prepared_free(p);
        return st;
    }
    *out = p;
    return KVQ_OK;
}

kvq_status kvq_prepare_bytes(kvq_dump *d, const kvq_analysis_opts *o, unsigned flags, size_t *bytes,
                             kvq_error *err)
{
    kvq_prepared *p; /* selection and positions only: a size needs no RoPE read */
    kvq_status st = prepare_common(d, o, 0, &p, err);
    if (st) return st;
    const kvq_dump_info *info = p->info;
    size_t layer = 0, tensors = 2 + ((flags & KVQ_READ_KEY_PRE_ROPE) && info->has_key_pre_rope);
    double total = 0; /* in double: a huge dump must not wrap around */
    if (!kvq_tensor_bytes((size_t)info->num_kv_heads, (size_t)info->seq_len, (size_t)info->head_dim, &layer))
        total = 1e30;
    total += (double)p->nl * tensors * layer;
    if (flags & KVQ_READ_KEY_PRE_ROPE) /* cos and sin, [T][D/2] doubles each */
        total += (double)info->seq_len * (info->head_dim / 2) * 2 * sizeof(double);
    if (info->has_query && o->device) /* the query rows only: the GPU recomputes the exact side */
        total += (double)p->nl * info->num_heads * p->npos * info->head_dim * sizeof(float);
    else if (info->has_query)
        total +=
            (double)p->nl * p->nh *
            kvq_attn_ref_bytes(info->num_heads / info->num_kv_heads, info->seq_len, info->head_dim, p->pos, p->npos);
    *bytes = total >= (double)SIZE_MAX ? SIZE_MAX : (size_t)total;
    kvq_prepared_free(p);
    return KVQ_OK;
}

kvq_status kvq_prepare_dump(kvq_dump *d, const kvq_analysis_opts *o, unsigned flags,
                            kvq_prepared **out, kvq_error *err)
{
    kvq_prepared *p;
    kvq_status st = prepare_common(d, o, flags, &p, err);
    if (st) return st;
    const kvq_dump_info *info = p->info;
    int nl = p->nl, nh = p->nh, nt = kvq_threads(o->nthreads);
    kvq_status *hst = calloc((size_t)nh, sizeof *hst);
    kvq_error *herr = calloc((size_t)nh, sizeof *herr);
    p->L = calloc((size_t)nl, sizeof *p->L);
    p->ref = o->device ? NULL : calloc((size_t)nl * nh + 1, sizeof *p->ref);
    p->qsel = o->device ? calloc((size_t)nl + 1, sizeof *p->qsel) : NULL;
    if (!hst || !herr || !p->L || !(p->ref || p->qsel)) {
        st = kvq_fail(err, KVQ_ERR_NOMEM, "%s: out of memory", p->path);
        goto done;
    }
    kvq_blas_serial(); /* parallelism is ours, over heads */
    for (int li = 0; li < nl && !st; li++) {
        kvq_layer *L = &p->L[li];
        float *rows = NULL; /* only the query rows the metrics use: [Hq][npos][D] */
        if ((st = kvq_dump_read_layer(d, p->layers[li], flags & ~KVQ_READ_QUERY, L, err))) break;
        if (info->has_query && (st = kvq_dump_read_query_rows(d, p->layers[li], p->pos, p->npos, &rows, err))) break;
        if (rows && p->qsel) {
            p->qsel[li] = rows;
        } else if (rows) {
            int G = L->Hq / L->H;
#pragma omp parallel for num_threads(nt) schedule(dynamic, 1)
            for (int hi = 0; hi < nh; hi++) {
                int h = p->heads[hi];
                size_t off = (size_t)h * L->T * L->D;
                hst[hi] = kvq_attn_ref_new_rows(rows + (size_t)h * G * p->npos * L->D, G, L->key + off, L->value + off,
                                                L->T, L->D, kvq_dump_attn_mode(d, p->layers[li]), p->pos, p->npos,
                                                &p->ref[(size_t)li * nh + hi], &herr[hi]);
            }
            for (int hi = 0; hi < nh && !st; hi++)
                if (hst[hi]) st = kvq_fail(err, hst[hi], "%s: /layer_%03d: %s", p->path, p->layers[li], herr[hi].msg);
            free(rows); /* the references hold the query rows they need */
        }
    }
done:
    free(hst), free(herr);
    if (st) {
        kvq_prepared_free(p);
        return st;
    }
    *out = p;
    return KVQ_OK;
}

/* Reconstruction and attention sums of the hi-th selected head for every
 * quantizer; ref: its cached exact attention, else computed from L->query. */
static void merge_attn(kvq_acc *acc, const kvq_attn_acc *aa, int nspecs)
{
    for (int s = 0; s < nspecs; s++) {
        kvq_acc tmp = {.has_attn = 1, .attn = aa[s]};
        kvq_acc_merge(&acc[s], &tmp);
    }
}

/* Head h's error sums `fused` and q's bits and static bytes of the head, into acc. */
static void head_acc_add(kvq_acc *acc, const kvq_acc *fused, const kvq_quant_out *q, int h)
{
    kvq_acc_merge(acc, fused);
    acc->k.bits += q->k_bits[h];
    acc->v.bits += q->v_bits[h];
    acc->static_bytes += q->static_bytes[h];
}

void kvq_quant_head_acc(const kvq_layer *L, const kvq_quant_out *q, int h, kvq_acc *acc)
{
    size_t n = (size_t)L->T * L->D;
    int H = L->H;
    /* the error sums the quantizer fused into its loops, else computed here */
    kvq_acc fused = {0};
    if (q->recon_done[h]) fused.k = q->recon[h];
    else
        kvq_recon_accumulate(&fused.k, kvq_head_in(L, 0, h), kvq_head_out(q, L, 0, h), n);
    if (q->recon_done[H + h]) fused.v = q->recon[H + h];
    else
        kvq_recon_accumulate(&fused.v, kvq_head_in(L, 1, h), kvq_head_out(q, L, 1, h), n);
    head_acc_add(acc, &fused, q, h);
}

/* kvq_quant_head_acc of head h for each of the nspecs slots: the error sums
 * their quantizers did not fuse are taken together, x read once for every
 * four of them (kvq_recon_accumulate_many), then merged spec by spec as
 * kvq_quant_head_acc merges them.  -1: out of memory. */
static int quant_heads_acc(const kvq_layer *L, const kvq_quant_out *slot, int nspecs, int h, kvq_acc *acc)
{
    size_t n = (size_t)L->T * L->D;
    int H = L->H;
    kvq_acc *fused = calloc((size_t)nspecs, sizeof *fused);
    kvq_recon_acc **racc = kvq_alloc_array((size_t)nspecs, sizeof *racc);
    const float **y = kvq_alloc_array((size_t)nspecs, sizeof *y);
    int ok = fused && racc && y;
    for (int t = 0; t < 2 && ok; t++) {
        int m = 0;
        for (int s = 0; s < nspecs; s++) {
            kvq_recon_acc *r = t ? &fused[s].v : &fused[s].k;
            if (slot[s].recon_done[t * H + h])
                *r = slot[s].recon[t * H + h];
            else
                racc[m] = r, y[m++] = kvq_head_out(&slot[s], L, t, h);
        }
        kvq_recon_accumulate_many(racc, kvq_head_in(L, t, h), y, m, n);
    }
    for (int s = 0; s < nspecs && ok; s++) head_acc_add(&acc[s], &fused[s], &slot[s], h);
    free(fused), free(racc), free(y);
    return ok ? 0 : -1;
}

/* The masks of head h of the specs that dropped tokens (NULL for the others). */
static void head_masks(const kvq_quant_out *slot, int nspecs, int h, int T, const unsigned char **Mh)
{
    for (int s = 0; s < nspecs; s++) Mh[s] = slot[s].dropped ? slot[s].keep + (size_t)h * T : NULL;
}

static kvq_status head_metrics(const kvq_layer *L, kvq_attn_mode mode, int h, int with_attn, const kvq_attn_ref *ref,
                               const float *qrows, int nspecs, const kvq_quant_out *slot, const int *pos, size_t npos,
                               kvq_acc *acc, kvq_attn_ws *ws, int more, kvq_error *err)
{
    size_t off = (size_t)h * L->T * L->D;
    const float *K = L->key + off, *V = L->value + off;
    if (quant_heads_acc(L, slot, nspecs, h, acc)) return kvq_fail(err, KVQ_ERR_NOMEM, "out of memory");
    if (!with_attn || (!qrows && !ref)) return KVQ_OK;
    int G = L->Hq / L->H;
    const float **Kh = kvq_alloc_array((size_t)nspecs, sizeof *Kh);
    const float **Vh = kvq_alloc_array((size_t)nspecs, sizeof *Vh);
    const unsigned char **Mh = kvq_alloc_array((size_t)nspecs, sizeof *Mh);
    kvq_attn_acc *aa = calloc((size_t)nspecs, sizeof *aa);
    kvq_status st = KVQ_OK;
    if (!Kh || !Vh || !Mh || !aa) {
        st = kvq_fail(err, KVQ_ERR_NOMEM, "out of memory");
    } else {
        for (int s = 0; s < nspecs; s++)
            Kh[s] = kvq_head_out(&slot[s], L, 0, h), Vh[s] = kvq_head_out(&slot[s], L, 1, h);
        head_masks(slot, nspecs, h, L->T, Mh);
        /* query heads h*G .. h*G+G-1 read KV head h */
        if (ref)
            st = kvq_attn_ref_compare_ws(ref, nspecs, Kh, Vh, Mh, aa, ws, err);
        else /* more: the head's exact side from the batch before (layer_metrics) */
            st = (more ? kvq_attention_rows_ws_more : kvq_attention_rows_ws)(qrows + (size_t)h * G * npos * L->D, G, K,
                                                                             V, L->T, L->D, mode, pos, npos, nspecs, Kh,
                                                                             Vh, Mh, aa, ws, err);
        if (!st) merge_attn(acc, aa, nspecs);
    }
    free(Kh), free(Vh), free(Mh), free(aa);
    return st;
}

/* Prefixes err's message with the dump path and, if layer >= 0, the layer. */
static kvq_status layer_error(kvq_error *err, kvq_status st, const char *path, int layer)
{
    char msg[sizeof err->msg];
    snprintf(msg, sizeof msg, "%s", err ? err->msg : "");
    if (layer < 0) return kvq_fail(err, st, "%s: %s", path, msg);
    return kvq_fail(err, st, "%s: /layer_%03d: %s", path, layer, msg);
}

/* Runs spec's plan on the device into slot s: K', V' stay there, the error
 * sums and bits come back as a CPU quantizer's would. */
static kvq_status plan_on_device(kvq_device *dev, const kvq_spec *spec, const kvq_quant_ctx *ctx,
                                 const kvq_layer *L, int s, kvq_quant_out *qo, kvq_error *err)
{
    kvq_plan plan;
    int bad = 0, H = L->H;
    spec->q->plan(spec, L->T, L->D, &plan);
    kvq_status st = kvq_device_quantize_plan(dev, s, &plan, qo->recon, &bad, err);
    if (st == KVQ_ERR_NUMERIC)
        return kvq_quant_numeric_error(err, spec, ctx, bad / H ? "value" : "key", bad % H);
    if (st) return st;
    for (int t = 0; t < 2; t++)
        for (int h = 0; h < H; h++) {
            (t ? qo->v_bits : qo->k_bits)[h] = kvq_plan_bits(&plan, t, H, L->D, h);
            qo->recon_done[t * H + h] = 1;
        }
    return KVQ_OK;
}

/* The attention metrics of the selected heads of a layer on the device,
 * whose slots 0..ns−1 hold the quantizers' K', V'.  qsel: the query rows
 * [Hq][npos][D]. */
static kvq_status attention_on_device(kvq_device *dev, const kvq_prepared *p, const kvq_layer *L,
                                      const float *qsel, int ns, kvq_acc *acc, kvq_error *err)
{
    kvq_attn_acc *aa = calloc((size_t)ns + 1, sizeof *aa);
    kvq_status st = aa ? kvq_device_set_queries(dev, qsel, L->Hq, p->pos, p->npos, p->info->query_prescaled, err)
                       : kvq_fail(err, KVQ_ERR_NOMEM, "out of memory");
    for (int hi = 0; hi < p->nh && !st; hi++) {
        memset(aa, 0, ((size_t)ns + 1) * sizeof *aa);
        if ((st = kvq_device_attention(dev, p->heads[hi], ns, aa, err))) break;
        for (int s = 0; s < ns; s++) aa[s].mass_sum = aa[s].rows; /* nothing dropped on the device */
        merge_attn(acc + (size_t)hi * ns, aa, ns);
    }
    free(aa);
    return st;
}

/* One quantizer's outputs for a layer (a slot per spec): K', V' [H][T][D]
 * of `bytes` each and the kept tokens [H][T] (neither when bytes is 0: a
 * spec run head by head), bits and static bytes [H], the fused error sums
 * and their flags [2][H].  0, or -1 out of memory (slot_free cleans up). */
static int slot_alloc(kvq_quant_out *q, int H, int T, size_t bytes)
{
    if (bytes) q->key = kvq_alloc_lines(bytes), q->value = kvq_alloc_lines(bytes);
    if (bytes) q->keep = kvq_alloc_array((size_t)H * T, 1);
    q->k_bits = calloc((size_t)H, sizeof(double)), q->v_bits = calloc((size_t)H, sizeof(double));
    q->static_bytes = calloc((size_t)H, sizeof(double));
    q->recon = calloc(2 * (size_t)H, sizeof *q->recon);
    q->recon_done = calloc(2 * (size_t)H, 1);
    return (!bytes || (q->key && q->value && q->keep)) && q->k_bits && q->v_bits && q->static_bytes && q->recon &&
                   q->recon_done
               ? 0
               : -1;
}

/* Zeroes what a quantizer adds to (bits, static bytes, fused sums). */
static void slot_reset(kvq_quant_out *q, int H)
{
    memset(q->k_bits, 0, (size_t)H * sizeof(double));
    memset(q->v_bits, 0, (size_t)H * sizeof(double));
    memset(q->static_bytes, 0, (size_t)H * sizeof(double));
    memset(q->recon, 0, 2 * (size_t)H * sizeof *q->recon);
    memset(q->recon_done, 0, 2 * (size_t)H);
    q->dropped = 0;
}

static void slot_free(kvq_quant_out *q)
{
    free(q->key), free(q->value), free(q->k_bits), free(q->v_bits), free(q->static_bytes), free(q->recon);
    free(q->recon_done), free(q->keep);
}

/* The analysis proper, over a prepared dump (cached or streamed). */
/* The GPU kernels compute plain attention: a layer with a sliding window,
 * a scale or a soft-cap is refused on the device. */
static kvq_status device_layers_plain(const kvq_prepared *p, kvq_error *err)
{
    for (int li = 0; p->info->has_query && li < p->nl; li++) {
        kvq_attn_mode m = kvq_dump_attn_mode(p->d, p->layers[li]);
        if (!kvq_attn_mode_plain(&m, p->info->head_dim))
            return kvq_fail(
                err, KVQ_ERR_UNSUPPORTED,
                "%s: /layer_%03d: attention with a sliding window, attn_scale or attn_softcap is computed on the "
                "CPU only (use --device cpu)",
                p->path, p->layers[li]);
    }
    return KVQ_OK;
}

/* Each spec parsed once for the dump's layers (res[s]), checked against what
 * the dump was prepared with, the device, the head_dim and the calibration. */
static kvq_status resolve_specs(const kvq_prepared *p, const kvq_analysis_opts *o, kvq_resolved_spec **res,
                                kvq_error *err)
{
    const kvq_dump_info *info = p->info;
    const char *path = p->path;
    kvq_status st;
    for (int s = 0; s < o->nspecs; s++) {
        if ((st = kvq_spec_resolve(&o->specs[s], info->num_layers, &res[s], err)))
            return layer_error(err, st, path, -1);
        unsigned missing = kvq_resolved_spec_flags(res[s]) & ~p->flags;
        if (missing)
            return kvq_fail(err, KVQ_ERR_USAGE, "%s: %s reads %s, but the dump was prepared without them", path,
                            o->specs[s].text, missing & KVQ_READ_KEY_PRE_ROPE ? "pre-RoPE keys" : "every query row");
        if (o->device && o->specs[s].q->is_tokens)
            return kvq_fail(err, KVQ_ERR_UNSUPPORTED, "%s: %s: tokens(...) runs on the CPU only (use --device cpu)",
                            path, o->specs[s].text);
        kvq_error shape_err = {0};
        if (kvq_resolved_spec_check_shape(res[s], info->head_dim, &shape_err))
            return kvq_fail(err, KVQ_ERR_USAGE, "%s: %s", path, shape_err.msg);
        if (!kvq_resolved_spec_needs_calib(res[s])) continue;
        if ((st = kvq_spec_check_calib(&o->specs[s], o->calib != NULL, err)) ||
            (st = kvq_calib_check(o->calib, path, info, err)))
            return st;
    }
    return KVQ_OK;
}

/* The specs run head by head: a spec whose family quantizes every head on
 * its own (kvq_spec_by_head) at every analysed layer, on the CPU.  Its K',
 * V' take no layer slot: the metrics thread of a head quantizes that head
 * into its own buffer right before comparing it, so the analysis holds a
 * head of them instead of a layer, page-faults that once, and reads them
 * back from cache.  The bits are the same: a family's heads depend neither
 * on each other nor on where they are written (quantize_head's contract). */
static int spec_by_head(const kvq_prepared *p, const kvq_analysis_opts *o, const kvq_resolved_spec *r)
{
    if (o->device) return 0;
    for (int li = 0; li < p->nl; li++)
        if (kvq_resolved_spec_parts(r, p->layers[li]) ||
            !kvq_spec_by_head(kvq_resolved_spec_at(r, p->layers[li]), p->info->seq_len, p->info->head_dim))
            return 0;
    return 1;
}

/* Head-by-head specs a head's task quantizes before it compares them: a
 * thread's buffer holds that many outputs of a head (8 MB each on an 8k-token
 * head), plus the first stages that later specs take. */
enum { HEAD_BATCH = 4 };

/* Every spec on one layer, as the metrics threads see it. */
typedef struct layer_specs {
    int ns, nby;            /* specs; how many of them run head by head */
    unsigned char *by_head; /* [ns] */
    const kvq_spec **spec;  /* [ns] the layer's spec (a mix's range) */
    int *first;             /* [ns] the head-by-head spec before s whose output is s's first stage, or -1 */
    kvq_quant_ctx *ctx;     /* [ns] its context on the layer */
    double (*state)[KVQ_LAYER_STATE_MAX / sizeof(double)]; /* [ns] a head-by-head spec's layer_prepare on it */
    const kvq_layer **in;   /* [ns] L, or Lq for the specs that read every query row */
    kvq_quant_out *slot;    /* [ns] the whole layer's outputs (no K', V' for by_head) */
    size_t slot_bytes;      /* a layer slot's K' (or V') */
    int nbuf;               /* threads */
    int *bslot;             /* [ns] a head-by-head spec's place in buf: a first stage's its own, others
                             * np + their rank in their batch (layer_metrics), or -1 */
    int np, nslots;         /* places for first stages; places in all */
    int *bcap;              /* [nbuf] places in each thread's buf */
    float **buf;            /* [nbuf]: a thread's K', V' of its head [nslots][2][T][D], made on first use */
    kvq_quant_out *view;    /* [nbuf][ns + 1]: a thread's outputs of its head */
    kvq_status *hst;        /* [2][nheads·ns]: each task's metrics, then its head-by-head runs */
    kvq_error *herr;        /* [nheads·ns] */
} layer_specs;

static void layer_specs_free(layer_specs *ls)
{
    for (int i = 0; ls->buf && i < ls->nbuf; i++) free(ls->buf[i]);
    free(ls->by_head), free(ls->spec), free(ls->first), free(ls->ctx), free(ls->state), free(ls->in), free(ls->buf);
    free(ls->bslot), free(ls->bcap);
    free(ls->view);
    free(ls->hst), free(ls->herr);
}

/* ns specs, nbuf threads, nh heads: 0, or -1 out of memory. */
static int layer_specs_alloc(layer_specs *ls, int ns, int nbuf, int nh, kvq_quant_out *slot)
{
    size_t n = (size_t)ns + 1;
    ls->ns = ns, ls->nbuf = nbuf, ls->slot = slot;
    ls->by_head = calloc(n, 1), ls->spec = calloc(n, sizeof *ls->spec), ls->ctx = calloc(n, sizeof *ls->ctx);
    ls->first = calloc(n, sizeof *ls->first), ls->state = calloc(n, sizeof *ls->state);
    ls->in = calloc(n, sizeof *ls->in), ls->buf = calloc((size_t)nbuf, sizeof *ls->buf);
    ls->bslot = calloc(n, sizeof *ls->bslot), ls->bcap = calloc((size_t)nbuf, sizeof *ls->bcap);
    ls->view = calloc((size_t)nbuf * n, sizeof *ls->view);
    size_t ntask = (size_t)nh * (ns > 0 ? ns : 1) + 1; /* at most a task per head and spec (spec_groups) */
    ls->hst = calloc(2 * ntask, sizeof *ls->hst), ls->herr = calloc(ntask, sizeof *ls->herr);
    return ls->by_head && ls->spec && ls->first && ls->state && ls->ctx && ls->in && ls->buf && ls->view && ls->hst &&
                   ls->herr && ls->bslot && ls->bcap
               ? 0
               : -1;
}

/* Every spec's context on layer li (L; Lq with every query row, for
 * selectors) and the layer-wide specs into their slots: on the CPU, or a
 * plan on the device (and the output uploaded).  *failed: the spec that
 * failed (ns if none). */
static kvq_status quantize_specs(const kvq_prepared *p, const kvq_analysis_opts *o, kvq_resolved_spec **res, int li,
                                 const kvq_layer *L, const kvq_layer *Lq, const kvq_attn_mode *mode, int nt,
                                 layer_specs *ls, int *failed, kvq_error *err)
{
    int layer = p->layers[li], nl = p->nl, H = p->info->num_kv_heads;
    for (*failed = 0; *failed < o->nspecs; ++*failed) {
        int s = *failed;
        kvq_quant_ctx *ctx = &ls->ctx[s];
        *ctx = (kvq_quant_ctx){.info = p->info,
                               .layer = layer,
                               .seed = p->seed,
                               .nthreads = nt,
                               .rope = p->rope.cos ? &p->rope : NULL,
                               .attn = mode};
        const kvq_spec *own = ls->spec[s] = kvq_resolved_spec_at(res[s], layer); /* the layer's (a mix's range) */
        const kvq_layer *Ls = ls->in[s] = kvq_resolved_spec_flags(res[s]) & KVQ_READ_QUERY ? Lq : L;
        kvq_quant_out *qo = &ls->slot[s];
        slot_reset(qo, H);
        kvq_status st = KVQ_OK;
        if (o->calib && (st = kvq_calib_state(o->calib, own, layer, p->seed, nt, &ctx->calib, err))) return st;
        if (ls->by_head[s] && (st = kvq_quant_with_layer_state(own, ctx, Ls, ls->state[s], ctx, err))) /* once */
            return layer_error(err, st, p->path, -1);
        if (ls->by_head[s]) continue; /* in the metrics' head loop */
        if (o->progress) o->progress(o->ud, li, nl, o->specs[s].text);
        if (o->device && o->specs[s].q->plan && !kvq_spec_prerotate(&o->specs[s]))
            st = plan_on_device(o->device, &o->specs[s], ctx, L, s, qo, err);
        else if (!(st = kvq_quantize_layer_in(res[s], ctx, Ls, qo, err)) && o->device)
            st = kvq_device_upload_slot(o->device, s, qo->key, qo->value, err);
        if (st) return layer_error(err, st, p->path, -1); /* the quantizer's message names the layer */
    }
    /* a spec's first stage from an earlier spec's output on the same head (head_outputs) */
    for (int s = 0; s < o->nspecs; s++) {
        ls->first[s] = -1;
        for (int f = 0; f < s && ls->by_head[s] && ls->first[s] < 0; f++)
            if (ls->by_head[f] && ls->in[f] == ls->in[s] && kvq_spec_is_first_stage(ls->spec[s], ls->spec[f]))
                ls->first[s] = f;
    }
    /* places in a thread's buffer: each first stage its own (its output waits for the later
     * spec that takes it), the other head-by-head specs by their rank in their batch */
    ls->np = 0;
    for (int s = 0; s < o->nspecs; s++) ls->bslot[s] = -1;
    for (int s = 0; s < o->nspecs; s++)
        if (ls->first[s] >= 0 && ls->bslot[ls->first[s]] < 0) ls->bslot[ls->first[s]] = ls->np++;
    ls->nslots = ls->np + (ls->nby - ls->np < HEAD_BATCH ? ls->nby - ls->np : HEAD_BATCH);
    return KVQ_OK;
}

/* The end of the batch of specs that starts at b0 (before s1): at most
 * HEAD_BATCH of them run head by head. */
static int batch_end(const layer_specs *ls, int b0, int s1)
{
    int s = b0, n = 0;
    while (s < s1 && (n += ls->by_head[s]) <= HEAD_BATCH) s++;
    return s;
}

/* Head h's output of the batch of specs [b0, b1) of the range that starts at
 * s0 into thread tid's view: the slot's, or for a spec run head by head,
 * quantized now into its place in the thread's buffer (head0 = h); a first
 * stage is taken from a spec of the same range (one before it in another
 * range's task quantizes it itself: the same bits).  A failure's message is
 * left to first_error. */
static kvq_status head_outputs(layer_specs *ls, const kvq_layer *L, int h, int tid, int s0, int b0, int b1)
{
    kvq_quant_out *view = ls->view + (size_t)tid * (ls->ns + 1);
    size_t TD = (size_t)L->T * L->D, bytes;
    if (ls->nslots > ls->bcap[tid]) { /* made on first use */
        free(ls->buf[tid]), ls->buf[tid] = NULL, ls->bcap[tid] = 0;
        if (!kvq_tensor_bytes((size_t)ls->nslots * 2, (size_t)L->T, (size_t)L->D, &bytes) ||
            !(ls->buf[tid] = kvq_alloc_lines(bytes)))
            return KVQ_ERR_NOMEM;
        ls->bcap[tid] = ls->nslots;
    }
    for (int s = b0, j = 0; s < b1; s++) {
        view[s] = ls->slot[s];
        if (!ls->by_head[s]) continue;
        int at = ls->bslot[s] >= 0 ? ls->bslot[s] : ls->np + j++;
        view[s].key = ls->buf[tid] + (size_t)at * 2 * TD, view[s].value = view[s].key + TD, view[s].head0 = h;
        kvq_quant_ctx ctx = ls->ctx[s];
        ctx.nthreads = 1; /* the heads are the threads */
        if (ls->first[s] >= s0) ctx.first_stage = &view[ls->first[s]]; /* quantized above, head h */
        kvq_error e = {0};
        for (int tensor = 0; tensor < 2; tensor++) {
            kvq_status st = kvq_quantize_one_head(ls->spec[s], &ctx, ls->in[s], &view[s], tensor, h, &e);
            if (st) return st;
        }
    }
    return KVQ_OK;
}

/* After a spec failed (st, err): the error as quantizing every spec over the
 * whole layer in order names it.  The specs run head by head before spec
 * `upto` are run so, into a scratch slot, and the first to fail names it;
 * if none does, st and err stay. */
static kvq_status first_error(const kvq_prepared *p, kvq_resolved_spec **res, const layer_specs *ls, int upto,
                              kvq_status st, kvq_error *err)
{
    const kvq_dump_info *info = p->info;
    kvq_quant_out scratch = {0};
    for (int s = 0; s < upto; s++) {
        if (!ls->by_head[s]) continue;
        if (!scratch.key && slot_alloc(&scratch, info->num_kv_heads, info->seq_len, ls->slot_bytes)) {
            st = kvq_fail(err, KVQ_ERR_NOMEM, "%s: out of memory", p->path);
            break;
        }
        slot_reset(&scratch, info->num_kv_heads);
        kvq_error e = {0};
        kvq_status fs = kvq_quantize_layer_in(res[s], &ls->ctx[s], ls->in[s], &scratch, &e);
        if (fs) {
            *err = e;
            st = layer_error(err, fs, p->path, -1);
            break;
        }
    }
    slot_free(&scratch);
    return st;
}

/* n threads' attention workspaces (NULL: out of memory). */
static kvq_attn_ws **ws_array_new(int n)
{
    kvq_attn_ws **ws = calloc((size_t)n, sizeof *ws);
    for (int i = 0; ws && i < n; i++)
        if (!(ws[i] = kvq_attn_ws_new())) {
            while (i--) kvq_attn_ws_free(ws[i]);
            free(ws), ws = NULL;
        }
    return ws;
}

static void ws_array_free(kvq_attn_ws **ws, int n)
{
    for (int i = 0; ws && i < n; i++) kvq_attn_ws_free(ws[i]);
    free(ws);
}

/* Into how many ranges of specs each head's work splits: 1 while the heads
 * keep every thread busy; with at least twice as many threads as heads
 * (one KV head on two cores, eight on sixteen), threads / heads ranges, no
 * more than there are specs.  A range's task quantizes, compares and sums
 * its own specs of the head, and computes the head's exact attention again
 * for them: each spec's sums are the same whatever the split. */
static int spec_groups(int nt, int nh, int ns)
{
    int g = nh > 0 ? nt / nh : 1;
    return g < 1 ? 1 : g > ns ? (ns > 0 ? ns : 1) : g;
}

/* Layer li's metrics, its selected heads (or heads and ranges of specs,
 * spec_groups) in parallel: each head's outputs (head_outputs: the specs
 * run head by head are quantized there), then its sums.  A head-by-head
 * run's failure is named by first_error. */
static kvq_status layer_metrics(const kvq_prepared *p, const kvq_analysis_opts *o, kvq_resolved_spec **res, int li,
                                const kvq_layer *L, const float *qr, layer_specs *ls, kvq_attn_ws **ws, kvq_acc *acc,
                                kvq_error *err)
{
    int nh = p->nh, ns = ls->ns, layer = p->layers[li], g = spec_groups(ls->nbuf, nh, ns), ntask = nh * g;
    kvq_status *hst = ls->hst, *qst = ls->hst + ntask;
    kvq_error *herr = ls->herr;
#pragma omp parallel for num_threads(ls->nbuf) schedule(dynamic, 1)
    for (int k = 0; k < ntask; k++) { /* head hi's specs [s0, s1) */
        int hi = k / g, s0 = (int)((long)(k % g) * ns / g), s1 = (int)((long)(k % g + 1) * ns / g);
        int tid = omp_get_thread_num(), h = p->heads[hi];
        kvq_quant_out *view = ls->view + (size_t)tid * (ns + 1);
        hst[k] = qst[k] = KVQ_OK;
        /* in batches of at most HEAD_BATCH head-by-head specs, so that a thread's buffer holds
         * a batch's outputs, not the run's; the head's exact attention is kept from the first */
        for (int b0 = s0, b1; b0 < s1 && !qst[k] && !hst[k]; b0 = b1) {
            b1 = batch_end(ls, b0, s1);
            if ((qst[k] = head_outputs(ls, L, h, tid, s0, b0, b1))) break;
            hst[k] = head_metrics(L, kvq_dump_attn_mode(p->d, layer), h, !o->device,
                                  p->ref ? p->ref[(size_t)li * nh + hi] : NULL, qr, b1 - b0, view + b0, p->pos, p->npos,
                                  acc + (size_t)hi * ns + b0, ws[tid], b0 > s0, &herr[k]);
        }
    }
    for (int k = 0; k < ntask; k++)
        if (qst[k])
            return first_error(p, res, ls, ns,
                               kvq_fail(err, qst[k], "%s: /layer_%03d: %s", p->path, layer, kvq_strerror(qst[k])), err);
    for (int k = 0; k < ntask; k++)
        if (hst[k]) return kvq_fail(err, hst[k], "%s: /layer_%03d: %s", p->path, layer, herr[k].msg);
    return KVQ_OK;
}

static kvq_status analyze_core(kvq_prepared *p, const kvq_analysis_opts *o, kvq_analysis *out,
                               kvq_error *err)
{
    const kvq_dump_info *info = p->info;
    const char *path = p->path;
    kvq_status st = KVQ_OK;
    memset(out, 0, sizeof *out);
    int ns = out->nspecs = o->nspecs, nl = out->nlayers = p->nl, nh = out->nheads = p->nh, H = info->num_kv_heads;
    out->has_attn = info->has_query;
    if (o->device && (st = device_layers_plain(p, err))) return st;
    size_t nacc = (size_t)nl * nh * ns;
    out->acc = calloc(nacc ? nacc : 1, sizeof *out->acc);
    out->layers = kvq_alloc_array((size_t)nl, sizeof *out->layers);
    out->heads = kvq_alloc_array((size_t)nh, sizeof *out->heads);
    kvq_quant_out *slot = calloc((size_t)ns + 1, sizeof *slot); /* one per spec */
    kvq_resolved_spec **res = calloc((size_t)ns + 1, sizeof *res); /* each spec parsed once for the dump's layers */
    int nt = kvq_threads(o->nthreads);
    layer_specs ls = {0};
    kvq_attn_ws **ws = ws_array_new(nt); /* each thread's, kept from head to head */
    kvq_layer read = {0};
    float *qrows = NULL; /* streamed: the layer's query rows */
    float *qall = NULL;  /* every query row [Hq][T][D], for selectors */
    int *allpos = kvq_alloc_array((size_t)info->seq_len + 1, sizeof *allpos);
    size_t bytes;
    for (int t = 0; allpos && t < info->seq_len; t++) allpos[t] = t;
    if (!out->acc || !out->layers || !out->heads || !slot || !res || !allpos || !ws ||
        layer_specs_alloc(&ls, ns, nt, nh, slot)) {
        st = kvq_fail(err, KVQ_ERR_NOMEM, "%s: out of memory", path);
        goto done;
    }
    memcpy(out->layers, p->layers, (size_t)nl * sizeof *out->layers);
    memcpy(out->heads, p->heads, (size_t)nh * sizeof *out->heads);
    if (!kvq_tensor_bytes((size_t)H, (size_t)info->seq_len, (size_t)info->head_dim, &bytes)) {
        st = kvq_fail(err, KVQ_ERR_NOMEM, "%s: layer size overflows", path);
        goto done;
    }
    if (p->L && (o->device ? !p->qsel : !!p->qsel)) {
        st = kvq_fail(err, KVQ_ERR_USAGE, "%s: prepared for the %s, analysed on the %s", path,
                      p->qsel ? "GPU" : "CPU", o->device ? "GPU" : "CPU");
        goto done;
    }
    if ((st = resolve_specs(p, o, res, err))) goto done;
    for (int s = 0; s < ns; s++) ls.nby += ls.by_head[s] = spec_by_head(p, o, res[s]);
    ls.slot_bytes = bytes;
    for (int s = 0; s < ns && !st; s++)
        if (slot_alloc(&slot[s], H, info->seq_len, ls.by_head[s] ? 0 : bytes))
            st = kvq_fail(err, KVQ_ERR_NOMEM, "%s: out of memory for %d quantizer outputs of %zu bytes", path, ns,
                          2 * bytes);
    if (st) goto done;

    kvq_blas_serial(); /* parallelism is ours, over heads */
    for (int li = 0; li < nl; li++) {
        int layer = p->layers[li], failed;
        const kvq_layer *L = p->L ? &p->L[li] : &read;
        if (o->progress && !p->L) o->progress(o->ud, li, nl, "read");
        if (!p->L && ((st = kvq_dump_read_layer_reuse(p->d, layer, p->flags & ~KVQ_READ_QUERY, &read, err)) ||
                      (info->has_query && (st = kvq_dump_read_query_rows(p->d, layer, p->pos, p->npos, &qrows, err)))))
            goto done;
        const float *qr = p->qsel ? p->qsel[li] : qrows; /* [Hq][npos][D] when the dump has queries */
        kvq_attn_mode mode = kvq_dump_attn_mode(p->d, layer);
        kvq_layer Lq = *L; /* with every query row, for the specs whose selectors score with them */
        if ((p->flags & KVQ_READ_QUERY) && info->has_query &&
            (st = kvq_dump_read_query_rows(p->d, layer, allpos, (size_t)info->seq_len, &qall, err)))
            goto done;
        Lq.query = qall;
        if (o->device && (st = kvq_device_set_layer(o->device, L, ns, err))) {
            st = layer_error(err, st, path, layer);
            goto done;
        }
        if ((st = quantize_specs(p, o, res, li, L, &Lq, &mode, nt, &ls, &failed, err))) {
            st = first_error(p, res, &ls, failed, st, err);
            goto done;
        }
        if (o->progress) o->progress(o->ud, li, nl, "metrics");
        kvq_acc *acc = out->acc + (size_t)li * nh * ns;
        if ((st = layer_metrics(p, o, res, li, L, qr, &ls, ws, acc, err))) goto done;
        if (o->device && qr && (st = attention_on_device(o->device, p, L, qr, ns, acc, err))) {
            st = layer_error(err, st, path, layer);
            goto done;
        }
        free(qrows); /* `read` keeps its buffers for the next layer */
        free(qall);
        qrows = qall = NULL;
    }
done:
    kvq_layer_free(&read);
    free(qrows), free(qall), free(allpos);
    for (int s = 0; s < ns && slot; s++) slot_free(&slot[s]);
    for (int s = 0; s < ns && res; s++) kvq_resolved_spec_free(res[s]);
    ws_array_free(ws, nt);
    layer_specs_free(&ls);
    free(slot), free(res);
    if (st) kvq_analysis_free(out);
    return st;
}

kvq_status kvq_analyze_prepared(kvq_prepared *p, const kvq_analysis_opts *o, kvq_analysis *out,
                                kvq_error *err)
{
    return analyze_core(p, o, out, err);
}

kvq_status kvq_analyze_dump(kvq_dump *d, const kvq_analysis_opts *o, kvq_analysis *out,
                            kvq_error *err)
{
    unsigned flags = 0;
    for (int s = 0; s < o->nspecs; s++) flags |= kvq_spec_read_flags(&o->specs[s]);
    kvq_prepared *p;
    memset(out, 0, sizeof *out);
    kvq_status st = prepare_common(d, o, flags, &p, err);
    if (st) return st;
    st = analyze_core(p, o, out, err);
    kvq_prepared_free(p);
    return st;
}

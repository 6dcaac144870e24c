/* analyze.c — the analysis driver behind kvq-analyze and kvq-sweep.
 *
 * For each selected layer (read one at a time, on the calling thread: HDF5
 * is not thread-safe): every quantizer reconstructs the whole layer (its own
 * threads over heads), then the metrics run in parallel over the selected KV
 * heads, the exact attention of a head computed once for all quantizers.
 * Each (layer, head, quantizer) has its own accumulator and pooling happens
 * later in a fixed order, so results do not depend on the thread count. */
#include "internal.h"

#include <cblas.h>
#include <omp.h>
#include <string.h>

int kvq_threads(int requested)
{
    if (requested > 0) return requested;
    int n = omp_get_num_procs();
    return n > 0 ? n : 1;
}

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
            return kvq_fail(err, KVQ_ERR_USAGE, "%s: %s %d: expected 0..%d (the dump has %d)", path, what, list[i], n - 1, n);
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

/* Reconstruction and attention sums of KV head h for every quantizer. */
static kvq_status head_metrics(const kvq_layer *L, const kvq_dump_info *info, int h, int nspecs,
                               float *const *kq, float *const *vq, double *const *kbits,
                               double *const *vbits, double *const *sbytes, const int *pos,
                               size_t npos, kvq_acc *acc, kvq_error *err)
{
    size_t off = (size_t)h * L->T * L->D, n = (size_t)L->T * L->D;
    const float *K = L->key + off, *V = L->value + off;
    for (int s = 0; s < nspecs; s++) {
        kvq_recon_accumulate(&acc[s].k, K, kq[s] + off, n);
        kvq_recon_accumulate(&acc[s].v, V, vq[s] + off, n);
        acc[s].k.bits += kbits[s][h];
        acc[s].v.bits += vbits[s][h];
        acc[s].static_bytes += sbytes[s][h];
    }
    if (!L->query) return KVQ_OK;
    int G = L->Hq / L->H;
    const float **Kh = kvq_alloc_array((size_t)nspecs, sizeof *Kh);
    const float **Vh = kvq_alloc_array((size_t)nspecs, sizeof *Vh);
    kvq_attn_acc *aa = calloc((size_t)nspecs, sizeof *aa);
    kvq_status st = KVQ_OK;
    if (!Kh || !Vh || !aa) {
        st = kvq_fail(err, KVQ_ERR_NOMEM, "out of memory");
    } else {
        for (int s = 0; s < nspecs; s++) Kh[s] = kq[s] + off, Vh[s] = vq[s] + off;
        /* query heads h*G .. h*G+G-1 read KV head h */
        st = kvq_attention_head(L->query + (size_t)h * G * L->T * L->D, G, K, V, L->T, L->D,
                                info->query_prescaled, pos, npos, nspecs, Kh, Vh, aa, err);
        for (int s = 0; s < nspecs && !st; s++) {
            acc[s].has_attn = 1;
            kvq_acc tmp = {.has_attn = 1, .attn = aa[s]};
            kvq_acc_merge(&acc[s], &tmp);
        }
    }
    free(Kh), free(Vh), free(aa);
    return st;
}

kvq_status kvq_analyze_dump(kvq_dump *d, const kvq_analysis_opts *o, kvq_analysis *out,
                            kvq_error *err)
{
    const kvq_dump_info *info = kvq_dump_get_info(d);
    const char *path = kvq_dump_path(d);
    kvq_status st;
    memset(out, 0, sizeof *out);
    if ((st = pick(path, "layer", o->layers, o->nlayers, info->num_layers, &out->layers, &out->nlayers, err)) ||
        (st = pick(path, "KV head", o->heads, o->nheads, info->num_kv_heads, &out->heads, &out->nheads, err))) {
        kvq_analysis_free(out);
        return st;
    }
    int ns = out->nspecs = o->nspecs, nl = out->nlayers, nh = out->nheads, H = info->num_kv_heads;
    out->has_attn = info->has_query;
    size_t nacc = (size_t)nl * nh * ns;
    out->acc = calloc(nacc ? nacc : 1, sizeof *out->acc);

    int *pos = NULL;
    size_t npos = 0;
    float **kq = calloc((size_t)ns + 1, sizeof *kq), **vq = calloc((size_t)ns + 1, sizeof *vq);
    double **kb = calloc((size_t)ns + 1, sizeof *kb), **vb = calloc((size_t)ns + 1, sizeof *vb);
    kvq_status *hst = calloc((size_t)nh, sizeof *hst);
    kvq_error *herr = calloc((size_t)nh, sizeof *herr);
    double **sb = calloc((size_t)ns + 1, sizeof *sb);
    kvq_layer L = {0};
    kvq_rope rope = {0}; /* rope.cos != NULL: the dump's RoPE was read */
    unsigned flags = KVQ_READ_QUERY;
    size_t bytes;
    if (!out->acc || !kq || !vq || !kb || !vb || !sb || !hst || !herr) {
        st = kvq_fail(err, KVQ_ERR_NOMEM, "%s: out of memory", path);
        goto done;
    }
    if (!kvq_tensor_bytes((size_t)H, (size_t)info->seq_len, (size_t)info->head_dim, &bytes)) {
        st = kvq_fail(err, KVQ_ERR_NOMEM, "%s: layer size overflows", path);
        goto done;
    }
    for (int s = 0; s < ns; s++) {
        kq[s] = malloc(bytes), vq[s] = malloc(bytes);
        kb[s] = calloc((size_t)H, sizeof(double)), vb[s] = calloc((size_t)H, sizeof(double));
        sb[s] = calloc((size_t)H, sizeof(double));
        if (!kq[s] || !vq[s] || !kb[s] || !vb[s] || !sb[s]) {
            st = kvq_fail(err, KVQ_ERR_NOMEM, "%s: out of memory for %d quantizer outputs of %zu bytes", path, ns, 2 * bytes);
            goto done;
        }
    }
    if (info->has_query && (st = kvq_query_positions(&o->queries, info->seq_len, o->seed, &pos, &npos, err)))
        goto done;
    for (int s = 0; s < ns; s++) {
        flags |= o->specs[s].q->read_flags;
        if (!kvq_spec_needs_calib(&o->specs[s])) continue;
        if (!o->calib) {
            st = kvq_fail(err, KVQ_ERR_USAGE, "%s: needs --calib FILE (a calibration dump of the same model)", o->specs[s].text);
            goto done;
        }
        if ((st = kvq_calib_check(o->calib, path, info, err))) goto done;
    }
    /* quantizers that read pre-RoPE keys may re-apply RoPE: give them the
     * dump's RoPE if it has one (they report its absence if they need it) */
    if (flags & KVQ_READ_KEY_PRE_ROPE) kvq_dump_read_rope(d, &rope, NULL);

    int nt = kvq_threads(o->nthreads);
    openblas_set_num_threads(1); /* parallelism is ours, over heads */
    for (int li = 0; li < nl; li++) {
        int layer = out->layers[li];
        if ((st = kvq_dump_read_layer(d, layer, flags, &L, err))) goto done;
        for (int s = 0; s < ns; s++) {
            kvq_quant_ctx ctx = {.info = info, .layer = layer, .seed = o->seed, .nthreads = nt,
                                 .rope = rope.cos ? &rope : NULL};
            kvq_quant_out qo = {.key = kq[s], .value = vq[s], .k_bits = kb[s], .v_bits = vb[s],
                                .static_bytes = sb[s]};
            memset(kb[s], 0, (size_t)H * sizeof(double));
            memset(vb[s], 0, (size_t)H * sizeof(double));
            memset(sb[s], 0, (size_t)H * sizeof(double));
            if (o->calib && (st = kvq_calib_state(o->calib, &o->specs[s], layer, o->seed, nt, &ctx.calib, err)))
                goto done;
            if ((st = kvq_quantize_layer(&o->specs[s], &ctx, &L, &qo, err))) {
                char msg[sizeof err->msg];
                snprintf(msg, sizeof msg, "%s", err ? err->msg : "");
                st = kvq_fail(err, st, "%s: %s", path, msg);
                goto done;
            }
        }
#pragma omp parallel for num_threads(nt) schedule(dynamic, 1)
        for (int hi = 0; hi < nh; hi++)
            hst[hi] = head_metrics(&L, info, out->heads[hi], ns, kq, vq, kb, vb, sb, pos, npos,
                                   out->acc + ((size_t)li * nh + hi) * ns, &herr[hi]);
        for (int hi = 0; hi < nh; hi++)
            if (hst[hi]) {
                st = kvq_fail(err, hst[hi], "%s: /layer_%03d: %s", path, layer, herr[hi].msg);
                goto done;
            }
        kvq_layer_free(&L);
    }
done:
    kvq_layer_free(&L);
    kvq_rope_free(&rope);
    for (int s = 0; s < ns && kq && vq && kb && vb && sb; s++)
        free(kq[s]), free(vq[s]), free(kb[s]), free(vb[s]), free(sb[s]);
    free(kq), free(vq), free(kb), free(vb), free(sb), free(hst), free(herr), free(pos);
    if (st) kvq_analysis_free(out);
    return st;
}

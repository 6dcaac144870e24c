/* gen.c — seeded synthetic dumps (kvq-gen): the structure real KV caches
 * show, at any shape.  Pre-RoPE keys have a few fixed outlier channels with
 * large scale and offset (the KIVI paper's Figure 2 pattern); RoPE of either
 * style is applied; values have no outlier channels; each query points at
 * one earlier key (plus noise) so attention is peaked. */
#include "../internal.h"

#include <math.h>
#include <string.h>

void kvq_gen_defaults(kvq_gen_opts *o)
{
    memset(o, 0, sizeof *o);
    o->num_layers = 2;
    o->num_heads = 8;
    o->num_kv_heads = 4;
    o->head_dim = 64;
    o->seq_len = 256;
    o->rope_style = KVQ_ROPE_INTERLEAVED;
    o->rope_theta = 10000.0;
    o->outlier_channels = 4;
    o->outlier_scale = 8.0;
    o->peak = 8.0;
    o->with_query = 1;
    o->with_key_pre_rope = 1;
    o->dtype = KVQ_F32;
    o->seed = 0;
}

/* One KV head's keys (pre and post RoPE), values and its G queries. */
static void gen_head(const kvq_gen_opts *o, int layer, int h, kvq_layer *L)
{
    int T = L->T, D = L->D, G = L->Hq / L->H;
    size_t off = (size_t)h * T * D;
    float *kpre = L->key_pre_rope ? L->key_pre_rope + off : NULL;
    float *k = L->key + off, *v = L->value + off;
    kvq_rng r;
    kvq_rng_init(&r, o->seed, (uint64_t)layer, (uint64_t)h, KVQ_STREAM_GEN);

    double sigma[4096], mu[4096];
    for (int c = 0; c < D; c++) sigma[c] = 0.5 + kvq_rng_uniform(&r), mu[c] = 0.2 * kvq_rng_normal(&r);
    for (int i = 0; i < o->outlier_channels; i++) { /* distinct outlier channels */
        int c;
        do c = (int)kvq_rng_below(&r, (uint64_t)D);
        while (sigma[c] > 2.0);
        sigma[c] *= o->outlier_scale;
        mu[c] = (kvq_rng_uniform(&r) < 0.5 ? -0.5 : 0.5) * o->outlier_scale;
    }
    for (int t = 0; t < T; t++)
        for (int c = 0; c < D; c++) k[(size_t)t * D + c] = (float)(mu[c] + sigma[c] * kvq_rng_normal(&r));
    if (kpre) memcpy(kpre, k, (size_t)T * D * sizeof(float));
    kvq_rope_apply(k, T, D, o->rope_theta, o->rope_style);

    for (int c = 0; c < D; c++) sigma[c] = 0.5 + kvq_rng_uniform(&r);
    for (int t = 0; t < T; t++)
        for (int c = 0; c < D; c++) v[(size_t)t * D + c] = (float)(sigma[c] * kvq_rng_normal(&r));

    if (!L->query) return;
    for (int j = 0; j < G; j++) {
        float *q = L->query + ((size_t)h * G + j) * T * D;
        for (int t = 0; t < T; t++) {
            /* q_t = peak·√D·k_u/‖k_u‖² + noise: the score of key u is ≈ peak */
            int u = (int)kvq_rng_below(&r, (uint64_t)t + 1);
            const float *ku = k + (size_t)u * D;
            double n2 = 0;
            for (int c = 0; c < D; c++) n2 += (double)ku[c] * ku[c];
            double a = n2 > 0 ? o->peak * sqrt((double)D) / n2 : 0.0;
            for (int c = 0; c < D; c++)
                q[(size_t)t * D + c] = (float)(a * ku[c] + 0.1 * kvq_rng_normal(&r));
        }
    }
}

kvq_status kvq_gen_write(const char *path, const kvq_gen_opts *o, kvq_error *err)
{
    if (o->num_layers < 1 || o->num_layers > 1000 || o->num_heads < 1 || o->num_kv_heads < 1 ||
        o->head_dim < 2 || o->head_dim > 4096 || o->seq_len < 1)
        return kvq_fail(err, KVQ_ERR_USAGE,
                        "synthetic dump: expected layers 1..1000, heads >= 1, head_dim 2..4096 and tokens >= 1");
    if (o->num_heads % o->num_kv_heads)
        return kvq_fail(err, KVQ_ERR_USAGE, "synthetic dump: %d heads: expected a multiple of the KV heads (%d)",
                        o->num_heads, o->num_kv_heads);
    if (o->head_dim % 2)
        return kvq_fail(err, KVQ_ERR_USAGE, "synthetic dump: head_dim %d: expected an even number (RoPE rotates pairs)",
                        o->head_dim);
    if (o->outlier_channels < 0 || o->outlier_channels > o->head_dim / 2)
        return kvq_fail(err, KVQ_ERR_USAGE, "synthetic dump: %d outlier channels: expected 0..head_dim/2 (%d)",
                        o->outlier_channels, o->head_dim / 2);

    kvq_dump_info info = {0};
    snprintf(info.model, sizeof info.model, "kvq-gen synthetic (seed %llu)", (unsigned long long)o->seed);
    info.num_layers = o->num_layers, info.num_heads = o->num_heads, info.num_kv_heads = o->num_kv_heads;
    info.head_dim = o->head_dim, info.seq_len = o->seq_len;
    info.has_rope_theta = 1, info.rope_theta = o->rope_theta, info.rope_style = o->rope_style;
    kvq_layer L;
    unsigned flags = (o->with_query ? KVQ_READ_QUERY : 0u) | (o->with_key_pre_rope ? KVQ_READ_KEY_PRE_ROPE : 0u);
    kvq_status st = kvq_layer_alloc(&L, o->num_kv_heads, o->num_heads, o->seq_len, o->head_dim, flags, err);
    if (st) return st;
    kvq_dump_writer *w;
    if ((st = kvq_dump_writer_create(path, &info, o->dtype, &w, err))) {
        kvq_layer_free(&L);
        return st;
    }
    for (int l = 0; l < o->num_layers && !st; l++) {
        if (o->progress) o->progress(o->progress_ud, l, o->num_layers, "generating and writing");
#pragma omp parallel for schedule(dynamic, 1)
        for (int h = 0; h < o->num_kv_heads; h++) gen_head(o, l, h, &L);
        st = kvq_dump_writer_layer(w, l, &L, err);
    }
    kvq_layer_free(&L);
    if (st) {
        kvq_dump_writer_abort(w);
        return st;
    }
    return kvq_dump_writer_finish(w, err);
}

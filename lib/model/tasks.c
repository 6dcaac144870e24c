/* tasks.c — retrieval tasks in the loop (SPEC §8 "Retrieval tasks",
 * docs/models.md#retrieval-tasks): each task's prompt (BOS + context + question) and
 * answer through kvq_model_eval's context protocol (the context's cache
 * compressed once by each spec, the question and answer on top, only the
 * answer scored), and the per-task results pooled into rows. */
#include "model.h"

#include <math.h>
#include <string.h>

/* err's message prefixed with the task's name (one line). */
static kvq_status name_error(kvq_error *err, kvq_status st, const char *name)
{
    char tmp[sizeof err->msg];
    if (!err) return st;
    snprintf(tmp, sizeof tmp, "%s", err->msg);
    return kvq_fail(err, st, "%s: %s", name, tmp);
}

/* The task's tokens: BOS (when the model adds one) + context + question +
 * answer; *nctx: BOS + context, *nprompt: + question. */
static kvq_status task_tokens(const kvq_model *m, const kvq_task *t, const char *name, int **ids, int *T, int *nctx,
                              int *nprompt, int *nans, kvq_error *err)
{
    int *part[3] = {0};
    size_t n[3] = {0};
    const char *text[3] = {t->context, t->question, t->answer};
    kvq_status st = KVQ_OK;
    *ids = NULL;
    for (int i = 0; i < 3 && !st; i++) st = kvq_model_tokenize_part(m, text[i], strlen(text[i]), &part[i], &n[i], err);
    if (st) {
        name_error(err, st, name);
        goto done;
    }
    int bos = m->vocab.add_bos ? 1 : 0, ctx = m->info.context_length;
    size_t total = (size_t)bos + n[0] + n[1] + n[2];
    if (!n[2]) {
        st = kvq_fail(err, KVQ_ERR_FORMAT, "%s: the answer has no tokens", name);
        goto done;
    }
    if ((size_t)bos + n[0] < 1) {
        st = kvq_fail(err, KVQ_ERR_FORMAT, "%s: an empty context and no BOS: nothing to compress", name);
        goto done;
    }
    if (total > (size_t)ctx) {
        st = kvq_fail(err, KVQ_ERR_FORMAT, "%s: the prompt and answer take %zu tokens, more than the model's context "
                      "length %d", name, total, ctx);
        goto done;
    }
    int *v = kvq_alloc_array(total, sizeof *v);
    if (!v) {
        st = kvq_fail(err, KVQ_ERR_NOMEM, "out of memory");
        goto done;
    }
    size_t k = 0;
    if (bos) v[k++] = m->vocab.bos;
    for (int i = 0; i < 3; i++) memcpy(v + k, part[i], n[i] * sizeof *v), k += n[i];
    *ids = v, *T = (int)total;
    *nctx = bos + (int)n[0], *nprompt = *nctx + (int)n[1], *nans = (int)n[2];
done:
    for (int i = 0; i < 3; i++) free(part[i]);
    return st;
}

void kvq_task_name(const kvq_task *t, size_t index, char *buf, size_t len)
{
    if (t->id && t->line) snprintf(buf, len, "task %s (line %zu)", t->id, t->line);
    else if (t->id) snprintf(buf, len, "task %s", t->id);
    else if (t->line) snprintf(buf, len, "the task of line %zu", t->line);
    else snprintf(buf, len, "task %zu", index + 1);
}

typedef struct task_sums {
    kvq_eval_sums *items; /* the window's sums per item, as kvq_model_eval hands them over */
    int nitems;
} task_sums;

static kvq_status keep_sums(void *ud, int window, const kvq_eval_sums *ref, const kvq_eval_sums *items,
                            kvq_error *err)
{
    (void)window, (void)ref, (void)err;
    task_sums *ts = ud;
    memcpy(ts->items, items, (size_t)ts->nitems * sizeof *items);
    return KVQ_OK;
}

kvq_status kvq_model_check_tasks(const kvq_model *m, const kvq_task *tasks, size_t ntasks, kvq_error *err)
{
    for (size_t i = 0; i < ntasks; i++) {
        int *ids, T, nctx, np, na;
        char name[160];
        kvq_task_name(&tasks[i], i, name, sizeof name);
        kvq_status st = task_tokens(m, &tasks[i], name, &ids, &T, &nctx, &np, &na, err);
        if (st) return st;
        free(ids);
    }
    return KVQ_OK;
}

kvq_status kvq_model_eval_tasks(kvq_model *m, const kvq_task *tasks, size_t t0, size_t t1, kvq_eval_item *items,
                                int nitems, const kvq_eval_opts *opts, kvq_task_result *res, kvq_error *err)
{
    int R = nitems + 1;
    kvq_eval_sums *sums = calloc((size_t)nitems + 1, sizeof *sums);
    if (!sums) return kvq_fail(err, KVQ_ERR_NOMEM, "out of memory");
    kvq_status st = KVQ_OK;
    for (size_t i = t0; i < t1 && !st; i++) {
        int *ids = NULL, T, nctx, np, na;
        char name[160];
        kvq_task_name(&tasks[i], i, name, sizeof name);
        if ((st = task_tokens(m, &tasks[i], name, &ids, &T, &nctx, &np, &na, err))) break;
        double *pnll = kvq_alloc_array((size_t)R * na, sizeof *pnll);
        unsigned char *phit = kvq_alloc_array((size_t)R * na, 1);
        if (!pnll || !phit) {
            free(ids), free(pnll), free(phit);
            st = kvq_fail(err, KVQ_ERR_NOMEM, "out of memory");
            break;
        }
        task_sums ts = {sums, nitems};
        kvq_eval_opts o = *opts;
        o.chunk = o.chunks = o.window_begin = o.window_end = 0;
        o.context = nctx, o.score_from = np - 1;
        o.position_nll = pnll, o.position_hit = phit;
        o.window_done = keep_sums, o.window_ud = &ts;
        o.window_progress = NULL, o.logit_pos = NULL, o.n_logit_pos = 0;
        double nll_ref;
        st = kvq_model_eval(m, ids, T, items, nitems, &o, &nll_ref, err);
        if (st) name_error(err, st, name);
        for (int r = 0; r < R && !st; r++) {
            kvq_task_result *out = &res[(i - t0) * (size_t)R + r];
            out->nll = 0, out->exact = 1;
            for (int a = 0; a < na; a++) out->nll += pnll[(size_t)r * na + a], out->exact &= phit[(size_t)r * na + a];
            const kvq_eval_sums *s = r ? &sums[r - 1] : NULL; /* row 0, the exact model: no cache of its own */
            out->k_bits = s ? s->ctx_k_bits : 0, out->v_bits = s ? s->ctx_v_bits : 0;
            out->elements = s ? s->ctx_elements : 0;
            out->answer_tokens = na, out->context_tokens = nctx;
        }
        free(ids), free(pnll), free(phit);
        if (!st && opts->window_progress) opts->window_progress(opts->ud, (int)(i + 1 - t0), (int)(t1 - t0));
    }
    free(sums);
    return st;
}

void kvq_task_pool(const kvq_task_result *res, size_t ntasks, int nitems, int item, const unsigned char *select,
                   kvq_task_summary *out)
{
    int R = nitems + 1;
    double n = 0, ref = 0, q = 0, hit_ref = 0, hit = 0, kb = 0, vb = 0, el = 0, mean = 0, m2 = 0;
    for (size_t i = 0; i < ntasks; i++) {
        if (select && !select[i]) continue;
        const kvq_task_result *r0 = &res[i * (size_t)R], *ri = &res[i * (size_t)R + 1 + item];
        double d = ri->nll - r0->nll;
        n += 1;
        ref += r0->nll, q += ri->nll, hit_ref += r0->exact, hit += ri->exact;
        kb += ri->k_bits, vb += ri->v_bits, el += ri->elements;
        double delta = d - mean; /* Welford, in task order */
        mean += delta / n;
        m2 += delta * (d - mean);
    }
    memset(out, 0, sizeof *out);
    out->tasks = (int)n;
    if (!n) {
        out->nll_ref = out->nll = out->dnll = out->dnll_se = out->exact_ref = out->exact = out->recall_drop = NAN;
        out->k_bits = out->v_bits = NAN;
        return;
    }
    out->nll_ref = ref / n, out->nll = q / n, out->dnll = q / n - ref / n;
    out->dnll_se = n > 1 ? sqrt(m2 / (n - 1)) / sqrt(n) : NAN;
    out->exact_ref = hit_ref / n, out->exact = hit / n, out->recall_drop = out->exact_ref - out->exact;
    out->k_bits = el > 0 ? kb / el : NAN, out->v_bits = el > 0 ? vb / el : NAN;
}

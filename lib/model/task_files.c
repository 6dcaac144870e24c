/* task_files.c — kvq-eval --tasks's result files (docs/models.md#retrieval-tasks):
 * the rows of a run (per configuration over all tasks, and per depth
 * bucket), a shard's rows (one per task and configuration, with what the
 * pooling needs), and the merge of such shards: the tasks put back in
 * order and pooled as one run pools them (kvq_task_pool, in task order), so
 * the merged rows are the unsharded run's, bit for bit.  The tool keeps the
 * files and the record. */
#include "model.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

static const char *const TASK_COLS[] = {"model", "tasks", "quantizer", "spec", "policy", "layer", "depth",
                                        "k_bits", "v_bits", "answer_nll_ref", "answer_nll", "answer_dnll",
                                        "answer_dnll_se", "exact_ref", "exact", "recall_drop"};
enum { TASK_TEXT = 7, TASK_NCOLS = sizeof TASK_COLS / sizeof *TASK_COLS };
/* a shard's rows: one per task and configuration */
static const char *const SHARD_COLS[] = {"model", "tasks", "quantizer", "spec", "policy", "layer", "depth", "task",
                                         "answer_nll_ref", "answer_nll", "exact_ref", "exact", "k_bits_sum",
                                         "v_bits_sum", "elements", "run"};
enum { SHARD_TEXT = 8, SHARD_NCOLS = sizeof SHARD_COLS / sizeof *SHARD_COLS, S_TASK = 7, S_NUM = 8, S_RUN = 15 };

/* One pooled row: configuration i over the selected tasks (none: no row). */
static kvq_status pooled_row(kvq_report *rep, const kvq_eval_row *r, const kvq_task_result *res, size_t ntasks,
                             int nitems, int i, const unsigned char *select, const char *depth)
{
    kvq_task_summary sum;
    kvq_task_pool(res, ntasks, nitems, i, select, &sum);
    if (!sum.tasks) return KVQ_OK;
    char ntask[24];
    snprintf(ntask, sizeof ntask, "%d", sum.tasks);
    kvq_cell row[TASK_NCOLS] = {{.text = r->model},
                                {.text = ntask},
                                {.text = r->quantizer},
                                {.text = r->spec},
                                {.text = r->policy},
                                {.text = r->layer},
                                {.text = depth},
                                {.num = sum.k_bits, .is_num = 1},
                                {.num = sum.v_bits, .is_num = 1},
                                {.num = sum.nll_ref, .is_num = 1},
                                {.num = sum.nll, .is_num = 1},
                                {.num = sum.dnll, .is_num = 1},
                                {.num = sum.dnll_se, .is_num = 1},
                                {.num = sum.exact_ref, .is_num = 1},
                                {.num = sum.exact, .is_num = 1},
                                {.num = sum.recall_drop, .is_num = 1}};
    return kvq_rows_add(rep, row);
}

kvq_status kvq_task_rows(FILE *f, kvq_format fmt, const kvq_eval_row *rows, int nitems, const kvq_task_result *res,
                         const double *depth, size_t ntasks, double per_depth)
{
    kvq_report *rep = kvq_rows_new(f, fmt, TASK_COLS, TASK_NCOLS, TASK_TEXT);
    unsigned char *sel = calloc(ntasks ? ntasks : 1, 1);
    kvq_status st = KVQ_OK;
    if (!rep || !sel) {
        kvq_report_discard(rep), free(sel);
        return KVQ_ERR_NOMEM;
    }
    int nb = per_depth > 0 ? (int)ceil(1.0 / per_depth - 1e-9) : 0;
    for (int i = 0; i < nitems && !st; i++) {
        st = pooled_row(rep, &rows[i], res, ntasks, nitems, i, NULL, "all");
        for (int b = 0; b < nb && !st; b++) { /* [lo, hi), the last one closed */
            double lo = b * per_depth, hi = b + 1 == nb ? 1.0 : (b + 1) * per_depth;
            for (size_t t = 0; t < ntasks; t++)
                sel[t] = !isnan(depth[t]) && depth[t] >= lo && (depth[t] < hi || (b + 1 == nb && depth[t] <= 1.0));
            char name[48];
            snprintf(name, sizeof name, "%.4g-%.4g", lo, hi);
            st = pooled_row(rep, &rows[i], res, ntasks, nitems, i, sel, name);
        }
    }
    free(sel);
    if (st) return kvq_report_discard(rep), st;
    return kvq_report_finish(rep);
}

kvq_status kvq_task_shard_rows(FILE *f, const kvq_eval_row *rows, int nitems, const kvq_task_result *res,
                               const double *depth, size_t t0, size_t t1, size_t ntasks, const char *run)
{
    if (t0 == t1) { /* an empty share (more shards than tasks): the header alone, which --merge takes */
        for (int c = 0; c < SHARD_NCOLS; c++) fprintf(f, "%s%s", SHARD_COLS[c], c + 1 < SHARD_NCOLS ? "," : "\n");
        return ferror(f) ? KVQ_ERR_IO : KVQ_OK;
    }
    kvq_report *rep = kvq_rows_new(f, KVQ_FMT_CSV, SHARD_COLS, SHARD_NCOLS, SHARD_TEXT);
    if (!rep) return KVQ_ERR_NOMEM;
    char total[24];
    snprintf(total, sizeof total, "%zu", ntasks);
    int R = nitems + 1;
    for (int i = 0; i < nitems; i++)
        for (size_t t = t0; t < t1; t++) {
            const kvq_task_result *r0 = &res[(t - t0) * R], *ri = &res[(t - t0) * R + 1 + i];
            char tn[24], dp[32] = "";
            snprintf(tn, sizeof tn, "%zu", t);
            if (!isnan(depth[t])) snprintf(dp, sizeof dp, "%.17g", depth[t]);
            const kvq_eval_row *r = &rows[i];
            kvq_cell c[SHARD_NCOLS] = {{.text = r->model}, {.text = total}, {.text = r->quantizer},
                                       {.text = r->spec}, {.text = r->policy}, {.text = r->layer},
                                       {.text = dp}, {.text = tn},
                                       {.num = r0->nll, .is_num = 1}, {.num = ri->nll, .is_num = 1},
                                       {.num = r0->exact, .is_num = 1}, {.num = ri->exact, .is_num = 1},
                                       {.num = ri->k_bits, .is_num = 1}, {.num = ri->v_bits, .is_num = 1},
                                       {.num = ri->elements, .is_num = 1}, {.text = run}};
            kvq_status wst = kvq_rows_add(rep, c);
            if (wst) return kvq_report_discard(rep), wst;
        }
    return kvq_report_finish(rep);
}

int kvq_is_task_shard(const char *path)
{
    FILE *f = fopen(path, "rb");
    if (!f) return 0;
    char line[512] = "";
    int yes = fgets(line, sizeof line, f) && !strncmp(line, "model,tasks,quantizer,spec,policy,layer,depth,task,", 51);
    fclose(f);
    return yes;
}

/* The merge's state: the configurations in the order first seen, and per
 * configuration and task its row's values (filled once). */
struct kvq_task_merge {
    kvq_eval_row *rows;
    char **texts; /* the rows' strings, owned */
    int nitems, ntext;
    size_t ntasks;
    kvq_task_result *res; /* [ntasks][cap + 1] */
    unsigned char *seen;  /* [ntasks][cap] */
    double *depth;
    int cap;
    const char *run, *run_file; /* the first row's fingerprint and its file (the tables own them) */
    kvq_csv *tab; /* [nfiles] */
    int nfiles;
};
typedef kvq_task_merge task_merge;

static char *keep(task_merge *m, const char *s)
{
    char *d = strdup(s);
    char **t = d ? realloc(m->texts, (size_t)(m->ntext + 1) * sizeof *t) : NULL;
    if (!t) return free(d), NULL;
    m->texts = t, t[m->ntext++] = d;
    return d;
}

static int item_of(task_merge *m, const kvq_csv *t, size_t rec)
{
    const char *f[6];
    for (int c = 0; c < 6; c++) f[c] = kvq_csv_at(t, rec, c);
    for (int i = 0; i < m->nitems; i++) {
        const kvq_eval_row *r = &m->rows[i];
        if (!strcmp(r->model, f[0]) && !strcmp(r->quantizer, f[2]) && !strcmp(r->spec, f[3]) &&
            !strcmp(r->policy, f[4]) && !strcmp(r->layer, f[5]))
            return i;
    }
    return -1;
}

/* Shard k read (tab[k]) and checked: its header, its task count and run
 * fingerprint (the others'); its configurations added to m in the order
 * first seen. */
static kvq_status merge_scan_shard(task_merge *m, kvq_csv *tab, const char *file, kvq_error *err)
{
    kvq_status st = kvq_csv_read(file, tab, err);
    if (st) return st;
    int ok = tab->ncols == SHARD_NCOLS && tab->nrec >= 1 && !tab->torn;
    for (int c = 0; ok && c < SHARD_NCOLS; c++) ok = !strcmp(kvq_csv_at(tab, 0, c), SHARD_COLS[c]);
    if (!ok)
        return kvq_fail(err, KVQ_ERR_FORMAT, "%s: not a whole task shard of kvq-eval --tasks --shard (expected its "
                        "header and complete rows)", file);
    for (size_t rec = 1; rec < tab->nrec; rec++) {
        double n;
        if (kvq_csv_number(kvq_csv_at(tab, rec, 1), &n) || n < 1 || n > 1e9 || n != floor(n) ||
            (m->ntasks && (size_t)n != m->ntasks))
            return kvq_fail(err, KVQ_ERR_FORMAT, "%s: line %zu: tasks %s: expected the run's task count%s", file,
                            rec + 1, kvq_csv_at(tab, rec, 1), m->ntasks ? " (the shards disagree)" : "");
        m->ntasks = (size_t)n;
        const char *run = kvq_csv_at(tab, rec, S_RUN);
        if (!m->run) m->run = run, m->run_file = file;
        if (strcmp(run, m->run))
            return kvq_fail(err, KVQ_ERR_FORMAT, "%s: line %zu: of another run than %s (fingerprint %s, not %s: "
                            "another model, task file, --policy, --stride, --seed or --calib): not shards of one run",
                            file, rec + 1, m->run_file, run, m->run);
        if (item_of(m, tab, rec) >= 0) continue;
        kvq_eval_row *nr = realloc(m->rows, (size_t)(m->nitems + 1) * sizeof *nr), r = {0};
        if (!nr) return kvq_fail(err, KVQ_ERR_NOMEM, "out of memory");
        m->rows = nr;
        if (!(r.model = keep(m, kvq_csv_at(tab, rec, 0))) || !(r.quantizer = keep(m, kvq_csv_at(tab, rec, 2))) ||
            !(r.spec = keep(m, kvq_csv_at(tab, rec, 3))) || !(r.policy = keep(m, kvq_csv_at(tab, rec, 4))))
            return kvq_fail(err, KVQ_ERR_NOMEM, "out of memory");
        snprintf(r.layer, sizeof r.layer, "%s", kvq_csv_at(tab, rec, 5));
        m->rows[m->nitems++] = r;
    }
    return KVQ_OK;
}

/* Row rec of shard t into m's results: values a run can write, each task
 * and configuration once, the exact model's the same in every shard. */
static kvq_status merge_take_row(task_merge *m, const kvq_csv *t, size_t rec, const char *file, kvq_error *err)
{
    int i = item_of(m, t, rec), R = m->nitems + 1;
    double task, v[7], d = NAN;
    int bad = kvq_csv_number(kvq_csv_at(t, rec, S_TASK), &task) || task < 0 || task >= (double)m->ntasks ||
              task != floor(task);
    for (int c = 0; c < 7 && !bad; c++) bad = kvq_csv_number(kvq_csv_at(t, rec, S_NUM + c), &v[c]);
    const char *ds = kvq_csv_at(t, rec, 6);
    if (!bad && *ds) bad = kvq_csv_number(ds, &d) || !(d >= 0 && d <= 1);
    /* values a run cannot write: NLLs below 0, exact not 0/1, bits or elements below 0 */
    if (!bad) bad = !(v[0] >= 0) || !(v[1] >= 0) || (v[2] != 0 && v[2] != 1) || (v[3] != 0 && v[3] != 1) ||
                    v[4] < 0 || v[5] < 0 || v[6] < 0;
    if (bad)
        return kvq_fail(err, KVQ_ERR_FORMAT, "%s: line %zu: expected a task index below %zu, a depth in 0..1 or none, "
                        "NLLs >= 0, exact 0 or 1 and bits >= 0", file, rec + 1, m->ntasks);
    size_t ti = (size_t)task;
    if (m->seen[ti * R + 1 + i])
        return kvq_fail(err, KVQ_ERR_FORMAT, "%s: line %zu: task %zu of %s (%s) is in the shards twice", file, rec + 1,
                        ti, m->rows[i].spec, m->rows[i].policy);
    m->seen[ti * R + 1 + i] = 1;
    kvq_task_result *r0 = &m->res[ti * R], *ri = &m->res[ti * R + 1 + i];
    if (m->seen[ti * R] && (r0->nll != v[0] || r0->exact != (int)v[2] || (isnan(m->depth[ti]) != isnan(d)) ||
                            (!isnan(d) && m->depth[ti] != d)))
        return kvq_fail(err, KVQ_ERR_FORMAT, "%s: line %zu: task %zu's exact model differs from another shard's "
                        "(shards of other runs?)", file, rec + 1, ti);
    m->seen[ti * R] = 1, r0->nll = v[0], r0->exact = (int)v[2], m->depth[ti] = d;
    ri->nll = v[1], ri->exact = (int)v[3], ri->k_bits = v[4], ri->v_bits = v[5], ri->elements = v[6];
    return KVQ_OK;
}

/* Every shard's rows into m's results, then every task of every configuration present. */
static kvq_status merge_take_rows(task_merge *m, const kvq_csv *tab, const char *const *files, int nfiles,
                                  kvq_error *err)
{
    int R = m->nitems + 1;
    kvq_status rc = KVQ_OK;
    m->res = calloc(m->ntasks * (size_t)R, sizeof *m->res);
    m->seen = calloc(m->ntasks * (size_t)R, 1);
    m->depth = malloc(m->ntasks * sizeof *m->depth);
    if (!m->res || !m->seen || !m->depth) return kvq_fail(err, KVQ_ERR_NOMEM, "out of memory");
    for (size_t t = 0; t < m->ntasks; t++) m->depth[t] = NAN;
    for (int k = 0; k < nfiles; k++)
        for (size_t rec = 1; rec < tab[k].nrec && !rc; rec++) rc = merge_take_row(m, &tab[k], rec, files[k], err);
    for (size_t t = 0; t < m->ntasks && !rc; t++)
        for (int i = 0; i < m->nitems && !rc; i++)
            if (!m->seen[t * R + 1 + i])
                rc = kvq_fail(err, KVQ_ERR_FORMAT, "--merge: task %zu of %zu of %s (%s) is in none of the shards (a "
                              "shard missing?)", t, m->ntasks, m->rows[i].spec, m->rows[i].policy);
    return rc;
}

kvq_status kvq_task_merge_open(const char *const *files, int nfiles, kvq_task_merge **out, kvq_error *err)
{
    *out = NULL;
    task_merge *m = calloc(1, sizeof *m);
    if (!m || !(m->tab = calloc((size_t)(nfiles > 0 ? nfiles : 1), sizeof *m->tab)))
        return free(m), kvq_fail(err, KVQ_ERR_NOMEM, "out of memory");
    m->nfiles = nfiles;
    kvq_status st = KVQ_OK;
    for (int k = 0; k < nfiles && !st; k++) st = merge_scan_shard(m, &m->tab[k], files[k], err);
    if (!st && !m->ntasks) st = kvq_fail(err, KVQ_ERR_FORMAT, "--merge: the shards hold no task rows");
    if (!st) st = merge_take_rows(m, m->tab, files, nfiles, err);
    if (st) return kvq_task_merge_free(m), st;
    *out = m;
    return KVQ_OK;
}

size_t kvq_task_merge_tasks(const kvq_task_merge *m) { return m->ntasks; }

kvq_status kvq_task_merge_rows(const kvq_task_merge *m, FILE *f, kvq_format fmt, double per_depth)
{
    return kvq_task_rows(f, fmt, m->rows, m->nitems, m->res, m->depth, m->ntasks, per_depth);
}

void kvq_task_merge_free(kvq_task_merge *m)
{
    if (!m) return;
    for (int k = 0; m->tab && k < m->nfiles; k++) kvq_csv_free(&m->tab[k]);
    for (int i = 0; i < m->ntext; i++) free(m->texts[i]);
    free(m->tab), free(m->texts), free(m->rows), free(m->res), free(m->seen), free(m->depth), free(m);
}

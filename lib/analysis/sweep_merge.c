/* sweep_merge.c — kvq-sweep --merge's logic (docs/tools.md#sweeps): shard
 * outputs read whole and checked (a sweep's rows each, the same columns, no
 * interrupted row), their points put in index order (none twice, each with
 * as many rows as the first), --expect-grid's proof that they are the grid's
 * valid points exactly, and the merged bytes.  kvq-sweep keeps OUT (written
 * atomically), its record and the shards' records' cross-check. */
#include "../internal.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* One point's rows in one shard file. */
typedef struct {
    const kvq_sweep_file *f;
    const char *path;
    const kvq_sweep_unit *u;
} unit_ref;

struct kvq_sweep_merge {
    kvq_sweep_file *files; /* [nfiles] */
    int nfiles;
    unit_ref *units; /* [nunits], in point order */
    size_t nunits, rows;
};

static int cmp_unit(const void *a, const void *b)
{
    const unit_ref *x = a, *y = b;
    return x->u->point < y->u->point ? -1 : x->u->point > y->u->point;
}

/* The files, read and checked: a sweep's output each, whole, with the first's columns. */
static kvq_status merge_read(kvq_sweep_merge *m, const char *const *paths, kvq_error *err)
{
    kvq_sweep_file *f = m->files;
    for (int i = 0; i < m->nfiles; i++) {
        kvq_status st = kvq_sweep_file_read(paths[i], &f[i], err);
        if (st) return st;
        if (!f[i].columns) return kvq_fail(err, KVQ_ERR_FORMAT, "%s: empty: not a kvq-sweep output", paths[i]);
        if (f[i].partial)
            return kvq_fail(err, KVQ_ERR_FORMAT,
                            "%s: ends in a partial row: an interrupted shard (finish it with --resume)", paths[i]);
        if (f[i].fmt != f[0].fmt || strcmp(f[i].columns, f[0].columns))
            return kvq_fail(err, KVQ_ERR_FORMAT, "%s: columns differ from %s's (expected: %s)", paths[i], paths[0],
                            f[0].columns);
        m->nunits += f[i].nunits;
    }
    return KVQ_OK;
}

/* Every file's points in the order of their index: no point twice, each
 * with as many rows as the first. */
static kvq_status merge_order(kvq_sweep_merge *m, const char *const *paths, kvq_error *err)
{
    unit_ref *units = m->units;
    size_t n = 0;
    for (int i = 0; i < m->nfiles; i++)
        for (size_t k = 0; k < m->files[i].nunits; k++)
            units[n++] = (unit_ref){&m->files[i], paths[i], &m->files[i].units[k]};
    qsort(units, m->nunits, sizeof *units, cmp_unit); /* stable enough: equal points are an error */
    for (size_t k = 0; k < m->nunits; k++) {
        const kvq_sweep_unit *u = units[k].u;
        if (k && u->point == units[k - 1].u->point)
            return kvq_fail(err, KVQ_ERR_FORMAT, "point %ld (%s) is in %s and %s: duplicated", u->point, u->spec,
                            units[k - 1].path, units[k].path);
        if (u->nrows != units[0].u->nrows)
            return kvq_fail(err, KVQ_ERR_FORMAT,
                            "%s: point %ld (%s) has %zu rows, point %ld in %s has %zu: incomplete or from another "
                            "sweep", units[k].path, u->point, u->spec, u->nrows, units[0].u->point, units[0].path,
                            units[0].u->nrows);
        m->rows += u->nrows;
    }
    return KVQ_OK;
}

kvq_status kvq_sweep_merge_open(const char *const *paths, int nfiles, kvq_sweep_merge **out, kvq_error *err)
{
    *out = NULL;
    kvq_sweep_merge *m = calloc(1, sizeof *m);
    if (!m || !(m->files = calloc((size_t)(nfiles > 0 ? nfiles : 1), sizeof *m->files))) {
        free(m);
        return kvq_fail(err, KVQ_ERR_NOMEM, "out of memory");
    }
    m->nfiles = nfiles;
    kvq_status st = merge_read(m, paths, err);
    if (!st && !(m->units = calloc(m->nunits + 1, sizeof *m->units)))
        st = kvq_fail(err, KVQ_ERR_NOMEM, "out of memory");
    if (!st) st = merge_order(m, paths, err);
    if (st) {
        kvq_sweep_merge_free(m);
        return st;
    }
    *out = m;
    return KVQ_OK;
}

kvq_status kvq_sweep_merge_check_grid(const kvq_sweep_merge *m, const kvq_grid *g, size_t *ninvalid,
                                      kvq_error *err)
{
    kvq_error perr = {0};
    const unit_ref *units = m->units;
    size_t k = 0, missing = 0, invalid = 0;
    char list[256] = "";
    for (size_t p = 0; p < kvq_grid_size(g); p++) {
        kvq_spec sp;
        int valid = kvq_grid_spec(g, p, &sp, &perr) == KVQ_OK;
        int present = k < m->nunits && units[k].u->point == (long)p;
        if (present && (!valid || strcmp(units[k].u->spec, sp.text)))
            return kvq_fail(err, KVQ_ERR_FORMAT, "%s: point %zu is '%s'; the expected grid %s", units[k].path, p,
                            units[k].u->spec, valid ? "has another spec there" : "has no valid point there");
        if (!valid) invalid++;
        if (valid && !present) {
            size_t l = strlen(list);
            if (missing < 10) snprintf(list + l, sizeof list - l, "%s%zu", missing ? ", " : "", p);
            missing++;
        }
        k += present;
    }
    if (k < m->nunits)
        return kvq_fail(err, KVQ_ERR_FORMAT, "%s: point %ld is outside the expected grid of %zu points",
                        units[k].path, units[k].u->point, kvq_grid_size(g));
    if (missing)
        return kvq_fail(err, KVQ_ERR_FORMAT, "%zu points of the expected grid are missing: %s%s", missing, list,
                        missing > 10 ? ", ..." : "");
    *ninvalid = invalid;
    return KVQ_OK;
}

size_t kvq_sweep_merge_points(const kvq_sweep_merge *m) { return m->nunits; }
size_t kvq_sweep_merge_rows(const kvq_sweep_merge *m) { return m->rows; }
kvq_format kvq_sweep_merge_format(const kvq_sweep_merge *m) { return m->nfiles ? m->files[0].fmt : KVQ_FMT_CSV; }

kvq_status kvq_sweep_merge_write(const kvq_sweep_merge *m, FILE *f, kvq_error *err)
{
    if (m->nfiles && m->files[0].fmt == KVQ_FMT_CSV) fprintf(f, "%s\n", m->files[0].columns);
    for (size_t k = 0; k < m->nunits; k++) {
        size_t n = m->units[k].u->end - m->units[k].u->begin;
        if (fwrite(m->units[k].f->data + m->units[k].u->begin, 1, n, f) != n) {
            int e = errno; /* for the caller's message */
            kvq_fail(err, KVQ_ERR_IO, "writing the merged rows failed");
            errno = e;
            return KVQ_ERR_IO;
        }
    }
    return KVQ_OK;
}

void kvq_sweep_merge_free(kvq_sweep_merge *m)
{
    if (!m) return;
    for (int i = 0; m->files && i < m->nfiles; i++) kvq_sweep_file_free(&m->files[i]);
    free(m->files), free(m->units), free(m);
}

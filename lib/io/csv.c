/* csv.c — kvq's CSV results read back (docs/tools.md): the rows a tool
 * wrote, for --resume and --merge (kvq-eval shards, kvq-alloc's sensitivity
 * table).  RFC 4180 as kvq's writer writes it: fields separated by commas,
 * a field holding a comma, a quote or a newline in double quotes with its
 * quotes doubled; a record ends at a newline outside quotes.  A last record
 * without its newline (an interrupted write) is left out and said
 * (`torn`), so that the complete records can be kept; anything else that is
 * not such a table is an error naming the file and line. */
#include "../kvq.h"
#include "../internal.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int push_cell(kvq_csv *t, char *s, size_t *cap)
{
    if (t->ncells == *cap) {
        size_t nc = *cap ? 2 * *cap : 64;
        char **p = realloc(t->cell, nc * sizeof *p);
        if (!p) return -1;
        t->cell = p, *cap = nc;
    }
    t->cell[t->ncells++] = s;
    return 0;
}

kvq_status kvq_csv_parse(const char *path, const char *data, size_t size, kvq_csv *t, kvq_error *err)
{
    memset(t, 0, sizeof *t);
    size_t cap = 0, ecap = 0, i = 0, line = 1, rec_line = 1, row_cells = 0;
    char *field = malloc(size + 1); /* the field being read (never longer than the file) */
    if (!field) return kvq_fail(err, KVQ_ERR_NOMEM, "%s: out of memory", path);
    kvq_status st = KVQ_OK;
    while (i < size) { /* one record */
        size_t start = i;
        rec_line = line;
        row_cells = 0;
        int done = 0, ended = 0;
        while (!done) { /* one field */
            size_t n = 0;
            if (i < size && data[i] == '"') {
                size_t qline = line;
                for (i++;; i++) {
                    if (i >= size) { /* torn inside quotes: a write cut short, unless the field ran on for lines */
                        if (line > qline) {
                            st = kvq_fail(err, KVQ_ERR_FORMAT, "%s: line %zu: a quoted field that never ends", path,
                                          qline);
                            goto fail;
                        }
                        done = 1;
                        break;
                    }
                    if (data[i] == '"') {
                        if (i + 1 < size && data[i + 1] == '"') { field[n++] = '"', i++; continue; }
                        i++;
                        break;
                    }
                    if (data[i] == '\n') line++;
                    field[n++] = data[i];
                }
                if (!done && i < size && data[i] != ',' && data[i] != '\n') {
                    st = kvq_fail(err, KVQ_ERR_FORMAT, "%s: line %zu: text after a quoted field: expected a comma",
                                  path, line);
                    goto fail;
                }
            } else {
                for (; i < size && data[i] != ',' && data[i] != '\n'; i++) {
                    if (data[i] == '"') {
                        st = kvq_fail(err, KVQ_ERR_FORMAT, "%s: line %zu: a quote inside an unquoted field", path,
                                      line);
                        goto fail;
                    }
                    field[n++] = data[i];
                }
            }
            if (done || i >= size) { done = 1; break; } /* the file ends inside this record */
            field[n] = '\0';
            char *s = strdup(field);
            if (!s || push_cell(t, s, &cap)) {
                free(s);
                st = kvq_fail(err, KVQ_ERR_NOMEM, "%s: out of memory", path);
                goto fail;
            }
            row_cells++;
            if (data[i] == '\n') done = ended = 1, line++;
            i++;
        }
        if (!ended) { /* the last record has no newline: torn */
            t->ncells -= row_cells;
            for (size_t k = 0; k < row_cells; k++) free(t->cell[t->ncells + k]);
            t->torn = 1;
            break;
        }
        if (t->nrec == 0) t->ncols = (int)row_cells;
        else if ((int)row_cells != t->ncols) {
            st = kvq_fail(err, KVQ_ERR_FORMAT, "%s: line %zu: %zu fields: expected %d, as the header", path, rec_line,
                          row_cells, t->ncols);
            goto fail;
        }
        if (t->nrec == ecap) {
            size_t nc = ecap ? 2 * ecap : 64;
            size_t *p = realloc(t->end, nc * sizeof *p);
            if (!p) {
                st = kvq_fail(err, KVQ_ERR_NOMEM, "%s: out of memory", path);
                goto fail;
            }
            t->end = p, ecap = nc;
        }
        t->end[t->nrec++] = i;
        t->complete = i;
        (void)start;
    }
    free(field);
    return KVQ_OK;
fail:
    free(field);
    kvq_csv_free(t);
    return st;
}

kvq_status kvq_csv_read(const char *path, kvq_csv *t, kvq_error *err)
{
    memset(t, 0, sizeof *t);
    FILE *f = fopen(path, "rb");
    if (!f) return kvq_fail(err, KVQ_ERR_IO, "%s: cannot open: %s", path, strerror(errno));
    size_t cap = 1 << 16, n = 0;
    char *buf = malloc(cap);
    kvq_status st = KVQ_OK;
    for (size_t r; buf && (r = fread(buf + n, 1, cap - n, f)) > 0;) {
        n += r;
        if (n == cap) {
            char *nb = cap < ((size_t)1 << 40) ? realloc(buf, cap * 2) : NULL;
            if (!nb) { free(buf); buf = NULL; break; }
            buf = nb, cap *= 2;
        }
    }
    if (!buf) st = kvq_fail(err, KVQ_ERR_NOMEM, "%s: out of memory", path);
    else if (ferror(f)) st = kvq_fail(err, KVQ_ERR_IO, "%s: read failed: %s", path, strerror(errno));
    fclose(f);
    if (!st) st = kvq_csv_parse(path, buf, n, t, err);
    free(buf);
    return st;
}

void kvq_csv_free(kvq_csv *t)
{
    for (size_t i = 0; t->cell && i < t->ncells; i++) free(t->cell[i]);
    free(t->cell), free(t->end);
    memset(t, 0, sizeof *t);
}

const char *kvq_csv_at(const kvq_csv *t, size_t rec, int col)
{
    return rec < t->nrec && col >= 0 && col < t->ncols ? t->cell[rec * (size_t)t->ncols + (size_t)col] : NULL;
}

int kvq_csv_column(const kvq_csv *t, const char *name)
{
    for (int c = 0; t->nrec && c < t->ncols; c++)
        if (!strcmp(t->cell[c], name)) return c;
    return -1;
}

int kvq_csv_number(const char *s, double *v)
{
    char *end;
    if (!s || !*s || *s == ' ') return -1;
    *v = strtod(s, &end); /* ERANGE of a subnormal is fine: %.17g writes them */
    return *end || !isfinite(*v) ? -1 : 0;
}

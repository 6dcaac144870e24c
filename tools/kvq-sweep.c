/* kvq-sweep — one quantizer over a parameter grid (docs/tools.md), built to run
 * for hours: the dumps are read and each head's exact attention computed
 * once per run (kvq_prepare_dump), each finished point's rows are appended
 * to OUT and fsync'ed as one unit, --resume continues an interrupted OUT,
 * --shard I/N splits the grid over independent jobs and --merge joins them.
 *
 *   kvq-sweep DUMP... --quant NAME --grid key=v1,v2 [--grid ...] -o OUT.csv
 *   kvq-sweep --merge A.csv B.csv ... [--expect-grid --quant ... --grid ...] -o ALL.csv
 */
#include "cli.h"

#include <errno.h>
#include <inttypes.h>
#include <fcntl.h>
#include <getopt.h>
#include <libgen.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

static const char *prog = "kvq-sweep";

enum { OPT_CALIB = 256, OPT_FORMAT, OPT_RESUME, OPT_SHARD, OPT_MERGE, OPT_EXPECT, OPT_LIST, OPT_CACHE,
       OPT_PROGRESS };

enum { PROGRESS_NEVER, PROGRESS_LINES, PROGRESS_BAR };

typedef struct {
    const char **grids, **fixed;
    int ngrids, nfixed;
    const char *quant, *output, *calib, *format;
    cli_analysis an; /* --layers, --heads, --queries, --per, --threads, --seed */
    long cache_mb;
    cli_shard share; /* --shard I/N (default 0/1) */
    kvq_format fmt;  /* the format as it took effect, for the record */
    int resume, merge, expect_grid, list_points, progress;
    cli_meta *meta;
} opts_t;

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static void fmt_time(char *buf, size_t len, double s)
{
    long t = (long)(s + 0.5);
    if (t >= 3600) snprintf(buf, len, "%ld:%02ld:%02ld", t / 3600, t / 60 % 60, t % 60);
    else snprintf(buf, len, "%ld:%02ld", t / 60, t % 60);
}

static int push(const char ***v, int *n, const char *s)
{
    const char **nv = realloc(*v, (size_t)(*n + 1) * sizeof *nv);
    if (!nv) return -1;
    nv[(*n)++] = s;
    *v = nv;
    return 0;
}

/* fsync of the directory holding path, so a new file's name is durable too. */
static void sync_dir(const char *path)
{
    char *copy = strdup(path);
    if (!copy) return;
    int fd = open(dirname(copy), O_RDONLY | O_DIRECTORY);
    if (fd >= 0) fsync(fd), close(fd);
    free(copy);
}

/* ------------------------------------------------------------- progress */

typedef struct {
    int mode;
    size_t total, done;
    double t0;
} progress_t;

static void progress_point(progress_t *p, size_t point, const char *spec, double dt)
{
    p->done++;
    if (p->mode == PROGRESS_NEVER) return;
    double el = now() - p->t0, eta = p->done ? el / (double)p->done * (double)(p->total - p->done) : 0;
    char e1[32], e2[32];
    fmt_time(e1, sizeof e1, el);
    fmt_time(e2, sizeof e2, eta);
    if (p->mode == PROGRESS_LINES) {
        fprintf(stderr, "%s: [%zu/%zu] point %zu %s: %.2f s; elapsed %s, ETA %s\n", prog, p->done, p->total,
                point, spec, dt, e1, e2);
        return;
    }
    char bar[31];
    int fill = p->total ? (int)(30 * p->done / p->total) : 30;
    for (int i = 0; i < 30; i++) bar[i] = i < fill ? '#' : '.';
    bar[30] = '\0';
    fprintf(stderr, "\r%s [%s] %zu/%zu points  %s elapsed  ETA %s  %-40.40s", prog, bar, p->done, p->total,
            e1, e2, spec);
    if (p->done == p->total) fputc('\n', stderr);
    fflush(stderr);
}

/* The sweep's options in its provenance record (below the rows). */
static void meta_options(const opts_t *o, kvq_format fmt);

/* --------------------------------------------------------------- merge */

/* The last run's "run" and "shard" in a meta file's runs (cli_meta_read_runs),
 * "" where it has none (a file of an older kvq, --meta none). */
static void recorded_run(const char *runs, char run[17], char shard[48])
{
    run[0] = shard[0] = '\0';
    for (const char *p = runs; p && (p = strstr(p, "\"run\": \"")); p++)
        if (sscanf(p, "\"run\": \"%16[0-9a-f]\"", run) != 1) run[0] = '\0';
    for (const char *p = runs; p && (p = strstr(p, "\"shard\": \"")); p++)
        if (sscanf(p, "\"shard\": \"%47[0-9/]\"", shard) != 1) shard[0] = '\0';
}

/* What the shards' records say of their runs, checked as the files go by:
 * one run's fingerprint, each shard I of one N at most once. */
typedef struct merge_runs {
    char run0[17];
    int from0;   /* the file whose record gave run0 */
    long nshard; /* -1 until a record names its I/N */
    int *holder; /* [nshard]: 1 + the file holding shard I, 0 none */
} merge_runs;

/* File i's recorded run and shard (recorded_run) against the others'. */
static int merge_check_run(merge_runs *mr, char **files, int i, const char *run, const char *shard)
{
    long si, sn;
    if (!mr->run0[0]) snprintf(mr->run0, sizeof mr->run0, "%s", run), mr->from0 = i;
    if (strcmp(run, mr->run0))
        return cli_error(prog, "%s: of another run than %s (fingerprint %s, not %s: other dumps, --calib or analysis "
                         "options): not shards of one sweep", files[i], files[mr->from0], run, mr->run0), CLI_RUNTIME;
    if (!shard[0] || kvq_shard_parse(shard, &si, &sn)) return CLI_OK;
    if (mr->nshard < 0) {
        if (!(mr->holder = calloc((size_t)sn, sizeof *mr->holder))) return CLI_RUNTIME;
        mr->nshard = sn;
    }
    if (sn != mr->nshard)
        return cli_error(prog, "%s: shard %s of a sweep in %ld shards, %s's has %ld: not shards of one sweep",
                         files[i], shard, sn, files[mr->from0], mr->nshard), CLI_RUNTIME;
    if (mr->holder[si])
        return cli_error(prog, "shard %s is in %s and %s: duplicated", shard, files[mr->holder[si] - 1], files[i]),
               CLI_RUNTIME;
    mr->holder[si] = i + 1;
    return CLI_OK;
}

/* Provenance: the shards (and their runs, from their meta files), checked
 * to be shares of one sweep. */
static int merge_record_shards(const opts_t *o, char **files, int nfiles)
{
    merge_runs mr = {.nshard = -1};
    int rc = CLI_OK;
    cli_meta_operands(o->meta, files, nfiles);
    for (int i = 0; i < nfiles && !rc; i++) {
        char *mp = cli_meta_path(files[i]), *runs = NULL, run[17], shard[48];
        if (!mp) return free(mr.holder), cli_error(prog, "out of memory"), CLI_RUNTIME;
        cli_meta_input(o->meta, "shard", files[i]);
        rc = cli_meta_read_runs(prog, mp, &runs);
        if (!rc && !runs)
            fprintf(stderr, "%s: note: %s: no meta file; the merge records the shard's checksum only\n", prog,
                    files[i]);
        recorded_run(runs, run, shard);
        if (!rc && run[0]) rc = merge_check_run(&mr, files, i, run, shard);
        cli_meta_prior_runs(o->meta, runs);
        free(mp), free(runs);
    }
    free(mr.holder);
    return rc;
}

/* kvq-sweep --merge: the files' points in index order into OUT, checked
 * (kvq_sweep_merge_open and, with --expect-grid, _check_grid) and recorded. */
static int do_merge(const opts_t *o, char **files, int nfiles)
{
    int rc = CLI_RUNTIME;
    kvq_error err = {0};
    kvq_grid *grid = NULL;
    kvq_sweep_merge *m = NULL;
    size_t ninvalid = 0;
    cli_out out = {0};
    if ((o->expect_grid && kvq_grid_new(o->quant, o->grids, o->ngrids, o->fixed, o->nfixed, &grid, &err)) ||
        kvq_sweep_merge_open((const char *const *)files, nfiles, &m, &err) ||
        (grid && kvq_sweep_merge_check_grid(m, grid, &ninvalid, &err))) {
        rc = cli_fail(prog, &err);
        goto done;
    }
    size_t npoints = kvq_sweep_merge_points(m);
    if (grid)
        fprintf(stderr, "%s: the grid is complete: %zu valid points (%zu invalid ones skipped by design)\n", prog,
                npoints, ninvalid);
    if ((rc = merge_record_shards(o, files, nfiles))) goto done;
    meta_options(o, kvq_sweep_merge_format(m));
    if (cli_out_open(&out, o->output, prog) || cli_out_attach_meta(&out, o->meta, prog)) goto done;
    if (kvq_sweep_merge_write(m, out.f, &err)) {
        rc = cli_write_error(prog, o->output, err.status, errno);
        goto done;
    }
    if (cli_meta_commit(&out, prog)) goto done;
    rc = CLI_OK;
    fprintf(stderr, "%s: merged %zu points (%zu rows) from %d files into %s%s\n", prog, npoints,
            kvq_sweep_merge_rows(m), nfiles, o->output,
            grid ? "" : " (completeness not checked: add --expect-grid and the sweep's --quant/--grid/--fixed)");
done:
    if (out.f) cli_out_abort(&out);
    kvq_sweep_merge_free(m);
    kvq_grid_free(grid);
    return rc;
}

/* --------------------------------------------------------------- sweep */

/* Rows one point adds for one dump. */
static size_t rows_per_dump(const opts_t *o, const kvq_dump_info *info)
{
    size_t nl = o->an.layers ? (size_t)o->an.nlayers : (size_t)info->num_layers;
    size_t nh = o->an.heads ? (size_t)o->an.nheads : (size_t)info->num_kv_heads;
    return o->an.per == KVQ_PER_HEAD ? nl * nh : o->an.per == KVQ_PER_LAYER ? nl : 1;
}

/* An exclusive lock on OUT for the whole run (docs/tools.md): a second run on the
 * same OUT exits at once instead of tearing the file. */
static int lock_out(int fd, const char *path)
{
    if (flock(fd, LOCK_EX | LOCK_NB) == 0) return CLI_OK;
    if (errno == EWOULDBLOCK)
        cli_error(prog, "%s: another kvq-sweep run is writing it (it holds the lock); wait for it or choose another -o",
                  path);
    else
        cli_error(prog, "%s: cannot lock: %s", path, strerror(errno));
    return CLI_RUNTIME;
}

/* One run of a sweep: what do_sweep's steps share. */
typedef struct sweep_t {
    opts_t *o;
    char **paths; /* the DUMP operands */
    int ndumps;
    kvq_grid *grid;
    unsigned char *state; /* per point: KVQ_POINT_* */
    size_t npoints, nrun, ninvalid, ncomplete, expect_rows;
    kvq_sweep_dump *src;  /* [ndumps]: open, prepared or not, named */
    size_t *shared_bytes; /* [ndumps]: what kvq_prepare_dump would keep */
    kvq_calib *calib;
    kvq_analysis_opts ao;
    kvq_format fmt;
    char *header; /* the CSV columns, without the newline */
    size_t header_len;
    char *target; /* OUT with its symlinks followed: a link's target is what is written */
    int fd, exists;
    char run[17]; /* the run's fingerprint (sweep_fingerprint), recorded in OUT.meta.json */
} sweep_t;

/* The run's fingerprint: the dumps and the calibration dump (size, first
 * and last MiB) and the analysis options, which change every point's rows.
 * Not the grid: a point's rows name its spec, and --resume may widen the
 * grid (its points are reconciled by spec). */
static void sweep_fingerprint(sweep_t *sw)
{
    const opts_t *o = sw->o;
    uint64_t h = KVQ_FINGERPRINT_SEED;
    for (int i = 0; i < sw->ndumps; i++) h = kvq_fingerprint_file(h, sw->paths[i]);
    h = kvq_fingerprint_file(h, o->calib);
    long long v[] = {o->an.nlayers, o->an.nheads, (long long)o->an.queries.kind, o->an.queries.n, (long long)o->an.per,
                     (long long)o->an.seed, (long long)sw->fmt};
    h = kvq_fingerprint_bytes(h, v, sizeof v);
    if (o->an.layers) h = kvq_fingerprint_bytes(h, o->an.layers, (size_t)o->an.nlayers * sizeof *o->an.layers);
    if (o->an.heads) h = kvq_fingerprint_bytes(h, o->an.heads, (size_t)o->an.nheads * sizeof *o->an.heads);
    snprintf(sw->run, sizeof sw->run, "%016" PRIx64, h);
}


/* The grid and this shard's points: valid ones to run, invalid ones said
 * (once the sweep is sure to start) and skipped; --list-points prints them. */
static int select_points(sweep_t *sw)
{
    opts_t *o = sw->o;
    kvq_error err = {0};
    if (kvq_grid_new(o->quant, o->grids, o->ngrids, o->fixed, o->nfixed, &sw->grid, &err)) return cli_fail(prog, &err);
    sw->npoints = kvq_grid_size(sw->grid);
    if (!(sw->state = calloc(sw->npoints, 1))) return cli_error(prog, "out of memory"), CLI_RUNTIME;
    kvq_sweep_select(sw->grid, o->share.i, o->share.n, sw->state, &sw->nrun, &sw->ninvalid);
    kvq_spec needs_calib = {0}; /* the first point that needs a calibration dump */
    for (size_t p = 0; p < sw->npoints; p++) {
        kvq_spec sp;
        if (sw->state[p] == KVQ_POINT_OTHER) continue;
        if (kvq_grid_spec(sw->grid, p, &sp, &err)) {
            if (o->list_points) printf("%zu\t-\tinvalid: %s\n", p, err.msg);
            continue;
        }
        if (!needs_calib.q && kvq_spec_needs_calib(&sp)) needs_calib = sp;
        if (o->list_points) printf("%zu\t%s\tvalid\n", p, sp.text);
    }
    if (!o->list_points && needs_calib.q) return cli_check_calib(prog, &needs_calib, o->calib != NULL);
    return CLI_OK;
}

/* The device, the dumps (checked against --layers/--heads/--queries) and
 * the calibration dump, opened once. */
static int open_inputs(sweep_t *sw)
{
    opts_t *o = sw->o;
    kvq_error err = {0};
    int rc = cli_analysis_device(prog, &o->an);
    if (rc) return rc;
    sw->ao = (kvq_analysis_opts){.layers = o->an.layers, .nlayers = o->an.nlayers, .heads = o->an.heads,
                                 .nheads = o->an.nheads, .queries = o->an.queries, .seed = o->an.seed,
                                 .nthreads = (int)o->an.threads, .device = o->an.device};
    for (int i = 0; i < sw->ndumps; i++) {
        kvq_sweep_dump *s = &sw->src[i];
        if (kvq_dump_open(sw->paths[i], &s->dump, &err)) return cli_fail(prog, &err);
        char *copy = strdup(sw->paths[i]);
        char *name = copy ? strdup(basename(copy)) : NULL;
        free(copy);
        if (!(s->name = name)) return cli_error(prog, "out of memory"), CLI_RUNTIME;
        sw->expect_rows += rows_per_dump(o, kvq_dump_get_info(s->dump));
        if (kvq_prepare_bytes(s->dump, &sw->ao, kvq_grid_read_flags(sw->grid), &sw->shared_bytes[i], &err))
            return cli_fail(prog, &err);
    }
    if (o->calib && kvq_calib_open(o->calib, &sw->calib, &err)) return cli_fail(prog, &err);
    sw->ao.calib = sw->calib;
    return CLI_OK;
}

/* --resume's OUT: locked (before it is read: a second run on OUT must not
 * read what this one is about to truncate), its columns this sweep's, its
 * complete points kept and an interrupted one cut (*keep: the bytes kept). */
static int continue_out(sweep_t *sw, size_t *keep)
{
    opts_t *o = sw->o;
    kvq_error err = {0};
    kvq_sweep_file old = {0};
    int rc;
    if ((sw->fd = open(sw->target, O_WRONLY)) < 0)
        return cli_error(prog, "%s: cannot continue it: %s", o->output, strerror(errno)), CLI_RUNTIME;
    if ((rc = lock_out(sw->fd, o->output))) return rc;
    if (kvq_sweep_file_read(o->output, &old, &err)) return cli_fail(prog, &err);
    if (old.columns && (old.fmt != sw->fmt || strcmp(old.columns, sw->header))) {
        cli_error(prog, "%s: its columns are not this sweep's (%s %s expected: %s)", o->output,
                  old.fmt == KVQ_FMT_JSONL ? "JSON lines" : "CSV", old.fmt != sw->fmt ? "found," : "with", sw->header);
        rc = CLI_RUNTIME;
    } else if (kvq_sweep_reconcile(o->output, &old, sw->grid, sw->state, sw->expect_rows, keep, &sw->ncomplete,
                                   &err)) {
        rc = cli_fail(prog, &err);
    } else if (ftruncate(sw->fd, (off_t)*keep) != 0 || lseek(sw->fd, 0, SEEK_END) < 0) {
        cli_error(prog, "%s: cannot continue it: %s", o->output, strerror(errno));
        rc = CLI_RUNTIME;
    } else {
        sw->nrun -= sw->ncomplete;
        if (*keep < old.size)
            fprintf(stderr, "%s: %s: dropped %zu bytes of an interrupted point\n", prog, o->output, old.size - *keep);
    }
    kvq_sweep_file_free(&old);
    return rc;
}

/* A new OUT (where a symlink points), locked. */
static int create_out(sweep_t *sw)
{
    opts_t *o = sw->o;
    sw->fd = open(sw->target, O_WRONLY | O_CREAT | O_EXCL, 0666);
    if (sw->fd >= 0) return lock_out(sw->fd, o->output);
    if (strcmp(sw->target, o->output))
        cli_error(prog, "%s: cannot create %s, where the symlink points: %s", o->output, sw->target, strerror(errno));
    else cli_error(prog, "%s: cannot create: %s", o->output, strerror(errno));
    return CLI_RUNTIME;
}

/* OUT: created, or continued with --resume (its complete points kept, an
 * interrupted one cut); locked for the run; the CSV header written. */
static int open_out(sweep_t *sw)
{
    opts_t *o = sw->o;
    kvq_error err = {0};
    int rc, special;
    sw->fmt = cli_pick_format(o->format, o->output); /* csv or jsonl: --format takes no table, -o is given */
    if (kvq_sweep_header(sw->grid, &sw->header, &sw->header_len)) return cli_error(prog, "out of memory"), CLI_RUNTIME;
    if (kvq_output_target(o->output, &sw->target, &special, &err)) return cli_fail(prog, &err);
    struct stat stbuf;
    sw->exists = stat(sw->target, &stbuf) == 0;
    if (sw->exists && !o->resume) {
        cli_error(prog, "%s: exists; continue it with --resume, or choose another -o (nothing is overwritten)",
                  o->output);
        return CLI_RUNTIME;
    }
    if (sw->exists && !S_ISREG(stbuf.st_mode)) { /* a FIFO would block the read of --resume forever */
        cli_error(prog, "%s: not a regular file (a sweep's OUT is read back, truncated and appended to)", o->output);
        return CLI_RUNTIME;
    }
    size_t keep = 0;
    if ((rc = sw->exists ? continue_out(sw, &keep) : create_out(sw))) return rc;
    if (keep == 0 && sw->fmt == KVQ_FMT_CSV) {
        sw->header[sw->header_len] = '\n';
        int bad = cli_write_all(sw->fd, sw->header, sw->header_len + 1);
        sw->header[sw->header_len] = '\0';
        if (bad) return cli_error(prog, "%s: write failed: %s", o->output, strerror(errno)), CLI_RUNTIME;
    }
    if (fsync(sw->fd) != 0) return cli_error(prog, "%s: fsync failed: %s", o->output, strerror(errno)), CLI_RUNTIME;
    if (!sw->exists) sync_dir(sw->target);
    return CLI_OK;
}

/* Provenance: the runs before this one (--resume), then this one,
 * "running" until it ends. */
static int record_start(sweep_t *sw)
{
    opts_t *o = sw->o;
    char *mp = cli_meta_path(o->output), *runs = NULL;
    if (!mp) return cli_error(prog, "out of memory"), CLI_RUNTIME;
    int rc = sw->exists ? cli_meta_read_runs(prog, mp, &runs) : CLI_OK;
    free(mp);
    if (rc) return rc;
    char run[17], shard[48], want[48];
    recorded_run(runs, run, shard);
    snprintf(want, sizeof want, "%ld/%ld", o->share.i, o->share.n);
    if (run[0] && strcmp(run, sw->run)) {
        cli_error(prog, "%s: written by another run (fingerprint %s, this run's %s: other dumps, --calib or "
                  "analysis options); remove it or choose another -o", o->output, run, sw->run);
        free(runs);
        return CLI_RUNTIME;
    }
    if (shard[0] && strcmp(shard, want)) {
        cli_error(prog, "%s: shard %s's output, this run is shard %s; remove it or choose another -o", o->output, shard,
                  want);
        free(runs);
        return CLI_RUNTIME;
    }
    cli_meta_prior_runs(o->meta, runs);
    free(runs);
    cli_meta_operands(o->meta, sw->paths, sw->ndumps);
    for (int i = 0; i < sw->ndumps; i++) cli_meta_input(o->meta, "dump", sw->paths[i]);
    cli_meta_input(o->meta, "calib", o->calib);
    meta_options(o, sw->fmt);
    cli_meta_str(o->meta, "result", "status", "running");
    cli_meta_str(o->meta, "result", "run", sw->run);
    cli_meta_int(o->meta, "result", "points_before", (long long)sw->ncomplete);
    return cli_meta_write(o->meta, prog, o->output, NULL);
}

/* The shared work, once per run: dumps within --cache-mb stay prepared. */
static int prepare_dumps(sweep_t *sw)
{
    opts_t *o = sw->o;
    kvq_error err = {0};
    double used = 0;
    for (int i = 0; i < sw->ndumps && sw->nrun; i++) {
        size_t bytes = sw->shared_bytes[i];
        if (used + (double)bytes > (double)o->cache_mb * 1048576.0) {
            if (o->cache_mb > 0)
                fprintf(stderr, "%s: note: %s: its shared data (%.0f MiB) exceeds --cache-mb %ld: re-read per point\n",
                        prog, sw->paths[i], (double)bytes / 1048576.0, o->cache_mb - (long)(used / 1048576.0));
            continue;
        }
        if (kvq_prepare_dump(sw->src[i].dump, &sw->ao, kvq_grid_read_flags(sw->grid), &sw->src[i].prep, &err))
            return cli_fail(prog, &err);
        used += (double)bytes;
    }
    return CLI_OK;
}

/* Point p's rows (text, len; freed here) appended to OUT and made durable
 * as one unit; *written counts it. */
static int write_point(sweep_t *sw, progress_t *pr, size_t p, char *text, size_t len, double dt, size_t *written)
{
    int bad = cli_write_all(sw->fd, text, len) != 0 || fsync(sw->fd) != 0;
    free(text);
    if (bad) return cli_error(prog, "%s: write failed: %s", sw->o->output, strerror(errno)), CLI_RUNTIME;
    ++*written;
    cli_interrupt_count((long)(sw->ncomplete + *written));
    kvq_spec sp;
    kvq_error err = {0};
    kvq_grid_spec(sw->grid, p, &sp, &err); /* valid: checked when the points were selected */
    progress_point(pr, p, sp.text, dt);
    return CLI_OK;
}

/* The points to run, in order, each one's rows appended to OUT and made
 * durable as one unit; *written counts them.  With at least twice as many
 * threads as KV heads, kvq_sweep_batch points are analysed at once (the
 * same rows); a batch that fails is run again point by point, so that the
 * points before the failing one are written and the failure is that
 * point's. */
static int run_points(sweep_t *sw, size_t *written)
{
    opts_t *o = sw->o;
    kvq_error err = {0};
    progress_t pr = {.mode = o->progress, .total = sw->nrun, .t0 = now()};
    enum { BATCH_MAX = 64 };
    int batch = kvq_sweep_batch(sw->src, sw->ndumps, &sw->ao);
    if (batch > BATCH_MAX) batch = BATCH_MAX;
    size_t pts[BATCH_MAX], lens[BATCH_MAX];
    char *texts[BATCH_MAX];
    for (size_t p = 0; p < sw->npoints;) {
        int n = 0;
        for (; p < sw->npoints && n < batch; p++)
            if (sw->state[p] == KVQ_POINT_RUN) pts[n++] = p;
        /* the batch at once; else (one point, or a batch that failed) a point at a time */
        double t0 = now();
        int together = n > 1 && !kvq_sweep_points_rows(sw->grid, pts, n, sw->src, sw->ndumps, &sw->ao, o->an.per,
                                                       sw->fmt, texts, lens, &err);
        double share = (now() - t0) / (n ? n : 1);
        for (int i = 0; i < n; i++) {
            double tp = now();
            if (!together && kvq_sweep_point_rows(sw->grid, pts[i], sw->src, sw->ndumps, &sw->ao, o->an.per, sw->fmt,
                                                  &texts[i], &lens[i], &err))
                return cli_fail(prog, &err);
            int rc = write_point(sw, &pr, pts[i], texts[i], lens[i], together ? share : now() - tp, written);
            if (rc) {
                for (int k = i + 1; together && k < n; k++) free(texts[k]);
                return rc;
            }
        }
    }
    return CLI_OK;
}

/* A finished sweep: OUT closed, and its record with OUT's checksum. */
static int finish_sweep(sweep_t *sw, size_t written)
{
    opts_t *o = sw->o;
    char hex[65];
    int e, closed = close(sw->fd);
    sw->fd = -1;
    if (closed != 0) return cli_error(prog, "%s: write failed: %s", o->output, strerror(errno)), CLI_RUNTIME;
    if (cli_sha256_file(sw->target, hex, &e))
        return cli_error(prog, "%s: cannot read it back: %s", o->output, strerror(e)), CLI_RUNTIME;
    cli_meta_str(o->meta, "result", "status", "complete");
    cli_meta_int(o->meta, "result", "points_written", (long long)written);
    return cli_meta_write(o->meta, prog, o->output, hex);
}

/* What an interruption leaves (docs/tools.md), said from as soon as OUT is open. */
static void interrupt_note(const sweep_t *sw)
{
    char head[512], tail[256];
    snprintf(head, sizeof head, "%s: interrupted: %s keeps ", prog, sw->o->output);
    snprintf(tail, sizeof tail, " of %zu points complete; the same command with --resume continues\n",
             sw->ncomplete + sw->nrun);
    cli_interrupt_note(head, tail);
    cli_interrupt_count((long)sw->ncomplete);
}

/* The invalid points of the grid, named before the run. */
static void name_invalid_points(const sweep_t *sw)
{
    for (size_t p = 0; p < sw->npoints; p++) {
        kvq_spec sp;
        kvq_error err = {0};
        if (sw->state[p] == KVQ_POINT_INVALID && kvq_grid_spec(sw->grid, p, &sp, &err))
            fprintf(stderr, "%s: skipping invalid point %zu: %s\n", prog, p, err.msg);
    }
}

static int do_sweep(opts_t *o, char **dumps, int ndumps)
{
    sweep_t sw = {.o = o, .paths = dumps, .ndumps = ndumps, .fd = -1};
    int rc = CLI_OK, started = 0;
    size_t written = 0;
    sw.src = calloc((size_t)ndumps, sizeof *sw.src);
    sw.shared_bytes = calloc((size_t)ndumps, sizeof *sw.shared_bytes);
    if (!sw.src || !sw.shared_bytes) {
        cli_error(prog, "out of memory");
        rc = CLI_RUNTIME;
        goto done;
    }
    if ((rc = select_points(&sw)) || o->list_points || (rc = open_inputs(&sw)) || (rc = open_out(&sw))) goto done;
    interrupt_note(&sw);
    sweep_fingerprint(&sw);
    if ((rc = record_start(&sw))) goto done;
    started = 1;
    name_invalid_points(&sw);
    double t0 = now();
    if ((rc = prepare_dumps(&sw))) goto done;
    double prep_s = now() - t0;
    if ((rc = run_points(&sw, &written))) goto done;
    if ((rc = finish_sweep(&sw, written))) goto done;
    started = 0;
    double total = now() - t0;
    fprintf(stderr, "%s: %s: %zu points written, %zu already complete, %zu invalid skipped (shard %ld/%ld of %zu grid "
            "points); %.2f s: shared work %.2f s, %.3f s per point\n", prog, o->output, written, sw.ncomplete,
            sw.ninvalid, o->share.i, o->share.n, sw.npoints, total, prep_s,
            written ? (total - prep_s) / (double)written : 0.0);
done:
    if (started && rc) { /* a failed run says so in the record (an interrupted one stays "running") */
        cli_meta_str(o->meta, "result", "status", "failed");
        cli_meta_write(o->meta, prog, o->output, NULL);
    }
    if (sw.fd >= 0) close(sw.fd);
    free(sw.target), free(sw.header);
    for (int i = 0; i < ndumps && sw.src; i++)
        kvq_prepared_free(sw.src[i].prep), kvq_dump_close(sw.src[i].dump), free((char *)sw.src[i].name);
    free(sw.src), free(sw.shared_bytes), free(sw.state);
    kvq_calib_close(sw.calib);
    kvq_grid_free(sw.grid);
    return rc;
}

/* --grid and --fixed: repeatable. */
static int opt_grid(const char *p, const char *arg, void *at, void *base)
{
    opts_t *o = base;
    int grid = at == (void *)&o->grids;
    if (push(grid ? &o->grids : &o->fixed, grid ? &o->ngrids : &o->nfixed, arg))
        return cli_error(p, "out of memory"), CLI_RUNTIME;
    return CLI_OK;
}

static int opt_format(const char *p, const char *arg, void *at, void *base)
{
    (void)base;
    if (strcmp(arg, "csv") && strcmp(arg, "jsonl"))
        return cli_error(p, "--format %s: expected csv or jsonl", arg), CLI_USAGE;
    *(const char **)at = arg;
    return CLI_OK;
}

/* --progress: auto (-1), always (a bar) or never. */
static int opt_progress(const char *p, const char *arg, void *at, void *base)
{
    (void)base;
    int *mode = at;
    if (!strcmp(arg, "auto")) *mode = -1;
    else if (!strcmp(arg, "always")) *mode = PROGRESS_BAR;
    else if (!strcmp(arg, "never")) *mode = PROGRESS_NEVER;
    else return cli_error(p, "--progress %s: expected auto, always or never", arg), CLI_USAGE;
    return CLI_OK;
}

/* kvq-sweep's options, one row each (cli_optrow); --layers, --heads,
 * --queries, --per, --threads, --seed and --device are the analysis group's
 * (cli.h), --meta and --no-hash the record's.  The recorded rows go into
 * each run's provenance as they took effect (a --merge run's: the grid and
 * the merge's own options). */
#define ROW(nm, k, kind, field, ...) {.name = nm, .key = k, .arg = kind, .offset = offsetof(opts_t, field), __VA_ARGS__}
#define BOTH (CLI_RECORD | CLI_RECORD_ALT)
static const cli_optrow rows[] = {
    ROW("quant", 'q', CLI_ARG_TEXT, quant, .record = BOTH | CLI_RECORD_NULL, .metavar = "NAME",
        .help = "the quantizer (see kvq-analyze --list-quantizers), or a template tokens(SELECT; HI; LO) whose "
                "selector's keys (keep, sinks, recent, obs, pool) --grid sweeps"),
    ROW("grid", 'g', CLI_ARG_CUSTOM, grids, .parse = opt_grid, .record = BOTH, .record_fn = cli_optrow_record_list,
        .aux_offset = offsetof(opts_t, ngrids), .metavar = "K=V1,V2",
        .help = "values of key K; repeatable.  Points run in the order of nested loops, the first --grid outermost"),
    ROW("fixed", 'f', CLI_ARG_CUSTOM, fixed, .parse = opt_grid, .record = BOTH, .record_fn = cli_optrow_record_list,
        .aux_offset = offsetof(opts_t, nfixed), .metavar = "K=V[,..]",
        .help = "keys held fixed at every point; repeatable"),
    ROW("output", 'o', CLI_ARG_TEXT, output, .metavar = "OUT",
        .help = "results file (required; must not exist without --resume); OUT.meta.json records each run's "
                "provenance"),
    ROW("resume", OPT_RESUME, CLI_ARG_FLAG, resume, .record = CLI_RECORD,
        .help = "continue OUT: keep its complete points, drop a trailing partial row, run the rest (a missing OUT "
                "starts afresh)"),
    ROW("shard", OPT_SHARD, CLI_ARG_CUSTOM, share, .parse = cli_optrow_shard, .record = CLI_RECORD,
        .record_fn = cli_optrow_record_shard, .metavar = "I/N",
        .help = "run only the points p with p mod N = I"),
    ROW("merge", OPT_MERGE, CLI_ARG_FLAG, merge, .record = CLI_RECORD_ALT,
        .help = "join the shard outputs FILE... into OUT, checking that the columns agree and that no point is "
                "duplicated"),
    ROW("expect-grid", OPT_EXPECT, CLI_ARG_FLAG, expect_grid, .record = CLI_RECORD_ALT,
        .help = "with --merge: prove that the --quant/--grid/--fixed grid is complete (every valid point present, "
                "nothing else)"),
    ROW("list-points", OPT_LIST, CLI_ARG_FLAG, list_points,
        .help = "print the points (index, spec, valid or why not) and exit"),
    ROW("calib", OPT_CALIB, CLI_ARG_TEXT, calib, .record = CLI_RECORD | CLI_RECORD_NULL, .metavar = "FILE",
        .help = "calibration dump of the same model"),
    ROW("format", OPT_FORMAT, CLI_ARG_CUSTOM, format, .parse = opt_format, .record = CLI_RECORD,
        .record_fn = cli_optrow_record_format, .aux_offset = offsetof(opts_t, fmt), .metavar = "FMT",
        .help = "csv or jsonl (default: jsonl for *.jsonl names, else csv)"),
    ROW("cache-mb", OPT_CACHE, CLI_ARG_LONG, cache_mb, .min = 0, .max = 1L << 30, .record = CLI_RECORD,
        .expect = "a non-negative integer (MiB)", .metavar = "N",
        .help = "memory for the shared work kept across points (default 4096); a dump that does not fit is re-read "
                "per point"),
    ROW("progress", OPT_PROGRESS, CLI_ARG_CUSTOM, progress, .parse = opt_progress, .metavar = "WHEN",
        .help = "auto (default: a bar on a terminal, else one line per point), always (a bar) or never"),
};
#undef ROW
#undef BOTH
enum { NROWS = sizeof rows / sizeof rows[0] };

static void meta_options(const opts_t *o, kvq_format fmt)
{
    opts_t took = *o; /* with the format as it took effect */
    took.fmt = fmt;
    cli_optrows_record(o->meta, rows, NROWS, &took, o->merge);
    if (!o->merge) cli_meta_analysis(o->meta, &o->an);
}

static void usage(FILE *f)
{
    fprintf(f, "usage: kvq-sweep [options] DUMP... --quant NAME --grid key=v1,v2,... -o OUT\n"
               "       kvq-sweep --merge [--expect-grid --quant NAME --grid ...] FILE... -o OUT\n"
               "Run one quantizer over the cartesian product of parameter values; each point\n"
               "is one kvq-analyze run, its rows (plus one column per grid key and `point`)\n"
               "appended to OUT as soon as the point is done.\n\n");
    cli_optrows_usage(f, rows, NROWS);
    cli_optrows_usage(f, cli_analysis_rows, cli_analysis_nrows);
    fprintf(f, "      --device DEV      cpu (default) or cuda (as kvq-analyze)\n"
               "      --no-hash         record the inputs' size and mtime, not their SHA-256\n"
               CLI_HELP_VERSION_HELP "\n"
               "Example: kvq-sweep data/stories260K.h5 --quant kivi --grid group=32,64,128 \\\n"
               "           --grid residual=32,64,128 --grid bits=2,3,4 -o kivi-sweep.csv\n");
}

/* --merge's options: what a merge takes, and its FILE... operands. */
static int check_merge(const opts_t *o, int noperands)
{
    if (o->resume || o->list_points || o->share.n != 1)
        return cli_error(prog, "--merge joins finished outputs: --resume, --shard and --list-points do not apply"),
               CLI_USAGE;
    if (!o->expect_grid && (o->quant || o->ngrids || o->nfixed))
        return cli_error(prog, "--merge with --quant/--grid/--fixed: add --expect-grid to check the merge against "
                         "that grid"), CLI_USAGE;
    if (o->expect_grid && !o->quant)
        return cli_error(prog, "--expect-grid needs the sweep's --quant (and --grid/--fixed)"), CLI_USAGE;
    if (!noperands) return cli_error(prog, "--merge: no input files given (see --help)"), CLI_USAGE;
    if (!o->output) return cli_error(prog, "--merge needs -o OUT"), CLI_USAGE;
    return CLI_OK;
}

/* A sweep's options: the quantizer, OUT and the dumps. */
static int check_sweep(const opts_t *o, int noperands)
{
    if (o->expect_grid) return cli_error(prog, "--expect-grid applies to --merge only"), CLI_USAGE;
    if (!o->quant) return cli_error(prog, "no --quant NAME given (see --help)"), CLI_USAGE;
    if (!o->list_points && !o->output)
        return cli_error(prog, "no -o OUT given: a sweep writes its rows to a file (see --help)"), CLI_USAGE;
    if (!o->list_points && !noperands)
        return cli_error(prog, "no dump given (usage: kvq-sweep [options] DUMP... --quant NAME --grid ... -o OUT)"),
               CLI_USAGE;
    return CLI_OK;
}

/* The options into o, checked; *stop after --help or --version. */
static int parse_options(int argc, char **argv, opts_t *o, int *stop)
{
    const cli_getopt_ctx go = {.prog = prog, .usage = usage, .analysis = &o->an, .meta = o->meta};
    int rc = cli_optrows_getopt(&go, rows, NROWS, ":q:g:f:o:hV", argc, argv, o, stop);
    if (rc || *stop) return rc;
    if (o->progress < 0) o->progress = isatty(STDERR_FILENO) ? PROGRESS_BAR : PROGRESS_LINES;
    if (cli_meta_inline(o->meta))
        return cli_error(prog, "--meta inline: a sweep's OUT is appended across runs and merged; its record is "
                         "OUT.meta.json"), CLI_USAGE;
    const char *in[] = {o->calib}; /* the dumps, the calibration dump, or the merged files may not be OUT
                                      (a --resume OUT is not an input) */
    if ((rc = cli_check_output(prog, o->output, in, 1)) ||
        (rc = cli_check_output(prog, o->output, (const char *const *)argv + optind, argc - optind)))
        return rc;
    return o->merge ? check_merge(o, argc - optind) : check_sweep(o, argc - optind);
}

static int run(int argc, char **argv, cli_meta *meta)
{
    opts_t o = {.share.n = 1, .cache_mb = 4096, .progress = -1, .meta = meta};
    cli_analysis_init(&o.an);
    int stop, rc = parse_options(argc, argv, &o, &stop);
    if (!rc && !stop)
        rc = o.merge ? do_merge(&o, argv + optind, argc - optind) : do_sweep(&o, argv + optind, argc - optind);
    free(o.grids), free(o.fixed);
    cli_analysis_free(&o.an);
    return rc;
}

int main(int argc, char **argv) { return cli_main(prog, argc, argv, CLI_MAIN_TUNE_MALLOC, run); }

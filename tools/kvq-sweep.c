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

static void usage(FILE *f)
{
    fprintf(f,
        "usage: kvq-sweep [options] DUMP... --quant NAME --grid key=v1,v2,... -o OUT\n"
        "       kvq-sweep --merge [--expect-grid --quant NAME --grid ...] FILE... -o OUT\n"
        "Run one quantizer over the cartesian product of parameter values; each point\n"
        "is one kvq-analyze run, its rows (plus one column per grid key and `point`)\n"
        "appended to OUT as soon as the point is done.\n\n"
        "  -q, --quant NAME      the quantizer (see kvq-analyze --list-quantizers), or a\n"
        "                        template tokens(SELECT; HI; LO) whose selector's keys\n"
        "                        (keep, sinks, recent, obs, pool) --grid sweeps\n"
        "  -g, --grid K=V1,V2    values of key K; repeatable.  Points run in the order\n"
        "                        of nested loops, the first --grid outermost\n"
        "  -f, --fixed K=V[,..]  keys held fixed at every point; repeatable\n"
        "  -o, --output OUT      results file (required; must not exist without --resume);\n"
        "                        OUT.meta.json records each run's provenance\n"
        "      --no-hash         record the inputs' size and mtime, not their SHA-256\n"
        "      --resume          continue OUT: keep its complete points, drop a trailing\n"
        "                        partial row, run the rest (a missing OUT starts afresh)\n"
        "      --shard I/N       run only the points p with p mod N = I\n"
        "      --merge           join the shard outputs FILE... into OUT, checking that the\n"
        "                        columns agree and that no point is duplicated\n"
        "      --expect-grid     with --merge: prove that the --quant/--grid/--fixed grid is\n"
        "                        complete (every valid point present, nothing else)\n"
        "      --list-points     print the points (index, spec, valid or why not) and exit\n"
        "      --calib FILE      calibration dump of the same model\n"
        "      --layers LIST     layers to analyse, e.g. 0-3,7 (default: all)\n"
        "      --heads LIST      KV heads to analyse (default: all)\n"
        "      --queries SEL     query rows: last:N (default last:64), all, every:N, random:N\n"
        "      --per WHAT        pool results per head, layer (default) or model\n"
        "      --format FMT      csv or jsonl (default: jsonl for *.jsonl names, else csv)\n"
        "      --threads N       worker threads (default: all cores)\n"
        "      --seed N          seed of the random streams (default 0)\n"
        "      --device DEV      cpu (default) or cuda (as kvq-analyze)\n"
        "      --cache-mb N      memory for the shared work kept across points (default\n"
        "                        4096); a dump that does not fit is re-read per point\n"
        "      --progress WHEN   auto (default: a bar on a terminal, else one line per\n"
        "                        point), always (a bar) or never\n"
        "  -h, --help            this help\n"
        "  -V, --version         print the version\n\n"
        "Example: kvq-sweep data/stories260K.h5 --quant kivi --grid group=32,64,128 \\\n"
        "           --grid residual=32,64,128 --grid bits=2,3,4 -o kivi-sweep.csv\n");
}

enum { OPT_CALIB = 256, OPT_FORMAT, OPT_RESUME, OPT_SHARD, OPT_MERGE, OPT_EXPECT, OPT_LIST, OPT_CACHE,
       OPT_PROGRESS };

enum { PROGRESS_NEVER, PROGRESS_LINES, PROGRESS_BAR };

typedef struct {
    const char **grids, **fixed;
    int ngrids, nfixed;
    const char *quant, *output, *calib, *format;
    cli_analysis an; /* --layers, --heads, --queries, --per, --threads, --seed */
    long shard_i, shard_n, cache_mb;
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

/* The sweep's options in its provenance record, with their effective values. */
static void meta_options(const opts_t *o, kvq_format fmt)
{
    cli_meta *m = o->meta;
    cli_meta_str(m, "options", "quant", o->quant);
    cli_meta_empty_list(m, "options", "grid");
    for (int i = 0; i < o->ngrids; i++) cli_meta_list(m, "options", "grid", o->grids[i]);
    cli_meta_empty_list(m, "options", "fixed");
    for (int i = 0; i < o->nfixed; i++) cli_meta_list(m, "options", "fixed", o->fixed[i]);
    if (o->merge) {
        cli_meta_bool(m, "options", "merge", 1);
        cli_meta_bool(m, "options", "expect-grid", o->expect_grid);
        return;
    }
    char shard[48];
    snprintf(shard, sizeof shard, "%ld/%ld", o->shard_i, o->shard_n);
    cli_meta_bool(m, "options", "resume", o->resume);
    cli_meta_str(m, "options", "shard", shard);
    cli_meta_str(m, "options", "calib", o->calib);
    cli_meta_analysis(m, &o->an);
    cli_meta_str(m, "options", "format", cli_format_name(fmt));
    cli_meta_int(m, "options", "cache-mb", o->cache_mb);
}

/* --------------------------------------------------------------- merge */

typedef struct {
    const kvq_sweep_file *f;
    const char *path;
    const kvq_sweep_unit *u;
} unit_ref;

static int cmp_unit(const void *a, const void *b)
{
    const unit_ref *x = a, *y = b;
    return x->u->point < y->u->point ? -1 : x->u->point > y->u->point;
}

static int do_merge(const opts_t *o, char **files, int nfiles)
{
    int rc = CLI_OK;
    kvq_error err = {0};
    kvq_grid *grid = NULL;
    kvq_sweep_file *f = calloc((size_t)nfiles, sizeof *f);
    unit_ref *units = NULL;
    size_t nunits = 0, rows = 0;
    cli_out out = {0};
    if (!f) { cli_error(prog, "out of memory"); return CLI_RUNTIME; }
    if (o->expect_grid &&
        kvq_grid_new(o->quant, o->grids, o->ngrids, o->fixed, o->nfixed, &grid, &err)) {
        rc = cli_fail(prog, &err);
        goto done;
    }
    for (int i = 0; i < nfiles; i++) {
        if (kvq_sweep_file_read(files[i], &f[i], &err)) { rc = cli_fail(prog, &err); goto done; }
        if (!f[i].columns) {
            cli_error(prog, "%s: empty: not a kvq-sweep output", files[i]);
            rc = CLI_RUNTIME;
            goto done;
        }
        if (f[i].partial) {
            cli_error(prog, "%s: ends in a partial row: an interrupted shard (finish it with --resume)", files[i]);
            rc = CLI_RUNTIME;
            goto done;
        }
        if (f[i].fmt != f[0].fmt || strcmp(f[i].columns, f[0].columns)) {
            cli_error(prog, "%s: columns differ from %s's (expected: %s)", files[i], files[0], f[0].columns);
            rc = CLI_RUNTIME;
            goto done;
        }
        nunits += f[i].nunits;
    }
    units = calloc(nunits + 1, sizeof *units);
    if (!units) { cli_error(prog, "out of memory"); rc = CLI_RUNTIME; goto done; }
    nunits = 0;
    for (int i = 0; i < nfiles; i++)
        for (size_t k = 0; k < f[i].nunits; k++) units[nunits++] = (unit_ref){&f[i], files[i], &f[i].units[k]};
    qsort(units, nunits, sizeof *units, cmp_unit); /* stable enough: equal points are an error */
    for (size_t k = 0; k < nunits; k++) {
        const kvq_sweep_unit *u = units[k].u;
        if (k && u->point == units[k - 1].u->point) {
            cli_error(prog, "point %ld (%s) is in %s and %s: duplicated", u->point, u->spec, units[k - 1].path,
                      units[k].path);
            rc = CLI_RUNTIME;
            goto done;
        }
        if (u->nrows != units[0].u->nrows) {
            cli_error(prog,
                      "%s: point %ld (%s) has %zu rows, point %ld in %s has %zu: incomplete or from another sweep",
                      units[k].path, u->point, u->spec, u->nrows, units[0].u->point, units[0].path, units[0].u->nrows);
            rc = CLI_RUNTIME;
            goto done;
        }
        rows += u->nrows;
    }
    if (grid) { /* every valid point exactly once, nothing else */
        size_t k = 0, missing = 0, invalid = 0;
        char list[256] = "";
        for (size_t p = 0; p < kvq_grid_size(grid); p++) {
            kvq_spec sp;
            int valid = kvq_grid_spec(grid, p, &sp, &err) == KVQ_OK;
            int present = k < nunits && units[k].u->point == (long)p;
            if (present && (!valid || strcmp(units[k].u->spec, sp.text))) {
                cli_error(prog, "%s: point %zu is '%s'; the expected grid %s", units[k].path, p, units[k].u->spec,
                          valid ? "has another spec there" : "has no valid point there");
                rc = CLI_RUNTIME;
                goto done;
            }
            if (!valid) invalid++;
            if (valid && !present) {
                size_t l = strlen(list);
                if (missing < 10) snprintf(list + l, sizeof list - l, "%s%zu", missing ? ", " : "", p);
                missing++;
            }
            k += present;
        }
        if (k < nunits) {
            cli_error(prog, "%s: point %ld is outside the expected grid of %zu points", units[k].path,
                      units[k].u->point, kvq_grid_size(grid));
            rc = CLI_RUNTIME;
            goto done;
        }
        if (missing) {
            cli_error(prog, "%zu points of the expected grid are missing: %s%s", missing, list,
                      missing > 10 ? ", ..." : "");
            rc = CLI_RUNTIME;
            goto done;
        }
        fprintf(stderr, "%s: the grid is complete: %zu valid points (%zu invalid ones skipped by design)\n", prog,
                nunits, invalid);
    }
    /* provenance: the shards (and their runs, from their meta files), then this merge */
    cli_meta_operands(o->meta, files, nfiles);
    for (int i = 0; i < nfiles; i++) {
        char *mp = cli_meta_path(files[i]), *runs = NULL;
        if (!mp) { cli_error(prog, "out of memory"); rc = CLI_RUNTIME; goto done; }
        cli_meta_input(o->meta, "shard", files[i]);
        int mrc = cli_meta_read_runs(prog, mp, &runs);
        if (!mrc && !runs) fprintf(stderr, "%s: note: %s: no meta file; the merge records the shard's checksum only\n",
                                   prog, files[i]);
        cli_meta_prior_runs(o->meta, runs);
        free(mp), free(runs);
        if (mrc) { rc = mrc; goto done; }
    }
    meta_options(o, f[0].fmt);
    if (cli_out_open(&out, o->output, prog) || cli_out_attach_meta(&out, o->meta, prog)) {
        rc = CLI_RUNTIME;
        goto done;
    }
    if (f[0].fmt == KVQ_FMT_CSV) fprintf(out.f, "%s\n", f[0].columns);
    for (size_t k = 0; k < nunits; k++)
        fwrite(units[k].f->data + units[k].u->begin, 1, units[k].u->end - units[k].u->begin, out.f);
    if (cli_out_commit(&out, prog)) { rc = CLI_RUNTIME; goto done; }
    fprintf(stderr, "%s: merged %zu points (%zu rows) from %d files into %s%s\n", prog, nunits, rows, nfiles, o->output,
            grid ? "" : " (completeness not checked: add --expect-grid and the sweep's --quant/--grid/--fixed)");
done:
    if (out.f) cli_out_abort(&out);
    for (int i = 0; i < nfiles; i++) kvq_sweep_file_free(&f[i]);
    free(f), free(units);
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

static int do_sweep(opts_t *o, char **dumps, int ndumps)
{
    int rc = CLI_OK, fd = -1, started = 0;
    char *target = NULL; /* OUT with its symlinks followed: a link's target is what is written */
    kvq_error err = {0};
    kvq_grid *grid = NULL;
    kvq_calib *calib = NULL;
    kvq_dump **d = calloc((size_t)ndumps, sizeof *d);
    kvq_prepared **prep = calloc((size_t)ndumps, sizeof *prep);
    char **base = calloc((size_t)ndumps, sizeof *base);
    size_t *shared_bytes = calloc((size_t)ndumps, sizeof *shared_bytes); /* what prepare would keep */
    unsigned char *state = NULL; /* per point: KVQ_POINT_* */
    const char **extra_cols = NULL, **extra = NULL;
    char *header = NULL, *unit = NULL;
    size_t header_len = 0, unit_len = 0;
    kvq_sweep_file old = {0};
    kvq_report *rep = NULL;
    FILE *ms = NULL;
    if (!d || !prep || !base || !shared_bytes) { cli_error(prog, "out of memory"); rc = CLI_RUNTIME; goto done; }

    if (kvq_grid_new(o->quant, o->grids, o->ngrids, o->fixed, o->nfixed, &grid, &err)) {
        rc = cli_fail(prog, &err);
        goto done;
    }
    size_t npoints = kvq_grid_size(grid), nrun = 0, ninvalid = 0, ncomplete = 0;
    int nk = kvq_grid_nkeys(grid);
    state = calloc(npoints, 1);
    extra_cols = calloc((size_t)nk + 1, sizeof *extra_cols);
    extra = calloc((size_t)nk + 1, sizeof *extra);
    if (!state || !extra_cols || !extra) { cli_error(prog, "out of memory"); rc = CLI_RUNTIME; goto done; }
    for (int k = 0; k < nk; k++) extra_cols[k] = kvq_grid_key(grid, k);
    extra_cols[nk] = "point";

    /* this shard's points: valid ones to run, invalid ones said (once the sweep is sure to start) and skipped */
    kvq_sweep_select(grid, o->shard_i, o->shard_n, state, &nrun, &ninvalid);
    kvq_spec needs_calib = {0}; /* the first point that needs a calibration dump */
    for (size_t p = 0; p < npoints; p++) {
        kvq_spec sp;
        if (state[p] == KVQ_POINT_OTHER) continue;
        if (kvq_grid_spec(grid, p, &sp, &err)) {
            if (o->list_points) printf("%zu\t-\tinvalid: %s\n", p, err.msg);
            continue;
        }
        if (!needs_calib.q && kvq_spec_needs_calib(&sp)) needs_calib = sp;
        if (o->list_points) printf("%zu\t%s\tvalid\n", p, sp.text);
    }
    if (o->list_points) goto done;
    if (needs_calib.q && (rc = cli_check_calib(prog, &needs_calib, o->calib != NULL))) goto done;

    /* the device, the dumps and the calibration dump, opened once */
    if ((rc = cli_analysis_device(prog, &o->an))) goto done;
    kvq_analysis_opts ao = {.layers = o->an.layers, .nlayers = o->an.nlayers, .heads = o->an.heads,
                            .nheads = o->an.nheads, .queries = o->an.queries, .seed = o->an.seed,
                            .nthreads = (int)o->an.threads, .device = o->an.device};
    size_t expect_rows = 0;
    for (int i = 0; i < ndumps; i++) {
        if (kvq_dump_open(dumps[i], &d[i], &err)) { rc = cli_fail(prog, &err); goto done; }
        char *copy = strdup(dumps[i]);
        if (!copy || !(base[i] = strdup(basename(copy)))) {
            free(copy);
            cli_error(prog, "out of memory");
            rc = CLI_RUNTIME;
            goto done;
        }
        free(copy);
        expect_rows += rows_per_dump(o, kvq_dump_get_info(d[i]));
        /* also checks --layers/--heads/--queries against the dump */
        if (kvq_prepare_bytes(d[i], &ao, kvq_grid_read_flags(grid), &shared_bytes[i], &err)) {
            rc = cli_fail(prog, &err);
            goto done;
        }
    }
    if (o->calib && kvq_calib_open(o->calib, &calib, &err)) { rc = cli_fail(prog, &err); goto done; }
    ao.calib = calib;

    /* the header this sweep writes */
    kvq_format fmt = cli_pick_format(o->format, o->output); /* csv or jsonl: --format takes no table, -o is given */
    if (!(ms = open_memstream(&header, &header_len)) || !(rep = kvq_report_new(ms, KVQ_FMT_CSV, extra_cols, nk + 1)) ||
        kvq_report_header(rep) || kvq_report_finish(rep) || fclose(ms)) {
        rep = NULL, ms = NULL;
        cli_error(prog, "out of memory");
        rc = CLI_RUNTIME;
        goto done;
    }
    rep = NULL, ms = NULL;
    header[--header_len] = '\0'; /* the columns, without the newline */

    /* OUT: created, or continued with --resume */
    int special;
    if (kvq_output_target(o->output, &target, &special, &err)) { rc = cli_fail(prog, &err); goto done; }
    struct stat stbuf;
    int exists = stat(target, &stbuf) == 0;
    if (exists && !o->resume) {
        cli_error(prog, "%s: exists; continue it with --resume, or choose another -o (nothing is overwritten)",
                  o->output);
        rc = CLI_RUNTIME;
        goto done;
    }
    if (exists && !S_ISREG(stbuf.st_mode)) { /* a FIFO would block the read of --resume forever */
        cli_error(prog, "%s: not a regular file (a sweep's OUT is read back, truncated and appended to)", o->output);
        rc = CLI_RUNTIME;
        goto done;
    }
    size_t keep = 0;
    if (exists) {
        /* the lock first: a second run on OUT must not read what this one is about to truncate */
        if ((fd = open(target, O_WRONLY)) < 0) {
            cli_error(prog, "%s: cannot continue it: %s", o->output, strerror(errno));
            rc = CLI_RUNTIME;
            goto done;
        }
        if ((rc = lock_out(fd, o->output))) goto done;
        if (kvq_sweep_file_read(o->output, &old, &err)) { rc = cli_fail(prog, &err); goto done; }
        if (old.columns && (old.fmt != fmt || strcmp(old.columns, header))) {
            cli_error(prog, "%s: its columns are not this sweep's (%s %s expected: %s)", o->output,
                      old.fmt == KVQ_FMT_JSONL ? "JSON lines" : "CSV", old.fmt != fmt ? "found," : "with", header);
            rc = CLI_RUNTIME;
            goto done;
        }
        if (kvq_sweep_reconcile(o->output, &old, grid, state, expect_rows, &keep, &ncomplete, &err)) {
            rc = cli_fail(prog, &err);
            goto done;
        }
        nrun -= ncomplete;
        if (ftruncate(fd, (off_t)keep) != 0 || lseek(fd, 0, SEEK_END) < 0) {
            cli_error(prog, "%s: cannot continue it: %s", o->output, strerror(errno));
            rc = CLI_RUNTIME;
            goto done;
        }
        if (keep < old.size)
            fprintf(stderr, "%s: %s: dropped %zu bytes of an interrupted point\n", prog, o->output, old.size - keep);
    } else {
        fd = open(target, O_WRONLY | O_CREAT | O_EXCL, 0666);
        if (fd < 0) {
            if (strcmp(target, o->output))
                cli_error(prog, "%s: cannot create %s, where the symlink points: %s", o->output, target,
                          strerror(errno));
            else
                cli_error(prog, "%s: cannot create: %s", o->output, strerror(errno));
            rc = CLI_RUNTIME;
            goto done;
        }
        if ((rc = lock_out(fd, o->output))) goto done;
    }
    if (keep == 0 && fmt == KVQ_FMT_CSV) {
        header[header_len] = '\n';
        int bad = cli_write_all(fd, header, header_len + 1);
        header[header_len] = '\0';
        if (bad) { cli_error(prog, "%s: write failed: %s", o->output, strerror(errno)); rc = CLI_RUNTIME; goto done; }
    }
    if (fsync(fd) != 0) {
        cli_error(prog, "%s: fsync failed: %s", o->output, strerror(errno));
        rc = CLI_RUNTIME;
        goto done;
    }
    if (!exists) sync_dir(target);
    {
        /* interrupted, the sweep says what OUT keeps and how to go on (docs/tools.md) */
        char head[512], tail[256];
        snprintf(head, sizeof head, "%s: interrupted: %s keeps ", prog, o->output);
        snprintf(tail, sizeof tail, " of %zu points complete; the same command with --resume continues\n",
                 ncomplete + nrun);
        cli_interrupt_note(head, tail);
        cli_interrupt_count((long)ncomplete);
    }

    { /* provenance: the runs before this one (--resume), then this one, "running" until it ends */
        char *mp = cli_meta_path(o->output), *runs = NULL;
        if (!mp) { cli_error(prog, "out of memory"); rc = CLI_RUNTIME; goto done; }
        int mrc = exists ? cli_meta_read_runs(prog, mp, &runs) : CLI_OK;
        free(mp);
        if (mrc) { rc = mrc; goto done; }
        cli_meta_prior_runs(o->meta, runs);
        free(runs);
        cli_meta_operands(o->meta, dumps, ndumps);
        for (int i = 0; i < ndumps; i++) cli_meta_input(o->meta, "dump", dumps[i]);
        cli_meta_input(o->meta, "calib", o->calib);
        meta_options(o, fmt);
        cli_meta_str(o->meta, "result", "status", "running");
        cli_meta_int(o->meta, "result", "points_before", (long long)ncomplete);
        if ((rc = cli_meta_write(o->meta, prog, o->output, NULL))) goto done;
        started = 1;
    }
    for (size_t p = 0; p < npoints; p++) {
        kvq_spec sp;
        if (state[p] == KVQ_POINT_INVALID && kvq_grid_spec(grid, p, &sp, &err))
            fprintf(stderr, "%s: skipping invalid point %zu: %s\n", prog, p, err.msg);
    }

    /* the shared work, once per run: dumps within --cache-mb stay prepared */
    double t0 = now(), used = 0;
    for (int i = 0; i < ndumps && nrun; i++) {
        size_t bytes = shared_bytes[i];
        if (used + (double)bytes > (double)o->cache_mb * 1048576.0) {
            if (o->cache_mb > 0)
                fprintf(stderr, "%s: note: %s: its shared data (%.0f MiB) exceeds --cache-mb %ld: re-read per point\n",
                        prog, dumps[i], (double)bytes / 1048576.0, o->cache_mb - (long)(used / 1048576.0));
            continue;
        }
        if (kvq_prepare_dump(d[i], &ao, kvq_grid_read_flags(grid), &prep[i], &err)) {
            rc = cli_fail(prog, &err);
            goto done;
        }
        used += (double)bytes;
    }

    progress_t pr = {.mode = o->progress, .total = nrun, .t0 = now()};
    size_t written = 0;
    double prep_s = pr.t0 - t0;
    for (size_t p = 0; p < npoints; p++) {
        if (state[p] != KVQ_POINT_RUN) continue;
        double tp = now();
        kvq_spec sp;
        char pt[32];
        kvq_grid_spec(grid, p, &sp, &err); /* valid: checked above */
        for (int k = 0; k < nk; k++) extra[k] = kvq_grid_value(grid, p, k);
        snprintf(pt, sizeof pt, "%zu", p);
        extra[nk] = pt;
        ao.specs = &sp, ao.nspecs = 1;
        free(unit), unit = NULL;
        if (!(ms = open_memstream(&unit, &unit_len)) || !(rep = kvq_report_new(ms, fmt, extra_cols, nk + 1))) {
            cli_error(prog, "out of memory");
            rc = CLI_RUNTIME;
            goto done;
        }
        kvq_report_omit_header(rep);
        for (int i = 0; i < ndumps; i++) {
            kvq_analysis a;
            kvq_status st =
                prep[i] ? kvq_analyze_prepared(prep[i], &ao, &a, &err) : kvq_analyze_dump(d[i], &ao, &a, &err);
            if (st) { rc = cli_fail(prog, &err); goto done; }
            st = kvq_report_analysis(rep, base[i], &a, &sp, o->an.per, extra);
            kvq_analysis_free(&a);
            if (st) { cli_error(prog, "%s: %s", o->output, kvq_strerror(st)); rc = CLI_RUNTIME; goto done; }
        }
        kvq_status st = kvq_report_finish(rep);
        rep = NULL;
        int closed = fclose(ms);
        ms = NULL;
        if (st || closed) { cli_error(prog, "out of memory"); rc = CLI_RUNTIME; goto done; }
        /* the point's rows as one unit: appended, then made durable */
        if (cli_write_all(fd, unit, unit_len) != 0 || fsync(fd) != 0) {
            cli_error(prog, "%s: write failed: %s", o->output, strerror(errno));
            rc = CLI_RUNTIME;
            goto done;
        }
        written++;
        cli_interrupt_count((long)(ncomplete + written));
        progress_point(&pr, p, sp.text, now() - tp);
    }
    if (close(fd) != 0) {
        fd = -1;
        cli_error(prog, "%s: write failed: %s", o->output, strerror(errno));
        rc = CLI_RUNTIME;
        goto done;
    }
    fd = -1;
    { /* the record of a finished run, with OUT's checksum */
        char hex[65];
        int e;
        if (cli_sha256_file(target, hex, &e)) {
            cli_error(prog, "%s: cannot read it back: %s", o->output, strerror(e));
            rc = CLI_RUNTIME;
            goto done;
        }
        cli_meta_str(o->meta, "result", "status", "complete");
        cli_meta_int(o->meta, "result", "points_written", (long long)written);
        if ((rc = cli_meta_write(o->meta, prog, o->output, hex))) goto done;
        started = 0;
    }
    double total = now() - t0;
    fprintf(stderr, "%s: %s: %zu points written, %zu already complete, %zu invalid skipped (shard %ld/%ld of %zu grid "
            "points); %.2f s: shared work %.2f s, %.3f s per point\n", prog, o->output, written, ncomplete, ninvalid,
            o->shard_i, o->shard_n, npoints, total, prep_s, written ? (total - prep_s) / (double)written : 0.0);
done:
    if (started && rc) { /* a failed run says so in the record (an interrupted one stays "running") */
        cli_meta_str(o->meta, "result", "status", "failed");
        cli_meta_write(o->meta, prog, o->output, NULL);
    }
    if (fd >= 0) close(fd);
    free(target);
    kvq_report_discard(rep);
    if (ms) fclose(ms);
    free(unit), free(header);
    kvq_sweep_file_free(&old);
    for (int i = 0; i < ndumps && d && prep && base; i++)
        kvq_prepared_free(prep[i]), kvq_dump_close(d[i]), free(base[i]);
    free(d), free(prep), free(base), free(shared_bytes), free(state), free(extra_cols), free(extra);
    kvq_calib_close(calib);
    kvq_grid_free(grid);
    return rc;
}

static int run(int argc, char **argv, cli_meta *meta)
{
    static const struct option longopts[] = {
        {"quant", required_argument, 0, 'q'}, {"grid", required_argument, 0, 'g'},
        {"fixed", required_argument, 0, 'f'}, {"output", required_argument, 0, 'o'},
        {"calib", required_argument, 0, OPT_CALIB}, CLI_ANALYSIS_LONGOPTS,
        {"format", required_argument, 0, OPT_FORMAT}, {"resume", no_argument, 0, OPT_RESUME},
        {"shard", required_argument, 0, OPT_SHARD}, {"merge", no_argument, 0, OPT_MERGE},
        {"expect-grid", no_argument, 0, OPT_EXPECT}, {"list-points", no_argument, 0, OPT_LIST},
        {"cache-mb", required_argument, 0, OPT_CACHE}, {"progress", required_argument, 0, OPT_PROGRESS},
        CLI_META_LONGOPTS,
        {"help", no_argument, 0, 'h'}, {"version", no_argument, 0, 'V'}, {0, 0, 0, 0}};

    opts_t o = {.shard_n = 1, .cache_mb = 4096, .progress = -1};
    int rc = CLI_OK, c;
    cli_analysis_init(&o.an);
    o.meta = meta;
    const cli_getopt_ctx go = {.prog = prog, .usage = usage, .analysis = &o.an, .model = NULL, .meta = o.meta};
    while ((c = cli_getopt(&go, argc, argv, ":q:g:f:o:hV", longopts, &rc)) != -1) {
        if (c == CLI_GETOPT_STOP) goto done;
        switch (c) {
        case 'q': o.quant = optarg; break;
        case 'g':
            if (push(&o.grids, &o.ngrids, optarg)) { cli_error(prog, "out of memory"); rc = CLI_RUNTIME; goto done; }
            break;
        case 'f':
            if (push(&o.fixed, &o.nfixed, optarg)) { cli_error(prog, "out of memory"); rc = CLI_RUNTIME; goto done; }
            break;
        case 'o': o.output = optarg; break;
        case OPT_CALIB: o.calib = optarg; break;
        case OPT_FORMAT:
            if (strcmp(optarg, "csv") && strcmp(optarg, "jsonl")) {
                cli_error(prog, "--format %s: expected csv or jsonl", optarg);
                rc = CLI_USAGE; goto done;
            }
            o.format = optarg;
            break;
        case OPT_RESUME: o.resume = 1; break;
        case OPT_SHARD:
            if (cli_parse_shard(optarg, &o.shard_i, &o.shard_n)) {
                cli_error(prog, "--shard %s: expected I/N with 0 <= I < N, e.g. 0/4", optarg);
                rc = CLI_USAGE; goto done;
            }
            break;
        case OPT_MERGE: o.merge = 1; break;
        case OPT_EXPECT: o.expect_grid = 1; break;
        case OPT_LIST: o.list_points = 1; break;
        case OPT_CACHE:
            if (cli_parse_long(optarg, 0, 1L << 30, &o.cache_mb)) {
                cli_error(prog, "--cache-mb %s: expected a non-negative integer (MiB)", optarg);
                rc = CLI_USAGE; goto done;
            }
            break;
        case OPT_PROGRESS:
            if (!strcmp(optarg, "auto")) o.progress = -1;
            else if (!strcmp(optarg, "always")) o.progress = PROGRESS_BAR;
            else if (!strcmp(optarg, "never")) o.progress = PROGRESS_NEVER;
            else {
                cli_error(prog, "--progress %s: expected auto, always or never", optarg);
                rc = CLI_USAGE;
                goto done;
            }
            break;
        }
    }
    if (o.progress < 0) o.progress = isatty(STDERR_FILENO) ? PROGRESS_BAR : PROGRESS_LINES;
    if (cli_meta_inline(o.meta)) {
        cli_error(prog, "--meta inline: a sweep's OUT is appended across runs and merged; its record is OUT.meta.json");
        rc = CLI_USAGE;
        goto done;
    }
    { /* the dumps, the calibration dump, or the merged files may not be OUT (a --resume OUT is not an input) */
        const char *in[] = {o.calib};
        if ((rc = cli_check_output(prog, o.output, in, 1)) ||
            (rc = cli_check_output(prog, o.output, (const char *const *)argv + optind, argc - optind)))
            goto done;
    }

    if (o.merge) {
        if (o.resume || o.list_points || o.shard_n != 1) {
            cli_error(prog, "--merge joins finished outputs: --resume, --shard and --list-points do not apply");
            rc = CLI_USAGE; goto done;
        }
        if (!o.expect_grid && (o.quant || o.ngrids || o.nfixed)) {
            cli_error(prog,
                      "--merge with --quant/--grid/--fixed: add --expect-grid to check the merge against that grid");
            rc = CLI_USAGE; goto done;
        }
        if (o.expect_grid && !o.quant) {
            cli_error(prog, "--expect-grid needs the sweep's --quant (and --grid/--fixed)");
            rc = CLI_USAGE;
            goto done;
        }
        if (optind >= argc) {
            cli_error(prog, "--merge: no input files given (see --help)");
            rc = CLI_USAGE;
            goto done;
        }
        if (!o.output) { cli_error(prog, "--merge needs -o OUT"); rc = CLI_USAGE; goto done; }
        rc = do_merge(&o, argv + optind, argc - optind);
        goto done;
    }
    if (o.expect_grid) { cli_error(prog, "--expect-grid applies to --merge only"); rc = CLI_USAGE; goto done; }
    if (!o.quant) { cli_error(prog, "no --quant NAME given (see --help)"); rc = CLI_USAGE; goto done; }
    if (!o.list_points && !o.output) {
        cli_error(prog, "no -o OUT given: a sweep writes its rows to a file (see --help)");
        rc = CLI_USAGE;
        goto done;
    }
    if (!o.list_points && optind >= argc) {
        cli_error(prog, "no dump given (usage: kvq-sweep [options] DUMP... --quant NAME --grid ... -o OUT)");
        rc = CLI_USAGE; goto done;
    }
    rc = do_sweep(&o, argv + optind, argc - optind);
done:
    free(o.grids), free(o.fixed);
    cli_analysis_free(&o.an);
    return rc;
}

int main(int argc, char **argv) { return cli_main(prog, argc, argv, CLI_MAIN_TUNE_MALLOC, run); }

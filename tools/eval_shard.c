/* eval_shard.c — kvq-eval's corpus runs across machines (docs/models.md#shards):
 * `--chunk N --shard I/S` appends each window's rows to OUT as it finishes
 * (locked, fsynced; --resume continues after the last whole window), and
 * `--merge` writes the shards' pooled rows as one run's, with the shards'
 * runs in its record.  What the rows hold, the check of a resumed OUT and
 * the merge itself are the library's (lib/model/eval_files.c); this file
 * keeps the files' locking and writing, the record and the messages. */
#include "eval_files.h"

#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

struct eval_shard {
    const char *prog;
    kvq_eval_shard_id id;
    int fd;
    long whole; /* whole windows in OUT (what an interrupted run keeps) */
};

/* A shard's OUT opened for writing and locked: new, or with resume an
 * existing regular file.  CLI_OK with s->fd, or the exit code after printing. */
static int shard_lock(eval_shard *s, int resume, int *exists)
{
    const char *prog = s->prog, *path = s->id.path;
    struct stat st;
    *exists = stat(path, &st) == 0;
    if (*exists && !resume)
        return cli_error(prog, "%s: exists; continue its windows with --resume, or choose another -o (nothing is "
                         "overwritten)", path), CLI_RUNTIME;
    if (*exists && !S_ISREG(st.st_mode))
        return cli_error(prog, "%s: not a regular file (a shard's OUT is read back, cut and appended to)", path),
               CLI_RUNTIME;
    if ((s->fd = open(path, O_WRONLY | O_CREAT | O_CLOEXEC, 0666)) < 0)
        return cli_error(prog, "%s: cannot write: %s", path, strerror(errno)), CLI_RUNTIME;
    if (!flock(s->fd, LOCK_EX | LOCK_NB)) return CLI_OK; /* before reading: another run may be about to cut it */
    if (errno == EWOULDBLOCK)
        cli_error(prog, "%s: another kvq-eval run is writing it (it holds the lock); wait for it or choose another -o",
                  path);
    else cli_error(prog, "%s: cannot lock: %s", path, strerror(errno));
    return CLI_RUNTIME;
}

/* OUT cut after its whole windows (keep bytes) and positioned there; a new one gets its header. */
static int shard_start(eval_shard *s, int exists, size_t keep)
{
    const char *path = s->id.path;
    int ncols;
    const char *const *cols = kvq_eval_columns(1, &ncols);
    if (exists && ftruncate(s->fd, (off_t)keep))
        return cli_error(s->prog, "%s: cannot cut its unfinished window: %s", path, strerror(errno)), CLI_RUNTIME;
    if (lseek(s->fd, (off_t)keep, SEEK_SET) < 0)
        return cli_error(s->prog, "%s: cannot seek: %s", path, strerror(errno)), CLI_RUNTIME;
    if (keep) return CLI_OK;
    if (cli_write_csv_header(s->prog, path, s->fd, cols, ncols, 6)) return CLI_RUNTIME;
    if (fsync(s->fd)) return cli_error(s->prog, "%s: write failed: %s", path, strerror(errno)), CLI_RUNTIME;
    return CLI_OK;
}

int eval_shard_open(const char *prog, const kvq_eval_shard_id *id, int resume, int w0, int w1, int *done,
                        eval_shard **out)
{
    *out = NULL, *done = 0;
    eval_shard *s = calloc(1, sizeof *s);
    if (!s) return cli_error(prog, "out of memory"), CLI_RUNTIME;
    *s = (eval_shard){.prog = prog, .id = *id, .fd = -1};
    kvq_csv t = {0};
    kvq_error err = {0};
    size_t keep = 0;
    int exists, rc = shard_lock(s, resume, &exists);
    if (!rc && exists && kvq_csv_read(id->path, &t, &err)) rc = cli_fail(prog, &err);
    if (!rc && t.nrec && kvq_eval_shard_resume(id, &t, w0, w1, done, &keep, &err)) rc = cli_fail(prog, &err);
    if (!rc) s->whole = *done, rc = shard_start(s, exists, keep);
    kvq_csv_free(&t);
    if (!rc) return *out = s, CLI_OK;
    if (s->fd >= 0) close(s->fd);
    free(s);
    return rc;
}

static kvq_status fail(kvq_error *err, kvq_status st, const char *path, int window, const char *why)
{
    err->status = st;
    snprintf(err->msg, sizeof err->msg, "%s: window %d: %s", path, window, why);
    return st;
}

kvq_status eval_shard_window(void *ud, int window, const kvq_eval_sums *ref, const kvq_eval_sums *sums,
                                 kvq_error *err)
{
    eval_shard *s = ud;
    char *buf = NULL;
    size_t len = 0;
    FILE *ms = open_memstream(&buf, &len);
    kvq_status st = ms ? kvq_eval_shard_rows(&s->id, window, ref, sums, ms) : KVQ_ERR_NOMEM;
    if (ms && fclose(ms) && !st) st = KVQ_ERR_NOMEM;
    if (st) {
        free(buf);
        return fail(err, st, s->id.path, window, "out of memory for its rows");
    }
    /* one write and an fsync a window: after a crash OUT holds whole windows and at most a torn one */
    if (cli_write_all(s->fd, buf, len) || fsync(s->fd)) {
        char why[256];
        snprintf(why, sizeof why, "write failed: %s", strerror(errno));
        free(buf);
        return fail(err, KVQ_ERR_IO, s->id.path, window, why);
    }
    free(buf);
    cli_interrupt_count(++s->whole);
    return KVQ_OK;
}

int eval_shard_close(eval_shard *s)
{
    if (!s) return CLI_OK;
    int rc = CLI_OK;
    if (close(s->fd)) {
        cli_error(s->prog, "%s: write failed: %s", s->id.path, strerror(errno));
        rc = CLI_RUNTIME;
    }
    free(s);
    return rc;
}

/* ----------------------------------------------------------------- merge */

/* Provenance: the shards (and their runs, from their meta files), then this merge. */
static int merge_provenance(const char *prog, char **files, int nfiles, long nwin, kvq_format fmt, cli_meta *meta)
{
    cli_meta_operands(meta, files, nfiles);
    for (int f = 0; f < nfiles; f++) {
        char *mp = cli_meta_path(files[f]), *runs = NULL;
        if (!mp) return cli_error(prog, "out of memory"), CLI_RUNTIME;
        cli_meta_input(meta, "shard", files[f]);
        int mrc = cli_meta_read_runs(prog, mp, &runs);
        if (!mrc && !runs)
            fprintf(stderr, "%s: note: %s: no meta file; the merge records the shard's checksum only\n", prog,
                    files[f]);
        cli_meta_prior_runs(meta, runs);
        free(mp), free(runs);
        if (mrc) return mrc;
    }
    cli_meta_int(meta, "result", "windows", nwin);
    return cli_meta_check_format(prog, meta, fmt);
}

int eval_merge(const char *prog, char **files, int nfiles, const char *output, kvq_format fmt, cli_meta *meta)
{
    kvq_eval_merge *m = NULL;
    kvq_report *rep = NULL;
    kvq_error err = {0};
    cli_out out = {0};
    int ncols, rc;
    const char *const *cols = kvq_eval_columns(0, &ncols);
    if (kvq_eval_merge_open((const char *const *)files, nfiles, &m, &err)) return cli_fail(prog, &err);
    if ((rc = merge_provenance(prog, files, nfiles, kvq_eval_merge_windows(m), fmt, meta))) goto done;
    rc = CLI_RUNTIME;
    if (cli_out_open(&out, output, prog) || cli_out_attach_meta(&out, meta, prog)) goto done;
    if (!(rep = kvq_rows_new(out.f, fmt, cols, ncols, 6))) {
        cli_error(prog, "out of memory");
        goto done;
    }
    errno = 0;
    kvq_status st = kvq_eval_merge_rows(m, rep);
    if (!st) errno = 0, st = kvq_report_finish(rep);
    else kvq_report_discard(rep);
    rep = NULL;
    if (st) {
        rc = cli_write_error(prog, output, st, errno);
        goto done;
    }
    rc = cli_meta_commit(&out, prog) ? CLI_RUNTIME : CLI_OK;
    if (!rc)
        fprintf(stderr, "%s: merged %ld windows of %d configurations from %d shards into %s\n", prog,
                kvq_eval_merge_windows(m), kvq_eval_merge_items(m), nfiles, output ? output : "stdout");
done:
    kvq_report_discard(rep);
    if (out.f) cli_out_abort(&out);
    kvq_eval_merge_free(m);
    return rc;
}

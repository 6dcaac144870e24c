/* eval_tasks.c — kvq-eval --tasks's output files (docs/models.md#retrieval-tasks):
 * a run's rows or a shard's (`--tasks F --shard I/N`: one row per task and
 * configuration) written to OUT, and `--merge` of such shards written as
 * one run's rows with the shards in its record.  The rows, the checks and
 * the pooling are the library's (lib/model/task_files.c). */
#include "eval_files.h"

#include <errno.h>

int eval_task_rows(const char *prog, cli_out *out, kvq_format fmt, const kvq_eval_row *rows, int nitems,
                  const kvq_task_result *res, const double *depth, size_t ntasks, double per_depth)
{
    errno = 0;
    kvq_status st = kvq_task_rows(out->f, fmt, rows, nitems, res, depth, ntasks, per_depth);
    return st ? cli_write_error(prog, out->path, st, errno) : CLI_OK;
}

int eval_task_shard_rows(const char *prog, cli_out *out, const kvq_eval_row *rows, int nitems,
                        const kvq_task_result *res, const double *depth, size_t t0, size_t t1, size_t ntasks,
                        const char *run)
{
    errno = 0;
    kvq_status st = kvq_task_shard_rows(out->f, rows, nitems, res, depth, t0, t1, ntasks, run);
    return st ? cli_write_error(prog, out->path, st, errno) : CLI_OK;
}

int eval_task_merge(const char *prog, char **files, int nfiles, const char *output, kvq_format fmt, double per_depth,
                   cli_meta *meta)
{
    kvq_task_merge *m = NULL;
    kvq_error err = {0};
    cli_out out = {0};
    if (kvq_task_merge_open((const char *const *)files, nfiles, &m, &err)) return cli_fail(prog, &err);
    cli_meta_int(meta, "result", "tasks", (long long)kvq_task_merge_tasks(m));
    for (int k = 0; k < nfiles; k++) cli_meta_input(meta, "shard", files[k]);
    int rc = CLI_RUNTIME;
    if (!cli_out_open(&out, output, prog) && !cli_out_attach_meta(&out, meta, prog)) {
        errno = 0;
        kvq_status st = kvq_task_merge_rows(m, out.f, fmt, per_depth);
        rc = st ? cli_write_error(prog, output, st, errno) : cli_meta_commit(&out, prog);
    }
    if (out.f) cli_out_abort(&out);
    kvq_task_merge_free(m);
    return rc;
}

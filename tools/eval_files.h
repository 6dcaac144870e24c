/* eval_files.h — kvq-eval's own output files, beside the shared helpers of
 * cli.h: --shard's OUT (eval_shard.c) and --tasks's rows (eval_tasks.c),
 * and --merge of either.  The rows' logic is libkvq's (lib/model/eval_files.c,
 * task_files.c); these keep OUT's locking, appending, fsync and record. */
#ifndef KVQ_EVAL_FILES_H
#define KVQ_EVAL_FILES_H

#include "cli.h"

/* kvq-eval --shard (docs/models.md#shards): OUT (id->path) created, or
 * with resume continued after its last whole window of this shard's
 * windows [w0, w1) (*done of them; kvq_eval_shard_resume), locked for the
 * run; eval_shard_window is the kvq_eval_opts.window_done that appends
 * a window's rows and fsyncs.  id's strings and rows outlive the shard. */
typedef struct eval_shard eval_shard;
int eval_shard_open(const char *prog, const kvq_eval_shard_id *id, int resume, int w0, int w1, int *done,
                        eval_shard **out);
kvq_status eval_shard_window(void *ud, int window, const kvq_eval_sums *ref, const kvq_eval_sums *sums,
                                 kvq_error *err);
int eval_shard_close(eval_shard *s);
/* kvq-eval --merge: the shards' windows pooled in window order into the
 * rows of one run (to output, atomically, with the shards' runs in its meta). */
int eval_merge(const char *prog, char **files, int nfiles, const char *output, kvq_format fmt, cli_meta *meta);

/* kvq-eval --tasks's rows (eval_tasks.c): per configuration a row over all
 * tasks and, with per_depth B > 0, one per depth bucket; a shard's rows
 * (one per task and configuration, tasks [t0, t1) of ntasks; res holds
 * only those); --merge of such shards into the rows of one run. */
int eval_task_rows(const char *prog, cli_out *out, kvq_format fmt, const kvq_eval_row *rows, int nitems,
                  const kvq_task_result *res, const double *depth, size_t ntasks, double per_depth);
int eval_task_shard_rows(const char *prog, cli_out *out, const kvq_eval_row *rows, int nitems,
                        const kvq_task_result *res, const double *depth, size_t t0, size_t t1, size_t ntasks,
                        const char *run);
int eval_task_merge(const char *prog, char **files, int nfiles, const char *output, kvq_format fmt, double per_depth,
                   cli_meta *meta);

#endif

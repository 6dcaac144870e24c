/* cli.h — what the kvq tools share: one-line errors, checked number and
 * list parsing, and output files written atomically (temporary + rename). */
#ifndef KVQ_CLI_H
#define KVQ_CLI_H

#include "kvq.h"

#include <stdint.h>
#include <stdio.h>

enum { CLI_OK = 0, CLI_RUNTIME = 1, CLI_USAGE = 2 };

/* Prints "PROG: error: ..." (one line) on stderr. */
void cli_error(const char *prog, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* Prints a library error and returns the matching exit code (2 usage, 1 else). */
int cli_fail(const char *prog, const kvq_error *err);

/* Whole-string decimal parsing with range checks (no sign for unsigned). */
int cli_parse_long(const char *s, long min, long max, long *out);
int cli_parse_u64(const char *s, uint64_t *out);
/* "0-3,7" -> malloc'ed list of ints (each 0..max); 0 on success. */
int cli_parse_list(const char *s, int max, int **out, int *n);

/* Output: stdout when path is NULL or "-", else a temporary file in the
 * same directory that cli_out_commit renames into place. */
typedef struct cli_out {
    FILE *f;
    char *path, *tmp;
} cli_out;
int cli_out_open(cli_out *o, const char *path, const char *prog);
int cli_out_commit(cli_out *o, const char *prog); /* flush, fsync, rename */
void cli_out_abort(cli_out *o);                   /* close and remove the temporary */

#endif

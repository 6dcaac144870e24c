/* kvq_output.h — result-file plumbing for kvq's own tools (tools/out.c) and
 * writers (io/output.c): not part of the public API, not installed. */
#ifndef KVQ_OUTPUT_H
#define KVQ_OUTPUT_H

#include "kvq_base.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Result files (every writer of kvq): *target (malloc'ed) is path with its
 * symlinks followed, so that a temporary + rename replaces the link's target;
 * *special = 1 when the target exists and is a FIFO or a device (written in
 * place, never replaced).  A directory or a symlink loop is KVQ_ERR_IO. */
kvq_status kvq_output_target(const char *path, char **target, int *special, kvq_error *err);
/* Creates "target.tmp.XXXXXX" (*tmp malloc'ed, *fd open) with the mode the
 * file keeps after the rename: an existing target's, else 0666 & ~umask.
 * Messages name path, the name the user gave. */
kvq_status kvq_output_temp(const char *path, const char *target, char **tmp, int *fd, kvq_error *err);

#ifdef __cplusplus
}
#endif
#endif

/* output.c — where a result file goes, for every writer in kvq (the tools'
 * tables, the dump writer): a symlink is followed to its target so that the
 * temporary + rename replaces the target, not the link; a FIFO or a device
 * is never replaced (the caller writes it directly); the temporary is
 * created with the mode the file will keep (an existing file's permissions,
 * else 0666 & ~umask, as open(2) gives a new file). */
#include "../internal.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

/* The path a symlink chain ends at (which may not exist yet); malloc'ed. */
static char *follow_links(const char *path)
{
    char *cur = strdup(path);
    for (int hops = 0; cur && hops < 40; hops++) {
        struct stat st;
        if (lstat(cur, &st) != 0 || !S_ISLNK(st.st_mode)) return cur;
        char link[PATH_MAX];
        ssize_t n = readlink(cur, link, sizeof link - 1);
        if (n < 0) return cur;
        link[n] = '\0';
        char *next;
        if (link[0] == '/') {
            next = strdup(link);
        } else { /* relative to the link's directory */
            const char *slash = strrchr(cur, '/');
            size_t dir = slash ? (size_t)(slash - cur + 1) : 0;
            next = malloc(dir + (size_t)n + 1);
            if (next) memcpy(next, cur, dir), memcpy(next + dir, link, (size_t)n + 1);
        }
        free(cur);
        cur = next;
    }
    return cur; /* a loop (or 40 links): still a link, the caller refuses it */
}

kvq_status kvq_output_target(const char *path, char **target, int *special, kvq_error *err)
{
    *special = 0;
    if (!(*target = follow_links(path))) return kvq_fail(err, KVQ_ERR_NOMEM, "%s: out of memory", path);
    struct stat st;
    if (lstat(*target, &st) == 0 && S_ISLNK(st.st_mode)) {
        free(*target), *target = NULL;
        return kvq_fail(err, KVQ_ERR_IO, "%s: cannot write the output: a symlink loop (or more than 40 links); "
                        "nothing written", path);
    }
    if (stat(*target, &st) == 0 && !S_ISREG(st.st_mode)) {
        if (S_ISDIR(st.st_mode)) {
            free(*target), *target = NULL;
            return kvq_fail(err, KVQ_ERR_IO, "%s: cannot write the output: it is a directory", path);
        }
        *special = 1; /* FIFO, device, socket: written in place, never replaced */
    }
    return KVQ_OK;
}

kvq_status kvq_output_temp(const char *path, const char *target, char **tmp, int *fd, kvq_error *err)
{
    size_t len = strlen(target) + 16;
    *fd = -1;
    if (!(*tmp = malloc(len))) return kvq_fail(err, KVQ_ERR_NOMEM, "%s: out of memory", path);
    snprintf(*tmp, len, "%s.tmp.XXXXXX", target);
    if ((*fd = mkstemp(*tmp)) < 0) {
        kvq_status st = strcmp(path, target)
                            ? kvq_fail(err, KVQ_ERR_IO, "%s: cannot create %s, where the symlink points: %s", path,
                                       target, strerror(errno))
                            : kvq_fail(err, KVQ_ERR_IO, "%s: cannot create output: %s", path, strerror(errno));
        free(*tmp), *tmp = NULL;
        return st;
    }
    /* the mode the file keeps after the rename: mkstemp made it 0600 */
    struct stat st;
    mode_t mode;
    if (stat(target, &st) == 0) {
        mode = st.st_mode & 07777;
    } else {
        mode_t mask = umask(0);
        umask(mask);
        mode = 0666 & ~mask;
    }
    if (fchmod(*fd, mode) != 0) {
        kvq_status st2 = kvq_fail(err, KVQ_ERR_IO, "%s: cannot set the mode of %s: %s", path, *tmp, strerror(errno));
        close(*fd), unlink(*tmp), free(*tmp);
        *fd = -1, *tmp = NULL;
        return st2;
    }
    return KVQ_OK;
}

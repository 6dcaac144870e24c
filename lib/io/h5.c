/* h5.c — what the dump reader and writer share about HDF5: its error stack
 * turned into one phrase, objects closed without losing it, and the library
 * set up once (no automatic printing, no shutdown at exit).  With
 * dump_read.c and dump_write.c, the only code of libkvq that includes
 * hdf5.h. */
#include "h5.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ------------------------------------------------------------ HDF5 errors */

/* Before any other HDF5 call: no automatic error printing, and no library
 * shutdown at exit — HDF5 1.10 crashes there closing a file whose close
 * already failed (a flush that hit ENOSPC); the OS reclaims all at exit. */
void kvq_h5_quiet(void)
{
    static int once;
    if (!once) H5dont_atexit(), once = 1;
    H5Eset_auto2(H5E_DEFAULT, NULL, NULL);
}

typedef struct {
    char desc[256];
    int found, sys_errno;
} h5_walk_data;

static herr_t h5_walk_cb(unsigned n, const H5E_error2_t *e, void *p)
{
    h5_walk_data *w = p;
    if (!e->desc || !e->desc[0]) return 0;
    /* upward walk: the first entry is the innermost (most specific) error */
    if (!w->found) {
        snprintf(w->desc, sizeof w->desc, "%s", e->desc);
        w->found = 1;
    }
    /* a failed system call: HDF5's file drivers write "..., errno = 28, ..." */
    const char *en = strstr(e->desc, "errno = ");
    if (en && !w->sys_errno) w->sys_errno = atoi(en + 8);
    (void)n;
    return 0;
}

/* What went wrong, from HDF5's error stack: the system error when a system
 * call failed (ENOSPC: "No space left on device"), else the innermost
 * message, else a generic phrase.  Every HDF5 API call clears the stack:
 * close objects with kvq_h5_close_id, which keeps it. */
const char *kvq_h5_detail(char *buf, size_t len)
{
    h5_walk_data w = {.found = 0};
    H5Ewalk2(H5E_DEFAULT, H5E_WALK_UPWARD, h5_walk_cb, &w);
    H5Eclear2(H5E_DEFAULT);
    if (w.sys_errno > 0)
        snprintf(buf, len, "%s", strerror(w.sys_errno));
    else
        snprintf(buf, len, "%s", w.found ? w.desc : "HDF5 call failed");
    return buf;
}

/* Closes any HDF5 object, keeping the error stack: every API call clears it
 * on entry, and the clean-up after a failure must not erase its reason. */
void kvq_h5_close_id(hid_t id)
{
    if (id < 0) return;
    hid_t saved = H5Eget_current_stack();
    switch (H5Iget_type(id)) {
    case H5I_FILE: H5Fclose(id); break;
    case H5I_GROUP: H5Gclose(id); break;
    case H5I_DATASET: H5Dclose(id); break;
    case H5I_ATTR: H5Aclose(id); break;
    case H5I_DATATYPE: H5Tclose(id); break;
    case H5I_DATASPACE: H5Sclose(id); break;
    default: break;
    }
    if (saved >= 0) H5Eset_current_stack(saved);
}

/* h5.h — io/'s HDF5 helpers (h5.c), for dump_read.c and dump_write.c only. */
#ifndef KVQ_IO_H5_H
#define KVQ_IO_H5_H

#include "../internal.h"

#include <hdf5.h>

#define KVQ_DUMP_FORMAT_TAG "kvq-dump/1"

/* Before any other HDF5 call: no automatic error printing, no shutdown at exit. */
void kvq_h5_quiet(void);
/* What went wrong, from HDF5's error stack (cleared): the system error when a
 * system call failed, else the innermost message, else a generic phrase. */
const char *kvq_h5_detail(char *buf, size_t len);
/* Closes any HDF5 object (id < 0: nothing), keeping the error stack. */
void kvq_h5_close_id(hid_t id);

#endif

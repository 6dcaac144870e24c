/* dump_read.c — the kvq-dump/1 reader (docs/dump-format.md), and the same
 * handle over layers held in memory (kvq_dump_from_memory: the bindings'
 * arrays, read through the one reader the driver knows).
 *
 * kvq_dump_open validates every attribute and the type and shape of every
 * dataset up front (metadata only, cheap), so a malformed file fails before
 * any work starts; kvq_dump_read_layer then reads one layer's tensors,
 * converts them to float32 and checks that every value is finite.
 * float16 datasets are read in their file type and converted here (F16C),
 * because HDF5's own half->float path is a slow soft conversion. */
#include "h5.h"

#include <errno.h>
#include <limits.h>
#include <math.h>
#include <omp.h>
#include <stdio.h>
#include <string.h>

struct kvq_dump {
    char *path;
    hid_t file;
    kvq_dump_info info;
    uint16_t *stage; /* float16 values on their way to float32, kept between reads */
    size_t stage_n;
    int *window;     /* [num_layers] each layer's sliding_window (0: none) */
    char *model;     /* the model attribute whole (info.model keeps its first 255 bytes) */
    const kvq_layer *mem; /* a dump in memory: its layers (borrowed), file -1 */
    float *mem_cos, *mem_sin; /* its RoPE tables [T][D/2] as a file holds them (float32), or NULL */
    int read_threads;         /* kvq_dump_set_read_threads: 1, or 0 for the default (2) */
};

/* ------------------------------------------------------------- attributes */

/* Reads a string attribute (fixed or variable length) of the root into buf
 * (cut to len) and, when full is given, whole into *full (malloc'ed). */
static kvq_status attr_string(const char *path, hid_t obj, const char *name, int required,
                              char *buf, size_t len, int *present, char **full, kvq_error *err)
{
    char det[256];
    kvq_status st = KVQ_OK;
    hid_t a = -1, t = -1, mt = -1, sp = -1;
    *present = 0;
    htri_t ex = H5Aexists(obj, name);
    if (ex < 0)
        return kvq_fail(err, KVQ_ERR_FORMAT, "%s: /%s: cannot query attribute: %s", path, name,
                        kvq_h5_detail(det, sizeof det));
    if (ex == 0) {
        if (required)
            return kvq_fail(err, KVQ_ERR_FORMAT, "%s: /%s: missing required attribute (expected a string)", path, name);
        return KVQ_OK;
    }
    if ((a = H5Aopen(obj, name, H5P_DEFAULT)) < 0 || (t = H5Aget_type(a)) < 0 ||
        (sp = H5Aget_space(a)) < 0) {
        st = kvq_fail(err, KVQ_ERR_FORMAT, "%s: /%s: cannot open attribute: %s", path, name,
                      kvq_h5_detail(det, sizeof det));
        goto out;
    }
    if (H5Tget_class(t) != H5T_STRING || H5Sget_simple_extent_npoints(sp) != 1) {
        st = kvq_fail(err, KVQ_ERR_FORMAT, "%s: /%s: expected a string attribute", path, name);
        goto out;
    }
    if (H5Tis_variable_str(t) > 0) {
        char *s = NULL;
        mt = H5Tcopy(H5T_C_S1);
        if (mt < 0 || H5Tset_size(mt, H5T_VARIABLE) < 0 || H5Tset_cset(mt, H5Tget_cset(t)) < 0 ||
            H5Aread(a, mt, &s) < 0) {
            st = kvq_fail(err, KVQ_ERR_FORMAT, "%s: /%s: cannot read string: %s", path, name,
                          kvq_h5_detail(det, sizeof det));
            goto out;
        }
        snprintf(buf, len, "%s", s ? s : "");
        if (full && !(*full = strdup(s ? s : ""))) st = kvq_fail(err, KVQ_ERR_NOMEM, "%s: /%s: out of memory", path, name);
        if (s) H5free_memory(s);
        if (st) goto out;
    } else {
        size_t sz = H5Tget_size(t);
        char *tmp = malloc(sz + 1);
        if (!tmp) { st = kvq_fail(err, KVQ_ERR_NOMEM, "%s: /%s: out of memory", path, name); goto out; }
        mt = H5Tcopy(H5T_C_S1);
        if (mt < 0 || H5Tset_size(mt, sz) < 0 || H5Tset_cset(mt, H5Tget_cset(t)) < 0 ||
            H5Tset_strpad(mt, H5Tget_strpad(t)) < 0 ||
            H5Aread(a, mt, tmp) < 0) {
            free(tmp);
            st = kvq_fail(err, KVQ_ERR_FORMAT, "%s: /%s: cannot read string: %s", path, name,
                          kvq_h5_detail(det, sizeof det));
            goto out;
        }
        tmp[sz] = '\0'; /* null-padded strings need not hold a terminator */
        size_t n = strlen(tmp);
        while (n > 0 && tmp[n - 1] == ' ') tmp[--n] = '\0'; /* space padding */
        snprintf(buf, len, "%s", tmp);
        if (full) *full = tmp;
        else free(tmp);
    }
    *present = 1;
out:
    kvq_h5_close_id(mt);
    kvq_h5_close_id(sp);
    kvq_h5_close_id(t);
    kvq_h5_close_id(a);
    return st;
}

/* Reads a numeric attribute as double; integer-only when `integer`. */
static kvq_status attr_number(const char *path, hid_t obj, const char *name, int required,
                              int integer, double *val, long long *ival, int *present,
                              kvq_error *err)
{
    char det[256];
    kvq_status st = KVQ_OK;
    hid_t a = -1, t = -1, sp = -1;
    const char *what = integer ? "an integer" : "a number";
    *present = 0;
    htri_t ex = H5Aexists(obj, name);
    if (ex < 0)
        return kvq_fail(err, KVQ_ERR_FORMAT, "%s: /%s: cannot query attribute: %s", path, name,
                        kvq_h5_detail(det, sizeof det));
    if (ex == 0) {
        if (required)
            return kvq_fail(err, KVQ_ERR_FORMAT, "%s: /%s: missing required attribute (expected %s)", path, name, what);
        return KVQ_OK;
    }
    if ((a = H5Aopen(obj, name, H5P_DEFAULT)) < 0 || (t = H5Aget_type(a)) < 0 ||
        (sp = H5Aget_space(a)) < 0) {
        st = kvq_fail(err, KVQ_ERR_FORMAT, "%s: /%s: cannot open attribute: %s", path, name,
                      kvq_h5_detail(det, sizeof det));
        goto out;
    }
    H5T_class_t cls = H5Tget_class(t);
    if (H5Sget_simple_extent_npoints(sp) != 1 ||
        !(cls == H5T_INTEGER || (!integer && cls == H5T_FLOAT))) {
        st = kvq_fail(err, KVQ_ERR_FORMAT, "%s: /%s: expected %s attribute", path, name, what);
        goto out;
    }
    if (cls == H5T_INTEGER) {
        long long v;
        if (H5Aread(a, H5T_NATIVE_LLONG, &v) < 0) {
            st = kvq_fail(err, KVQ_ERR_FORMAT, "%s: /%s: cannot read: %s", path, name, kvq_h5_detail(det, sizeof det));
            goto out;
        }
        if (ival) *ival = v;
        if (val) *val = (double)v;
    } else {
        double v;
        if (H5Aread(a, H5T_NATIVE_DOUBLE, &v) < 0) {
            st = kvq_fail(err, KVQ_ERR_FORMAT, "%s: /%s: cannot read: %s", path, name, kvq_h5_detail(det, sizeof det));
            goto out;
        }
        if (val) *val = v;
    }
    *present = 1;
out:
    kvq_h5_close_id(sp);
    kvq_h5_close_id(t);
    kvq_h5_close_id(a);
    return st;
}

static kvq_status attr_dim(const char *path, hid_t root, const char *name, int *out,
                           kvq_error *err)
{
    long long v = 0;
    int present;
    kvq_status st = attr_number(path, root, name, 1, 1, NULL, &v, &present, err);
    if (st) return st;
    if (v <= 0)
        return kvq_fail(err, KVQ_ERR_FORMAT, "%s: /%s: expected a positive integer, got %lld", path, name, v);
    if (v > INT_MAX)
        return kvq_fail(err, KVQ_ERR_FORMAT, "%s: /%s: expected at most %d, got %lld", path, name, INT_MAX, v);
    *out = (int)v;
    return KVQ_OK;
}

/* --------------------------------------------------------------- datasets */

/* Classifies a dataset's float type; KVQ_ERR_FORMAT for anything else. */
static kvq_status float_kind(const char *path, const char *obj, hid_t t, kvq_dtype *dt,
                             kvq_error *err)
{
    if (H5Tget_class(t) != H5T_FLOAT)
        return kvq_fail(err, KVQ_ERR_FORMAT, "%s: %s: expected a float16/32/64 dataset, got a non-float type", path,
                        obj);
    size_t sz = H5Tget_size(t);
    if (sz == 4) { *dt = KVQ_F32; return KVQ_OK; }
    if (sz == 8) { *dt = KVQ_F64; return KVQ_OK; }
    if (sz == 2) {
        size_t spos, epos, esize, mpos, msize;
        if (H5Tget_fields(t, &spos, &epos, &esize, &mpos, &msize) >= 0 && spos == 15 &&
            epos == 10 && esize == 5 && mpos == 0 && msize == 10 && H5Tget_ebias(t) == 15) {
            *dt = KVQ_F16;
            return KVQ_OK;
        }
        return kvq_fail(err, KVQ_ERR_FORMAT, "%s: %s: expected IEEE float16, got another 16-bit float layout", path,
                        obj);
    }
    return kvq_fail(err, KVQ_ERR_FORMAT, "%s: %s: expected a float16/32/64 dataset, got a %zu-byte float", path, obj,
                    sz);
}

/* Checks that `name` in group `g` is a float dataset of shape [d0][d1][d2]
 * (d2 == 0: two-dimensional [d0][d1]).  *present = 0 if it does not exist. */
static kvq_status check_dataset(const char *path, hid_t g, const char *gname, const char *name,
                                hsize_t d0, hsize_t d1, hsize_t d2, int *present, kvq_dtype *dt,
                                kvq_error *err)
{
    char obj[128], det[256];
    kvq_status st = KVQ_OK;
    hid_t ds = -1, t = -1, sp = -1;
    snprintf(obj, sizeof obj, "%s/%s", gname, name);
    *present = 0;
    htri_t ex = H5Lexists(g, name, H5P_DEFAULT);
    if (ex < 0)
        return kvq_fail(err, KVQ_ERR_FORMAT, "%s: %s: cannot query: %s", path, obj, kvq_h5_detail(det, sizeof det));
    if (ex == 0) return KVQ_OK;
    if ((ds = H5Dopen2(g, name, H5P_DEFAULT)) < 0) {
        st = kvq_fail(err, KVQ_ERR_FORMAT, "%s: %s: expected a dataset: %s", path, obj, kvq_h5_detail(det, sizeof det));
        goto out;
    }
    if ((t = H5Dget_type(ds)) < 0 || (sp = H5Dget_space(ds)) < 0) {
        st = kvq_fail(err, KVQ_ERR_FORMAT, "%s: %s: cannot read type/shape: %s", path, obj,
                      kvq_h5_detail(det, sizeof det));
        goto out;
    }
    if ((st = float_kind(path, obj, t, dt, err))) goto out;
    int rank = H5Sget_simple_extent_ndims(sp);
    hsize_t dims[H5S_MAX_RANK];
    int want = d2 ? 3 : 2;
    hsize_t exp[3] = {d0, d1, d2};
    int ok = rank == want;
    if (rank >= 0 && rank <= H5S_MAX_RANK) H5Sget_simple_extent_dims(sp, dims, NULL);
    for (int i = 0; ok && i < want; i++) ok = dims[i] == exp[i];
    if (!ok) {
        char got[128] = "a scalar";
        if (rank > 0 && rank <= H5S_MAX_RANK) {
            size_t o = 0;
            o += snprintf(got + o, sizeof got - o, "[");
            for (int i = 0; i < rank && o < sizeof got; i++)
                o += snprintf(got + o, sizeof got - o, "%s%llu", i ? "," : "", (unsigned long long)dims[i]);
            if (o < sizeof got) snprintf(got + o, sizeof got - o, "]");
        } else if (rank < 0) {
            snprintf(got, sizeof got, "an unreadable shape");
        }
        if (want == 3)
            st = kvq_fail(err, KVQ_ERR_FORMAT, "%s: %s: expected [%llu,%llu,%llu], got %s", path, obj,
                          (unsigned long long)d0, (unsigned long long)d1, (unsigned long long)d2, got);
        else
            st = kvq_fail(err, KVQ_ERR_FORMAT, "%s: %s: expected [%llu,%llu], got %s", path, obj,
                          (unsigned long long)d0, (unsigned long long)d1, got);
        goto out;
    }
    *present = 1;
out:
    kvq_h5_close_id(sp);
    kvq_h5_close_id(t);
    kvq_h5_close_id(ds);
    return st;
}

/* Reads dataset `obj` (absolute path, shape[0] × shape[1] × shape[2]) into
 * dst as float32 and checks every value is finite.  rows (ascending, unique,
 * < shape[1]) selects the rows of the middle axis to read: dst is then
 * [shape[0]][nrows][shape[2]] (a hyperslab: only those rows leave the file);
 * rows == NULL reads everything. */
/* d->stage with room for n halves (grown, never shrunk: the next layer's
 * read reuses it without fresh pages). */
static uint16_t *stage_room(kvq_dump *d, size_t n)
{
    if (n > d->stage_n) {
        free(d->stage);
        d->stage_n = 0;
        if (!(d->stage = kvq_alloc_array(n, sizeof *d->stage))) return NULL;
        d->stage_n = n;
    }
    return d->stage;
}

/* The non-finite value dst[i] (obj's [A][B][C] values, or with rows its
 * rows[0..nrows) of B) named by its index in obj. */
static kvq_status nonfinite_at(const char *path, const char *obj, const float *dst, size_t i, const int shape[3],
                               const int *rows, size_t nrows, kvq_error *err)
{
    size_t mid = rows ? nrows : (size_t)shape[1];
    size_t c = i % (size_t)shape[2], r = i / (size_t)shape[2];
    size_t b = r % mid, a = r / mid;
    return kvq_fail(err, KVQ_ERR_FORMAT, "%s: %s: expected finite float32 values, got %s at [%zu,%zu,%zu]", path, obj,
                    isnan(dst[i]) ? "nan" : signbit(dst[i]) ? "-inf" : "inf", a, rows ? (size_t)rows[b] : b, c);
}

/* The first non-finite value of dst, as nonfinite_at names it. */
static kvq_status check_finite(const char *path, const char *obj, const float *dst, const int shape[3],
                               const int *rows, size_t nrows, kvq_error *err)
{
    size_t mid = rows ? nrows : (size_t)shape[1], n = (size_t)shape[0] * mid * (size_t)shape[2];
    size_t i = kvq_first_nonfinite(dst, n);
    return i >= n ? KVQ_OK : nonfinite_at(path, obj, dst, i, shape, rows, nrows, err);
}

/* Values [lo, hi) of a float16 slab, out of the stage: byte order fixed,
 * the values in float32 at dst; returns the index in the slab of the first
 * non-finite one, or SIZE_MAX. */
static size_t convert_range(uint16_t *half, float *dst, size_t lo, size_t hi, int big_endian)
{
    if (big_endian)
        for (size_t i = lo; i < hi; i++) half[i] = (uint16_t)((half[i] >> 8) | (half[i] << 8));
    kvq_f16_to_f32_array(half + lo, dst + lo, hi - lo);
    size_t i = kvq_first_nonfinite(dst + lo, hi - lo);
    return i < hi - lo ? lo + i : SIZE_MAX;
}

/* Converts a slab of per values in pieces of CONVERT_PIECE that the team's
 * threads take in turn as they come free (the reader after its read), and
 * lowers *first to the index in the slab of its first non-finite value. */
enum { CONVERT_PIECE = 1 << 15 };
static void convert_pieces(uint16_t *half, float *dst, size_t per, int big_endian, size_t *next, size_t *first)
{
    size_t mine = SIZE_MAX;
    for (;;) {
        size_t lo = __atomic_fetch_add(next, CONVERT_PIECE, __ATOMIC_RELAXED);
        if (lo >= per) break;
        size_t i = convert_range(half, dst, lo, lo + CONVERT_PIECE < per ? lo + CONVERT_PIECE : per, big_endian);
        if (i < mine) mine = i;
    }
#pragma omp critical(kvq_convert_first)
    if (mine < *first) *first = mine;
}

/* obj's values from src, a tensor of a dump in memory, or their rows,
 * copied and checked as a file's. */
static kvq_status copy_floats(const kvq_dump *d, const char *obj, const float *src, float *dst, const int shape[3],
                              const int *rows, size_t nrows, kvq_error *err)
{
    size_t B = (size_t)shape[1], C = (size_t)shape[2];
    if (!rows) {
        memcpy(dst, src, (size_t)shape[0] * B * C * sizeof *dst);
    } else {
        for (size_t a = 0; a < (size_t)shape[0]; a++)
            for (size_t i = 0; i < nrows; i++)
                memcpy(dst + (a * nrows + i) * C, src + (a * B + (size_t)rows[i]) * C, C * sizeof *dst);
    }
    return check_finite(d->path, obj, dst, shape, rows, nrows, err);
}

static kvq_status read_floats(kvq_dump *d, const char *obj, float *dst, const int shape[3], const int *rows,
                              size_t nrows, kvq_error *err)
{
    const char *path = d->path;
    char det[256];
    kvq_status st = KVQ_OK;
    hid_t ds = -1, t = -1, fspace = H5S_ALL, mspace = H5S_ALL;
    size_t mid = rows ? nrows : (size_t)shape[1], n = (size_t)shape[0] * mid * (size_t)shape[2];
    if ((ds = H5Dopen2(d->file, obj, H5P_DEFAULT)) < 0 || (t = H5Dget_type(ds)) < 0) {
        st =
            kvq_fail(err, KVQ_ERR_FORMAT, "%s: %s: cannot open dataset: %s", path, obj, kvq_h5_detail(det, sizeof det));
        goto out;
    }
    if (rows) { /* one block per run of consecutive rows */
        hsize_t mdims[3] = {(hsize_t)shape[0], nrows, (hsize_t)shape[2]};
        herr_t h = (fspace = H5Dget_space(ds)) < 0 || (mspace = H5Screate_simple(3, mdims, NULL)) < 0 ? -1 : 0;
        for (size_t i = 0; i < nrows && h >= 0;) {
            size_t j = i + 1;
            while (j < nrows && rows[j] == rows[j - 1] + 1) j++;
            hsize_t start[3] = {0, (hsize_t)rows[i], 0}, count[3] = {(hsize_t)shape[0], j - i, (hsize_t)shape[2]};
            h = H5Sselect_hyperslab(fspace, i ? H5S_SELECT_OR : H5S_SELECT_SET, start, NULL, count, NULL);
            i = j;
        }
        if (h < 0) {
            st = kvq_fail(err, KVQ_ERR_IO, "%s: %s: cannot select %zu rows: %s", path, obj, nrows,
                          kvq_h5_detail(det, sizeof det));
            goto out;
        }
    }
    kvq_dtype dt;
    if ((st = float_kind(path, obj, t, &dt, err))) goto out;
    if (dt == KVQ_F16) {
        /* memory type = file type: HDF5 copies the bytes, no conversion.  A
         * whole tensor [A][B][C] comes one [B][C] slab at a time through two
         * stages of that size, so that no second copy of the tensor is
         * allocated: while the calling thread reads slab a (HDF5 only ever
         * from it), a second converts and checks slab a − 1 piece by piece,
         * faulting in its float32 pages, and the reader takes the pieces
         * left when its read is done.  A row selection (small) comes whole. */
        size_t slabs = rows || shape[0] <= 1 ? 1 : (size_t)shape[0], per = n / slabs, bad = SIZE_MAX;
        uint16_t *half = stage_room(d, per ? 2 * per : 1);
        if (!half) {
            st = kvq_fail(err, KVQ_ERR_NOMEM, "%s: %s: out of memory for %zu values", path, obj, per);
            goto out;
        }
        hsize_t sdims[3] = {1, (hsize_t)mid, (hsize_t)shape[2]};
        if (slabs > 1 && ((fspace = H5Dget_space(ds)) < 0 || (mspace = H5Screate_simple(3, sdims, NULL)) < 0)) {
            st = kvq_fail(err, KVQ_ERR_IO, "%s: %s: cannot select a slab: %s", path, obj,
                          kvq_h5_detail(det, sizeof det));
            goto out;
        }
        int be = H5Tget_order(t) == H5T_ORDER_BE,
            workers = slabs > 1 && omp_get_max_threads() > 1 && d->read_threads != 1 ? 2 : 1;
        for (size_t a = 0; a <= slabs; a++) { /* every slab read first: a read error comes before a value's */
            int failed = 0;
            size_t next = 0, first = SIZE_MAX; /* slab a − 1: its next piece, its first non-finite value */
#pragma omp parallel num_threads(workers)
            {
                if (omp_get_thread_num() == 0 && a < slabs) {
                    hsize_t start[3] = {a, 0, 0};
                    failed = (slabs > 1 && H5Sselect_hyperslab(fspace, H5S_SELECT_SET, start, NULL, sdims, NULL) < 0) ||
                             H5Dread(ds, t, mspace, fspace, H5P_DEFAULT, half + a % 2 * per) < 0;
                }
                if (a > 0) convert_pieces(half + (a - 1) % 2 * per, dst + (a - 1) * per, per, be, &next, &first);
            }
            if (first != SIZE_MAX && bad == SIZE_MAX) bad = (a - 1) * per + first;
            if (failed) {
                st = kvq_fail(err, KVQ_ERR_IO, "%s: %s: read failed (truncated or corrupt file?): %s", path, obj,
                              kvq_h5_detail(det, sizeof det));
                goto out;
            }
        }
        if (bad != SIZE_MAX) st = nonfinite_at(path, obj, dst, bad, shape, rows, nrows, err);
        goto out;
    } else if (H5Dread(ds, H5T_NATIVE_FLOAT, mspace, fspace, H5P_DEFAULT, dst) < 0) {
        st = kvq_fail(err, KVQ_ERR_IO, "%s: %s: read failed (truncated or corrupt file?): %s", path, obj,
                      kvq_h5_detail(det, sizeof det));
        goto out;
    }
    /* finite check; a float64 value beyond float32 range also lands here as inf */
    st = check_finite(path, obj, dst, shape, rows, nrows, err);
out:
    if (fspace != H5S_ALL) kvq_h5_close_id(fspace);
    if (mspace != H5S_ALL) kvq_h5_close_id(mspace);
    kvq_h5_close_id(t);
    kvq_h5_close_id(ds);
    return st;
}

/* ------------------------------------------------------------------- open */

static kvq_status validate_root(kvq_dump *d, kvq_error *err)
{
    const char *p = d->path;
    kvq_dump_info *in = &d->info;
    hid_t root = d->file;
    char tag[64];
    int present;
    kvq_status st;

    if ((st = attr_string(p, root, "kvq_format", 1, tag, sizeof tag, &present, NULL, err))) return st;
    if (strcmp(tag, KVQ_DUMP_FORMAT_TAG) != 0)
        return kvq_fail(err, KVQ_ERR_FORMAT, "%s: /kvq_format: expected \"%s\", got \"%s\"", p, KVQ_DUMP_FORMAT_TAG,
                        tag);
    if ((st = attr_string(p, root, "model", 1, in->model, sizeof in->model, &present, &d->model, err))) return st;
    if ((st = attr_dim(p, root, "num_layers", &in->num_layers, err)) ||
        (st = attr_dim(p, root, "num_heads", &in->num_heads, err)) ||
        (st = attr_dim(p, root, "num_kv_heads", &in->num_kv_heads, err)) ||
        (st = attr_dim(p, root, "head_dim", &in->head_dim, err)) ||
        (st = attr_dim(p, root, "seq_len", &in->seq_len, err)))
        return st;
    if (in->num_layers > 1000)
        return kvq_fail(err, KVQ_ERR_FORMAT, "%s: /num_layers: expected at most 1000 (layer_NNN names), got %d", p,
                        in->num_layers);
    if (in->num_heads % in->num_kv_heads != 0)
        return kvq_fail(err, KVQ_ERR_FORMAT, "%s: /num_heads: expected a multiple of num_kv_heads (%d), got %d", p,
                        in->num_kv_heads, in->num_heads);
    size_t bytes;
    if (!kvq_tensor_bytes((size_t)in->num_heads, (size_t)in->seq_len, (size_t)in->head_dim, &bytes))
        return kvq_fail(err, KVQ_ERR_NOMEM, "%s: /: tensor size %d x %d x %d overflows size_t", p, in->num_heads,
                        in->seq_len, in->head_dim);

    double theta = 0;
    if ((st = attr_number(p, root, "rope_theta", 0, 0, &theta, NULL, &in->has_rope_theta, err))) return st;
    if (in->has_rope_theta && !(isfinite(theta) && theta > 0))
        return kvq_fail(err, KVQ_ERR_FORMAT, "%s: /rope_theta: expected a positive finite number, got %g", p, theta);
    in->rope_theta = theta;

    char style[64];
    if ((st = attr_string(p, root, "rope_style", 0, style, sizeof style, &present, NULL, err))) return st;
    in->rope_style = KVQ_ROPE_UNSET;
    if (present) {
        if (!strcmp(style, "interleaved")) in->rope_style = KVQ_ROPE_INTERLEAVED;
        else if (!strcmp(style, "half")) in->rope_style = KVQ_ROPE_HALF;
        else
            return kvq_fail(err, KVQ_ERR_FORMAT, "%s: /rope_style: expected \"interleaved\" or \"half\", got \"%s\"", p,
                            style);
    }
    long long qp = 0;
    if ((st = attr_number(p, root, "query_prescaled", 0, 1, NULL, &qp, &present, err))) return st;
    if (qp != 0 && qp != 1)
        return kvq_fail(err, KVQ_ERR_FORMAT, "%s: /query_prescaled: expected 0 or 1, got %lld", p, qp);
    in->query_prescaled = (int)qp;

    /* optional explicit RoPE tables [T][D/2] */
    int has_cos = 0, has_sin = 0;
    kvq_dtype dt;
    if (in->head_dim % 2 == 0) {
        if ((st = check_dataset(p, root, "", "rope_cos", (hsize_t)in->seq_len, (hsize_t)in->head_dim / 2, 0, &has_cos,
                                &dt, err)) ||
            (st = check_dataset(p, root, "", "rope_sin", (hsize_t)in->seq_len, (hsize_t)in->head_dim / 2, 0, &has_sin,
                                &dt, err)))
            return st;
        if (has_cos != has_sin)
            return kvq_fail(err, KVQ_ERR_FORMAT, "%s: /%s: expected a dataset (/%s is present)", p,
                            has_cos ? "rope_sin" : "rope_cos", has_cos ? "rope_cos" : "rope_sin");
    }
    in->has_rope_table = has_cos && has_sin;

    /* the model's attention scale and logit soft-cap (docs/dump-format.md) */
    double v = 0;
    if ((st = attr_number(p, root, "attn_scale", 0, 0, &v, NULL, &present, err))) return st;
    if (present && !(isfinite(v) && v > 0))
        return kvq_fail(err, KVQ_ERR_FORMAT, "%s: /attn_scale: expected a positive finite number, got %g", p, v);
    in->attn_scale = present ? v : 0;
    v = 0;
    if ((st = attr_number(p, root, "attn_softcap", 0, 0, &v, NULL, &present, err))) return st;
    if (present && !(isfinite(v) && v >= 0))
        return kvq_fail(err, KVQ_ERR_FORMAT, "%s: /attn_softcap: expected a finite number >= 0 (0: none), got %g", p,
                        v);
    in->attn_softcap = v;
    return KVQ_OK;
}

static kvq_status validate_layers(kvq_dump *d, kvq_error *err)
{
    const char *p = d->path;
    kvq_dump_info *in = &d->info;
    hsize_t H = (hsize_t)in->num_kv_heads, Hq = (hsize_t)in->num_heads;
    hsize_t T = (hsize_t)in->seq_len, D = (hsize_t)in->head_dim;
    char det[256];
    if (!(d->window = calloc((size_t)in->num_layers, sizeof *d->window)))
        return kvq_fail(err, KVQ_ERR_NOMEM, "%s: out of memory", p);
    for (int l = 0; l < in->num_layers; l++) {
        char gname[32];
        snprintf(gname, sizeof gname, "/layer_%03d", l);
        htri_t ex = H5Lexists(d->file, gname + 1, H5P_DEFAULT);
        if (ex <= 0)
            return kvq_fail(err, KVQ_ERR_FORMAT, "%s: %s: missing group (num_layers is %d)", p, gname, in->num_layers);
        hid_t g = H5Gopen2(d->file, gname, H5P_DEFAULT);
        if (g < 0)
            return kvq_fail(err, KVQ_ERR_FORMAT, "%s: %s: expected a group: %s", p, gname,
                            kvq_h5_detail(det, sizeof det));
        int pk, pv, pq, pr;
        kvq_dtype dk = KVQ_F32, dv = KVQ_F32, dq = KVQ_F32, dr;
        kvq_status st;
        if ((st = check_dataset(p, g, gname, "key", H, T, D, &pk, &dk, err)) ||
            (st = check_dataset(p, g, gname, "value", H, T, D, &pv, &dv, err)) ||
            (st = check_dataset(p, g, gname, "query", Hq, T, D, &pq, &dq, err)) ||
            (st = check_dataset(p, g, gname, "key_pre_rope", H, T, D, &pr, &dr, err))) {
            H5Gclose(g);
            return st;
        }
        long long win = 0;
        int haswin;
        char wname[48];
        snprintf(wname, sizeof wname, "%s/sliding_window", gname + 1);
        if ((st = attr_number(p, g, "sliding_window", 0, 1, NULL, &win, &haswin, err))) {
            H5Gclose(g);
            return st;
        }
        H5Gclose(g);
        if (win < 0 || win > INT32_MAX)
            return kvq_fail(err, KVQ_ERR_FORMAT, "%s: /%s: expected a window of 0 (none) to 2^31-1 positions, got %lld",
                            p, wname, win);
        in->window_layers += win > 0;
        d->window[l] = (int)win;
        if (!pk)
            return kvq_fail(err, KVQ_ERR_FORMAT, "%s: %s/key: missing required dataset (expected [%d,%d,%d])", p, gname,
                            in->num_kv_heads, in->seq_len, in->head_dim);
        if (!pv)
            return kvq_fail(err, KVQ_ERR_FORMAT, "%s: %s/value: missing required dataset (expected [%d,%d,%d])", p,
                            gname, in->num_kv_heads, in->seq_len, in->head_dim);
        if (l == 0) {
            in->has_query = pq;
            in->has_key_pre_rope = pr;
            in->key_dtype = dk;
            in->value_dtype = dv;
            in->query_dtype = dq;
        } else if (pq != in->has_query || pr != in->has_key_pre_rope) {
            const char *what = pq != in->has_query ? "query" : "key_pre_rope";
            int has0 = pq != in->has_query ? in->has_query : in->has_key_pre_rope;
            return kvq_fail(err, KVQ_ERR_FORMAT, "%s: %s/%s: expected %s, as in /layer_000", p, gname, what,
                            has0 ? "a dataset" : "no dataset");
        }
    }
    return KVQ_OK;
}

kvq_status kvq_dump_open(const char *path, kvq_dump **out, kvq_error *err)
{
    char det[256];
    *out = NULL;
    FILE *f = fopen(path, "rb");
    if (!f) return kvq_fail(err, KVQ_ERR_IO, "%s: cannot open: %s", path, strerror(errno));
    fclose(f);
    kvq_h5_quiet();
    htri_t is = H5Fis_hdf5(path);
    if (is <= 0) {
        H5Eclear2(H5E_DEFAULT);
        return kvq_fail(err, KVQ_ERR_FORMAT, "%s: not an HDF5 file (expected a kvq-dump/1 HDF5 dump)", path);
    }
    kvq_dump *d = calloc(1, sizeof *d);
    if (!d || !(d->path = strdup(path))) {
        free(d);
        return kvq_fail(err, KVQ_ERR_NOMEM, "%s: out of memory", path);
    }
    d->file = H5Fopen(path, H5F_ACC_RDONLY, H5P_DEFAULT);
    if (d->file < 0) {
        kvq_status st = kvq_fail(err, KVQ_ERR_FORMAT, "%s: cannot open as HDF5 (truncated or corrupt file?): %s", path,
                                 kvq_h5_detail(det, sizeof det));
        free(d->path);
        free(d);
        return st;
    }
    kvq_status st = validate_root(d, err);
    if (!st) st = validate_layers(d, err);
    if (st) {
        kvq_dump_close(d);
        return st;
    }
    *out = d;
    return KVQ_OK;
}

/* The checks kvq_dump_open makes of a file, on m's layers and attributes. */
static kvq_status validate_memory(kvq_dump *d, const kvq_dump_mem *m, kvq_error *err)
{
    const char *p = d->path;
    kvq_dump_info *in = &d->info;
    if (!m->model || !*m->model) return kvq_fail(err, KVQ_ERR_FORMAT, "%s: /model: expected a non-empty string", p);
    if (!(d->model = strdup(m->model))) return kvq_fail(err, KVQ_ERR_NOMEM, "%s: out of memory", p);
    if (m->nlayers < 1 || m->nlayers > 1000 || !m->layers)
        return kvq_fail(err, KVQ_ERR_FORMAT, "%s: /num_layers: expected 1 to 1000 layers, got %d", p, m->nlayers);
    const kvq_layer *l0 = &m->layers[0];
    int Hq = l0->query ? l0->Hq : l0->H;
    size_t bytes;
    if (l0->H <= 0 || Hq <= 0 || l0->T <= 0 || l0->D <= 0)
        return kvq_fail(err, KVQ_ERR_FORMAT, "%s: /layer_000: expected H, Hq, T, D > 0, got %d, %d, %d, %d", p, l0->H,
                        Hq, l0->T, l0->D);
    if (Hq % l0->H)
        return kvq_fail(err, KVQ_ERR_FORMAT, "%s: /num_heads: expected a multiple of num_kv_heads (%d), got %d", p,
                        l0->H, Hq);
    if (!kvq_tensor_bytes((size_t)Hq, (size_t)l0->T, (size_t)l0->D, &bytes))
        return kvq_fail(err, KVQ_ERR_NOMEM, "%s: /: tensor size %d x %d x %d overflows size_t", p, Hq, l0->T, l0->D);
    *in = (kvq_dump_info){.num_layers = m->nlayers, .num_heads = Hq, .num_kv_heads = l0->H, .head_dim = l0->D,
                          .seq_len = l0->T, .has_query = l0->query != NULL, .has_key_pre_rope = l0->key_pre_rope != NULL,
                          .key_dtype = KVQ_F32, .value_dtype = KVQ_F32, .query_dtype = KVQ_F32};
    snprintf(in->model, sizeof in->model, "%s", m->model);
    if (!(d->window = calloc((size_t)m->nlayers, sizeof *d->window)))
        return kvq_fail(err, KVQ_ERR_NOMEM, "%s: out of memory", p);
    for (int i = 0; i < m->nlayers; i++) {
        const kvq_layer *l = &m->layers[i];
        if (!l->key || !l->value)
            return kvq_fail(err, KVQ_ERR_FORMAT, "%s: /layer_%03d/%s: missing required dataset (expected [%d,%d,%d])", p,
                            i, l->key ? "value" : "key", in->num_kv_heads, in->seq_len, in->head_dim);
        if (l->H != l0->H || l->T != l0->T || l->D != l0->D || (l->query && l->Hq != Hq))
            return kvq_fail(err, KVQ_ERR_FORMAT, "%s: /layer_%03d: expected the shape of /layer_000 (H %d, Hq %d, T %d, "
                            "D %d), got H %d, Hq %d, T %d, D %d", p, i, l0->H, Hq, l0->T, l0->D, l->H,
                            l->query ? l->Hq : l->H, l->T, l->D);
        if (!l->query != !l0->query || !l->key_pre_rope != !l0->key_pre_rope) {
            int q = !l->query != !l0->query;
            return kvq_fail(err, KVQ_ERR_FORMAT, "%s: /layer_%03d/%s: expected %s, as in /layer_000", p, i,
                            q ? "query" : "key_pre_rope", (q ? l0->query : l0->key_pre_rope) ? "a dataset" : "no dataset");
        }
        int win = m->windows ? m->windows[i] : 0;
        if (win < 0)
            return kvq_fail(err, KVQ_ERR_FORMAT, "%s: /layer_%03d/sliding_window: expected a window of 0 (none) to "
                            "2^31-1 positions, got %d", p, i, win);
        in->window_layers += win > 0;
        d->window[i] = win;
    }
    double theta = m->rope_theta;
    if (theta != 0 && !(isfinite(theta) && theta > 0))
        return kvq_fail(err, KVQ_ERR_FORMAT, "%s: /rope_theta: expected a positive finite number, got %g", p, theta);
    in->has_rope_theta = theta != 0, in->rope_theta = theta;
    if (m->rope_style != KVQ_ROPE_UNSET && m->rope_style != KVQ_ROPE_INTERLEAVED && m->rope_style != KVQ_ROPE_HALF)
        return kvq_fail(err, KVQ_ERR_FORMAT, "%s: /rope_style: expected \"interleaved\" or \"half\"", p);
    in->rope_style = m->rope_style;
    if (m->query_prescaled != 0 && m->query_prescaled != 1)
        return kvq_fail(err, KVQ_ERR_FORMAT, "%s: /query_prescaled: expected 0 or 1, got %d", p, m->query_prescaled);
    in->query_prescaled = m->query_prescaled;
    if (!m->rope_cos != !m->rope_sin)
        return kvq_fail(err, KVQ_ERR_FORMAT, "%s: /%s: expected a dataset (/%s is present)", p,
                        m->rope_cos ? "rope_sin" : "rope_cos", m->rope_cos ? "rope_cos" : "rope_sin");
    if (m->rope_cos && in->head_dim % 2)
        return kvq_fail(err, KVQ_ERR_FORMAT, "%s: /rope_cos: RoPE tables need an even head_dim, got %d", p,
                        in->head_dim);
    if (m->rope_cos) {
        size_t n = (size_t)in->seq_len * (size_t)(in->head_dim / 2);
        if (!(d->mem_cos = kvq_alloc_array(n, sizeof *d->mem_cos)) ||
            !(d->mem_sin = kvq_alloc_array(n, sizeof *d->mem_sin)))
            return kvq_fail(err, KVQ_ERR_NOMEM, "%s: out of memory for the RoPE tables", p);
        for (size_t i = 0; i < n; i++) d->mem_cos[i] = (float)m->rope_cos[i], d->mem_sin[i] = (float)m->rope_sin[i];
        int shape[3] = {1, in->seq_len, in->head_dim / 2};
        kvq_status st = check_finite(p, "/rope_cos", d->mem_cos, shape, NULL, 0, err);
        if (!st) st = check_finite(p, "/rope_sin", d->mem_sin, shape, NULL, 0, err);
        if (st) return st;
        in->has_rope_table = 1;
    }
    if (m->attn_scale != 0 && !(isfinite(m->attn_scale) && m->attn_scale > 0))
        return kvq_fail(err, KVQ_ERR_FORMAT, "%s: /attn_scale: expected a positive finite number, got %g", p,
                        m->attn_scale);
    in->attn_scale = m->attn_scale;
    if (!(isfinite(m->attn_softcap) && m->attn_softcap >= 0))
        return kvq_fail(err, KVQ_ERR_FORMAT, "%s: /attn_softcap: expected a finite number >= 0 (0: none), got %g", p,
                        m->attn_softcap);
    in->attn_softcap = m->attn_softcap;
    return KVQ_OK;
}

kvq_status kvq_dump_from_memory(const kvq_dump_mem *m, kvq_dump **out, kvq_error *err)
{
    *out = NULL;
    const char *name = m && m->name ? m->name : "layers";
    kvq_dump *d = calloc(1, sizeof *d);
    if (!d || !(d->path = strdup(name))) {
        free(d);
        return kvq_fail(err, KVQ_ERR_NOMEM, "%s: out of memory", name);
    }
    d->file = -1;
    d->mem = m ? m->layers : NULL;
    kvq_status st = m ? validate_memory(d, m, err) : kvq_fail(err, KVQ_ERR_USAGE, "no dump given");
    if (st) {
        kvq_dump_close(d);
        return st;
    }
    *out = d;
    return KVQ_OK;
}

const kvq_dump_info *kvq_dump_get_info(const kvq_dump *d) { return &d->info; }
const char *kvq_dump_path(const kvq_dump *d) { return d->path; }

void kvq_dump_set_read_threads(kvq_dump *d, int nthreads) { d->read_threads = nthreads == 1 ? 1 : 0; }

void kvq_dump_close(kvq_dump *d)
{
    if (!d) return;
    if (d->file >= 0) H5Fclose(d->file);
    H5Eclear2(H5E_DEFAULT);
    free(d->path);
    free(d->stage);
    free(d->window);
    free(d->model);
    free(d->mem_cos), free(d->mem_sin);
    free(d);
}

const char *kvq_dump_model(const kvq_dump *d) { return d->model ? d->model : d->info.model; }

kvq_attn_mode kvq_dump_attn_mode(const kvq_dump *d, int layer)
{
    const kvq_dump_info *in = &d->info;
    return (kvq_attn_mode){.prescaled = in->query_prescaled, .scale = (float)in->attn_scale,
                           .softcap = (float)in->attn_softcap,
                           .window = d->window && layer >= 0 && layer < in->num_layers ? d->window[layer] : 0};
}

void kvq_layer_free(kvq_layer *l)
{
    if (!l) return;
    free(l->key);
    free(l->value);
    free(l->query);
    free(l->key_pre_rope);
    memset(l, 0, sizeof *l);
}

kvq_status kvq_layer_alloc(kvq_layer *l, int H, int Hq, int T, int D, unsigned flags,
                           kvq_error *err)
{
    size_t kb, qb;
    memset(l, 0, sizeof *l);
    if (H <= 0 || Hq <= 0 || T <= 0 || D <= 0 || !kvq_tensor_bytes((size_t)H, (size_t)T, (size_t)D, &kb) ||
        !kvq_tensor_bytes((size_t)Hq, (size_t)T, (size_t)D, &qb))
        return kvq_fail(err, KVQ_ERR_NOMEM, "layer of %d x %d x %d (query heads %d): invalid or overflowing size", H, T,
                        D, Hq);
    l->H = H, l->Hq = Hq, l->T = T, l->D = D;
    l->key = calloc(1, kb);
    l->value = calloc(1, kb);
    if (flags & KVQ_READ_QUERY) l->query = calloc(1, qb);
    if (flags & KVQ_READ_KEY_PRE_ROPE) l->key_pre_rope = calloc(1, kb);
    if (!l->key || !l->value || ((flags & KVQ_READ_QUERY) && !l->query) ||
        ((flags & KVQ_READ_KEY_PRE_ROPE) && !l->key_pre_rope)) {
        kvq_layer_free(l);
        return kvq_fail(err, KVQ_ERR_NOMEM, "out of memory for a layer of %d x %d x %d", H, T, D);
    }
    return KVQ_OK;
}

/* The tensors `flags` selects of one layer into out's buffers (allocated
 * for this dump's shape); frees out on failure. */
static kvq_status read_into(kvq_dump *d, int layer, kvq_layer *out, kvq_error *err)
{
    const kvq_dump_info *in = &d->info;
    int H = in->num_kv_heads, Hq = in->num_heads, T = in->seq_len, D = in->head_dim;
    int skv[3] = {H, T, D}, sq[3] = {Hq, T, D};
    char obj[64];
    const kvq_layer *mem = d->mem ? &d->mem[layer] : NULL; /* a dump in memory: its tensors */
    struct { const char *name; float *dst; const int *shape; const float *src; } items[] = {
        {"key", out->key, skv, mem ? mem->key : NULL},
        {"value", out->value, skv, mem ? mem->value : NULL},
        {"query", out->query, sq, mem ? mem->query : NULL},
        {"key_pre_rope", out->key_pre_rope, skv, mem ? mem->key_pre_rope : NULL},
    };
    kvq_h5_quiet();
    for (size_t i = 0; i < sizeof items / sizeof items[0]; i++) {
        if (!items[i].dst) continue;
        snprintf(obj, sizeof obj, "/layer_%03d/%s", layer, items[i].name);
        kvq_status st = mem ? copy_floats(d, obj, items[i].src, items[i].dst, items[i].shape, NULL, 0, err)
                            : read_floats(d, obj, items[i].dst, items[i].shape, NULL, 0, err);
        if (st) {
            kvq_layer_free(out);
            return st;
        }
    }
    return KVQ_OK;
}

/* The flags this dump can honour; KVQ_ERR_USAGE for a layer out of range. */
static kvq_status layer_request(kvq_dump *d, int layer, unsigned *flags, kvq_error *err)
{
    const kvq_dump_info *in = &d->info;
    if (layer < 0 || layer >= in->num_layers)
        return kvq_fail(err, KVQ_ERR_USAGE, "%s: layer %d: expected 0..%d", d->path, layer, in->num_layers - 1);
    if (!in->has_query) *flags &= ~KVQ_READ_QUERY;
    if (!in->has_key_pre_rope) *flags &= ~KVQ_READ_KEY_PRE_ROPE;
    return KVQ_OK;
}

static kvq_status alloc_for(kvq_dump *d, int layer, unsigned flags, kvq_layer *out, kvq_error *err)
{
    const kvq_dump_info *in = &d->info;
    kvq_status st = kvq_layer_alloc(out, in->num_kv_heads, in->num_heads, in->seq_len, in->head_dim, flags, err);
    if (!st) return KVQ_OK;
    char msg[sizeof err->msg];
    snprintf(msg, sizeof msg, "%s", err ? err->msg : "out of memory");
    return kvq_fail(err, st, "%s: /layer_%03d: %s", d->path, layer, msg);
}

kvq_status kvq_dump_read_layer(kvq_dump *d, int layer, unsigned flags, kvq_layer *out,
                               kvq_error *err)
{
    memset(out, 0, sizeof *out);
    kvq_status st = layer_request(d, layer, &flags, err);
    if (!st) st = alloc_for(d, layer, flags, out, err);
    return st ? st : read_into(d, layer, out, err);
}

kvq_status kvq_dump_read_layer_reuse(kvq_dump *d, int layer, unsigned flags, kvq_layer *io, kvq_error *err)
{
    const kvq_dump_info *in = &d->info;
    kvq_status st = layer_request(d, layer, &flags, err);
    if (st) return st;
    int same = io->key && io->H == in->num_kv_heads && io->Hq == in->num_heads && io->T == in->seq_len &&
               io->D == in->head_dim && !io->query == !(flags & KVQ_READ_QUERY) &&
               !io->key_pre_rope == !(flags & KVQ_READ_KEY_PRE_ROPE);
    if (!same) {
        kvq_layer_free(io);
        if ((st = alloc_for(d, layer, flags, io, err))) return st;
    }
    return read_into(d, layer, io, err);
}

kvq_status kvq_dump_read_query_rows(kvq_dump *d, int layer, const int *pos, size_t npos, float **out,
                                    kvq_error *err)
{
    const kvq_dump_info *in = &d->info;
    *out = NULL;
    if (layer < 0 || layer >= in->num_layers)
        return kvq_fail(err, KVQ_ERR_USAGE, "%s: layer %d: expected 0..%d", d->path, layer, in->num_layers - 1);
    if (!in->has_query)
        return kvq_fail(err, KVQ_ERR_FORMAT, "%s: /layer_%03d/query: the dump has no queries", d->path, layer);
    for (size_t i = 0; i < npos; i++)
        if (pos[i] < 0 || pos[i] >= in->seq_len || (i && pos[i] <= pos[i - 1]))
            return kvq_fail(err, KVQ_ERR_USAGE, "%s: query rows: expected ascending positions below %d", d->path,
                            in->seq_len);
    kvq_h5_quiet();
    size_t bytes;
    if (!kvq_tensor_bytes((size_t)in->num_heads, npos ? npos : 1, (size_t)in->head_dim, &bytes) ||
        !(*out = malloc(bytes)))
        return kvq_fail(err, KVQ_ERR_NOMEM, "%s: out of memory for %zu query rows", d->path, npos);
    if (npos == 0) return KVQ_OK;
    int shape[3] = {in->num_heads, in->seq_len, in->head_dim};
    char obj[64];
    snprintf(obj, sizeof obj, "/layer_%03d/query", layer);
    kvq_status st = d->mem ? copy_floats(d, obj, d->mem[layer].query, *out, shape, pos, npos, err)
                           : read_floats(d, obj, *out, shape, pos, npos, err);
    if (st) free(*out), *out = NULL;
    return st;
}

kvq_status kvq_dump_read_rope(kvq_dump *d, kvq_rope *out, kvq_error *err)
{
    const kvq_dump_info *in = &d->info;
    int T = in->seq_len, D = in->head_dim, half = D / 2;
    memset(out, 0, sizeof *out);
    if (in->rope_style == KVQ_ROPE_UNSET)
        return kvq_fail(err, KVQ_ERR_FORMAT,
                        "%s: /rope_style: expected \"interleaved\" or \"half\" (needed to re-apply RoPE)", d->path);
    if (D % 2)
        return kvq_fail(err, KVQ_ERR_FORMAT,
                        "%s: /head_dim: expected an even head_dim to re-apply RoPE (it rotates channel pairs), got %d",
                        d->path, D);
    if (!in->has_rope_table) {
        if (!in->has_rope_theta)
            return kvq_fail(
                err, KVQ_ERR_FORMAT,
                "%s: /rope_theta: expected the RoPE base or /rope_cos, /rope_sin tables (needed to re-apply RoPE)",
                d->path);
        return kvq_rope_from_theta(out, T, D, in->rope_theta, in->rope_style, err);
    }
    size_t n = (size_t)T * half;
    float *c = kvq_alloc_array(n ? n : 1, sizeof *c), *s = kvq_alloc_array(n ? n : 1, sizeof *s);
    out->cos = kvq_alloc_array(n ? n : 1, sizeof *out->cos);
    out->sin = kvq_alloc_array(n ? n : 1, sizeof *out->sin);
    kvq_status st = KVQ_OK;
    if (!c || !s || !out->cos || !out->sin) {
        st = kvq_fail(err, KVQ_ERR_NOMEM, "%s: out of memory for the RoPE tables", d->path);
    } else {
        int shape[3] = {1, T, half};
        kvq_h5_quiet();
        if (d->mem) /* the tables as a file holds them */
            memcpy(c, d->mem_cos, n * sizeof *c), memcpy(s, d->mem_sin, n * sizeof *s);
        else if (!(st = read_floats(d, "/rope_cos", c, shape, NULL, 0, err)))
            st = read_floats(d, "/rope_sin", s, shape, NULL, 0, err);
        for (size_t i = 0; i < n && !st; i++) out->cos[i] = c[i], out->sin[i] = s[i];
    }
    free(c), free(s);
    if (st) {
        kvq_rope_free(out);
        return st;
    }
    out->T = T, out->D = D, out->style = in->rope_style;
    return KVQ_OK;
}

int kvq_dump_has_tokens(kvq_dump *d)
{
    if (d->mem) return 0;
    kvq_h5_quiet();
    return H5Aexists(d->file, "tokens") > 0;
}

kvq_status kvq_dump_read_tokens(kvq_dump *d, int **tokens, size_t *n, kvq_error *err)
{
    char det[256];
    *tokens = NULL, *n = 0;
    kvq_h5_quiet();
    if (d->mem || H5Aexists(d->file, "tokens") <= 0)
        return kvq_fail(err, KVQ_ERR_FORMAT, "%s: /tokens: attribute missing", d->path);
    hid_t a = H5Aopen(d->file, "tokens", H5P_DEFAULT), sp = a >= 0 ? H5Aget_space(a) : -1,
          t = a >= 0 ? H5Aget_type(a) : -1;
    kvq_status st = KVQ_OK;
    hssize_t cnt = sp >= 0 ? H5Sget_simple_extent_npoints(sp) : -1;
    if (a < 0 || sp < 0 || t < 0 || cnt < 1 || H5Tget_class(t) != H5T_INTEGER) {
        st = kvq_fail(err, KVQ_ERR_FORMAT, "%s: /tokens: expected an integer array: %s", d->path,
                      kvq_h5_detail(det, sizeof det));
    } else if (!(*tokens = kvq_alloc_array((size_t)cnt, sizeof **tokens))) {
        st = kvq_fail(err, KVQ_ERR_NOMEM, "%s: out of memory", d->path);
    } else if (H5Aread(a, H5T_NATIVE_INT, *tokens) < 0) {
        free(*tokens), *tokens = NULL;
        st = kvq_fail(err, KVQ_ERR_FORMAT, "%s: /tokens: cannot read: %s", d->path, kvq_h5_detail(det, sizeof det));
    } else {
        *n = (size_t)cnt;
    }
    kvq_h5_close_id(t);
    kvq_h5_close_id(sp);
    kvq_h5_close_id(a);
    return st;
}

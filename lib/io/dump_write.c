/* dump_write.c — the kvq-dump/1 writer (docs/dump-format.md): the file is built under a
 * temporary name (created with the mode it keeps, output.c) and renamed
 * into place by kvq_dump_writer_finish, so a crash never leaves a
 * half-written dump; a tool's hooks learn the temporary's name so that a
 * signal can remove it. */
#include "h5.h"

#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

struct kvq_dump_writer {
    char *path, *tmp;
    hid_t file;
    kvq_dump_info info;
    kvq_dtype dtype;
};

/* kvq_set_temp_hooks: a tool's bookkeeping of the writers' temporaries */
static void (*temp_created)(const char *), (*temp_gone)(const char *);

/* ----------------------------------------------------------------- writer */

static hid_t f16_type(void)
{
    hid_t t = H5Tcopy(H5T_IEEE_F32LE);
    if (t < 0) return t;
    if (H5Tset_fields(t, 15, 10, 5, 0, 10) < 0 || H5Tset_size(t, 2) < 0 || H5Tset_ebias(t, 15) < 0) {
        H5Tclose(t);
        return -1;
    }
    return t;
}

static herr_t write_attr_string(hid_t obj, const char *name, const char *val)
{
    hid_t t = H5Tcopy(H5T_C_S1), sp = H5Screate(H5S_SCALAR), a = -1;
    herr_t r = -1;
    if (t >= 0 && sp >= 0 && H5Tset_size(t, strlen(val) + 1) >= 0 &&
        (a = H5Acreate2(obj, name, t, sp, H5P_DEFAULT, H5P_DEFAULT)) >= 0)
        r = H5Awrite(a, t, val);
    kvq_h5_close_id(a);
    kvq_h5_close_id(sp);
    kvq_h5_close_id(t);
    return r;
}

static herr_t write_attr_num(hid_t obj, const char *name, hid_t ftype, hid_t mtype, const void *v)
{
    hid_t sp = H5Screate(H5S_SCALAR), a = -1;
    herr_t r = -1;
    if (sp >= 0 && (a = H5Acreate2(obj, name, ftype, sp, H5P_DEFAULT, H5P_DEFAULT)) >= 0)
        r = H5Awrite(a, mtype, v);
    kvq_h5_close_id(a);
    kvq_h5_close_id(sp);
    return r;
}

kvq_status kvq_dump_writer_create(const char *path, const kvq_dump_info *info, kvq_dtype dtype,
                                  kvq_dump_writer **out, kvq_error *err)
{
    char det[256];
    *out = NULL;
    kvq_h5_quiet();
    kvq_dump_writer *w = calloc(1, sizeof *w);
    if (!w) return kvq_fail(err, KVQ_ERR_NOMEM, "%s: out of memory", path);
    int special = 0, fd = -1;
    kvq_status st0 = kvq_output_target(path, &w->path, &special, err);
    if (!st0 && special)
        st0 =
            kvq_fail(err, KVQ_ERR_IO, "%s: expected a regular file for an HDF5 dump (it is a FIFO or a device)", path);
    if (!st0) st0 = kvq_output_temp(path, w->path, &w->tmp, &fd, err);
    if (st0) {
        free(w->path), free(w);
        return st0;
    }
    close(fd);
    if (temp_created) temp_created(w->tmp);
    w->info = *info;
    w->dtype = dtype;
    w->file = H5Fcreate(w->tmp, H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT);
    if (w->file < 0) {
        kvq_status st =
            kvq_fail(err, KVQ_ERR_IO, "%s: cannot create HDF5 file: %s", path, kvq_h5_detail(det, sizeof det));
        unlink(w->tmp);
        free(w->tmp), free(w->path), free(w);
        return st;
    }
    long long dims[5] = {info->num_layers, info->num_heads, info->num_kv_heads, info->head_dim, info->seq_len};
    const char *names[5] = {"num_layers", "num_heads", "num_kv_heads", "head_dim", "seq_len"};
    herr_t r = write_attr_string(w->file, "kvq_format", KVQ_DUMP_FORMAT_TAG);
    if (r >= 0) r = write_attr_string(w->file, "model", info->model);
    for (int i = 0; i < 5 && r >= 0; i++)
        r = write_attr_num(w->file, names[i], H5T_STD_I64LE, H5T_NATIVE_LLONG, &dims[i]);
    if (r >= 0 && info->has_rope_theta)
        r = write_attr_num(w->file, "rope_theta", H5T_IEEE_F64LE, H5T_NATIVE_DOUBLE, &info->rope_theta);
    if (r >= 0 && info->rope_style != KVQ_ROPE_UNSET)
        r = write_attr_string(w->file, "rope_style", info->rope_style == KVQ_ROPE_HALF ? "half" : "interleaved");
    long long qp = info->query_prescaled;
    if (r >= 0) r = write_attr_num(w->file, "query_prescaled", H5T_STD_I64LE, H5T_NATIVE_LLONG, &qp);
    if (r < 0) {
        kvq_status st =
            kvq_fail(err, KVQ_ERR_IO, "%s: cannot write root attributes: %s", path, kvq_h5_detail(det, sizeof det));
        kvq_dump_writer_abort(w);
        return st;
    }
    *out = w;
    return KVQ_OK;
}

/* Writes x as a dataset [a][b][c], or [b][c] when a == 0. */
static herr_t write_tensor(hid_t g, const char *name, const float *x, int a, int b, int c,
                           kvq_dtype dt)
{
    hsize_t dims[3] = {(hsize_t)a, (hsize_t)b, (hsize_t)c};
    size_t n = (size_t)(a ? a : 1) * b * c;
    hid_t sp = a ? H5Screate_simple(3, dims, NULL) : H5Screate_simple(2, dims + 1, NULL), ft = -1, ds = -1;
    herr_t r = -1;
    uint16_t *half = NULL;
    if (sp < 0) return -1;
    if (dt == KVQ_F16) ft = f16_type();
    else ft = H5Tcopy(dt == KVQ_F64 ? H5T_IEEE_F64LE : H5T_IEEE_F32LE);
    if (ft < 0) goto out;
    if ((ds = H5Dcreate2(g, name, ft, sp, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT)) < 0) goto out;
    if (dt == KVQ_F16) {
        if (!(half = kvq_alloc_array(n, sizeof *half))) goto out;
        kvq_f32_to_f16_array(x, half, n);
        r = H5Dwrite(ds, ft, H5S_ALL, H5S_ALL, H5P_DEFAULT, half);
    } else {
        r = H5Dwrite(ds, H5T_NATIVE_FLOAT, H5S_ALL, H5S_ALL, H5P_DEFAULT, x);
    }
out:
    free(half);
    kvq_h5_close_id(ds);
    kvq_h5_close_id(ft);
    kvq_h5_close_id(sp);
    return r;
}

kvq_status kvq_dump_writer_layer(kvq_dump_writer *w, int layer, const kvq_layer *l,
                                 kvq_error *err)
{
    char gname[32], det[256];
    const kvq_dump_info *in = &w->info;
    if (layer < 0 || layer >= in->num_layers || l->H != in->num_kv_heads || l->T != in->seq_len ||
        l->D != in->head_dim || (l->query && l->Hq != in->num_heads))
        return kvq_fail(err, KVQ_ERR_USAGE, "%s: layer %d: shape disagrees with the dump's attributes", w->path, layer);
    kvq_h5_quiet();
    snprintf(gname, sizeof gname, "/layer_%03d", layer);
    hid_t g = H5Gcreate2(w->file, gname, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT);
    if (g < 0)
        return kvq_fail(err, KVQ_ERR_IO, "%s: %s: cannot create group: %s", w->path, gname,
                        kvq_h5_detail(det, sizeof det));
    herr_t r = write_tensor(g, "key", l->key, l->H, l->T, l->D, w->dtype);
    if (r >= 0) r = write_tensor(g, "value", l->value, l->H, l->T, l->D, w->dtype);
    if (r >= 0 && l->query) r = write_tensor(g, "query", l->query, l->Hq, l->T, l->D, w->dtype);
    if (r >= 0 && l->key_pre_rope) r = write_tensor(g, "key_pre_rope", l->key_pre_rope, l->H, l->T, l->D, w->dtype);
    kvq_h5_close_id(g);
    if (r < 0)
        return kvq_fail(err, KVQ_ERR_IO, "%s: %s: cannot write: %s", w->path, gname, kvq_h5_detail(det, sizeof det));
    return KVQ_OK;
}

kvq_status kvq_dump_writer_layer_attr_int(kvq_dump_writer *w, int layer, const char *name, long long v,
                                          kvq_error *err)
{
    char gname[32], det[256];
    snprintf(gname, sizeof gname, "/layer_%03d", layer);
    kvq_h5_quiet();
    hid_t g = H5Gopen2(w->file, gname, H5P_DEFAULT);
    herr_t r = g < 0 ? -1 : write_attr_num(g, name, H5T_STD_I64LE, H5T_NATIVE_LLONG, &v);
    kvq_h5_close_id(g);
    if (r < 0)
        return kvq_fail(err, KVQ_ERR_IO, "%s: %s/%s: cannot write: %s", w->path, gname, name,
                        kvq_h5_detail(det, sizeof det));
    return KVQ_OK;
}

kvq_status kvq_dump_writer_rope_table(kvq_dump_writer *w, const float *cos, const float *sin,
                                      kvq_error *err)
{
    char det[256];
    kvq_h5_quiet();
    int T = w->info.seq_len, half = w->info.head_dim / 2;
    herr_t r = write_tensor(w->file, "rope_cos", cos, 0, T, half, KVQ_F32);
    if (r >= 0) r = write_tensor(w->file, "rope_sin", sin, 0, T, half, KVQ_F32);
    if (r < 0)
        return kvq_fail(err, KVQ_ERR_IO, "%s: /rope_cos, /rope_sin: cannot write: %s", w->path,
                        kvq_h5_detail(det, sizeof det));
    return KVQ_OK;
}

kvq_status kvq_dump_writer_attr_ints(kvq_dump_writer *w, const char *name, const int *v, size_t n, kvq_error *err)
{
    char det[256];
    kvq_h5_quiet();
    hsize_t dims[1] = {(hsize_t)n};
    hid_t sp = n ? H5Screate_simple(1, dims, NULL) : H5Screate(H5S_SCALAR), a = -1;
    herr_t r = -1;
    if (sp >= 0 && (a = H5Acreate2(w->file, name, H5T_STD_I32LE, sp, H5P_DEFAULT, H5P_DEFAULT)) >= 0)
        r = H5Awrite(a, H5T_NATIVE_INT, v);
    kvq_h5_close_id(a);
    kvq_h5_close_id(sp);
    if (r < 0)
        return kvq_fail(err, KVQ_ERR_IO, "%s: attribute %s: cannot write: %s", w->path, name,
                        kvq_h5_detail(det, sizeof det));
    return KVQ_OK;
}

kvq_status kvq_dump_writer_attr_real(kvq_dump_writer *w, const char *name, double v, kvq_error *err)
{
    char det[256];
    kvq_h5_quiet();
    if (write_attr_num(w->file, name, H5T_IEEE_F64LE, H5T_NATIVE_DOUBLE, &v) < 0)
        return kvq_fail(err, KVQ_ERR_IO, "%s: attribute %s: cannot write: %s", w->path, name,
                        kvq_h5_detail(det, sizeof det));
    return KVQ_OK;
}

kvq_status kvq_dump_writer_attr_string(kvq_dump_writer *w, const char *name, const char *v, kvq_error *err)
{
    char det[256];
    kvq_h5_quiet();
    if (write_attr_string(w->file, name, v) < 0)
        return kvq_fail(err, KVQ_ERR_IO, "%s: attribute %s: cannot write: %s", w->path, name,
                        kvq_h5_detail(det, sizeof det));
    return KVQ_OK;
}

kvq_status kvq_dump_writer_finish(kvq_dump_writer *w, kvq_error *err)
{
    char det[256];
    kvq_status st = KVQ_OK;
    kvq_h5_quiet();
    if (H5Fclose(w->file) < 0) {
        w->file = -1;
        st = kvq_fail(err, KVQ_ERR_IO, "%s: cannot close: %s", w->path, kvq_h5_detail(det, sizeof det));
    } else if (rename(w->tmp, w->path) != 0) {
        st = kvq_fail(err, KVQ_ERR_IO, "%s: cannot rename %s into place: %s", w->path, w->tmp, strerror(errno));
    }
    w->file = -1;
    if (st) unlink(w->tmp);
    if (temp_gone) temp_gone(w->tmp);
    free(w->tmp), free(w->path), free(w);
    return st;
}

void kvq_set_temp_hooks(void (*created)(const char *tmp), void (*gone)(const char *tmp))
{
    temp_created = created, temp_gone = gone;
}

void kvq_dump_writer_abort(kvq_dump_writer *w)
{
    if (!w) return;
    /* A close that fails (its flush hit ENOSPC or EFBIG) leaves HDF5 1.10
     * half-closed state behind: it is not closed again (that crashes) and
     * h5_quiet keeps HDF5 from closing it at exit. */
    if (w->file >= 0) H5Fclose(w->file);
    H5Eclear2(H5E_DEFAULT);
    unlink(w->tmp);
    if (temp_gone) temp_gone(w->tmp);
    free(w->tmp), free(w->path), free(w);
}

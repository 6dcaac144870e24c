/* make_dumps.c — writes valid and deliberately malformed kvq dumps with the
 * raw HDF5 API (test code only; libkvq keeps hdf5.h in lib/io/), one per
 * class of bad input that tests/test_cli.sh checks:  make-dumps OUTDIR */
#include <hdf5.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { L = 4, H = 4, HQ = 8, T = 16, D = 8 };

typedef struct {
    const char *name;
    const char *tag;          /* kvq_format value */
    int vlen;                 /* strings as variable length UTF-8 */
    int skip_attr;            /* omit head_dim */
    int dim_as_string;        /* num_heads written as a string */
    long long seq_len_attr;   /* value of seq_len attribute */
    long long num_heads_attr; /* value of num_heads */
    int layers_written;       /* groups actually written */
    int missing_key_layer;    /* layer without key (-1 none) */
    int short_layer;          /* layer whose key has T-1 tokens (-1 none) */
    int nan_layer;            /* layer whose value holds a NaN (-1 none) */
    int f64_overflow;         /* key as float64 holding 1e300 */
    int int_key;              /* key stored as int32 */
    int f16;                  /* tensors as IEEE float16 */
    int f16_big_endian;       /* ... big-endian */
    int query_first_only;     /* query only in layer_000 */
    const char *rope_style;
    long long prescaled;
    int query_inf_layer;      /* layer whose query holds a -inf (-1 none) */
    int pre_rope;             /* key_pre_rope in every layer, rope_theta set; 2: a NaN in layer 0's */
    int rope_table_nan;       /* rope_cos/rope_sin tables, rope_cos holding a NaN */
    int dim;                  /* head_dim (0: D) */
} variant;

static hid_t f16_type(int be)
{
    hid_t t = H5Tcopy(be ? H5T_IEEE_F32BE : H5T_IEEE_F32LE);
    H5Tset_fields(t, 15, 10, 5, 0, 10);
    H5Tset_size(t, 2);
    H5Tset_ebias(t, 15);
    return t;
}

static void attr_str(hid_t o, const char *name, const char *v, int vlen)
{
    hid_t t = H5Tcopy(H5T_C_S1), sp = H5Screate(H5S_SCALAR);
    if (vlen) {
        H5Tset_size(t, H5T_VARIABLE);
        H5Tset_cset(t, H5T_CSET_UTF8);
        hid_t a = H5Acreate2(o, name, t, sp, H5P_DEFAULT, H5P_DEFAULT);
        H5Awrite(a, t, &v);
        H5Aclose(a);
    } else {
        H5Tset_size(t, strlen(v)); /* null-padded, no terminator stored */
        H5Tset_strpad(t, H5T_STR_NULLPAD);
        hid_t a = H5Acreate2(o, name, t, sp, H5P_DEFAULT, H5P_DEFAULT);
        H5Awrite(a, t, v);
        H5Aclose(a);
    }
    H5Sclose(sp);
    H5Tclose(t);
}

static void attr_int(hid_t o, const char *name, long long v, hid_t ftype)
{
    hid_t sp = H5Screate(H5S_SCALAR);
    hid_t a = H5Acreate2(o, name, ftype, sp, H5P_DEFAULT, H5P_DEFAULT);
    H5Awrite(a, H5T_NATIVE_LLONG, &v);
    H5Aclose(a);
    H5Sclose(sp);
}

static void tensor(hid_t g, const char *name, int a, int b, int c, const variant *v, int poison)
{
    hsize_t dims[3] = {(hsize_t)a, (hsize_t)b, (hsize_t)c};
    size_t n = (size_t)a * b * c;
    double *x = malloc(n * sizeof *x);
    for (size_t i = 0; i < n; i++) x[i] = sin(0.37 * (double)i) * (1 + (i % D == 3) * 4);
    if (poison == 1) x[n / 2 + 3] = NAN;
    if (poison == 2) x[5] = 1e300;
    if (poison == 3) x[7] = -INFINITY;
    hid_t sp = H5Screate_simple(3, dims, NULL), ft, ds;
    if (v->int_key && !strcmp(name, "key")) {
        ft = H5Tcopy(H5T_STD_I32LE);
        ds = H5Dcreate2(g, name, ft, sp, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT);
        int *xi = malloc(n * sizeof *xi);
        for (size_t i = 0; i < n; i++) xi[i] = (int)(x[i] * 10);
        H5Dwrite(ds, H5T_NATIVE_INT, H5S_ALL, H5S_ALL, H5P_DEFAULT, xi);
        free(xi);
    } else {
        if (poison == 2) ft = H5Tcopy(H5T_IEEE_F64LE);
        else if (v->f16) ft = f16_type(v->f16_big_endian);
        else ft = H5Tcopy(H5T_IEEE_F32LE);
        ds = H5Dcreate2(g, name, ft, sp, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT);
        /* HDF5 converts double -> float16 itself here: fine for test data */
        H5Dwrite(ds, H5T_NATIVE_DOUBLE, H5S_ALL, H5S_ALL, H5P_DEFAULT, x);
    }
    H5Dclose(ds);
    H5Tclose(ft);
    H5Sclose(sp);
    free(x);
}

static void write_variant(const char *dir, const variant *v)
{
    char path[1024];
    snprintf(path, sizeof path, "%s/%s", dir, v->name);
    hid_t f = H5Fcreate(path, H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT);
    attr_str(f, "kvq_format", v->tag ? v->tag : "kvq-dump/1", v->vlen);
    attr_str(f, "model", "make-dumps", v->vlen);
    attr_int(f, "num_layers", L, H5T_STD_I32LE);
    if (v->dim_as_string) attr_str(f, "num_heads", "8", v->vlen);
    else attr_int(f, "num_heads", v->num_heads_attr ? v->num_heads_attr : HQ, H5T_STD_U8LE);
    attr_int(f, "num_kv_heads", H, H5T_STD_I16BE);
    int dim = v->dim ? v->dim : D;
    if (!v->skip_attr) attr_int(f, "head_dim", dim, H5T_STD_I64LE);
    if (v->pre_rope) {
        hid_t sp = H5Screate(H5S_SCALAR);
        hid_t a = H5Acreate2(f, "rope_theta", H5T_IEEE_F64LE, sp, H5P_DEFAULT, H5P_DEFAULT);
        double theta = 10000.0;
        H5Awrite(a, H5T_NATIVE_DOUBLE, &theta);
        H5Aclose(a);
        H5Sclose(sp);
    }
    if (v->rope_table_nan) { /* [T][dim/2] tables; cos holds a NaN */
        hsize_t dims[2] = {T, (hsize_t)dim / 2};
        size_t n = (size_t)T * (dim / 2);
        double *c = malloc(n * sizeof *c);
        for (int k = 0; k < 2; k++) {
            for (size_t i = 0; i < n; i++) c[i] = k ? sin(0.1 * (double)i) : cos(0.1 * (double)i);
            if (!k) c[n - 1] = NAN;
            hid_t sp = H5Screate_simple(2, dims, NULL);
            hid_t ds =
                H5Dcreate2(f, k ? "rope_sin" : "rope_cos", H5T_IEEE_F32LE, sp, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT);
            H5Dwrite(ds, H5T_NATIVE_DOUBLE, H5S_ALL, H5S_ALL, H5P_DEFAULT, c);
            H5Dclose(ds);
            H5Sclose(sp);
        }
        free(c);
    }
    attr_int(f, "seq_len", v->seq_len_attr ? v->seq_len_attr : T, H5T_STD_I64LE);
    attr_int(f, "query_prescaled", v->prescaled, H5T_STD_I64LE);
    attr_str(f, "rope_style", v->rope_style ? v->rope_style : "interleaved", v->vlen);
    int nl = v->layers_written ? v->layers_written : L;
    for (int l = 0; l < nl; l++) {
        char g[32];
        snprintf(g, sizeof g, "layer_%03d", l);
        hid_t gr = H5Gcreate2(f, g, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT);
        if (l != v->missing_key_layer)
            tensor(gr, "key", H, l == v->short_layer ? T - 1 : T, dim, v, v->f64_overflow ? 2 : 0);
        tensor(gr, "value", H, T, dim, v, l == v->nan_layer);
        if (!v->query_first_only || l == 0) tensor(gr, "query", HQ, T, dim, v, l == v->query_inf_layer ? 3 : 0);
        if (v->pre_rope) tensor(gr, "key_pre_rope", H, T, dim, v, v->pre_rope == 2 && l == 0);
        H5Gclose(gr);
    }
    H5Fclose(f);
}

int main(int argc, char **argv)
{
    if (argc != 2) {
        fprintf(stderr, "usage: make-dumps OUTDIR\n");
        return 2;
    }
#define V(...) {.missing_key_layer = -1, .short_layer = -1, .nan_layer = -1, .query_inf_layer = -1, __VA_ARGS__}
    const variant vs[] = {
        V(.name = "ok-fixed.h5"),
        V(.name = "ok-vlen-f16.h5", .vlen = 1, .f16 = 1),
        V(.name = "ok-f16-be.h5", .f16 = 1, .f16_big_endian = 1),
        V(.name = "bad-tag.h5", .tag = "kvq-dump/2"),
        V(.name = "missing-attr.h5", .skip_attr = 1),
        V(.name = "attr-type.h5", .dim_as_string = 1),
        V(.name = "zero-dim.h5", .seq_len_attr = -5),
        V(.name = "gqa.h5", .num_heads_attr = 6),
        V(.name = "missing-group.h5", .layers_written = 2),
        V(.name = "missing-key.h5", .missing_key_layer = 1),
        V(.name = "bad-shape.h5", .short_layer = 3),
        V(.name = "nan.h5", .nan_layer = 2),
        V(.name = "f64-overflow.h5", .f64_overflow = 1),
        V(.name = "int-key.h5", .int_key = 1),
        V(.name = "query-partial.h5", .query_first_only = 1),
        V(.name = "bad-style.h5", .rope_style = "sideways"),
        V(.name = "bad-prescaled.h5", .prescaled = 2),
        V(.name = "query-inf.h5", .query_inf_layer = 1),
        V(.name = "nan-late.h5", .nan_layer = 3),
        V(.name = "huge-seq.h5", .seq_len_attr = 68719476736LL),
        V(.name = "pre-rope.h5", .pre_rope = 1),
        V(.name = "pre-rope-nan.h5", .pre_rope = 2),
        V(.name = "rope-table-nan.h5", .pre_rope = 1, .rope_table_nan = 1),
        V(.name = "odd-dim.h5", .pre_rope = 1, .dim = 7),
    };
    H5Eset_auto2(H5E_DEFAULT, NULL, NULL);
    for (size_t i = 0; i < sizeof vs / sizeof vs[0]; i++) write_variant(argv[1], &vs[i]);
    return 0;
}

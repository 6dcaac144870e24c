"""_lib.py — libkvq through ctypes: where the shared library is, the C
structs of lib/kvq.h that the package passes (mirrored field for field), the
signatures of the functions it calls, and kvq.Error.

The library is loaded on first use, so `import kvq` works (and write_dump
runs) without it; the first call that needs it says where it looked."""
import ctypes
import os

__all__ = ["Error", "UsageError", "FileError", "FormatError", "OutOfMemoryError", "NumericError", "UnsupportedError",
           "lib", "check", "ReconAcc", "Acc", "Metrics", "Param", "Spec", "DumpInfo", "Layer", "AttnMode",
           "Rope", "DumpMem"]


class Error(Exception):
    """A failure reported by libkvq (or a bad argument): the message is the
    library's one line; `status` is its kind (usage, io, format, nomem,
    numeric, unsupported, internal).  Raised as the subclass of its kind,
    which is also the matching built-in, so `except ValueError` and `except
    OSError` catch what numpy and h5py users expect:

    usage: UsageError (ValueError)     io: FileError (OSError)
    format: FormatError (ValueError)   nomem: OutOfMemoryError (MemoryError)
    numeric: NumericError (ArithmeticError)
    unsupported: UnsupportedError (NotImplementedError)
    """

    def __new__(cls, message="", status="usage", *args, **kwargs):
        if cls is Error:  # Error(msg, status) raises the subclass of that kind
            cls = _BY_STATUS.get(status, Error)
        return super().__new__(cls, message)

    def __init__(self, message="", status=None):
        super().__init__(message)
        self.status = status or self._status

    _status = "internal"


class UsageError(Error, ValueError):
    """A bad argument, spec or option (status "usage")."""
    _status = "usage"


class FileError(Error, OSError):
    """A file that cannot be opened, read or written (status "io")."""
    _status = "io"

    def __str__(self):  # OSError's own would print the args tuple
        return str(self.args[0]) if self.args else ""


class FormatError(Error, ValueError):
    """A file that is not what it should be: a damaged dump, a bad GGUF (status "format")."""
    _status = "format"


class OutOfMemoryError(Error, MemoryError):
    """libkvq ran out of memory (status "nomem")."""
    _status = "nomem"


class NumericError(Error, ArithmeticError):
    """A non-finite value or scale, named by the message (status "numeric")."""
    _status = "numeric"


class UnsupportedError(Error, NotImplementedError):
    """Something this build or this input's shape cannot do (status "unsupported")."""
    _status = "unsupported"


_BY_STATUS = {"usage": UsageError, "io": FileError, "format": FormatError, "nomem": OutOfMemoryError,
              "numeric": NumericError, "unsupported": UnsupportedError}


_STATUS = ["ok", "usage", "io", "format", "nomem", "numeric", "unsupported", "internal"]
c_double, c_int, c_float, c_char_p = ctypes.c_double, ctypes.c_int, ctypes.c_float, ctypes.c_char_p


class _Err(ctypes.Structure):  # kvq_error
    _c_name = "kvq_error"
    _fields_ = [("status", c_int), ("msg", ctypes.c_char * 1024)]


class ReconAcc(ctypes.Structure):  # kvq_recon_acc
    _c_name = "kvq_recon_acc"
    _fields_ = [(n, c_double) for n in ("n", "sum_x2", "sum_e2", "sum_abs_e", "max_abs", "bits")]


class AttnAcc(ctypes.Structure):  # kvq_attn_acc
    _c_name = "kvq_attn_acc"
    _fields_ = [(n, c_double) for n in ("rows", "s_ref2", "s_diff2", "a_ref2", "a_diff2", "kl_sum", "top1_same",
                                        "o_ref2", "o_diff2", "o_joint_diff2", "mass_sum")]


class Acc(ctypes.Structure):  # kvq_acc
    _c_name = "kvq_acc"
    _fields_ = [("k", ReconAcc), ("v", ReconAcc), ("static_bytes", c_double), ("has_attn", c_int),
                ("attn", AttnAcc)]


class Metrics(ctypes.Structure):  # kvq_metrics: has_attn, then a double per row of lib/kvq_metric_cols.def
    _c_name = "kvq_metrics"
    # _fields_ are the library's own (kvq_abi_field), set when it loads: a metric column is one row in C


def _abi_fields(handle):
    """{struct: {"size": bytes, "fields": [(name, offset, size)]}} as the library describes its structs."""
    fn = getattr(handle, "kvq_abi_field", None)
    if fn is None:
        return None
    fn.restype = c_int
    fn.argtypes = [c_int, ctypes.POINTER(c_char_p), ctypes.POINTER(c_char_p), ctypes.POINTER(ctypes.c_size_t),
                   ctypes.POINTER(ctypes.c_size_t)]
    out, i = {}, 0
    t, f, off, size = c_char_p(), c_char_p(), ctypes.c_size_t(), ctypes.c_size_t()
    while fn(i, ctypes.byref(t), ctypes.byref(f), ctypes.byref(off), ctypes.byref(size)):
        entry = out.setdefault(t.value.decode(), {"size": size.value, "fields": []})
        entry["fields"].append((f.value.decode(), off.value))
        i += 1
    return out


def _mirror_metrics(handle):
    """Metrics' fields from the library: has_attn an int, the metric columns doubles at their offsets."""
    if hasattr(Metrics, "_fields_"):
        return
    desc = (_abi_fields(handle) or {}).get("kvq_metrics")
    if desc is None:
        return  # abi_mismatches says so
    fields, at = [], 0
    for name, off in desc["fields"]:
        if off > at:
            fields.append((f"_pad{at}", ctypes.c_char * (off - at)))
        ctype = c_int if name == "has_attn" else c_double
        fields.append((name, ctype))
        at = off + ctypes.sizeof(ctype)
    if desc["size"] > at:
        fields.append(("_tail", ctypes.c_char * (desc["size"] - at)))
    Metrics._fields_ = fields
    AnalysisRow._fields_ = [("layer", c_int), ("head", c_int), ("quantizer", c_char_p), ("spec", ctypes.c_char * 1024),
                            ("m", Metrics)]


class AnalysisRow(ctypes.Structure):  # kvq_analysis_row (KVQ_SPEC_MAX 1024); its fields once Metrics has its own
    _c_name = "kvq_analysis_row"


class Param(ctypes.Structure):  # kvq_param
    _c_name = "kvq_param"
    _fields_ = [("key", c_char_p), ("type", c_int), ("default", c_char_p), ("min", c_double), ("max", c_double),
                ("choices", c_char_p), ("help", c_char_p), ("quiet_default", c_int), ("typed", c_int),
                ("offset", ctypes.c_size_t)]


class Spec(ctypes.Structure):  # kvq_spec (KVQ_MAX_PARAMS 16, KVQ_SPEC_MAX 1024, KVQ_OPTS_MAX 256)
    _c_name = "kvq_spec"
    _fields_ = [("q", ctypes.c_void_p), ("val", c_double * 16), ("given", ctypes.c_ubyte * 16),
                ("text", ctypes.c_char * 1024), ("opts", c_double * 32)]


class DumpInfo(ctypes.Structure):  # kvq_dump_info
    _c_name = "kvq_dump_info"
    _fields_ = [("model", ctypes.c_char * 256)] + [(n, c_int) for n in (
        "num_layers", "num_heads", "num_kv_heads", "head_dim", "seq_len", "has_rope_theta")] + [
        ("rope_theta", c_double), ("rope_style", c_int)] + [(n, c_int) for n in (
            "query_prescaled", "has_query", "has_key_pre_rope", "has_rope_table", "key_dtype", "value_dtype",
            "query_dtype")] + [("attn_scale", c_double), ("attn_softcap", c_double), ("window_layers", c_int)]


_PF = ctypes.POINTER(c_float)
_PD = ctypes.POINTER(c_double)


class Layer(ctypes.Structure):  # kvq_layer
    _c_name = "kvq_layer"
    _fields_ = [(n, c_int) for n in ("H", "Hq", "T", "D")] + [(n, _PF) for n in (
        "key", "value", "query", "key_pre_rope")]


class AttnMode(ctypes.Structure):  # kvq_attn_mode
    _c_name = "kvq_attn_mode"
    _fields_ = [("prescaled", c_int), ("scale", c_float), ("softcap", c_float), ("window", c_int)]


class Rope(ctypes.Structure):  # kvq_rope
    _c_name = "kvq_rope"
    _fields_ = [("T", c_int), ("D", c_int), ("style", c_int), ("cos", _PD), ("sin", _PD)]


_P = ctypes.c_void_p


class ArraysOpts(ctypes.Structure):  # kvq_arrays_opts
    _c_name = "kvq_arrays_opts"
    _fields_ = [("spec", c_char_p), ("layer", c_int), ("seed", ctypes.c_uint64), ("nthreads", c_int),
                ("rope_cos", _PD), ("rope_sin", _PD), ("rope_theta", c_double), ("rope_style", c_int),
                ("calib", _P), ("query", _PF), ("num_heads", c_int), ("keep", ctypes.POINTER(ctypes.c_ubyte))]


class AnalyzeCsvOpts(ctypes.Structure):  # kvq_analyze_csv_opts
    _c_name = "kvq_analyze_csv_opts"
    _fields_ = [("label", c_char_p), ("specs", ctypes.POINTER(c_char_p)), ("nspecs", c_int), ("per", c_int),
                ("layers", ctypes.POINTER(c_int)), ("nlayers", c_int), ("heads", ctypes.POINTER(c_int)),
                ("nheads", c_int), ("queries", c_char_p), ("calib", _P), ("seed", ctypes.c_uint64),
                ("nthreads", c_int)]


class Task(ctypes.Structure):  # kvq_task
    _c_name = "kvq_task"
    _fields_ = [("id", c_char_p), ("context", c_char_p), ("question", c_char_p), ("answer", c_char_p),
                ("depth", ctypes.c_double), ("line", ctypes.c_size_t)]


class DumpMem(ctypes.Structure):  # kvq_dump_mem
    _c_name = "kvq_dump_mem"
    _fields_ = [("name", c_char_p), ("model", c_char_p), ("layers", ctypes.POINTER(Layer)), ("nlayers", c_int),
                ("windows", ctypes.POINTER(c_int)), ("rope_theta", c_double), ("rope_style", c_int),
                ("rope_cos", _PD), ("rope_sin", _PD), ("query_prescaled", c_int), ("attn_scale", c_double),
                ("attn_softcap", c_double)]


_SIGNATURES = {
    # name: (restype, argtypes)
    "kvq_version": (c_char_p, []),
    "kvq_blas_core": (c_char_p, []),
    "kvq_blas_core_detected": (c_char_p, []),
    "kvq_blas_core_for_cpu": (c_char_p, []),
    "kvq_blas_core_wanted": (c_char_p, []),
    "kvq_blas_core_source": (None, [c_char_p, ctypes.c_size_t]),
    "kvq_blas_note_choice": (None, [c_char_p]),
    "kvq_take_notes": (ctypes.c_size_t, [c_char_p, ctypes.c_size_t]),
    "kvq_free": (None, [_P]),
    "kvq_spec_splits": (ctypes.c_ulong, []),
    "kvq_quantizer_count": (ctypes.c_size_t, []),
    "kvq_quantizer_at": (_P, [ctypes.c_size_t]),
    "kvq_selector_count": (ctypes.c_size_t, []),
    "kvq_selector_at": (_P, [ctypes.c_size_t]),
    "kvq_selector_needs_queries": (ctypes.c_int, [ctypes.c_size_t]),
    "kvq_quantizer_name": (c_char_p, [_P]),
    "kvq_quantizer_description": (c_char_p, [_P]),
    "kvq_quantizer_nparams": (c_int, [_P]),
    "kvq_quantizer_param": (ctypes.POINTER(Param), [_P, c_int]),
    "kvq_quantizer_in_default_set": (c_int, [_P]),
    "kvq_quantizer_read_flags": (ctypes.c_uint, [_P]),
    "kvq_quantizer_example_spec": (c_char_p, [_P]),
    "kvq_spec_check_shape": (c_int, [ctypes.POINTER(Spec), c_int, ctypes.POINTER(_Err)]),
    "kvq_spec_parse": (c_int, [c_char_p, ctypes.POINTER(Spec), ctypes.POINTER(_Err)]),
    "kvq_spec_needs_calib": (c_int, [ctypes.POINTER(Spec)]),
    "kvq_spec_format_full": (None, [ctypes.POINTER(Spec), ctypes.c_char_p, ctypes.c_size_t]),
    "kvq_acc_merge": (None, [ctypes.POINTER(Acc), ctypes.POINTER(Acc)]),
    "kvq_metrics_finalize": (None, [ctypes.POINTER(Acc), ctypes.POINTER(Metrics)]),
    "kvq_metric_column": (c_int, [c_int, ctypes.POINTER(c_char_p), ctypes.POINTER(ctypes.c_uint)]),
    "kvq_calib_open": (c_int, [c_char_p, ctypes.POINTER(_P), ctypes.POINTER(_Err)]),
    "kvq_calib_close": (None, [_P]),
    "kvq_quantize_arrays": (c_int, [ctypes.POINTER(ArraysOpts), c_int, c_int, c_int, _PF, _PF, _PF, _PF, _PF,
                                    ctypes.POINTER(Acc), ctypes.POINTER(_Err)]),
    "kvq_select_arrays": (c_int, [ctypes.POINTER(ArraysOpts), c_int, c_int, c_int, _PF, c_int, c_int,
                                  ctypes.POINTER(ctypes.c_ubyte), ctypes.POINTER(_Err)]),
    "kvq_analyze_csv": (c_int, [c_char_p, ctypes.POINTER(AnalyzeCsvOpts), ctypes.POINTER(_P), ctypes.POINTER(_Err)]),
    "kvq_analyze_csv_memory": (c_int, [ctypes.POINTER(DumpMem), ctypes.POINTER(AnalyzeCsvOpts), ctypes.POINTER(_P),
                                       ctypes.POINTER(_Err)]),
    "kvq_analyze_rows": (c_int, [c_char_p, ctypes.POINTER(DumpMem), ctypes.POINTER(AnalyzeCsvOpts),
                                 ctypes.POINTER(ctypes.POINTER(AnalysisRow)), ctypes.POINTER(ctypes.c_size_t),
                                 ctypes.POINTER(_Err)]),
    "kvq_dump_open": (c_int, [c_char_p, ctypes.POINTER(_P), ctypes.POINTER(_Err)]),
    "kvq_dump_get_info": (ctypes.POINTER(DumpInfo), [_P]),
    "kvq_dump_model": (c_char_p, [_P]),
    "kvq_dump_read_layer": (c_int, [_P, c_int, ctypes.c_uint, ctypes.POINTER(Layer), ctypes.POINTER(_Err)]),
    "kvq_dump_has_tokens": (c_int, [_P]),
    "kvq_dump_read_tokens": (c_int, [_P, ctypes.POINTER(ctypes.POINTER(c_int)), ctypes.POINTER(ctypes.c_size_t),
                                     ctypes.POINTER(_Err)]),
    "kvq_dump_read_rope": (c_int, [_P, ctypes.POINTER(Rope), ctypes.POINTER(_Err)]),
    "kvq_dump_attn_mode": (AttnMode, [_P, c_int]),
    "kvq_rope_free": (None, [ctypes.POINTER(Rope)]),
    "kvq_layer_free": (None, [ctypes.POINTER(Layer)]),
    "kvq_dump_close": (None, [_P]),
    "kvq_tasks_generate": (c_int, [c_int, ctypes.c_size_t, c_int, ctypes.c_uint64, _P, _P,
                                   ctypes.POINTER(ctypes.POINTER(Task)), ctypes.POINTER(_Err)]),
    "kvq_tasks_parse": (c_int, [c_char_p, c_char_p, ctypes.c_size_t, ctypes.POINTER(ctypes.POINTER(Task)),
                                ctypes.POINTER(ctypes.c_size_t), ctypes.POINTER(_Err)]),
    "kvq_task_json": (_P, [ctypes.POINTER(Task), c_char_p]),
    "kvq_tasks_free": (None, [ctypes.POINTER(Task), ctypes.c_size_t]),
}

_lib = None
_MIRRORED = (_Err, ReconAcc, AttnAcc, Acc, Metrics, Param, Spec, DumpInfo, Layer, AttnMode, Rope, ArraysOpts,
             AnalyzeCsvOpts, DumpMem, Task, AnalysisRow)


def abi_mismatches(handle, classes=_MIRRORED):
    """How the library's structs differ from these ctypes mirrors (field
    offsets, sizes; kvq_abi_field), as lines; empty when they agree."""
    c_side = _abi_fields(handle)
    if c_side is None:
        return ["it has no kvq_abi_field (an older libkvq)"]
    out = []
    for cls in classes:
        c = c_side.get(cls._c_name)
        if c is None:
            out.append(f"{cls._c_name}: not described by the library")
            continue
        if not hasattr(cls, "_fields_"):
            out.append(f"{cls._c_name}: its fields could not be read from the library")
            continue
        ours = [getattr(cls, name).offset for name, *_ in cls._fields_ if not name.startswith("_")]
        theirs = [o for _, o in c["fields"]]
        if ctypes.sizeof(cls) != c["size"] or ours != theirs:
            out.append(f"{cls._c_name}: {c['size']} bytes, fields at {theirs} in C; {ctypes.sizeof(cls)} bytes, "
                       f"fields at {ours} here")
    return out



def metric_columns():
    """[(name, flags)] of kvq-analyze's metric columns, in their order (kvq_metric_column; flags: 1 an
    attention column, 2 shown in the table)."""
    L, out, i = lib(), [], 0
    name, flags = c_char_p(), ctypes.c_uint()
    while L.kvq_metric_column(i, ctypes.byref(name), ctypes.byref(flags)):
        out.append((name.value.decode(), flags.value))
        i += 1
    return out


def _candidates():
    env = os.environ.get("KVQ_LIBRARY")
    if env:
        return [env]
    out = []
    # installed by pip (a meson-python wheel): the library beside the package, first (the
    # _where.py of a wheel names the build's prefix, not the venv)
    wheel = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".kvq.mesonpy.libs", "libkvq.so.0")
    if os.path.exists(wheel):
        out.append(os.path.normpath(wheel))
    try:
        from . import _where  # written by meson: the build tree's library, or the installed one
        out.append(_where.LIBRARY)
    except ImportError:
        pass
    out += ["libkvq.so.0", "libkvq.so"]  # the loader's search path
    return out


def lib():
    """The loaded libkvq (ctypes.CDLL), its functions typed."""
    global _lib
    if _lib is not None:
        return _lib
    tried = []
    for path in _candidates():
        try:
            handle = ctypes.CDLL(path)
        except OSError as e:
            tried.append(f"{path} ({e})")
            continue
        _mirror_metrics(handle)
        bad = abi_mismatches(handle)
        if bad:  # a library built from other headers than this package mirrors
            tried.append(f"{path} (laid out differently from this kvq package: {'; '.join(bad[:2])}; rebuild both)")
            continue
        for name, (res, args) in _SIGNATURES.items():
            fn = getattr(handle, name)
            fn.restype, fn.argtypes = res, args
        _lib = handle
        from . import _blas
        _blas.note(handle)
        _blas.check(handle)
        return _lib
    raise Error("cannot load libkvq: tried " + "; ".join(tried) +
                " (build it with meson, then import kvq from BUILD/python, or set KVQ_LIBRARY to libkvq.so)",
                "io")


def warn_notes(stacklevel=3):
    """The library's notes of the last calls (kvq_take_notes: what is not an error
    but should be said, e.g. a vq codebook with fewer distinct training points than
    centres), each as a RuntimeWarning."""
    import warnings
    buf = ctypes.create_string_buffer(4096)
    lib().kvq_take_notes(buf, len(buf))
    for line in buf.value.decode(errors="replace").splitlines():
        warnings.warn("kvq: note: " + line, RuntimeWarning, stacklevel=stacklevel)


def new_error():
    return _Err()


def check(status, err):
    """Raises Error with the library's message when status is not KVQ_OK."""
    if status:
        kind = _STATUS[status] if 0 <= status < len(_STATUS) else str(status)
        raise Error(err.msg.decode("utf-8", "replace"), kind)

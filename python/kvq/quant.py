"""quant.py — the quantizer registry, a quantizer on one layer's arrays, and
whole analyses, over libkvq (lib/kvq.h: kvq_quantize_arrays,
kvq_analyze_rows: its rows as values, no CSV between).  Every number is
the one kvq-analyze computes."""
import collections
import contextlib
import ctypes
import os
import threading

import numpy as np

from . import _lib
from ._arrays import as_f32, dptr, fptr
from ._lib import Error

_TYPES = {0: "int", 1: "real", 2: "choice"}
_STYLES = {None: 0, "interleaved": 1, "half": 2}


def __getattr__(name):  # RECON_COLUMNS: the library's metric columns that are not attention ones
    if name == "RECON_COLUMNS":
        return tuple(n for n, flags in _lib.metric_columns() if not flags & 1)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _params(L, q):
    params = []
    for j in range(L.kvq_quantizer_nparams(q)):
        p = L.kvq_quantizer_param(q, j).contents
        choices = p.choices.decode().split("|") if p.choices else None
        integer = _TYPES[p.type] == "int"
        params.append(dict(key=p.key.decode(), type=_TYPES[p.type],
                           default=p.default.decode() if p.default else None,
                           min=None if choices else int(p.min) if integer else p.min,
                           max=None if choices else int(p.max) if integer else p.max, choices=choices,
                           help=p.help.decode() if p.help else ""))
    return params


def quantizers():
    """The registry, as `kvq-analyze --list-quantizers` prints it: one dict
    per family (name, description, params, needs_calib, in_default_set,
    reads_key_pre_rope, example_spec: a non-default spec that takes the
    family's own paths); each param a dict (key, type, default, min, max,
    choices, help; an int's bounds as ints).  The composite specs are not
    families: mix(RANGE=SPEC;...) and tokens(SELECT; HI; LO), whose
    selectors kvq.selectors() lists."""
    L, out = _lib.lib(), []
    for i in range(L.kvq_quantizer_count()):
        q = L.kvq_quantizer_at(i)
        name = L.kvq_quantizer_name(q).decode()
        spec, err = _lib.Spec(), _lib.new_error()
        _lib.check(L.kvq_spec_parse(name.encode(), ctypes.byref(spec), ctypes.byref(err)), err)
        out.append(dict(name=name, description=L.kvq_quantizer_description(q).decode(), params=_params(L, q),
                        needs_calib=bool(L.kvq_spec_needs_calib(ctypes.byref(spec))),
                        in_default_set=bool(L.kvq_quantizer_in_default_set(q)),
                        reads_key_pre_rope=bool(L.kvq_quantizer_read_flags(q) & 2),
                        example_spec=f"{name}:{L.kvq_quantizer_example_spec(q).decode()}"))
    return out


def selectors():
    """The token selectors of tokens(SELECT; HI; LO) (docs/quantizers.md#tokens),
    as `kvq-analyze --list-quantizers` prints them: one dict per selector
    (name, description, params as in quantizers(), needs_queries: it scores
    by attention and reads the queries)."""
    L = _lib.lib()
    out = []
    for i in range(L.kvq_selector_count()):
        q = L.kvq_selector_at(i)
        out.append(dict(name=L.kvq_quantizer_name(q).decode(), description=L.kvq_quantizer_description(q).decode(),
                        params=_params(L, q), needs_queries=bool(L.kvq_selector_needs_queries(i))))
    return out


def check_spec(spec, head_dim=None):
    """Raises Error (status "usage") if the spec does not parse or, given
    head_dim, cannot run on heads of that many channels (a block that does
    not divide it); returns the spec with every key written out."""
    L, sp, err = _lib.lib(), _lib.Spec(), _lib.new_error()
    _lib.check(L.kvq_spec_parse(_text(spec, "spec"), ctypes.byref(sp), ctypes.byref(err)), err)
    if head_dim is not None:
        _check_int(head_dim, "head_dim", 1)
        _lib.check(L.kvq_spec_check_shape(ctypes.byref(sp), head_dim, ctypes.byref(err)), err)
    buf = ctypes.create_string_buffer(1024)
    L.kvq_spec_format_full(ctypes.byref(sp), buf, len(buf))
    return buf.value.decode()


def spec_full(spec):
    """The spec with every key written out (defaults filled in), as the
    `spec` column of a sweep point; raises Error for a bad spec."""
    return check_spec(spec)


def _text(s, what):
    if not isinstance(s, str):
        raise Error(f"{what}: expected a string, got {type(s).__name__}")
    if "\0" in s:
        raise Error(f"{what}: contains a NUL character")
    try:
        return s.encode()
    except UnicodeEncodeError as e:  # a lone surrogate
        raise Error(f"{what}: not text that UTF-8 can hold ({e.reason} at character {e.start})") from None


class Calibration:
    """A calibration dump (`kvq-analyze --calib`) and the states fitted on it
    (k-means centres, codebooks), computed on first use per layer and spec
    and kept while the object lives (or `with kvq.Calibration(path) as c:`
    closes it at the block's end).  Paths given as `calib=` are opened once
    per process and shared."""

    def __init__(self, path):
        L, err, h = _lib.lib(), _lib.new_error(), ctypes.c_void_p()
        self._h, self.path = None, os.fspath(path)
        # one call at a time holds the handle: libkvq fits a calibration's states on first use and
        # does not lock them, and close() waits for the call in progress
        self._lock = threading.Lock()
        _lib.check(L.kvq_calib_open(_text(os.fspath(path), "calib"), ctypes.byref(h), ctypes.byref(err)), err)
        self._h = h

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def close(self):
        """Frees the states; waits for a call using them in another thread to
        end first (a call started after close() raises kvq.Error)."""
        lock = getattr(self, "_lock", None)
        if lock is None:  # __init__ failed before the lock existed
            return
        with lock:
            h, self._h = self._h, None
        if h:
            _lib.lib().kvq_calib_close(h)

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    @contextlib.contextmanager
    def using(self):
        """The handle for one call into libkvq, held until the call ends; calls
        that share a Calibration run one at a time (libkvq fits its states on
        first use without a lock of its own)."""
        with self._lock:
            if not self._h:
                raise Error(f"{self.path}: the calibration was closed")
            yield self._h

    @property
    def handle(self):
        if not self._h:
            raise Error(f"{self.path}: the calibration was closed")
        return self._h


_calibs = {}


def calibration(calib):
    """None, a Calibration, or a path (opened once per file version)."""
    if calib is None or isinstance(calib, Calibration):
        return calib
    try:
        path = os.fspath(calib)
    except TypeError:
        raise Error(f"calib: expected a path or kvq.Calibration, got {type(calib).__name__}") from None
    try:
        st = os.stat(path)
        key = (os.path.realpath(path), st.st_mtime_ns, st.st_size)
    except OSError:
        key = None
    if key is None:
        return Calibration(path)  # raises the library's message
    if key not in _calibs:
        _calibs[key] = Calibration(path)
    return _calibs[key]


def _rope(rope, T, D):
    """(cos, sin, theta, style) for kvq_quantize_arrays from None or a dict
    {style, theta} / {style, cos, sin} (read_dump's `rope` is one)."""
    if rope is None:
        return None, None, 0.0, 0
    if not isinstance(rope, dict):
        raise Error("rope: expected None or a dict {'style': 'interleaved'|'half', 'theta': X} "
                    "or {'style': ..., 'cos': [T,D/2], 'sin': [T,D/2]}")
    style = rope.get("style")
    if style not in ("interleaved", "half"):
        raise Error(f"rope: style: expected 'interleaved' or 'half', got {style!r}")
    if rope.get("cos") is not None or rope.get("sin") is not None:
        tabs = []
        for k in ("cos", "sin"):
            a = np.asarray(rope.get(k), dtype=np.float64)
            if a.ndim != 2 or a.shape[0] < T or a.shape[1] != D // 2:
                raise Error(f"rope: {k}: expected [T,{D // 2}] with T >= {T}, got shape {list(a.shape)}")
            tabs.append(np.ascontiguousarray(a[:T]))
        return tabs[0], tabs[1], 0.0, _STYLES[style]
    try:
        theta = float(rope.get("theta"))
    except (TypeError, ValueError):
        theta = float("nan")
    if not theta > 0 or theta == float("inf"):
        raise Error(f"rope: theta: expected a positive number, got {rope.get('theta')!r}")
    return None, None, theta, _STYLES[style]


def _metrics(acc):
    m = _lib.Metrics()
    _lib.lib().kvq_metrics_finalize(ctypes.byref(acc), ctypes.byref(m))
    return {c: getattr(m, c) for c, flags in _lib.metric_columns() if not flags & 1}


class Quantized(collections.namedtuple("Quantized", "key value k_bits v_bits static_bytes")):
    """kvq.quantize's result: key', value' (float32 numpy, the input's shape),
    k_bits, v_bits (stored bits per element) and static_bytes, as
    kvq-analyze's row of the layer; also .metrics (that row's reconstruction
    columns), .head_metrics (one dict per KV head, its --per head rows) and
    .keep, a bool [H,T] array: the tokens a tokens(...) selector kept (stored
    by HI; the others by LO, or evicted — zero rows — when LO is drop), all
    True for a spec that selects nothing."""


INT_MAX = 2 ** 31 - 1  # a C int (layers, heads)
MAX_THREADS = 4096  # KVQ_MAX_THREADS, as the tools' --threads


def _check_int(v, what, lo=0, hi=INT_MAX):
    """v as a Python int in [lo, hi]: ctypes would wrap anything outside what C holds."""
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or not lo <= v <= hi:
        raise Error(f"{what}: expected an integer {lo}..{hi}, got {v!r}")
    return int(v)


def _check_seed(v):
    return _check_int(v, "seed", 0, 2 ** 64 - 1)


def _check_threads(v):
    return _check_int(v, "threads (0: as many as the work keeps busy)", 0, MAX_THREADS)


def quantize(spec, key, value, *, layer=0, key_pre_rope=None, query=None, rope=None, calib=None, seed=0, threads=0,
             copy=True, out=None):
    """Quantize one layer's keys and values with `spec` (e.g. "kivi:bits=2")
    exactly as `kvq-analyze --seed SEED` does for layer `layer` of a dump
    holding these tensors: [H,T,D] (or [1,H,T,D]) arrays or tensors of any
    float dtype.  Returns a Quantized (key', value', k_bits, v_bits,
    static_bytes, .metrics, .head_metrics).  `rope` (a dict, see docs) and
    `key_pre_rope` feed quantizers that re-apply RoPE to pre-RoPE keys;
    `calib` (a path or kvq.Calibration) the calibrated ones; `query`
    ([Hq,T,D] post-RoPE, Hq a multiple of H) the tokens(...) selectors that
    score by attention (h2o, zipcache, snapkv, tova).  float32
    C-contiguous input is read in place; copy=False makes any conversion an
    Error instead.  out=(key_out, value_out): float32 C-contiguous arrays of
    the input's shape to write K', V' into (no allocation per call)."""
    layer, seed, threads = _check_int(layer, "layer"), _check_seed(seed), _check_threads(threads)
    spec_b = _text(spec, "spec")
    k = as_f32(key, "key", copy, (3, 4))
    batch4 = k.ndim == 4
    if batch4:
        if k.shape[0] != 1:
            raise Error(f"key: shape {list(k.shape)}: one sequence at a time (batch 1; kvq.DecodeCache "
                        f"keeps a cache per sequence)")
        k = k[0]
    H, T, D = k.shape
    arrays = {}
    if query is not None:
        qa = as_f32(query, "query", copy, (3, 4))
        if qa.ndim == 4 and qa.shape[0] == 1:
            qa = qa[0]
        if qa.ndim != 3 or qa.shape[1:] != (T, D) or qa.shape[0] % H:
            raise Error(f"query: expected [Hq, {T}, {D}] with Hq a multiple of {H}, got {list(qa.shape)}")
        arrays["query"] = qa
    for name, x in (("value", value), ("key_pre_rope", key_pre_rope)):
        if x is None:
            if name == "value":
                raise Error("value: expected an array")
            continue
        a = as_f32(x, name, copy, (3, 4))
        if a.ndim == 4 and a.shape[0] == 1:
            a = a[0]
        if a.shape != (H, T, D):
            raise Error(f"{name}: expected {[H, T, D]} like key, got {list(a.shape)}")
        arrays[name] = a
    cos, sin, theta, style = _rope(rope, T, D)
    cal = calibration(calib)
    if out is None:
        kq, vq = np.empty((H, T, D), np.float32), np.empty((H, T, D), np.float32)
    else:
        try:
            kq, vq = out
        except (TypeError, ValueError):
            raise Error("out: expected (key_out, value_out)") from None
        for name, o in (("out[0]", kq), ("out[1]", vq)):
            if not isinstance(o, np.ndarray) or o.dtype != np.float32 or not o.flags.c_contiguous or \
                    not o.flags.writeable or o.shape not in ((H, T, D), (1, H, T, D)):
                raise Error(f"{name}: expected a writeable float32 C-contiguous array of shape {[H, T, D]}")
        if np.shares_memory(kq, vq):
            raise Error("out: key_out and value_out overlap")
        for name, o in (("out[0]", kq), ("out[1]", vq)):  # written while the inputs are read
            for iname, i in (("key", k), ("value", arrays["value"]), ("key_pre_rope", arrays.get("key_pre_rope")),
                             ("query", arrays.get("query"))):
                if i is not None and np.shares_memory(o, i):
                    raise Error(f"{name}: overlaps the input {iname}: give outputs of their own")
        kq, vq = kq.reshape(H, T, D), vq.reshape(H, T, D)
    accs = (_lib.Acc * H)()
    L, err = _lib.lib(), _lib.new_error()
    keep = np.empty((H, T), np.uint8)
    qa = arrays.get("query")
    with cal.using() if cal else contextlib.nullcontext() as ch:  # not closed while libkvq uses it
        opts = _lib.ArraysOpts(spec=spec_b, layer=layer, seed=seed, nthreads=threads, rope_cos=dptr(cos),
                               rope_sin=dptr(sin), rope_theta=theta, rope_style=style, calib=ch, query=fptr(qa),
                               num_heads=qa.shape[0] if qa is not None else 0,
                               keep=keep.ctypes.data_as(ctypes.POINTER(ctypes.c_ubyte)))
        st = L.kvq_quantize_arrays(ctypes.byref(opts), H, T, D, fptr(k), fptr(arrays["value"]),
                                   fptr(arrays.get("key_pre_rope")), fptr(kq), fptr(vq), accs, ctypes.byref(err))
    _lib.check(st, err)
    _lib.warn_notes()
    pooled = _lib.Acc()
    for h in range(H):  # in head order, as kvq-analyze pools a layer
        L.kvq_acc_merge(ctypes.byref(pooled), ctypes.byref(accs[h]))
    m = _metrics(pooled)
    if out is not None:
        kq, vq = out
    elif batch4:
        kq, vq = kq[None], vq[None]
    r = Quantized(kq, vq, m["k_bits"], m["v_bits"], m["static_bytes"])
    r.metrics, r.head_metrics = m, [_metrics(accs[h]) for h in range(H)]
    r.keep = keep.astype(bool)
    return r


_PER = {"head": 0, "layer": 1, "model": 2}
def _int_list(v, what):
    if v is None:
        return None, 0
    v = [_check_int(x, what) for x in ([v] if isinstance(v, (int, np.integer)) else v)]
    if not v:
        raise Error(f"{what}: expected at least one index")
    return (ctypes.c_int * len(v))(*v), len(v)


def _dump_in_memory(d, keep):
    """kvq_dump_mem over read_dump's dict or a list of layer dicts, checked
    as write_dump checks them; the arrays it points to are appended to keep."""
    from .dump import DumpError, check_attrs, checked_layers
    attrs = d if isinstance(d, dict) else {}
    layers = d["layers"] if isinstance(d, dict) else d
    model = attrs.get("model") or "layers"
    rope = attrs.get("rope") or {}
    theta, style = rope.get("theta"), rope.get("style")
    check_attrs(model, theta, style)
    arrays, (H, T, D, Hq, _) = checked_layers(layers, None, "BHTD")
    n = len(arrays)
    lays = (_lib.Layer * n)()
    for i, a in enumerate(arrays):
        f32 = {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in a.items()}
        keep.append(f32)
        lays[i] = _lib.Layer(H=H, Hq=Hq or H, T=T, D=D, key=fptr(f32["key"]), value=fptr(f32["value"]),
                             query=fptr(f32.get("query")), key_pre_rope=fptr(f32.get("key_pre_rope")))
    m = _lib.DumpMem(name=b"layers", model=model.encode(), layers=lays, nlayers=n,
                     rope_theta=float(theta) if theta is not None else 0.0,
                     rope_style={None: 0, "interleaved": 1, "half": 2}[style],
                     query_prescaled=int(bool(attrs.get("query_prescaled"))),
                     attn_scale=float(attrs.get("attn_scale") or 0.0), attn_softcap=float(attrs.get("attn_softcap") or 0.0))
    keep.append(lays)
    windows = attrs.get("windows")
    if windows is not None:
        if len(windows) != n or any(not isinstance(w, (int, np.integer)) or not 0 <= w < 2 ** 31 for w in windows):
            raise DumpError(f"windows: expected one sliding window (0: none) per layer, {n} in all, got {windows!r}")
        win = (ctypes.c_int * n)(*windows)
        keep.append(win)
        m.windows = win
    if theta is None and rope.get("cos") is not None:  # explicit RoPE tables (a dump without rope_theta)
        for k in ("cos", "sin"):
            t = np.ascontiguousarray(rope[k], dtype=np.float64)
            if t.shape != (T, D // 2):
                raise DumpError(f"rope.{k}: expected [{T},{D // 2}], got {list(t.shape)}")
            keep.append(t)
            setattr(m, "rope_" + k, dptr(t))
    return m


def analyze(dump_or_layers, specs, *, per="layer", queries="last:64", calib=None, seed=0, layers=None, heads=None,
            threads=0, label=None):
    """kvq-analyze as a function: the rows `kvq-analyze --format csv` prints
    for one dump — a path, or in memory read_dump's dict or a list of layer
    dicts as write_dump takes them (read as that dump, no file written) — as
    dicts, each as parse_rows reads the CSV row (kvq_analyze_rows gives the
    values themselves, so no text is written and read again).  specs: a
    spec or a list."""
    if isinstance(specs, str):
        specs = [specs]
    specs = list(specs)
    if not specs:
        raise Error("specs: expected at least one quantizer spec")
    enc = [_text(s, "specs") for s in specs]
    if per not in _PER:
        raise Error(f"per: expected 'head', 'layer' or 'model', got {per!r}")
    lay, nlay = _int_list(layers, "layers")
    hd, nhd = _int_list(heads, "heads")
    seed, threads = _check_seed(seed), _check_threads(threads)
    cal = calibration(calib)
    keep, mem = [], None  # keep: the arrays mem points to, alive for the call
    if isinstance(dump_or_layers, (str, os.PathLike)):
        path = os.fspath(dump_or_layers)
        name = label if label is not None else os.path.basename(path)
    else:
        mem = _dump_in_memory(dump_or_layers, keep)
        name = label if label is not None else "layers"
    L, err = _lib.lib(), _lib.new_error()
    rows, nrows = ctypes.POINTER(_lib.AnalysisRow)(), ctypes.c_size_t()
    arr = (ctypes.c_char_p * len(enc))(*enc)
    ip = ctypes.POINTER(ctypes.c_int)  # the arrays stay alive in arr, lay, hd for the call
    opts = _lib.AnalyzeCsvOpts(label=_text(name, "label"), specs=ctypes.cast(arr, ctypes.POINTER(ctypes.c_char_p)),
                               nspecs=len(enc), per=_PER[per], layers=ctypes.cast(lay, ip) if lay else None,
                               nlayers=nlay, heads=ctypes.cast(hd, ip) if hd else None, nheads=nhd,
                               queries=_text(queries, "queries"), calib=None, seed=seed, nthreads=threads)
    with cal.using() if cal else contextlib.nullcontext() as ch:  # not closed while libkvq uses it
        opts.calib = ch
        st = L.kvq_analyze_rows(None if mem is not None else _text(path, "dump"),
                                ctypes.byref(mem) if mem is not None else None, ctypes.byref(opts),
                                ctypes.byref(rows), ctypes.byref(nrows), ctypes.byref(err))
    _lib.check(st, err)
    _lib.warn_notes()
    try:
        cols = _lib.metric_columns()
        return [_row_dict(name, rows[i], cols) for i in range(nrows.value)]
    finally:
        L.kvq_free(rows)


def _row_dict(dump, r, cols):
    """A kvq_analysis_row as parse_rows reads the same CSV row: layer and head int or "all", the metric
    columns floats in kvq_metric_column's order, an attention column None when the row has no attention."""
    row = {"dump": dump, "layer": "all" if r.layer < 0 else r.layer, "head": "all" if r.head < 0 else r.head,
           "quantizer": r.quantizer.decode(), "spec": r.spec.decode()}
    for col, flags in cols:
        row[col] = None if flags & 1 and not r.m.has_attn else float(getattr(r.m, col))
    return row

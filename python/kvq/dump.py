"""dump.py — kvq-dump/1 files (docs/dump-format.md) from Python:
write_dump from tensors you already have (no hand-written HDF5 code; needs
h5py, imported when called), read_dump through libkvq's own reader.

    from kvq import write_dump
    write_dump("dump.h5", layers, model="my-model", rope_theta=1e4, rope_style="half")

`layers` is a list (one entry per layer) of dicts with "key", "value" and
optionally "query", "key_pre_rope": numpy arrays or torch tensors of shape
[H, T, D] ([Hq, T, D] for queries), or [B, H, T, D] (Hugging Face's order)
with `batch` picking one sequence; tensors in flash-attention / vLLM order,
[B, T, H, D] or [T, H, D], need layout="BTHD" (they are transposed).  A
4-D layout mix-up is detected where the shapes allow it (grouped-query
attention: T agrees and H does not).  float16 and float32 are written as
they are; bfloat16 (and float64) are widened/narrowed to float32.  The file
is written to a temporary name in the same directory and renamed into place;
only a regular file (or none) is replaced — a symlink's target is written,
and a FIFO, device or directory at the path is refused — and the file gets
the mode a new file would (0666 less the umask), or the replaced file's.
tools/kvq_dump.py keeps the old import path working.
"""
import math
import os
import stat
import tempfile

import numpy as np

__all__ = ["write_dump", "read_dump", "DumpError"]

_FORMAT = "kvq-dump/1"


from ._lib import Error, UsageError


class DumpError(UsageError):
    """A tensor or argument that kvq-dump/1 cannot hold; the message names it
    (a kvq.UsageError, so also a ValueError)."""

    def __init__(self, message):
        super().__init__(message, "usage")


def _to_numpy(x, what, batch, layout):
    if hasattr(x, "detach"):  # a torch tensor
        x = x.detach()
        if str(x.dtype) in ("torch.bfloat16",):
            x = x.float()
        x = x.cpu().numpy()
    x = np.asarray(x)
    if x.dtype.name == "bfloat16":  # ml_dtypes / jax arrays
        x = x.astype(np.float32)
    if x.ndim == 4:
        if batch is None:
            raise DumpError(f"{what}: shape {list(x.shape)} has a batch axis: pass batch=INDEX")
        if not 0 <= batch < x.shape[0]:
            raise DumpError(f"{what}: batch={batch}: expected 0..{x.shape[0] - 1}")
        x = x[batch]
    elif x.ndim != 3:
        raise DumpError(f"{what}: expected [H,T,D] or [B,H,T,D], got shape {list(x.shape)}")
    if layout == "BTHD":  # [T, H, D] -> [H, T, D]
        x = x.transpose(1, 0, 2)
    if 0 in x.shape:
        raise DumpError(f"{what}: shape {list(x.shape)} is empty: expected at least one head, token and channel")
    if x.dtype == np.float64:
        x = x.astype(np.float32)
    if x.dtype not in (np.float16, np.float32):
        raise DumpError(f"{what}: expected float16, bfloat16 or float32 values, got {x.dtype}")
    if not np.isfinite(x).all():
        raise DumpError(f"{what}: expected finite values (found nan or inf)")
    return np.ascontiguousarray(x)


def _target(path):
    """The file the dump replaces: path with its links followed; refuses what is not a
    regular file (a FIFO, a device, a directory) and a symlink loop."""
    try:
        os.stat(path)
    except FileNotFoundError:
        pass
    except OSError as e:  # ELOOP, EACCES, ...
        raise DumpError(f"{path}: cannot use as the output: {e.strerror}") from None
    target = os.path.realpath(path)
    try:
        st = os.stat(target)
    except FileNotFoundError:
        return target, None
    if not stat.S_ISREG(st.st_mode):
        raise DumpError(f"{path}: not a regular file (a FIFO, device or directory is never replaced)")
    return target, stat.S_IMODE(st.st_mode)


def _layout_hint(i, a):
    """With grouped-query attention a [B,T,H,D] tensor read as [B,H,T,D] shows: T agrees
    and H does not (query [Hq,T,D] vs key [H,T,D] become [T,Hq,D] vs [T,H,D])."""
    k, q = a["key"].shape, a["query"].shape
    if q[0] == k[0] and q[1] != k[1] and q[1] % k[1] == 0:
        return (f"layers[{i}]: query {list(q)} and key {list(k)} look like [T,H,D] (flash-attention / vLLM "
                f"order [B,T,H,D]), not [H,T,D] (Hugging Face's [B,H,T,D]): pass layout=\"BTHD\"")
    return None


def check_attrs(model, rope_theta, rope_style):
    """The root attributes a dump takes (write_dump, and kvq.analyze on
    arrays, which reads them as a dump's); DumpError on bad ones."""
    if not isinstance(model, str) or not model:
        raise DumpError("model: expected a non-empty string")
    if "\0" in model:
        raise DumpError("model: contains a NUL character (an HDF5 string cannot hold one)")
    try:
        model.encode()
    except UnicodeEncodeError as e:
        raise DumpError(f"model: not text that UTF-8 can hold ({e.reason} at character {e.start})") from None
    if rope_style not in (None, "interleaved", "half"):
        raise DumpError(f'rope_style: expected "interleaved" or "half", got {rope_style!r}')
    if rope_theta is not None:
        try:
            theta = float(rope_theta)
        except (TypeError, ValueError):
            theta = math.nan
        if not (theta > 0 and math.isfinite(theta)):
            raise DumpError(f"rope_theta: expected a positive finite number, got {rope_theta!r}")


def checked_layers(layers, batch, layout):
    """The layers' tensors as [H,T,D] float16/float32 C-contiguous numpy
    arrays, checked as write_dump checks them: (arrays, (H, T, D, Hq or
    None, has key_pre_rope)); DumpError on anything else."""
    if layout not in ("BHTD", "BTHD"):
        raise DumpError(f'layout: expected "BHTD" ([B,]H,T,D: Hugging Face) or "BTHD" ([B,]T,H,D: '
                        f'flash-attention / vLLM), got {layout!r}')
    layers = list(layers)
    if not layers:
        raise DumpError("layers: expected at least one layer")
    arrays, shape = [], None
    for i, layer in enumerate(layers):
        if not isinstance(layer, dict) or layer.get("key") is None or layer.get("value") is None:
            raise DumpError(f"layers[{i}]: expected a dict with 'key' and 'value'")
        unknown = set(layer) - {"key", "value", "query", "key_pre_rope"}
        if unknown:
            raise DumpError(f"layers[{i}]: unknown entries {sorted(unknown)} (expected key, value, query, key_pre_rope)")
        a = {k: _to_numpy(v, f"layers[{i}].{k}", batch, layout) for k, v in layer.items() if v is not None}
        H, T, D = a["key"].shape
        if "query" in a and layout == "BHTD":
            hint = _layout_hint(i, a)
            if hint:
                raise DumpError(hint)
        for k in ("value", "key_pre_rope"):
            if k in a and a[k].shape != (H, T, D):
                raise DumpError(f"layers[{i}].{k}: expected {[H, T, D]} like key, got {list(a[k].shape)}")
        if "query" in a:
            Hq = a["query"].shape[0]
            if a["query"].shape[1:] != (T, D) or Hq % H:
                raise DumpError(f"layers[{i}].query: expected [Hq,{T},{D}] with Hq a multiple of {H}, "
                                f"got {list(a['query'].shape)} (tensors are read as [H,T,D] / [B,H,T,D]; "
                                f"for [T,H,D] / [B,T,H,D] pass layout=\"BTHD\")")
        this = (H, T, D, a["query"].shape[0] if "query" in a else None, "key_pre_rope" in a)
        if shape is not None and this != shape:
            raise DumpError(f"layers[{i}]: shapes or tensors differ from layers[0] "
                            f"(H, T, D, Hq, key_pre_rope = {this} vs {shape})")
        shape = this
        arrays.append(a)
    return arrays, shape


def write_dump(path, layers, *, model, batch=None, rope_theta=None, rope_style=None,
               query_prescaled=False, layout="BHTD"):
    """Write `layers` to `path` as kvq-dump/1; raises DumpError on bad input."""
    try:  # imported here: everything but writing dumps works without h5py
        import h5py
    except ImportError as e:
        raise ImportError(f"kvq.write_dump needs h5py: "
                          f"apt install python3-h5py or pip install h5py ({e})") from None

    if not isinstance(path, (str, os.PathLike)) or not str(path):
        raise DumpError("path: expected a file name")
    check_attrs(model, rope_theta, rope_style)
    arrays, shape = checked_layers(layers, batch, layout)
    H, T, D, Hq, _ = shape
    target, mode = _target(os.fspath(path))
    if mode is None:  # a new file: what open(2) with 0666 would give under the umask
        umask = os.umask(0)
        os.umask(umask)
        mode = 0o666 & ~umask
    fd, tmp = tempfile.mkstemp(prefix=os.path.basename(target) + ".tmp.", dir=os.path.dirname(target))
    os.close(fd)
    try:
        with h5py.File(tmp, "w") as f:
            f.attrs.update(kvq_format=_FORMAT, model=model, num_layers=len(arrays),
                           num_heads=Hq if Hq is not None else H, num_kv_heads=H, head_dim=D, seq_len=T,
                           query_prescaled=int(bool(query_prescaled)))
            if rope_theta is not None:
                f.attrs["rope_theta"] = float(rope_theta)
            if rope_style is not None:
                f.attrs["rope_style"] = rope_style
            for i, a in enumerate(arrays):
                g = f.create_group(f"layer_{i:03d}")
                for k, v in a.items():
                    g[k] = v
            f.flush()
            os.fsync(f.id.get_vfd_handle())
        os.chmod(tmp, mode)
        os.replace(tmp, target)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


_STYLE_NAMES = {1: "interleaved", 2: "half"}


def read_dump(path, *, layers=None, query=True, key_pre_rope=True):
    """A kvq-dump/1 file as a dict, read and checked by libkvq (float16 and
    float64 datasets arrive as float32): model, num_layers, num_heads,
    num_kv_heads, head_dim, seq_len, query_prescaled, attn_scale,
    attn_softcap, rope ({style, theta, cos, sin} or None), tokens (int32 or
    None), windows (each layer's sliding_window, 0 = none) and layers (one
    dict per layer: key, value and, when present, query and key_pre_rope,
    [H,T,D] float32) — `layers` (indices) reads only those; the dict can be
    given to write_dump and kvq.analyze."""
    import ctypes

    import numpy as np

    from . import _lib
    L, err, d = _lib.lib(), _lib.new_error(), ctypes.c_void_p()
    if not isinstance(path, (str, os.PathLike)):
        raise Error(f"path: expected a file name, got {type(path).__name__}")
    _lib.check(L.kvq_dump_open(os.fspath(path).encode(), ctypes.byref(d), ctypes.byref(err)), err)
    try:
        info = L.kvq_dump_get_info(d).contents
        nl = info.num_layers
        which = list(range(nl)) if layers is None else [int(i) for i in layers]
        for i in which:
            if not 0 <= i < nl:
                raise Error(f"{os.fspath(path)}: layer {i}: expected 0..{nl - 1} (the dump has {nl})")
        out = dict(model=L.kvq_dump_model(d).decode("utf-8", "replace"), num_layers=nl, num_heads=info.num_heads,
                   num_kv_heads=info.num_kv_heads, head_dim=info.head_dim, seq_len=info.seq_len,
                   query_prescaled=bool(info.query_prescaled), attn_scale=info.attn_scale or None,
                   attn_softcap=info.attn_softcap or None, rope=None, tokens=None)
        rope = _lib.Rope()
        if info.rope_style and L.kvq_dump_read_rope(d, ctypes.byref(rope), ctypes.byref(err)) == 0:
            n = rope.T * (rope.D // 2)
            shape = (rope.T, rope.D // 2)
            out["rope"] = dict(style=_STYLE_NAMES[rope.style],
                               theta=info.rope_theta if info.has_rope_theta else None,
                               cos=np.ctypeslib.as_array(rope.cos, (n,)).reshape(shape).copy(),
                               sin=np.ctypeslib.as_array(rope.sin, (n,)).reshape(shape).copy())
            L.kvq_rope_free(ctypes.byref(rope))
        toks, ntok = ctypes.POINTER(ctypes.c_int)(), ctypes.c_size_t()
        if L.kvq_dump_has_tokens(d):  # a /tokens that is there but damaged raises
            _lib.check(L.kvq_dump_read_tokens(d, ctypes.byref(toks), ctypes.byref(ntok), ctypes.byref(err)), err)
        if toks:
            out["tokens"] = np.ctypeslib.as_array(toks, (ntok.value,)).astype(np.int32) if ntok.value else \
                np.zeros(0, np.int32)
            L.kvq_free(toks)
        out["windows"] = [L.kvq_dump_attn_mode(d, i).window for i in which]
        flags = (1 if query else 0) | (2 if key_pre_rope else 0)
        arrays = []
        for i in which:
            lay = _lib.Layer()
            _lib.check(L.kvq_dump_read_layer(d, i, flags, ctypes.byref(lay), ctypes.byref(err)), err)
            try:
                a = {}
                for name, heads in (("key", lay.H), ("value", lay.H), ("query", lay.Hq),
                                    ("key_pre_rope", lay.H)):
                    ptr = getattr(lay, name)
                    if ptr:
                        n = heads * lay.T * lay.D
                        a[name] = np.ctypeslib.as_array(ptr, (n,)).reshape(heads, lay.T, lay.D).copy()
                arrays.append(a)
            finally:
                L.kvq_layer_free(ctypes.byref(lay))
        out["layers"] = arrays
        return out
    finally:
        L.kvq_dump_close(d)

"""_arrays.py — what the package accepts as a tensor: numpy arrays of any
float dtype, torch tensors (moved to the CPU; bfloat16 and float16
widened), [H,T,D] or Hugging Face's [B,H,T,D]; float32 C-contiguous
arrays reach libkvq without a copy."""
import ctypes

import numpy as np

from ._lib import Error


MAX_DIM = 2 ** 31 - 1  # H, T and D reach libkvq as C ints


def to_numpy(x, what):
    """(x as a numpy array, why getting it converted the values or None):
    torch tensors detached and moved to the CPU, float16/bfloat16 widened."""
    why = None
    if hasattr(x, "detach") and hasattr(x, "cpu"):  # a torch tensor
        try:
            x = x.detach()
            device = str(getattr(x, "device", "cpu"))
            if device == "meta" or getattr(x, "is_meta", False):
                raise Error(f"{what}: a torch tensor on the 'meta' device has no values")
            if str(x.dtype) in ("torch.bfloat16", "torch.float16"):
                why = f"a torch {str(x.dtype)[6:]} tensor (widened to float32)"
                x = x.float()
            if not device.startswith("cpu"):
                why = f"a tensor on {device} (copied to the CPU)"
            x = x.cpu().numpy()
        except Error:
            raise
        except Exception as e:  # a tensor that cannot be read (sparse, quantized, ...)
            raise Error(f"{what}: cannot read the tensor's values ({type(e).__name__}: {e})") from None
    try:
        x = np.asarray(x)
    except Exception as e:  # ragged lists and the like
        raise Error(f"{what}: expected an array, got {type(x).__name__} ({e})") from None
    if x.dtype.name == "bfloat16":  # ml_dtypes / jax arrays
        x, why = x.astype(np.float32), "bfloat16 (widened to float32)"
    return x, why


def as_f32(x, what, copy=True, ranks=(3,)):
    """x as a float32 C-contiguous numpy array of one of `ranks`; without a
    copy when it already is one.  copy=False: Error instead of converting."""
    x, why = to_numpy(x, what)
    if x.ndim not in ranks:
        want = " or ".join({3: "[H,T,D]", 4: "[B,H,T,D]", 2: "[T,D/2]"}[r] for r in ranks)
        raise Error(f"{what}: expected {want}, got shape {list(x.shape)}")
    if x.dtype.kind != "f":
        raise Error(f"{what}: expected float16, bfloat16, float32 or float64 values, got {x.dtype}")
    if 0 in x.shape:
        raise Error(f"{what}: shape {list(x.shape)} is empty: expected at least one head, token and channel")
    if any(d > MAX_DIM for d in x.shape):
        raise Error(f"{what}: shape {list(x.shape)}: each dimension must be below 2^31")
    if why is not None and not copy:
        raise Error(f"{what}: {why}, and copy=False forbids converting it")
    if x.dtype != np.float32 or not x.flags.c_contiguous:
        if not copy:
            why = "not float32" if x.dtype != np.float32 else "not C-contiguous"
            raise Error(f"{what}: {why}, and copy=False forbids converting it")
        x = np.ascontiguousarray(x, dtype=np.float32)
    return x


def fptr(x):
    """A float* to a float32 C-contiguous array (or NULL for None)."""
    return None if x is None else x.ctypes.data_as(ctypes.POINTER(ctypes.c_float))


def dptr(x):
    return None if x is None else x.ctypes.data_as(ctypes.POINTER(ctypes.c_double))

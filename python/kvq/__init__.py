"""kvq — KV-cache quantizers, their metrics and a decode-time quantized cache
for Python, over libkvq (the library behind kvq-analyze and kvq-eval): the
same code, so every number equals the tools'.  numpy is the only
dependency; torch tensors are accepted (moved to the CPU; bfloat16 widened).

    import kvq
    r = kvq.quantize("kivi:bits=2", key, value)          # [H,T,D] or [1,H,T,D]
    r.key, r.value, r.k_bits, r.metrics["k_rel_fro"]
    rows = kvq.analyze("dump.h5", ["kivi:bits=2", "fp8"], per="model")
    rows, columns, meta = kvq.read_output("sweep.csv")    # any kvq tool's OUT
    tasks = kvq.tasks("kv", 100, 256, seed=1)            # retrieval tasks, as kvq-gen --task
    cache = kvq.DecodeCache("kivi:bits=2")                # in a model's own loop
    k_hat, v_hat = cache.update(layer, new_key, new_value)

Reference: docs/python.md (quantizers: docs/quantizers.md; columns:
docs/metrics.md)."""
from . import _blas

_blas.prepare()  # before numpy loads OpenBLAS (docs/performance.md#blas-kernels)
from ._lib import (Error, FileError, FormatError, NumericError, OutOfMemoryError, UnsupportedError,  # noqa: E402
                   UsageError)
from .cache import DecodeCache  # noqa: E402
from .dump import DumpError, read_dump, write_dump  # noqa: E402
from .output import parse_output, parse_rows, read_meta, read_output  # noqa: E402
from .quant import (Calibration, Quantized, analyze, check_spec, quantize, quantizers, selectors,  # noqa: E402
                    spec_full)
from .tasks import read_tasks, tasks, write_tasks  # noqa: E402

__all__ = ["Error", "UsageError", "FileError", "FormatError", "NumericError", "OutOfMemoryError", "UnsupportedError",
           "DumpError", "quantizers", "selectors", "quantize", "analyze", "DecodeCache", "Calibration", "Quantized",
           "read_dump", "write_dump", "parse_rows", "parse_output", "read_output", "read_meta", "spec_full",
           "check_spec", "tasks", "read_tasks", "write_tasks", "version", "blas"]


def version():
    """libkvq's version string (as the tools' --version)."""
    from ._lib import lib
    return lib().kvq_version().decode()


def blas():
    """The OpenBLAS kernels in use: {"core", "source", "cpu"} — the core, why it
    is that one (as OUT.meta.json's blas_core_source) and the best core this
    CPU runs (docs/performance.md#blas-kernels)."""
    import ctypes
    from ._lib import lib
    h = lib()
    buf = ctypes.create_string_buffer(256)
    h.kvq_blas_core_source(buf, 256)
    cpu = h.kvq_blas_core_for_cpu()
    return {"core": h.kvq_blas_core().decode(), "source": buf.value.decode(), "cpu": cpu.decode() if cpu else None}

"""_blas.py — OpenBLAS's kernels for the package (docs/performance.md#blas-kernels).

OpenBLAS picks its kernels (its "core") once, when it loads, from the CPUID;
on cloud VMs that mask the CPUID it may fall back to 2004's Prescott kernels,
a fifth of the machine's sgemm rate.  The tools restart themselves with
OPENBLAS_CORETYPE set; a Python process cannot, so:

- prepare(), run by `import kvq` before anything loads numpy: when no
  OpenBLAS is loaded yet and the user set no OPENBLAS_CORETYPE, it sets it to
  the core this CPU runs (as libkvq's kvq_blas_core_for_cpu decides: the
  generic core of the CPU's instruction sets, whose sgemm kernels are those
  of OpenBLAS's own pick when its detection works);
- check(lib), when libkvq loads: if OpenBLAS was loaded before (numpy imported
  first) with a core below the CPU's, one warning says how to fix it.

Nothing here changes a core the user set."""
import ctypes
import ctypes.util
import os
import warnings

_warned = False


def _openblas_loaded():
    try:
        with open("/proc/self/maps") as f:
            return any("openblas" in line.lower() for line in f)
    except OSError:
        return True  # cannot tell: leave it alone


def _cpu_core():
    """The core this CPU runs (x86-64 Linux), or None."""
    try:
        with open("/proc/cpuinfo") as f:
            info = f.read(1 << 16)
    except OSError:
        return None
    flags, vendor = set(), ""
    for line in info.splitlines():
        key, _, val = line.partition(":")
        key = key.strip()
        if key == "flags" and not flags:
            flags = set(val.split())
        elif key == "vendor_id" and not vendor:
            vendor = val.strip()
    amd = vendor in ("AuthenticAMD", "HygonGenuine")
    if {"avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512cd"} <= flags:
        return "SkylakeX"
    if {"avx2", "fma"} <= flags:
        return "Zen" if amd else "Haswell"
    if "avx" in flags:
        return "Bulldozer" if amd else "Sandybridge"
    return None


chosen = None  # the core prepare() chose, once OpenBLAS loaded with it


def _load_openblas():
    """The OpenBLAS libkvq links, by its soname (no ldconfig lookup at every import),
    else whatever the linker finds; OSError when there is none."""
    try:
        ctypes.CDLL("libopenblas.so.0", mode=ctypes.RTLD_GLOBAL)
    except OSError:
        ctypes.CDLL(ctypes.util.find_library("openblas") or "libopenblas.so", mode=ctypes.RTLD_GLOBAL)


def prepare():
    """Sets OPENBLAS_CORETYPE for OpenBLAS's load, loads it, and takes the
    variable out of the environment again: processes this one starts (a kvq
    tool) make or record their own choice, not ours."""
    global chosen
    if os.environ.get("OPENBLAS_CORETYPE") or _openblas_loaded():
        return
    core = _cpu_core()
    if not core:
        return
    os.environ["OPENBLAS_CORETYPE"] = core
    try:
        _load_openblas()  # it reads the variable as it loads
        chosen = core
    except OSError:
        pass  # no OpenBLAS to load now: libkvq's own (if any) loads later, without our choice
    finally:
        del os.environ["OPENBLAS_CORETYPE"]


def note(lib):
    """Tells libkvq the core prepare() chose (kvq_blas_core_source says so)."""
    if chosen:
        lib.kvq_blas_note_choice(chosen.encode())


def check(lib):
    """After libkvq loaded: one warning when OpenBLAS runs kernels below the CPU's
    and nobody chose them."""
    global _warned
    if _warned or chosen or os.environ.get("OPENBLAS_CORETYPE"):
        return
    want = lib.kvq_blas_core_wanted()
    if want:
        _warned = True
        have = lib.kvq_blas_core_detected().decode()
        want = want.decode()
        warnings.warn(f"kvq: OpenBLAS was loaded before kvq (numpy?) and runs its {have} kernels on a CPU that runs "
                      f"{want}: matrix products may run at a fraction of their speed. Set OPENBLAS_CORETYPE={want} "
                      f"before starting Python, or import kvq first (docs/performance.md#blas-kernels)",
                      RuntimeWarning, stacklevel=3)

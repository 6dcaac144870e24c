"""bench_python.py — the overhead of `import kvq`: kvq.quantize on a
Llama-3-8B-shaped layer (8 KV heads x 4096 tokens x 128) against the same
call from C (kvq-bench-arrays), best of REPS, at 1 thread and all cores.
    PYTHONPATH=BUILD/python python3 bench_python.py BUILD_DIR [REPS]"""
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

import kvq

build = sys.argv[1]
reps = int(sys.argv[2]) if len(sys.argv) > 2 else 5
H, T, D = 8, 4096, 128
rng = np.random.default_rng(0)
k = rng.standard_normal((H, T, D), dtype=np.float32)
k[:, :, :4] *= 8  # a few outlier channels, as real keys have
v = rng.standard_normal((H, T, D), dtype=np.float32)
specs = ["per-token:bits=4", "kivi:bits=2", "fp8", "turboquant:bits=3"]
tmp = tempfile.mkdtemp(prefix="kvq-bench-python.")
kp, vp = os.path.join(tmp, "k.f32"), os.path.join(tmp, "v.f32")
k.tofile(kp)
v.tofile(vp)
print(f"kvq.quantize against kvq_quantize_arrays from C, [{H},{T},{D}] float32, best of {reps}")
print("Python (out=): K', V' written into arrays reused across calls, as the C call reuses its buffers;")
print("Python (new): fresh arrays each call (their first touch is page faults, ~1 ms per 2 MB)")
print(f"{'spec':22} {'threads':>7} {'C (s)':>9} {'Python out= (s)':>15} {'overhead':>9} {'Python new (s)':>14}")
kout, vout = np.empty_like(k), np.empty_like(v)
for threads in (1, 0):
    out = subprocess.run([os.path.join(build, "tests", "kvq-bench-arrays"), kp, vp, str(H), str(T), str(D),
                          str(threads), str(reps), *specs], capture_output=True, text=True, check=True).stdout
    c_time = {ln.split()[0]: float(ln.split()[1]) for ln in out.splitlines()}
    for s in specs:
        best = {}
        for mode in ("out", "new"):
            best[mode] = 1e30
            for _ in range(reps):
                t0 = time.perf_counter()
                kvq.quantize(s, k, v, threads=threads, out=(kout, vout) if mode == "out" else None)
                best[mode] = min(best[mode], time.perf_counter() - t0)
        print(f"{s:22} {threads or 'all':>7} {c_time[s]:9.4f} {best['out']:15.4f} "
              f"{100 * (best['out'] / c_time[s] - 1):8.1f}% {best['new']:14.4f}")
for f in (kp, vp):
    os.unlink(f)
os.rmdir(tmp)

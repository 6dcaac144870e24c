"""test_kvq_dump_py.py — tools/kvq_dump.py: dumps it writes are read by kvq
(kvq-info, kvq-analyze), [B,H,T,D] with a batch index, float16, bfloat16 and
torch tensors when torch is installed, and every validation error.
    python3 test_kvq_dump_py.py BUILD_DIR SOURCE_DIR"""
import os
import subprocess
import sys
import tempfile

try:
    import h5py  # noqa: F401
    import numpy as np
except ImportError as e:  # tools/setup.sh installs python3-numpy and python3-h5py
    print(f"SKIP: {e} (tools/setup.sh installs python3-h5py)")
    sys.exit(77)

build, src = sys.argv[1], sys.argv[2]
sys.path.insert(0, os.path.join(src, "tools"))
from kvq_dump import DumpError, write_dump  # noqa: E402

passed = failed = 0


def check(ok, what):
    global passed, failed
    if ok:
        passed += 1
    else:
        failed += 1
        print("FAIL:", what)


def run(*args):
    return subprocess.run([os.path.join(build, "tools", args[0]), *args[1:]], capture_output=True, text=True)


rng = np.random.default_rng(0)
tmp = tempfile.mkdtemp()
L, B, Hq, H, T, D = 2, 3, 4, 2, 40, 8
layers = [dict(key=rng.standard_normal((B, H, T, D)).astype(np.float32),
               value=rng.standard_normal((B, H, T, D)).astype(np.float16),
               query=rng.standard_normal((B, Hq, T, D)).astype(np.float32)) for _ in range(L)]
p = os.path.join(tmp, "b.h5")
write_dump(p, layers, model="toy", batch=1, rope_theta=10000, rope_style="half")
r = run("kvq-info", p)
check(r.returncode == 0 and "toy" in r.stdout, f"kvq-info on the written dump: {r.stdout} {r.stderr}")
r = run("kvq-analyze", "--format", "csv", "-q", "kivi:group=8,residual=8", "--per", "model", p)
check(r.returncode == 0 and r.stdout.count("\n") == 2, f"kvq-analyze on the written dump: {r.stderr}")
check(not [f for f in os.listdir(tmp) if ".tmp." in f], "a temporary file was left")

# values exactly as given (float16 stays float16)
with h5py.File(p) as f:
    check(f["layer_001/value"].dtype == np.float16, "float16 written as float16")
    check(np.array_equal(f["layer_001/key"][...], layers[1]["key"][1]), "batch 1 picked")
    check(f.attrs["num_heads"] == Hq and f.attrs["seq_len"] == T, "attributes")

# bfloat16, through torch if it is installed
try:
    import torch
    t = [dict(key=torch.randn(H, T, D, dtype=torch.bfloat16), value=torch.randn(H, T, D)) for _ in range(L)]
    write_dump(os.path.join(tmp, "t.h5"), t, model="torch")
    with h5py.File(os.path.join(tmp, "t.h5")) as f:
        check(f["layer_000/key"].dtype == np.float32, "bfloat16 widened to float32")
except ImportError:
    print("test_kvq_dump_py: torch not installed: torch tensors not tested")

bad = [
    (dict(layers=[dict(key=np.zeros((H, T, D)), value=np.zeros((H, T + 1, D)))]), "layers[0].value: expected [2, 40, 8]"),
    (dict(layers=[dict(key=np.zeros((B, H, T, D)), value=np.zeros((B, H, T, D)))]), "pass batch=INDEX"),
    (dict(layers=[dict(key=np.zeros((B, H, T, D)), value=np.zeros((B, H, T, D)))], batch=5), "batch=5: expected 0..2"),
    (dict(layers=[dict(key=np.zeros((H, T)), value=np.zeros((H, T)))]), "expected [H,T,D] or [B,H,T,D]"),
    (dict(layers=[dict(key=np.zeros((H, T, D), np.int32), value=np.zeros((H, T, D)))]), "expected float16, bfloat16 or float32"),
    (dict(layers=[dict(key=np.full((H, T, D), np.nan), value=np.zeros((H, T, D)))]), "finite"),
    (dict(layers=[dict(key=np.zeros((H, T, D)), value=np.zeros((H, T, D)), query=np.zeros((3, T, D)))]), "multiple of 2"),
    (dict(layers=[dict(key=np.zeros((H, T, D)))]), "with 'key' and 'value'"),
    (dict(layers=[dict(key=np.zeros((H, T, D)), value=np.zeros((H, T, D)), keys=1)]), "unknown entries"),
    (dict(layers=[dict(key=np.zeros((H, T, D)), value=np.zeros((H, T, D))),
                  dict(key=np.zeros((H, T, 4)), value=np.zeros((H, T, 4)))]), "layers[1]: shapes"),
    (dict(layers=[]), "at least one layer"),
    (dict(layers=[dict(key=np.zeros((H, T, D)), value=np.zeros((H, T, D)))], rope_style="sideways"), "rope_style"),
]
for kw, needle in bad:
    out = os.path.join(tmp, "bad.h5")
    try:
        write_dump(out, model="x", **kw)
        check(False, f"accepted bad input ({needle})")
    except DumpError as e:
        check(needle in str(e), f"message {e!s} lacks {needle!r}")
    check(not os.path.exists(out), "a rejected dump left a file")

print(f"{passed} passed, {failed} failed")
sys.exit(1 if failed else 0)

"""test_kvq_dump_py.py — tools/kvq_dump.py: dumps it writes are read by kvq
(kvq-info, kvq-analyze), [B,H,T,D] with a batch index, float16, bfloat16 and
torch tensors when torch is installed, and every validation error.
    python3 test_kvq_dump_py.py BUILD_DIR SOURCE_DIR"""
import os
import stat
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
from kvqtest import check, finish, run_tool  # noqa: E402



def run(*args):
    return run_tool(build, *args)


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
    (dict(layers=[dict(key=np.zeros((H, 0, D)), value=np.zeros((H, 0, D)))]), "is empty"),
    (dict(layers=[dict(key=np.zeros((H, T, 0)), value=np.zeros((H, T, 0)))]), "is empty"),
    (dict(layers=[dict(key=np.zeros((0, T, D)), value=np.zeros((0, T, D)), query=np.zeros((0, T, D)))]), "is empty"),
    (dict(layers=[dict(key=None, value=np.zeros((H, T, D)))]), "with 'key' and 'value'"),
    (dict(layers=[dict(key=np.zeros((H, T, D)), value=np.zeros((H, T, D)))], rope_theta=float("inf")), "positive finite"),
    (dict(layers=[dict(key=np.zeros((H, T, D)), value=np.zeros((H, T, D)))], rope_theta="x"), "positive finite"),
    (dict(layers=[dict(key=np.zeros((H, T, D)), value=np.zeros((H, T, D)))], layout="THD"), "layout"),
    # [B,T,H,D] (flash-attention / vLLM) read as [B,H,T,D]: detected through grouped-query shapes
    (dict(layers=[dict(key=np.zeros((B, T, H, D)), value=np.zeros((B, T, H, D)), query=np.zeros((B, T, Hq, D)))], batch=0),
     'look like [T,H,D] (flash-attention / vLLM order [B,T,H,D])'),
    # a query that fits neither reading names both layouts
    (dict(layers=[dict(key=np.zeros((H, T, D)), value=np.zeros((H, T, D)), query=np.zeros((3, T, D)))]), 'layout="BTHD"'),
]
for kw, needle in bad:
    out = os.path.join(tmp, "bad.h5")
    try:
        write_dump(out, model="x", **kw)
        check(False, f"accepted bad input ({needle})")
    except DumpError as e:
        check(needle in str(e), f"message {e!s} lacks {needle!r}")
    check(not os.path.exists(out), "a rejected dump left a file")

# layout="BTHD": transposed to [H,T,D]
bthd = [dict(key=np.ascontiguousarray(l["key"].transpose(0, 2, 1, 3)), value=np.ascontiguousarray(l["value"].transpose(0, 2, 1, 3)),
             query=np.ascontiguousarray(l["query"].transpose(0, 2, 1, 3))) for l in layers]
write_dump(os.path.join(tmp, "bthd.h5"), bthd, model="toy", batch=1, layout="BTHD")
with h5py.File(os.path.join(tmp, "bthd.h5")) as f:
    check(np.array_equal(f["layer_001/key"][...], layers[1]["key"][1]) and f.attrs["num_heads"] == Hq,
          "layout BTHD transposed to [H,T,D]")

# only regular files are replaced: a symlink's target is written (the link stays), a FIFO or a
# symlink loop is refused and left as it is; the mode follows the umask (022: 0644)
small = [dict(key=np.zeros((H, T, D), np.float32), value=np.zeros((H, T, D), np.float32))]
real, link = os.path.join(tmp, "real.h5"), os.path.join(tmp, "link.h5")
old_umask = os.umask(0o022)
try:
    write_dump(real, small, model="m")
    check(os.stat(real).st_mode & 0o777 == 0o644, f"mode {oct(os.stat(real).st_mode & 0o777)} under umask 022")
    os.symlink(real, link)
    write_dump(link, small, model="through-link")
    check(os.path.islink(link), "the symlink was replaced by a file")
    with h5py.File(real) as f:
        check(f.attrs["model"] == "through-link", "the link's target was not written")
    fifo = os.path.join(tmp, "fifo.h5")
    os.mkfifo(fifo)
    loop = os.path.join(tmp, "loop.h5")
    os.symlink(loop, loop)
    for target, needle in ((fifo, "not a regular file"), (loop, "cannot use as the output"), (tmp, "not a regular file")):
        try:
            write_dump(target, small, model="m")
            check(False, f"wrote to {target}")
        except DumpError as e:
            check(needle in str(e), f"message {e!s} lacks {needle!r}")
    check(stat.S_ISFIFO(os.lstat(fifo).st_mode) and os.path.islink(loop), "a FIFO or a link loop was replaced")
finally:
    os.umask(old_umask)

finish("test_kvq_dump_py")

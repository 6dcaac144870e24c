"""test_meta.py — provenance (docs/tools.md#provenance): every tool that writes
results writes OUT.meta.json; it parses, names every input with the SHA-256
sha256sum gives, records OUT's own checksum, and both its command and its
options (every effective value, defaults included) reproduce OUT byte for
byte; --meta inline, --no-hash, sweeps' --resume and --merge, and an
interrupted run that leaves no meta file for a missing OUT.
    python3 test_meta.py BUILD_DIR SOURCE_DIR"""
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from kvqtest import check, finish, run_tool

build, src = os.path.abspath(sys.argv[1]), os.path.abspath(sys.argv[2])
tools = os.path.join(build, "tools")
dump = os.path.join(src, "data", "stories260K.h5")
calib = os.path.join(src, "data", "stories260K-calib.h5")
shared = os.environ.get("KVQ_MODEL_DIR", os.path.join(src, "..", "shared", "data"))
model = os.path.join(shared, "model", "stories260K.gguf")
text = os.path.join(shared, "texts", "story_main.txt")
tmp = tempfile.mkdtemp(prefix="kvq-test-meta.")
os.environ["KVQ_HASH_CACHE"] = os.path.join(tmp, "sha256-cache")  # the tools' cache of checksums: this test's own


def run(tool, *args, cwd=tmp, expect=0):
    p = run_tool(build, tool, *args, cwd=cwd)
    check(p.returncode == expect, f"{tool} {' '.join(args)}: exit {p.returncode}, expected {expect}: {p.stderr.strip()}")
    return p


def sha256(path):
    """The file's SHA-256 as sha256sum prints it (hashlib where coreutils is absent)."""
    if shutil.which("sha256sum"):
        return subprocess.run(["sha256sum", "--", path], capture_output=True, text=True, check=True).stdout.split()[0]
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def read(path):
    with open(path, "rb") as f:
        return f.read()


def load_meta(out):
    """OUT.meta.json, parsed; None (and a failure) if absent or not JSON."""
    path = out + ".meta.json"
    try:
        with open(path, encoding="utf-8") as f:
            meta = json.load(f)
    except (OSError, ValueError) as e:
        check(False, f"{path}: {e}")
        return None
    check(meta.get("kvq_meta") == 1 and isinstance(meta.get("runs"), list) and meta["runs"],
          f"{path}: kvq_meta 1 and a list of runs")
    return meta


def check_run(r, tool, out, what, hashed=True):
    """A run record: the build, the command, every input's checksum, OUT's."""
    check(r["tool"] == tool, f"{what}: tool {r['tool']}")
    check(r["kvq"]["version"] and r["kvq"]["simd"] in ("none", "avx2", "avx512") and "OpenBLAS" in r["kvq"]["blas"],
          f"{what}: build {r['kvq']}")
    check(r["command"][0].endswith(tool) and r["cwd"] == os.path.realpath(tmp), f"{what}: command and cwd")
    for i in r["inputs"]:
        p = os.path.join(r["cwd"], i["path"])
        check(i["size"] == os.path.getsize(p), f"{what}: {i['path']}: size")
        check(i["sha256"] == (sha256(p) if hashed else None), f"{what}: {i['path']}: sha256 {i['sha256']}")
        check(i["mtime"].endswith("Z") and i["mtime"][:4].isdigit(), f"{what}: {i['path']}: mtime {i['mtime']}")
    if out is not None:
        check(r["output_sha256"] == sha256(os.path.join(tmp, out)), f"{what}: output_sha256 is OUT's")
    check(r["seconds"] >= 0 and r["peak_rss_bytes"] > 0 and r["start"] <= r["end"], f"{what}: times and memory")
    check(r["options"]["meta"] in ("file", "inline") and r["options"]["no-hash"] == (not hashed),
          f"{what}: --meta and --no-hash recorded")


def options_command(r, out):
    """The command rebuilt from the recorded options: every option spelled
    out with its effective value (null: the option's absence), the operands,
    and -o OUT."""
    cmd = [r["command"][0]]
    for k, v in r["options"].items():
        if v is None or v is False:
            continue
        if v is True:
            cmd.append(f"--{k}")
        elif isinstance(v, list):
            if v and all(isinstance(x, int) for x in v):
                cmd += [f"--{k}", ",".join(map(str, v))]
            else:
                for x in v:
                    cmd += [f"--{k}", str(x)]
        else:
            cmd += [f"--{k}", str(v)]
    return cmd + r["operands"] + ["-o", out]


def same_output(a, b):
    """Equal bytes; for an HDF5 dump, equal datasets and attributes (HDF5
    stamps each object with the second it was written)."""
    if not a.endswith(".h5"):
        return read(a) == read(b)
    import h5py
    import numpy as np

    def items(path):
        out = {}
        with h5py.File(path, "r") as f:
            f.visititems(lambda name, o: out.__setitem__(name, o[()] if isinstance(o, h5py.Dataset) else None))
            for name in [""] + list(out):
                for k, v in f[name or "/"].attrs.items():
                    out[f"{name}@{k}"] = v
        return out
    x, y = items(a), items(b)
    return x.keys() == y.keys() and all(np.array_equal(x[k], y[k]) for k in x)


def reproduces(r, out, what):
    """The recorded command (with -o moved) and the options' command both
    write OUT's bytes again."""
    cmd = list(r["command"])
    i = cmd.index("-o")
    for how, c in (("command", cmd[:i + 1] + ["again-" + out] + cmd[i + 2:]),
                   ("options", options_command(r, "again-" + out))):
        again = os.path.join(tmp, "again-" + out)
        for f in (again, again + ".meta.json", again + ".sensitivity.csv", again + ".uniform.csv"):
            if os.path.exists(f):
                os.unlink(f)
        p = subprocess.run(c, cwd=r["cwd"], capture_output=True, text=True)
        check(p.returncode == 0, f"{what}: re-run from the {how}: {' '.join(c)}: {p.stderr.strip()}")
        check(p.returncode == 0 and same_output(os.path.join(tmp, out), again),
              f"{what}: re-run from the {how} gives the same OUT bytes (datasets for a dump)")


shutil.copy(dump, os.path.join(tmp, "d.h5"))
shutil.copy(calib, os.path.join(tmp, "c.h5"))

# --- kvq-analyze: explicit specs and the default set; csv and jsonl
run("kvq-analyze", "-q", "kivi:bits=2", "-q", "per-token:bits=4", "--per", "layer", "--queries", "last:16",
    "--seed", "3", "--calib", "c.h5", "-o", "a.csv", "d.h5")
m = load_meta(os.path.join(tmp, "a.csv"))
if m:
    r = m["runs"][0]
    check(m["output"] == "a.csv" and len(m["runs"]) == 1, "analyze: one run, output named")
    check_run(r, "kvq-analyze", "a.csv", "analyze")
    check([i["role"] for i in r["inputs"]] == ["dump", "calib"], f"analyze: inputs {r['inputs']}")
    o = r["options"]
    check(o["quant"] == ["kivi:bits=2", "per-token:bits=4"] and o["queries"] == "last:16" and o["seed"] == 3 and
          o["per"] == "layer" and o["format"] == "csv" and o["threads"] >= 1 and o["device"] == "cpu" and
          o["layers"] is None and o["calib"] == "c.h5", f"analyze: options {o}")
    reproduces(r, "a.csv", "analyze")
run("kvq-analyze", "--per", "model", "--threads", "1", "-o", "b.jsonl", "d.h5")
m = load_meta(os.path.join(tmp, "b.jsonl"))
if m:
    r = m["runs"][0]
    check(len(r["options"]["quant"]) >= 5 and r["options"]["format"] == "jsonl" and r["options"]["threads"] == 1,
          f"analyze default set: the specs it ran are recorded ({r['options']['quant']})")
    reproduces(r, "b.jsonl", "analyze default set")

# --- the checksums of unchanged files (tools/hash.c): a file hashed once is not read again while
# stat(2) says the same of it (device, inode, size, mtime, ctime); a file changed within 2 s is not kept
cache = os.environ["KVQ_HASH_CACHE"]
if os.path.exists(cache):
    os.unlink(cache)
shutil.copy(dump, os.path.join(tmp, "c.h5"))
run("kvq-analyze", "-q", "kivi:bits=2", "-o", "c0.csv", "c.h5")  # c.h5's ctime is now: hashed, not kept
check(not os.path.exists(cache) or "c.h5" not in open(cache).read(), "hash cache: a file changed just now is not kept")
time.sleep(2.1)
recs = []
for out in ("c1.csv", "c2.csv"):
    run("kvq-analyze", "-q", "kivi:bits=2", "-o", out, "c.h5")
    m = load_meta(os.path.join(tmp, out))
    recs.append(m["runs"][0]["inputs"][0] if m else {})
want = sha256(os.path.join(tmp, "c.h5"))
check(recs[0].get("sha256") == want and "sha256_cached" not in recs[0], "hash cache: the first run hashes the file")
check(recs[1].get("sha256") == want and recs[1].get("sha256_cached") is True,
      "hash cache: the next run takes the checksum of the unchanged file from the cache")
os.utime(os.path.join(tmp, "c.h5"))  # a new mtime and ctime: another state of the file
time.sleep(2.1)
run("kvq-analyze", "-q", "kivi:bits=2", "-o", "c3.csv", "c.h5")
m = load_meta(os.path.join(tmp, "c3.csv"))
i = m["runs"][0]["inputs"][0] if m else {}
check(i.get("sha256") == want and "sha256_cached" not in i, "hash cache: a touched file is hashed again")
os.environ["KVQ_HASH_CACHE"] = "off"
os.unlink(cache)
run("kvq-analyze", "-q", "kivi:bits=2", "-o", "c4.csv", "c.h5")
check(not os.path.exists(cache), "KVQ_HASH_CACHE=off: no cache written")
# a first run on fewer than three processors reads its dump with one thread while the hash runs
# (cli_meta_share_reading): the same rows as a run that hashes nothing
run("kvq-analyze", "-q", "kivi:bits=2", "--no-hash", "-o", "c5.csv", "c.h5")
check(read(os.path.join(tmp, "c4.csv")) == read(os.path.join(tmp, "c5.csv")),
      "a first run, its hash beside the work, writes the rows a --no-hash run writes")
run("kvq-info", "-o", "c4.txt", "c.h5")
run("kvq-info", "--no-hash", "-o", "c5.txt", "c.h5")
check(read(os.path.join(tmp, "c4.txt")) == read(os.path.join(tmp, "c5.txt")),
      "kvq-info: a first run writes the report a --no-hash run writes")
os.environ["KVQ_HASH_CACHE"] = cache

# --- no record, no hash: on stdout without --meta inline nothing would wait for the inputs'
# checksums, so no thread of the run opens the dump but the reading one (strace -f: the opens
# by thread; --threads 1 leaves the other core free for a background hasher to start on)
def strace_works():
    """strace is there and may trace (a container can forbid ptrace)."""
    if not shutil.which("strace"):
        return False
    log = os.path.join(tmp, "strace-probe.log")
    p = subprocess.run(["strace", "-f", "-o", log, "true"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return p.returncode == 0 and os.path.exists(log)


if strace_works():
    def other_thread_opens(*args):
        log = os.path.join(tmp, "strace.log")
        env = dict(os.environ, KVQ_HASH_CACHE="off")
        subprocess.run(["strace", "-f", "-e", "trace=openat", "-o", log, os.path.join(tools, "kvq-analyze"),
                        "-q", "kivi:bits=2", "--threads", "1", *args, "c.h5"], cwd=tmp, env=env,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        lines = open(log).read().splitlines()
        main = lines[0].split()[0] if lines else ""
        return sum(1 for ln in lines if '"c.h5"' in ln and ln.split()[0] != main)
    n_out, n_stdout = other_thread_opens("-o", "h.csv"), other_thread_opens()
    check(n_out == 1, f"with -o the dump is hashed beside the work (opened by {n_out} other threads, expected 1)")
    check(n_stdout == 0, f"on stdout the dump is not hashed (opened by {n_stdout} other threads, expected 0)")
else:
    print("skipped: the check that a run without a record hashes nothing needs strace, allowed to trace")

# --- --no-hash, --meta inline
run("kvq-analyze", "-q", "kcvt:bits=2", "--no-hash", "-o", "n.csv", "d.h5")
m = load_meta(os.path.join(tmp, "n.csv"))
if m:
    check(m["runs"][0]["hashed"] is False, "--no-hash: hashed false")
    check_run(m["runs"][0], "kvq-analyze", "n.csv", "--no-hash", hashed=False)
run("kvq-analyze", "-q", "kivi:bits=2", "--per", "model", "-o", "plain.jsonl", "d.h5")
run("kvq-analyze", "-q", "kivi:bits=2", "--per", "model", "--meta", "inline", "-o", "in.jsonl", "d.h5")
lines = read(os.path.join(tmp, "in.jsonl")).split(b"\n", 1)
first = json.loads(lines[0])
check(first["kvq_meta"] == 1 and first["runs"][0]["options"]["meta"] == "inline", "--meta inline: the first line")
check(lines[1] == read(os.path.join(tmp, "plain.jsonl")), "--meta inline: the rows follow unchanged")
check(first["runs"][0]["output_sha256"] == hashlib.sha256(lines[1]).hexdigest(), "--meta inline: the rows' checksum")
check(load_meta(os.path.join(tmp, "in.jsonl")) == first, "--meta inline: the same object as OUT.meta.json")
p = run("kvq-analyze", "-q", "kivi:bits=2", "--meta", "inline", "-o", "x.csv", "d.h5", expect=2)
check("needs --format jsonl" in p.stderr and not os.path.exists(os.path.join(tmp, "x.csv")),
      "--meta inline with csv: a usage error, nothing written")
run("kvq-analyze", "--meta", "both", "d.h5", expect=2)

# --- a meta file that cannot be written: nothing is
os.mkdir(os.path.join(tmp, "blocked.csv.meta.json"))
# (refused before any work, as a usage error: the -o chosen cannot carry its record)
p = run("kvq-analyze", "-q", "kivi:bits=2", "-o", "blocked.csv", "d.h5", expect=2)
check(not os.path.exists(os.path.join(tmp, "blocked.csv")) and len(p.stderr.strip().splitlines()) == 1
      and "blocked.csv.meta.json" in p.stderr,
      f"unwritable meta file: one line, no OUT ({p.stderr.strip()})")

# --- interrupted: no meta file for a missing OUT; an earlier pair stays a pair
run("kvq-gen", "--preset", "llama3-8b", "--layers", "4", "--tokens", "2048", "--progress", "never", "-o", "big.h5")
for before in (False, True):
    if before:
        run("kvq-analyze", "-q", "kivi:bits=2", "--per", "model", "-o", "int.csv", "d.h5")
    p = subprocess.Popen([os.path.join(tools, "kvq-analyze"), "--per", "model", "-o", "int.csv", "big.h5"], cwd=tmp,
                         stderr=subprocess.PIPE)
    time.sleep(0.5)
    p.send_signal(signal.SIGTERM)
    p.wait()
    check(p.returncode != 0, "interrupted analyze: failed")
    o, mp = os.path.join(tmp, "int.csv"), os.path.join(tmp, "int.csv.meta.json")
    if not before:
        check(not os.path.exists(o) and not os.path.exists(mp), "interrupted first run: neither OUT nor its meta")
    else:
        mm = load_meta(o)
        check(mm and mm["runs"][0]["output_sha256"] == sha256(o), "interrupted re-run: the earlier OUT and meta agree")
    check(not [f for f in os.listdir(tmp) if ".tmp" in f], f"interrupted: no temporaries left ({os.listdir(tmp)})")

# --- dumps: kvq-gen (a preset expanded into its settings), kvq-dump below
run("kvq-gen", "--preset", "llama3-8b", "--layers", "1", "--tokens", "64", "--progress", "never", "-o", "g.h5")
m = load_meta(os.path.join(tmp, "g.h5"))
if m:
    r = m["runs"][0]
    check_run(r, "kvq-gen", "g.h5", "gen")
    check(r["options"]["heads"] == 32 and r["options"]["kv-heads"] == 8 and r["options"]["rope-style"] == "half" and
          r["options"]["layers"] == 1, f"gen: the preset's settings recorded ({r['options']})")
    reproduces(r, "g.h5", "gen")
run("kvq-gen", "--layers", "1", "--tokens", "8", "--meta", "inline", "-o", "gi.h5", expect=2)

# --- kvq-info -o
run("kvq-info", "--channels", "-o", "ch.csv", "d.h5")
m = load_meta(os.path.join(tmp, "ch.csv"))
if m:
    check_run(m["runs"][0], "kvq-info", "ch.csv", "info")
    reproduces(m["runs"][0], "ch.csv", "info")

# --- kvq-sweep: one record per run across --resume, the shards' runs after --merge
grid = ["--quant", "kivi", "--grid", "bits=2,4", "--grid", "group=32,64", "--per", "model", "--progress", "never"]
run("kvq-sweep", "d.h5", *grid, "-o", "sw.csv")
m = load_meta(os.path.join(tmp, "sw.csv"))
if m:
    r = m["runs"][0]
    check_run(r, "kvq-sweep", "sw.csv", "sweep")
    check(r["result"]["status"] == "complete" and r["result"]["points_written"] == 4, f"sweep: result {r['result']}")
    check(r["options"]["grid"] == ["bits=2,4", "group=32,64"] and r["options"]["shard"] == "0/1", "sweep: options")
    reproduces(r, "sw.csv", "sweep")
bgrid = ["--quant", "kivi", "--grid", "bits=2,3,4,8", "--grid", "group=16,32,64,128", "--per", "model",
         "--progress", "never"]
p = subprocess.Popen([os.path.join(tools, "kvq-sweep"), "big.h5", *bgrid, "-o", "res.csv"], cwd=tmp,
                     stderr=subprocess.PIPE)
for _ in range(600):  # until a point is written
    time.sleep(0.05)
    if os.path.exists(os.path.join(tmp, "res.csv")) and read(os.path.join(tmp, "res.csv")).count(b"\n") >= 2:
        break
p.send_signal(signal.SIGTERM)
p.wait()
m = load_meta(os.path.join(tmp, "res.csv"))
check(m and m["runs"][0]["result"]["status"] == "running", "interrupted sweep: its record says running")
run("kvq-sweep", "big.h5", *bgrid, "--resume", "-o", "res.csv")
m = load_meta(os.path.join(tmp, "res.csv"))
if m:
    check(len(m["runs"]) == 2 and m["runs"][1]["options"]["resume"] is True and
          m["runs"][1]["result"]["status"] == "complete" and
          m["runs"][1]["result"]["points_before"] + m["runs"][1]["result"]["points_written"] == 16,
          f"resumed sweep: two runs, the second completes ({[r['result'] for r in m['runs']]})")
    check(m["runs"][1]["output_sha256"] == sha256(os.path.join(tmp, "res.csv")), "resumed sweep: OUT's checksum")
for i in (0, 1):
    run("kvq-sweep", "d.h5", *grid, "--shard", f"{i}/2", "-o", f"sh{i}.csv")
run("kvq-sweep", "--merge", "sh0.csv", "sh1.csv", "-o", "merged.csv")
m = load_meta(os.path.join(tmp, "merged.csv"))
if m:
    check([r["options"].get("shard") for r in m["runs"]] == ["0/2", "1/2", None] and
          m["runs"][2]["options"]["merge"] is True, "merge: the shards' runs, then the merge")
    check_run(m["runs"][2], "kvq-sweep", "merged.csv", "merge")
    check(read(os.path.join(tmp, "merged.csv")) == read(os.path.join(tmp, "sw.csv")), "merge: the single run's bytes")
run("kvq-sweep", "d.h5", *grid, "--meta", "inline", "-o", "swi.jsonl", expect=2)

# --- models in the loop (the bundled model lives in ../shared, never committed)
if os.path.exists(model):
    run("kvq-eval", model, "--text", text, "--max-tokens", "64", "-q", "kivi:bits=2", "-q", "none",
        "--policy", "prefill,decode", "-o", "e.csv")
    m = load_meta(os.path.join(tmp, "e.csv"))
    if m:
        r = m["runs"][0]
        check_run(r, "kvq-eval", "e.csv", "eval")
        check([i["role"] for i in r["inputs"]] == ["model", "text"], f"eval: inputs {r['inputs']}")
        check(r["model"]["architecture"] == "llama" and r["model"]["tokens"] == 64 and r["model"]["name"],
              f"eval: model {r['model']}")
        o = r["options"]
        check(o["policy"] == "prefill,decode" and o["stride"] == 1 and o["chunk"] is None and o["seed"] == 0 and
              o["max-tokens"] == 64, f"eval: options {o}")
        reproduces(r, "e.csv", "eval")
    run("kvq-dump", model, "--text", text, "--max-tokens", "64", "--layers", "0,2", "-o", "md.h5")
    m = load_meta(os.path.join(tmp, "md.h5"))
    if m:
        r = m["runs"][0]
        check_run(r, "kvq-dump", "md.h5", "dump")
        check(r["options"]["layers"] == [0, 2] and r["result"]["mean_nll"] > 0 and r["model"]["tokens"] == 64,
              f"dump: options and result ({r['options']}, {r['result']})")
        reproduces(r, "md.h5", "dump")
    run("kvq-alloc", model, "--text", text, "--max-tokens", "64", "--family", "kivi", "--grid", "kbits=2,8",
        "--grid", "vbits=2,8", "--fixed", "residual=0", "--budget", "5", "--progress", "never", "-o", "al.csv")
    m = load_meta(os.path.join(tmp, "al.csv"))
    if m:
        r = m["runs"][0]
        check_run(r, "kvq-alloc", "al.csv", "alloc")
        check(r["options"]["budget"] == ["5"] and r["result"]["passes_run"] == 4, f"alloc: {r['options']}")
        reproduces(r, "al.csv", "alloc")
else:
    print(f"SKIP: kvq-eval and kvq-alloc records: {model} absent")

shutil.rmtree(tmp)
finish("test_meta")

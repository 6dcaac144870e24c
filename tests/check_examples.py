"""check_examples.py — the numbers the README and docs/ show are the numbers the tools print.

Every example whose output a page shows carries a marker right before that output:

    <!-- example: COMMAND -->                 the next fenced block is COMMAND's stdout (a table)
    <!-- example: COMMAND => FILE COLS... -->  the next markdown table shows FILE's CSV rows, column by
                                              column (COLS: CSV columns; "a,b" is a cell "x, y", "a±b" a
                                              cell "x ± y"; text cells compare their `code` part)
    <!-- example: python -->                  the next ```python block runs (PYTHONPATH=build/python, in a
                                              directory holding data/), and each line it prints equals the
                                              comment of its print() line up to the comment's first ":"
    <!-- example: not run: REASON -->          an example the suite does not run (a recipe, a GPU, ...)

COMMAND runs with bash in the source tree, $M and $T the bundled model and texts
(../shared/data), $OUT a temporary directory, build/ the build directory; with OpenBLAS's
Haswell kernels (OPENBLAS_CORETYPE=Haswell), which the documented numbers were computed with:
another BLAS core rounds differently, and a 4-bit quantizer's result can move in its third digit.
Each documented number must equal the printed one to the digits shown (within half a unit of its
last digit); text cells must be equal.  An example needing ../shared is skipped without it; the
whole check skips (77) on a CPU without AVX2.
    check_examples.py SOURCE_DIR BUILD_DIR"""
import csv
import decimal
import glob
import os
import re
import subprocess
import sys
import tempfile

src, build = os.path.abspath(sys.argv[1]), os.path.abspath(sys.argv[2])
shared = os.path.join(src, "..", "shared", "data")
MARK = re.compile(r"<!-- example: (.*?) -->")
fails, checked, skipped = [], 0, []


def cpu_has_avx2():
    try:
        flags = open("/proc/cpuinfo").read()
    except OSError:
        return False
    return " avx2" in flags and " fma" in flags


def close(doc, got):
    """doc (text) equals got to the digits doc shows."""
    try:
        d = decimal.Decimal(doc)
        g = float(got)
    except (decimal.InvalidOperation, ValueError):
        return doc == got
    if not d.is_finite():
        return doc == got
    unit = decimal.Decimal(1).scaleb(d.as_tuple().exponent)
    return abs(decimal.Decimal(repr(g)) - d) <= unit / 2 + decimal.Decimal("1e-12") * abs(d)


def code_part(cell):
    m = re.search(r"`([^`]*)`", cell)
    return m.group(1) if m else cell.strip()


def next_block(text, pos):
    """The fenced block or markdown table after pos: ("fence", lines) or ("table", rows of cells)."""
    rest = text[pos:]
    m = re.match(r"\s*```\w*\n(.*?)```", rest, re.S)
    if m:
        return "fence", [ln for ln in m.group(1).splitlines() if ln.strip()]
    m = re.match(r"\s*((?:\|.*\|\n)+)", rest)
    if m:
        rows = [[c.strip() for c in ln.strip().strip("|").split("|")] for ln in m.group(1).splitlines()]
        return "table", [r for r in rows if not all(re.fullmatch(r"-+", c) for c in r)]
    return None, None


def compare_fence(where, doc_lines, out):
    got = [ln for ln in out.splitlines() if ln.strip()]
    dh, gh = doc_lines[0].split(), got[0].split() if got else []
    if not set(dh) <= set(gh):
        return [f"{where}: columns {sorted(set(dh) - set(gh))} are not printed (printed: {gh})"]
    if len(got) != len(doc_lines):
        return [f"{where}: {len(doc_lines) - 1} rows documented, {len(got) - 1} printed"]
    bad = []
    for i, (dl, gl) in enumerate(zip(doc_lines[1:], got[1:]), 1):
        dc, gc = dl.split(), dict(zip(gh, gl.split()))
        for h, v in zip(dh, dc):
            if not close(v, gc.get(h, "")):
                bad.append(f"{where}: row {i}, {h}: documented {v}, printed {gc.get(h)}")
    return bad


def run_python(where, code, tmp):
    """Runs a page's Python block; its printed lines against its print() lines' comments."""
    os.makedirs(os.path.join(tmp, "py"), exist_ok=True)
    data = os.path.join(tmp, "py", "data")
    if not os.path.exists(data):
        os.symlink(os.path.join(src, "data"), data)
    penv = dict(env, PYTHONPATH=os.path.join(build, "python"), MPLBACKEND="Agg")
    r = subprocess.run(["/usr/bin/python3", "-c", code], cwd=os.path.join(tmp, "py"), env=penv, capture_output=True,
                       text=True)
    if r.returncode:
        return [f"{where}: the Python example failed: {r.stderr.strip()[-1500:]}"]
    want = [ln.split("#", 1)[1].split(":", 1)[0].strip() for ln in code.splitlines()
            if ln.lstrip().startswith("print(") and "#" in ln]
    got = r.stdout.splitlines()
    if len(got) != len(want):
        return [f"{where}: {len(want)} commented print() lines, {len(got)} lines printed"]
    bad = []
    for w, g in zip(want, got):
        wt, gt = re.split(r"[\s(),]+", w.strip("() ")), re.split(r"[\s(),]+", g.strip("() "))
        if len(wt) != len(gt) or not all(close(a, b) for a, b in zip(wt, gt)):
            bad.append(f"{where}: printed {g!r}, the comment says {w!r}")
    return bad


def compare_table(where, rows, path, cols):
    try:
        got = list(csv.DictReader(open(path)))
    except OSError as e:
        return [f"{where}: {path}: {e}"]
    body = rows[1:]  # the header row of the markdown table
    if len(body) != len(got):
        return [f"{where}: {len(body)} rows documented, {len(got)} in {path}"]
    bad = []
    for i, (cells, row) in enumerate(zip(body, got), 1):
        for cell, col in zip(cells, cols):
            parts, names = [cell], [col]
            for sep, csep in ((",", ", "), ("±", " ± ")):
                if sep in col:
                    names, parts = col.split(sep), [p.strip() for p in cell.split(csep)]
            for name, part in zip(names, parts):
                v = code_part(part)
                if name not in row:
                    bad.append(f"{where}: column {name} is not in {path}")
                elif not close(v, row[name]):
                    bad.append(f"{where}: row {i}, {name}: documented {v}, in {path} {row[name]}")
    return bad


if not cpu_has_avx2():
    print("SKIP: the documented numbers are OpenBLAS Haswell kernels' (AVX2 + FMA), which this CPU lacks")
    sys.exit(77)
env = dict(os.environ, OPENBLAS_CORETYPE="Haswell", M=os.path.join(shared, "model"), T=os.path.join(shared, "texts"))
env.pop("KVQ_BLAS_CORE_DETECTED", None)
pages = [os.path.join(src, "README.md")] + sorted(glob.glob(os.path.join(src, "docs", "*.md")))
with tempfile.TemporaryDirectory(prefix="kvq-examples.") as tmp:
    env["OUT"] = tmp
    for page in pages:
        text = open(page).read()
        for m in MARK.finditer(text):
            spec = m.group(1)
            where = f"{os.path.relpath(page, src)}:{text[:m.start()].count(chr(10)) + 1}"
            if spec.startswith("not run:"):
                skipped.append(f"{where}: {spec}")
                continue
            if spec == "python":
                block = re.match(r"\s*```python\n(.*?)```", text[m.end():], re.S)
                if not block:
                    fails.append(f"{where}: no ```python block after the marker")
                    continue
                fails += run_python(where, block.group(1), tmp)
                checked += 1
                continue
            cmd, _, target = spec.partition(" => ")
            if ("$M" in cmd or "$T" in cmd) and not os.path.isdir(os.path.join(shared, "model")):
                skipped.append(f"{where}: needs ../shared/data (absent)")
                continue
            cmd = cmd.replace("build/tools/", os.path.join(build, "tools") + "/")
            kind, block = next_block(text, m.end())
            if kind is None:
                fails.append(f"{where}: no fenced block or table after the marker")
                continue
            r = subprocess.run(["bash", "-c", cmd], cwd=src, env=env, capture_output=True, text=True)
            if r.returncode:
                fails.append(f"{where}: `{cmd}` exited {r.returncode}: {r.stderr.strip()[-300:]}")
                continue
            if target:
                path, *cols = target.split()
                if kind != "table":
                    fails.append(f"{where}: `=> {path}` compares a markdown table, found a fenced block")
                    continue
                fails += compare_table(where, block, os.path.expandvars(path.replace("$OUT", tmp)), cols)
            else:
                if kind != "fence":
                    fails.append(f"{where}: stdout compares a fenced block, found a table")
                    continue
                fails += compare_fence(where, block, r.stdout)
            checked += 1
for f in fails:
    print("FAIL:", f)
for s in skipped:
    print("not run:", s)
print(f"check_examples: {checked} examples checked, {len(fails)} differences, {len(skipped)} not run")
sys.exit(1 if fails else 0)

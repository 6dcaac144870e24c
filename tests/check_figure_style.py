"""check_figure_style.py — every figure script, at both widths, makes a figure
fit for a paper: exactly 3.4 or 7 inches wide; every text at least 8 pt at
that size; no two texts overlapping (matplotlib's renderer extents); no two
legend entries with the same colour and marker; the PDF's metadata carrying
the provenance caption (the command and commit of the kvq run behind each
input, from its OUT.meta.json).
    check_figure_style.py DATA_DIR OUT_DIR [BUILD_DIR]
DATA_DIR holds what make_figures.sh writes to OUTDIR/data."""
import importlib.util
import os
import re
import sys
import zlib

here = os.path.dirname(os.path.abspath(__file__))
nb = os.path.join(os.path.dirname(here), "notebooks-export")
sys.path.insert(0, nb)
import kvqplot  # noqa: E402
import matplotlib.colors as mcolors  # noqa: E402
from matplotlib.collections import PathCollection  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402

data, out = sys.argv[1], sys.argv[2]
build = sys.argv[3] if len(sys.argv) > 3 else None


def d(name):
    return os.path.join(data, name)


# script -> the arguments make_figures.sh gives it (those whose inputs exist)
SCRIPTS = [
    ("channel_magnitudes", ["--values", d("values-L1-H0.csv"), "--channels", d("channels.csv")]),
    ("error_vs_bits", ["--input", d("analyze-model.csv")]),
    ("error_vs_bits", ["--input", d("analyze-formats.csv"), "--name", "error_vs_bits_formats"]),
    ("sweep_heatmap", ["--input", d("sweep-kivi.csv"), "--x", "group", "--y", "residual", "--metric", "out_rel_joint"]),
    ("sweep_heatmap", ["--input", d("sweep-kivi.csv"), "--x", "group", "--y", "residual", "--metric", "bits",
                       "--name", "sweep_heatmap_bits"]),
    ("layer_profile", ["--input", d("analyze-layer.csv")]),
    ("vq_coupling", ["--analyze", d("analyze-vq.csv")] + (["--eval", d("eval-vq.csv")] if os.path.exists(d("eval-vq.csv"))
                                                          else [])),
]
if os.path.exists(d("eval-layer.csv")):
    SCRIPTS.append(("proxy_vs_loss", ["--analyze", d("proxy-layer.csv"), "--eval-layer", d("eval-layer.csv"),
                                      "--eval-policy", d("eval-policy.csv")]))
if os.path.exists(d("alloc.csv")):
    SCRIPTS.append(("alloc_vs_bits", ["--input", d("alloc.csv")]))
if os.path.exists(d("eval-context.csv")):
    SCRIPTS.append(("quantize_or_evict", ["--input", d("eval-context.csv")]))
SCRIPTS.append(("does_it_remember", ["--input", d("eval-tasks.csv")]))

if build and os.path.exists(os.path.join(build, "python", "kvq", "__init__.py")) and not os.environ.get("KVQ_SANITIZED"):
    sys.path.insert(0, os.path.join(build, "python"))  # the Python API, from the build
    SCRIPTS.append(("python_api", ["--dump", os.path.join(os.path.dirname(here), "data", "stories260K.h5")]))
if os.environ.get("KVQ_FIGURES_ONLY"):  # while working on one script
    SCRIPTS = [s for s in SCRIPTS if s[0] in os.environ["KVQ_FIGURES_ONLY"].split(",")]
problems = []
checked = 0


def legend_key(h):
    """What a reader tells a legend entry by: its colour and marker (and line style)."""
    if isinstance(h, PathCollection):
        fc = h.get_facecolor()
        colour = mcolors.to_hex(fc[0]) if len(fc) else "none"
        ec = h.get_edgecolor()
        edge = mcolors.to_hex(ec[0]) if len(ec) else "none"
        path = h.get_paths()[0] if h.get_paths() else None
        marker = tuple(map(tuple, path.vertices.round(3))) if path is not None else ()
        return ("scatter", colour, edge, marker)
    if isinstance(h, Line2D):
        return ("line", mcolors.to_hex(h.get_color()), str(h.get_marker()), str(h.get_linestyle()))
    colours = []
    for get in ("get_facecolor", "get_edgecolor", "get_color"):
        c = getattr(h, get, lambda: None)()
        try:
            colours.append(mcolors.to_hex(c) if c is not None and len(c) in (3, 4) and not hasattr(c[0], "__len__")
                           else mcolors.to_hex(c[0]) if c is not None and len(c) else "none")
        except (TypeError, ValueError, IndexError):
            colours.append(str(c))
    return (type(h).__name__, *colours)


def check_figure(fig, label, width):
    global checked
    checked += 1
    w, _ = fig.get_size_inches()
    if abs(w - kvqplot.WIDTHS[width]) > 1e-6:
        problems.append(f"{label}: {w:.2f} in wide, expected {kvqplot.WIDTHS[width]}")
    fig.canvas.draw()  # the extents at the figure's own dpi (a PDF save draws at 72)
    r = fig.canvas.get_renderer()
    ts = kvqplot.texts(fig)
    for t in ts:
        if t.get_fontsize() < kvqplot.FONT_PT - 1e-9:
            problems.append(f"{label}: text {t.get_text()!r} at {t.get_fontsize():.1f} pt (< {kvqplot.FONT_PT})")
    boxes = [(t, t.get_window_extent(r)) for t in ts]
    for i in range(len(boxes)):
        for j in range(i + 1, len(boxes)):
            (a, ba), (b, bb) = boxes[i], boxes[j]
            if kvqplot._overlap(ba, bb, pad=0.5):
                problems.append(f"{label}: texts overlap: {a.get_text()!r} and {b.get_text()!r}")
    fb = fig.bbox
    for t, bb in boxes:
        if bb.x0 < fb.x0 - 1 or bb.x1 > fb.x1 + 1 or bb.y0 < fb.y0 - 1 or bb.y1 > fb.y1 + 1:
            problems.append(f"{label}: text {t.get_text()!r} leaves the figure")
    legends = [ax.get_legend() for ax in fig.axes if ax.get_legend()] + list(fig.legends)
    for leg in legends:
        handles = getattr(leg, "legend_handles", None) or leg.legendHandles
        seen = {}
        for h, t in zip(handles, leg.get_texts()):
            k = legend_key(h)
            if k in seen:
                problems.append(f"{label}: legend entries {seen[k]!r} and {t.get_text()!r} look alike")
            seen[k] = t.get_text()


def pdf_subject(path):
    """The Subject string of a PDF's information dictionary."""
    raw = open(path, "rb").read()
    m = re.search(rb"/Subject\s*\((.*?)(?<!\\)\)", raw, re.S)
    if m:
        return re.sub(rb"\\(.)", rb"\1", m.group(1)).decode("latin-1")
    m = re.search(rb"/Subject\s*<([0-9A-Fa-f]+)>", raw)
    if m:
        b = bytes.fromhex(m.group(1).decode())
        return b.decode("utf-16") if b[:2] in (b"\xfe\xff", b"\xff\xfe") else b.decode("latin-1")
    for s in re.finditer(rb"stream\r?\n(.*?)endstream", raw, re.S):  # an object stream, compressed
        try:
            z = zlib.decompress(s.group(1))
        except zlib.error:
            continue
        m = re.search(rb"/Subject\s*\((.*?)(?<!\\)\)", z, re.S)
        if m:
            return m.group(1).decode("latin-1")
    return None


orig_save = kvqplot.save
for script, args in SCRIPTS:
    spec = importlib.util.spec_from_file_location(script, os.path.join(nb, script + ".py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    for width in ("single", "double"):
        name = (args[args.index("--name") + 1] if "--name" in args else script) + "-" + width
        label = f"{script} {width}"

        def hooked(fig, outdir, _name, sources, _label=label, _width=width):
            written = orig_save(fig, outdir, _name, sources)  # finish() then save: the figure as printed
            check_figure(fig, _label, _width)
            pdf = [w for w in written if w.endswith(".pdf")][0]
            subject = pdf_subject(pdf)
            metas = [m for _, m in sources if isinstance(m, dict)]
            if not subject:
                problems.append(f"{_label}: {pdf}: no provenance caption (PDF Subject)")
            for m in metas:
                run = m["runs"][-1]
                tool = os.path.basename(run["command"][0])
                commit = (run["kvq"]["commit"] or "unknown commit")[:12]
                if subject and (tool not in subject or commit not in subject):
                    problems.append(f"{_label}: caption {subject!r} lacks {tool} or {commit}")
            if not metas and script != "python_api":  # it reads a dump in Python: the caption names it
                problems.append(f"{_label}: its inputs have no provenance record (run make_figures.sh first)")
            return written

        kvqplot.save = hooked
        mod.kvqplot.save = hooked
        try:
            mod.main(args + ["--out", out, "--name", name, "--width", width])
        except kvqplot.InputError as e:
            problems.append(f"{label}: {e}")
        finally:
            kvqplot.save = orig_save
            mod.kvqplot.save = orig_save

for p in problems:
    print(f"FAIL: {p}")
print(f"{checked} figures checked, {len(problems)} problems")
sys.exit(1 if problems else 0)

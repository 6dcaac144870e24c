"""kvqplot — what kvq's figure scripts share: the style of a paper figure.

Reading kvq's CSV or JSON-lines output (through kvq.read_output, the
package's one reader) with a check of the columns a figure needs (and its
provenance record, inline or OUT.meta.json, when there is one); sizes
for a single column (3.4 in) and a double column (7 in) with fonts of at
least 8 pt at that size; a colour-blind-safe palette (Okabe & Ito) with one
marker per quantizer family and one shade per spec, so that no two specs
look alike; legends in their own panel beside or below the axes; point
labels kept only where they overlap nothing; log axes only when the data
span more than a decade, with enough tick labels; the Pareto front; and
saving PNG + vector PDF atomically (temporary name, then rename), like the
kvq tools do, the PDF carrying a one-line provenance caption.
"""
import math
import os
import re
import sys

import matplotlib
import matplotlib.colors as mcolors
import matplotlib.pyplot as plt
import matplotlib.ticker as mticker

try:  # kvq's reader of its output (python/kvq/output.py: plain Python, no libkvq needed)
    import kvq
except ImportError:  # run from the sources without PYTHONPATH=BUILD/python: the package beside
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
    import kvq

DPI = 200  # PNG pixels per inch: a double-column figure is 1400 px wide
WIDTHS = {"single": 3.4, "double": 7.0}  # inches: one column and the full page of a two-column paper
FONT_PT = 8  # the smallest text at print size

# Okabe & Ito (2008), "Color Universal Design": distinguishable with every
# common colour-vision deficiency (black left for the Pareto front)
OKABE_ITO = ["#0072B2", "#E69F00", "#009E73", "#D55E00", "#CC79A7", "#56B4E9", "#F0E442"]
# quantizer family -> (colour, marker), in registry order: the markers are
# all different, so two families never look alike even where colours repeat
FAMILY_STYLE = {
    "per-token": (OKABE_ITO[0], "o"),
    "per-channel": (OKABE_ITO[1], "s"),
    "kivi": (OKABE_ITO[2], "^"),
    "kcvt": (OKABE_ITO[3], "v"),
    "absmax": (OKABE_ITO[4], "D"),
    "gear": (OKABE_ITO[5], "P"),
    "gear-l": (OKABE_ITO[6], "X"),
    "cluster": (OKABE_ITO[0], "*"),
    "lloydmax": (OKABE_ITO[1], "h"),
    "fp8": (OKABE_ITO[2], "p"),
    "fp4": (OKABE_ITO[3], "H"),
    "tender": (OKABE_ITO[4], "d"),
    "ggml": (OKABE_ITO[5], "<"),
    "kvquant": (OKABE_ITO[6], ">"),
    "turboquant": ("#555555", "8"),
}
_EXTRA_MARKERS = ["$a$", "$b$", "$c$", "$d$", "$e$", "$f$"]

METRIC_LABEL = {
    "k_rel_fro": "key error  ‖K−K'‖/‖K‖",
    "v_rel_fro": "value error  ‖V−V'‖/‖V‖",
    "score_rel": "score error  ‖S−S'‖/‖S‖",
    "attn_rel": "attention error  ‖A−A'‖/‖A‖",
    "attn_kl": "KL(A‖A') per query row (nats)",
    "attn_top1": "top-1 key kept (fraction of rows)",
    "out_rel": "output error, exact A  ‖AV−AV'‖/‖AV‖",
    "out_rel_joint": "output error  ‖AV−A'V'‖/‖AV‖",
    "k_sqnr_db": "key SQNR (dB)",
    "v_sqnr_db": "value SQNR (dB)",
    "k_bits": "key bits per element",
    "v_bits": "value bits per element",
}

KEY_LABEL = {
    "group": "group size (elements)",
    "residual": "residual window (tokens)",
    "bits": "bits per code",
    "kbits": "key bits per code",
    "vbits": "value bits per code",
    "rank": "low-rank rank",
    "sparsity": "outlier fraction per row",
    "centroids": "centroids per head",
    "window": "exact window (tokens)",
    "loop": "power-iteration passes",
    "groups": "channel groups (Tender)",
    "chunk": "chunk (tokens)",
    "alpha": "scale ratio between groups",
    "format": "FP8 / FP4 format",
    "global": "NVFP4 second-level scale",
    "scale": "scale granularity",
    "ktype": "llama.cpp K cache type",
    "vtype": "llama.cpp V cache type",
    "outliers": "outlier fraction per row",
    "sink": "sink tokens",
    "prerotate": "pre-rotation",
}


class InputError(Exception):
    """A missing or malformed input: reported as one line, exit status 1."""


def family_style(name, _seen={}):
    """(colour, marker) of a quantizer family; a family kvqplot does not know
    gets a letter marker of its own."""
    if name in FAMILY_STYLE:
        return FAMILY_STYLE[name]
    if name not in _seen:
        _seen[name] = ("#555555", _EXTRA_MARKERS[len(_seen) % len(_EXTRA_MARKERS)])
    return _seen[name]


def shade(colour, t):
    """colour darkened (t < 0, towards black) or lightened (t > 0, towards
    white) by the fraction |t|."""
    r, g, b = mcolors.to_rgb(colour)
    target = 1.0 if t > 0 else 0.0
    t = abs(t)
    return mcolors.to_hex((r + (target - r) * t, g + (target - g) * t, b + (target - b) * t))


def spec_bits(spec):
    """The number a spec's bit width key gives ('kivi:bits=2' -> 2), else None."""
    m = re.search(r"(?:^|[:,])(?:bits|kbits)=(\d+(?:\.\d+)?)", spec)
    return float(m.group(1)) if m else None


def spec_styles(specs):
    """(colour, marker) per spec: the family's marker, and within a family one
    shade per spec — darker for fewer bits — so that no two specs share both
    colour and marker.  specs: (family, spec) pairs."""
    by_family = {}
    for fam, spec in dict.fromkeys(specs):
        by_family.setdefault(fam, []).append(spec)
    styles = {}
    for fam, group in by_family.items():
        colour, marker = family_style(fam)
        group = sorted(group, key=lambda s: (spec_bits(s) is None, spec_bits(s) or 0, s))
        n = len(group)
        for i, spec in enumerate(group):
            t = 0.0 if n == 1 else -0.55 + 0.8 * i / (n - 1)  # dark .. light around the family colour
            styles[(fam, spec)] = (shade(colour, t), marker)
    return styles


METRIC_SHORT = {"k_rel_fro": "key error", "v_rel_fro": "value error", "score_rel": "score error",
                "attn_rel": "attention error", "attn_kl": "attention KL (nats)", "attn_top1": "top-1 kept",
                "out_rel": "output error (exact A)", "out_rel_joint": "output error",
                "k_sqnr_db": "key SQNR (dB)", "v_sqnr_db": "value SQNR (dB)", "k_bits": "key bits",
                "v_bits": "value bits"}


def split_tokens(spec):
    """(selector, HI, LO) of a tokens(SELECT; HI; LO) spec, or None."""
    if not spec.startswith("tokens(") or not spec.endswith(")"):
        return None
    parts = [p.strip() for p in spec[7:-1].split(";")]
    return (parts[0].split(":")[0], parts[1], parts[2]) if len(parts) == 3 else None


def metric_label(col, short=False):
    """An axis label for a kvq column, with its definition (or, short, without)."""
    return (METRIC_SHORT if short else METRIC_LABEL).get(col, col)


def key_label(key):
    return KEY_LABEL.get(key, key)


def in_notebook():
    """True inside Jupyter: scripts then use their default arguments."""
    return "ipykernel" in sys.modules


def read_rows(path, required, what="kvq output"):
    """Rows (dicts of strings or JSON values), the column names and the
    source (path, provenance record or None: what save() names in the
    caption) of a kvq CSV or JSON-lines file, read by kvq.read_output;
    InputError if it is missing, unreadable, empty or lacks any of the
    `required` columns."""
    if not os.path.isfile(path):
        raise InputError(f"{path}: no such file (expected {what}; "
                         "notebooks-export/make_figures.sh writes every input)")
    try:
        rows, cols, meta = kvq.read_output(path)
    except kvq.Error as e:
        raise InputError(str(e)) from None
    missing = [c for c in required if c not in cols]
    if missing:
        raise InputError(f"{path}: missing column{'s' if len(missing) > 1 else ''} {', '.join(missing)} "
                         f"(expected {what}; found: {', '.join(cols[:12]) or 'no header'}"
                         f"{', ...' if len(cols) > 12 else ''})")
    if not rows:
        raise InputError(f"{path}: no rows (expected {what})")
    return rows, cols, (path, meta)


def caption(sources):
    """One line naming what the figure was made from: per source (path,
    record) — read_rows' third value, or (path, "how it was read") for an
    input that no kvq tool wrote — the command that wrote it, the kvq commit
    and the date (from its provenance record), or the file alone when it
    has none."""
    parts = []
    for path, meta in dict(sources).items():
        if isinstance(meta, str):
            parts.append(f"{os.path.basename(path)} {meta}")
            continue
        if not meta:
            parts.append(f"{os.path.basename(path)} (no provenance record)")
            continue
        r = meta["runs"][-1]
        cmd = " ".join([os.path.basename(r["command"][0])] + r["command"][1:])
        commit = (r.get("kvq", {}).get("commit") or "unknown commit")[:12]
        dirty = "-dirty" if str(r.get("kvq", {}).get("commit", "")).endswith("-dirty") else ""
        parts.append(f"{os.path.basename(path)}: {cmd} (kvq {r.get('kvq', {}).get('version', '?')} "
                     f"{commit}{dirty}, {str(r.get('end', ''))[:10]})")
    return " | ".join(parts) or "no kvq input"


def pick_dump(rows, dump, path):
    """The rows of one dump: `dump` if given, else the only one there is."""
    dumps = sorted({r["dump"] for r in rows})
    if dump:
        rows = [r for r in rows if r["dump"] == dump]
        if not rows:
            raise InputError(f"{path}: no rows for dump {dump} (has: {', '.join(dumps)})")
    elif len(dumps) > 1:
        raise InputError(f"{path}: rows of {len(dumps)} dumps ({', '.join(dumps)}): choose one with --dump")
    return rows


def num(row, col, path):
    """The float value of a cell; NaN for an empty cell or JSON null."""
    v = row.get(col)
    if v is None or v == "":
        return math.nan
    try:
        return float(v)
    except (TypeError, ValueError):
        raise InputError(f"{path}: column {col}: expected a number, got {v!r}") from None


def integer(row, col, path):
    """The integer value of a cell (layer, head, channel indices)."""
    v = row.get(col)
    try:
        return int(v)
    except (TypeError, ValueError):
        raise InputError(f"{path}: column {col}: expected an integer, got {v!r}") from None


def add_style_args(p):
    """--width and --no-labels, the options every figure script takes."""
    p.add_argument("--width", choices=sorted(WIDTHS), default="double",
                   help="single (3.4 in, one column) or double (7 in, the page) column; fonts are 8 pt or more "
                        "at that size (default double)")
    p.add_argument("--no-labels", action="store_true", help="no point labels")


def style():
    """rcParams of a paper figure: 8 pt text at print size, thin lines,
    fonts embedded as TrueType in the PDF (editable, searchable)."""
    plt.rcParams.update({
        "font.size": FONT_PT, "axes.titlesize": FONT_PT + 1, "axes.labelsize": FONT_PT,
        "xtick.labelsize": FONT_PT, "ytick.labelsize": FONT_PT, "legend.fontsize": FONT_PT,
        "figure.titlesize": FONT_PT + 1, "lines.linewidth": 1.2, "lines.markersize": 4.5,
        "axes.linewidth": 0.6, "xtick.major.width": 0.6, "ytick.major.width": 0.6, "grid.linewidth": 0.4,
        "legend.frameon": False, "legend.handletextpad": 0.4, "legend.columnspacing": 1.0,
        "pdf.fonttype": 42, "ps.fonttype": 42, "savefig.dpi": DPI,
        "figure.constrained_layout.h_pad": 0.03, "figure.constrained_layout.w_pad": 0.03,
    })


def figure(width, panel_height, nrows=1, ncols=1, legend=None, nlegend=0, longest=20, **grid):
    """A figure `width` ('single' or 'double') wide with nrows x ncols panels
    of panel_height inches each and, when legend is 'right', 'bottom' or
    'auto' (right on a double column, below on a single one), a panel of its
    own for the legend of nlegend entries whose longest label has `longest`
    characters.  Returns (fig, axes [nrows][ncols] array, legend axes or None)."""
    import numpy as np
    style()
    W = WIDTHS[width]
    if legend == "auto":
        legend = "right" if width == "double" else "bottom"
    wr, hr = list(grid.pop("width_ratios", [1] * ncols)), list(grid.pop("height_ratios", [1] * nrows))
    H = panel_height * nrows
    lw = lh = 0
    if legend == "right":
        lw = min(0.45 * W, 0.3 + 0.058 * longest)  # a marker and the longest label at 8 pt
        ncol_leg = 1 if nlegend * 0.16 < H else 2
        lw *= ncol_leg
        wr.append(lw / (W - lw) * sum(wr))
    elif legend == "bottom":
        ncol_leg = max(1, min(nlegend, int(W // (0.3 + 0.058 * longest))))
        lh = 0.17 * math.ceil(max(nlegend, 1) / ncol_leg) + 0.08
        hr.append(lh / H * sum(hr))
        H += lh
    fig = plt.figure(figsize=(W, H), dpi=DPI, constrained_layout=True)
    gs = fig.add_gridspec(len(hr), len(wr), width_ratios=wr, height_ratios=hr, **grid)
    axes = np.array([[fig.add_subplot(gs[r, c]) for c in range(ncols)] for r in range(nrows)])
    lax = None
    if legend == "right":
        lax = fig.add_subplot(gs[:, -1])
    elif legend == "bottom":
        lax = fig.add_subplot(gs[-1, :])
    if lax is not None:
        lax.set_axis_off()
        lax._kvq_where, lax._kvq_ncol = legend, ncol_leg
    return fig, axes, lax


def legend(lax, handles, labels):
    """The legend in its own panel (figure's lax): top left beside the axes,
    or centred in rows below them."""
    if lax is None or not handles:
        return None
    if lax._kvq_where == "right":
        return lax.legend(handles, labels, loc="upper left", ncol=lax._kvq_ncol, borderaxespad=0)
    return lax.legend(handles, labels, loc="center", ncol=lax._kvq_ncol, borderaxespad=0)


def bottom_xlabel(axes, text):
    """The x label under each column's lowest panel (not under the legend)."""
    for c in range(axes.shape[1]):
        for r in range(axes.shape[0] - 1, -1, -1):
            if axes[r, c].axison:
                axes[r, c].set_xlabel(text)
                break


def legend_entries(axes):
    """The union of the panels' legend entries, in the order first seen."""
    seen = {}
    for ax in list(getattr(axes, "flat", axes)):
        for h, lab in zip(*ax.get_legend_handles_labels()):
            seen.setdefault(lab, h)
    return list(seen.values()), list(seen.keys())


def label_points(ax, points, enabled=True, **kw):
    """Labels next to points, (x, y, text) each; the ones that would overlap
    another label, a tick label or a title are dropped when the figure is
    saved (save -> finish).  enabled False (--no-labels): none."""
    if not enabled:
        return
    kw = {"fontsize": FONT_PT, "xytext": (3, 3), "textcoords": "offset points", **kw}
    labels = getattr(ax.figure, "_kvq_labels", [])
    for x, y, text in points:
        if math.isfinite(x) and math.isfinite(y):
            a = ax.annotate(text, (x, y), **kw)
            a.set_in_layout(False)  # labels never shrink the axes: the ones that do not fit are dropped
            labels.append(a)
    ax.figure._kvq_labels = labels


def _all_axes(fig):
    """The figure's axes and the ones inside them (inset colour bars)."""
    from matplotlib.axes import Axes
    return [a for a in fig.findobj(Axes)]


def texts(fig):
    """Every text the figure draws, non-empty: tick labels (only the ticks
    in view), axis labels, titles, legends, annotations."""
    from matplotlib.text import Text
    ticks, drawn = set(), []
    for ax in _all_axes(fig):
        if not ax.get_visible():
            continue
        for axis in (ax.xaxis, ax.yaxis):
            for t in axis.get_major_ticks() + axis.get_minor_ticks():
                ticks.update((t.label1, t.label2))
            if not axis.get_visible() or not ax.axison:
                continue
            for t in axis._update_ticks():  # the ticks the axis will draw (in view)
                drawn += [lab for lab in (t.label1, t.label2) if lab.get_visible() and lab.get_text().strip()]
    out = []
    for t in fig.findobj(Text):
        if t in ticks or not t.get_visible() or not t.get_text().strip() or t.figure is not fig:
            continue
        ax = getattr(t, "axes", None)
        if ax is not None and not ax.get_visible():
            continue
        out.append(t)
    return out + drawn


def _overlap(a, b, pad=0.5):
    return a.x0 < b.x1 - pad and b.x0 < a.x1 - pad and a.y0 < b.y1 - pad and b.y0 < a.y1 - pad


def _thin_ticks(fig):
    """Fewer tick labels on an axis whose labels touch: half the bins of a
    linear axis, powers of ten only on a log one, every other label of a
    fixed (categorical) one; redrawn until none touch."""
    for ax in _all_axes(fig):
        for axis in (ax.xaxis, ax.yaxis):
            for _ in range(4):
                r = fig.canvas.get_renderer()
                labs = [lab for t in axis._update_ticks() for lab in (t.label1, t.label2)
                        if lab.get_visible() and lab.get_text().strip()]
                boxes = [lab.get_window_extent(r) for lab in labs]
                if not any(_overlap(a, b) for i, a in enumerate(boxes) for b in boxes[i + 1:]):
                    break
                loc = axis.get_major_locator()
                if isinstance(loc, mticker.LogLocator):
                    axis.set_major_locator(mticker.LogLocator(base=10, numticks=max(2, len(labs) // 2 + 1)))
                elif isinstance(loc, mticker.FixedLocator):
                    for lab in labs[1::2]:
                        lab.set_visible(False)
                else:
                    axis.set_major_locator(mticker.MaxNLocator(nbins=max(1, len(labs) // 2), steps=[1, 2, 2.5, 5, 10]))
                fig.canvas.draw()


def finish(fig):
    """Fixes the layout (constrained layout run once, then frozen), thins
    tick labels that touch, and drops the point labels that overlap any
    other text or leave their panel."""
    fig.canvas.draw()
    fig.set_layout_engine("none")
    _thin_ticks(fig)
    labels = getattr(fig, "_kvq_labels", [])
    if not labels:
        return
    r = fig.canvas.get_renderer()
    fixed = [t.get_window_extent(r) for t in texts(fig) if t not in labels]
    kept = []
    for t in labels:
        bb, bounds = t.get_window_extent(r), t.axes.bbox  # inside its own panel
        inside = bb.x0 >= bounds.x0 and bb.x1 <= bounds.x1 and bb.y0 >= bounds.y0 and bb.y1 <= bounds.y1
        if not inside or any(_overlap(bb, o, pad=-3) for o in fixed + kept):  # 3 px apart at least
            t.set_visible(False)
        else:
            kept.append(bb)


def log_if_spread(ax, values, axis="y"):
    """Log scale only when the positive values span more than a decade; then
    at least three labelled ticks (1-2-5 steps when the powers of ten in view
    are fewer), plain numbers rather than powers where they are short."""
    pos = [v for v in values if v > 0 and math.isfinite(v)]
    if len(pos) < 2 or max(pos) / min(pos) <= 10:
        return False
    (ax.set_yscale if axis == "y" else ax.set_xscale)("log")
    lo, hi = min(pos), max(pos)
    powers = math.floor(math.log10(hi)) - math.ceil(math.log10(lo)) + 1
    a = ax.yaxis if axis == "y" else ax.xaxis
    if powers < 3:
        subs = (1.0, 2.0, 5.0) if axis == "y" or hi / lo < 30 else (1.0, 3.0)
        a.set_major_locator(mticker.LogLocator(base=10, subs=subs))
        a.set_minor_locator(mticker.LogLocator(base=10, subs=[s for s in range(2, 10) if s not in subs]))
        a.set_major_formatter(mticker.FuncFormatter(lambda v, _: f"{v:g}"))
        a.set_minor_formatter(mticker.NullFormatter())
    return True


def dnll_kl_panels(axes, series):
    """Two panels of kvq-eval rows against a size: left dnll (± dnll_se, symmetric log: it may be
    negative within noise), right KL (log when spread). series: [(points, style)], points
    [(x, {"dnll", "dnll_se", "kl"})], style the matplotlib keywords of its line."""
    for ax, metric in zip(axes.flat, ("dnll", "kl")):
        values = []
        for pts, style in series:
            pts = [(x, v[metric], v["dnll_se"]) for x, v in pts if math.isfinite(v[metric])]
            if not pts:
                continue
            xs, ys, es = zip(*pts)
            values += ys
            if metric == "dnll":
                ax.errorbar(xs, ys, yerr=es, capsize=1.5, **style)
            else:
                ax.plot(xs, ys, **style)
        if metric == "dnll":
            ax.set_yscale("symlog", linthresh=0.01)
            ax.axhline(0, color="0.5", linewidth=0.6)
            ax.set_ylabel("dnll (nats)")
        else:
            log_if_spread(ax, [v for v in values if v > 0])
            ax.set_ylabel("KL(p ‖ p′) (nats)")
        ax.grid(True, which="major", alpha=0.3)


def pareto_front(points):
    """Indices of the (x, y) points no other point beats on both (lower is
    better on each), sorted by x."""
    order = sorted(range(len(points)), key=lambda i: (points[i][0], points[i][1]))
    front, best = [], math.inf
    for i in order:
        x, y = points[i]
        if math.isfinite(y) and y < best:
            front.append(i)
            best = y
    return front


def save(fig, outdir, name, sources):
    """Writes OUTDIR/NAME.png and NAME.pdf (temporary name, then rename),
    after finish(); both carry the provenance caption of `sources` (see
    caption) in their metadata (the PDF's Subject, the PNG's Description)."""
    finish(fig)
    os.makedirs(outdir, exist_ok=True)
    written = []
    cap = caption(sources)
    fig._kvq_caption = cap
    meta = {"png": {"Title": name, "Description": cap, "Software": "kvq notebooks-export"},
            "pdf": {"Title": name, "Subject": cap, "Creator": f"kvq notebooks-export/{name}"}}
    for ext in ("png", "pdf"):
        final = os.path.join(outdir, f"{name}.{ext}")
        tmp = f"{final}.tmp.{os.getpid()}"
        try:
            fig.savefig(tmp, dpi=DPI, format=ext, metadata=meta[ext])
            os.replace(tmp, final)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        written.append(final)
    plt.close(fig)
    return written


def run(main, prog):
    """Runs main(); an InputError becomes one line on stderr and exit 1.  A
    script run from the shell draws off-screen (Agg); importing kvqplot, or
    running in a notebook, leaves the backend alone."""
    if not in_notebook():
        matplotlib.use("Agg")
    try:
        for path in main():
            print(f"{prog}: wrote {path}", file=sys.stderr)
    except InputError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        sys.exit(1)

"""kvqplot — what kvq's figure scripts share.

Reading kvq's CSV or JSON-lines output with a check of the columns a figure
needs; one colour and marker per quantizer family, the same in every figure;
axis labels with units; the Pareto front; and saving PNG + PDF atomically
(temporary name, then rename), like the kvq tools do.
"""
import csv
import json
import math
import os
import sys

import matplotlib

matplotlib.use("Agg")  # no display needed
import matplotlib.pyplot as plt  # noqa: E402

DPI = 100  # figures are FIGSIZE inches × DPI pixels exactly (no tight bbox)

# quantizer family -> (colour, marker), in registry order
FAMILY_STYLE = {
    "per-token": ("#1f77b4", "o"),
    "per-channel": ("#ff7f0e", "s"),
    "kivi": ("#2ca02c", "^"),
    "kcvt": ("#d62728", "v"),
    "absmax": ("#9467bd", "D"),
    "gear": ("#8c564b", "P"),
    "gear-l": ("#e377c2", "X"),
    "cluster": ("#7f7f7f", "*"),
    "lloydmax": ("#bcbd22", "h"),
    "fp8": ("#17becf", "p"),
    "fp4": ("#e6550d", "H"),
    "tender": ("#393b79", "d"),
    "ggml": ("#637939", "<"),
    "kvquant": ("#843c39", ">"),
    "turboquant": ("#7b4173", "8"),
}
_EXTRA = ["#aec7e8", "#ffbb78", "#98df8a", "#ff9896"]

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
    if name in FAMILY_STYLE:
        return FAMILY_STYLE[name]
    if name not in _seen:
        _seen[name] = (_EXTRA[len(_seen) % len(_EXTRA)], "o")
    return _seen[name]


def metric_label(col):
    return METRIC_LABEL.get(col, col)


def key_label(key):
    return KEY_LABEL.get(key, key)


def in_notebook():
    """True inside Jupyter: scripts then use their default arguments."""
    return "ipykernel" in sys.modules


def read_rows(path, required, what="kvq output"):
    """Rows (dicts of strings or JSON values) and the column names of a kvq
    CSV or JSON-lines file; InputError if it is missing, unreadable, empty or
    lacks any of the `required` columns."""
    if not os.path.isfile(path):
        raise InputError(f"{path}: no such file (expected {what}; "
                         "notebooks-export/make_figures.sh writes every input)")
    try:
        with open(path, newline="", encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise InputError(f"{path}: cannot read: {e}") from None
    if text.lstrip().startswith("{"):
        rows = []
        for i, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise InputError(f"{path}: line {i}: not JSON ({e.msg})") from None
            if not isinstance(row, dict):
                raise InputError(f"{path}: line {i}: expected a JSON object")
            rows.append(row)
        cols = list(rows[0].keys()) if rows else []
    else:
        reader = csv.DictReader(text.splitlines())
        cols = reader.fieldnames or []
        try:
            rows = list(reader)
        except csv.Error as e:
            raise InputError(f"{path}: malformed CSV: {e}") from None
    missing = [c for c in required if c not in cols]
    if missing:
        raise InputError(f"{path}: missing column{'s' if len(missing) > 1 else ''} {', '.join(missing)} "
                         f"(expected {what}; found: {', '.join(cols[:12]) or 'no header'}"
                         f"{', ...' if len(cols) > 12 else ''})")
    if not rows:
        raise InputError(f"{path}: no rows (expected {what})")
    return rows, cols


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


def log_if_spread(ax, values, axis="y"):
    """Log scale when the positive values span more than a decade."""
    pos = [v for v in values if v > 0 and math.isfinite(v)]
    if len(pos) >= 2 and max(pos) / min(pos) > 10:
        (ax.set_yscale if axis == "y" else ax.set_xscale)("log")
        return True
    return False


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


def save(fig, outdir, name):
    """Writes OUTDIR/NAME.png and NAME.pdf (temporary name, then rename)."""
    os.makedirs(outdir, exist_ok=True)
    written = []
    for ext in ("png", "pdf"):
        final = os.path.join(outdir, f"{name}.{ext}")
        tmp = f"{final}.tmp.{os.getpid()}"
        try:
            fig.savefig(tmp, dpi=DPI, format=ext)
            os.replace(tmp, final)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        written.append(final)
    plt.close(fig)
    return written


def run(main, prog):
    """Runs main(); an InputError becomes one line on stderr and exit 1."""
    try:
        for path in main():
            print(f"{prog}: wrote {path}", file=sys.stderr)
    except InputError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        sys.exit(1)

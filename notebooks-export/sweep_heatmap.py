# %% [markdown]
# # Sweep heat map: one metric over two grid keys
#
# A metric of a `kvq-sweep` output (default `out_rel_joint`, the error the next layer sees) over two of its grid keys (default
# the first two, e.g. KIVI's group size × residual window), one panel per value of a
# remaining grid key (e.g. bits), all panels on one colour scale (logarithmic where the
# values span more than a decade). Grey cells are grid points that are invalid for the
# quantizer (e.g. a residual window that is not a multiple of the group) or were not run.
# `--metric bits` plots the effective bits per element `(k_bits + v_bits)/2`.
#
# Regenerate (with every other figure): `notebooks-export/make_figures.sh`, or alone:
#
#     kvq-sweep data/stories260K.h5 --quant kivi --grid bits=2,4 --grid group=16,32,64,128 \
#         --grid residual=0,32,64,128 --per model -o sweep.csv
#     python3 notebooks-export/sweep_heatmap.py --input sweep.csv --x group --y residual --out figures
#
# Opened as a notebook (jupytext), it runs with the defaults below.

# %%
import argparse
import math

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.colors import LogNorm, Normalize

import kvqplot

PANELS_MAX = 4


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="A kvq-sweep metric over two grid keys, one panel per value of a third.")
    p.add_argument("--input", default="figures/data/sweep-kivi.csv", help="kvq-sweep output (CSV or JSON lines)")
    p.add_argument("--x", help="grid key on the x axis (default: the first grid key)")
    p.add_argument("--y", help="grid key on the y axis (default: the second grid key)")
    p.add_argument("--metric", default="out_rel_joint", help="metric column, or 'bits' = (k_bits + v_bits)/2")
    p.add_argument("--where", action="append", default=[], metavar="KEY=VALUE",
                   help="keep only rows with this grid value; repeatable")
    p.add_argument("--layer", default="all", help="the layer rows to use (default 'all': kvq-sweep --per model)")
    p.add_argument("--dump", help="the dump to plot when the sweep has several")
    p.add_argument("--out", default="figures", help="output folder")
    p.add_argument("--name", default="sweep_heatmap", help="file name without extension")
    kvqplot.add_style_args(p)
    return p.parse_args([] if kvqplot.in_notebook() else argv)


# %% [markdown]
# ## Read the sweep and find its grid keys (the columns between the last metric and `point`)

# %%
def load(args):
    need = ["dump", "layer", "head", "quantizer", "k_bits", "v_bits", "static_bytes", "point"]
    if args.metric != "bits":
        need.append(args.metric)
    rows, cols, src = kvqplot.read_rows(args.input, need, "kvq-sweep output")
    last = "attn_mass" if "attn_mass" in cols else "static_bytes"
    keys = cols[cols.index(last) + 1:cols.index("point")]
    if len(keys) < 2:
        raise kvqplot.InputError(f"{args.input}: {len(keys)} grid key(s) ({', '.join(keys) or 'none'}): "
                                 "a heat map needs two")
    x = args.x or keys[0]
    y = args.y or ([k for k in keys if k != x] or [None])[0]
    for k in (x, y):
        if k not in keys:
            raise kvqplot.InputError(f"{args.input}: '{k}' is not a grid key (grid keys: {', '.join(keys)})")
    if x == y:
        raise kvqplot.InputError(f"--x and --y are both '{x}'")
    where = {}
    for w in args.where:
        k, _, v = w.partition("=")
        if k not in keys or not v:
            raise kvqplot.InputError(f"--where {w}: expected KEY=VALUE with a grid key ({', '.join(keys)})")
        where[k] = v
    rows = [r for r in rows if str(r["layer"]) == args.layer and str(r["head"]) == "all"]
    if not rows:
        raise kvqplot.InputError(f"{args.input}: no rows with layer '{args.layer}' and head 'all' "
                                 "(run kvq-sweep with --per model, or pick --layer N of a --per layer sweep)")
    rows = kvqplot.pick_dump(rows, args.dump, args.input)
    rows = [r for r in rows if all(str(r[k]) == v for k, v in where.items())]
    if not rows:
        raise kvqplot.InputError(f"{args.input}: no rows left after --where/--dump")
    rest = [k for k in keys if k not in (x, y) and k not in where and len({str(r[k]) for r in rows}) > 1]
    if len(rest) > 1:
        raise kvqplot.InputError(f"grid keys {', '.join(rest)} vary too: fix all but one with --where KEY=VALUE")
    facet = rest[0] if rest else None
    return rows, x, y, facet, [src]


def value(r, args):
    if args.metric == "bits":
        return (kvqplot.num(r, "k_bits", args.input) + kvqplot.num(r, "v_bits", args.input)) / 2
    return kvqplot.num(r, args.metric, args.input)


def sort_key(v):
    try:
        return (0, float(v), "")
    except ValueError:
        return (1, 0.0, v)


# %% [markdown]
# ## Plot: one panel per facet value, shared colour scale, values written in the cells

# %%
def plot(rows, x, y, facet, args):
    xs = sorted({str(r[x]) for r in rows}, key=sort_key)
    ys = sorted({str(r[y]) for r in rows}, key=sort_key)
    fvals = sorted({str(r[facet]) for r in rows}, key=sort_key) if facet else [None]
    if len(fvals) > PANELS_MAX:
        raise kvqplot.InputError(f"'{facet}' has {len(fvals)} values: at most {PANELS_MAX} panels "
                                 f"(choose some with --where {facet}=VALUE)")
    grids = []
    for fv in fvals:
        g = np.full((len(ys), len(xs)), np.nan)
        for r in rows:
            if fv is None or str(r[facet]) == fv:
                g[ys.index(str(r[y])), xs.index(str(r[x]))] = value(r, args)
        grids.append(g)
    finite = np.concatenate([g[np.isfinite(g)] for g in grids])
    if finite.size == 0:
        raise kvqplot.InputError(f"{args.input}: no finite {args.metric} values (a dump without queries?)")
    lo, hi = float(finite.min()), float(finite.max())
    log = lo > 0 and hi / lo > 10
    norm = LogNorm(lo, hi) if log else Normalize(lo, hi if hi > lo else lo + 1)
    cmap = plt.get_cmap("viridis").copy()
    cmap.set_bad("#d9d9d9")
    n = len(fvals)
    single = args.width == "single"
    # a single column stacks the panels; the page puts them side by side
    fig, axes, _ = kvqplot.figure(args.width, 1.5 if single else 2.6, n if single else 1, 1 if single else n)
    axes = list(axes.flat)
    label = "bits per element, (k_bits + v_bits)/2" if args.metric == "bits" else \
        kvqplot.metric_label(args.metric, short=single)
    for ax, fv, g in zip(axes, fvals, grids):
        im = ax.imshow(np.ma.masked_invalid(g), cmap=cmap, norm=norm, origin="lower", aspect="auto")
        ax.set_xticks(range(len(xs)), xs)
        ax.set_yticks(range(len(ys)), ys)
        ax.set_xlabel(x if single else kvqplot.key_label(x))
        ax.set_ylabel(y if single else kvqplot.key_label(y))
        if fv is not None:
            ax.set_title(f"{facet} = {fv}")
        for i in range(len(ys)):
            for j in range(len(xs)):
                v = g[i, j]
                txt = "invalid" if not math.isfinite(v) else f"{v:.3g}"
                bright = math.isfinite(v) and norm(v) > 0.6
                ax.text(j, i, txt, ha="center", va="center", fontsize=kvqplot.FONT_PT,
                        color="black" if bright or not math.isfinite(v) else "white")
    cb = fig.colorbar(im, ax=list(axes), fraction=0.05 if single else 0.04, pad=0.02)
    cb.set_label(label + (" (log)" if log else ""))
    if not single:
        fig.suptitle(f"{rows[0]['dump']}: {rows[0]['quantizer']} sweep, {label.split('  ')[0]} "
                     "(pooled over the model)")
    return fig


# %%
def main(argv=None):
    args = parse_args(argv)
    rows, x, y, facet, sources = load(args)
    return kvqplot.save(plot(rows, x, y, facet, args), args.out, args.name, sources)


if __name__ == "__main__":
    kvqplot.run(main, "sweep_heatmap")

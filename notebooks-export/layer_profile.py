# %% [markdown]
# # Per-layer error profiles of several quantizers
#
# For each quantizer configuration of a `kvq-analyze --per layer` table: the attention
# error, the layer-output error and the key and value errors, layer by layer. Layers
# differ a lot (the first layers of small models often have the most peaked attention), and
# a quantizer's average error can hide one layer that it breaks. Colours follow the
# quantizer family as in the other figures; log scale where errors span decades.
#
# Regenerate (with every other figure): `notebooks-export/make_figures.sh`, or alone:
#
#     kvq-analyze -q kivi:bits=2 -q kcvt:bits=2 -q per-token:bits=4 --per layer -o layers.csv data/stories260K.h5
#     python3 notebooks-export/layer_profile.py --input layers.csv --out figures
#
# Opened as a notebook (jupytext), it runs with the defaults below.

# %%
import argparse
import math

import matplotlib.pyplot as plt

import kvqplot

STYLES = ["-", "--", ":", "-."]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="Per-layer error of several quantizers.")
    p.add_argument("--input", default="figures/data/analyze-layer.csv",
                   help="kvq-analyze --per layer output (CSV or JSON lines)")
    p.add_argument("--metrics", default="attn_rel,out_rel_joint,k_rel_fro,v_rel_fro",
                   help="up to four metric columns, comma-separated")
    p.add_argument("--dump", help="the dump to plot when the table has several")
    p.add_argument("--out", default="figures", help="output folder")
    p.add_argument("--name", default="layer_profile", help="file name without extension")
    kvqplot.add_style_args(p)
    return p.parse_args([] if kvqplot.in_notebook() else argv)


# %% [markdown]
# ## Read the per-layer rows

# %%
def load(args):
    metrics = [m for m in args.metrics.split(",") if m]
    if not 1 <= len(metrics) <= 4:
        raise kvqplot.InputError(f"--metrics {args.metrics}: expected one to four metric columns")
    rows, _, src = kvqplot.read_rows(args.input, ["dump", "layer", "head", "quantizer", "spec"] + metrics,
                                "kvq-analyze --per layer output")
    rows = [r for r in rows if str(r["layer"]) != "all" and str(r["head"]) == "all"]
    if not rows:
        raise kvqplot.InputError(f"{args.input}: no per-layer rows (a layer number and head 'all'): "
                                 "run kvq-analyze with --per layer")
    rows = kvqplot.pick_dump(rows, args.dump, args.input)
    series = {}  # spec -> (family, {layer: {metric: value}})
    for r in rows:
        fam, by_layer = series.setdefault(r["spec"], (r["quantizer"], {}))
        by_layer[kvqplot.integer(r, "layer", args.input)] = {m: kvqplot.num(r, m, args.input) for m in metrics}
    return rows[0]["dump"], metrics, series, [src]


# %% [markdown]
# ## Plot: one panel per metric, one line per configuration

# %%
def plot(dump, metrics, series, args):
    single = args.width == "single"
    styles = kvqplot.spec_styles([(fam, spec) for spec, (fam, _) in series.items()])
    nrows = (len(metrics) + 1) // 2
    fig, axes, lax = kvqplot.figure(args.width, 1.45 if single else 2.0, nrows, 2 if len(metrics) > 1 else 1,
                                    legend="auto", nlegend=len(series), longest=max(map(len, series)))
    per_family = {}
    for ax, metric in zip(axes.flat, metrics):
        values = []
        for spec, (fam, by_layer) in series.items():
            layers = sorted(by_layer)
            ys = [by_layer[l][metric] for l in layers]
            if not any(math.isfinite(v) for v in ys):
                continue
            values += ys
            colour, marker = styles[(fam, spec)]
            k = per_family.setdefault(spec, sum(1 for s in per_family if series[s][0] == fam))
            ax.plot(layers, ys, color=colour, marker=marker, markersize=3.5, linewidth=1,
                    linestyle=STYLES[k % len(STYLES)], label=spec)
        if not values:
            ax.text(0.5, 0.5, f"no {metric} values\n(no queries)", ha="center", va="center",
                    transform=ax.transAxes)
            ax.set_axis_off()
            continue
        kvqplot.log_if_spread(ax, values)
        ax.set_ylabel(kvqplot.metric_label(metric, short=single))
        ax.xaxis.get_major_locator().set_params(integer=True)
        ax.grid(True, which="major", alpha=0.3)
    for ax in axes.flat[len(metrics):]:
        ax.set_axis_off()
    kvqplot.bottom_xlabel(axes, "layer")
    kvqplot.legend(lax, *kvqplot.legend_entries(axes))
    if not single:
        fig.suptitle(f"{dump}: error per layer ({len(series)} configurations)")
    return fig


# %%
def main(argv=None):
    args = parse_args(argv)
    dump, metrics, series, sources = load(args)
    return kvqplot.save(plot(dump, metrics, series, args), args.out, args.name, sources)


if __name__ == "__main__":
    kvqplot.run(main, "layer_profile")

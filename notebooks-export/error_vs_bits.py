# %% [markdown]
# # Error against effective bits, per quantizer family
#
# For every quantizer configuration in a `kvq-analyze --per model` table: the attention
# error `attn_rel`, the layer-output error `out_rel_joint`, and the key and value errors
# `k_rel_fro` / `v_rel_fro`, against the effective bits per element `(k_bits + v_bits)/2`
# (the true stored cost: codes, scales, zeros, exact windows, outliers, low-rank factors).
# Colours and markers mark the family; the dashed black line and the ringed points are the
# Pareto front (no other configuration has both fewer bits and a lower error).
#
# Regenerate (with every other figure): `notebooks-export/make_figures.sh`, or alone:
#
#     python3 notebooks-export/error_vs_bits.py --input figures/data/analyze-model.csv --out figures
#
# Opened as a notebook (jupytext), it runs with the defaults below.

# %%
import argparse
import math

import matplotlib.pyplot as plt

import kvqplot

PANELS = ["attn_rel", "out_rel_joint", "k_rel_fro", "v_rel_fro"]
REQUIRED = ["dump", "layer", "head", "quantizer", "spec", "k_bits", "v_bits"] + PANELS
FIGSIZE = (12, 9)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="Error vs effective bits per quantizer family, with the Pareto front.")
    p.add_argument("--input", default="figures/data/analyze-model.csv",
                   help="kvq-analyze --per model output (CSV or JSON lines)")
    p.add_argument("--dump", help="the dump to plot when the table has several (default: the only one)")
    p.add_argument("--out", default="figures", help="output folder")
    p.add_argument("--name", default="error_vs_bits", help="file name without extension")
    return p.parse_args([] if kvqplot.in_notebook() else argv)


# %% [markdown]
# ## Read the per-model rows

# %%
def load(args):
    rows, _ = kvqplot.read_rows(args.input, REQUIRED, "kvq-analyze --per model output")
    rows = [r for r in rows if str(r["layer"]) == "all" and str(r["head"]) == "all"]
    if not rows:
        raise kvqplot.InputError(f"{args.input}: no per-model rows (layer and head 'all'): "
                                 "run kvq-analyze with --per model")
    rows = kvqplot.pick_dump(rows, args.dump, args.input)
    pts = []
    for r in rows:
        bits = (kvqplot.num(r, "k_bits", args.input) + kvqplot.num(r, "v_bits", args.input)) / 2
        pts.append({"family": r["quantizer"], "spec": r["spec"], "bits": bits,
                    **{m: kvqplot.num(r, m, args.input) for m in PANELS}})
    return rows[0]["dump"], pts


# %% [markdown]
# ## Plot: one panel per metric, log scale where errors span decades

# %%
def plot(dump, pts, args):
    fig, axes = plt.subplots(2, 2, figsize=FIGSIZE, dpi=kvqplot.DPI)
    families = list(dict.fromkeys(p["family"] for p in pts))
    for ax, metric in zip(axes.flat, PANELS):
        sel = [p for p in pts if math.isfinite(p[metric])]
        if not sel:
            ax.text(0.5, 0.5, f"no {metric} values\n(the dump has no queries)", ha="center", va="center",
                    transform=ax.transAxes)
            ax.set_axis_off()
            continue
        for fam in families:
            fp = [p for p in sel if p["family"] == fam]
            if not fp:
                continue
            colour, marker = kvqplot.family_style(fam)
            ax.scatter([p["bits"] for p in fp], [p[metric] for p in fp], color=colour, marker=marker,
                       s=110 if marker == "*" else 50,
                       label=fam, zorder=3, edgecolors="white", linewidths=0.5)
        front = kvqplot.pareto_front([(p["bits"], p[metric]) for p in sel])
        fx = [sel[i]["bits"] for i in front]
        fy = [sel[i][metric] for i in front]
        ax.step(fx, fy, where="post", color="black", linestyle="--", linewidth=1, zorder=2, label="Pareto front")
        ax.scatter(fx, fy, s=140, facecolors="none", edgecolors="black", linewidths=1, zorder=4)
        kvqplot.log_if_spread(ax, [p[metric] for p in sel])
        ax.set_xlabel("effective bits per element, (k_bits + v_bits)/2")
        ax.set_ylabel(kvqplot.metric_label(metric))
        ax.grid(True, which="both", alpha=0.3)
    handles, labels = axes.flat[0].get_legend_handles_labels()
    for ax in axes.flat[1:]:  # families missing from the first panel
        for h, lab in zip(*ax.get_legend_handles_labels()):
            if lab not in labels:
                handles.append(h)
                labels.append(lab)
    fig.legend(handles, labels, loc="lower center", ncol=min(len(labels), 6), frameon=False, fontsize=10)
    fig.suptitle(f"{dump}: error against stored bits ({len(pts)} configurations, pooled over the model)")
    fig.subplots_adjust(left=0.08, right=0.98, top=0.93, bottom=0.14, hspace=0.3, wspace=0.22)
    return fig


# %%
def main(argv=None):
    args = parse_args(argv)
    dump, pts = load(args)
    return kvqplot.save(plot(dump, pts, args), args.out, args.name)


if __name__ == "__main__":
    kvqplot.run(main, "error_vs_bits")

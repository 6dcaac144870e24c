# %% [markdown]
# # Error against effective bits, per quantizer family
#
# For every quantizer configuration in a `kvq-analyze --per model` table: the attention
# error `attn_rel`, the layer-output error `out_rel_joint`, and the key and value errors
# `k_rel_fro` / `v_rel_fro`, against the effective bits per element `(k_bits + v_bits)/2`
# (the true stored cost: codes, scales, zeros, exact windows, outliers, low-rank factors).
# Markers mark the family, shades its specs (darker: fewer bits), small numbers the bits per
# code; the dashed black line and the ringed, named points are the Pareto front (no other
# configuration has both fewer bits and a lower error). `--width single|double` sizes it for
# one column or the page; `--no-labels` leaves the numbers out.
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


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="Error vs effective bits per quantizer family, with the Pareto front.")
    p.add_argument("--input", default="figures/data/analyze-model.csv",
                   help="kvq-analyze --per model output (CSV or JSON lines)")
    p.add_argument("--dump", help="the dump to plot when the table has several (default: the only one)")
    p.add_argument("--out", default="figures", help="output folder")
    p.add_argument("--name", default="error_vs_bits", help="file name without extension")
    kvqplot.add_style_args(p)
    return p.parse_args([] if kvqplot.in_notebook() else argv)


# %% [markdown]
# ## Read the per-model rows

# %%
def load(args):
    rows, _, src = kvqplot.read_rows(args.input, REQUIRED, "kvq-analyze --per model output")
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
    return rows[0]["dump"], pts, [src]


# %% [markdown]
# ## Plot: one panel per metric, log scale where errors span decades
#
# Each family keeps its marker and colour in every kvq figure; its specs are shades of that
# colour (darker: fewer bits), and each point is labelled with its nominal bit width where the
# label has room. The dashed black line and the ringed points are the Pareto front; its points
# are labelled with their family and bits first.

# %%
def short(p):
    """'kivi 2b' for a spec with a bit width, else the family and its first key."""
    b = kvqplot.spec_bits(p["spec"])
    if b is not None:
        return f"{p['family']} {b:g}b"
    rest = p["spec"].split(":", 1)[1].split(",")[0] if ":" in p["spec"] else ""
    return f"{p['family']} {rest.split('=')[-1]}".strip()


def plot(dump, pts, args):
    families = list(dict.fromkeys(p["family"] for p in pts))
    styles = kvqplot.spec_styles([(p["family"], p["spec"]) for p in pts])
    single = args.width == "single"
    fig, axes, lax = kvqplot.figure(args.width, 1.45 if single else 2.1, 2, 2, legend="auto",
                                    nlegend=len(families) + 1, longest=max(map(len, families + ["Pareto front"])))
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
            ax.scatter([p["bits"] for p in fp], [p[metric] for p in fp], c=[styles[(fam, p["spec"])][0] for p in fp],
                       marker=marker, s=28 if marker == "*" else 16, zorder=3, edgecolors="white", linewidths=0.3)
            ax.scatter([], [], color=colour, marker=marker, s=20, label=fam)  # the legend's entry: the family
        front = kvqplot.pareto_front([(p["bits"], p[metric]) for p in sel])
        fx = [sel[i]["bits"] for i in front]
        fy = [sel[i][metric] for i in front]
        ax.step(fx, fy, where="post", color="black", linestyle="--", linewidth=0.8, zorder=2, label="Pareto front")
        ax.scatter(fx, fy, s=50, facecolors="none", edgecolors="black", linewidths=0.6, zorder=4)
        kvqplot.log_if_spread(ax, [p[metric] for p in sel])
        # labels: the front's points by name first, then every point's nominal bit width
        kvqplot.label_points(ax, [(sel[i]["bits"], sel[i][metric], short(sel[i])) for i in front],
                             enabled=not args.no_labels, fontweight="bold")
        kvqplot.label_points(ax, [(p["bits"], p[metric], f"{kvqplot.spec_bits(p['spec']):g}")
                                  for i, p in enumerate(sel)
                                  if kvqplot.spec_bits(p["spec"]) is not None and i not in front],
                             enabled=not args.no_labels, color="0.35", xytext=(2, -8))
        ax.set_ylabel(kvqplot.metric_label(metric, short=single))
        ax.grid(True, which="major", alpha=0.3)
    kvqplot.bottom_xlabel(axes, "bits per element" if single else "stored bits per element, (k_bits + v_bits)/2")
    kvqplot.legend(lax, *kvqplot.legend_entries(axes))
    if not single:
        fig.suptitle(f"{dump}: error against stored bits ({len(pts)} configurations, pooled over the model; "
                     "labels: bits per code)")
    return fig


# %%
def main(argv=None):
    args = parse_args(argv)
    dump, pts, sources = load(args)
    return kvqplot.save(plot(dump, pts, args), args.out, args.name, sources)


if __name__ == "__main__":
    kvqplot.run(main, "error_vs_bits")

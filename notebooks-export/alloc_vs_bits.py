# %% [markdown]
# # Bit allocation: the loss against the bits, allocated per layer or uniform
#
# `kvq-alloc` measures each layer's sensitivity to every point of a family's grid (the
# loss rise with only that layer quantized), picks per bit budget the per-layer
# assignment with the least predicted loss (an exact knapsack), and evaluates it in full
# beside every uniform point (the same point in all layers). Here: the measured `dnll`
# against the mean stored bits per element (K and V together) — the allocations as a
# line, the uniform points as markers labelled by their keys — with error bars of one
# standard error (`dnll_se`). An allocation below the uniform points at the same bits is
# what per-layer, per-tensor precision buys.
#
# Regenerate (with every other figure): `notebooks-export/make_figures.sh`, or alone:
#
#     kvq-alloc model.gguf --text story.txt --family kivi --grid kbits=2,4,8 --grid vbits=2,4,8 \
#         --fixed residual=0 --budget 5,6,7,8,10 -o alloc.csv
#     python3 notebooks-export/alloc_vs_bits.py --input alloc.csv --out figures
#
# Opened as a notebook (jupytext), it runs with the defaults below.

# %%
import argparse
import math
import re

import matplotlib.pyplot as plt

import kvqplot

COLS = ["budget", "spec", "mean_bits", "dnll", "dnll_se"]
UCOLS = ["spec", "mean_bits", "dnll", "dnll_se"]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="dnll against mean bits: kvq-alloc's allocations and uniform points.")
    p.add_argument("--input", default="figures/data/alloc.csv", help="kvq-alloc output (OUT)")
    p.add_argument("--uniform", help="its OUT.uniform.csv (default: beside --input)")
    p.add_argument("--out", default="figures", help="output folder")
    p.add_argument("--name", default="alloc_vs_bits", help="file name without extension")
    kvqplot.add_style_args(p)
    return p.parse_args([] if kvqplot.in_notebook() else argv)


def point_label(spec):
    """The grid keys of a uniform point, short: 'kivi:residual=0,kbits=4,vbits=2' -> 'k4 v2' when
    kbits/vbits are there, else the keys after the family name."""
    keys = dict(kv.split("=", 1) for kv in spec.split(":", 1)[1].split(",")) if ":" in spec else {}
    if "kbits" in keys or "vbits" in keys:
        return f"k{keys.get('kbits', keys.get('bits', '?'))} v{keys.get('vbits', keys.get('bits', '?'))}"
    return spec.split(":", 1)[-1]


# %%
def main(argv=None):
    a = parse_args(argv)
    rows, _, src = kvqplot.read_rows(a.input, COLS, "kvq-alloc output")
    upath = a.uniform or re.sub(r"$", ".uniform.csv", a.input)
    uni, _, usrc = kvqplot.read_rows(upath, UCOLS, "kvq-alloc's OUT.uniform.csv")
    alloc = sorted(((kvqplot.num(r, "mean_bits", a.input), kvqplot.num(r, "dnll", a.input),
                     kvqplot.num(r, "dnll_se", a.input), kvqplot.num(r, "budget", a.input))
                    for r in rows if str(r["spec"]).startswith("mix(")))
    if not alloc:
        raise kvqplot.InputError(f"{a.input}: no allocation rows (spec mix(...)): expected kvq-alloc output")
    single = a.width == "single"
    fig, axes, _ = kvqplot.figure(a.width, 2.4 if single else 3.0)
    ax = axes[0, 0]
    color = kvqplot.OKABE_ITO[0]
    ax.errorbar([x for x, *_ in alloc], [y for _, y, *_ in alloc], yerr=[e for _, _, e, _ in alloc], color=color,
                marker="o", markersize=4, capsize=2, label="per-layer allocation")
    kvqplot.label_points(ax, [(x, y, f"{b:g} b") for x, y, _, b in alloc], enabled=not a.no_labels, color=color,
                         xytext=(4, 4))
    ux = [kvqplot.num(r, "mean_bits", upath) for r in uni]
    uy = [kvqplot.num(r, "dnll", upath) for r in uni]
    ue = [kvqplot.num(r, "dnll_se", upath) for r in uni]
    ax.errorbar(ux, uy, yerr=ue, fmt="s", markersize=3.5, color=kvqplot.OKABE_ITO[1], capsize=2,
                label="uniform")
    kvqplot.label_points(ax, [(x, y, point_label(str(r["spec"]))) for x, y, r in zip(ux, uy, uni)],
                         enabled=not a.no_labels, color="0.3", xytext=(4, -9))
    ys = [abs(y) for y in uy + [y for _, y, *_ in alloc] if y != 0]
    if ys and max(ys) / min(ys) > 30:  # losses span decades (and may dip below 0 in noise): linear near 0
        ax.set_yscale("symlog", linthresh=max(min(ys), max(ys) / 1000))
    ax.axhline(0, color="0.8", lw=0.8)
    ax.set(xlabel="mean stored bits per element (K and V)", ylabel="dnll (nats per token)")
    if not single:
        ax.set_title("loss rise against bits: per-layer allocation vs uniform")
    ax.legend(loc="best")  # inside, where it covers the fewest points
    if any(not math.isfinite(v) for v in ux + uy):
        raise kvqplot.InputError(f"{upath}: non-finite values")
    return kvqplot.save(fig, a.out, a.name, [src, usrc])


# %%
if __name__ == "__main__" or kvqplot.in_notebook():
    kvqplot.run(main, "alloc_vs_bits")

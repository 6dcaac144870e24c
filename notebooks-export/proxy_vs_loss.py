# %% [markdown]
# # Do the offline proxies predict what a quantized cache does to the model?
#
# Left and middle: for each layer and quantizer, an offline proxy measured by `kvq-analyze`
# on that layer's dumped K/V/Q (`attn_kl`, `out_rel_joint`) against `dnll`, the rise of the
# model's mean next-token loss when only that layer's cache is quantized
# (`kvq-eval --per-layer`, prefill). The title gives Spearman's rank correlation: how well the
# proxy orders the (layer, quantizer) cells by their real cost. Right: `dnll` with every
# layer quantized, the whole cache at once (prefill, the papers' convention) against the
# cache as generation holds it (decode).
#
# Regenerate (with every other figure, when the bundled model is present):
# `notebooks-export/make_figures.sh`, or alone:
#
#     kvq-dump MODEL --text T -o d.h5
#     kvq-analyze -q ... --per layer -o proxy.csv d.h5
#     kvq-eval MODEL --text T -q ... --per-layer -o layer.csv
#     kvq-eval MODEL --text T -q ... --policy prefill,decode -o policy.csv
#     python3 notebooks-export/proxy_vs_loss.py --analyze proxy.csv --eval-layer layer.csv --eval-policy policy.csv
#
# Opened as a notebook (jupytext), it runs with the defaults below.

# %%
import argparse
import math

import matplotlib.pyplot as plt
import numpy as np

import kvqplot

FIGSIZE = (15, 5)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="Offline proxies against the model's loss.")
    p.add_argument("--analyze", default="figures/data/proxy-layer.csv", help="kvq-analyze --per layer output")
    p.add_argument("--eval-layer", default="figures/data/eval-layer.csv", help="kvq-eval --per-layer output")
    p.add_argument("--eval-policy", default="figures/data/eval-policy.csv",
                   help="kvq-eval --policy prefill,decode output")
    p.add_argument("--proxies", default="attn_kl,out_rel_joint", help="two kvq-analyze columns")
    p.add_argument("--out", default="figures", help="output folder")
    p.add_argument("--name", default="proxy_vs_loss", help="file name without extension")
    return p.parse_args([] if kvqplot.in_notebook() else argv)


# %% [markdown]
# ## Join the proxies and the losses on (spec, layer)

# %%
def load(args):
    proxies = [c for c in args.proxies.split(",") if c]
    if len(proxies) != 2:
        raise kvqplot.InputError(f"--proxies {args.proxies}: expected two kvq-analyze columns")
    arows, _ = kvqplot.read_rows(args.analyze, ["layer", "head", "quantizer", "spec"] + proxies,
                                 "kvq-analyze --per layer output")
    lrows, _ = kvqplot.read_rows(args.eval_layer, ["quantizer", "spec", "policy", "layer", "dnll"],
                                 "kvq-eval --per-layer output")
    prows, _ = kvqplot.read_rows(args.eval_policy, ["quantizer", "spec", "policy", "layer", "dnll"],
                                 "kvq-eval --policy prefill,decode output")
    proxy = {(r["spec"], str(r["layer"])): r for r in arows if str(r["layer"]) != "all" and str(r["head"]) == "all"}
    cells = []  # (family, spec, layer, {proxy: value}, dnll)
    for r in lrows:
        if str(r["layer"]) == "all" or r["policy"] != "prefill" or r["spec"] == "none":
            continue
        a = proxy.get((r["spec"], str(r["layer"])))
        if a is None:
            continue
        cells.append((r["quantizer"], r["spec"], str(r["layer"]),
                      {c: kvqplot.num(a, c, args.analyze) for c in proxies}, kvqplot.num(r, "dnll", args.eval_layer)))
    if not cells:
        raise kvqplot.InputError(f"{args.eval_layer}: no per-layer prefill rows whose spec and layer appear in "
                                 f"{args.analyze} (run both with the same -q specs, kvq-eval with --per-layer)")
    policy = {}
    for r in prows:
        if str(r["layer"]) == "all" and r["spec"] != "none":
            policy.setdefault(r["spec"], [r["quantizer"], math.nan, math.nan])
            policy[r["spec"]][1 if r["policy"] == "prefill" else 2] = kvqplot.num(r, "dnll", args.eval_policy)
    if not policy:
        raise kvqplot.InputError(f"{args.eval_policy}: no rows for all layers (run kvq-eval without --per-layer)")
    return proxies, cells, policy


def spearman(x, y):
    """Rank correlation (average ranks for ties)."""
    def ranks(v):
        order = np.argsort(v, kind="mergesort")
        r = np.empty(len(v))
        r[order] = np.arange(len(v))
        for u in np.unique(v):  # ties share their mean rank
            r[v == u] = r[v == u].mean()
        return r
    x, y = np.asarray(x, float), np.asarray(y, float)
    if len(x) < 3:
        return math.nan
    return float(np.corrcoef(ranks(x), ranks(y))[0, 1])


# %% [markdown]
# ## Plot

# %%
def plot(proxies, cells, policy, args):
    fig, axes = plt.subplots(1, 3, figsize=FIGSIZE, dpi=kvqplot.DPI)
    for ax, c in zip(axes[:2], proxies):
        xs = [cell[3][c] for cell in cells]
        ys = [cell[4] for cell in cells]
        seen = set()
        for fam, spec, layer, px, d in cells:
            colour, marker = kvqplot.family_style(fam)
            ax.scatter(px[c], d, color=colour, marker=marker, s=36, label=None if spec in seen else spec)
            ax.annotate(layer, (px[c], d), fontsize=7, xytext=(3, 2), textcoords="offset points")
            seen.add(spec)
        pos = [x for x in xs if x > 0]
        if pos and max(pos) / min(pos) > 30:
            ax.set_xscale("log")
        ax.set_xlabel(f"{kvqplot.metric_label(c)} (kvq-analyze, per layer)")
        ax.set_ylabel("dnll, only this layer quantized (nats)")
        ax.set_title(f"Spearman ρ = {spearman(xs, ys):.2f} over {len(cells)} (layer, quantizer) cells", fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
    ax = axes[2]
    specs = list(policy)
    x = np.arange(len(specs))
    pre = [policy[s][1] for s in specs]
    dec = [policy[s][2] for s in specs]
    ax.bar(x - 0.2, pre, 0.4, label="prefill (whole cache at once)", color="#4c72b0")
    ax.bar(x + 0.2, dec, 0.4, label="decode (cache as generation holds it)", color="#dd8452")
    ax.set_xticks(x)
    ax.set_xticklabels(specs, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("dnll, every layer quantized (nats)")
    vals = [v for v in pre + dec if v > 0]
    if vals and max(vals) / min(vals) > 30:
        ax.set_yscale("log")
    ax.legend(fontsize=8, frameon=False)
    ax.grid(True, axis="y", which="both", alpha=0.3)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=min(6, max(1, len(labels))), frameon=False, fontsize=8)
    fig.suptitle("Offline proxies against the model's loss (points: layers)")
    fig.subplots_adjust(left=0.05, right=0.99, top=0.88, bottom=0.3, wspace=0.28)
    return fig


# %%
def main(argv=None):
    args = parse_args(argv)
    proxies, cells, policy = load(args)
    return kvqplot.save(plot(proxies, cells, policy, args), args.out, args.name)


if __name__ == "__main__":
    kvqplot.run(main, "proxy_vs_loss")

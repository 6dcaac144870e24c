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



def parse_args(argv=None):
    p = argparse.ArgumentParser(description="Offline proxies against the model's loss.")
    p.add_argument("--analyze", default="figures/data/proxy-layer.csv", help="kvq-analyze --per layer output")
    p.add_argument("--eval-layer", default="figures/data/eval-layer.csv", help="kvq-eval --per-layer output")
    p.add_argument("--eval-policy", default="figures/data/eval-policy.csv",
                   help="kvq-eval --policy prefill,decode output")
    p.add_argument("--proxies", default="attn_kl,out_rel_joint", help="two kvq-analyze columns")
    p.add_argument("--out", default="figures", help="output folder")
    p.add_argument("--name", default="proxy_vs_loss", help="file name without extension")
    kvqplot.add_style_args(p)
    return p.parse_args([] if kvqplot.in_notebook() else argv)


# %% [markdown]
# ## Join the proxies and the losses on (spec, layer)

# %%
def load(args):
    proxies = [c for c in args.proxies.split(",") if c]
    if len(proxies) != 2:
        raise kvqplot.InputError(f"--proxies {args.proxies}: expected two kvq-analyze columns")
    arows, _, asrc = kvqplot.read_rows(args.analyze, ["layer", "head", "quantizer", "spec"] + proxies,
                                 "kvq-analyze --per layer output")
    lrows, _, lsrc = kvqplot.read_rows(args.eval_layer, ["quantizer", "spec", "policy", "layer", "dnll"],
                                 "kvq-eval --per-layer output")
    prows, _, psrc = kvqplot.read_rows(args.eval_policy, ["quantizer", "spec", "policy", "layer", "dnll"],
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
    return proxies, cells, policy, [asrc, lsrc, psrc]


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
    single = args.width == "single"
    specs_seen = list(dict.fromkeys((fam, spec) for fam, spec, *_ in cells))
    styles = kvqplot.spec_styles(specs_seen)
    fig, axes, lax = kvqplot.figure(args.width, 1.7 if single else 2.3, 3 if single else 1, 1 if single else 3,
                                    legend="auto", nlegend=len(specs_seen) + 2,
                                    longest=max([len(s) for _, s in specs_seen] + [29]))
    axes = list(axes.flat)
    for ax, c in zip(axes[:2], proxies):
        xs = [cell[3][c] for cell in cells]
        ys = [cell[4] for cell in cells]
        for fam, spec in specs_seen:
            sel = [cell for cell in cells if cell[1] == spec]
            colour, marker = styles[(fam, spec)]
            ax.scatter([cell[3][c] for cell in sel], [cell[4] for cell in sel], color=colour, marker=marker, s=18,
                       label=spec, zorder=3)
        kvqplot.label_points(ax, [(px[c], d, f"L{layer}") for _, _, layer, px, d in cells],
                             enabled=not args.no_labels, color="0.35")
        kvqplot.log_if_spread(ax, xs, axis="x")
        ax.set_xlabel(f"{kvqplot.metric_label(c, short=True)} (per layer)")
        ax.set_ylabel("dnll, one layer (nats)")
        ax.set_title(f"rank corr. ρ = {spearman(xs, ys):.2f}", fontsize=kvqplot.FONT_PT)
        ax.grid(True, which="major", alpha=0.3)
    ax = axes[2]  # horizontal bars: every spec's name readable
    specs = list(policy)
    y = np.arange(len(specs))
    pre = [policy[s][1] for s in specs]
    dec = [policy[s][2] for s in specs]
    ax.barh(y - 0.2, pre, 0.4, label="whole cache at once (prefill)", color="0.3")
    ax.barh(y + 0.2, dec, 0.4, label="cache as decoding holds it", color="0.7")
    ax.set_yticks(y, [s.replace(":bits=", " ") for s in specs])
    ax.invert_yaxis()
    ax.set_xlabel("dnll, all layers (nats)")
    kvqplot.log_if_spread(ax, pre + dec, axis="x")
    ax.grid(True, axis="x", which="major", alpha=0.3)
    kvqplot.legend(lax, *kvqplot.legend_entries(axes))
    if not single:
        fig.suptitle("Offline proxies against the model's loss (points: layers; right: prefill vs decode)")
    return fig


# %%
def main(argv=None):
    args = parse_args(argv)
    proxies, cells, policy, sources = load(args)
    return kvqplot.save(plot(proxies, cells, policy, args), args.out, args.name, sources)


if __name__ == "__main__":
    kvqplot.run(main, "proxy_vs_loss")

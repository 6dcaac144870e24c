# %% [markdown]
# # Does the cache still remember? Exact recall against the context's bytes
#
# `kvq-eval MODEL --tasks FILE --per-depth B` (docs/models.md#retrieval-tasks) compresses each
# task's context once by the spec (as `--context` does), puts the question and the
# answer on top and asks whether every answer token is still the arg-max — whether
# greedy decoding still retrieves the fact. Left: `exact` (± its binomial standard error
# over the tasks) against the stored bits per element of the contexts' caches, for
# quantization alone, eviction alone and both; the dashed line is the exact cache's
# recall. Right: a depth × budget map of one eviction family (by default SnapKV keeping
# a fraction of the context): where in the context the facts are lost.
#
# Regenerate (with every other figure): `notebooks-export/make_figures.sh`, or alone:
#
#     kvq-gen --task kv --count 200 --context-tokens 512 -o kv.jsonl
#     kvq-eval data/kvq-retrieval.gguf --tasks kv.jsonl --per-depth 0.2 -q none \
#         -q kivi:bits=2 -q 'tokens(snapkv:keep=0.25; none; drop)' ... -o eval-tasks.csv
#     python3 notebooks-export/does_it_remember.py --input eval-tasks.csv --out figures
#
# Opened as a notebook (jupytext), it runs with the defaults below.

# %%
import argparse
import math
import re

import kvqplot

REQUIRED = ["model", "tasks", "quantizer", "spec", "policy", "layer", "depth", "k_bits", "v_bits", "exact_ref",
            "exact"]
KIND_LINE = {"evict": "-", "quantize": "--", "both": ":"}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="Exact recall against the contexts' bits (kvq-eval --tasks), and a "
                                            "depth x budget map of one eviction family.")
    p.add_argument("--input", default="figures/data/eval-tasks.csv", help="kvq-eval --tasks --per-depth B output")
    p.add_argument("--heatmap", default="snapkv", help="the selector whose keep fractions make the map's columns")
    p.add_argument("--out", default="figures", help="output folder")
    p.add_argument("--name", default="does_it_remember", help="file name without extension")
    kvqplot.add_style_args(p)
    return p.parse_args([] if kvqplot.in_notebook() else argv)


# %% [markdown]
# ## Series: how the bytes are spent

# %%
def series_of(row):
    """(label, kind) of a row's series."""
    spec, fam = str(row["spec"]), str(row["quantizer"])
    t = kvqplot.split_tokens(spec)
    if t is None:
        return fam, "quantize"
    sel, hi, lo = t
    if lo == "drop" and hi == "none":
        return f"evict: {sel}", "evict"
    if lo == "drop":
        return f"{sel}, kept at {hi.split(':')[0]}", "both"
    return f"{sel}: {hi.split(':')[0]} / {lo.split(':')[0]}", "both"


def keep_of(spec, selector):
    m = re.match(r"tokens\(" + re.escape(selector) + r":(?:[^;]*,)?keep=([0-9.]+)[^;]*;\s*none;\s*drop\)$", spec)
    return float(m.group(1)) if m else None


def load(a):
    rows, _, src = kvqplot.read_rows(a.input, REQUIRED, "kvq-eval --tasks output")
    rows = [r for r in rows if str(r["layer"]) == "all" and str(r["policy"]) == "prefill"]
    if not rows:
        raise kvqplot.InputError(f"{a.input}: no prefill rows of every layer: expected kvq-eval --tasks output")
    pooled = [r for r in rows if str(r["depth"]) == "all"]
    ref = [kvqplot.num(r, "exact_ref", a.input) for r in pooled]
    series = {}
    for r in pooled:
        if str(r["quantizer"]) == "none":
            continue
        label, kind = series_of(r)
        n = kvqplot.integer(r, "tasks", a.input)
        p = kvqplot.num(r, "exact", a.input)
        bits = (kvqplot.num(r, "k_bits", a.input) + kvqplot.num(r, "v_bits", a.input)) / 2
        series.setdefault((kind, label), []).append((bits, p, math.sqrt(max(p * (1 - p), 0.0) / n)))
    if not series:
        raise kvqplot.InputError(f"{a.input}: only the exact cache: expected compressed specs beside -q none")
    heat = {}
    for r in rows:
        k = keep_of(str(r["spec"]), a.heatmap)
        if k is not None and str(r["depth"]) != "all":
            heat[(str(r["depth"]), k)] = kvqplot.num(r, "exact", a.input)
    order = sorted(series, key=lambda k: (list(KIND_LINE).index(k[0]), k[1]))
    model = str(rows[0]["model"])
    ntask = kvqplot.integer(pooled[0], "tasks", a.input)
    return model, ntask, sum(ref) / len(ref), {k: sorted(series[k]) for k in order}, heat, [src]


# %% [markdown]
# ## Plot: recall against bits; the depth map

# %%
def plot(model, ntask, ref, series, heat, a):
    single = a.width == "single"
    labels = [k[1] for k in series]
    ncols = 2 if heat else 1
    fig, axes, lax = kvqplot.figure(a.width, 1.9 if single else 2.4, 1, ncols, legend="auto", nlegend=len(labels),
                                    longest=max(map(len, labels)))
    ax = axes.flat[0]
    palette = kvqplot.OKABE_ITO + ["#000000"]
    marker = {"evict": "o", "quantize": "s", "both": "D"}  # the kind by marker and line, the series by colour
    for i, ((kind, label), pts) in enumerate(series.items()):
        colour = palette[i % len(palette)]
        if i >= len(palette):  # past the palette: its colours lightened, each series its own
            colour = kvqplot.shade(colour, 0.5 * (i // len(palette)))
        xs, ys, es = zip(*pts)
        ax.errorbar(xs, ys, yerr=es, capsize=1.5, color=colour, marker=marker[kind],
                    markersize=3.5, linestyle=KIND_LINE[kind], linewidth=1, label=label)
    ax.axhline(ref, color="0.4", linewidth=0.8, linestyle="--")
    ax.set_ylim(-0.03, 1.03)
    ax.set_xlabel("context bits" if single else "context: stored bits per element")
    ax.set_ylabel("exact recall")
    ax.grid(True, which="major", alpha=0.3)
    if heat:
        hx = axes.flat[1]
        depths = sorted({d for d, _ in heat}, key=lambda d: float(d.split("-")[0]))
        keeps = sorted({k for _, k in heat})
        grid = [[heat.get((d, k), float("nan")) for k in keeps] for d in depths]
        im = hx.imshow(grid, aspect="auto", origin="lower", vmin=0, vmax=1, cmap="viridis")
        hx.set_xticks(range(len(keeps)))
        hx.set_xticklabels([f"{k:g}" for k in keeps])
        hx.set_yticks(range(len(depths)))
        hx.set_yticklabels(depths)
        hx.set_xlabel(f"{a.heatmap}: fraction kept")
        hx.set_ylabel("depth of the fact")
        fig.colorbar(im, ax=hx, label="exact recall")
    kvqplot.legend(lax, *kvqplot.legend_entries([axes.flat[0]]))
    if not single:
        fig.suptitle(f"{model}: {ntask} tasks, each context compressed once; exact cache {ref:.2f}")
    return fig


# %%
def main(argv=None):
    a = parse_args(argv)
    model, ntask, ref, series, heat, sources = load(a)
    return kvqplot.save(plot(model, ntask, ref, series, heat, a), a.out, a.name, sources)


if __name__ == "__main__":
    kvqplot.run(main, "does_it_remember")

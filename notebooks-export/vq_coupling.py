# %% [markdown]
# # Coupled channels: vector quantization against scalar codes at the same bits
#
# Coupled Quantization (Zhang et al. 2024) claims that coding several channels jointly
# against a learned codebook beats coding them one at a time at the same bits per channel.
# Here: `vq` with 1, 2, 4 and 8 coupled channels (`dims`; one line each) at 1, 2 and 4 bits
# per channel, beside per-channel, KIVI and Lloyd–Max at 1, 2 and 4 bits per code, against
# the stored bits per element `(k_bits + v_bits)/2` (scales, zeros, norms and exact windows
# included; vq stores nothing but its codes). Offline: the key error, the attention error and
# the layer-output error from `kvq-analyze --per model`; in the model (when `--eval` is
# given): `dnll` from `kvq-eval`, with one standard error. `dims=1` is a scalar code whose
# levels are learned per channel; a `dims` line below the `dims=1` line at the same bits
# is what coupling buys.
#
# Regenerate (with every other figure): `notebooks-export/make_figures.sh`, or alone:
#
#     kvq-analyze -q vq:dims=4,bits=8,share=layer ... --calib calib.h5 --per model -o analyze-vq.csv dump.h5
#     kvq-eval model.gguf --text story.txt -q vq:dims=4,bits=8,share=layer ... --calib calib.h5 -o eval-vq.csv
#     python3 notebooks-export/vq_coupling.py --analyze analyze-vq.csv --eval eval-vq.csv --out figures
#
# Opened as a notebook (jupytext), it runs with the defaults below.

# %%
import argparse
import math
import re

import kvqplot

OFFLINE = ["k_rel_fro", "attn_rel", "out_rel_joint"]
REQUIRED = ["dump", "layer", "head", "quantizer", "spec", "k_bits", "v_bits"] + OFFLINE
EVAL_REQUIRED = ["quantizer", "spec", "policy", "layer", "k_bits", "v_bits", "dnll", "dnll_se"]
BASELINES = ["per-channel", "kivi", "lloydmax"]
DIMS_MARKER = {1: "o", 2: "s", 4: "D", 8: "^", 16: "v"}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="vq's coupled channels against scalar codes: error and dnll vs bits.")
    p.add_argument("--analyze", default="figures/data/analyze-vq.csv", help="kvq-analyze --per model output")
    p.add_argument("--eval", help="kvq-eval output with the same specs (adds the dnll panel)")
    p.add_argument("--out", default="figures", help="output folder")
    p.add_argument("--name", default="vq_coupling", help="file name without extension")
    kvqplot.add_style_args(p)
    return p.parse_args([] if kvqplot.in_notebook() else argv)


def dims_of(spec):
    m = re.search(r"(?:^|[:,])dims=(\d+)", spec)
    return int(m.group(1)) if m else 4  # vq's default


# %% [markdown]
# ## Read the rows: one series per vq `dims` and per baseline family

# %%
def series(rows, path, metrics):
    """{label: [(bits, {metric: value}), ...] sorted by bits}, vq by dims first."""
    out = {}
    for r in rows:
        fam, spec = str(r["quantizer"]), str(r["spec"])
        if fam == "vq":
            label = f"vq dims={dims_of(spec)}"
        elif fam in BASELINES:
            label = fam
        else:
            continue
        bits = (kvqplot.num(r, "k_bits", path) + kvqplot.num(r, "v_bits", path)) / 2
        out.setdefault(label, []).append((bits, {m: kvqplot.num(r, m, path) for m in metrics}))
    order = sorted((k for k in out if k.startswith("vq ")), key=lambda k: int(k.split("=")[1]))
    order += [b for b in BASELINES if b in out]
    return {k: sorted(out[k], key=lambda p: p[0]) for k in order}


def load(a):
    rows, _, src = kvqplot.read_rows(a.analyze, REQUIRED, "kvq-analyze --per model output")
    rows = [r for r in rows if str(r["layer"]) == "all" and str(r["head"]) == "all"]
    rows = kvqplot.pick_dump(rows, None, a.analyze) if rows else rows
    off = series(rows, a.analyze, OFFLINE)
    if not any(k.startswith("vq ") for k in off):
        raise kvqplot.InputError(f"{a.analyze}: no per-model vq rows: expected kvq-analyze --per model -q vq:... output")
    sources, model = [src], None
    if a.eval:
        erows, _, esrc = kvqplot.read_rows(a.eval, EVAL_REQUIRED, "kvq-eval output")
        erows = [r for r in erows if str(r["layer"]) == "all" and str(r["policy"]) == "prefill"]
        model = series(erows, a.eval, ["dnll", "dnll_se"])
        if not any(k.startswith("vq ") for k in model):
            raise kvqplot.InputError(f"{a.eval}: no vq rows (layer all, policy prefill): expected kvq-eval -q vq:... output")
        sources.append(esrc)
    return str(rows[0]["dump"]), off, model, sources


# %% [markdown]
# ## Plot: one panel per metric; vq's lines in shades of blue, darker for more coupled channels

# %%
def style_of(label, nvq, i):
    if label.startswith("vq "):
        d = int(label.split("=")[1])
        t = 0.45 - 0.9 * i / max(nvq - 1, 1)  # light (few channels) .. dark (many)
        return kvqplot.shade(kvqplot.OKABE_ITO[0], t), DIMS_MARKER.get(d, "o"), "-"
    colour, marker = kvqplot.family_style(label)
    return colour, marker, "--"


def plot(dump, off, model, a):
    single = a.width == "single"
    panels = [(m, off) for m in OFFLINE] + ([("dnll", model)] if model else [("v_rel_fro", None)])
    labels = list(off)
    fig, axes, lax = kvqplot.figure(a.width, 1.45 if single else 2.0, 2, 2, legend="auto", nlegend=len(labels),
                                    longest=max(map(len, labels)))
    nvq = sum(k.startswith("vq ") for k in off)
    for ax, (metric, data) in zip(axes.flat, panels):
        if data is None:
            ax.text(0.5, 0.5, "no kvq-eval table given\n(--eval: dnll in the model)", ha="center", va="center",
                    transform=ax.transAxes)
            ax.set_axis_off()
            continue
        values = []
        for i, label in enumerate(k for k in labels if k in data):
            colour, marker, ls = style_of(label, nvq, i if label.startswith("vq ") else 0)
            pts = [(x, v[metric], v.get("dnll_se", 0.0)) for x, v in data[label] if math.isfinite(v[metric])]
            if not pts:
                continue
            xs, ys, es = zip(*pts)
            values += ys
            if metric == "dnll":
                ax.errorbar(xs, ys, yerr=es, color=colour, marker=marker, markersize=3.5, linestyle=ls, linewidth=1,
                            capsize=1.5, label=label)
            else:
                ax.plot(xs, ys, color=colour, marker=marker, markersize=3.5, linestyle=ls, linewidth=1, label=label)
        kvqplot.log_if_spread(ax, values)
        ax.set_ylabel("dnll (nats)" if metric == "dnll" else kvqplot.metric_label(metric, short=True))
        ax.grid(True, which="major", alpha=0.3)
    kvqplot.bottom_xlabel(axes, "bits per element" if single else "stored bits per element, (k_bits + v_bits)/2")
    kvqplot.legend(lax, *kvqplot.legend_entries(axes))
    if not single:
        fig.suptitle(f"{dump}: coupled channels (vq, lines by dims) against scalar codes at the same stored bits")
    return fig


# %%
def main(argv=None):
    a = parse_args(argv)
    dump, off, model, sources = load(a)
    return kvqplot.save(plot(dump, off, model, a), a.out, a.name, sources)


if __name__ == "__main__":
    kvqplot.run(main, "vq_coupling")

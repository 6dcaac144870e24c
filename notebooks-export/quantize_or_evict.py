# %% [markdown]
# # Quantize or evict? The loss against the bytes of a compressed context
#
# Under `kvq-eval --context N` (SPEC §3.11) each window's first N tokens are prefilled
# exactly and their cache compressed once; the rest is teacher-forced on top and scored.
# Here: `dnll` (± one standard error) and `kl` against the stored bits per element of the
# compressed context — `16` is the exact cache; bytes per context token are that times
# `2·layers·kv_heads·head_dim/8` — for eviction alone (`tokens(snapkv:keep=K; none; drop)`
# and StreamingLLM's window of the same size), quantization alone (KIVI, per-token, FP8)
# and the two combined (SnapKV keeping more tokens at 4 or 2 bits; H2O keeping the heavy
# hitters exact and the rest at 2 bits). A line below another at the same bits is the
# better use of the bytes.
#
# The context's bits come from the row's pooled bits (the compressed context plus the
# continuation, 16 bits under `--policy prefill`, per element of the window's T tokens):
# `ctx = ((k_bits + v_bits)/2 · T − 16 · (T − N)) / N`, T from the run's `--chunk` (or
# the row's `tokens`) and N from the `policy` cell (`prefill/context=N`).
#
# Regenerate (with every other figure, when the bundled model is present):
# `notebooks-export/make_figures.sh`, or alone:
#
#     kvq-eval model.gguf --text corpus.txt --chunk 512 --context 384 -q none \
#         -q 'tokens(snapkv:keep=0.25; none; drop)' -q kivi:bits=2 ... -o eval-context.csv
#     python3 notebooks-export/quantize_or_evict.py --input eval-context.csv --out figures
#
# Opened as a notebook (jupytext), it runs with the defaults below.

# %%
import argparse
import re

import kvqplot

REQUIRED = ["tokens", "quantizer", "spec", "policy", "layer", "k_bits", "v_bits", "dnll", "dnll_se", "kl"]
KIND_LINE = {"evict": "-", "quantize": "--", "both": ":"}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="dnll and kl against the compressed context's bits: eviction, "
                                            "quantization and both (kvq-eval --context).")
    p.add_argument("--input", default="figures/data/eval-context.csv", help="kvq-eval --context N output")
    p.add_argument("--window", type=int, help="tokens per window T (default: the run's --chunk, else the tokens "
                                              "column)")
    p.add_argument("--out", default="figures", help="output folder")
    p.add_argument("--name", default="quantize_or_evict", help="file name without extension")
    kvqplot.add_style_args(p)
    return p.parse_args([] if kvqplot.in_notebook() else argv)


# %% [markdown]
# ## One series per way of spending the bytes

# %%
def bits_of(spec):
    m = re.search(r"(?:^|[:,])bits=(\d+)", spec)
    return f" {m.group(1)}-bit" if m else ""


def series_of(row):
    """(label, kind) of a row's series: kind evict, quantize or both."""
    spec, fam = str(row["spec"]), str(row["quantizer"])
    t = kvqplot.split_tokens(spec)
    if t is None:
        return fam, "quantize"
    sel, hi, lo = t
    if lo == "drop" and hi == "none":
        return f"evict: {sel}", "evict"
    if lo == "drop":
        return f"{sel}, kept at {hi.split(':')[0]}{bits_of(hi)}", "both"
    if hi == "none":
        return f"{sel} exact, rest {lo.split(':')[0]}{bits_of(lo)}", "both"
    return f"{sel}: {hi.split(':')[0]}{bits_of(hi)} / {lo.split(':')[0]}{bits_of(lo)}", "both"


def window_of(a, rows, src):
    if a.window:
        return a.window
    meta = src[1]
    if isinstance(meta, dict):
        chunk = meta["runs"][-1].get("options", {}).get("chunk")
        if chunk:
            return int(chunk)
    return kvqplot.integer(rows[0], "tokens", a.input)


def load(a):
    rows, _, src = kvqplot.read_rows(a.input, REQUIRED, "kvq-eval --context N output")
    rows = [r for r in rows if str(r["layer"]) == "all"]
    ctx = [(r, re.search(r"/context=(\d+)$", str(r["policy"]))) for r in rows]
    ctx = [(r, int(m.group(1))) for r, m in ctx if m and str(r["policy"]).startswith("prefill/")]
    if not ctx:
        raise kvqplot.InputError(f"{a.input}: no prefill/context=N rows (layer all): expected kvq-eval --context N "
                                 f"output")
    T = window_of(a, rows, src)
    out = {}
    for r, N in ctx:
        if str(r["quantizer"]) == "none" or N >= T:
            continue
        label, kind = series_of(r)
        bits = (kvqplot.num(r, "k_bits", a.input) + kvqplot.num(r, "v_bits", a.input)) / 2
        ctx_bits = (bits * T - 16.0 * (T - N)) / N
        vals = {c: kvqplot.num(r, c, a.input) for c in ("dnll", "dnll_se", "kl")}
        out.setdefault((kind, label), []).append((ctx_bits, vals))
    if not out:
        raise kvqplot.InputError(f"{a.input}: only the exact cache: expected compressed specs beside -q none")
    order = sorted(out, key=lambda k: (list(KIND_LINE).index(k[0]), k[1]))
    model = str(rows[0].get("model", ""))
    return model, T, ctx[0][1], {k: sorted(out[k], key=lambda p: p[0]) for k in order}, [src]


# %% [markdown]
# ## Plot: dnll (symmetric log: it may be negative within noise) and KL (log)

# %%
def plot(model, T, N, data, a):
    single = a.width == "single"
    labels = [k[1] for k in data]
    fig, axes, lax = kvqplot.figure(a.width, 1.7 if single else 2.2, 1, 2, legend="auto", nlegend=len(labels),
                                    longest=max(map(len, labels)))
    palette = kvqplot.OKABE_ITO + ["#000000"]  # eight distinct colours, then markers tell them apart
    colours = {label: palette[i % len(palette)] for i, (kind, label) in enumerate(data)}
    markers = "osD^v<>ph*"
    series = [(pts, dict(color=colours[label], marker=markers[i % len(markers)], markersize=3.5,
                         linestyle=KIND_LINE[kind], linewidth=1, label=label))
              for i, ((kind, label), pts) in enumerate(data.items())]
    kvqplot.dnll_kl_panels(axes, series)
    kvqplot.bottom_xlabel(axes, "context bits" if single else "context: stored bits per element")
    kvqplot.legend(lax, *kvqplot.legend_entries(axes))
    if not single:
        fig.suptitle(f"{model}: a {N}-token context compressed once, {T - 1 - N} positions scored per window")
    return fig


# %%
def main(argv=None):
    a = parse_args(argv)
    model, T, N, data, sources = load(a)
    return kvqplot.save(plot(model, T, N, data, a), a.out, a.name, sources)


if __name__ == "__main__":
    kvqplot.run(main, "quantize_or_evict")

# %% [markdown]
# # Compress while generating? The loss against the mean cache size
#
# Under `kvq-eval --context N --policy decode` (docs/models.md#compress-while-generating)
# each window's first N tokens are prefilled and the rest are generated (teacher-forced,
# scored). Three ways to hold a smaller cache while generating:
# - **compress while decoding** (kvpress's DecodingPress and PrefillDecodingPress):
#   `tokens(SEL:keep=S/N,target=S,interval=I; none; drop)` compresses the context to S
#   tokens, then every I generated tokens back to S — one line per selector;
# - **compress once** (kvpress's presses after the prefill):
#   `tokens(SEL:keep=K; none; drop)` evicts part of the context; the generated tokens
#   stay, so the cache grows again;
# - **quantize** every token (KIVI, per-token) at fewer bits.
#
# Left: `dnll` (± one standard error) against the mean cache size while generating — the
# exact cache's bits per element times the tokens held (`cache_tokens`, averaged over the
# scored positions) over the exact cache's, for eviction (its 32-bit positions left
# out); the stored bits per element for quantization. Right: `kl` on the same axis.
# A line below another at the same size is the better use of the memory.
#
# Regenerate (with every other figure): `notebooks-export/make_figures.sh`, or alone:
#
#     kvq-eval data/kvq-retrieval.gguf --text corpus.txt --chunk 512 --context 256 --policy decode \
#         -q none -q 'tokens(h2o:keep=0.25,target=64,interval=16; none; drop)' \
#         -q 'tokens(h2o:keep=0.25; none; drop)' -q kivi:bits=2 ... -o eval-decoding.csv
#     python3 notebooks-export/compress_while_generating.py --input eval-decoding.csv --out figures
#
# Opened as a notebook (jupytext), it runs with the defaults below.

# %%
import argparse
import re

import kvqplot

REQUIRED = ["quantizer", "spec", "policy", "layer", "k_bits", "v_bits", "dnll", "dnll_se", "kl", "cache_tokens"]
KIND_LINE = {"while decoding": "-", "once": ":", "quantize": "--"}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="dnll and kl against the mean cache size while generating: "
                                            "compressing while decoding, once, or quantizing (kvq-eval --policy "
                                            "decode --context N).")
    p.add_argument("--input", default="figures/data/eval-decoding.csv", help="kvq-eval --policy decode output")
    p.add_argument("--out", default="figures", help="output folder")
    p.add_argument("--name", default="compress_while_generating", help="file name without extension")
    kvqplot.add_style_args(p)
    return p.parse_args([] if kvqplot.in_notebook() else argv)


# %% [markdown]
# ## Series: how the cache is kept small

# %%
def series_of(row):
    """(label, kind) of a row's series, or None for a spec the figure does not place (HI or LO quantized)."""
    spec, fam = str(row["spec"]), str(row["quantizer"])
    t = kvqplot.split_tokens(spec)
    if t is None:
        return fam, "quantize"
    name, hi, lo = t
    if hi != "none" or lo != "drop":
        return None
    every = re.search(r"[:,]interval=(\d+)", spec)
    if every:
        return f"{name}, every {every.group(1)}", "while decoding"
    return f"{name}, once", "once"


def load(a):
    rows, _, src = kvqplot.read_rows(a.input, REQUIRED, "kvq-eval --policy decode output")
    rows = [r for r in rows if str(r["layer"]) == "all" and str(r["policy"]).startswith("decode")]
    ref = [r for r in rows if str(r["quantizer"]) == "none"]
    if not ref:
        raise kvqplot.InputError(f"{a.input}: no -q none row under --policy decode (layer all): the exact cache "
                                 f"gives the size axis its unit")
    held_ref = kvqplot.num(ref[0], "cache_tokens", a.input)
    out = {}
    for r in rows:
        s = series_of(r)
        if str(r["quantizer"]) == "none" or s is None:
            continue
        label, kind = s
        if kind == "quantize":
            size = (kvqplot.num(r, "k_bits", a.input) + kvqplot.num(r, "v_bits", a.input)) / 2
        else:
            size = 16.0 * kvqplot.num(r, "cache_tokens", a.input) / held_ref
        vals = {c: kvqplot.num(r, c, a.input) for c in ("dnll", "dnll_se", "kl")}
        out.setdefault((kind, label), []).append((size, vals))
    if not out:
        raise kvqplot.InputError(f"{a.input}: only the exact cache: expected compressed specs beside -q none")
    order = sorted(out, key=lambda k: (list(KIND_LINE).index(k[0]), k[1]))
    model = str(rows[0].get("model", ""))
    policy = str(ref[0]["policy"])
    return model, policy, {k: sorted(out[k], key=lambda p: p[0]) for k in order}, [src]


# %% [markdown]
# ## Plot: dnll (symmetric log: it may be negative within noise) and KL (log)

# %%
def plot(model, policy, data, a):
    from matplotlib.lines import Line2D
    single = a.width == "single"
    # a colour and marker per selector or family, a line style per way (KIND_LINE); intervals other
    # than the most common one get a lighter shade of their selector's colour
    names = list(dict.fromkeys(label.split(",")[0] for _, label in data))
    palette, markers = kvqplot.OKABE_ITO + ["#000000"], "osD^v<>ph*"
    colour = {n: palette[i % len(palette)] for i, n in enumerate(names)}
    marker = {n: markers[i % len(markers)] for i, n in enumerate(names)}
    handles = [Line2D([], [], color=colour[n], marker=marker[n], markersize=3.5, linewidth=1) for n in names]
    handles += [Line2D([], [], color="0.3", linestyle=ls, linewidth=1) for ls in KIND_LINE.values()]
    labels = names + list(KIND_LINE)
    fig, axes, lax = kvqplot.figure(a.width, 1.7 if single else 2.2, 1, 2, legend="auto", nlegend=len(labels),
                                    longest=max(map(len, labels)))
    series = [(pts, dict(color=colour[label.split(",")[0]], marker=marker[label.split(",")[0]], markersize=3.5,
                         linestyle=KIND_LINE[kind], linewidth=1, label=label)) for (kind, label), pts in data.items()]
    kvqplot.dnll_kl_panels(axes, series)
    kvqplot.bottom_xlabel(axes, "mean cache bits" if single else "mean cache bits per element")
    kvqplot.legend(lax, handles, labels)
    if not single:
        fig.suptitle(f"{model}: compressing while generating ({policy}), once, or quantizing")
    return fig


# %%
def main(argv=None):
    a = parse_args(argv)
    model, policy, data, sources = load(a)
    return kvqplot.save(plot(model, policy, data, a), a.out, a.name, sources)


if __name__ == "__main__":
    kvqplot.run(main, "compress_while_generating")

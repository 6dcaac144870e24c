# %% [markdown]
# # kvq from Python: quantize a layer, analyse it, watch a decode-time cache
#
# The other figures read the tools' CSV; this one calls the library itself through
# `import kvq` (python/kvq), as a user's own notebook or model loop would:
#
# 1. **Key error against bits** for one layer of the bundled dump, per family
#    (`kvq.quantize`: the same numbers as `kvq-analyze --per layer`).
# 2. **Attention error per layer** (`kvq.analyze`: kvq-analyze's rows as dicts).
# 3. **What generation sees** (`kvq.DecodeCache`): the error of each token's key at the
#    step it is written (decode: KIVI's full-precision residual window holds it exactly
#    until its group is flushed) against its error once the whole cache is quantized at
#    once (prefill).
#
# Run from a build (the package and libkvq come from it):
#
#     PYTHONPATH=build/python python3 notebooks-export/python_api.py --out figures
#
# Opened as a notebook (jupytext), it runs with the defaults below.

# %%
import argparse
import os

import matplotlib.pyplot as plt
import numpy as np

import kvqplot

try:
    import kvq
except ImportError as e:  # the package lives in BUILD/python (python/kvq in the sources)
    raise SystemExit(f"python_api: error: cannot import kvq ({e}): run with PYTHONPATH=BUILD/python")

HERE = os.path.dirname(os.path.abspath(__file__))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="kvq's Python API on the bundled dump.")
    p.add_argument("--dump", default=os.path.join(HERE, "..", "data", "stories260K.h5"), help="a kvq-dump/1 file")
    p.add_argument("--layer", type=int, default=2, help="the layer of panels 1 and 3")
    p.add_argument("--out", default="figures", help="output folder")
    p.add_argument("--name", default="python_api", help="file name without extension")
    kvqplot.add_style_args(p)
    return p.parse_args([] if kvqplot.in_notebook() else argv)


# %%
def main(argv=None):
    a = parse_args(argv)
    try:
        dump = kvq.read_dump(a.dump)
    except kvq.Error as e:
        raise kvqplot.InputError(str(e))
    if not 0 <= a.layer < dump["num_layers"]:
        raise kvqplot.InputError(f"{a.dump}: --layer {a.layer}: expected 0..{dump['num_layers'] - 1}")
    L = dump["layers"][a.layer]
    single = a.width == "single"
    fig, axes, lax = kvqplot.figure(a.width, 1.8 if single else 2.4, 3 if single else 1, 1 if single else 3,
                                    legend="bottom", nlegend=5, longest=11)
    ax = list(axes.flat)

    # 1. key error against stored bits, one layer, several families
    for fam, bits in (("per-token", (2, 3, 4, 8)), ("per-channel", (2, 3, 4, 8)), ("kivi", (2, 3, 4)),
                      ("absmax", (4, 6, 8)), ("lloydmax", (1, 2, 3, 4))):
        pts = [kvq.quantize(f"{fam}:bits={b}", L["key"], L["value"], layer=a.layer) for b in bits]
        color, marker = kvqplot.family_style(fam)
        ax[0].plot([r.k_bits for r in pts], [r.metrics["k_rel_fro"] for r in pts], marker=marker, color=color,
                   label=fam, markersize=3.5)
    kvqplot.log_if_spread(ax[0], [v for line in ax[0].get_lines() for v in line.get_ydata()])
    ax[0].set(xlabel="key bits per element", ylabel="key error", title=f"kvq.quantize: layer {a.layer}")
    kvqplot.legend(lax, *kvqplot.legend_entries(ax[:1]))  # the families, below the panels

    # 2. attention error per layer, two configurations
    for spec in ("kivi:bits=2", "per-token:bits=4"):
        rows = kvq.analyze(a.dump, spec, per="layer")
        color, marker = kvqplot.family_style(spec.split(":")[0])
        ax[1].plot([r["layer"] for r in rows], [r["attn_rel"] for r in rows], marker=marker, color=color,
                   label=spec)
    ax[1].set(xlabel="layer", ylabel="attention error", title="kvq.analyze: per layer",
              xticks=range(dump["num_layers"]))
    ax[1].set_ylim(0, max(v for line in ax[1].get_lines() for v in line.get_ydata()) * 1.6)
    ax[1].legend(loc="upper left")

    # 3. each token's key error when it is written (decode) and in the whole-cache quantization (prefill)
    spec, T = "kivi:bits=2,group=32,residual=64", min(256, dump["seq_len"])
    cache, dec = kvq.DecodeCache(spec), []
    norm = np.linalg.norm(L["key"][:, :T], axis=2)  # [H, T]
    for t in range(T):
        k_hat, _ = cache.update(a.layer, L["key"][:, t:t + 1], L["value"][:, t:t + 1])
        dec.append(np.mean(np.linalg.norm(L["key"][:, t] - k_hat[:, t], axis=1) / norm[:, t]))
    full = kvq.quantize(spec, L["key"][:, :T], L["value"][:, :T], layer=a.layer).key
    pre = np.mean(np.linalg.norm(L["key"][:, :T] - full, axis=2) / norm, axis=0)
    ax[2].plot(range(T), pre, color="0.5", linewidth=0.8, label="prefill (whole cache)")
    ax[2].plot(range(T), dec, color=kvqplot.family_style("kivi")[0], linewidth=0.8, label="decode (as written)")
    ax[2].set(xlabel="token", ylabel="key error of the token", title="kvq.DecodeCache: kivi 2b")
    ax[2].set_ylim(0, max(max(pre), max(dec)) * 1.8)
    ax[2].legend(loc="upper left")
    return kvqplot.save(fig, a.out, a.name, [(a.dump, f"read by kvq's Python API {kvq.version()}")])


# %%
if __name__ == "__main__" or kvqplot.in_notebook():
    kvqplot.run(main, "python_api")

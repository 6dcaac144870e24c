# %% [markdown]
# # Channel magnitudes of keys and values (the KIVI paper's Figure 2 view)
#
# Top: |K| and |V| of one layer and KV head over token positions × channels. Keys have a
# few channels of large magnitude at every token (outlier channels), values do not: this
# is why KIVI quantizes keys per channel and values per token. Bottom: the per-channel
# abs-max of every KV head of that layer (the chosen head highlighted), from
# `kvq-info --channels`, with the max/median ratio kvq-info reports.
#
# Regenerate (with every other figure): `notebooks-export/make_figures.sh`, or alone:
#
#     kvq-info --values 1:0 -o values.csv data/stories260K.h5
#     kvq-info --channels -o channels.csv data/stories260K.h5
#     python3 notebooks-export/channel_magnitudes.py --values values.csv --channels channels.csv --out figures
#
# Opened as a notebook (jupytext), it runs with the defaults below.

# %%
import argparse
import statistics

import matplotlib.pyplot as plt
import numpy as np

import kvqplot


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="|K| and |V| over tokens x channels, and per-channel abs-max profiles.")
    p.add_argument("--values", default="figures/data/values-L1-H0.csv", help="kvq-info --values L:H output")
    p.add_argument("--channels", default="figures/data/channels.csv", help="kvq-info --channels output")
    p.add_argument("--key-tensor", default="key", choices=["key", "key_pre_rope"],
                   help="keys as cached (post-RoPE, default) or before RoPE")
    p.add_argument("--out", default="figures", help="output folder")
    p.add_argument("--name", default="channel_magnitudes", help="file name without extension")
    kvqplot.add_style_args(p)
    return p.parse_args([] if kvqplot.in_notebook() else argv)


# %% [markdown]
# ## Read one head's tensors and the layer's per-channel statistics

# %%
def load(args):
    rows, cols, vsrc = kvqplot.read_rows(args.values, ["dump", "layer", "head", "tensor", "token", "c0"],
                                   "kvq-info --values L:H output")
    chans = [c for c in cols if c.startswith("c") and c[1:].isdigit()]
    tensors = {}
    for r in rows:
        tensors.setdefault(r["tensor"], []).append([abs(kvqplot.num(r, c, args.values)) for c in chans])
    for t in (args.key_tensor, "value"):
        if t not in tensors:
            raise kvqplot.InputError(f"{args.values}: no '{t}' rows (has: {', '.join(tensors)})")
    dump, layer, head = rows[0]["dump"], str(rows[0]["layer"]), str(rows[0]["head"])
    crow, _, csrc = kvqplot.read_rows(args.channels, ["dump", "layer", "head", "tensor", "channel", "abs_max"],
                                "kvq-info --channels output")
    prof = {}  # (tensor, head) -> [abs_max per channel]
    for r in crow:
        if r["dump"] == dump and str(r["layer"]) == layer:
            key = (r["tensor"], kvqplot.integer(r, "head", args.channels))
            prof.setdefault(key, {})[kvqplot.integer(r, "channel", args.channels)] = \
                kvqplot.num(r, "abs_max", args.channels)
    if not any(k[0] == "value" for k in prof):
        raise kvqplot.InputError(f"{args.channels}: no rows for {dump} layer {layer}")
    prof = {k: [v[c] for c in sorted(v)] for k, v in prof.items()}
    return (dump, kvqplot.integer(rows[0], "layer", args.values), kvqplot.integer(rows[0], "head", args.values),
            {t: np.array(v) for t, v in tensors.items()}, prof, [vsrc, csrc])


# %% [markdown]
# ## Plot: magnitude maps on top, abs-max profiles below

# %%
def plot(dump, layer, head, tensors, prof, args):
    single = args.width == "single"
    fig, axes, lax = kvqplot.figure(args.width, 1.5 if single else 1.9, 2, 2, height_ratios=[3, 2],
                                    legend="bottom", nlegend=3, longest=16)
    names = {"key": "K", "key_pre_rope": "K before RoPE", "value": "V"}
    for col, t in enumerate((args.key_tensor, "value")):
        ax = axes[0, col]
        x = tensors[t]
        im = ax.imshow(x, aspect="auto", interpolation="nearest", cmap="magma", origin="lower",
                       extent=(-0.5, x.shape[1] - 0.5, -0.5, x.shape[0] - 0.5))
        ax.set_xlabel("channel")
        ax.set_ylabel("token" if single else "token position")
        ax.set_title(f"|{names[t]}|" if single else f"|{names[t]}|, layer {layer}, KV head {head}")
        cb = fig.colorbar(im, cax=ax.inset_axes([1.03, 0, 0.05, 1]))  # beside its map, not the column
        if not single:
            cb.set_label(f"|{names[t]}|")

        ax = axes[1, col]
        heads = sorted(h for (tt, h) in prof if tt == t)
        ratios = []
        for h in heads:
            v = prof[(t, h)]
            ratios.extend(v)
            if h == head:
                continue
            ax.plot(range(len(v)), v, color="0.55", alpha=0.7, linewidth=0.8, marker=".", markersize=2,
                    label="other KV heads" if col == 0 and h == next(x for x in heads if x != head) else None)
        if (t, head) in prof:
            v = prof[(t, head)]
            ax.bar(range(len(v)), v, color=kvqplot.OKABE_ITO[3] if t != "value" else kvqplot.OKABE_ITO[0],
                   alpha=0.85, label=f"KV head {head}, {names[t]}")
        ratio = max(ratios) / statistics.median(ratios) if ratios and statistics.median(ratios) > 0 else float("nan")
        ax.set_title(f"max/median {ratio:.1f}" if single else
                     f"abs-max per channel, layer {layer} (max/median {ratio:.1f})")
        ax.set_xlabel("channel")
        ax.set_ylabel(f"max |{names[t]}|")
        ax.grid(True, axis="y", alpha=0.3)
    kvqplot.legend(lax, *kvqplot.legend_entries(axes[1]))
    if not single:
        fig.suptitle(f"{dump}: keys have outlier channels, values do not")
    return fig


# %%
def main(argv=None):
    args = parse_args(argv)
    dump, layer, head, tensors, prof, sources = load(args)
    return kvqplot.save(plot(dump, layer, head, tensors, prof, args), args.out, args.name, sources)


if __name__ == "__main__":
    kvqplot.run(main, "channel_magnitudes")

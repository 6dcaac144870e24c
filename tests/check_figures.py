"""check_figures.py — the figure command's output is what it should be: every
PNG a valid image 7 inches wide at 200 dpi and not blank, every PDF a
complete PDF.   check_figures.py OUTDIR"""
import struct
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.image as mpimg  # noqa: E402
import numpy as np  # noqa: E402

# every figure is 7 in (double column, the default) x 200 dpi = 1400 px wide;
# its height follows its panels and legend
WIDTH_PX = 1400
HEIGHT_PX = (300, 1800)
EXPECTED = ["channel_magnitudes", "error_vs_bits", "error_vs_bits_formats", "layer_profile", "sweep_heatmap",
            "sweep_heatmap_bits", "vq_coupling", "does_it_remember"]
OPTIONAL = ["proxy_vs_loss",  # made when the bundled model (../shared/data/model) is present
            "alloc_vs_bits",  # the same
            "quantize_or_evict",  # the same
            "python_api"]     # made from a build with the Python package


def check(outdir):
    import os
    bad = []
    expected = EXPECTED + [n for n in OPTIONAL if os.path.exists(f"{outdir}/{n}.png")]
    for name in expected:
        png = f"{outdir}/{name}.png"
        try:
            with open(png, "rb") as f:
                head = f.read(24)
        except OSError as e:
            bad.append(f"{png}: {e}")
            continue
        if head[:8] != b"\x89PNG\r\n\x1a\n" or head[12:16] != b"IHDR":
            bad.append(f"{png}: not a PNG")
            continue
        size = struct.unpack(">II", head[16:24])
        if size[0] != WIDTH_PX or not HEIGHT_PX[0] <= size[1] <= HEIGHT_PX[1]:
            bad.append(f"{png}: {size[0]}x{size[1]}, expected {WIDTH_PX} wide and {HEIGHT_PX[0]}-{HEIGHT_PX[1]} high")
        img = mpimg.imread(png)[..., :3]
        ink = np.mean(np.any(img < 0.9, axis=-1))  # fraction of pixels that are not (near) white
        if img.std() < 0.05 or ink < 0.03:
            bad.append(f"{png}: blank (std {img.std():.3f}, {100 * ink:.1f}% non-white)")
        pdf = f"{outdir}/{name}.pdf"
        try:
            with open(pdf, "rb") as f:
                data = f.read()
        except OSError as e:
            bad.append(f"{pdf}: {e}")
            continue
        if not data.startswith(b"%PDF-") or b"%%EOF" not in data[-64:] or len(data) < 2000:
            bad.append(f"{pdf}: not a complete PDF")
    return bad


if __name__ == "__main__":
    problems = check(sys.argv[1])
    for p in problems:
        print(f"FAIL: {p}")
    print(f"{len(problems)} problems")
    sys.exit(1 if problems else 0)

"""check_figures.py — the figure command's output is what it should be: every
PNG a valid image of the expected size and not blank, every PDF a complete
PDF.   check_figures.py OUTDIR"""
import struct
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.image as mpimg  # noqa: E402
import numpy as np  # noqa: E402

EXPECTED = {  # name -> (width, height) in pixels
    "channel_magnitudes": (1200, 900),
    "error_vs_bits": (1200, 900),
    "error_vs_bits_formats": (1200, 900),
    "layer_profile": (1200, 900),
    "sweep_heatmap": (1250, 550),      # two panels (bits = 2, 4)
    "sweep_heatmap_bits": (1250, 550),
}
OPTIONAL = {"proxy_vs_loss": (1500, 500),  # made when the bundled model (../shared/data/model) is present
            "alloc_vs_bits": (900, 600),   # the same
            "python_api": (1500, 500)}     # made from a build with the Python package


def check(outdir):
    import os
    bad = []
    expected = dict(EXPECTED)
    expected.update({n: s for n, s in OPTIONAL.items() if os.path.exists(f"{outdir}/{n}.png")})
    for name, (w, h) in expected.items():
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
        if size != (w, h):
            bad.append(f"{png}: {size[0]}x{size[1]}, expected {w}x{h}")
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

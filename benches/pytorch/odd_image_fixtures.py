"""Writes the odd-input fixtures of redline-loader's decoder tests: a CMYK JPEG and a grayscale
JPEG (as cameras and scanners make them), each with PIL's own RGB decoding beside it.

Usage: python3 benches/pytorch/odd_image_fixtures.py crates/loader/tests/fixtures
Needs Pillow.
"""

import os
import sys

from PIL import Image

W, H = 48, 32


def main():
    out = sys.argv[1]
    os.makedirs(out, exist_ok=True)
    rgb = Image.new("RGB", (W, H))
    rgb.putdata([((x * 5) % 256, (y * 8) % 256, ((x + y) * 3) % 256) for y in range(H) for x in range(W)])
    for name, img in [("cmyk", rgb.convert("CMYK")), ("gray", rgb.convert("L"))]:
        path = os.path.join(out, f"{name}.jpg")
        img.save(path, quality=95)
        with open(os.path.join(out, f"{name}.pil.rgb"), "wb") as f:
            f.write(Image.open(path).convert("RGB").tobytes())


if __name__ == "__main__":
    main()

"""Writes the resize fixtures of redline-loader's tests: PIL's crop + bilinear resize (what
torchvision's RandomResizedCrop and Resize do on PIL images) of a synthetic RGB image.

Usage: python3 benches/pytorch/resize_fixtures.py crates/loader/tests/fixtures
Needs Pillow. The input image is a formula (the Rust test computes the same one), so only the
outputs are committed: resize_<i>.rgb (raw RGB bytes) and cases.json.
"""

import json
import os
import sys

from PIL import Image

W, H = 173, 131


def pixel(x, y, c):
    # Smooth gradients plus high-frequency texture, so antialiasing matters.
    return (x * 7 + y * 13 + c * 50 + (x * y) % 31 + ((x // 3 + y // 2) % 2) * 40) % 256


CASES = [
    # (left, top, width, height) of the crop, then the output (width, height)
    ((10, 5, 150, 120), (64, 64)),  # downscale ~2x
    ((3, 7, 40, 30), (97, 71)),  # upscale
    ((0, 0, W, H), (120, 100)),  # whole image, slight downscale, aspect change
    ((20, 11, 133, 77), (50, 90)),  # down horizontally, up vertically
    ((5, 9, 64, 48), (64, 17)),  # one axis unchanged
]


def main():
    out_dir = sys.argv[1]
    os.makedirs(out_dir, exist_ok=True)
    img = Image.new("RGB", (W, H))
    img.putdata([tuple(pixel(x, y, c) for c in range(3)) for y in range(H) for x in range(W)])
    cases = []
    for i, ((left, top, w, h), (ow, oh)) in enumerate(CASES):
        out = img.crop((left, top, left + w, top + h)).resize((ow, oh), Image.BILINEAR)
        name = f"resize_{i}.rgb"
        with open(os.path.join(out_dir, name), "wb") as f:
            f.write(out.tobytes())
        cases.append({"crop": [left, top, w, h], "out": [ow, oh], "file": name})
    with open(os.path.join(out_dir, "cases.json"), "w") as f:
        json.dump({"image": [W, H], "pil": Image.__version__, "cases": cases}, f, indent=1)


if __name__ == "__main__":
    main()

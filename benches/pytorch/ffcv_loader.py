"""FFCV's loader on the same images, for `cargo xtask bench loader --vs ffcv`: the ImageFolder is
written to a .beton (JPEG, max side 512, quality 90), then read with
RandomResizedCropRGBImageDecoder((res, res)) + RandomHorizontalFlip + ToTensor (u8 NHWC, like
redline's batches). The first epoch compiles FFCV's numba code and is not timed; then whole
epochs are timed until --seconds have passed.

Usage: python3 benches/pytorch/ffcv_loader.py --folder DIR --out PATH [--batch B] [--res R]
       [--workers N] [--seconds S]
"""

import argparse
import json
import os
import tempfile
import time

from ffcv.fields import IntField, RGBImageField
from ffcv.fields.decoders import IntDecoder, RandomResizedCropRGBImageDecoder
from ffcv.loader import Loader, OrderOption
from ffcv.transforms import RandomHorizontalFlip, ToTensor
from ffcv.writer import DatasetWriter
from torchvision.datasets import ImageFolder


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--folder", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--res", type=int, default=224)
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    p.add_argument("--seconds", type=float, default=20.0)
    a = p.parse_args()
    beton = os.path.join(tempfile.mkdtemp(), "set.beton")
    fields = {
        "image": RGBImageField(write_mode="jpg", max_resolution=512, jpeg_quality=90),
        "label": IntField(),
    }
    DatasetWriter(beton, fields, num_workers=a.workers).from_indexed_dataset(ImageFolder(a.folder))
    loader = Loader(
        beton, batch_size=a.batch, num_workers=a.workers, order=OrderOption.RANDOM, drop_last=True,
        pipelines={
            "image": [RandomResizedCropRGBImageDecoder((a.res, a.res)), RandomHorizontalFlip(), ToTensor()],
            "label": [IntDecoder(), ToTensor()],
        })
    for _ in loader:  # epoch 1: numba compiles
        pass
    images, start = 0, time.perf_counter()
    while time.perf_counter() - start < a.seconds:
        for x, _ in loader:
            images += x.shape[0]
    elapsed = time.perf_counter() - start
    with open(a.out, "w") as f:
        json.dump({"images_per_sec": images / elapsed, "images": images, "seconds": elapsed,
                   "workers": a.workers}, f, indent=2)


if __name__ == "__main__":
    main()

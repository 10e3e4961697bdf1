"""The seed's data pipeline, for `cargo xtask bench loader --vs pytorch`: torchvision ImageFolder +
RandomResizedCrop(res) + RandomHorizontalFlip + ToTensor + Normalize in a DataLoader with
num_workers = cores, pin_memory and prefetch_factor 2, timed for --seconds after one batch.

Usage: python3 benches/pytorch/loader.py --folder DIR --out PATH [--batch B] [--res R]
       [--workers N] [--seconds S]
"""

import argparse
import json
import os
import time

import torch
from torchvision import datasets

from seed_pipeline import train_transform


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--folder", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--res", type=int, default=224)
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    p.add_argument("--seconds", type=float, default=20.0)
    a = p.parse_args()
    tf = train_transform(a.res)
    data = datasets.ImageFolder(a.folder, tf)
    loader = torch.utils.data.DataLoader(
        data, batch_size=a.batch, shuffle=True, num_workers=a.workers, pin_memory=True,
        prefetch_factor=2, drop_last=True, persistent_workers=True)
    it = iter(loader)
    images, start = 0, None
    while True:
        try:
            x, _ = next(it)
        except StopIteration:
            it = iter(loader)
            continue
        if start is None:
            start = time.perf_counter()  # after the first (warm-up) batch
            continue
        images += x.shape[0]
        if time.perf_counter() - start >= a.seconds:
            break
    elapsed = time.perf_counter() - start
    with open(a.out, "w") as f:
        json.dump({"images_per_sec": images / elapsed, "images": images, "seconds": elapsed,
                   "workers": a.workers, "torch": torch.__version__}, f, indent=2)


if __name__ == "__main__":
    main()

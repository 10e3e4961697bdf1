"""The seed's training loop, for `cargo xtask bench imagenet --vs pytorch`: torchvision
ImageFolder + RandomResizedCrop + RandomHorizontalFlip + ToTensor + Normalize in a DataLoader,
torchvision's ResNet, CrossEntropyLoss, AdamW (PyTorch's defaults: lr 1e-3, weight decay 0.01),
and autocast + GradScaler only when --precision asks for half precision. The same warm-up and
measurement rule as bench-imagenet: --warmup steps, then steps until --steps (or --seconds have
passed and at least 5 steps ran); img/s = batch / median step time, a step including its data
wait and the optimizer.

--layout best runs NCHW and channels-last one after the other and reports the faster (PyTorch
at its best layout); each layout's figure is in the JSON.

Usage: python3 benches/pytorch/imagenet.py --folder DIR --out PATH [--model resnet50]
       [--res 224] [--batch 8] [--precision fp32|fp16|bf16] [--workers N] [--warmup 2]
       [--steps N] [--seconds 60] [--layout nchw|channels_last|best]
"""

import argparse
import json
import os
import statistics
import time

import torch
import torchvision
from torchvision import datasets

from seed_pipeline import train_transform


def measure(a, layout):
    torch.manual_seed(0)
    tf = train_transform(a.res)
    data = datasets.ImageFolder(a.folder, tf)
    loader = torch.utils.data.DataLoader(
        data, batch_size=a.batch, shuffle=True, num_workers=a.workers,
        prefetch_factor=2, drop_last=True, persistent_workers=True)
    fmt = torch.channels_last if layout == "channels_last" else torch.contiguous_format
    model = getattr(torchvision.models, a.model)().to(memory_format=fmt)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loss_fn = torch.nn.CrossEntropyLoss()
    half = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(a.precision)
    scaler = torch.amp.GradScaler("cpu", enabled=a.precision == "fp16")

    def batches():
        while True:
            yield from loader

    it = batches()
    steps, losses = [], []
    start = None
    for i in range(10**9):
        t0 = time.perf_counter()
        x, y = next(it)
        x = x.contiguous(memory_format=fmt)
        with torch.autocast("cpu", dtype=half or torch.float32, enabled=half is not None):
            loss = loss_fn(model(x), y)
        opt.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        losses.append(loss.item())
        dt = time.perf_counter() - t0
        if i < a.warmup:
            continue
        if start is None:
            start = t0
        steps.append(dt)
        elapsed = time.perf_counter() - start
        if (a.steps and len(steps) >= a.steps) or (
                not a.steps and elapsed >= a.seconds and len(steps) >= 5):
            break
    p50 = statistics.median(steps)
    return {"layout": layout, "images_per_sec": a.batch / p50, "step_p50_ms": p50 * 1e3,
            "steps": len(steps), "final_loss": losses[-1]}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--folder", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--model", default="resnet50")
    p.add_argument("--res", type=int, default=224)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--precision", default="fp32", choices=["fp32", "fp16", "bf16"])
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=0)
    p.add_argument("--seconds", type=float, default=60.0)
    p.add_argument("--layout", default="best", choices=["nchw", "channels_last", "best"])
    a = p.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    layouts = ["nchw", "channels_last"] if a.layout == "best" else [a.layout]
    runs = [measure(a, layout) for layout in layouts]
    best = max(runs, key=lambda r: r["images_per_sec"])
    with open(a.out, "w") as f:
        json.dump({"images_per_sec": best["images_per_sec"], "layout": best["layout"],
                   "runs": runs, "threads": torch.get_num_threads(), "torch": torch.__version__},
                  f, indent=2)


if __name__ == "__main__":
    main()

"""The default training recipe of `redline-train` / `cargo xtask train`, in PyTorch, for the
accuracy fixture that redline's ResNet-18 test compares against
(crates/train/tests/fixtures/resnet18_64px.json).

The recipe: torchvision's ResNet (zero-initialised last BN of each block), SGD with Nesterov
momentum 0.9 (fixed: OneCycleLR's momentum cycling is off, as redline's schedule does not cycle
it), weight decay on weights only (tensors of rank >= 2; BN parameters and biases get none), a
one-cycle learning rate peaking at --lr (PyTorch's OneCycleLR defaults: pct_start 0.3, cosine,
div_factor 25, final_div_factor 1e4), label smoothing 0.1. Training images go through
RandomResizedCrop(res) + RandomHorizontalFlip + Normalize, validation through
Resize(res / 0.875) + CenterCrop(res) + Normalize — the loader's two pipelines. Whole batches
only (the last partial batch of an epoch is dropped, as redline's loader does).

Each seed is a full run; the JSON has every seed's final validation top-1 and their mean.

Usage: python3 benches/pytorch/train.py --folder DIR --out PATH [--model resnet18] [--res 64]
       [--batch 64] [--epochs 3] [--lr 0.2] [--wd 5e-5] [--seeds 0,1,2] [--workers 2]
"""

import argparse
import json
import statistics
import sys
import time

import torch
import torchvision
from torchvision import datasets, transforms

from seed_pipeline import train_transform

MEAN, STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]


def eval_transform(res):
    return transforms.Compose([
        transforms.Resize(round(res / 0.875)),
        transforms.CenterCrop(res),
        transforms.ToTensor(),
        transforms.Normalize(MEAN, STD),
    ])


def top1(model, loader):
    model.eval()
    right = seen = 0
    with torch.no_grad():
        for x, y in loader:
            right += (model(x).argmax(1) == y).sum().item()
            seen += len(y)
    model.train()
    return right / seen


def run(a, seed):
    torch.manual_seed(seed)
    train = datasets.ImageFolder(f"{a.folder}/train", train_transform(a.res))
    val = datasets.ImageFolder(f"{a.folder}/val", eval_transform(a.res))
    train_loader = torch.utils.data.DataLoader(
        train, batch_size=a.batch, shuffle=True, drop_last=True, num_workers=a.workers,
        persistent_workers=a.workers > 0)
    val_loader = torch.utils.data.DataLoader(val, batch_size=a.batch, num_workers=a.workers)
    model = getattr(torchvision.models, a.model)(
        num_classes=len(train.classes), zero_init_residual=True)
    decay = [p for p in model.parameters() if p.ndim >= 2]
    plain = [p for p in model.parameters() if p.ndim < 2]
    opt = torch.optim.SGD(
        [{"params": decay, "weight_decay": a.wd}, {"params": plain, "weight_decay": 0.0}],
        lr=a.lr, momentum=0.9, nesterov=True)
    total = a.epochs * len(train_loader)
    sched = torch.optim.lr_scheduler.OneCycleLR(
        opt, max_lr=a.lr, total_steps=total, pct_start=0.3, div_factor=25.0,
        final_div_factor=1e4, cycle_momentum=False)
    loss_fn = torch.nn.CrossEntropyLoss(label_smoothing=0.1)
    per_epoch = []
    for epoch in range(a.epochs):
        t0 = time.perf_counter()
        for x, y in train_loader:
            loss = loss_fn(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
        acc = top1(model, val_loader)
        per_epoch.append(acc)
        print(f"seed {seed} epoch {epoch}: loss {loss.item():.3f} val top-1 {acc:.4f} "
              f"({time.perf_counter() - t0:.0f} s)", flush=True)
    return per_epoch


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--folder", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--model", default="resnet18")
    p.add_argument("--res", type=int, default=64)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--lr", type=float, default=None)
    p.add_argument("--wd", type=float, default=5e-5)
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--synth-seed", type=int, default=None,
                   help="the `redline-data synth --seed` that made --folder (recorded)")
    a = p.parse_args()
    if a.lr is None:
        a.lr = 0.2 * a.batch / 64
    runs = {int(s): run(a, int(s)) for s in a.seeds.split(",")}
    train = datasets.ImageFolder(f"{a.folder}/train")
    finals = [r[-1] for r in runs.values()]
    report = {
        "command": "python3 benches/pytorch/train.py " + " ".join(sys.argv[1:]),
        "classes": len(train.classes), "images": len(train), "synth_seed": a.synth_seed,
        "model": a.model, "res": a.res, "batch": a.batch, "epochs": a.epochs, "lr": a.lr,
        "wd": a.wd, "label_smoothing": 0.1, "nesterov": True, "schedule": "one_cycle",
        "torch": torch.__version__, "torchvision": torchvision.__version__,
        "val_top1_per_seed": {str(s): r for s, r in runs.items()},
        "final_val_top1": statistics.mean(finals),
        "final_val_top1_spread": max(finals) - min(finals),
    }
    with open(a.out, "w") as f:
        json.dump(report, f, indent=2)
    print(json.dumps({k: report[k] for k in ("final_val_top1", "final_val_top1_spread")}))


if __name__ == "__main__":
    main()

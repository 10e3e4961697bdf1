"""PyTorch's side of gpu-check's speed stage: ResNet training steps at PyTorch's best on one
device — channels_last, cudnn.benchmark, AdamW(fused=True), autocast (+ GradScaler for fp16;
bf16 needs none) — fed the same way as redline's side: one u8 NHWC batch resident in pinned
host memory, copied to the device each step (non_blocking) and normalised there. Optionally
the same step with the model under torch.compile.

img/s = images / wall time between two synchronisations, after --warmup steps (which also
absorb cudnn.benchmark's search and the compile). Prints one JSON object (and writes it to
--out when given).

Usage: python3 gpu_speed.py [--model resnet50] [--res 224] [--batch 256]
       [--precision bf16|fp16] [--warmup 10] [--steps 30] [--lr 1e-3] [--compile]
       [--device cuda] [--out PATH]
"""

import argparse
import json
import math
import time

import torch
import torchvision

MEAN = (0.485, 0.456, 0.406)
STD = (0.229, 0.224, 0.225)


def synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(a, device, compiled):
    torch.manual_seed(0)
    half = {"fp16": torch.float16, "bf16": torch.bfloat16}[a.precision]
    model = getattr(torchvision.models, a.model)().to(device, memory_format=torch.channels_last)
    model.train()
    step_model = torch.compile(model) if compiled else model
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, fused=True)
    scaler = torch.amp.GradScaler(device.type, enabled=a.precision == "fp16")
    loss_fn = torch.nn.CrossEntropyLoss()
    pin = device.type == "cuda"
    pixels = torch.randint(0, 256, (a.batch, a.res, a.res, 3), dtype=torch.uint8)
    labels = torch.randint(0, 1000, (a.batch,), dtype=torch.int64)
    if pin:
        pixels, labels = pixels.pin_memory(), labels.pin_memory()
    mean = torch.tensor(MEAN, device=device, dtype=half).view(1, 3, 1, 1)
    std = torch.tensor(STD, device=device, dtype=half).view(1, 3, 1, 1)

    def step():
        x = pixels.to(device, non_blocking=pin).permute(0, 3, 1, 2)  # NHWC storage: channels_last
        x = (x.to(half) / 255 - mean) / std
        y = labels.to(device, non_blocking=pin)
        with torch.autocast(device.type, dtype=half):
            loss = loss_fn(step_model(x), y)
        opt.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        return loss

    for _ in range(a.warmup):
        step()
    synchronize(device)
    start = time.perf_counter()
    for _ in range(a.steps):
        loss = step()
    synchronize(device)
    seconds = time.perf_counter() - start
    last = float(loss.item())
    return {
        "img_per_s": a.batch * a.steps / seconds,
        "seconds": seconds,
        "steps": a.steps,
        "warmup": a.warmup,
        # A diverged loss is null: Python would write NaN, which is not JSON, and the speed
        # stage would lose the whole report (seen here at batch 2 on the CPU under load).
        "loss": last if math.isfinite(last) else None,
    }


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="resnet50")
    p.add_argument("--res", type=int, default=224)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--precision", default="bf16", choices=["bf16", "fp16"])
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--compile", action="store_true")
    p.add_argument("--device", default="cuda")
    p.add_argument("--out")
    a = p.parse_args()
    device = torch.device(a.device)
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True
        name = torch.cuda.get_device_name(device)
    else:
        name = "cpu"
    report = {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if device.type == "cuda" else None,
        "device": name,
        "model": a.model, "res": a.res, "batch": a.batch, "precision": a.precision,
        "channels_last": True, "cudnn_benchmark": device.type == "cuda", "fused_adamw": True,
        "eager": measure(a, device, compiled=False),
    }
    if a.compile:
        try:
            report["compile"] = measure(a, device, compiled=True)
        except Exception as e:  # a compiler that fails here is a result, not a crash
            report["compile"] = {"error": f"{type(e).__name__}: {e}"}
    text = json.dumps(report)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)
    print(text)


if __name__ == "__main__":
    main()

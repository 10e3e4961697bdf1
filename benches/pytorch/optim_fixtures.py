"""PyTorch's optimizers, LR schedules and gradient clipping on small fixed inputs, for redline-nn's
tests: writes crates/nn/tests/fixtures/optim.json. Usage: python3 benches/pytorch/optim_fixtures.py

Every case starts from the same parameters and feeds the same gradients (functions of the step
number), so the Rust side can replay them exactly.
"""

import json
import math
import os

import torch

OUT = os.path.join(os.path.dirname(__file__), "..", "..", "crates", "nn", "tests", "fixtures", "optim.json")
torch.set_default_dtype(torch.float64)


def start():
    # Two groups' worth: a "weight" (decayed) and a "bias" (not decayed).
    w = torch.tensor([[0.5, -1.0, 2.0], [0.25, 0.0, -0.75]], requires_grad=True)
    b = torch.tensor([0.1, -0.2], requires_grad=True)
    return w, b


def grads(step):
    gw = torch.tensor([[1.0, -2.0, 0.5], [0.0, 3.0, -1.0]]) * (1.0 + 0.5 * step)
    gb = torch.tensor([0.3, -0.1]) * (step - 1.0)
    return gw, gb


def run(make, steps=4, schedule=None):
    w, b = start()
    opt = make([{"params": [w], "weight_decay": 0.05}, {"params": [b], "weight_decay": 0.0}])
    sched = schedule(opt) if schedule else None
    lrs = []
    for s in range(steps):
        gw, gb = grads(s)
        w.grad, b.grad = gw.clone(), gb.clone()
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        if sched:
            sched.step()
    return {"w": w.detach().flatten().tolist(), "b": b.detach().tolist(), "lrs": lrs}


cases = {
    "sgd_nesterov": run(lambda g: torch.optim.SGD(g, lr=0.1, momentum=0.9, nesterov=True)),
    "sgd_plain": run(lambda g: torch.optim.SGD(g, lr=0.1)),
    "sgd_dampened": run(lambda g: torch.optim.SGD(g, lr=0.1, momentum=0.9, dampening=0.1)),
    "adamw": run(lambda g: torch.optim.AdamW(g, lr=0.01, betas=(0.9, 0.999), eps=1e-8)),
}


def lrs(make_sched, steps, lr=0.4):
    p = torch.zeros(1, requires_grad=True)
    opt = torch.optim.SGD([p], lr=lr)
    sched = make_sched(opt)
    out = []
    for _ in range(steps):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out


schedules = {
    "one_cycle": lrs(lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.4, total_steps=20), 20),
    "step": lrs(lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=3, gamma=0.5), 10),
    "warmup_cosine": lrs(
        lambda o: torch.optim.lr_scheduler.SequentialLR(
            o,
            [
                torch.optim.lr_scheduler.LinearLR(o, start_factor=0.1, total_iters=4),
                torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=12, eta_min=0.01),
            ],
            milestones=[4],
        ),
        16,
    ),
}

w, b = start()
w.grad, b.grad = grads(2)
norm = torch.nn.utils.clip_grad_norm_([w, b], max_norm=1.5)
clip = {"norm": norm.item(), "w": w.grad.flatten().tolist(), "b": b.grad.tolist()}

with open(OUT, "w") as f:
    json.dump({"optimizers": cases, "schedules": schedules, "clip": clip}, f, indent=1)
print("wrote", OUT)

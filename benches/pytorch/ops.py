"""The op benchmark's rows in PyTorch, timed the same way as redline's (benches/src/ops.rs).

Usage: python3 benches/pytorch/ops.py --rows gemm_512,conv3x3_64_56_b8_fwd_nchw,... --out PATH

Each row: two warm-up iterations, then iterations until 2 s have passed (at least 5, at most 50);
GFLOP/s = counted FLOPs / median time, with the same FLOP counts as redline. Runs on the CPU with
torch.set_num_threads(all cores) unless REDLINE_CPU_THREADS says otherwise. Writes a JSON list of
{"name", "gflops", "median_ms", "iterations"}.
"""

import argparse
import json
import os
import re
import statistics
import time

import torch
import torch.nn.functional as F

BN_FLOPS_PER_ELEMENT = 8.0  # as BN_FLOPS_PER_ELEMENT in benches/src/ops.rs


def inputs(shape, channels_last=False, requires_grad=False):
    x = torch.rand(shape) * 2 - 1
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    return x.requires_grad_(requires_grad)


def prepare(name):
    """Returns (flops, step) for a row name."""
    m = re.fullmatch(r"gemm_(\d+)", name)
    if m:
        n = int(m.group(1))
        a, b = inputs((n, n)), inputs((n, n))
        return 2.0 * n**3, lambda: torch.mm(a, b)
    m = re.fullmatch(r"conv3x3_(\d+)_(\d+)_b(\d+)_(fwd|fwdbwd)_(nchw|nhwc)", name)
    if m:
        c, hw, n = int(m.group(1)), int(m.group(2)), int(m.group(3))
        backward, cl = m.group(4) == "fwdbwd", m.group(5) == "nhwc"
        x = inputs((n, c, hw, hw), cl, backward)
        w = inputs((c, c, 3, 3), cl, backward)
        g = inputs((n, c, hw, hw), cl)
        forward = 2.0 * n * c * hw * hw * c * 9

        def step():
            y = F.conv2d(x, w, padding=1)
            if backward:
                # Input and weight gradients, as redline's row computes.
                torch.autograd.grad(y, (x, w), g)

        if not backward:
            step_no_grad = step

            def step():
                with torch.no_grad():
                    step_no_grad()

        return (3.0 if backward else 1.0) * forward, step
    m = re.fullmatch(r"bn_(\d+)_(\d+)_b(\d+)_fwdbwd", name)
    if m:
        c, hw, n = int(m.group(1)), int(m.group(2)), int(m.group(3))
        x = inputs((n, c, hw, hw), True, True)
        g = inputs((n, c, hw, hw), True)
        weight, bias = inputs((c,), requires_grad=True), inputs((c,), requires_grad=True)

        def step():
            y = F.batch_norm(x, None, None, weight, bias, training=True, eps=1e-5)
            torch.autograd.grad(y, (x, weight, bias), g)

        return 3.0 * BN_FLOPS_PER_ELEMENT * n * c * hw * hw, step
    raise SystemExit(f"unknown row {name}")


def measure(name, seconds):
    flops, step = prepare(name)
    for _ in range(2):
        step()
    times, start = [], time.perf_counter()
    while True:
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
        if len(times) >= 5 and (time.perf_counter() - start >= seconds or len(times) >= 50):
            break
    median = statistics.median_low(times)
    return {"name": name, "gflops": flops / median / 1e9, "median_ms": median * 1e3, "iterations": len(times)}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--seconds", type=float, default=2.0)
    args = parser.parse_args()
    threads = int(os.environ.get("REDLINE_CPU_THREADS", os.cpu_count() or 1))
    torch.set_num_threads(threads)
    results = []
    for name in args.rows.split(","):
        r = measure(name, args.seconds)
        print(f"  {r['name']:<30} {r['gflops']:>9.1f} GFLOP/s  (median {r['median_ms']:.2f} ms of {r['iterations']})", flush=True)
        results.append(r)
    with open(args.out, "w") as f:
        json.dump({"torch": torch.__version__, "threads": threads, "rows": results}, f, indent=2)


if __name__ == "__main__":
    main()

"""PyTorch's CPU all-reduce (the gloo backend), timed as redline's `allreduce_bench` example is:
`--mb` megabytes of float32 averaged `--iters` times after two warm-ups, a barrier before each.
Launched by torchrun (`cargo xtask bench allreduce --vs gloo` does it); rank 0 writes
{"world", "mb", "median_ms", "algbw_gb_per_s"} to --out."""

import argparse
import json
import time

import torch
import torch.distributed as dist


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--mb", type=float, default=25)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--out", default="")
    a = p.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    n = int(a.mb * 1e6 / 4)
    x = torch.full((n,), float(rank + 1), dtype=torch.float32)
    times = []
    for i in range(a.iters + 2):
        dist.barrier()
        t = time.perf_counter()
        dist.all_reduce(x, op=dist.ReduceOp.SUM)
        x /= world  # DDP's average, as redline's Reduce::Avg
        if i >= 2:
            times.append(time.perf_counter() - t)
    median = sorted(times)[len(times) // 2]  # as the Rust side takes it
    if rank == 0:
        line = json.dumps({"world": world, "mb": a.mb, "median_ms": round(median * 1e3, 3),
                           "algbw_gb_per_s": round(n * 4 / median / 1e9, 3)})
        print(line)
        if a.out:
            with open(a.out, "w") as f:
                f.write(line + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

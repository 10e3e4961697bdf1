"""PyTorch's side of `benches/examples/resnet50_convs.rs`: every distinct ResNet-50 convolution
at 224², batch 8, channels-last, forward and backward (input + weight gradients), weighted by
its uses in the network. Usage: python3 benches/pytorch/resnet50_convs.py"""

import os
import time

import torch

SHAPES = [
    (3, 64, 7, 2, 224, 1), (64, 64, 1, 1, 56, 1), (256, 64, 1, 1, 56, 2), (64, 64, 3, 1, 56, 3),
    (64, 256, 1, 1, 56, 4), (256, 128, 1, 1, 56, 1), (128, 128, 3, 2, 56, 1),
    (256, 512, 1, 2, 56, 1), (128, 512, 1, 1, 28, 4), (512, 128, 1, 1, 28, 3),
    (128, 128, 3, 1, 28, 3), (512, 256, 1, 1, 28, 1), (256, 256, 3, 2, 28, 1),
    (512, 1024, 1, 2, 28, 1), (256, 1024, 1, 1, 14, 6), (1024, 256, 1, 1, 14, 5),
    (256, 256, 3, 1, 14, 5), (1024, 512, 1, 1, 14, 1), (512, 512, 3, 2, 14, 1),
    (1024, 2048, 1, 2, 14, 1), (512, 2048, 1, 1, 7, 3), (2048, 512, 1, 1, 7, 2),
    (512, 512, 3, 1, 7, 2),
]


def main():
    torch.set_num_threads(os.cpu_count() or 1)
    n, tf, tb = 8, 0.0, 0.0
    print(f"{'conv':<28} {'fwd ms':>9} {'bwd ms':>9}")
    for c, o, k, s, h, uses in SHAPES:
        x = torch.full((n, c, h, h), 0.5).to(memory_format=torch.channels_last).requires_grad_()
        w = torch.full((o, c, k, k), 0.01).to(memory_format=torch.channels_last).requires_grad_()
        fwd, bwd = [], []
        for _ in range(4):
            x.grad = w.grad = None
            t0 = time.perf_counter()
            y = torch.nn.functional.conv2d(x, w, stride=s, padding=k // 2)
            t1 = time.perf_counter()
            g = torch.ones_like(y)
            t2 = time.perf_counter()
            y.backward(g)
            fwd.append(t1 - t0)
            bwd.append(time.perf_counter() - t2)
        f, b = min(fwd[1:]), min(bwd[1:])
        tf += f * uses
        tb += b * uses
        print(f"{f'{c}->{o} k{k} s{s} {h}² ×{uses}':<28} {f * 1e3:>9.2} {b * 1e3:>9.2}")
    print(f"weighted total: forward {tf * 1e3:.0f} ms, backward {tb * 1e3:.0f} ms")


if __name__ == "__main__":
    main()

"""Checkpoints across PyTorch and redline: the fixture and the two checks of
crates/train/tests/pytorch_checkpoints.rs.

Every entry of torchvision's ResNet-18 state dict gets deterministic, non-zero values from
`value(key, shape)` (numpy only) — batch-norm running statistics and num_batches_tracked too —
so a state dict as PyTorch saves it can be written without torch, and torchvision's eval-mode
logits on a deterministic input are recorded once, with torch, as the fixture.

  python3 checkpoint_fixtures.py fixture        # torch + torchvision: writes the logits fixture
  python3 checkpoint_fixtures.py write OUT      # numpy + safetensors: the state dict PyTorch's
                                                # safetensors.torch.save_file would write
  python3 checkpoint_fixtures.py check CKPT     # numpy + safetensors: a redline checkpoint's
        model entries are torchvision's state dict — the same keys, shapes and dtypes that
        load_state_dict(strict=True) demands, and the values `write` gave; with torch present
        it also loads them into torchvision.models.resnet18() strictly and compares logits
"""

import json
import os
import sys
import zlib

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.join(HERE, "..", "..")
KEYS = os.path.join(ROOT, "crates", "nn", "tests", "fixtures", "resnet18.txt")
FIXTURE = os.path.join(ROOT, "crates", "train", "tests", "fixtures", "resnet18_state_logits.json")
BATCH, RES = 2, 32


def keys():
    """torchvision's ResNet-18 state dict entries, in order: (key, shape)."""
    out = []
    with open(KEYS) as f:
        for line in f:
            key, shape = line.split()
            out.append((key, () if shape == "scalar" else tuple(int(d) for d in shape.split("x"))))
    return out


def value(key, shape):
    """A deterministic, non-trivial value for one state-dict entry."""
    if key.endswith("num_batches_tracked"):
        return np.array(100 + zlib.crc32(key.encode()) % 900, dtype=np.int64)
    n = int(np.prod(shape))
    phase = (zlib.crc32(key.encode()) % 1000) / 100.0
    wave = np.sin(0.37 * np.arange(n, dtype=np.float64) + phase).reshape(shape)
    if key.endswith("running_var"):
        v = 0.5 + 0.4 * (wave + 1.0)  # in [0.5, 1.3]
    elif key.endswith("running_mean") or key.endswith("bias"):
        v = 0.1 * wave
    elif len(shape) == 1:  # batch-norm weight
        v = 1.0 + 0.2 * wave
    else:  # conv / linear weight: about He-scaled
        fan_in = n // shape[0]
        v = wave * np.sqrt(2.0 / fan_in)
    return v.astype(np.float32)


def state_dict():
    return {k: value(k, s) for k, s in keys()}


def inputs():
    n = BATCH * 3 * RES * RES
    return (1.5 * np.sin(0.11 * np.arange(n, dtype=np.float64))).astype(np.float32).reshape(BATCH, 3, RES, RES)


def torch_logits(tensors):
    import torch
    import torchvision

    model = torchvision.models.resnet18()
    model.load_state_dict({k: torch.from_numpy(np.asarray(v)) for k, v in tensors.items()}, strict=True)
    model.eval()
    with torch.no_grad():
        return model(torch.from_numpy(inputs())).numpy()


def fixture():
    import torch

    logits = torch_logits(state_dict())
    with open(FIXTURE, "w") as f:
        json.dump(
            {
                "made_by": "benches/pytorch/checkpoint_fixtures.py fixture",
                "torch": torch.__version__,
                "model": "torchvision.models.resnet18() in eval mode, the state dict of value()",
                "input": f"1.5 * sin(0.11 * i), i = 0.., shape [{BATCH}, 3, {RES}, {RES}] (f32)",
                "logits": [[float(x) for x in row] for row in logits],
            },
            f,
        )
        f.write("\n")
    print(f"wrote {FIXTURE}: logits {logits.shape}, |max| {np.abs(logits).max():.3f}")


def write(out):
    from safetensors.numpy import save_file

    save_file(state_dict(), out)


def check(path):
    from safetensors.numpy import load_file

    saved = load_file(path)
    want = state_dict()
    problems = []
    for key, shape in keys():
        if key not in saved:
            problems.append(f"missing {key}")
            continue
        got = saved[key]
        if got.shape != shape or got.dtype != want[key].dtype:
            problems.append(f"{key}: {got.dtype} {got.shape}, torchvision has {want[key].dtype} {shape}")
        elif not np.array_equal(got, want[key]):
            problems.append(f"{key}: values differ from what `write` gave")
    model_keys = {k for k, _ in keys()}
    # Everything else must sit under the optimizer's or the scaler's prefix, so the model part
    # is exactly torchvision's state dict.
    stray = [k for k in saved if k not in model_keys and not k.startswith(("optimizer.", "scaler."))]
    problems += [f"unexpected entry {k}" for k in stray]
    if problems:
        print("\n".join(problems))
        sys.exit(1)
    extra = sorted(k.split(".")[0] for k in saved if k not in model_keys)
    print(f"{len(model_keys)} model entries as torchvision's; besides them: {sorted(set(extra))}")
    try:
        import torch  # noqa: F401
    except ImportError:
        return
    logits = torch_logits({k: saved[k] for k in model_keys})
    with open(FIXTURE) as f:
        expect = np.array(json.load(f)["logits"], dtype=np.float32)
    err = np.abs(logits - expect).max()
    print(f"torch load_state_dict(strict=True) took it; logits differ from the fixture by {err:.2e}")
    if err > 1e-5:
        sys.exit(1)


if __name__ == "__main__":
    mode = sys.argv[1] if len(sys.argv) > 1 else ""
    if mode == "fixture":
        fixture()
    elif mode == "write" and len(sys.argv) == 3:
        write(sys.argv[2])
    elif mode == "check" and len(sys.argv) == 3:
        check(sys.argv[2])
    else:
        sys.exit(__doc__)

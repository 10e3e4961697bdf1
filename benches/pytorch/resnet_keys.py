"""torchvision's ResNet state_dict keys and shapes, for redline-nn's naming test.

Writes crates/nn/tests/fixtures/resnet{18,34,50}.txt: one `key shape` line per state_dict entry
(shape as `AxBxC`, `scalar` for 0-d), in torchvision's order, and prints each model's parameter
count. Usage: python3 benches/pytorch/resnet_keys.py
"""

import os

import torchvision

OUT = os.path.join(os.path.dirname(__file__), "..", "..", "crates", "nn", "tests", "fixtures")

for name in ["resnet18", "resnet34", "resnet50"]:
    model = getattr(torchvision.models, name)()
    with open(os.path.join(OUT, f"{name}.txt"), "w") as f:
        for key, value in model.state_dict().items():
            shape = "x".join(str(d) for d in value.shape) or "scalar"
            f.write(f"{key} {shape}\n")
    print(name, sum(p.numel() for p in model.parameters()), "parameters")

"""The diff guide's example (docs/guide/diff.md): what grew between two censuses and between
two steps, grouped by holder. CPU tensors, so it runs anywhere."""

import torch

import cudamem

model = torch.nn.Linear(1024, 1024)
history = []
cache = {}


def step(i):
    out = model(torch.randn(64, 1024))
    history.append(out)  # the bug: a graph per step
    if i % 2:
        cache[f"batch{i}"] = torch.randn(64, 1024)
    return out.sum().item()


print("=== census ===")
before = cudamem.live_tensors("cpu", holders=True)
for i in range(4):
    step(i)
after = cudamem.live_tensors("cpu", holders=True)
print(cudamem.diff(before, after))

print("=== spans ===")
with cudamem.track("step", leaks=True) as first:
    step(4)
with cudamem.track("step", leaks=True) as second:
    step(5)
print(cudamem.diff(first, second))

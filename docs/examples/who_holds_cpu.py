"""The who-holds guide's examples of scale and limits (docs/guide/who-holds.md): many
references to one tensor, a numpy array on a tensor's memory, a search cut short by its
limits, limits refused. Runs on any machine (CPU tensors).
"""

import torch

import cudamem

print("=== grouped ===")  # one list holding a tensor 3,000 times, 60,000 dicts another
total = torch.zeros(())
log = [total] * 3000
print(cudamem.who_holds(total, timeout=1.0))
print()

emb = torch.ones(1024)
rows = [{"id": i, "emb": emb} for i in range(60_000)]
result = cudamem.who_holds(emb)
print(result)
h = next(h for h in result if not h.caller)
print(f"path={h.path!r} count={h.count} pattern={h.pattern!r}")

print("=== numpy ===")  # numpy arrays on a tensor's memory hold it
frame = torch.zeros(480, 640)
pixels = frame.numpy()  # shares frame's memory
print(cudamem.who_holds(frame))

print("=== stopped ===")  # a search cut short says which limit stopped it, how far it got
t = torch.ones(16)
nest: list = [t]
for _ in range(100):
    nest = [nest]
print(cudamem.who_holds(t, max_depth=5))

print("=== refused ===")  # bad limits are refused, naming the argument
for bad in ({"timeout": None}, {"max_depth": "10"}, {"max_nodes": -1}):
    try:
        cudamem.who_holds(t, **bad)
    except (TypeError, ValueError) as exc:
        print(f"{type(exc).__name__}: {exc}")

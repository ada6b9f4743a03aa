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

print("=== structure ===")  # a path is structure: steps, container, item, pattern, graph


class Model:
    def __init__(self) -> None:
        self.seen: list[torch.Tensor] = []

    def log(self, value: torch.Tensor) -> None:
        self.seen.append(value)


class Callback:
    log = None


model = Model()
cb = Callback()
cb.log = model.log  # a callback keeps a bound method, so the model lives on through it
del model
w = torch.ones(256, requires_grad=True)
for _ in range(3):
    cb.log((torch.sigmoid(w * 2)).sum())
step = cb.log.__self__.seen[2]
saved = step.grad_fn.next_functions[0][0]._saved_result  # sigmoid's output, kept for backward
del step
for h in cudamem.who_holds(saved):
    if h.caller:
        continue
    r = h.route
    print(h.path)
    print(f"  steps={[s.kind for s in r.steps]}")
    print(f"  container={r.container!r} item={r.item!r}")
    print(f"  pattern={r.item_pattern!r} through_graph={r.through_graph}")

"""The span guide's examples (docs/guide/spans.md). Run on a GPU: python docs/examples/spans.py

Spans read the CUDA allocator's counters: without a GPU there is nothing to show, so on a CPU
machine this example says so and stops.
"""

import gc
import sys

import torch

import cudamem

if not torch.cuda.is_available():
    sys.exit("spans.py: this example needs a CUDA GPU")
torch.manual_seed(0)

# -- 1. one block ---------------------------------------------------------------------
print("=== create ===")
torch.cuda.init()
with cudamem.track("create") as span:
    x = torch.ones((8192, 8192), device="cuda")  # 256 MiB of fp32
print(span)
print(span.allocated_delta, span.reserved_delta, span.peak, span.peak_delta)

# -- 2. freeing: allocated drops, reserved stays until empty_cache ------------------------
print("=== free ===")
with cudamem.track("del x") as span:
    del x
print(span)
with cudamem.track("empty_cache") as span:
    torch.cuda.empty_cache()
print(span)

# -- 3. a decorated function records one span per call --------------------------------------
model = torch.nn.Sequential(torch.nn.Linear(4096, 4096), torch.nn.ReLU(), torch.nn.Linear(4096, 10))
model.cuda()
opt = torch.optim.Adam(model.parameters())


@cudamem.track
def train_step(batch: torch.Tensor) -> float:
    opt.zero_grad(set_to_none=True)
    loss = model(batch).square().mean()
    loss.backward()
    opt.step()
    return float(loss.detach())


cudamem.clear_history()
for _ in range(5):
    train_step(torch.randn(512, 4096, device="cuda"))
print("=== history-calls ===")
print(cudamem.history().spans[0])  # the first call creates Adam's state
print(cudamem.history().spans[-1])  # later calls give back what they take
print("=== history ===")
print(cudamem.history())

# -- 4. nesting: every span gets its own peak ---------------------------------------------
print("=== nesting ===")
cudamem.clear_history()
with cudamem.track("step") as step:
    with cudamem.track("forward"):
        out = model(torch.randn(2048, 4096, device="cuda"))
        loss = out.square().mean()
    with cudamem.track("backward"):
        loss.backward()
del out, loss
print(step)
for child in step.children:
    print("  ", child)
print("=== peaks ===")
print("process-wide peak:", cudamem.max_allocated(0))
print(
    "torch.cuda.max_memory_allocated():",
    torch.cuda.max_memory_allocated(0),
    "(since the last span entry)",
)

# -- 5. an out-of-memory error is recorded, and propagates unchanged ---------------------------
print("=== oom ===")  # the span's OOM post-mortem (stderr) comes first
try:
    with cudamem.track("too big") as span:
        torch.empty(1024**4, dtype=torch.uint8, device="cuda")  # 1 TiB
except torch.OutOfMemoryError:
    pass
print("=== oom-span ===")
print(span)
print(span.exception.is_oom)

# -- 6. JSON --------------------------------------------------------------------------------
from cudamem.render.json import to_json  # noqa: E402

gc.collect()
print("=== json ===")
print(to_json(step.children[0])[:400], "...")

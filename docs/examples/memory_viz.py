"""The memory_viz guide's example (docs/guide/memory-viz.md): a snapshot whose live blocks
are named by their holders, read back and summarised with torch.cuda._memory_viz. Needs a
GPU for blocks; on a CPU-only machine the file holds an empty snapshot (a note says so)."""

import pickle
import sys

import torch
from torch.cuda import _memory_viz

import cudamem

GPU = torch.cuda.is_available()
losses = []
if GPU:
    torch.cuda.memory._record_memory_history(max_entries=10_000)
    x = torch.randn(1024, 1024, device="cuda", requires_grad=True)
    for _ in range(3):
        losses.append(torch.sigmoid(x * 2).mean())  # each keeps its graph (4 MiB)

print("=== dump ===")
dump = cudamem.dump_snapshot("snapshot.pickle")
print(dump)
snap = cudamem.load_snapshot("snapshot.pickle")  # plain data only: no code runs
for seg in snap["segments"]:
    for block in seg["blocks"]:
        if block["state"] == "active_allocated":
            frame = block["frames"][0]
            print(f"{block['size']:>10} B  {frame['filename']}:{frame['line']}:{frame['name']}")
with open("snapshot.pickle", "rb") as f:
    print(_memory_viz.segsum(pickle.load(f)).split("\n\nLegend")[0], file=sys.stdout)

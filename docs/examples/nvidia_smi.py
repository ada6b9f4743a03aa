"""The nvidia-smi guide's examples (docs/guide/nvidia-smi.md) on a GPU.

The ledger reconciles NVML's view of a GPU with PyTorch's. Without a GPU there is nothing to
reconcile: on a CPU machine this example shows only what ``explain()`` then says, and stops.
"""

import gc
import sys

import torch

import cudamem

if not torch.cuda.is_available():
    print("=== no-gpu ===")
    print(cudamem.explain())  # one line saying why, never an exception
    sys.exit(0)

print("=== before ===")
print(cudamem.explain())  # before any CUDA work: nothing to explain, no context created
print("=== ledger ===")
x = torch.zeros(1024, 1024).to("cuda:0")  # seed 001: a 4 MiB tensor
print(cudamem.explain())
print("=== release ===")
del x
gc.collect()
print(cudamem.release())

# A new stream per run leaves that run's cache stranded on the stream.
print("=== streams ===")
for run in range(3):
    with torch.cuda.stream(torch.cuda.Stream()):
        y = torch.empty(64 * 1024**2, dtype=torch.uint8, device="cuda")
        del y
torch.cuda.synchronize()
print(cudamem.explain(0))
print(cudamem.release())

"""The nvidia-smi guide's examples (docs/guide/nvidia-smi.md) on a GPU."""

import gc

import torch

import cudamem

print(cudamem.explain())  # before any CUDA work: nothing to explain, no context created
x = torch.zeros(1024, 1024).to("cuda:0")  # seed 001: a 4 MiB tensor
print(cudamem.explain())
del x
gc.collect()
print(cudamem.release())

# A new stream per run leaves that run's cache stranded on the stream.
for run in range(3):
    with torch.cuda.stream(torch.cuda.Stream()):
        y = torch.empty(64 * 1024**2, dtype=torch.uint8, device="cuda")
        del y
torch.cuda.synchronize()
print(cudamem.explain(0))
print(cudamem.release())

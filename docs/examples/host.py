# docs: cudamem run
"""The host half of a training job (docs/guide/host.md), run under ``cudamem run``: no line of
it asks cudamem for anything; the run watches the DataLoader workers by itself.

Two datasets with the same 200,000 labels: one keeps them in a list of dicts, the other in
numpy arrays. Two forked workers read each for 300 batches of 256. The dict workers' private
memory grows (copy-on-read) and a ``HostMemoryWarning`` names ``dataset.records``; the numpy
workers stay flat and nothing is said. Then ``explain().host`` while a loader is running,
and ``release(host=True)`` (on a GPU: 600 MiB pinned takes 1 GiB, and its cache is freed).
"""

import os
import subprocess
import sys

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

import cudamem

N = 200_000


class Records(Dataset):
    """Labels in a list of dicts: every read writes a dict's reference count."""

    def __init__(self, n):
        self.records = [{"id": i, "path": f"img_{i:07d}.jpg", "label": i % 10} for i in range(n)]

    def __len__(self):
        return len(self.records)

    def __getitem__(self, i):
        return self.records[i]["label"]


class Columns(Dataset):
    """The same data as numpy arrays: one buffer each, never reference-counted per item."""

    def __init__(self, n):
        self.labels = np.arange(n) % 10
        self.paths = np.array([f"img_{i:07d}.jpg" for i in range(n)], dtype="S16")

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        return int(self.labels[i])


def train(dataset, batches=300):
    loader = DataLoader(dataset, batch_size=256, num_workers=2, shuffle=True)
    seen = 0
    for step, labels in enumerate(loader):
        seen += len(labels)
        if step + 1 == batches:
            break
    return seen


print("=== measured-records ===")
train(Records(N))
print("=== measured-columns ===")
train(Columns(N))
print("numpy-backed workers: no warning")

print("=== measured-explain ===")
# Persistent workers stay alive between epochs: after one whole epoch they are live and
# idle, with no batch in flight (what a running loader holds varies from read to read).
running = DataLoader(Columns(N // 10), batch_size=256, num_workers=2, persistent_workers=True)
for labels in running:
    pass
print(cudamem.explain().host)

print("=== measured-status ===")
# What `python -m cudamem status --pid PID` shows of this process, read from outside:
status = subprocess.run(
    [sys.executable, "-m", "cudamem", "status", "--pid", str(os.getpid())],
    capture_output=True,
    text=True,
    check=True,
).stdout
print(status[status.index("host memory") :].split("\n\n")[0])
del running

print("=== measured-release ===")
if torch.cuda.is_available():
    pinned = torch.empty(600 * 1024**2, dtype=torch.uint8).pin_memory()
    print(cudamem.explain().host.pinned)
    del pinned
print(cudamem.release(host=True, holders=False).host)
print("=== measured-report ===")

"""The OOM guide's example (docs/guide/oom.md): a forced OOM with memory held in a list."""

import torch

import cudamem

guard = cudamem.on_oom("oom-report.txt", record_history=True, max_entries=10_000)
held = [
    torch.empty(1024**3, dtype=torch.uint8, device="cuda"),
    torch.empty(2 * 1024**3, dtype=torch.uint8, device="cuda"),
]
try:
    with cudamem.track("too_big"):
        torch.empty(200 * 1024**3, dtype=torch.uint8, device="cuda")
except torch.OutOfMemoryError as exc:
    print("re-raised unchanged:", type(exc).__name__)
guard.uninstall()

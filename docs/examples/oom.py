"""The OOM guide's examples (docs/guide/oom.md).

On a GPU: a real out-of-memory error with 1 GiB and 2 GiB held in a list, reported by
``cudamem.on_oom``. On any machine: ``cudamem.oom_report()`` on PyTorch's real message for a
200 GiB request on an H200 (the exception is built here, so the report has only what the
message says: no live CUDA storage to name).
"""

import torch

import cudamem

if torch.cuda.is_available():
    print("=== real ===")
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
    del held

print("=== simulated ===")
MESSAGE = (
    "CUDA out of memory. Tried to allocate 200.00 GiB. GPU 0 has a total capacity of 139.81 GiB "
    "of which 138.52 GiB is free. Including non-PyTorch memory, this process has 1.28 GiB "
    "memory in use. Of the allocated memory 768.00 MiB is allocated by PyTorch, and 20.00 MiB "
    "is reserved by PyTorch but unallocated."
)
try:
    raise torch.OutOfMemoryError(MESSAGE)
except torch.OutOfMemoryError as exc:
    print(cudamem.oom_report(exc))

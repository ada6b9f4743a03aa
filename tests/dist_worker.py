"""One rank of the two-process gloo tests of ``cudamem.distributed``
(tests/integration/test_distributed.py launches it through torchrun; pytest does not collect it).

Usage: ``dist_worker.py MODE OUT_DIR``. Every rank runs eight tracked steps of 1 MiB tensors on
the CPU, measured by a stand-in allocator that counts live CPU tensors; rank 1 keeps each
step's output in a module-global list, so it grows 1 MiB per step and its leak detector warns.
Then every rank calls ``gather_report`` and writes what it got to ``OUT_DIR/rank<N>.json``.

Modes: ``ok``; ``all`` (``all_ranks=True``); ``raise`` (rank 1's span history raises inside
collection); ``absent`` (rank 1 never calls ``gather_report``); ``fallback`` (the rows go over
cudamem's gloo side group, as when torch hides its store).
"""

from __future__ import annotations

import json
import os
import sys
import time
import warnings
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

import cudamem
import cudamem.distributed as cdist
from cudamem.allocator import backend as _backend
from cudamem.base.data import to_data
from cudamem.distributed import _transport
from cudamem.growth.settings import LeakWarning
from cudamem.spans import history as _history
from tests.fakes import CpuStorageBackend

STEPS = 8
kept: list[torch.Tensor] = []


def _boom() -> None:
    raise RuntimeError("history exploded on purpose")


def main() -> int:
    mode, out = sys.argv[1], Path(sys.argv[2])
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", timeout=timedelta(seconds=30))
    report = None
    with _backend.use(CpuStorageBackend()), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(STEPS):
            with cudamem.track("step"):
                x = torch.ones(256, 1024)  # 1 MiB of float32
                y = x * 2
                if rank == 1:
                    kept.append(y)
                del x, y
        if mode == "fallback":
            _transport._store = lambda dist: None  # type: ignore[assignment]
        if mode == "raise" and rank == 1:
            _history.history = _boom  # type: ignore[assignment]
        if mode == "absent" and rank == 1:
            # Never join the collective; wait for rank 0 to finish without us.
            deadline = time.monotonic() + 25
            while not (out / "rank0.json").exists() and time.monotonic() < deadline:
                time.sleep(0.1)
        else:
            report = cdist.gather_report(
                timeout=4 if mode == "absent" else 20, all_ranks=mode == "all"
            )
    result = {
        "rank": rank,
        "pid": os.getpid(),
        "report": None if report is None else to_data(report),
        "text": None if report is None else str(report),
        "leak_warnings": [str(w.message) for w in caught if isinstance(w.message, LeakWarning)],
    }
    tmp = out / f"rank{rank}.json.tmp"
    tmp.write_text(json.dumps(result))
    tmp.rename(out / f"rank{rank}.json")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())

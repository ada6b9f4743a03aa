"""One rank of the GPU tests of ``cudamem.distributed`` (tests/gpu/test_distributed_cuda.py launches
it through torchrun with NCCL; pytest does not collect it).

Usage: ``dist_worker_cuda.py MODE OUT_DIR``. Modes:

* ``own``: ``torch.cuda.set_device(LOCAL_RANK)``, NCCL, an all-reduce and a few tracked matmul
  steps on the rank's own GPU, then ``gather_report``;
* ``stray``: the same without ``set_device`` (the current device stays cuda:0) and rank 1
  creating one tensor with ``device='cuda'``, which lands on cuda:0.
"""

from __future__ import annotations

import json
import os
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

import cudamem
import cudamem.distributed as cdist
from cudamem.base.data import to_data


def main() -> int:
    mode, out = sys.argv[1], Path(sys.argv[2])
    rank, local = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    own = torch.device("cuda", local)
    if mode == "own":
        torch.cuda.set_device(own)
    dist.init_process_group("nccl", timeout=timedelta(seconds=60))
    stray = None
    if mode == "stray" and rank == 1:
        stray = torch.ones(1024, 1024, device="cuda")  # the current device: cuda:0
    x = torch.randn(1024, 1024, device=own)
    for _ in range(3):
        with cudamem.track("step", device=own):
            y = x @ x
            dist.all_reduce(y)
            del y
    torch.cuda.synchronize(own)
    report = cdist.gather_report(timeout=60)
    result = {
        "rank": rank,
        "pid": os.getpid(),
        "report": None if report is None else to_data(report),
        "text": None if report is None else str(report),
    }
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    del stray, x
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The distributed guide's example (docs/guide/distributed.md): one report for every rank.

    python docs/examples/distributed_report.py          # starts torchrun itself
    torchrun --standalone --nproc_per_node=2 docs/examples/distributed_report.py

On GPUs each rank trains on its own device over NCCL (``NCCL_NVLS_ENABLE=0`` keeps NVLink
multicast off), one rank per GPU, two at most; ``--no-set-device`` leaves
``torch.cuda.set_device`` out, as many scripts do. On a machine without a GPU two ranks talk
over gloo, and a stand-in allocator that counts the process's live CPU tensors plays the GPU,
so the report has something to show. Either way the last rank keeps every step's output in a
list: it grows, and the report names it.
"""

import contextlib
import os
import subprocess
import sys
import warnings

import torch
import torch.distributed as dist

import cudamem
import cudamem.distributed
from cudamem.allocator import backend as _backend
from cudamem.allocator import backend_base as _backend_base
from cudamem.allocator.stats import AllocatorStats
from cudamem.holders.census import live_storage_keys

warnings.simplefilter("ignore", cudamem.LeakWarning)  # the report carries the finding


class CpuTensorsAsGpu(_backend_base.Backend):
    """Stand-in for the CUDA allocator on a CPU-only machine: "cuda:0" is the bytes of this
    process's live CPU tensors (the census), read at every span edge."""

    def __init__(self) -> None:
        self.peak = 0

    def device_count(self) -> int:
        return 1

    def initialized_devices(self) -> tuple[int, ...]:
        return (0,)

    def has_context(self, device: int) -> bool:
        return device == 0

    def storage_device_type(self) -> str:
        return "cpu"

    def read(self, device: int) -> AllocatorStats:
        now = sum(live_storage_keys("cpu").values())
        self.peak = max(self.peak, now)
        return AllocatorStats(device, now, now, now, now, self.peak, self.peak, 0, 0, 0, 0, 0, 0, 0)

    def synchronize(self, device: int) -> None:
        pass

    def reset_peak(self, device: int) -> None:
        self.peak = sum(live_storage_keys("cpu").values())


def launch() -> int:
    """Not started by torchrun: start it, one rank per GPU (two ranks on a CPU)."""
    gpus = torch.cuda.device_count()
    ranks = 2 if gpus == 0 else min(gpus, 2)
    env = dict(os.environ, OMP_NUM_THREADS="1", NCCL_NVLS_ENABLE="0")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    cmd += [f"--nproc_per_node={ranks}", __file__, *sys.argv[1:]]
    return subprocess.run(cmd, env=env, check=False).returncode


def main() -> None:
    rank, local = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    last = int(os.environ["WORLD_SIZE"]) - 1
    gpu = torch.cuda.is_available()
    stand_in = contextlib.nullcontext()
    if gpu:
        device = torch.device("cuda", local)
        if "--no-set-device" not in sys.argv:
            torch.cuda.set_device(device)
        dist.init_process_group("nccl")
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
        stand_in = _backend.use(CpuTensorsAsGpu())  # see the class above

    with stand_in:
        model = torch.nn.Linear(1024, 1024).to(device)
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        outputs = []
        for _ in range(8):
            with cudamem.track("train_step"):
                x = torch.randn(256, 1024, device=device)
                out = model(x)
                loss = out.square().mean()
                opt.zero_grad()
                loss.backward()
                if gpu:
                    for p in model.parameters():
                        dist.all_reduce(p.grad)
                opt.step()
                if rank == last and last > 0:
                    outputs.append(out.detach())  # the last rank keeps 1 MiB a step
            del x, out, loss

        report = cudamem.distributed.gather_report(timeout=60)
        if report is not None:  # only rank 0 gets it
            print(report)
    dist.destroy_process_group()


if __name__ == "__main__":
    if "RANK" not in os.environ:
        sys.exit(launch())
    main()

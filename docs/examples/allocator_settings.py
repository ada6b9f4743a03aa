"""The nvidia-smi guide's allocator-settings sections (docs/guide/nvidia-smi.md) on a GPU.

    python docs/examples/allocator_settings.py            # every scenario, each in a fresh process
    python docs/examples/allocator_settings.py graph      # one of: expandable graph compile
                                                          #   record_stream cublas context

Each scenario runs in a fresh process: the allocator reads PYTORCH_CUDA_ALLOC_CONF when CUDA
initialises (the expandable scenario sets it for its own process), and the context scenario
must start with no CUDA context at all.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import torch

import cudamem

MiB = 1024**2


def expandable() -> None:
    # Three 286 MiB tensors, the middle one deleted (the allocator maps 20 MiB pages).
    t = [torch.empty(286 * MiB, dtype=torch.uint8, device="cuda") for _ in range(3)]
    del t[1]
    print(cudamem.explain())
    print(cudamem.release())
    print(cudamem.release())  # nothing left to free: it says what stays mapped, and why


def graph() -> None:
    x = torch.randn(4096, 4096, device="cuda")  # 64 MiB
    w = torch.randn(4096, 4096, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        y = x @ w  # warm-up outside the graph
    torch.cuda.current_stream().wait_stream(side)
    del y
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = x @ w  # the 64 MiB output lives in the graph's private pool
    g.replay()
    torch.cuda.synchronize()
    print(cudamem.explain())
    from cudamem.allocator.cache_split import graph_pool_blocks

    block = graph_pool_blocks(0).pool_of(y.data_ptr())
    print(f"y lives in pool {None if block is None else block.pool_id}")
    del g, y
    print(cudamem.release())


def reduce_overhead() -> None:
    @torch.compile(mode="reduce-overhead")
    def f(x: torch.Tensor) -> torch.Tensor:
        return (x * 2 + 1).relu()

    x = torch.randn(4096, 4096, device="cuda")
    for _ in range(4):
        y = f(x)
    torch.cuda.synchronize()
    print(cudamem.explain())
    del y


def record_stream() -> None:
    side = torch.cuda.Stream()
    x = torch.empty(32 * MiB, dtype=torch.uint8, device="cuda")
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(10_000_000_000)  # keep the side stream busy for a few seconds
        x.add_(1)
    x.record_stream(side)
    del x  # freed, but not reusable until the side stream's work is done
    print(cudamem.explain())
    torch.cuda.synchronize()


def cublas() -> None:
    a = torch.randn(1024, 1024, device="cuda")
    for _ in range(3):  # a new stream per run: one cuBLAS workspace each
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            b = a @ a
        torch.cuda.current_stream().wait_stream(s)
        del b, s
    torch.cuda.synchronize()
    print(cudamem.explain())
    print(cudamem.release())


def context() -> None:
    # A thread starts on device 0; a synchronize() there creates a context and allocates
    # nothing.
    t = threading.Thread(target=torch.cuda.synchronize)
    t.start()
    t.join()
    print(cudamem.explain())


SCENARIOS = {
    "expandable": expandable,
    "graph": graph,
    "compile": reduce_overhead,
    "record_stream": record_stream,
    "cublas": cublas,
    "context": context,
}


CHILD = "CUDAMEM_EXAMPLE_SCENARIO"


def main() -> int:
    if not torch.cuda.is_available():
        sys.exit("allocator_settings.py: this example needs a CUDA GPU")
    if os.environ.get(CHILD) in SCENARIOS:
        SCENARIOS[os.environ[CHILD]]()
        return 0
    names = sys.argv[1:] or list(SCENARIOS)
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown:
        print(f"unknown scenario(s) {unknown}; choose from {sorted(SCENARIOS)}")
        return 2
    for name in names:
        env = {**os.environ, CHILD: name}
        if name == "expandable":
            env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
        if len(names) > 1:  # a section of docs/output/allocator_settings-gpu.txt
            print(f"=== {name} ===", flush=True)
        done = subprocess.run([sys.executable, __file__], env=env, check=False)
        if done.returncode:
            return done.returncode
    return 0


if __name__ == "__main__":
    sys.exit(main())

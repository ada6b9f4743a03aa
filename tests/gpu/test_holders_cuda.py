"""Seed 000's cases on a GPU (H200): who holds the memory, to the byte and path."""

from __future__ import annotations

import gc

import pytest
import torch

import cudamem
from cudamem.holders import census

pytestmark = pytest.mark.cuda

M = __name__
MiB = 1024**2


def _allocated() -> int:
    torch.cuda.synchronize()
    return int(torch.cuda.memory_allocated())


def test_seed_000_list_holds_256_mib_after_del() -> None:
    global saved
    x = torch.ones((8192, 8192), device="cuda", dtype=torch.float32)
    saved = [x]
    del x
    gc.collect()
    try:
        result = cudamem.who_holds(saved[0])
        assert result.paths == [f"{M}.saved[0]"]
        h = result[0]
        assert (h.nbytes, h.device, h.via, h.root_kind) == (256 * MiB, "cuda:0", "itself", "global")
    finally:
        globals().pop("saved", None)


def test_seed_000_loss_history_40_mib_through_autograd() -> None:
    global loss_history
    x = torch.randn(1024, 1024, device="cuda", requires_grad=True)
    loss_history = []
    before = _allocated()
    base = census.live_refs("cuda")
    for _ in range(10):
        loss = torch.sigmoid(x * 2).mean()
        loss_history.append(loss)
        del loss
    try:
        grown = _allocated() - before
        assert 40 * MiB <= grown < 41 * MiB  # 10 sigmoid outputs of 4 MiB, plus 10 scalars
        c = cudamem.live_tensors("cuda:0", holders=True)
        new = census.live_refs("cuda").new_since(base)  # not what earlier tests left on the GPU
        outputs = [
            s
            for s in c
            if s.ref in new and s.nbytes == 4 * MiB and s.saved_by_autograd and s.tensors == 0
        ]
        assert len(outputs) == 10
        paths = sorted(s.holders.paths[0] for s in outputs if s.holders is not None)
        assert paths == sorted(
            f"{M}.loss_history[{i}] → grad_fn MeanBackward0 → SigmoidBackward0 saved result"
            for i in range(10)
        )
        assert sum(s.nbytes for s in outputs) == 40 * MiB
        u = cudamem.unaccounted(0)
        assert u.autograd >= 40 * MiB
    finally:
        globals().pop("loss_history", None)


def test_seed_000_detach_keeps_40_mib() -> None:
    global outputs
    x = torch.randn(1024, 1024, device="cuda", requires_grad=True)
    outputs = []
    before = _allocated()
    for _ in range(10):
        output = torch.sigmoid(x * 2)
        outputs.append(output.detach())
        del output
    try:
        assert _allocated() - before == 40 * MiB
        for i in range(10):
            result = cudamem.who_holds(outputs[i])
            assert [h.path for h in result if not h.caller] == [f"{M}.outputs[{i}]"]
            assert result.nbytes == 4 * MiB and result.device == "cuda:0"
        # .detach().cpu() gives the GPU memory back
        outputs[:] = [o.cpu() for o in outputs]
        assert _allocated() == before
    finally:
        globals().pop("outputs", None)


def test_unaccounted_names_the_cublas_workspace() -> None:
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    assert callable(clear)
    torch.cuda.synchronize()
    clear()
    a = torch.randn(1024, 1024, device="cuda")
    b = torch.randn(1024, 1024, device="cuda")
    c = a @ b
    torch.cuda.synchronize()
    u = cudamem.unaccounted(0)
    assert u.method == "snapshot"
    assert u.cublas_workspaces == 32 * MiB and u.workspace_count == 1  # H200: 32 MiB
    assert u.python >= 12 * MiB
    assert u.python + u.autograd + u.cublas_workspaces + u.unknown == u.allocated
    assert "cuBLAS workspaces (1)" in str(u)
    del a, b, c

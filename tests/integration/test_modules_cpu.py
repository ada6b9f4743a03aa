"""The per-module profile on real CPU tensors (live CPU storages as the allocator: a heap
scan per read): checkpointing, autocast, PyTorch's MemTracker as the anchor, ``cudamem run
--modules`` and the demo's seed 000 module."""

from __future__ import annotations

import gc
import json
from typing import Any

import pytest
import torch
from torch import nn

import cudamem
from cudamem.allocator import backend as _backend
from cudamem.integrations._cpu import CpuStorageBackend
from cudamem.render.json import to_json


def test_checkpointing_moves_kept_memory_into_the_backward_on_cpu_tensors() -> None:
    """Real CPU storages as the allocator: the block's activations are kept without
    checkpointing, re-made in the backward with it."""
    from torch.utils.checkpoint import checkpoint

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.up = nn.Linear(64, 256)
            self.down = nn.Linear(256, 64)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.down(torch.relu(self.up(x)))  # type: ignore[no-any-return]

    class Net(nn.Module):
        def __init__(self, ckpt: bool) -> None:
            super().__init__()
            self.block = Block()
            self.ckpt = ckpt

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if self.ckpt:
                return checkpoint(self.block, x, use_reentrant=False)  # type: ignore[no-any-return]
            return self.block(x)  # type: ignore[no-any-return]

    x = torch.randn(128, 64, requires_grad=True)
    rows = {}
    # The counters are every live CPU storage: garbage an earlier test in this worker left
    # (cycles holding tensors) must not be collected in the middle of the measurement.
    gc.collect()
    gc.disable()
    try:
        with _backend.use(CpuStorageBackend()):
            for ckpt in (False, True):
                net = Net(ckpt)
                with cudamem.track_modules(net) as prof:
                    net(x).sum().backward()
                rows[ckpt] = prof.profile.module("Net.block")
    finally:
        gc.enable()
    plain, ckpt = rows[False], rows[True]
    activation = 128 * 256 * 4  # relu's output, which down saves (up's is freed)
    output = 128 * 64 * 4
    assert plain.kept.max == activation + output
    assert (plain.recomputes.max, plain.recomputed.max) == (0, 0)
    assert ckpt.kept.max < activation  # only the block's output
    assert ckpt.recomputes.max == 1
    assert ckpt.recomputed.max >= activation
    assert ckpt.backward_calls.max == 1


def test_reentrant_checkpointing_recomputes_inside_the_backward() -> None:
    from torch.utils.checkpoint import checkpoint

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.block = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 8))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return checkpoint(self.block, x, use_reentrant=True)  # type: ignore[no-any-return]

    net = Net()
    x = torch.randn(4, 8, requires_grad=True)
    with _backend.use(CpuStorageBackend()), cudamem.track_modules(net) as prof:
        net(x).sum().backward()
    block = prof.profile.module("Net.block")
    assert (block.calls.max, block.recomputes.max) == (1, 1)
    assert block.recomputed.max >= 4 * 32 * 4  # the hidden activation, re-made in backward
    assert prof.profile.module("Net.block.0").recomputes.max == 1
    assert "1+1r" in str(prof.profile)


def test_autocast_on_cpu_is_profiled() -> None:
    model = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16))
    x = torch.randn(8, 16)
    with _backend.use(CpuStorageBackend()), cudamem.track_modules(model) as prof:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(x)
        out.float().sum().backward()
    first = prof.profile.module("Sequential.0")
    # its bf16 output (8*64*2) and the bf16 input it saved (8*16*2): half of fp32's
    assert first.kept.max == 8 * 64 * 2 + 8 * 16 * 2
    assert first.backward_calls.max == 1


def test_cudamem_run_modules_names_the_top_modules(tmp_path: Any) -> None:
    from cudamem.render.html import render_html
    from cudamem.run.runner import run_script

    script = tmp_path / "train_mlp.py"
    script.write_text(
        "import torch\n"
        "from torch import nn\n"
        "model = nn.Sequential(nn.Linear(64, 512), nn.Tanh(), nn.Linear(512, 8))\n"
        "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "for _ in range(2):\n"
        "    model(torch.randn(32, 64)).sum().backward()\n"
        "    opt.step()\n"
        "    opt.zero_grad()\n"
    )
    with _backend.use(CpuStorageBackend()):
        report = run_script(str(script), modules=True, top=0, ledger=False)
    assert report.exit_code == 0
    p = report.modules
    assert p.steps == 2
    # Tanh keeps its 32x512 float output (its backward needs it), as Linear 0 keeps its own.
    assert p.module("Sequential.1").self_kept.max == 32 * 512 * 4
    text = str(report)
    assert "top modules by activations kept by their own code (mean per step, 2 steps):" in text
    assert "Sequential.1" in text and "64.0 KiB" in text
    assert "<h2>Memory per module</h2>" in render_html(report)
    data = json.loads(to_json(report, kind="cudamem.run"))
    assert data["modules"]["steps"] == 2
    assert {m["name"] for m in data["modules"]["modules"]} >= {"Sequential.0", "Sequential.1"}
    with pytest.raises(TypeError, match="modules must be a bool"):
        run_script(str(script), modules=1)  # type: ignore[arg-type]


def test_the_demo_names_seed_000s_activation_module() -> None:
    from cudamem.demo.seed000 import seed000_modules

    exp = seed000_modules()
    assert exp.passed, exp.checks
    assert exp.rows[1][:3] == ("Seed000.activation", "10", "40.0 MiB")

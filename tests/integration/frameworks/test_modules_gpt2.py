"""The per-module profile against PyTorch's MemTracker on a GPT-2 made of CPU tensors.

In a process of its own (``tests/integration/test_frameworks.py``): transformers doubles the
heap every later census and holder search of the other tests walks."""

from __future__ import annotations

from typing import Any

import torch

import cudamem
from cudamem.allocator import backend as _backend
from cudamem.integrations._cpu import CpuStorageBackend

from ... import extras

transformers = extras.need("transformers")


def _tiny_gpt2() -> Any:
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=256, n_positions=32, attn_pdrop=0.0
    )
    return transformers.GPT2LMHeadModel(config)


def test_kept_agrees_with_memtracker_on_cpu_tensors() -> None:
    """The anchor on CPU: with live CPU storages as the allocator, each module's kept bytes
    are MemTracker's for the same step (no allocator rounding on the CPU: exactly)."""
    from ...memtracker import compare, memtracker_kept

    model = _tiny_gpt2()
    opt = torch.optim.AdamW(model.parameters())
    ids = torch.randint(0, 256, (2, 16))

    def step() -> None:
        model(ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()

    step()  # the optimizer state exists before either measures
    with _backend.use(CpuStorageBackend()), cudamem.track_modules(model, optimizer=opt) as prof:
        step()
    theirs = memtracker_kept(model, [opt, ids], step, "cpu")
    ours = {r.name: r.kept.max for r in prof.profile.modules}
    assert ours["GPT2LMHeadModel.lm_head"] == theirs["GPT2LMHeadModel.lm_head"] > 0
    assert compare(ours, theirs, floor=1) == []
    p = prof.profile
    block = p.module("GPT2LMHeadModel.transformer.h.0")
    assert block.backward_calls.max == 1
    # transformer.h (a ModuleList) never runs itself: the blocks hang under transformer.
    assert (block.parent, block.depth) == ("GPT2LMHeadModel.transformer", 2)
    for row in p.modules:  # each module's kept is its own code's plus its children's
        children = [c for c in p.modules if c.parent == row.name]
        assert row.kept.max == row.self_kept.max + sum(c.kept.max for c in children), row.name

"""The per-module profile on a GPU, against PyTorch's ``MemTracker`` and plain spans: a GPT-2
built from a transformers config (no download) and a torchvision ResNet-18; activation
checkpointing, autocast with GradScaler and torch.compile."""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch import nn

import cudamem
from cudamem.modules.profiler import COMPILED_NOTE

from .. import extras
from ..memtracker import compare, memtracker_kept

pytestmark = pytest.mark.cuda

MiB = 1 << 20
#: The caching allocator rounds every block to 512 bytes, as MemTracker does, but a large
#: block is split only when more than 1 MiB would remain: a large tensor may hold up to
#: 1 MiB more than it asked for, and the allocator's counters (which cudamem reads) count
#: the block while MemTracker counts the request. The shapes below keep every large
#: activation a multiple of 2 MiB, and each measured step starts from an empty cache, so
#: that blocks split exactly; the slack stays as a bound.
SPLIT_SLACK = MiB
BATCH, SEQ, VOCAB = 8, 256, 4096


@pytest.fixture(autouse=True)
def _no_automatic_gc() -> Iterator[None]:
    """Python's cyclic gc may free an unrelated tensor (a cycle left by an earlier step) in
    the middle of any module's forward, which the allocator's counters would rightly show
    there. The steps below collect first, at their start, and nothing collects inside."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def _gpt2(n_embd: int = 256, **kw: Any) -> Any:
    transformers = extras.need("transformers")
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=2, n_embd=n_embd, n_head=n_embd // 64, vocab_size=VOCAB, n_positions=SEQ, **kw
    )
    return transformers.GPT2LMHeadModel(config).cuda()


def _gpt2_step(model: Any, opt: Any, *, amp: Any = None) -> Callable[[], None]:
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), device="cuda")

    def step() -> None:
        gc.collect()
        torch.cuda.empty_cache()  # fresh segments: blocks split exactly (see SPLIT_SLACK)
        if amp is None:
            model(ids, labels=ids).loss.backward()
            opt.step()
        else:
            with torch.autocast("cuda", dtype=torch.float16):
                loss = model(ids, labels=ids).loss
            amp.scale(loss).backward()
            amp.step(opt)
            amp.update()
        opt.zero_grad()

    return step


def _kept(profile: Any) -> dict[str, float]:
    return {r.name: r.kept.max for r in profile.modules}


def test_gpt2_kept_agrees_with_memtracker() -> None:
    model = _gpt2()
    opt = torch.optim.AdamW(model.parameters())
    step = _gpt2_step(model, opt)
    step()  # warm: optimizer state, cuBLAS workspaces
    with cudamem.track_modules(model, optimizer=opt) as prof:
        step()
    theirs = memtracker_kept(model, [opt], step, "cuda")
    p = prof.profile
    assert p.unmeasured is None and p.steps == 1
    lm_head = p.module("GPT2LMHeadModel.lm_head")
    assert lm_head.kept.max >= BATCH * SEQ * VOCAB * 4  # the fp32 logits
    assert compare(_kept(p), theirs, floor=64 * 1024, slack=SPLIT_SLACK) == []
    # Parameters: the tied embedding counts once, at transformer.wte.
    root = p.module("GPT2LMHeadModel")
    nbytes = sum(t.nbytes for t in model.parameters())
    assert root.params == nbytes and lm_head.params == 0
    assert root.grads == nbytes
    assert root.optimizer >= 2 * nbytes
    assert p.module("GPT2LMHeadModel.transformer.h.0").backward_calls.max == 1


def test_the_modules_add_up_to_the_steps_spans() -> None:
    model = _gpt2()
    opt = torch.optim.AdamW(model.parameters())
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), device="cuda")
    _gpt2_step(model, opt)()
    gc.collect()
    with cudamem.track_modules(model) as prof:
        with cudamem.track("forward") as fwd:
            out = model(ids, labels=ids)  # kept: dropping it would free the logits
        loss = out.loss
        with cudamem.track("backward") as bwd:
            loss.backward()
    p = prof.profile
    root = p.module("GPT2LMHeadModel")
    assert root.kept.max == fwd.allocated_delta
    assert root.forward_peak.max == fwd.peak_delta
    # Each module's kept is its own code's plus its children's, exactly.
    for row in p.modules:
        children = [c for c in p.modules if c.parent == row.name]
        assert row.kept.max == row.self_kept.max + sum(c.kept.max for c in children), row.name
    # The root's backward runs from the logits' gradient to the end of the backward pass.
    assert abs(root.backward_delta.max - bwd.allocated_delta) <= MiB
    assert root.backward_peak.max <= (bwd.peak_delta or 0) + MiB


def test_cpp_gates_agree_with_python_gates(monkeypatch: pytest.MonkeyPatch) -> None:
    """The figures through the C++ log (the forward's edges marked, the gates in C++, no
    Python in the backward, one replay) are those of a span per call and Python gates,
    module by module, forward and backward."""
    from cudamem.allocator import backend as _backend

    model = _gpt2()
    opt = torch.optim.AdamW(model.parameters())
    step = _gpt2_step(model, opt)
    step()
    backend = _backend.get()
    assert _backend.reader_status().active and backend.gates is not None
    figures = {}
    for native in (True, False):
        if not native:
            monkeypatch.setattr(backend, "gates", None)
        with cudamem.track_modules(model) as prof:
            for _ in range(2):
                step()
                assert (prof._native is not None) is native
        figures[native] = {
            r.name: (
                r.calls.max,
                r.backward_calls.max,
                r.kept.max,
                r.forward_peak.max,
                r.backward_delta.max,
                r.backward_peak.max,
            )
            for r in prof.profile.modules
        }
    assert figures[True].keys() == figures[False].keys()
    for name, (calls, bcalls, *sizes) in figures[True].items():
        py_calls, py_bcalls, *py_sizes = figures[False][name]
        assert (calls, bcalls) == (py_calls, py_bcalls), name
        for size, py_size in zip(sizes, py_sizes, strict=True):
            assert abs(size - py_size) <= SPLIT_SLACK, name
    root = figures[True]["GPT2LMHeadModel"]
    assert root[:2] == (1, 1)
    assert root[2] > 0 and root[3] >= root[2] and root[5] > 0


def _recomputed(profile: Any, name: str) -> float:
    """Bytes re-made in the backward by ``name``'s forward: its own row's when its hooks ran
    again (an older transformers checkpoints the block's ``__call__``), else its children's
    (transformers >= 4.5x checkpoints ``forward``, leaving the block's own hooks outside)."""
    row = profile.module(name)
    children = [c for c in profile.modules if c.parent == name]
    return max(row.recomputed.max, sum(c.recomputed.max for c in children))


@pytest.mark.parametrize("reentrant", [False, True])
def test_checkpointing_moves_memory_from_forward_to_backward(reentrant: bool) -> None:
    profiles = {}
    block = "GPT2LMHeadModel.transformer.h.0"
    for ckpt in (False, True):
        model = _gpt2()
        if ckpt:
            model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": reentrant}
            )
        opt = torch.optim.AdamW(model.parameters())
        step = _gpt2_step(model, opt)
        step()
        with cudamem.track_modules(model) as prof:
            step()
        profiles[ckpt] = prof.profile
    plain, ckpt = profiles[False].module(block), profiles[True].module(block)
    assert plain.recomputes.max == 0 and _recomputed(profiles[False], block) == 0
    assert ckpt.kept.max < 0.5 * plain.kept.max  # the block keeps little in forward ...
    # ... and re-makes it in the backward (the MLP's activations at least).
    assert _recomputed(profiles[True], block) >= 0.3 * plain.kept.max
    assert profiles[True].module(block + ".mlp.c_fc").recomputes.max == 1
    assert "1+1r" in str(profiles[True])


def test_autocast_and_gradscaler() -> None:
    model = _gpt2(n_embd=1024)  # fp16 activations and weight copies: multiples of 2 MiB
    opt = torch.optim.AdamW(model.parameters())
    scaler = torch.amp.GradScaler("cuda")
    step = _gpt2_step(model, opt, amp=scaler)
    step()
    step()
    with cudamem.track_modules(model, optimizer=opt) as prof:
        step()
        prof.step()
        step()
    p = prof.profile
    assert p.steps == 2
    lm_head = p.module("GPT2LMHeadModel.lm_head")
    assert lm_head.kept.max >= BATCH * SEQ * VOCAB * 2  # fp16 logits
    assert p.module("GPT2LMHeadModel.transformer.h.1.mlp.c_fc").backward_calls.max == 1
    theirs = memtracker_kept(model, [opt], step, "cuda")
    # Autocast's cast weights are cached for the whole autocast region: the first module
    # to use a weight keeps its fp16 copy, in both tools alike.
    assert compare(_kept(p), theirs, floor=64 * 1024, slack=SPLIT_SLACK) == []


def test_resnet18_against_memtracker() -> None:
    torchvision = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    model = torchvision.models.resnet18().cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x = torch.randn(32, 3, 224, 224, device="cuda")
    y = torch.randint(0, 1000, (32,), device="cuda")

    def step() -> None:
        gc.collect()
        torch.cuda.empty_cache()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()

    step()
    with cudamem.track_modules(model, optimizer=opt) as prof:
        step()
    theirs = memtracker_kept(model, [opt, x, y], step, "cuda")
    p = prof.profile
    assert compare(_kept(p), theirs, floor=256 * 1024, slack=SPLIT_SLACK) == []
    conv1 = p.module("ResNet.conv1")
    assert conv1.kept.max >= 32 * 64 * 112 * 112 * 4
    assert p.module("ResNet.layer1.0.relu").calls.max == 2  # one ReLU, called twice
    assert p.module("ResNet.layer4").backward_calls.max == 1


def test_a_compiled_submodule_is_one_unit() -> None:
    torch._dynamo.reset()
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(512, 2048), nn.GELU(), nn.Linear(2048, 512))
    model = nn.Sequential(nn.Linear(512, 512), torch.compile(mlp), nn.Linear(512, 10)).cuda()
    x = torch.randn(256, 512, device="cuda")
    model(x).sum().backward()  # compiled here, outside the profile
    with cudamem.track_modules(model) as prof:
        model(x).sum().backward()
    p = prof.profile
    unit = p.module("Sequential.1")
    assert unit.notes == (COMPILED_NOTE,)
    assert unit.kept.max > 0 and unit.backward_calls.max == 1
    assert [r.name for r in p.modules if r.name.startswith("Sequential.1.")] == []
    assert "compiled (torch.compile)" in str(p)


def test_hooks_go_on_gpu_too_even_when_the_step_raises() -> None:
    model = _gpt2()
    block = model.transformer.h[1]

    def refuse(module: nn.Module, args: Any) -> None:
        raise ValueError("refused by the user's hook")

    block.register_forward_pre_hook(refuse)
    before = [(len(m._forward_pre_hooks), len(m._forward_hooks)) for m in model.modules()]
    ids = torch.randint(0, VOCAB, (2, SEQ // 4), device="cuda")
    prof = cudamem.track_modules(model)
    with pytest.raises(ValueError, match="refused"), prof:
        model(ids, labels=ids)
    after = [(len(m._forward_pre_hooks), len(m._forward_hooks)) for m in model.modules()]
    assert after == before and prof.hooks == 0
    p = prof.profile
    assert p.module("GPT2LMHeadModel.transformer.h.1").raised == 1
    assert p.module("GPT2LMHeadModel.transformer.h.0").calls.max == 1
    assert p.module("GPT2LMHeadModel.transformer.h.0").kept.max > 0

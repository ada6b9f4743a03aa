"""``cudamem.plan`` on a GPU: GPT-2 small @512, BERT-base @512 and ResNet-50 @224 with AdamW
(models from configs, no download), probes at 4 and 8, a check at 16 and a confirming step
at the answer; the peak predicted at ¼, ½ and ⅘ of the largest batch; the largest batch runs
at margin 0 and 0.05; a 6-layer MLP under bf16 autocast and ``GradScaler`` whose probes grow
until its per-sample bytes are resolved; the length axis on GPT-2 with eager attention;
checkpointing advice measured.

Every size comes from the device and the plan (its capacity, its free memory), never from
one card's numbers: the suite runs whole on an 80 GB H100 and a 141 GB H200 alike.

Goals (issues 34, 44): allocated within 2 %, reserved within 5 % where memory is plentiful;
the largest batch runs; checkpointing within 5 %."""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import cudamem
from cudamem.fit._runner import UNACCOUNTED_SHARE
from cudamem.fit.memory_plan import MemoryPlan
from cudamem.modules._tree_bytes import held_bytes

from ..gc_calls import counted_collections

pytestmark = pytest.mark.cuda

MiB = 1 << 20


def measure(step: Callable[..., Any], *args: int) -> tuple[int, int]:
    """Peak allocated and reserved of one plain step, from an empty cache."""
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    step(*args)
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()


def cublas_workspaces() -> int:
    """The bytes cuBLAS's workspaces hold now (freed to measure them: the next matmul makes
    them again)."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch._C._cuda_clearCublasWorkspaces()
    return before - torch.cuda.memory_allocated()


def gpt2(attn: str = "sdpa") -> tuple[torch.nn.Module, torch.optim.Optimizer, Callable[..., None]]:
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = transformers.GPT2Config(use_cache=False, n_positions=1024)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attn).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step(n: int, length: int = 512) -> None:
        ids = torch.randint(0, config.vocab_size, (n, length), device="cuda")
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return model, opt, step


def bert() -> tuple[torch.nn.Module, torch.optim.Optimizer, Callable[..., None]]:
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = transformers.BertConfig()
    model = transformers.BertForMaskedLM(config).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step(n: int) -> None:
        ids = torch.randint(0, config.vocab_size, (n, 512), device="cuda")
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return model, opt, step


def resnet50() -> tuple[torch.nn.Module, torch.optim.Optimizer, Callable[..., None]]:
    torchvision = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    model = torchvision.models.resnet50(weights=None).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step(n: int) -> None:
        x = torch.randn(n, 3, 224, 224, device="cuda")
        y = torch.randint(0, 1000, (n,), device="cuda")
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return model, opt, step


@pytest.fixture(autouse=True)
def _empty_after() -> Any:
    """Each test's models go before the next test measures."""
    yield
    gc.collect()
    torch.cuda.empty_cache()


@pytest.mark.parametrize(
    ("build", "reserved_rel"),
    # A conv net's reserved peak with memory to spare is cuDNN's choice of algorithms and
    # workspaces at each size (ResNet-50 reserved 1.9 GiB at batches 4, 8 and 16 on an H100,
    # 1.2x its allocated at 237): not a line. What limits its batch is ``required``, which
    # the confirmed batch running checks.
    [(gpt2, 0.05), (bert, 0.05), (resnet50, None)],
    ids=["gpt2-small-512", "bert-base-512", "resnet50-224"],
)
def test_five_steps_predict_the_peak_up_to_the_largest_batch(
    build: Callable[[], Any], reserved_rel: float | None
) -> None:
    model, opt, step = build()
    calls: list[int] = []

    def counted(n: int) -> None:
        calls.append(n)
        step(n)

    params = sum(p.numel() * p.element_size() for p in model.parameters())
    plan = cudamem.plan(counted, sizes=(4, 8), model=model, optimizer=opt)
    # warm-up, probes, the check, then confirming steps at the answer
    assert calls[:4] == [4, 4, 8, 16] and 5 <= len(calls) <= 10, str(plan)
    assert [p.role for p in plan.probes[4:]] == ["confirm"] * (len(calls) - 4)
    assert plan.linear is True and plan.resolved is True, str(plan)
    # What stays is the step's own: AdamW's two moments and the cuBLAS (and cuBLASLt)
    # workspaces its first matmuls made, one per handle and stream (their size depends on
    # the card), and AdamW's per-parameter step counts (GPT-2 small: 1.75 MiB beyond the two).
    assert plan.kept_after <= 2 * params + cublas_workspaces() + 4 * MiB, str(plan)
    largest = plan.largest(0.0)
    assert largest == max(p.n for p in plan.probes if not p.oom), str(plan)
    for n in (largest // 4, largest // 2):  # memory to spare: allocated and reserved
        predicted = plan.predict(n)
        allocated, reserved = measure(step, n)
        assert predicted.allocated == pytest.approx(allocated, rel=0.02), (n, str(plan))
        if reserved_rel is not None:
            assert predicted.reserved == pytest.approx(reserved, rel=reserved_rel), (n, str(plan))
    n = largest * 4 // 5  # near the limit the cache gives way: allocated only
    allocated, _ = measure(step, n)
    assert plan.predict(n).allocated == pytest.approx(allocated, rel=0.02), (n, str(plan))
    assert plan.modules, "the per-module profile names the per-sample bytes"


def test_the_largest_batch_runs_and_restore_puts_the_state_back() -> None:
    model, opt, step = gpt2()
    step(2)  # optimizer state exists before the plan
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    plan = cudamem.plan(step, model=model, optimizer=opt, restore=True)
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert plan.restore is not None and plan.restore.nbytes >= 3 * sum(
        p.numel() * 4 for p in model.parameters()
    )
    assert plan.kept_after <= 64 * MiB, str(plan)  # nothing of the probes stays
    largest = plan.largest(0.05)
    assert largest > 16
    _, reserved = measure(step, largest)  # runs: no OutOfMemoryError
    assert reserved <= torch.cuda.mem_get_info()[1]
    measure(step, plan.largest(0.0))  # the confirmed batch runs too


def mlp() -> tuple[torch.nn.Module, torch.optim.Optimizer, Callable[..., None]]:
    """6 x (Linear(4096, 4096) + GELU) under bf16 autocast with a GradScaler: at small
    batches its peak is the optimizer's step (weights, gradients, AdamW state)."""
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(6):
        layers += [torch.nn.Linear(4096, 4096), torch.nn.GELU()]
    model = torch.nn.Sequential(*layers).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    scaler = torch.amp.GradScaler("cuda")

    def step(n: int) -> None:
        x = torch.randn(n, 4096, device="cuda")
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(x).float().pow(2).mean()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)

    return model, opt, step


def test_probes_grow_until_the_per_sample_bytes_are_resolved() -> None:
    """From probes at 4 and 8 the per-sample bytes are a hundredth of a percent of the peak:
    the probes grow until they are a tenth of it, and the answer is a batch that ran."""
    model, opt, step = mlp()
    calls: list[int] = []

    def counted(n: int) -> None:
        calls.append(n)
        step(n)

    plan = cudamem.plan(counted, model=model, optimizer=opt)
    assert calls[:3] == [4, 4, 8] and calls[3] == 8 * 16, str(plan)
    assert len(calls) <= 10 and plan.resolved is True, str(plan)
    largest = plan.largest(0.0)
    assert largest in calls and largest > 1000 * 8, str(plan)
    for n in (largest, plan.largest(0.05)):
        measure(step, n)  # runs: no OutOfMemoryError
    n = largest // 2
    allocated, _ = measure(step, n)
    assert plan.predict(n).allocated == pytest.approx(allocated, rel=0.02), str(plan)


class _Cycle:
    """An object in a reference cycle holding a CUDA tensor: garbage only a full
    collection frees once it has aged to the oldest generation."""

    def __init__(self, nbytes: int) -> None:
        self.tensor = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        self.me = self


def test_the_full_collection_at_the_start_runs_only_where_garbage_could_hold_memory(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The model and AdamW account for what is allocated: the plan does not walk the heap
    before it freezes it (one full collection, after the warm-up made AdamW's state). An
    old cycle holding 1 % of the card beside them: collected before the first step, and no
    step's baseline counts it."""
    model, opt, step = mlp()
    total = torch.cuda.mem_get_info()[1]
    gc.collect()
    torch.cuda.empty_cache()
    held = held_bytes(model, (opt,), "cuda", torch.cuda.current_device())
    unaccounted = torch.cuda.memory_allocated() - held
    assert 0 <= unaccounted <= UNACCOUNTED_SHARE * total, unaccounted  # nothing else lives
    generations = counted_collections(monkeypatch)
    plan = cudamem.plan(step, sizes=(512, 1024), confirm=False, model=model, optimizer=opt)
    # young collections before the warm-up and the first probe; the full one after the
    # warm-up made AdamW's state
    assert generations[:4] == [1, 1, 1, 2] and generations.count(2) == 1, generations
    assert plan.probes[0].baseline == held + unaccounted

    garbage = (round(0.01 * total) // MiB) * MiB
    parked = [_Cycle(garbage)]
    monkeypatch.undo()
    gc.collect()  # aged to the oldest generation
    parked.clear()
    before = torch.cuda.memory_allocated()
    generations = counted_collections(monkeypatch)
    plan = cudamem.plan(step, sizes=(512, 1024), confirm=False, model=model, optimizer=opt)
    assert generations[:2] == [1, 2], generations  # the young ones, then the whole heap
    assert plan.probes[0].baseline <= before - garbage
    assert torch.cuda.memory_allocated() <= before - garbage + 64 * MiB


def test_lengths_predict_eager_attention_at_1024_from_128_and_256() -> None:
    _, _, step = gpt2(attn="eager")
    plan = cudamem.plan(step, sizes=(4, 8), lengths=(128, 256))
    assert plan.linear is True, str(plan)
    assert plan.allocated_line is not None
    assert plan.allocated_line.terms == ("1", "n*L", "n*L^2")
    predicted = plan.predict(8, 1024)
    allocated, _ = measure(step, 8, 1024)
    assert predicted.allocated == pytest.approx(allocated, rel=0.02), str(plan)
    assert plan.largest(length=1024) > 0


def _checkpoint(model: torch.nn.Module, names: tuple[str, ...]) -> None:
    """``torch.utils.checkpoint`` around the forward of each module named."""
    base = type(model).__name__
    by_name = {f"{base}.{path}" if path else base: m for path, m in model.named_modules()}
    for name in names:
        module = by_name[name]
        forward = module.forward

        def checkpointed(*args: Any, _forward: Any = forward, **kwargs: Any) -> Any:
            return torch.utils.checkpoint.checkpoint(_forward, *args, use_reentrant=False, **kwargs)

        module.forward = checkpointed  # type: ignore[method-assign]


@pytest.mark.parametrize(("build", "n"), [(gpt2, 64), (resnet50, 128)], ids=["gpt2", "resnet50"])
def test_checkpointing_advice_is_within_5_percent(build: Callable[[], Any], n: int) -> None:
    model, opt, step = build()
    plan: MemoryPlan = cudamem.plan(step, model=model, optimizer=opt)
    without = plan.predict(n)
    advice = plan.checkpointing(n, margin=0.0, memory=round(without.reserved * 0.75))
    assert advice.modules, str(advice)
    _checkpoint(model, advice.modules)
    allocated, _ = measure(step, n)
    assert advice.predicted.allocated == pytest.approx(allocated, rel=0.05), (
        str(advice),
        allocated,
    )
    assert allocated < without.allocated

"""``cudamem.plan`` through the fake allocator: the fit, the check and its refusals, OOM
probes, what stays allocated, restore, the length axis, per-module shares and checkpointing
advice, argument errors, no CUDA device, rendering. (On an H200:
``tests/gpu/test_plan_cuda.py``.)"""

from __future__ import annotations

import gc
import json
import subprocess
import sys
import weakref
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

import pytest
import torch
from torch import nn

import cudamem
from cudamem.allocator import backend as _backend
from cudamem.allocator.stats import AllocatorStats
from cudamem.base.format import format_bytes
from cudamem.fit._forwards import output_bytes
from cudamem.fit._runner import INTERPRETER_FROZEN
from cudamem.fit._terms import (
    ALLOWANCE,
    HEADROOM,
    UNCONFIRMED,
    Line,
    checkpoint_per_sample,
    largest_under,
    required,
)
from cudamem.fit.memory_plan import MemoryPlan, NotLinearError, Probe
from cudamem.fit.planner import SHAPES_CAUSE
from cudamem.modules._tree_bytes import held_bytes
from cudamem.render.json import to_json

from ..fakes import FakeAllocator
from ..gc_calls import counted_collections

MiB = 1 << 20
GiB = 1 << 30


class Device(FakeAllocator):
    """The fake allocator with a size: CUDA's free memory is what its reserved leaves, and
    a request past it raises ``torch.OutOfMemoryError`` as CUDA's allocator does: once it
    has given its cache back, what it cannot give back is ``stranded`` (a share of the
    allocated bytes). While memory is plentiful it keeps ``cached`` more reserved."""

    total = 140 * GiB
    stranded = 0.0
    cached = 0.0
    #: Bytes of the card outside the allocator (its capacity is ``total`` plus these).
    outside = 0

    def mem_get_info(self, device: int) -> tuple[int, int] | None:
        return (self.total - self.reserved[device], self.total + self.outside)

    def limit(self, n_bytes_needed: float) -> bool:
        return n_bytes_needed > self.total

    def read(self, device: int) -> AllocatorStats:
        return super().read(device)._replace(ooms=self.calls["oom"])

    def alloc(self, nbytes: int, device: int = 0) -> None:
        with self.lock:
            after = self.allocated[device] + nbytes
            if self.limit(after * (1 + self.stranded)):
                self.calls["oom"] += 1
                # the cache given back: only the stranded bytes stay reserved
                self.reserved[device] = round(self.allocated[device] * (1 + self.stranded))
                raise torch.OutOfMemoryError(
                    f"CUDA out of memory. Tried to allocate {nbytes / MiB:.2f} MiB"
                )
        super().alloc(nbytes, device)
        with self.lock:
            keep = round(self.allocated[device] * (1 + max(self.cached, self.stranded)))
            self.reserved[device] = min(self.total, max(self.reserved[device], keep))


def most(fixed: int, per_sample: int, memory: int, stranded: float = 0.0) -> int:
    """The true largest batch of ``fixed + per_sample * n`` on a device of ``memory``."""
    return int((memory / (1 + stranded) - fixed) // per_sample)


class RoundingDevice(Device):
    """Reserves 25 % more than it allocates while memory is plentiful (a conv net's cache);
    near the limit it can give all but 0.5 % of that back."""

    cached = 0.25
    stranded = 0.005


@pytest.fixture
def fake() -> Iterator[Device]:
    device = Device()
    with _backend.use(device):
        yield device


class Step:
    """A training step on the fake device: ``state`` bytes of optimizer state made by the
    first call and kept, then ``peak(n)`` bytes of activations held at once and freed."""

    def __init__(self, fake: FakeAllocator, peak: Callable[..., int], state: int = 300 * MiB):
        self.fake, self.peak, self.state = fake, peak, state
        self.calls: list[tuple[int, ...]] = []

    def __call__(self, *args: int) -> None:
        self.calls.append(args)
        if len(self.calls) == 1:
            self.fake.alloc(self.state)
        nbytes = self.peak(*args)
        self.fake.alloc(nbytes)
        self.fake.free(nbytes)


def linear(n: int) -> int:
    return 1000 * MiB + 50 * MiB * n


class _Held:
    """A cycle that frees its fake bytes when the collector breaks it."""

    def __init__(self, fake: FakeAllocator, nbytes: int) -> None:
        self.fake, self.nbytes, self.me = fake, nbytes, self
        fake.alloc(nbytes)

    def __del__(self) -> None:
        self.fake.free(self.nbytes)


def _old_garbage(fake: FakeAllocator, nbytes: int) -> None:
    """``nbytes`` allocated on ``fake`` by a cycle aged to the oldest generation, then
    dropped: garbage only a full collection frees."""
    parked = [_Held(fake, nbytes)]
    gc.collect()
    parked.clear()


def test_a_clean_step_costs_one_full_collection_per_level(
    fake: Device, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A full collection walks the whole heap (100-200 ms with transformers imported): the
    # plan runs one before the first step and one after it (its optimizer state raised the
    # level), and only the young generations around the other steps.
    generations = counted_collections(monkeypatch)
    plan = cudamem.plan(Step(fake, linear))
    assert len(plan.probes) == 5
    assert generations.count(2) == 2
    assert generations.count(1) == len(plan.probes) + 2  # before each step, first and last


def test_bytes_left_in_an_old_cycle_are_collected_before_the_next_step(
    fake: Device, monkeypatch: pytest.MonkeyPatch
) -> None:
    generations = counted_collections(monkeypatch)
    step = Step(fake, linear)
    parked: list[_Held] = []

    def leaves_a_cycle(n: int) -> None:
        step(n)
        if len(step.calls) == 3:  # the probe at 8 leaves 700 MiB in a cycle aged to gen 2
            parked.append(_Held(fake, 700 * MiB))
            gc.collect()
            parked.clear()

    plan = cudamem.plan(leaves_a_cycle)
    # the check at 16 started where the probes did: the cycle was collected before it
    assert [p.baseline for p in plan.probes[1:]] == [plan.probes[1].baseline] * 4
    assert fake.allocated[0] == plan.probes[1].baseline
    assert plan.per_sample() == 50 * MiB and plan.fixed == 1300 * MiB
    assert generations.count(2) == 4  # the start, the warm-up's state, the step's own, the cycle


def test_the_heap_found_is_frozen_while_the_steps_run_and_handed_back_after(fake: Device) -> None:
    # Full collections inside the plan walk only what the steps made: the objects alive
    # when it began sit in the permanent generation until it ends.
    step = Step(fake, linear)
    frozen: list[int] = []

    def watched(n: int) -> None:
        frozen.append(gc.get_freeze_count())
        step(n)

    before = len(gc.get_objects())
    cudamem.plan(watched)
    assert len(frozen) == 5 and min(frozen) >= before // 2
    assert gc.get_freeze_count() == 0


def test_the_heap_is_handed_back_when_a_step_raises(fake: Device) -> None:
    def broken(n: int) -> None:
        raise ValueError(f"bad batch {n}")

    with pytest.raises(ValueError, match="bad batch 4"):
        cudamem.plan(broken)
    assert gc.get_freeze_count() == 0


def test_a_heap_frozen_by_someone_else_stays_as_they_left_it(fake: Device) -> None:
    gc.freeze()
    try:
        theirs = gc.get_freeze_count()
        seen: list[int] = []
        step = Step(fake, linear)

        def watched(n: int) -> None:
            seen.append(gc.get_freeze_count())
            step(n)

        cudamem.plan(watched)
        # none frozen by the plan, none handed back (a few of theirs may die meanwhile)
        assert all(theirs // 2 < count <= theirs for count in seen)
        assert theirs // 2 < gc.get_freeze_count() <= theirs
    finally:
        gc.unfreeze()


def test_the_interpreters_own_frozen_objects_do_not_stop_the_freeze(
    fake: Device, monkeypatch: pytest.MonkeyPatch
) -> None:
    # CPython 3.12 keeps its immortal objects in the permanent generation (375 at the start
    # of 3.12.3): not someone's freeze, so the plan freezes the heap all the same
    real = gc.get_freeze_count
    monkeypatch.setattr(gc, "get_freeze_count", lambda: real() + 375)
    step = Step(fake, linear)
    tracked: list[int] = []

    def watched(n: int) -> None:
        tracked.append(len(gc.get_objects()))
        step(n)

    before = len(gc.get_objects())
    cudamem.plan(watched)
    assert len(tracked) == 5 and max(tracked) < before // 2
    assert real() == 0


@pytest.mark.parametrize("freeze", [False, True])
def test_a_freeze_is_told_from_the_interpreters_own_by_its_size(freeze: bool) -> None:
    # this interpreter, bare: what it freezes on its own (0 before 3.12, its immortal
    # objects since) stays under the bound, and a freeze of even its smallest heap exceeds it
    code = "import gc; gc.freeze(); " if freeze else "import gc; "
    out = subprocess.run(
        [sys.executable, "-I", "-S", "-c", code + "print(gc.get_freeze_count())"],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    frozen = int(out.stdout)
    assert (frozen > INTERPRETER_FROZEN) is freeze, frozen


def test_garbage_from_before_the_plan_is_collected_before_the_freeze(fake: Device) -> None:
    # an old cycle holding 700 MiB when the plan starts: collected by the first, full,
    # collection, not frozen with the heap (it would stand in every step's fixed part)
    _old_garbage(fake, 700 * MiB)
    assert fake.allocated[0] == 700 * MiB
    plan = cudamem.plan(Step(fake, linear))
    assert plan.probes[0].baseline == 0
    assert plan.fixed == 1300 * MiB and plan.per_sample() == 50 * MiB


class HostDevice(Device):
    """The fake device whose storages are the host's: a CPU model's tensors are on it."""

    storages = "cpu"


def _model_on(device: Device) -> tuple[nn.Module, torch.optim.Optimizer, int]:
    """A model and its AdamW, their bytes allocated on the fake ``device`` as well."""
    model = nn.Sequential(nn.Linear(64, 64), nn.LayerNorm(64))
    optimizer = torch.optim.AdamW(model.parameters())
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    device.alloc(nbytes)
    return model, optimizer, nbytes


@pytest.mark.parametrize(
    ("live", "garbage", "full", "kept"),
    [
        (0, 0, 1, 0),
        (10 * MiB, 0, 1, 10 * MiB),  # a batch, cuBLAS's workspace
        (0, 100 * MiB, 1, 100 * MiB),  # under 0.5 % of the card: waits for the plan's end
        (0, 2 * GiB, 2, 0),  # past it: collected before the first step
    ],
    ids=["nothing", "live 10 MiB", "garbage 100 MiB", "garbage 2 GiB"],
)
def test_the_full_collection_at_the_start_runs_where_the_model_leaves_bytes_unexplained(
    live: int, garbage: int, full: int, kept: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Beside the model's and the optimizer's tensors the 140 GiB card holds ``live`` bytes
    # and ``garbage`` in an old cycle. Where they stay under 0.5 % of the card (717 MiB) no
    # garbage could hold more, and the plan does not walk the whole heap before it freezes
    # it (one full collection remains: after the warm-up made the optimizer state); garbage
    # under that stands in the fixed part and is collected after the plan.
    device = HostDevice()
    with _backend.use(device):
        model, optimizer, nbytes = _model_on(device)
        device.alloc(live)
        _old_garbage(device, garbage)
        generations = counted_collections(monkeypatch)
        plan = cudamem.plan(Step(device, linear), model=model, optimizer=optimizer)
        assert generations.count(2) == full
        assert plan.probes[0].baseline == nbytes + kept
        assert plan.fixed == nbytes + kept + 1300 * MiB and plan.per_sample() == 50 * MiB
        gc.collect()
        assert device.allocated[0] == nbytes + live + 300 * MiB  # the model and its state


def test_the_bytes_a_model_and_optimizer_hold_count_each_storage_once_on_its_device() -> None:
    torch.manual_seed(0)
    embed = nn.Embedding(16, 8)
    head = nn.Linear(8, 16, bias=False)
    head.weight = embed.weight  # tied: one storage
    model = nn.Sequential(embed, nn.BatchNorm1d(8), head)
    optimizer = torch.optim.AdamW(model.parameters(), foreach=False)
    floats = 4
    params = (16 * 8 + 8 + 8) * floats
    buffers = (8 + 8) * floats + 8  # running mean and var, num_batches_tracked (int64)
    assert held_bytes(model, (), "cpu", 0) == params + buffers
    assert held_bytes(model, (optimizer,), "cpu", 0) == params + buffers
    model(torch.arange(4)).sum().backward()
    optimizer.step()
    steps = 3 * floats  # AdamW's step count, one 0-d tensor a parameter
    expected = params + buffers + params + 2 * params + steps  # grads, two moments
    assert held_bytes(model, (optimizer,), "cpu", 0) == expected
    assert held_bytes(None, (optimizer,), "cpu", 0) == expected - buffers
    assert held_bytes(model, (optimizer,), "cuda", 0) == 0
    assert held_bytes(model, (optimizer,), "cpu", 1) == 0


def test_a_modules_output_bytes_count_each_storage_once_in_containers_five_deep() -> None:
    x = torch.zeros(256)  # 1 KiB
    y = torch.zeros(64, dtype=torch.float64)  # 512 B
    view = x[10:20]  # x's storage: counted with x, once
    assert output_bytes(x, set()) == 1024
    assert output_bytes((x, view, x.view(16, 16)), set()) == 1024
    assert output_bytes({"logits": x, "extra": [y, (view, "text", None)]}, set()) == 1536
    seen: set[tuple[str, int]] = set()
    assert output_bytes(x, seen) == 1024
    assert output_bytes([x, y], seen) == 512  # x counted by the call before
    deep: Any = y
    for _ in range(5):
        deep = [deep]
    assert output_bytes(deep, set()) == 512  # y inside five lists
    assert output_bytes([deep], set()) == 0  # six: past the walk
    assert output_bytes(torch.zeros(8, device="meta"), set()) == 0  # no memory of its own
    assert output_bytes(torch.zeros(0), set()) == 0


def test_a_linear_step_is_fitted_from_four_steps_and_confirmed_by_a_fifth(fake: Device) -> None:
    fake.alloc(500 * MiB)  # the model
    step = Step(fake, linear)
    plan = cudamem.plan(step)
    # warm-up, two probes, the check, then a step at the answer for the whole device
    target = largest_under(lambda n: required(1800 * MiB + 50 * MiB * n, ALLOWANCE), Device.total)
    assert step.calls == [(4,), (4,), (8,), (16,), (target,)]
    assert [p.role for p in plan.probes] == ["warm-up", "probe", "probe", "check", "confirm"]
    assert not any(p.oom for p in plan.probes) and fake.calls["oom"] == 0
    assert plan.fixed == 1800 * MiB  # model + optimizer state + the step's own fixed part
    assert plan.per_sample() == 50 * MiB
    assert plan.fitted == ((4, None), (8, None), (16, None), (target, None))
    assert plan.resolved is True and plan.confirm is True
    assert plan.linear is True and plan.check is not None and plan.check.error == 0.0
    assert plan.predict(128).allocated == 1800 * MiB + 128 * 50 * MiB
    assert plan.predict(128).reserved == plan.predict(128).allocated
    assert not plan.predict(target + 1).measured_range and plan.predict(8).measured_range
    # The confirming step reserved what it allocated: nothing stranded, the headroom stays.
    assert plan.allowance == 0.0
    assert plan.predict(128).required == plan.predict(128).allocated + HEADROOM
    # Under 10 GiB less 10 %, 0.5 % of it in reserve (no step ran at that limit):
    # (0.9 * 0.985 * 10 GiB - 64 MiB - 1800 MiB) / 50 MiB.
    assert plan.largest(0.10, memory=10 * GiB) == int(
        (0.9 * (1 - UNCONFIRMED) * 10 * GiB - HEADROOM - 1800 * MiB) // (50 * MiB)
    )
    assert plan.largest(memory=1000 * MiB) == 0  # not even one sample
    # The whole device: the confirmed step, never past it.
    assert plan.largest(0.0) == target == plan.largest(0.0, memory=Device.total)
    truth = most(1800 * MiB, 50 * MiB, Device.total)
    assert truth * 0.98 < target < truth  # 1 % and the headroom below it
    # A larger card: the line's answer.
    assert plan.largest(0.0, memory=2 * Device.total) > 2 * target
    # Nothing of the probes stays: only the optimizer state the step keeps.
    assert plan.kept_after == 300 * MiB
    assert fake.allocated[0] == 800 * MiB
    assert fake.reserved[0] == fake.allocated[0]  # the cache was emptied


def test_largest_reads_the_memory_free_now(fake: Device) -> None:
    fake.alloc(500 * MiB)
    plan = cudamem.plan(Step(fake, linear))
    fake.alloc(2 * GiB)  # something else took memory since
    usable = Device.total - fake.reserved[0] + fake.reserved[0]  # free + this process's
    expected = int((0.95 * (1 - UNCONFIRMED) * usable - HEADROOM - 1800 * MiB) // (50 * MiB))
    assert plan.largest() == expected
    assert plan.available == Device.total  # free + reserved before the confirming step
    assert plan.largest_now == expected  # the default margin, when the plan finished
    assert plan.largest(0.0) == plan.probes[-1].n  # the whole device: the confirmed step


def test_the_small_steps_reserved_ratio_does_not_shrink_the_largest_batch() -> None:
    """A conv net's cache holds 25 % more than it allocates while memory is plentiful; at
    the limit the allocator gives it back and needs 0.5 % (ResNet-50: batch 1,398 named
    from the ratio, 1,713 ran)."""
    device = RoundingDevice()
    with _backend.use(device):
        device.alloc(500 * MiB)
        plan = cudamem.plan(Step(device, linear))
        assert plan.ratio == pytest.approx(1.25)
        prediction = plan.predict(100)
        assert prediction.reserved == round(prediction.allocated * 1.25)
        truth = most(1800 * MiB, 50 * MiB, Device.total, stranded=0.005)
        answer = plan.largest(0.0)
        assert truth * 0.97 <= answer <= truth  # within 3 % of the true largest, not over
        assert answer > Device.total / 1.25 / (50 * MiB)  # the ratio's answer: 20 % lower
        confirm = [p for p in plan.probes if p.role == "confirm"]
        assert confirm and confirm[-1].n == answer and not confirm[-1].oom
        Step(device, linear)(answer)  # a plain step at the answer runs
        assert device.calls["oom"] == 0


def quadratic(n: int) -> int:
    return 1000 * MiB + 50 * MiB * n + 2 * MiB * n * n


def test_a_step_off_the_line_is_not_extrapolated(fake: Device) -> None:
    step = Step(fake, quadratic)
    plan = cudamem.plan(step)
    # The check at 16 lands off the line: larger probes (32) and a second check (64) before
    # the refusal; no confirming step.
    assert step.calls == [(4,), (4,), (8,), (16,), (32,), (64,)]
    assert [p.role for p in plan.probes][-3:] == ["check", "probe", "check"]
    assert plan.recovered == (16,)
    assert plan.linear is False
    assert plan.check is not None and plan.check.n == 64 and plan.check.error > 0.02
    assert plan.causes[-1] == SHAPES_CAUSE
    with pytest.raises(NotLinearError, match=r"not linear in n: at batch 64 .* past batch 64"):
        plan.predict(65)
    with pytest.raises(NotLinearError, match="largest"):
        plan.largest(memory=100 * GiB)
    assert plan.predict(64).allocated > 0  # within what it measured: answered
    assert "NOT LINEAR in n" in str(plan)


def test_a_check_off_the_line_at_small_batches_leads_to_larger_probes(fake: Device) -> None:
    """Small batches pick other kernels and workspaces: 200 MiB more below batch 16. The
    check at 16 lands off the line of 4 and 8; 16 and 32 give the line, 64 checks it."""

    def peak(n: int) -> int:
        return linear(n) + (200 * MiB if n < 16 else 0)

    step = Step(fake, peak)
    plan = cudamem.plan(step)
    assert [c[0] for c in step.calls][:6] == [4, 4, 8, 16, 32, 64]
    assert plan.recovered == (16,) and plan.linear is True
    assert plan.fitted[:3] == ((16, None), (32, None), (64, None))
    assert plan.per_sample() == 50 * MiB and plan.fixed == 1300 * MiB
    assert plan.probes[-1].role == "confirm" and not plan.probes[-1].oom
    truth = most(1300 * MiB, 50 * MiB, Device.total)
    assert truth * 0.98 < plan.largest(0.0) < truth
    assert "the check at batch 16 landed off the line" in str(plan)


def test_an_unresolved_slope_grows_the_probes_until_it_is_measured(fake: Device) -> None:
    """A 6-layer MLP under AdamW: at small batches the peak is the optimizer's step (1.9 GiB
    and 16 KiB a sample), past batch ~2,500 the backward's (1.5 GiB and 180 KiB a sample).
    From probes at 4 and 8 the old plan extrapolated 16 KiB a sample to a batch that ran
    out of memory."""
    KiB = 1 << 10

    def peak(n: int) -> int:
        return max(1900 * MiB + 16 * KiB * n, 1500 * MiB + 180 * KiB * n)

    step = Step(fake, peak, state=0)
    plan = cudamem.plan(step)
    sizes = [c[0] for c in step.calls]
    assert sizes[:6] == [4, 4, 8, 128, 2048, 32768]  # grown 16x until resolved
    assert plan.resolved is True
    assert len(sizes) <= 10 and fake.calls["oom"] <= 1
    truth = (Device.total - 1500 * MiB) // (180 * KiB)
    answer = plan.largest(0.0)
    assert truth * 0.97 <= answer <= truth
    step(answer)  # runs
    assert plan.largest(0.05) < answer
    assert any(n == answer for n in sizes)  # a step ran at the answer


def test_a_confirming_step_out_of_memory_is_caught_and_the_answer_shrinks(fake: Device) -> None:
    """Near the limit the allocator cannot give back 4 % of what it allocated: the first
    confirming step (1 % allowed) runs out of memory, is recorded, the next runs 5 % lower,
    then halfway between the two until they are within ``BRACKET`` (2.5 %; here they end
    1.5 % apart)."""
    fake.stranded = 0.04
    fake.alloc(500 * MiB)
    kept: list[Any] = []
    step = Step(fake, linear)
    plan = cudamem.plan(step)
    confirms = [p for p in plan.probes if p.role == "confirm"]
    assert confirms[0].oom and confirms[0].error is not None
    assert confirms[0].oom_allocated == 800 * MiB  # the model and the optimizer state
    assert confirms[0].oom_reserved is not None
    # the request that failed, read from the message: the step's activations, in one piece
    assert confirms[0].oom_requested == pytest.approx(linear(confirms[0].n), abs=0.01 * MiB)
    row = (
        f"800.0 MiB allocated, {format_bytes(confirms[0].oom_reserved)} reserved when it failed,"
        f" asking for {format_bytes(confirms[0].oom_requested)}"
    )
    assert row in str(plan)
    assert not confirms[1].oom and confirms[1].n == int(confirms[0].n * 0.95)
    assert len(plan.probes) <= 10
    failed = min(c.n for c in confirms if c.oom)
    ran = max(c.n for c in confirms if not c.oom)
    assert plan.smallest_oom == failed and failed - ran <= 0.015 * failed
    answer = plan.largest(0.0)
    truth = most(1800 * MiB, 50 * MiB, Device.total, stranded=0.04)
    assert answer == ran and truth * 0.985 <= answer <= truth
    assert 0.03 < plan.allowance < 0.055  # the most the step that ran allows
    assert fake.allocated[0] == 800 * MiB  # nothing of the failed step stays
    assert not kept
    # The plan's OOMs are not the user's: no verdict speaks of them.
    assert fake.read(0).ooms == sum(p.oom for p in plan.probes) >= 1
    assert cudamem.fragmentation(0).verdict is None
    assert "out-of-memory" not in str(cudamem.explain(0, host=False))
    fake.calls["oom"] += 1  # one of the user's own
    assert cudamem.fragmentation(0).verdict is not None


def test_cudnn_benchmark_is_named_as_a_cause(fake: Device, monkeypatch: Any) -> None:
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", True)
    plan = cudamem.plan(Step(fake, quadratic))
    assert "cuDNN benchmark" in plan.causes[0]
    linear_plan = cudamem.plan(Step(fake, linear))
    assert linear_plan.causes == ()  # named only when the check fails


class Activations:
    """Fake activations: freed on the fake device when the object dies."""

    def __init__(self, fake: FakeAllocator, nbytes: int) -> None:
        fake.alloc(nbytes)
        self.fake, self.nbytes = fake, nbytes

    def __del__(self) -> None:
        self.fake.free(self.nbytes)


def test_a_probe_out_of_memory_is_reported_and_its_frames_freed(fake: Device) -> None:
    kept: list[Any] = []
    alive: list[weakref.ref[Activations]] = []

    def step(n: int) -> None:
        acts = Activations(fake, 100 * MiB * n)
        alive.append(weakref.ref(acts))
        if n >= 16:
            try:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
            except torch.OutOfMemoryError as exc:
                kept.append(exc.__traceback__)  # someone keeps the traceback (a logger)
                raise

    plan = cudamem.plan(step)
    check, confirm = plan.probes[-2:]
    assert (check.role, check.n, check.oom) == ("check", 16, True)
    assert check.error == "CUDA out of memory. Tried to allocate 2.00 GiB"
    # the line untested, a step below the failed size confirms what runs
    assert (confirm.role, confirm.n, confirm.oom) == ("confirm", 15, False)
    assert plan.smallest_oom == 16
    assert plan.check is None and plan.linear is None
    assert any("the check at batch 16 ran out of memory" in n for n in plan.notes)
    # The failed step's frame is cleared although its traceback lives on.
    assert kept and all(ref() is None for ref in alive)
    assert fake.allocated[0] == 0
    assert plan.largest(memory=100 * GiB) == 15  # never at or past a size that failed


@pytest.mark.usefixtures("span_path")
def test_a_probe_is_quiet_and_its_peak_covers_the_spans_inside(
    fake: Device, capsys: pytest.CaptureFixture[str]
) -> None:
    cudamem.clear_history()

    def step(n: int) -> None:
        with cudamem.track("forward"):  # resets the peak counter on entry
            fake.alloc(100 * MiB * n)
            fake.free(100 * MiB * n)
        fake.alloc(MiB)
        fake.free(MiB)
        if n >= 16:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    plan = cudamem.plan(step)
    assert plan.per_sample() == 100 * MiB  # the inner span's reset folded into the probe's
    assert capsys.readouterr().err == ""  # no post-mortem for a probe allowed to fail
    assert {s.name for s in cudamem.history().spans} == {"forward"}  # no probe in history


def test_a_probe_out_of_memory_skips_the_larger_ones(fake: Device) -> None:
    calls: list[int] = []

    def step(n: int) -> None:
        calls.append(n)
        if n >= 8:
            raise torch.OutOfMemoryError("CUDA out of memory.")
        fake.alloc(n * MiB)
        fake.free(n * MiB)

    plan = cudamem.plan(step)
    assert calls == [4, 4, 8]  # no check after a failed probe
    assert plan.allocated_line is None
    with pytest.raises(RuntimeError, match="the probes gave no fit: batch 8 ran out of memory"):
        plan.predict(4)
    assert "out of memory" in str(plan)


def test_a_step_that_raises_something_else_propagates(fake: Device) -> None:
    def step(n: int) -> None:
        raise KeyError("labels")

    with pytest.raises(KeyError, match="labels") as raised:
        cudamem.plan(step)
    if hasattr(raised.value, "__notes__"):  # Python 3.11+
        assert raised.value.__notes__ == ["cudamem.plan: raised by the warm-up step at batch 4"]

    def too_long(n: int, length: int) -> None:
        if length > 256:
            raise IndexError("index out of range in self")  # past the position embeddings

    with pytest.raises(IndexError) as raised:
        cudamem.plan(too_long, lengths=(128, 256))
    if hasattr(raised.value, "__notes__"):
        assert raised.value.__notes__ == [
            "cudamem.plan: raised by the check step at batch 8, length 512 "
            "(check= chooses the check step's size)"
        ]


def test_restore_puts_the_model_and_optimizer_back(fake: Device) -> None:
    torch.manual_seed(0)
    model = nn.Linear(8, 4)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    before = {k: v.clone() for k, v in model.state_dict().items()}

    def step(n: int) -> None:
        loss = model(torch.ones(n, 8)).square().sum()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        fake.alloc(linear(n))
        fake.free(linear(n))

    plan = cudamem.plan(step, model=model, optimizer=optimizer, restore=True)
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert optimizer.state_dict()["state"] == {}  # the probes' AdamW moments are gone
    assert all(p.grad is None for p in model.parameters())
    assert plan.restore is not None
    assert plan.restore.nbytes == (8 * 4 + 4) * 4  # the parameters, copied to the host
    assert "restored the model and optimizer: 144 B" in str(plan)
    unrestored = cudamem.plan(step, model=model, optimizer=optimizer)
    assert unrestored.restore is None
    parts = dict(unrestored.fixed_parts)  # what the module profile read at the probe
    assert parts["parameters"] == 144 and parts["optimizer state"] >= 2 * 144
    assert "fixed part 1000.0 MiB: parameters 144 B" in str(unrestored)
    assert not torch.equal(before["weight"], model.state_dict()["weight"])  # real steps


def test_lengths_fit_the_quadratic_attention_term(fake: Device) -> None:
    def peak(n: int, length: int) -> int:
        return 900 * MiB + n * (4096 * length + 48 * length * length)

    step = Step(fake, peak, state=0)
    plan = cudamem.plan(step, lengths=(128, 256))
    # Warm-up, both sizes at 128, the smallest at 256, the check at twice the length.
    assert step.calls == [(4, 128), (4, 128), (8, 128), (4, 256), (8, 512)]
    assert plan.allocated_line is not None
    assert plan.allocated_line.terms == ("1", "n*L", "n*L^2")
    assert plan.linear is True
    assert plan.predict(16, 1024).allocated == peak(16, 1024)
    # A measured batch at a length longer than any step ran is past the probes too.
    assert plan.predict(8, 512).measured_range and not plan.predict(8, 1024).measured_range
    budget = 0.95 * 100 * GiB
    # no confirming step on a length axis: the prior allowance
    assert plan.allowance == ALLOWANCE and plan.confirm is False
    per_sample = 4096 * 1024 + 48 * 1024 * 1024
    expected = int(((budget - HEADROOM) / (1 + ALLOWANCE) - 900 * MiB) // per_sample)
    assert plan.largest(length=1024, memory=100 * GiB) == expected
    with pytest.raises(ValueError, match="length is required"):
        plan.predict(16)
    flat = cudamem.plan(Step(fake, linear, state=0))
    with pytest.raises(ValueError, match="length is only for a plan with lengths="):
        flat.predict(16, 1024)


def test_three_lengths_fit_four_terms(fake: Device) -> None:
    def peak(n: int, length: int) -> int:
        return 900 * MiB + n * (2 * MiB + 4096 * length + 48 * length * length)

    step = Step(fake, peak, state=0)
    plan = cudamem.plan(step, lengths=(64, 128, 256))
    assert len(step.calls) == 6  # warm-up, four probes, the check
    assert plan.allocated_line is not None and len(plan.allocated_line.terms) == 4
    assert plan.predict(32, 2048).allocated == pytest.approx(peak(32, 2048), rel=1e-9)


class Block(nn.Module):
    """Keeps ``per_sample`` fake bytes per sample until the step frees them."""

    def __init__(self, fake: FakeAllocator, per_sample: int, held: list[int]) -> None:
        super().__init__()
        self.fake, self.per_sample, self.held = fake, per_sample, held

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        nbytes = self.per_sample * x.shape[0]
        self.fake.alloc(nbytes)
        self.held.append(nbytes)
        return x


class Head(Block):
    pass


class Net(nn.Module):
    def __init__(self, fake: FakeAllocator, held: list[int]) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(fake, 10 * MiB, held) for _ in range(4))
        self.head = Head(fake, 30 * MiB, held)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def test_modules_name_the_per_sample_bytes_and_checkpointing_advice(fake: Device) -> None:
    held: list[int] = []
    model = Net(fake, held)
    fake.alloc(600 * MiB)  # the model and its optimizer state

    def step(n: int) -> None:
        model(torch.ones(n, 4))
        fake.alloc(20 * MiB * n)  # the loss's backward
        fake.free(20 * MiB * n + sum(held))
        held.clear()

    plan = cudamem.plan(step, model=model)
    assert plan.fixed == 600 * MiB and plan.per_sample() == 90 * MiB
    assert plan.profiled == (8, None)
    shares = {m.name: m.kept for m in plan.modules}
    assert shares["Net.blocks.0"] == 10 * MiB and shares["Net.head"] == 30 * MiB
    assert shares["Net"] == 70 * MiB  # what the whole forward kept per sample
    costs = {m.name: m for m in plan.module_costs}
    assert [m.name for m in plan.module_costs] == [
        *(f"Net.blocks.{i}" for i in range(4)),
        "Net.head",
        "Net",
    ]
    assert costs["Net.blocks.2"].upto == 30 * MiB  # every activation alive at its exit
    assert costs["Net.blocks.2"].output == 16  # the output tensor: 4 float32 per sample
    text = str(plan)
    assert "activations kept per sample, by module (profiled at n=8):" in text
    assert "30.0 MiB  Net.head" in text

    # Batch 10 without checkpointing: 600 + 900 MiB (and the 64 MiB headroom); under
    # 1400 MiB two blocks do.
    assert plan.allowance == 0.0
    advice = plan.checkpointing(10, margin=0.0, memory=1400 * MiB)
    assert advice.modules == ("Net.blocks.0", "Net.blocks.1")
    per_sample = 90 * MiB - 2 * (10 * MiB - 16)
    assert advice.predicted.allocated == round(600 * MiB + 10 * per_sample)
    assert advice.fits and advice.without.allocated == 1500 * MiB
    chosen = [costs["Net.blocks.0"], costs["Net.blocks.1"]]
    assert checkpoint_per_sample(90 * MiB, chosen) == per_sample
    assert plan.predict_checkpointed(10, advice.modules) == advice.predicted
    assert "checkpoint 2 modules (Net.blocks.0, Net.blocks.1)" in str(advice)
    roomy = plan.checkpointing(10, memory=100 * GiB)
    assert roomy.modules == () and roomy.fits
    tight = plan.checkpointing(10, margin=0.0, memory=700 * MiB)
    assert not tight.fits and len(tight.modules) == 4
    with pytest.raises(KeyError, match=r"Net\.nothing"):
        plan.predict_checkpointed(10, ["Net.nothing"])


def test_without_a_cuda_device_it_says_so_and_runs_nothing() -> None:
    class NoGpu(FakeAllocator):
        def device_count(self) -> int:
            return 0

    calls: list[int] = []
    with _backend.use(NoGpu(devices=0, contexts=())):
        plan = cudamem.plan(calls.append)
    assert calls == []
    assert plan.unmeasured == "no CUDA device"
    assert str(plan) == "cudamem.plan: nothing measured (no CUDA device)"
    with pytest.raises(RuntimeError, match="measured nothing: no CUDA device"):
        plan.predict(8)
    with pytest.raises(RuntimeError, match="measured nothing: no CUDA device"):
        plan.largest(memory=GiB)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"step": 3}, TypeError, "step must be callable"),
        ({"sizes": 8}, TypeError, "sizes must be a sequence of positive ints, not int"),
        ({"sizes": (4, 8.0)}, TypeError, r"sizes\[1\] must be an int, not float"),
        ({"sizes": (4, True)}, TypeError, r"sizes\[1\] must be an int, not bool"),
        ({"sizes": (0, 8)}, ValueError, r"sizes\[0\] must be >= 1, got 0"),
        ({"sizes": (4, 4)}, ValueError, "sizes must be distinct"),
        ({"sizes": (4,)}, ValueError, "sizes needs at least 2 values"),
        ({"lengths": (128, -1)}, ValueError, r"lengths\[1\] must be >= 1"),
        ({"check": 2.5}, TypeError, "check must be a bool or a batch size"),
        ({"restore": 1}, TypeError, "restore must be a bool"),
        ({"restore": True}, ValueError, "restore=True needs model= and optimizer="),
        ({"model": "gpt2"}, TypeError, "model must be a torch.nn.Module"),
        ({"optimizer": object()}, TypeError, "optimizer must be a torch.optim.Optimizer"),
    ],
)
def test_bad_arguments_are_named(
    fake: Device, kwargs: dict[str, Any], error: type, match: str
) -> None:
    args = {"step": lambda n: None, **kwargs}
    with pytest.raises(error, match=match):
        cudamem.plan(**args)


def test_bad_question_arguments_are_named(fake: Device) -> None:
    plan = cudamem.plan(Step(fake, linear))
    with pytest.raises(ValueError, match=r"margin must be >= 0 and < 1 .*got 1.5"):
        plan.largest(1.5, memory=GiB)
    with pytest.raises(TypeError, match="margin must be a number, not str"):
        plan.largest("5%", memory=GiB)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="n must be >= 1, got 0"):
        plan.predict(0)
    with pytest.raises(TypeError, match="memory must be an int"):
        plan.largest(memory=1.5)  # type: ignore[arg-type]


def test_the_plan_as_text_html_and_json(fake: Device) -> None:
    fake.alloc(500 * MiB)
    plan = cudamem.plan(Step(fake, linear))
    text = str(plan)
    assert text.startswith("cudamem.plan on cuda:0: 5 steps run")
    assert "peak allocated = 1.8 GiB + 50.0 MiB × n" in text
    assert "line said 2.5 GiB: 0.00% off, on the line" in text
    assert "required near the limit = peak allocated × 1.0000 + 64.0 MiB" in text
    assert f"measured at the confirming step at batch {plan.probes[-1].n}" in text
    assert "ran at the answer" in text
    assert "after the plan: +300.0 MiB allocated" in text
    html = plan._repr_html_()
    assert html.startswith("<p><b>cudamem.plan</b> on cuda:0</p><table")
    assert '<td style="padding:0 0.6em">check</td>' in html
    data = json.loads(to_json(plan))
    assert data["allocated_line"] == {"terms": ["1", "n"], "coefs": [1800.0 * MiB, 50.0 * MiB]}
    confirmed = plan.probes[-1].n
    assert data["linear"] is True and data["largest_measured"] == confirmed
    roles = ["warm-up", "probe", "probe", "check", "confirm"]
    assert [p["role"] for p in data["probes"]] == roles
    # the cache as the confirming step (the largest) left it, its peaks from the counters
    assert data["fragmentation"]["peak_allocated"] == 1800 * MiB + confirmed * 50 * MiB
    assert "cuda:0 fragmentation:" in text
    assert (
        str(plan.predict(64))
        == "batch 64: peak allocated 4.9 GiB, reserved 4.9 GiB, needs 4.9 GiB (predicted)"
    )
    assert isinstance(plan, MemoryPlan)


class TwoPhaseStep:
    """A model's forward holding ``1000 MiB + 60 MiB·n`` at its end, then a backward whose
    peak is ``500 MiB + 80 MiB·n``: the forward's peak is the step's at the probes (n ≤ 16),
    the backward's from n = 26 on."""

    def __init__(self, fake: FakeAllocator) -> None:
        self.fake = fake
        fake_ = fake

        class Model(torch.nn.Module):
            def forward(self, n: int) -> int:
                nbytes = 1000 * MiB + 60 * MiB * n
                fake_.alloc(nbytes)
                fake_.free(nbytes)
                return n

        self.model = Model()

    def __call__(self, n: int) -> None:
        self.model(n)
        nbytes = 500 * MiB + 80 * MiB * n
        self.fake.alloc(nbytes)
        self.fake.free(nbytes)


def test_the_peak_past_the_probes_is_the_larger_phase_s(fake: Device) -> None:
    """One line through the step's peaks (the forward's at every probe) would say
    1000 MiB + 60 MiB·n at n = 64; the backward holds 500 MiB + 80 MiB·n there."""
    plan = cudamem.plan(TwoPhaseStep(fake), sizes=(4, 8), confirm=False)
    assert [p.phases for p in plan.probes] == [
        (1000 * MiB + 60 * MiB * n, 500 * MiB + 80 * MiB * n) for n in (4, 4, 8, 16)
    ]
    assert plan.allocated_line is not None
    assert round(plan.allocated_line.at(64)) == 1000 * MiB + 60 * MiB * 64
    assert plan.linear is True
    assert plan.predict(8).allocated == 1000 * MiB + 60 * MiB * 8
    assert plan.predict(64).allocated == 500 * MiB + 80 * MiB * 64
    text = str(plan)
    assert "predicted as the larger of the step's phases" in text
    assert "phase 2: 500.0 MiB + 80.0 MiB × n" in text
    # a step that runs no module has no phases: one line
    assert cudamem.plan(Step(fake, linear)).phase_lines == ()


def test_reserved_past_the_probes_is_the_smaller_of_the_line_and_the_ratio() -> None:
    """Within the measured sizes the larger guide answers; past them the smaller: a line
    through small steps' reserved peaks grows too fast where the cache's overhead is a share
    of each block, the largest step's ratio overstates a fixed overhead."""
    probe = Probe(8, None, "probe", 1800 * MiB, 2200 * MiB, 0, 0.1)
    plan = MemoryPlan(
        0,
        (probe,),
        Line(("1", "n"), (1000.0 * MiB, 100.0 * MiB)),
        Line(("1", "n"), (1000.0 * MiB, 150.0 * MiB)),  # 2200 MiB at n = 8
        1.2,
        None,
    )
    # n = 4: line 1600 MiB, ratio 1.2 × 1400 = 1680 MiB: the larger
    assert plan.predict(4).reserved == round(1.2 * 1400 * MiB)
    # n = 100: line 16,000 MiB, ratio 1.2 × 11,000 = 13,200 MiB: the smaller
    assert plan.predict(100).reserved == round(1.2 * 11000 * MiB)
    steep = replace(plan, reserved_line=Line(("1", "n"), (1100.0 * MiB, 100.0 * MiB)))
    assert steep.predict(100).reserved == 11100 * MiB  # a fixed 100 MiB: the line
    assert plan.predict(100).allocated == 11000 * MiB


class _FakeAdam(torch.optim.Optimizer):
    """An optimizer whose step holds ``nbytes`` of temporaries on the fake device."""

    def __init__(self, fake: FakeAllocator, nbytes: int) -> None:
        super().__init__([torch.zeros(1, requires_grad=True)], {})
        self.fake, self.nbytes = fake, nbytes

    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        self.fake.alloc(self.nbytes)
        self.fake.free(self.nbytes)


def test_the_optimizer_s_step_is_a_phase_of_its_own(fake: Device) -> None:
    """At the probes (n = 4, 8) the step's peak is the optimizer's constant 1500 MiB: a line
    through the step's peaks would be flat. Cut at the optimizer's step, the forward's and
    the backward's lines carry the growth: the check at 16 lands on the forward's, n = 64 on
    the backward's."""
    two = TwoPhaseStep(fake)
    opt = _FakeAdam(fake, 1500 * MiB)

    def step(n: int) -> None:
        two(n)
        opt.step()

    plan = cudamem.plan(step, sizes=(4, 8))
    assert [p.allocated for p in plan.probes[:4]] == [1500 * MiB] * 3 + [1960 * MiB]
    assert plan.probes[1].phases == (1240 * MiB, 820 * MiB, 1500 * MiB)
    assert plan.linear is True and len(plan.phase_lines) == 3
    assert plan.predict(64).allocated == 500 * MiB + 80 * MiB * 64


def test_the_fragmentation_s_peaks_are_the_last_step_s_own(fake: Device) -> None:
    """The phases' spans reset the allocator's peak counters inside a step: the plan's
    fragmentation reports the check step's peak (its forward's 1960 MiB), not the last
    phase's."""
    plan = cudamem.plan(TwoPhaseStep(fake), sizes=(4, 8), confirm=False)
    assert plan.fragmentation is not None
    assert plan.probes[-1].allocated == 1960 * MiB
    assert plan.fragmentation.peak_allocated == 1960 * MiB


def test_a_negative_term_reads_as_a_minus() -> None:
    from cudamem.render.plan import formula

    assert formula(Line(("1", "n"), (2048.0 * MiB, -227.5 * 1024))) == "2.0 GiB − 227.5 KiB × n"
    line = Line(("1", "n*L", "n*L^2"), (1024.0 * MiB, 1.5 * MiB, -51.0))
    assert formula(line) == "1.0 GiB + n × (1.5 MiB·L − 51.0 B·L²)"


def test_the_largest_batch_for_another_budget_or_card_says_what_it_assumed(fake: Device) -> None:
    """A 40 % budget on this card lies inside the steps that ran; a card twice the size
    is answered from the line, with the bytes outside the allocator taken off it."""
    fake.alloc(500 * MiB)
    fake.total = 100 * GiB
    fake.outside = 2 * GiB  # the CUDA context and the driver, as NVML counts them

    plan = cudamem.plan(Step(fake, linear))
    assert plan.capacity == 102 * GiB and plan.available == 100 * GiB
    small = plan.largest_for(40 * GiB, margin=0.0)
    assert small.n == plan.largest(0.0, memory=40 * GiB)
    assert small.territory == "interpolated" and small.capacity is None
    assert small.required <= small.budget == 40 * GiB
    assert small.n == int((40 * GiB * (1 - UNCONFIRMED) - HEADROOM - 1800 * MiB) // (50 * MiB))
    assert f"{UNCONFIRMED:.1%} of the budget kept in reserve: no step ran at this limit" in str(
        small
    )
    big = plan.largest_for(204 * GiB, margin=0.0, card=True)
    assert big.memory == 202 * GiB and big.territory == "extrapolated"
    assert big.n == int((202 * GiB * (1 - UNCONFIRMED) - HEADROOM - 1800 * MiB) // (50 * MiB))
    assert big.card_parts[0] == ("outside the allocator", 2 * GiB)
    text = str(big)
    assert text.startswith("largest batch on a card of 204.0 GiB (202.0 GiB for the allocator)")
    assert "past every step that ran" in text
    assert "assumes 2.0 GiB of the card outside the allocator, as here" in text
    assert "the allocator cannot give back 0.00% of the peak plus 64.0 MiB" in text
    with pytest.raises(ValueError, match="memory must be >= 0"):
        plan.largest_for(-1)


def test_confirm_false_answers_from_the_line(fake: Device) -> None:
    step = Step(fake, linear)
    plan = cudamem.plan(step, confirm=False)
    assert step.calls == [(4,), (4,), (8,), (16,)]
    assert plan.confirm is False and plan.allowance == ALLOWANCE
    expected = largest_under(
        lambda n: required(1300 * MiB + 50 * MiB * n, ALLOWANCE), 0.95 * Device.total
    )
    assert plan.largest() == expected  # past the steps: the line's word
    assert "before any confirming step measured it" in str(plan)
    with pytest.raises(TypeError, match="confirm must be a bool"):
        cudamem.plan(step, confirm=1)  # type: ignore[arg-type]


def test_max_batch_caps_every_step_and_the_answer(fake: Device) -> None:
    """A dataset of 1,000 samples: no batch past it is a batch of the step."""
    step = Step(fake, linear)
    plan = cudamem.plan(step, max_batch=1000)
    assert max(c[0] for c in step.calls) == 1000
    assert plan.probes[-1].role == "confirm" and plan.probes[-1].n == 1000
    assert plan.largest(0.0) == 1000 == plan.max_batch
    assert plan.largest(0.0, memory=10 * Device.total) == 1000
    with pytest.raises(ValueError, match="max_batch must be >= 8, got 4"):
        cudamem.plan(step, max_batch=4)


def test_an_unresolved_slope_that_cannot_grow_names_only_batches_that_ran(fake: Device) -> None:
    """100 GiB fixed and 1 KiB a sample on a 140 GiB device: no probe twice as large stays
    within half the memory, so the per-sample bytes stay unresolved; the plan says so,
    confirms nothing, and names no batch past the largest that ran."""
    step = Step(fake, lambda n: 100 * GiB + 1024 * n, state=0)
    plan = cudamem.plan(step)
    assert [c[0] for c in step.calls] == [4, 4, 8]
    assert plan.resolved is False
    assert plan.largest(0.0) == 8
    assert "answers past the steps run are not to be trusted" in str(plan)

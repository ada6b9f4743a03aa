"""Growth detection and leak capture through the fake allocator, culprits on real CPU tensors.

The fake allocator plays the GPU's allocated level; its ``storage_device_type`` is ``cpu``,
so the census names real CPU tensors as the culprits of a level the test drives. A warning
needs surviving storages, so the fake keeps real (untouched, hence not resident) CPU
storages as large as its level unless a test asks for growth no tensor explains.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import math
import random
import re
import sys
import warnings
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

import cudamem
from cudamem.allocator import backend as _backend
from cudamem.base.data import to_data
from cudamem.growth import _trend
from cudamem.growth._trend import rate, theil_sen, trimmed
from cudamem.growth.detector import _WATCH, _detector
from cudamem.growth.settings import LeakSettings, LeakWarning
from cudamem.holders import census
from cudamem.holders.census import LiveStorage
from cudamem.holders.culprits import NO_HOLDER, Culprit, group_culprits
from cudamem.holders.finder import Holder, Holders
from cudamem.render.json import to_json
from cudamem.spans import state as _spans_state

from ..fakes import FakeAllocator, leak_detection, leak_warnings
from ..routes import split

MiB = 1024**2

# Module globals: what the seed's training loop keeps (the census names them by path).
loss_history: list[torch.Tensor] = []
outputs: list[torch.Tensor] = []
errors: list[Exception] = []
X = torch.randn(256, 1024, requires_grad=True)  # 1 MiB of float32 per activation


class CpuFake(FakeAllocator):
    """The fake GPU, whose storages the census looks for on the CPU."""

    storages = "cpu"

    def __init__(self, devices: int = 1, contexts: tuple[int, ...] = (0,)) -> None:
        super().__init__(devices, contexts)
        #: Real CPU storages standing for the level (``torch.empty``: pages never touched).
        self.kept: list[torch.Tensor] = []

    def set_level(self, level: int, *, keep: bool = True) -> None:
        """Move the level; ``keep``: real storages hold it (what a leak of tensors looks
        like), else it is memory no tensor accounts for (the allocator's cache)."""
        now = self.allocated[0]
        if level > now:
            self.alloc(level - now)
        else:
            self.free(now - level)
        if keep:
            held = sum(t.untyped_storage().nbytes() for t in self.kept)
            while self.kept and held > level:
                held -= self.kept.pop().untyped_storage().nbytes()
            if level > held:
                self.kept.append(torch.empty(level - held, dtype=torch.uint8))

    def grow(self, nbytes: int) -> None:
        """``nbytes`` more, held by a new real storage."""
        self.alloc(nbytes)
        self.kept.append(torch.empty(nbytes, dtype=torch.uint8))


@pytest.fixture
def fake() -> Iterator[CpuFake]:
    with leak_detection(CpuFake(devices=1, contexts=(0,)), loss_history, outputs, errors) as alloc:
        yield alloc


@contextlib.contextmanager
def no_leak_warning() -> Iterator[None]:
    """Fail on any LeakWarning: as an error (cudamem lets it reach the ``with``), or recorded
    in any other form (a hook failure reported as a warning of its own)."""
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        warnings.simplefilter("error", LeakWarning)
        yield
    texts = [str(w.message) for w in record]
    assert not [t for t in texts if "LeakWarning" in t or "retains" in t], texts


def run_levels(
    fake: CpuFake, levels: list[int], name: str = "step", *, keep: bool = True
) -> list[LeakWarning]:
    """One span per level; the level is the allocated bytes at the span's exit."""
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for level in levels:
            with cudamem.track(name, sync=False):
                fake.set_level(level, keep=keep)
    return leak_warnings(record)


# --------------------------------------------------------------------------- the rule


def test_theil_sen_is_robust_to_one_outlier() -> None:
    assert theil_sen([0, 4, 8, 12, 16]) == 4
    assert theil_sen([0, 4, 8, 100, 16, 20]) == 4
    assert theil_sen([5, 5, 5, 5, 5]) == 0
    assert theil_sen([7]) == 0


def test_the_slope_is_measured_from_the_call_before_the_first_rise() -> None:
    # five levels, four changes: flat, flat, +10 (a rise), +10 (a rise)
    levels, rises = deque([10, 10, 10, 20, 30]), deque([False, False, True, True])
    assert trimmed(levels, rises) == (10, 20, 30)
    assert rate(levels, rises) == 10  # the flat calls before the leak would halve it
    assert theil_sen(levels) == 5
    # the first rise only: a flat call after it stays in the window
    assert trimmed([0, 0, 10, 10], [False, True, False]) == (0, 10, 10)
    assert trimmed([4, 4, 4], [False, False]) == (4, 4, 4)  # no rise: the whole window
    assert rate([4, 4, 4], [False, False]) == 0


def test_warmup_step_is_not_a_leak(fake: CpuFake) -> None:
    # The first step allocates optimizer state (+300 MiB), then the level is flat.
    levels = [300 * MiB] + [300 * MiB + 4 * MiB] * 3 + [300 * MiB] * 40
    assert run_levels(fake, levels) == []


def test_one_off_jumps_are_not_a_leak(fake: CpuFake) -> None:
    # A cuBLAS workspace at step 3 and a validation buffer at step 7: two rises, then flat.
    levels = [0, 0, 32 * MiB, 32 * MiB, 32 * MiB, 32 * MiB, 96 * MiB] + [96 * MiB] * 30
    assert run_levels(fake, levels) == []


def test_allocator_noise_is_not_a_leak(fake: CpuFake) -> None:
    rng = random.Random(6)
    levels = [100 * MiB + rng.randrange(0, 48 * 1024, 512) for _ in range(300)]
    assert run_levels(fake, levels) == []


def test_small_bounded_buffer_is_not_a_leak(fake: CpuFake) -> None:
    # A logger's device buffer: +512 B per step for 100 steps, then flushed.
    levels = [(i % 100) * 512 for i in range(300)]
    assert run_levels(fake, levels) == []


def test_steady_leak_warns_within_five_calls(fake: CpuFake) -> None:
    found = run_levels(fake, [i * 4 * MiB for i in range(5)])
    assert len(found) == 1
    growth = found[0].growth
    assert growth is not None
    assert growth.name == "step"
    assert growth.per_call == 4 * MiB
    assert growth.calls == 5
    assert str(found[0]).startswith("step retains +4.0 MiB per call (5 calls)")


def test_leak_every_other_call_is_caught(fake: CpuFake) -> None:
    # Gradient accumulation keeping a tensor every second step.
    levels = [(i // 2) * 8 * MiB for i in range(16)]
    found = run_levels(fake, levels)
    assert len(found) == 1
    assert found[0].growth is not None
    assert found[0].growth.per_call == 4 * MiB


def test_leak_that_stops_warns_once_and_settles(fake: CpuFake) -> None:
    levels = [i * 4 * MiB for i in range(10)] + [36 * MiB] * 40
    found = run_levels(fake, levels)
    assert len(found) == 1
    series = _detector.series["step"]
    assert series.phase == _WATCH  # the episode is over
    # The same leak again: the picture did not change, so no second warning.
    again = run_levels(fake, [36 * MiB + i * 4 * MiB for i in range(12)])
    assert again == []


def test_warns_again_when_the_rate_changes(fake: CpuFake) -> None:
    levels = [i * 4 * MiB for i in range(10)]
    levels += [levels[-1] + i * 32 * MiB for i in range(1, 16)]
    found = run_levels(fake, levels)
    assert [w.growth.per_call for w in found if w.growth] == [4 * MiB, 32 * MiB]


def test_ongoing_leak_is_reported_once(fake: CpuFake) -> None:
    found = run_levels(fake, [i * 4 * MiB for i in range(100)])
    assert len(found) == 1


def test_a_leaking_series_measures_its_slope_once_per_call(
    fake: CpuFake, monkeypatch: pytest.MonkeyPatch
) -> None:
    slopes: list[int] = []

    def counted(levels: Any, rises: Any) -> float:
        slopes.append(len(levels))
        return rate(levels, rises)

    monkeypatch.setattr(_trend, "rate", counted)
    found = run_levels(fake, [i * 4 * MiB for i in range(40)])
    assert [w.growth.per_call for w in found if w.growth] == [4 * MiB]
    # every call past the first few judges the slope, and only once: a second reading in
    # the leaking phase would double the count
    assert 0 < len(slopes) <= 40


def test_spans_that_raise_are_not_judged(fake: CpuFake) -> None:
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for i in range(10):
            with pytest.raises(ValueError), cudamem.track("step", sync=False):
                fake.set_level(i * 4 * MiB)
                raise ValueError("bad batch")
    assert leak_warnings(record) == []
    assert "step" not in _detector.series


def test_names_are_separate_series(fake: CpuFake) -> None:
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for _ in range(6):
            with cudamem.track("train", sync=False):
                fake.grow(4 * MiB)
            with cudamem.track("val", sync=False):
                pass
    found = leak_warnings(record)
    assert [w.growth.name for w in found if w.growth] == ["train"]


def test_steady_state_never_runs_the_census(fake: CpuFake, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []

    def counting(name: str) -> Callable[..., None]:
        def fn(*args: object, **kwargs: object) -> None:
            calls.append(name)

        return fn

    monkeypatch.setattr(census, "live_refs", counting("refs"))
    monkeypatch.setattr(census, "live_storages", counting("storages"))
    rng = random.Random(1)
    run_levels(fake, [64 * MiB + rng.randrange(0, 16 * 1024) for _ in range(200)])
    assert calls == []


# --------------------------------------------------------------------------- settings


def test_thresholds_are_configurable(fake: CpuFake) -> None:
    settings = cudamem.configure_leaks(min_bytes_per_call=8 * MiB)
    assert settings.min_bytes_per_call == 8 * MiB
    assert cudamem.leak_settings() is settings
    assert run_levels(fake, [i * 4 * MiB for i in range(20)]) == []
    cudamem.configure_leaks(min_bytes_per_call=MiB, window=4, min_rises=4, warmup=2)
    # warmup=2: call 2 is the baseline; 3 rises by call 5 arm a capture of call 6, and call 7
    # (4 rises of 4: sustained) names the culprits.
    found = run_levels(fake, [i * 2 * MiB for i in range(8)], name="other")
    assert len(found) == 1
    assert found[0].growth is not None and found[0].growth.calls == 7
    assert cudamem.configure_leaks() == LeakSettings()
    assert "3 of the last 8 calls" in str(cudamem.leak_settings())


def test_bad_settings_are_refused() -> None:
    with pytest.raises(TypeError, match="unknown leak setting"):
        cudamem.configure_leaks(treshold=1)
    with pytest.raises(ValueError, match="min_rises"):
        cudamem.configure_leaks(min_rises=9, window=8)
    with pytest.raises(ValueError, match="window"):
        cudamem.configure_leaks(window=1)
    with pytest.raises(ValueError, match="rate_change"):
        cudamem.configure_leaks(rate_change=1.0)
    with pytest.raises(ValueError, match="enabled"):
        cudamem.configure_leaks(enabled="yes")
    assert cudamem.leak_settings() == LeakSettings()


def test_disabled_detection_watches_nothing(fake: CpuFake) -> None:
    cudamem.configure_leaks(enabled=False)
    assert run_levels(fake, [i * 4 * MiB for i in range(20)]) == []
    assert _detector.series == {}


# --------------------------------------------------------------------------- culprits


def _loss_step(fake: CpuFake) -> None:
    """Seed 000's loop: the loss (and its graph, 1 MiB saved by sigmoid) kept in a list."""
    with cudamem.track("train_step", sync=False):
        loss = torch.sigmoid(X * 2).mean()
        loss_history.append(loss)
        fake.alloc(MiB)  # what the GPU would show


def _detach_step(fake: CpuFake) -> None:
    """Seed 000's ``output.detach()`` loop: no graph, but the output itself is kept."""
    with cudamem.track("val_step", sync=False):
        outputs.append(torch.sigmoid(X * 2).detach())
        fake.alloc(MiB)


def test_culprits_named_through_autograd(fake: CpuFake) -> None:
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for _ in range(5):
            _loss_step(fake)
    found = leak_warnings(record)
    assert len(found) == 1
    growth = found[0].growth
    assert growth is not None
    assert growth.per_call == MiB
    top = growth.culprits[0]
    assert top.holder == "tests.integration.test_leaks.loss_history"
    assert top.tensors == 5
    assert top.nbytes >= 5 * MiB
    assert top.autograd_bytes >= 5 * MiB
    assert "→ grad_fn MeanBackward0 → SigmoidBackward0 saved result" in top.example
    text = str(found[0])
    assert text.startswith("train_step retains +1.0 MiB per call (5 calls)")
    assert (
        "tests.integration.test_leaks.loss_history: 5 tensors, 5.0 MiB held through autograd "
        "graphs" in text
    )
    assert "loss.item()" in text


def test_culprits_named_for_detached_outputs(fake: CpuFake) -> None:
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for _ in range(5):
            _detach_step(fake)
    found = leak_warnings(record)
    assert len(found) == 1
    growth = found[0].growth
    assert growth is not None
    top = growth.culprits[0]
    assert top.holder == "tests.integration.test_leaks.outputs"
    assert (top.tensors, top.nbytes, top.autograd_bytes) == (5, 5 * MiB, 0)
    assert "tests.integration.test_leaks.outputs: 5 tensors, 5.0 MiB" in str(found[0])
    assert "held through autograd" not in str(found[0])


#: The guarded loop's sizes: each weight 1 MiB (made before the loop), each call's input
#: and ReLU output 512 KiB (the activations its loss's graph saves), its loss 4 bytes.
WIDTH, BATCH = 512, 256
STEP_BYTES = 2 * BATCH * WIDTH * 4 + 4


@pytest.mark.parametrize("span_leaks", [False, True])
def test_culprit_counts_only_what_the_calls_left(fake: CpuFake, span_leaks: bool) -> None:
    """A loop keeps each NaN guard's exception: the traceback's frame holds that call's
    input and loss (with its graph), and, through the step's closure, the model, whose
    weights were there before the loop. The culprit is the calls' activations alone, as
    ``leaks(since=)`` of the loop says: not the weights the same frames reach (the growth
    path counted them, 2 MiB more, and its example led to ``model[0].weight``). The same
    with the step decorated ``leaks=True``."""
    model = torch.nn.Sequential(
        torch.nn.Linear(WIDTH, WIDTH), torch.nn.ReLU(), torch.nn.Linear(WIDTH, WIDTH)
    )

    def train_step(x: torch.Tensor) -> None:
        loss = model(x).sum()
        if not torch.isfinite(loss):  # the NaN guard
            raise FloatingPointError("loss is NaN")

    @cudamem.track(sync=False, leaks=span_leaks)
    def guarded_step() -> None:
        try:
            train_step(torch.full((BATCH, WIDTH), math.nan))
        except FloatingPointError as e:
            errors.append(e)
        fake.alloc(STEP_BYTES)  # what the GPU shows

    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        with cudamem.track("loop", sync=False, leaks=True) as loop:
            for _ in range(5):
                guarded_step()
    found = leak_warnings(record)
    assert len(found) == 1, [str(w) for w in found]
    growth = found[0].growth
    assert growth is not None
    top = growth.culprits[0]
    assert top.holder == f"{__name__}.errors"
    # Every call's input, ReLU output and loss, alive in the errors' frames; no weight.
    assert (top.items, top.tensors, top.storages) == (len(errors), 5, 3 * 5)
    assert top.nbytes == 5 * STEP_BYTES
    assert top.autograd_bytes == 5 * BATCH * WIDTH * 4  # the ReLU outputs
    assert re.fullmatch(
        rf"{__name__}\.errors\[[0-4]\]\.__traceback__\.tb_next → test_leaks\.py:\d+ in "
        r"train_step\(\): (local 'x'|loss → .* saved mat1)",
        top.example,
    ), top.example
    assert f"{__name__}.errors: 5 tensors, 5.0 MiB" in str(found[0])
    # One rule: what the loop left, grouped, is the same culprit.
    assert cudamem.leaks(since=loop).culprits[0] == top


def test_warning_goes_to_logging(fake: CpuFake, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="cudamem.leaks")
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        for _ in range(5):
            _detach_step(fake)
    messages = [r.getMessage() for r in caplog.records if r.name == "cudamem.leaks"]
    assert len(messages) == 1
    assert messages[0].startswith("val_step retains +1.0 MiB per call (5 calls)")


def test_warning_points_at_user_code(fake: CpuFake) -> None:
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for _ in range(5):
            _detach_step(fake)
    (w,) = [w for w in record if issubclass(w.category, LeakWarning)]
    assert w.filename == __file__


def test_growth_no_storage_explains_is_not_reported(
    fake: CpuFake, caplog: pytest.LogCaptureFixture
) -> None:
    # +4 MiB per call of memory no live tensor holds (the allocator's cache, workspaces):
    # a slope, but no survivors, so no warning; one debug line says why.
    caplog.set_level(logging.DEBUG, logger="cudamem.leaks")
    assert run_levels(fake, [i * 4 * MiB for i in range(30)], keep=False) == []
    lines = [r.getMessage() for r in caplog.records if "not reported" in r.getMessage()]
    assert lines and "'step' grows by 4.0 MiB per call" in lines[0]
    assert "hold 0 B:" in lines[0]
    assert _detector.findings == deque()


def test_unexplained_growth_backs_off_the_census(
    fake: CpuFake, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A slope that is only the allocator's cache, forever: the census runs a few episodes,
    # then ever more rarely (without the back-off: two snapshots per call, 600 here).
    passes: list[int] = []
    real = census.live_refs

    def counting(device_type: str | None = None) -> object:
        passes.append(len(passes))
        return real(device_type)

    monkeypatch.setattr(census, "live_refs", counting)
    assert run_levels(fake, [i * 4 * MiB for i in range(300)], keep=False) == []
    assert 0 < len(passes) <= 60
    series = _detector.series["step"]
    assert series.quiet >= 4 and series.hold > 0


def test_survivors_under_half_the_growth_are_not_reported(fake: CpuFake) -> None:
    # Each call: +4 MiB on the allocator, of which a surviving tensor holds 1 MiB.
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for _ in range(20):
            with cudamem.track("step", sync=False):
                fake.alloc(3 * MiB)
                fake.grow(MiB)
    assert leak_warnings(record) == []


def test_survivors_holding_half_the_growth_are_reported(fake: CpuFake) -> None:
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for _ in range(8):
            with cudamem.track("step", sync=False):
                fake.alloc(2 * MiB)
                fake.grow(2 * MiB)
    (found,) = leak_warnings(record)
    assert found.growth is not None
    assert found.growth.per_call == 4 * MiB and found.growth.retained == 2 * MiB


def test_min_explained_is_configurable(fake: CpuFake) -> None:
    cudamem.configure_leaks(min_explained=0.25)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for _ in range(8):
            with cudamem.track("step", sync=False):
                fake.alloc(3 * MiB)
                fake.grow(MiB)
    assert len(leak_warnings(record)) == 1
    for bad in (0, 1.5, "half", True):
        with pytest.raises(ValueError, match="min_explained"):
            cudamem.configure_leaks(min_explained=bad)


def test_census_failure_never_reaches_the_step(
    fake: CpuFake, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("census exploded")

    caplog.set_level(logging.DEBUG, logger="cudamem.leaks")
    monkeypatch.setattr(census, "live_refs", broken)
    monkeypatch.setattr(census, "live_storages", broken)
    # Nothing can confirm the growth: no warning, and the steps run on untouched.
    assert run_levels(fake, [i * 4 * MiB for i in range(12)]) == []
    messages = " ".join(r.getMessage() for r in caplog.records)
    assert "census exploded" in messages
    assert "could not be captured" in messages


def test_culprits_failing_still_warns_and_says_why(
    fake: CpuFake, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The survivors are confirmed (their refs are alive); only naming them fails.
    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("holder search exploded")

    monkeypatch.setattr(census, "live_storages", broken)
    found = run_levels(fake, [i * 4 * MiB for i in range(6)])
    assert len(found) == 1
    growth = found[0].growth
    assert growth is not None and growth.culprits == ()
    assert growth.retained == 4 * MiB
    assert any("naming the culprits failed" in n and "exploded" in n for n in growth.notes)


def test_growth_is_json_ready(fake: CpuFake) -> None:
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for _ in range(5):
            _detach_step(fake)
    growth = leak_warnings(record)[0].growth
    data = to_data(growth) if growth else {}
    assert data["per_call"] == MiB
    assert data["culprits"][0]["holder"] == "tests.integration.test_leaks.outputs"
    assert '"per_call": 1048576' in to_json(growth)


# --------------------------------------------------------------------------- grouping


def test_container_strips_indices_not_keys() -> None:
    assert split("__main__.loss_history[3] → grad_fn MeanBackward0").container == (
        "__main__.loss_history"
    )
    assert split("__main__.trainer.outputs['val'][2]").container == (
        "__main__.trainer.outputs['val']"
    )
    assert split("train.py:42 in step(): local 'batch'", "frame").container == (
        "train.py:42 in step(): local 'batch'"
    )


def _storage(nbytes: int, *paths: str, root_kind: str = "global") -> LiveStorage:
    """A storage as the census reports it, held through ``paths``."""
    holders = Holders(
        "Tensor",
        nbytes,
        "cpu",
        tuple(
            Holder(
                split(p, "unknown" if p.startswith("<") else root_kind),
                "?",
                "itself",
                nbytes,
                "cpu",
            )
            for p in paths
        ),
    )
    return LiveStorage("cpu", nbytes, "float32", (), 1, False, 0, holders)


def test_group_prefers_the_holder_most_storages_share() -> None:
    items = [
        _storage(10, "m.hist[0]"),
        _storage(10, "m.hist[1]"),
        _storage(10, "f.py:1 in main(): local 'loss'", "m.hist[2]"),
        _storage(5),
    ]
    groups = group_culprits(items)
    assert groups[0] == Culprit("m.hist", 3, 3, 30, 0, "m.hist[0]", 3, ("m.hist[*]",), "cpu")
    assert groups[1].holder == NO_HOLDER


# --------------------------------------------------------------------------- track(leaks=True)


def test_track_leaks_lists_new_storages_with_holders(fake: CpuFake) -> None:
    keep = torch.ones(64)  # exists before the span: not reported
    with cudamem.track("val", leaks=True) as span:
        outputs.append(torch.sigmoid(X * 2).detach())
        outputs.append(torch.sigmoid(X * 3).detach())
        scratch = torch.zeros(1024)  # a local still alive after the block
        tmp = torch.zeros(4096)
        del tmp  # freed inside: not reported
    report = span.leaks
    assert report.count == 3
    assert report.nbytes == 2 * MiB + 4096
    assert report.checked == "at exit"
    holders = {c.holder for c in report.culprits}
    assert "tests.integration.test_leaks.outputs" in holders
    assert any("local 'scratch'" in h for h in holders)
    assert report.culprits[0].holder == "tests.integration.test_leaks.outputs"
    text = str(report)
    assert text.startswith("val: 3 storages created inside, 2.0 MiB, alive at exit")
    assert "tests.integration.test_leaks.outputs[0]" in text
    assert to_data(report)["count"] == 3
    del keep, scratch


def test_leaks_since_span_asks_again_now(fake: CpuFake) -> None:
    with cudamem.track("val", leaks=True) as span:
        outputs.append(torch.sigmoid(X * 2).detach())
        outputs.append(torch.sigmoid(X * 3).detach())
    assert len(span.leaks) == 2
    outputs.pop()
    later = cudamem.leaks(since=span)
    assert later.count == 1
    assert later.checked == "now"
    assert later.culprits[0].holder == "tests.integration.test_leaks.outputs"
    outputs.clear()
    assert not cudamem.leaks(since=span)
    assert "no storage created inside is alive now" in str(cudamem.leaks(since=span))


def test_decorated_function_passes_leaks(fake: CpuFake) -> None:
    """Each call of a function decorated with ``leaks=True`` records what it left behind:
    the capture its span's exit hooks see names the storage and the list holding it."""
    reports: list[Any] = []

    def grab(raw: Any) -> None:
        if raw.name == "fn":
            capture = None if raw.extras is None else raw.extras.get("leaks")
            reports.append(None if capture is None else capture.report)

    @cudamem.track("fn", leaks=True)
    def fn() -> None:
        outputs.append(torch.zeros(256))

    _spans_state.add_exit_hook(grab)
    try:
        fn()
        fn()
    finally:
        _spans_state.remove_exit_hook(grab)
    assert len(outputs) == 2 and len(reports) == 2
    for report in reports:
        assert report is not None, "the decorated call's span took no leak capture"
        assert (report.count, report.nbytes) == (1, 1024)
        assert report.culprits[0].holder == "tests.integration.test_leaks.outputs"


def test_leaks_needs_a_closed_span_with_leaks(fake: CpuFake) -> None:
    span = cudamem.track("plain")
    with pytest.raises(RuntimeError, match="not entered"):
        cudamem.leaks(since=span)
    with span:
        pass
    with pytest.raises(ValueError, match="leaks=True"):
        cudamem.leaks(since=span)
    with pytest.raises(ValueError, match="leaks=True"):
        span.leaks
    with pytest.raises(TypeError, match="MemorySpan"):
        cudamem.leaks(since="plain")  # type: ignore[arg-type]


def test_track_leaks_without_census(fake: CpuFake, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("census exploded")

    monkeypatch.setattr(census, "live_refs", broken)
    with cudamem.track("val", leaks=True) as span:
        outputs.append(torch.zeros(16))
    assert span.leaks.count == 0
    assert any("census" in n for n in span.leaks.notes)


def test_leak_capture_keeps_nothing_alive(fake: CpuFake) -> None:
    import weakref

    with cudamem.track("val", leaks=True) as span:
        t = torch.zeros(1024)
        outputs.append(t)
    ref = weakref.ref(t)
    report = span.leaks
    del t
    outputs.clear()
    assert ref() is None
    assert report.count == 1


# --------------------------------------------------------------------------- identity

#: ``torch.frombuffer`` over one buffer: a new storage at the same address every time
#: (what the caching allocator does after a free, made deterministic).
BUFFER = bytearray(MiB)
ghost: list[torch.Tensor] = []


def _at_buffer() -> torch.Tensor:
    return torch.frombuffer(BUFFER, dtype=torch.uint8)


def test_storage_recreated_at_its_address_is_no_survivor(fake: CpuFake) -> None:
    # zero_grad(set_to_none=True) between steps, backward() re-creating the gradient where
    # the old one was: each call's storage dies in the next, and the level (cache) rises.
    addresses = set()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for i in range(30):
            with cudamem.track("step", sync=False):
                ghost.append(_at_buffer())
                fake.set_level(i * MiB, keep=False)
            addresses.add(ghost[-1].untyped_storage().data_ptr())
            ghost.clear()
    assert len(addresses) == 1  # every call's storage sat at the same address
    assert leak_warnings(record) == []  # by address, each would be a 1 MiB survivor


def test_track_leaks_sees_a_new_storage_at_an_old_address(fake: CpuFake) -> None:
    ghost.append(_at_buffer())
    address = ghost[0].untyped_storage().data_ptr()
    with cudamem.track("val", leaks=True) as span:
        ghost.clear()
        ghost.append(_at_buffer())  # new, though its address existed at entry
    assert ghost[0].untyped_storage().data_ptr() == address
    report = span.leaks
    assert report.count == 1 and report.nbytes == MiB
    assert report.culprits[0].holder == "tests.integration.test_leaks.ghost"
    # Later, another storage at that address is not the one the span left.
    ghost.clear()
    ghost.append(_at_buffer())
    assert cudamem.leaks(since=span).count == 0
    ghost.clear()


def test_leak_capture_releases_its_references(fake: CpuFake) -> None:
    # An armed capture of a non-explicit span keeps nothing on the span, and the detector
    # lets go of its captures once it has decided.
    found = run_levels(fake, [i * 4 * MiB for i in range(8)])
    assert len(found) == 1
    series = _detector.series["step"]
    assert series.pending is None and series.captured is None
    detector_module = sys.modules["cudamem.growth.detector"]  # cudamem.leaks is the function
    assert "step" not in detector_module._armed
    span = cudamem.track("step", sync=False)
    with span:
        fake.set_level(fake.allocated[0])
    extras = span._extras
    assert extras is None or extras.get("leaks") is None


def test_cpu_training_with_set_to_none_never_warns(fake: CpuFake) -> None:
    # Real gradients: each step's outlive it, zero_grad(set_to_none=True) frees them at the
    # start of the next and backward() re-creates them (glibc usually hands back the same
    # addresses). The allocator level (the fake) rises by cache only.
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256)
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(64, 256)
    losses: list[float] = []
    with no_leak_warning():
        for i in range(20):
            with cudamem.track("train", sync=False):
                opt.zero_grad(set_to_none=True)
                loss = model(x).square().mean()
                loss.backward()
                opt.step()
                losses.append(loss.item())
                fake.set_level(i * 256 * 1024, keep=False)
    assert len(losses) == 20


def _live_refs() -> int:
    from cudamem.holders._storages import StorageRef

    gc.collect()
    return sum(type(o) is StorageRef for o in gc.get_objects())


def test_detection_holds_no_references_once_decided(fake: CpuFake) -> None:
    # Weak references pin a small C++ header each: every one cudamem took is released.
    baseline = _live_refs()
    found = run_levels(fake, [i * 4 * MiB for i in range(12)])  # a leak, warned once
    run_levels(fake, [i * 4 * MiB for i in range(12)], name="cache", keep=False)  # let go
    assert len(found) == 1
    with cudamem.track("val", leaks=True) as span:
        fake.grow(MiB)
    assert _live_refs() > baseline  # the span's report: its storages and their refs
    del span
    assert _live_refs() <= baseline


def test_growth_no_storage_explains_names_piling_cublas_workspaces(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A new torch.cuda.Stream per call: +65 MiB of workspaces each call, no tensor at all.
    gpu = FakeAllocator(devices=1, contexts=(0,))  # its storages are CUDA ones: none here
    piles = [(0, 325 * MiB, 10)]
    monkeypatch.setattr(
        sys.modules["cudamem.growth._explained"], "cublas_workspaces", lambda: piles
    )
    cudamem.configure_leaks()
    with _backend.use(gpu), warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for _ in range(12):
            with cudamem.track("run", sync=False):
                gpu.alloc(65 * MiB)
    (found,) = leak_warnings(record)
    assert found.growth is not None and found.growth.culprits == ()
    assert (
        "325.0 MiB of the allocated memory on cuda:0 is 10 cuBLAS workspaces held by no tensor"
        in str(found)
    )
    assert "cudamem.release(clear_cublas=True) frees them" in str(found)
    # A training step's own two workspaces are not named.
    piles[:] = [(0, 65 * MiB, 2)]
    cudamem.configure_leaks()
    gpu = FakeAllocator(devices=1, contexts=(0,))
    with _backend.use(gpu), warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for _ in range(12):
            with cudamem.track("run", sync=False):
                gpu.alloc(65 * MiB)
    # Nothing explains that growth then: no warning (a debug line says why).
    assert leak_warnings(record) == []
    cudamem.configure_leaks()

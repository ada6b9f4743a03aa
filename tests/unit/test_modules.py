"""The per-module profile through the fake allocator: its arithmetic, its hooks' lifecycle,
shared modules, exceptions, steps, state bytes, torch.compile, rendering. (On real CPU
tensors: ``tests/integration/test_modules_cpu.py``; on a GPU: ``tests/gpu``.)"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn

import cudamem
from cudamem.allocator import backend as _backend
from cudamem.base.format import format_bytes
from cudamem.modules.profile import RawModule, Spread, build_profile
from cudamem.render.json import to_json

from ..fakes import FakeAllocator

#: Every test runs on the Python path and on the compiled span core.
pytestmark = pytest.mark.usefixtures("span_path")

KiB = 1024


@pytest.fixture
def fake() -> Iterator[FakeAllocator]:
    alloc = FakeAllocator(devices=1, contexts=(0,))
    with _backend.use(alloc):
        yield alloc


class Leaf(nn.Module):
    """Allocates ``temp`` and ``keep`` bytes on the fake device, frees ``temp``."""

    def __init__(self, fake: FakeAllocator, keep: int, temp: int = 0) -> None:
        super().__init__()
        self.fake, self.keep, self.temp = fake, keep, temp
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.fake.alloc(self.temp)
        self.fake.alloc(self.keep)
        self.fake.free(self.temp)
        return x * 2


class Outer(nn.Module):
    def __init__(self, fake: FakeAllocator, own: int = 100 * KiB) -> None:
        super().__init__()
        self.fake, self.own = fake, own
        self.a = Leaf(fake, keep=30 * KiB, temp=50 * KiB)
        self.b = Leaf(fake, keep=10 * KiB, temp=5 * KiB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.fake.alloc(self.own)
        return self.b(self.a(x))


def test_kept_self_and_peaks_nest(fake: FakeAllocator) -> None:
    model = Outer(fake)
    with cudamem.track_modules(model) as prof:
        model(torch.ones(2, 4))
    p = prof.profile
    a, b, outer = p.module("Outer.a"), p.module("Outer.b"), p.module("Outer")
    assert (a.kept, a.forward_peak) == (Spread(30 * KiB, 30 * KiB), Spread(80 * KiB, 80 * KiB))
    assert (b.kept.max, b.forward_peak.max) == (10 * KiB, 15 * KiB)
    assert outer.kept.max == 140 * KiB  # its own 100 KiB and its children's 40 KiB
    assert outer.self_kept.max == 100 * KiB
    assert outer.kept.max == outer.self_kept.max + a.kept.max + b.kept.max
    assert outer.forward_peak.max == 180 * KiB  # 100 own + a's 30 kept + a's 50 temporary
    assert [r.name for r in p.modules] == ["Outer", "Outer.a", "Outer.b"]  # lin never ran
    assert (outer.depth, a.depth, a.parent) == (0, 1, "Outer")
    assert p.top(1)[0].name == "Outer"  # its own code kept the most
    assert [r.name for r in p.top(3)] == ["Outer", "Outer.a", "Outer.b"]
    assert p.top(1, by="forward_peak")[0].name == "Outer"
    assert p.unmeasured is None


def test_siblings_sort_largest_kept_first(fake: FakeAllocator) -> None:
    model = Outer(fake)
    model.b.keep = 64 * KiB
    with cudamem.track_modules(model) as prof:
        model(torch.ones(2, 4))
    assert [r.name for r in prof.profile.modules] == ["Outer", "Outer.b", "Outer.a"]


def test_steps_give_mean_and_max(fake: FakeAllocator) -> None:
    model = Outer(fake)
    with cudamem.track_modules(model) as prof:
        for keep in (10, 20, 60):
            model.a.keep = keep * KiB
            model(torch.ones(2, 4))
            prof.step()
    a = prof.profile.module("Outer.a")
    assert prof.profile.steps == 3
    assert a.steps == 3
    assert a.kept == Spread(30 * KiB, 60 * KiB)
    assert a.calls == Spread(1.0, 1.0)


class Shared(nn.Module):
    def __init__(self, fake: FakeAllocator) -> None:
        super().__init__()
        self.fake = fake
        self.layer = Leaf(fake, keep=8 * KiB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(self.layer(self.layer(x)))


def test_a_shared_layer_counts_every_call(fake: FakeAllocator) -> None:
    model = Shared(fake)
    with cudamem.track_modules(model) as prof:
        model(torch.ones(2, 4))
        prof.step()
        model(torch.ones(2, 4))
    layer = prof.profile.module("Shared.layer")
    assert layer.calls == Spread(3.0, 3.0)
    assert layer.kept == Spread(24 * KiB, 24 * KiB)
    assert layer.forward_peak.max == 8 * KiB  # one call's, not the sum
    assert prof.profile.module("Shared").self_kept.max == 0


class AllocInBackward(torch.autograd.Function):
    """Identity forward; its backward allocates ``temp`` + ``keep`` bytes, frees ``temp``."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, fake: Any, keep: int, temp: int) -> torch.Tensor:
        ctx.fake, ctx.keep, ctx.temp = fake, keep, temp
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        ctx.fake.alloc(ctx.temp + ctx.keep)
        ctx.fake.free(ctx.temp)
        return grad, None, None, None


class Grad(nn.Module):
    def __init__(self, fake: FakeAllocator, keep: int, temp: int) -> None:
        super().__init__()
        self.fake, self.keep, self.temp = fake, keep, temp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return AllocInBackward.apply(x, self.fake, self.keep, self.temp)  # type: ignore[no-any-return]


class Pipeline(nn.Module):
    def __init__(self, fake: FakeAllocator) -> None:
        super().__init__()
        self.first = Grad(fake, keep=4 * KiB, temp=16 * KiB)
        self.second = Grad(fake, keep=2 * KiB, temp=64 * KiB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(self.first(x))


def test_backward_spans_measure_each_module(fake: FakeAllocator) -> None:
    model = Pipeline(fake)
    x = torch.ones(3, requires_grad=True)
    with cudamem.track_modules(model) as prof:
        for _ in range(2):
            model(x).sum().backward()
    p = prof.profile
    first, second, root = (
        p.module("Pipeline.first"),
        p.module("Pipeline.second"),
        p.module("Pipeline"),
    )
    assert p.steps == 2  # the second forward began after a backward: a new step
    assert second.backward_calls == Spread(1.0, 1.0)
    assert second.backward_delta.max == 2 * KiB
    assert second.backward_peak.max == 66 * KiB
    assert first.backward_delta.max == 4 * KiB
    assert first.backward_peak.max == 20 * KiB
    # The root's backward holds both: 2 KiB kept by second's, then first's 20 KiB peak.
    assert root.backward_delta.max == 6 * KiB
    assert root.backward_peak.max == 66 * KiB
    assert root.backward_time.max > 0


def test_a_module_whose_inputs_need_no_grad_ends_with_the_backward(fake: FakeAllocator) -> None:
    model = Pipeline(fake)
    w = torch.ones(3, requires_grad=True)
    with cudamem.track_modules(model) as prof:
        (model(torch.ones(3)) * w).sum().backward()
    first = prof.profile.module("Pipeline.first")
    assert first.backward_calls.max == 0  # its output needs no grad: no backward through it
    with cudamem.track_modules(model) as prof:
        model(torch.ones(3) * w).sum().backward()
    assert prof.profile.module("Pipeline.first").backward_calls.max == 1


class Boom(nn.Module):
    def __init__(self, fake: FakeAllocator) -> None:
        super().__init__()
        self.fake = fake

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.fake.alloc(KiB)
        raise ValueError("boom in forward")


class WithBoom(nn.Module):
    def __init__(self, fake: FakeAllocator) -> None:
        super().__init__()
        self.ok = Leaf(fake, keep=KiB)
        self.boom = Boom(fake)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.boom(self.ok(x))


def _hook_counts(model: nn.Module) -> list[tuple[int, int]]:
    return [(len(m._forward_pre_hooks), len(m._forward_hooks)) for m in model.modules()]


def test_a_raising_forward_propagates_and_the_profile_stays_consistent(
    fake: FakeAllocator,
) -> None:
    model = WithBoom(fake)
    before = _hook_counts(model)
    prof = cudamem.track_modules(model)
    with pytest.raises(ValueError, match="boom in forward"), prof:
        with contextlib.suppress(ValueError):
            model(torch.ones(2, 4))
        assert prof._stack == []  # the stack is empty again
        model.ok(torch.ones(2, 4))  # a later call is measured as usual
        model(torch.ones(2, 4))
    assert _hook_counts(model) == before
    assert prof.hooks == 0
    p = prof.profile
    assert p.module("WithBoom.boom").raised == 2
    assert p.module("WithBoom").raised == 2
    assert p.module("WithBoom.ok").calls.max == 3
    assert "2 forward calls raised" in str(p)


def test_every_hook_goes_and_the_users_hooks_stay(fake: FakeAllocator) -> None:
    model = Pipeline(fake)
    seen: list[str] = []
    model.first.register_forward_hook(lambda m, i, o: seen.append("user hook"))
    model.first.register_forward_pre_hook(lambda m, i: seen.append("user pre-hook"))
    before = _hook_counts(model)
    x = torch.ones(3, requires_grad=True)
    with cudamem.track_modules(model) as prof:
        assert prof.hooks > 0
        out = model(x)  # backward hooks pending at exit
    assert _hook_counts(model) == before
    assert prof.hooks == 0
    out.sum().backward()  # after exit: nothing of the profile runs
    model(x)
    assert seen == ["user pre-hook", "user hook"] * 2
    assert prof.profile.module("Pipeline.first").backward_calls.max == 0
    with pytest.raises(RuntimeError, match="runs once"):
        prof.start()


def test_user_hooks_run_inside_the_measurement(fake: FakeAllocator) -> None:
    model = Pipeline(fake)
    model.first.register_forward_pre_hook(lambda m, i: fake.alloc(3 * KiB))
    model.first.register_forward_hook(lambda m, i, o: fake.alloc(5 * KiB))
    with cudamem.track_modules(model) as prof:
        model(torch.ones(3))
    assert prof.profile.module("Pipeline.first").kept.max == 8 * KiB


def test_state_bytes_count_tied_storages_once() -> None:
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(10, 8)  # 320 bytes
            self.head = nn.Linear(8, 10, bias=False)
            self.head.weight = self.emb.weight  # tied
            self.norm = nn.BatchNorm1d(8)  # 2 params + 3 buffers

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.norm(self.emb(x)))  # type: ignore[no-any-return]

    model = Tied()
    opt = torch.optim.Adam(model.parameters())
    with cudamem.track_modules(model, optimizer=opt) as prof:
        model(torch.arange(4)).sum().backward()
        opt.step()
    p = prof.profile
    emb, head, norm, root = (p.module(f"Tied{s}") for s in (".emb", ".head", ".norm", ""))
    assert (emb.params, emb.grads, head.params) == (320, 320, 0)
    assert emb.optimizer == 2 * 320 + 4  # exp_avg, exp_avg_sq, step
    assert (norm.params, norm.buffers) == (64, 64 + 8)  # running mean/var, num_batches
    assert root.params == 320 + 64
    assert root.optimizer == emb.optimizer + norm.optimizer


def test_optimizers_that_step_are_found_without_the_argument(fake: FakeAllocator) -> None:
    model = nn.Sequential(nn.Linear(4, 4))
    opt = torch.optim.SGD(model.parameters(), momentum=0.9)
    with cudamem.track_modules(model) as prof:
        model(torch.ones(2, 4)).sum().backward()
        opt.step()
    assert prof.profile.module("Sequential.0").optimizer == 80  # momentum buffers


def test_without_a_model_every_called_tree_is_profiled(fake: FakeAllocator) -> None:
    model = Outer(fake)
    loss = nn.MSELoss()
    before = len(torch.nn.modules.module._global_forward_pre_hooks)
    with cudamem.track_modules() as prof:
        out = model(torch.ones(2, 4))
        loss(out, torch.zeros(2, 4))
    assert len(torch.nn.modules.module._global_forward_pre_hooks) == before
    p = prof.profile
    assert p.module("Outer").kept.max == 140 * KiB
    assert p.module("Outer.a").kept.max == 30 * KiB
    assert p.module("MSELoss").calls.max == 1


def test_arguments_are_checked() -> None:
    with pytest.raises(TypeError, match=r"model must be a torch\.nn\.Module"):
        cudamem.track_modules("gpt2")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"optimizer must be a torch\.optim\.Optimizer"):
        cudamem.track_modules(nn.Linear(2, 2), optimizer=[object()])
    prof = cudamem.track_modules(nn.Linear(2, 2))
    with prof, pytest.raises(RuntimeError, match="once the profiler has stopped"):
        prof.profile
    with pytest.raises(ValueError, match="by must be one of"):
        prof.profile.top(3, by="bytes")
    with pytest.raises(ValueError, match="n must be >= 0"):
        prof.profile.top(-1)
    with pytest.raises(KeyError, match="no module 'nope'"):
        prof.profile.module("nope")


def test_without_a_device_the_profile_says_so() -> None:
    with _backend.use(FakeAllocator(devices=0, contexts=())):
        model = Outer(FakeAllocator())
        with cudamem.track_modules(model) as prof:
            model(torch.ones(2, 4))
    p = prof.profile
    assert p.unmeasured == "no CUDA device"
    assert "bytes not measured (no CUDA device)" in str(p)


def test_without_a_device_nothing_reads_as_zero() -> None:
    """No CUDA device: the rows say kept and peaks were not measured (never "kept 0 B"), the
    table's allocator columns are n/a (its "-" is a measured 0), and top() says why it is
    empty (a warning at the caller's line, and the answer's reason); by='params' still ranks."""
    with _backend.use(FakeAllocator(devices=0, contexts=())):
        model = Outer(FakeAllocator())
        with cudamem.track_modules(model) as prof:
            model(torch.ones(2, 4))
    p = prof.profile
    row = p.modules[0]
    assert row.unmeasured == "no CUDA device"
    assert str(row) == (
        f"{row.name} ({row.type_name}): kept and peaks not measured (no CUDA device), "
        f"params {format_bytes(row.params)}, grads 0 B, optimizer 0 B"
    )
    assert "kept 0 B" not in str(row)
    cells = str(p).splitlines()[4].split()
    # kept, self, fwd peak, bwd peak, recomputed (one step: no "kept max" column)
    assert cells[2:7] == ["n/a"] * 5 and cells[7] != "n/a"  # params are measured
    with pytest.warns(UserWarning, match=r"self_kept not measured \(no CUDA device\)") as seen:
        top = p.top(5)
    assert seen[0].filename == __file__  # located at the caller's line
    assert top == () and top.reason == (
        "self_kept not measured (no CUDA device): no module to rank"
    )
    by_params = p.top(1, by="params")
    assert by_params[0].name == row.name and by_params.reason is None


def test_build_profile_adds_steps_up() -> None:
    raws = [
        RawModule("M", "M", 0, None, ((1, 10, 4, 12, 1000, 1, -3, 7, 500, 0, 0),) * 2),
        RawModule(
            "M.a",
            "A",
            1,
            "M",
            ((1, 6, 6, 8, 400, 1, 2, 5, 100, 1, 6), (2, 2, 2, 8, 0, 0, 0, 0, 0, 0, 0)),
        ),
        RawModule("M.never", "N", 1, "M", ()),
    ]
    p = build_profile(raws, 2, {"M": (1, 2, 3, 4)})
    assert [r.name for r in p.modules] == ["M", "M.a"]
    a = p.module("M.a")
    assert (a.calls, a.kept, a.recomputed) == (Spread(1.5, 2), Spread(4, 6), Spread(3, 6))
    assert p.module("M").forward_time == pytest.approx(Spread(1e-6, 1e-6))
    assert (p.module("M").params, p.module("M").optimizer, a.params) == (1, 4, 0)


def test_text_json_and_html_name_modules_and_bytes(fake: FakeAllocator) -> None:
    model = Outer(fake)
    with cudamem.track_modules(model) as prof:
        model(torch.ones(2, 4))
    p = prof.profile
    text = str(p)
    assert "module profile: 1 step, 3 modules (mean per step)" in text
    assert "top modules by activations kept (own code, mean per step): Outer 100.0 KiB" in text
    assert "Outer.a 30.0 KiB" in text
    assert "\n  a " in text and "140.0 KiB" in text and "180.0 KiB" in text
    assert "kept max" not in text  # one step: its largest is its only one
    assert str(p.module("Outer.a")).startswith("Outer.a (Leaf): kept 30.0 KiB per step")
    data = json.loads(to_json(p, kind="cudamem.modules"))
    assert (data["kind"], data["schema"], data["steps"]) == ("cudamem.modules", 1, 1)
    row = next(m for m in data["modules"] if m["name"] == "Outer.a")
    assert row["kept"] == {"mean": 30 * KiB, "max": 30 * KiB}
    assert row["params"] == 80 and row["type_name"] == "Leaf"
    assert p.to_dict()["modules"][0]["name"] == "Outer"
    html = p._repr_html_()
    assert 'title="Outer.a"' in html and "140.0 KiB" in html and "<table" in html
    assert 'class="cm-bar" style="width:160px"' in html  # the root, the widest bar
    assert 'class="cm-bar" style="width:34px"' in html  # Outer.a: 30/140 of it
    assert str(prof) == text


def test_the_root_adds_up_to_a_span_around_the_forward_and_user_peaks_survive(
    fake: FakeAllocator,
) -> None:
    model = Outer(fake)
    with cudamem.track("step") as step, cudamem.track_modules(model) as prof:
        with cudamem.track("forward") as fwd:
            model(torch.ones(2, 4))
        fake.free(140 * KiB)
    root = prof.profile.module("Outer")
    assert root.kept.max == fwd.allocated_delta == 140 * KiB
    assert root.forward_peak.max == fwd.peak_delta == 180 * KiB
    # The profile reset the peak counter at every module entry: the user's spans still
    # see the true peak, folded back into them.
    assert step.peak_delta == 180 * KiB
    assert cudamem.max_allocated() >= 180 * KiB


def test_a_module_called_with_keywords_ends_its_backward_at_its_input(
    fake: FakeAllocator,
) -> None:
    class ByKeyword(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.first = Grad(fake, keep=4 * KiB, temp=16 * KiB)
            self.second = KeywordGrad(fake, keep=2 * KiB, temp=64 * KiB)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.second(x=self.first(x))  # type: ignore[no-any-return]

    class KeywordGrad(Grad):
        def forward(self, *, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
            return super().forward(x)

    model = ByKeyword()
    with cudamem.track_modules(model) as prof:
        model(torch.ones(3, requires_grad=True)).sum().backward()
    second = prof.profile.module("ByKeyword.second")
    assert second.backward_delta.max == 2 * KiB  # first's 4 KiB come after its end


def test_a_compiled_root_is_one_unit_and_a_function_compiled_around_the_model_is_quiet(
    fake: FakeAllocator,
) -> None:
    import torch._dynamo

    torch._dynamo.reset()
    compiled = torch.compile(nn.Sequential(nn.Linear(4, 4), nn.ReLU()), backend="eager")
    with cudamem.track_modules(compiled) as prof:
        compiled(torch.ones(2, 4))
    assert [r.name for r in prof.profile.modules] == ["OptimizedModule"]
    model = Outer(fake)
    run = torch.compile(lambda x: model(x), backend="eager")
    with cudamem.track_modules(model) as prof:
        run(torch.ones(2, 4))  # the hooks are traced away inside the compiled function
    assert prof.profile.modules == ()
    assert "no profiled module ran" in str(prof.profile)


class FailInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("backward failed")


def test_a_failed_backward_leaves_no_span_open(fake: FakeAllocator) -> None:
    from cudamem.spans import state as _spans_state

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.first = Grad(fake, keep=KiB, temp=0)
            self.second = Grad(fake, keep=KiB, temp=0)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.second(FailInBackward.apply(self.first(x)))  # type: ignore[no-any-return]

    model = Net()
    x = torch.ones(3, requires_grad=True)
    with cudamem.track_modules(model) as prof:
        with pytest.raises(RuntimeError, match="backward failed"):
            model(x).sum().backward()
        assert len(prof._open_backward) == 1  # the root's: its end never came
        model(x)  # the next forward closes what the failed backward left open
        assert prof._open_backward == {}
        assert _spans_state._open_peak == {}
    p = prof.profile
    assert p.module("Net.second").backward_calls.max == 1  # it finished before the failure
    assert p.module("Net").backward_calls.max == 0  # never finished: not recorded


def test_pause_leaves_calls_out_until_resume(fake: FakeAllocator) -> None:
    model = Outer(fake)
    with cudamem.track_modules(model) as prof:
        model(torch.ones(2, 4))
        prof.pause()
        model(torch.ones(2, 4))  # a validation pass: not profiled
        prof.resume()
        model(torch.ones(2, 4))
    outer = prof.profile.module("Outer")
    assert outer.calls.max == 2  # one step (no backward ended one): two calls, not three
    assert outer.kept.max == 2 * 140 * KiB


def test_one_backward_hook_per_node_and_no_graph_kept_alive(fake: FakeAllocator) -> None:
    """A node that bounds several calls' backwards gets one hook (a module's input node is
    its predecessor's output node, a parent's output node its last child's), and the profile
    holds no autograd node: a graph whose output the code drops dies with it."""
    import weakref

    class Box:
        def __init__(self, t: torch.Tensor) -> None:
            self.t = t

    saved: list[weakref.ref[Box]] = []

    def pack(t: torch.Tensor) -> Box:
        box = Box(t.detach())  # the saved tensor's own grad_fn would make a cycle
        saved.append(weakref.ref(box))
        return box

    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4), nn.Tanh())
    x = torch.ones(2, 4, requires_grad=True)
    with cudamem.track_modules(model) as prof:
        base = prof.hooks
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda box: box.t):
            out = model(x)
        # Nodes: the first addmm (0's start, 1's end), the first tanh (1's start, 2's
        # end), the second addmm (2's start, 3's end), the second tanh (3's start and the
        # Sequential's): 4 hooks for 9 call edges.
        assert prof.hooks - base == 4
        assert saved and all(ref() is not None for ref in saved)
        del out
        assert [ref() for ref in saved] == [None] * len(saved)
        out = model(x)
        out.sum().backward()
    p = prof.profile
    assert [p.module(f"Sequential.{i}").backward_calls.max for i in range(4)] == [1] * 4
    assert p.module("Sequential").backward_calls.max == 1

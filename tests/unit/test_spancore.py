"""The compiled span core (``native/src/spancore/``): its build entry, its switch, and that a span
through it is the span the Python path makes, field by field, in the common case and in
every case it hands back to Python."""

from __future__ import annotations

import contextlib
import gc
import importlib.util
import os
import subprocess
import sys
import sysconfig
import threading
import weakref
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import pytest

import cudamem
from cudamem.allocator import backend as _backend
from cudamem.base.data import to_data
from cudamem.native import cext as _cext
from cudamem.native import fastread as _fastread
from cudamem.native import spancore as _spancore
from cudamem.spans import python_path as _spans_python_path
from cudamem.spans import raw as _spans_raw
from cudamem.spans import span as _span
from cudamem.spans import state as _spans_state

from ..conftest import compiled_span_core, python_edges
from ..fakes import FakeAllocator

MiB = 1024**2
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
needs_cc = pytest.mark.skipif(_cext.compiler() is None, reason="no C compiler here")


@pytest.fixture
def core() -> Any:
    """The compiled core's state for this ``cudamem.spans`` (checked as the switch checks it)."""
    core = _span._core_check(compiled_span_core())
    assert not isinstance(core, str), core
    return core


@pytest.fixture
def paths() -> Iterator[Callable[[bool], None]]:
    """``use(True)``: spans through the core from now on; ``use(False)``: through Python."""
    module = compiled_span_core()
    with contextlib.ExitStack() as stack:

        def use(compiled: bool) -> None:
            stack.enter_context(_span._serving(module if compiled else None))

        yield use


# -- the build -----------------------------------------------------------------------


@needs_cc
def test_the_build_entry_compiles_a_module_with_the_calls_span_py_makes(tmp_path: Any) -> None:
    name = "_cudamem_spancore_test"
    path = str(tmp_path / f"{name}.so")
    _spancore.EXTENSION.build(path, name)
    module = _fastread.load_library(path, name)
    assert _spancore.EXTENSION.check(module) is None
    assert "init" in dir(module)
    # A span module's functions are its state's, not the module's.
    assert not {"open", "close", "make", "columns"} & set(dir(module))


def test_a_module_without_the_calls_is_refused() -> None:
    class Empty:
        open = None

    assert _spancore.EXTENSION.check(Empty()) == "the compiled span core lacks init"


def test_each_extension_builds_its_own_c_files_and_names_what_it_lacks() -> None:
    from cudamem.native import heapscan as _heapscan

    src = os.path.join(ROOT, "cudamem", "native", "src")
    assert _spancore.EXTENSION.source == os.path.join(src, "spancore")
    assert _heapscan.EXTENSION.source == os.path.join(src, "heapscan")
    for ext in (_spancore.EXTENSION, _heapscan.EXTENSION):
        assert any(name.endswith(".c") for name in os.listdir(ext.source))

    class Partial:
        scan = edges = staticmethod(lambda *a: None)

    # The exports are checked before the heap pass's own check runs (it would call them).
    assert _heapscan.EXTENSION.check(Partial()) == (
        "the compiled heap pass lacks edges_info, instances, gc_instances, module_dicts"
    )


def test_a_build_is_named_by_its_compiler_flags_too(monkeypatch: pytest.MonkeyPatch) -> None:
    """A build made with other flags (an older release's) is never loaded for this one."""
    name, path = _spancore.EXTENSION.paths()
    assert name.startswith("_cudamem_spancore_") and path.endswith(
        name + (sysconfig.get_config_var("EXT_SUFFIX") or ".so")
    )
    flags = _cext._flags()
    monkeypatch.setattr(_cext, "_flags", lambda: [*flags, "-DCUDAMEM_OTHER"])
    other_name, other_path = _spancore.EXTENSION.paths()
    assert other_name != name and other_path != path
    assert os.path.dirname(other_path) == os.path.dirname(path)


def test_init_refuses_a_type_whose_fields_are_not_slots() -> None:
    class NoSlots:
        pass

    module = compiled_span_core()
    table = list(_span._core_table())
    table[0] = NoSlots
    with pytest.raises(TypeError, match=r"NoSlots\.name is not a slot"):
        module.init(tuple(table))
    # The real types still pass (the refusal changed nothing).
    assert not isinstance(_span._core_check(module), str)


def _run(code: str, **env: str) -> str:
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": ROOT, **env},
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


SWITCH = """
import cudamem
from cudamem.allocator import backend as _backend
from cudamem.native import spancore as _spancore
from cudamem.spans import span
from tests.fakes import FakeAllocator
with _backend.use(FakeAllocator()):
    with cudamem.track("first"):
        pass
    _spancore.EXTENSION.wait()
    with cudamem.track("second"):
        pass
    with cudamem.track("third") as s:
        pass
print(_spancore.status().state, span._open is span._py_open,
      type(span.MemorySpan.__dict__["__enter__"]).__name__, s.allocated_delta)
"""


def test_switched_off_by_its_variable_every_span_stays_python() -> None:
    out = _run(SWITCH, CUDAMEM_FAST_SPAN="0")
    assert out == "disabled True function 0"


@needs_cc
def test_the_spans_after_the_build_open_and_close_through_the_core() -> None:
    out = _run(SWITCH)
    assert out == "active False SpanMethod 0"


# -- one core state per span module ----------------------------------------------------


def _machinery(package: str) -> SimpleNamespace:
    """The span machinery of ``package`` (``cudamem.spans`` or a copy) as one namespace: its
    span, state and raw modules' names."""
    names = SimpleNamespace()
    for leaf in ("raw", "state", "span"):
        module = importlib.import_module(f"{package}.{leaf}")
        names.__dict__.update({k: v for k, v in vars(module).items() if not k.startswith("__")})
    return names


@pytest.fixture
def second_span() -> Iterator[SimpleNamespace]:
    """A second span machinery in this process, as ``importlib.reload``, an autoreload or an
    in-process pytester run makes one: the whole ``cudamem.spans`` package executed again
    under another name (registered for the test, then forgotten)."""
    name = "cudamem._spans_second"
    folder = os.path.dirname(_span.__file__)
    spec = importlib.util.spec_from_file_location(
        name, os.path.join(folder, "__init__.py"), submodule_search_locations=[folder]
    )
    assert spec is not None and spec.loader is not None
    package = importlib.util.module_from_spec(spec)
    sys.modules[name] = package
    try:
        spec.loader.exec_module(package)
        machinery = _machinery(name)
        assert machinery.MemorySpan is not _span.MemorySpan
        yield machinery
    finally:
        for key in [k for k in sys.modules if k == name or k.startswith(name + ".")]:
            del sys.modules[key]


def _spy(calls: list[str], edge: str, real: Callable[..., Any]) -> Callable[..., Any]:
    def call(*args: Any, **kwargs: Any) -> Any:
        calls.append(edge)
        return real(*args, **kwargs)

    return call


def test_two_span_modules_in_one_process_each_keep_their_own_core(
    second_span: SimpleNamespace, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each span module's spans open and close in C with that module's types, stack, hooks
    and finished queue, and the first module's spans keep all of them after the core is
    initialised for the second."""
    module = compiled_span_core()
    first = _machinery("cudamem.spans")
    seen: dict[str, list[Any]] = {"first": [], "second": []}
    for span_module, key in ((first, "first"), (second_span, "second")):
        monkeypatch.setattr(span_module.STATE, "finished_sink", lambda: None)
        monkeypatch.setattr(span_module.STATE, "finished_at", 10**6)
        span_module.add_exit_hook(seen[key].append)
    queued = len(first.finished)
    calls: list[str] = []
    fake = FakeAllocator(devices=1)
    try:
        with _backend.use(fake), first._serving(module):
            with first.track("first-before"):
                fake.alloc(MiB)
            with second_span._serving(module):
                for span_module, key in ((first, "first"), (second_span, "second")):
                    for edge in ("py_open", "py_close"):
                        real = getattr(span_module.STATE, edge)
                        spy = _spy(calls, f"{key}{edge}", real)
                        monkeypatch.setattr(span_module.STATE, edge, spy)
                with first.track("first") as a, second_span.track("second") as b:
                    fake.alloc(2 * MiB)
                with second_span.MemorySpan("second-class") as c:
                    fake.free(MiB)
                with first.MemorySpan("first-class") as d:
                    fake.free(MiB)
            with first.track("first-after") as e:
                fake.alloc(MiB)
    finally:
        first.remove_exit_hook(seen["first"].append)
        second_span.remove_exit_hook(seen["second"].append)
    assert calls == []  # every span opened and closed in C
    for span_module, spans in ((first, (a, d, e)), (second_span, (b, c))):
        for span in spans:
            assert type(span) is span_module.MemorySpan
            assert type(span._raw) is span_module.RawSpan
            assert span._raw.top_level and span._raw.parent is None
    names = ["first-before", "first", "first-class", "first-after"]
    assert [r.name for r in seen["first"]] == names
    assert [r.name for r in seen["second"]] == ["second", "second-class"]
    assert [r.name for r in list(first.finished)[queued:]] == names
    assert [r.name for r in second_span.finished] == ["second", "second-class"]
    assert (a.allocated_delta, b.allocated_delta, c.allocated_delta, d.allocated_delta) == (
        2 * MiB,
        2 * MiB,
        -MiB,
        -MiB,
    )
    assert not a._raw.children and not b._raw.children
    assert first._top.get() is None and second_span._top.get() is None


def test_a_state_outlives_its_owner_and_is_collected_in_a_cycle() -> None:
    """The functions the span machinery installs hold their state; a state that only a cycle
    keeps (it holds a container of its table that holds it) is collected."""
    module = compiled_span_core()
    core = _span._core_check(module)
    assert not isinstance(core, str)
    open_, close = core.open, core.close
    del core
    gc.collect()
    with _backend.use(FakeAllocator()):
        raw = open_("kept", None, False, False, False, False, False, hooks=False)
        close(raw, None, hooks=False)
    assert type(raw) is _spans_raw.RawSpan and raw.closed and raw.alloc_delta == 0

    class Marker:
        pass

    # A state kept only by a container of its own table, which holds the state.
    table = list(_span._core_table())
    open_peak: dict[Any, Any] = {}
    table[next(i for i, x in enumerate(table) if x is _spans_state._open_peak)] = open_peak
    open_peak["marker"] = marker = Marker()
    gone = weakref.ref(marker)
    open_peak["state"] = module.init(tuple(table))
    del table, open_peak, marker
    gc.collect()
    assert gone() is None


def test_the_state_s_span_methods_hand_any_other_call_to_python(
    core: Any, paths: Callable[[bool], None]
) -> None:
    assert core.enter.__get__(None, _span.MemorySpan) is core.enter
    assert (core.enter.__name__, core.exit.__qualname__) == ("__enter__", "MemorySpan.__exit__")
    assert "MemorySpan.__enter__" in repr(core.enter) and core.exit.__doc__
    for args in [(), (object(),)]:  # no span, or not a MemorySpan: what Python answers
        errors = []
        for method in (core.enter, _span._py_span_enter):
            with pytest.raises(Exception) as info:
                method(*args)
            errors.append((type(info.value), str(info.value)))
        assert errors[0] == errors[1]
    paths(True)
    with _backend.use(FakeAllocator()) as fake:
        span = cudamem.MemorySpan("called")
        assert span.__enter__() is span  # an explicit call: unbound, the span first
        fake.alloc(MiB)
        span.__exit__(None, None, tb=None)  # a keyword: the Python method closes it
        with pytest.raises(TypeError):
            cudamem.MemorySpan("odd").__exit__(None)  # as the Python method refuses it
        other = cudamem.MemorySpan("bound")
        enter, exit_ = other.__enter__, other.__exit__  # bound, as a with block binds them
        assert enter.__self__ is other and exit_.__func__ is _span.MemorySpan.__exit__
        assert "bound MemorySpan.__enter__ of" in repr(enter)
        with pytest.raises(TypeError):
            enter(1)  # as the Python method refuses it
        assert enter() is other and not other.closed
        with pytest.raises(TypeError):
            exit_(None)
        exit_(None, None, None)
    assert span.closed and span.allocated_delta == MiB
    assert other.closed and _spans_state._top.get() is None


# -- the same spans ------------------------------------------------------------------


def _clock(key: str) -> bool:
    """A field that differs between any two runs (a clock), left out of the comparison."""
    return any(word in key for word in ("duration", "started", "time", "_s"))


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items() if not _clock(k)}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _nested(fake: FakeAllocator) -> list[Any]:
    fake.alloc(100 * MiB)
    with cudamem.track("outer") as outer:
        fake.alloc(50 * MiB)
        with cudamem.track("inner"):
            fake.alloc(300 * MiB)
            fake.free(300 * MiB)
        with cudamem.track("quiet", peak=False):
            fake.alloc(1 * MiB)
        fake.free(51 * MiB)
    return [outer]


def _raised(fake: FakeAllocator) -> list[Any]:
    spans = []
    for kind in (ValueError, KeyError):
        try:
            with cudamem.track("boom") as span:
                fake.alloc(8 * MiB)
                raise kind("no")
        except kind:
            pass
        spans.append(span)
    return spans


def _decorated(fake: FakeAllocator) -> list[Any]:
    @cudamem.track("fn")
    def fn(n: int) -> int:
        fake.alloc(n)
        return n

    @cudamem.track("gen")
    def gen() -> Iterator[int]:
        for i in range(3):
            fake.alloc(MiB)
            yield i

    with cudamem.track("around") as around:
        fn(3 * MiB)
        assert list(gen()) == [0, 1, 2]
    return [around]


def _many_children(fake: FakeAllocator) -> list[Any]:
    with cudamem.track("parent") as parent:
        for _ in range(_spans_state.MAX_CHILDREN + 3):
            with cudamem.track("child"):
                fake.alloc(1)
    return [parent]


def _named_device(fake: FakeAllocator) -> list[Any]:
    with cudamem.track("dev0", device=0) as a:
        fake.alloc(2 * MiB)
    with cudamem.MemorySpan("", device="cuda:0") as b:  # "" reads as "span"
        fake.free(2 * MiB)
    return [a, b]


def _history(fake: FakeAllocator) -> list[Any]:
    for i in range(_spans_state.FINISHED_AT + 5):
        with cudamem.track("loop"):
            fake.alloc(i % 3)
    return [cudamem.history()]


SCENARIOS = [_nested, _raised, _decorated, _many_children, _named_device, _history]


@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda f: f.__name__.strip("_"))
def test_the_core_makes_the_spans_python_makes(
    scenario: Callable[[FakeAllocator], list[Any]], paths: Callable[[bool], None]
) -> None:
    runs = []
    for compiled in (False, True):
        paths(compiled)
        cudamem.clear_history()
        _spans_state._reset_state()
        fake = FakeAllocator(devices=1)
        with _backend.use(fake):
            results = scenario(fake)
        runs.append([_plain(to_data(r)) for r in results])
    assert runs[0] == runs[1]


def test_the_core_serves_the_common_span_itself(paths: Callable[[bool], None]) -> None:
    """One device, settled: no call of the Python open or close."""
    paths(True)
    fake = FakeAllocator(devices=1)
    with python_edges() as calls, _backend.use(fake):
        with cudamem.track("common") as common:
            fake.alloc(MiB)
        assert calls == []
        fake.count = 2  # device 1 has no context: the devices are not settled
        with cudamem.track("unsettled") as unsettled:
            fake.alloc(MiB)
        assert calls == ["open", "close"]
    assert common.allocated_delta == MiB and unsettled.allocated_delta == MiB


# -- what the core hands back, and hostile neighbours ---------------------------------


class OddReader(FakeAllocator):
    """A C-level reader that answers lists, not tuples: the core hands the span to Python."""

    def __init__(self) -> None:
        super().__init__(devices=1)
        self.fast_counters = self.fast_reset = self._list  # type: ignore[assignment]

    def _list(self, device: int) -> list[int]:
        a = self.allocated[device]
        return [a, self.reserved[device], self.peak[device]]


class RaisingReader(FakeAllocator):
    """A C-level reader that raises: the methods answer instead."""

    def __init__(self) -> None:
        super().__init__(devices=1)
        self.fast_counters = self.fast_reset = self._raise  # type: ignore[assignment]

    def _raise(self, device: int) -> tuple[int, int, int]:
        raise RuntimeError("reader went away")


@pytest.mark.parametrize("backend", [OddReader, RaisingReader])
def test_odd_or_failing_readers_give_the_same_span_on_both_paths(
    backend: type[FakeAllocator], paths: Callable[[bool], None]
) -> None:
    deltas = []
    for compiled in (False, True):
        paths(compiled)
        fake = backend()
        with _backend.use(fake):
            fake.alloc(MiB)
            with cudamem.track("s") as span:
                fake.alloc(3 * MiB)
        deltas.append((span.allocated_delta, span.peak, span.record.notes))
    assert deltas[0] == deltas[1] == (3 * MiB, 4 * MiB, ())


def test_a_hook_that_interrupts_propagates_and_the_next_span_is_clean(
    paths: Callable[[bool], None],
) -> None:
    paths(True)

    def interrupt(raw: Any) -> None:
        if raw.name == "stop":
            raise KeyboardInterrupt

    _spans_state.add_exit_hook(interrupt)
    try:
        with _backend.use(FakeAllocator()):
            with pytest.raises(KeyboardInterrupt), cudamem.track("stop"):
                pass
            with cudamem.track("after") as after:
                pass
    finally:
        _spans_state.remove_exit_hook(interrupt)
    assert after.closed and after.allocated_delta == 0
    assert _spans_state._top.get() is None


def test_threads_open_and_close_through_the_core_without_losing_a_peak(
    paths: Callable[[bool], None],
) -> None:
    paths(True)
    fake = FakeAllocator()
    barrier = threading.Barrier(4)
    peaks: list[int | None] = []
    lock = threading.Lock()

    def work(n: int) -> None:
        barrier.wait()
        for _ in range(200):
            with cudamem.track(f"t{n}") as span:
                pass
            with lock:
                peaks.append(span.peak)

    with _backend.use(fake):
        fake.alloc(5 * MiB)
        threads = [threading.Thread(target=work, args=(n,)) for n in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert peaks == [5 * MiB] * 800
    assert _spans_state._open_peak == {}


def test_the_history_folds_a_batch_in_c_to_pythons_figures(
    core: Any, paths: Callable[[bool], None]
) -> None:
    """A batch of the same name with errors, unmeasured spans, spans without a peak and
    large values: the compiled fold and the Python fold give the same aggregates."""
    from cudamem.spans import history as _history

    paths(True)
    fake = FakeAllocator(devices=1)
    spans = []
    with _backend.use(fake):
        for i in range(40):
            try:
                with cudamem.track("b", peak=i % 3 != 0) as span:
                    fake.alloc((i % 7) * MiB << 20)  # up to 6 TiB: big ints
                    if i % 5 == 0:
                        raise ValueError(i)
                    fake.free((i % 4) * MiB)
            except ValueError:
                pass
            spans.append(span._raw)
    spans.append(_spans_python_path._py_open("unmeasured", None, False, False, False, False, False))
    _spans_python_path._py_close(spans[-1], None)  # settled devices, so measured; drop its after:
    spans[-1].after = ()
    compiled, python = _history._Aggregate(), _history._Aggregate()
    assert core.columns(spans) is not None
    compiled.add(spans)
    with _span._serving(None):
        python.add(spans)
    assert compiled.freeze("b") == python.freeze("b")
    assert compiled.freeze("b").errors == 8 and compiled.freeze("b").measured == 40


def test_the_compiled_fold_refuses_what_it_does_not_read(core: Any) -> None:
    assert core.columns([]) is None
    assert core.columns([object()]) is None
    assert core.columns(("not", "a list")) is None
    raw = _spans_python_path._py_open("x", None, False, False, False, False, False, hooks=False)
    # Open, never closed: its exit fields are unset.
    assert core.columns([raw]) is None
    _spans_python_path._py_close(raw, None, hooks=False)
    assert core.columns([raw]) is not None
    raw.alloc_delta = 2**70  # past 64 bits: Python's ints fold it
    assert core.columns([raw]) is None

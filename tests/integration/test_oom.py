"""OOM post-mortems from simulated ``torch.OutOfMemoryError``s, through the fake allocator."""

from __future__ import annotations

import os
import sys
import threading
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import cudamem
from cudamem import on_oom, oom_report
from cudamem.allocator import backend as _backend
from cudamem.base.data import to_data
from cudamem.ledger.oom import _advice, parse_oom_message

from ..fakes import FakeAllocator

MiB = 1024**2
GiB = 1024**3

#: PyTorch 2.x's message for ``torch.empty(200 GiB)`` on an H200 (CUDACachingAllocator.cpp).
MESSAGE = (
    "CUDA out of memory. Tried to allocate 200.00 GiB. GPU 0 has a total capacity of 139.81 GiB "
    "of which 138.52 GiB is free. Including non-PyTorch memory, this process has 1.28 GiB "
    "memory in use. Of the allocated memory 768.00 MiB is allocated by PyTorch, and 20.00 MiB "
    "is reserved by PyTorch but unallocated. If reserved but unallocated memory is large try "
    "setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  See "
    "documentation for Memory Management  "
    "(https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)"
)
#: PyTorch < 2.1.
OLD_MESSAGE = (
    "CUDA out of memory. Tried to allocate 20.00 MiB (GPU 0; 10.76 GiB total capacity; 9.50 GiB "
    "already allocated; 11.69 MiB free; 9.81 GiB reserved in total by PyTorch) If reserved "
    "memory is >> allocated memory try setting max_split_size_mb to avoid fragmentation."
)
#: A fragmented cache: 60 MiB free in the cache, but no block larger than 20 MiB.
FRAG_MESSAGE = (
    "CUDA out of memory. Tried to allocate 40.00 MiB. GPU 0 has a total capacity of 139.81 GiB "
    "of which 0 bytes is free. Of the allocated memory 139.00 GiB is allocated by PyTorch, and "
    "60.00 MiB is reserved by PyTorch but unallocated."
)

#: The fake allocator of ``test_fragmentation_and_stranded_streams`` as its message says it.
HERE_MESSAGE = (
    "CUDA out of memory. Tried to allocate 40.00 MiB. GPU 0 has a total capacity of 79.19 GiB "
    "of which 0 bytes is free. Of the allocated memory 100.00 MiB is allocated by PyTorch, and "
    "124.00 MiB is reserved by PyTorch but unallocated."
)

big_holder: list[torch.Tensor] = []


class OomFake(FakeAllocator):
    """A fake GPU with snapshot segments, an observer seam and history recording."""

    storages = "cpu"

    def __init__(self) -> None:
        super().__init__(devices=1, contexts=(0,))
        self.segments: list[dict[str, Any]] = []
        self.observers: list[Callable[[int, int, int, int], None]] = []
        self.history: list[tuple[bool, int]] = []
        self.recording = False

    def memory_segments(self, device: int) -> list[dict[str, Any]] | None:
        return self.segments

    def attach_oom_observer(self, observer: Callable[[int, int, int, int], None]) -> bool:
        self.observers.append(observer)
        return True

    def set_history(
        self, enabled: bool, max_entries: int, still_wanted: Callable[[], bool] | None
    ) -> bool:
        # Like torch.cuda._lazy_call once CUDA is initialised: the request runs at once,
        # and checks still_wanted() first (a guard not yet installed gets nothing).
        if enabled and still_wanted is not None and not still_wanted():
            return True
        self.history.append((enabled, max_entries))
        self.recording = enabled
        return True

    def is_recording_history(self) -> bool:
        return self.recording

    def history_snapshot(self) -> dict[str, Any] | None:
        if not self.recording or not big_holder:
            return None
        ptr = big_holder[0].untyped_storage().data_ptr()
        frames = [
            {"filename": torch.__file__, "line": 1, "name": "empty"},
            {"filename": "/home/u/train.py", "line": 42, "name": "build"},
        ]
        block = {"address": ptr, "size": 64 * MiB, "state": "active_allocated", "frames": frames}
        return {"segments": [{"device": 0, "blocks": [block]}]}


def segment(stream: int, blocks: list[tuple[str, int]]) -> dict[str, Any]:
    return {
        "device": 0,
        "stream": stream,
        "total_size": sum(size for _, size in blocks),
        "allocated_size": sum(size for state, size in blocks if state == "active_allocated"),
        "blocks": [{"state": state, "size": size, "address": 0} for state, size in blocks],
    }


@pytest.fixture
def fake() -> Iterator[OomFake]:
    from cudamem.ledger import oom
    from cudamem.ledger import oom_guard as _oom_guard

    alloc = OomFake()
    big_holder.clear()
    _oom_guard._last_key = None
    oom._events.clear()
    cudamem.configure_leaks()
    with _backend.use(alloc):
        yield alloc
    if _oom_guard._guard is not None:
        _oom_guard._guard.uninstall()
    big_holder.clear()
    _oom_guard._last_key = None


def make_oom(message: str = MESSAGE) -> torch.OutOfMemoryError:
    return torch.OutOfMemoryError(message)


# --------------------------------------------------------------------------- parsing


def test_parse_current_message() -> None:
    p = parse_oom_message(MESSAGE)
    assert p.requested == 200 * GiB
    assert p.device == 0
    assert p.total == round(139.81 * GiB)
    assert p.free == round(138.52 * GiB)
    assert p.process_in_use == round(1.28 * GiB)
    assert p.allocated == 768 * MiB
    assert p.reserved_unallocated == 20 * MiB


def test_parse_old_message() -> None:
    p = parse_oom_message(OLD_MESSAGE)
    assert p.requested == 20 * MiB
    assert p.device == 0
    assert p.total == round(10.76 * GiB)
    assert p.allocated == round(9.5 * GiB)
    assert p.free == round(11.69 * MiB)
    assert p.reserved_unallocated == round(9.81 * GiB) - round(9.5 * GiB)


def test_parse_other_processes_and_garbage() -> None:
    text = MESSAGE.replace(
        "Including non-PyTorch memory, this process",
        "Process 4242 has 3.00 GiB memory in use. Including non-PyTorch memory, this process",
    )
    assert parse_oom_message(text).processes == ((4242, 3 * GiB),)
    empty = parse_oom_message("something else entirely")
    assert empty.requested is None and empty.device is None


# --------------------------------------------------------------------------- the report


def test_report_names_largest_holder_and_advice(fake: OomFake) -> None:
    big_holder.append(torch.zeros(16 * MiB // 4))  # 16 MiB on the "GPU"
    fake.alloc(768 * MiB)
    report = oom_report(make_oom())
    assert report.requested == 200 * GiB
    assert report.device == 0
    assert report.allocated == 768 * MiB
    top = report.storages[0]
    assert top.nbytes == 16 * MiB
    assert top.paths[0] == "tests.integration.test_oom.big_holder[0]"
    assert "more than the GPU has" in report.advice[0]
    text = str(report)
    assert "tried to allocate 200.0 GiB" in text
    assert "tests.integration.test_oom.big_holder[0]" in text
    data = to_data(report)
    assert [h["path"] for h in data["storages"][0]["holders"]["holders"]] == [
        "tests.integration.test_oom.big_holder[0]"
    ]
    assert data["storages"][0]["nbytes"] == 16 * MiB
    assert data["culprits"][0]["holder"] == "tests.integration.test_oom.big_holder"
    assert data["requested"] == 200 * GiB


def test_report_groups_the_largest_storages_by_container(fake: OomFake) -> None:
    for _ in range(3):
        big_holder.append(torch.empty(24 * MiB, dtype=torch.uint8))  # pages never touched
    fake.alloc(768 * MiB)
    report = oom_report(make_oom(OLD_MESSAGE))  # a request that fits: advice on holders
    top = report.culprits[0]
    assert (top.holder, top.items, top.storages, top.nbytes) == (
        "tests.integration.test_oom.big_holder",
        3,
        3,
        72 * MiB,
    )
    held = "3 items of tests.integration.test_oom.big_holder hold 72.0 MiB"
    assert any(held in a for a in report.advice)
    text = str(report)
    assert "held by:\n  tests.integration.test_oom.big_holder: 3 tensors, 72.0 MiB" in text


def test_report_names_the_container_that_keeps_graphs(fake: OomFake) -> None:
    w = torch.randn(2 * MiB, requires_grad=True)  # 8 MiB: each loss saves a sigmoid of it
    for _ in range(3):
        big_holder.append(torch.sigmoid(w * 2).sum())
    fake.alloc(768 * MiB)
    report = oom_report(make_oom(OLD_MESSAGE))
    graph = [c for c in report.culprits if c.holder == "tests.integration.test_oom.big_holder"]
    assert graph and graph[0].autograd_bytes >= 3 * 8 * MiB
    assert any(
        a.startswith("tests.integration.test_oom.big_holder keeps autograd graphs alive")
        for a in report.advice
    )


def test_fragmentation_and_stranded_streams(fake: OomFake) -> None:
    fake.alloc(100 * MiB)
    fake.segments = [
        segment(0, [("active_allocated", 20 * MiB), ("inactive", 20 * MiB)]),
        segment(0, [("active_allocated", 20 * MiB), ("inactive", 20 * MiB)]),
        segment(0, [("active_allocated", 20 * MiB), ("inactive", 20 * MiB)]),
        segment(0x7F00, [("inactive", 64 * MiB)]),  # a stream with no live block
    ]
    fake.reserved[0] = 100 * MiB + 124 * MiB
    report = oom_report(make_oom(HERE_MESSAGE))
    assert (report.allocated, report.reserved) == (100 * MiB, 224 * MiB)
    assert report.largest_free_block == 64 * MiB
    assert report.fragmentation == pytest.approx(1 - 64 / 124)
    assert [(s.stream, s.reserved) for s in report.stranded] == [(0x7F00, 64 * MiB)]
    assert any("cached on 1 stream with no live tensor" in a for a in report.advice)
    assert "stranded cache: 64.0 MiB on stream 0x7f00" in str(report)


def test_a_message_from_another_allocator_is_not_mixed_with_this_one(fake: OomFake) -> None:
    """A message from another process (or before memory was freed): its card and its
    allocator's figures, never this allocator's reserved bytes or free blocks beside them."""
    fake.alloc(100 * MiB)
    fake.segments = [segment(0, [("active_allocated", 20 * MiB), ("inactive", 20 * MiB)])]
    fake.reserved[0] = 3 * GiB
    report = oom_report(make_oom(FRAG_MESSAGE))
    assert report.total == round(139.81 * GiB)
    assert report.allocated == 139 * GiB and report.reserved == 139 * GiB + 60 * MiB
    assert report.largest_free_block is None and report.fragmentation is None
    assert report.inactive_split is None and report.stranded == ()
    assert any("the allocator now holds 3.0 GiB, not the 139.1 GiB" in n for n in report.notes)
    assert "3.0 GiB" not in str(report).split("note")[0]


#: A message that states what PyTorch allocated but not what it reserved (a trimmed or
#: reworded message: the "reserved by PyTorch but unallocated" clause cut off).
NO_RESERVED_MESSAGE = (
    "CUDA out of memory. Tried to allocate 40.00 MiB. GPU 0 has a total capacity of 139.81 GiB "
    "of which 0 bytes is free. Including non-PyTorch memory, this process has 1.00 GiB memory "
    "in use. Of the allocated memory 100.00 MiB is allocated by PyTorch."
)


def test_a_message_without_reserved_bytes_keeps_the_allocators_own(fake: OomFake) -> None:
    """The message's allocated bytes, the live reserved bytes beside them (said so), and the
    process's non-PyTorch bytes counted against what is reserved, not only allocated."""
    fake.alloc(100 * MiB)
    fake.reserved[0] = 224 * MiB
    report = oom_report(make_oom(NO_RESERVED_MESSAGE))
    assert (report.allocated, report.reserved) == (100 * MiB, 224 * MiB)
    assert report.inactive_split is None
    assert any("states no reserved bytes" in n for n in report.notes)
    assert report.non_pytorch == 1 * GiB - 224 * MiB


def test_a_message_without_reserved_bytes_from_a_larger_allocator_keeps_none(
    fake: OomFake,
) -> None:
    # this allocator reserves less than the message's allocated: another allocator failed
    fake.alloc(10 * MiB)
    fake.reserved[0] = 20 * MiB
    report = oom_report(make_oom(NO_RESERVED_MESSAGE.replace("100.00 MiB is", "2.00 GiB is")))
    assert report.allocated == 2 * GiB and report.reserved is None
    assert not any("states no reserved bytes" in n for n in report.notes)


def test_fragmentation_advice() -> None:
    advice = _advice(
        requested=40 * MiB,
        total=80 * GiB,
        free=0,
        cache=60 * MiB,
        largest_free=20 * MiB,
        stranded=(),
        culprits=(),
        others=None,
        non_pytorch=None,
    )
    assert "expandable_segments:True" in advice[0]


def frag_advice(requested: int, free: int, *, expandable: bool = False) -> list[str]:
    """The advice for 60 MiB cached in 20 MiB pieces, 1 GiB reserved of a 1.1 GiB limit."""
    advice = _advice(
        requested=requested,
        total=GiB + 100 * MiB,
        free=free,
        cache=60 * MiB,
        largest_free=20 * MiB,
        stranded=(),
        culprits=(),
        others=None,
        non_pytorch=None,
        reserved=GiB,
        expandable=expandable,
    )
    return [a for a in advice if a.startswith("Fragmentation")]


def test_fragmentation_advice_counts_the_device_headroom_and_names_expandable() -> None:
    # 80 MiB: more than the cache, within the cache plus what the limit leaves (100 MiB)
    (advice,) = frag_advice(80 * MiB, 50 * GiB)
    assert advice.endswith("PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True.")
    # the limit, not the device's free memory, caps the headroom: 161 MiB is beyond both
    assert frag_advice(161 * MiB, 50 * GiB) == []
    assert frag_advice(80 * MiB, 10 * MiB) == []  # the device has only 10 MiB free
    (already,) = frag_advice(80 * MiB, 50 * GiB, expandable=True)
    assert "Expandable segments are on already" in already
    assert "PYTORCH_CUDA_ALLOC_CONF" not in already


def test_report_uses_observer_facts(fake: OomFake) -> None:
    on_oom(stderr=False)
    (observer,) = fake.observers
    observer(0, 3 * GiB, 80 * GiB, 1 * GiB)  # what malloc reports before raising
    report = oom_report(make_oom("CUDA out of memory (no details)"))
    assert (report.requested, report.total, report.free) == (3 * GiB, 80 * GiB, GiB)
    assert cudamem.ledger.oom_guard._guard is not None  # type: ignore[attr-defined]


def test_oom_report_refuses_other_errors(fake: OomFake) -> None:
    with pytest.raises(ValueError, match="not an out-of-memory error"):
        oom_report(ValueError("x"))


def test_report_without_census(fake: OomFake, monkeypatch: pytest.MonkeyPatch) -> None:
    from cudamem.holders import census

    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("census exploded")

    monkeypatch.setattr(census, "live_storages", broken)
    report = oom_report(make_oom())
    assert report.storages == ()
    assert any("census" in n for n in report.notes)


# --------------------------------------------------------------------------- spans


def test_oom_in_span_reports_once_and_reraises_unchanged(
    fake: OomFake, capsys: pytest.CaptureFixture[str]
) -> None:
    big_holder.append(torch.zeros(MiB))
    exc = make_oom()
    with pytest.raises(torch.OutOfMemoryError) as info:  # noqa: SIM117
        with cudamem.track("outer"):
            with cudamem.track("train_step"):
                raise exc
    assert info.value is exc
    assert str(info.value) == MESSAGE
    err = capsys.readouterr().err
    assert err.count("=== cudamem OOM post-mortem") == 1
    assert "span 'train_step'" in err
    assert "tests.integration.test_oom.big_holder[0]" in err


def test_span_reports_can_be_turned_off(fake: OomFake, capsys: pytest.CaptureFixture[str]) -> None:
    cudamem.configure_leaks(span_oom_reports=False)
    with pytest.raises(torch.OutOfMemoryError), cudamem.track("s"):
        raise make_oom()
    assert "post-mortem" not in capsys.readouterr().err


def test_other_errors_in_spans_are_not_reported(
    fake: OomFake, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(ValueError), cudamem.track("s"):
        raise ValueError("not memory")
    assert capsys.readouterr().err == ""


def test_span_report_goes_to_the_guards_file(fake: OomFake, tmp_path: Path) -> None:
    guard = on_oom(tmp_path / "oom-{pid}.txt", stderr=False)
    with pytest.raises(torch.OutOfMemoryError), cudamem.track("s"):
        raise make_oom()
    path = tmp_path / f"oom-{os.getpid()}.txt"
    assert "tried to allocate 200.0 GiB" in path.read_text()
    assert guard.last_report is not None and guard.last_report.file == str(path)


# --------------------------------------------------------------------------- hooks


def test_hooks_installed_and_restored(fake: OomFake) -> None:
    before_sys, before_thread = sys.excepthook, threading.excepthook
    guard = on_oom(stderr=False)
    assert guard.installed
    assert sys.excepthook is not before_sys
    assert threading.excepthook is not before_thread
    guard.uninstall()
    assert sys.excepthook is before_sys
    assert threading.excepthook is before_thread
    assert not guard.installed
    guard.uninstall()  # twice is harmless


def test_excepthook_reports_then_forwards_unchanged(
    fake: OomFake, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    seen: list[tuple[Any, ...]] = []
    previous = sys.excepthook
    sys.excepthook = lambda *args: seen.append(args)
    try:
        big_holder.append(torch.zeros(MiB))
        guard = on_oom(tmp_path / "oom.txt")
        exc = make_oom()
        sys.excepthook(type(exc), exc, None)
        assert seen == [(type(exc), exc, None)]  # the previous hook got the same exception
        err = capsys.readouterr().err
        assert "sys.excepthook" in err and "tests.integration.test_oom.big_holder[0]" in err
        assert "tried to allocate 200.0 GiB" in (tmp_path / "oom.txt").read_text()
        guard.uninstall()
        assert sys.excepthook is not guard._sys_hook_ref
    finally:
        sys.excepthook = previous


def test_excepthook_ignores_other_errors(fake: OomFake, capsys: pytest.CaptureFixture[str]) -> None:
    previous = sys.excepthook
    sys.excepthook = lambda *args: None
    try:
        on_oom()
        sys.excepthook(ValueError, ValueError("x"), None)
        assert capsys.readouterr().err == ""
    finally:
        cudamem.ledger.oom_guard._guard.uninstall()  # type: ignore[attr-defined]
        sys.excepthook = previous


def test_thread_excepthook_reports(fake: OomFake, capsys: pytest.CaptureFixture[str]) -> None:
    previous = threading.excepthook
    seen: list[BaseException | None] = []
    threading.excepthook = lambda args: seen.append(args.exc_value)
    try:
        with on_oom():
            exc = make_oom()

            def worker() -> None:
                raise exc

            t = threading.Thread(target=worker, name="loader")
            t.start()
            t.join()
        assert seen == [exc]
        assert "threading.excepthook (loader)" in capsys.readouterr().err
        assert threading.excepthook is not None
    finally:
        threading.excepthook = previous


def test_context_manager_reports_reraises_and_uninstalls(
    fake: OomFake, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    before = sys.excepthook
    exc = make_oom()
    with pytest.raises(torch.OutOfMemoryError) as info, on_oom(tmp_path / "o.txt") as guard:
        raise exc
    assert info.value is exc
    assert not guard.installed
    assert sys.excepthook is before
    assert "on_oom() block" in capsys.readouterr().err
    assert (tmp_path / "o.txt").exists()


def test_on_oom_replaces_previous_guard(fake: OomFake) -> None:
    before = sys.excepthook
    first = on_oom(stderr=False)
    second = on_oom(stderr=False)
    assert not first.installed and second.installed
    second.uninstall()
    assert sys.excepthook is before


def test_hook_replaced_by_someone_else_stays(fake: OomFake) -> None:
    before = sys.excepthook
    guard = on_oom(stderr=False)
    ours = sys.excepthook

    def theirs(*args: Any) -> None:
        ours(*args)

    sys.excepthook = theirs
    guard.uninstall()
    assert sys.excepthook is theirs  # not ripped out of their chain
    sys.excepthook = before


def test_history_is_opt_in_bounded_and_turned_off(
    fake: OomFake, capsys: pytest.CaptureFixture[str]
) -> None:
    guard = on_oom(stderr=False)
    assert fake.history == []
    guard.uninstall()
    big_holder.append(torch.zeros(16 * MiB // 4))
    guard = on_oom(record_history=True, max_entries=5000)
    assert fake.history == [(True, 5000)]
    report = oom_report(make_oom())
    assert report.storages[0].allocated_at == "/home/u/train.py:42 in build"
    assert "[allocated at /home/u/train.py:42 in build]" in str(report)
    guard.uninstall()
    assert fake.history == [(True, 5000), (False, 0)]


def test_history_already_on_is_left_alone(fake: OomFake) -> None:
    fake.recording = True
    guard = on_oom(record_history=True)
    guard.uninstall()
    assert fake.history == []
    assert fake.recording
    assert any("already on" in n for n in guard.notes)


def test_ipython_handler_installed_and_restored(
    fake: OomFake, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    shown: list[Any] = []

    class Shell:
        custom_exceptions: tuple[type[BaseException], ...] = ()
        CustomTB: Any = "default"

        def set_custom_exc(self, exc_tuple: tuple[type, ...], handler: Any) -> None:
            self.custom_exceptions = exc_tuple
            self.CustomTB = types.MethodType(handler, self)

        def showtraceback(self, exc_info: Any, tb_offset: Any = None) -> None:
            shown.append(exc_info[1])

    shell = Shell()
    module = types.ModuleType("IPython")
    module.get_ipython = lambda: shell  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "IPython", module)
    guard = on_oom()
    assert shell.custom_exceptions == (torch.OutOfMemoryError,)
    exc = make_oom()
    shell.CustomTB(type(exc), exc, None)
    assert shown == [exc]
    assert "IPython" in capsys.readouterr().err
    guard.uninstall()
    assert shell.custom_exceptions == () and shell.CustomTB == "default"


def test_bad_arguments(fake: OomFake) -> None:
    with pytest.raises(ValueError, match="top"):
        on_oom(top=-1)
    with pytest.raises(ValueError, match="max_entries"):
        on_oom(max_entries=0)
    with pytest.raises(TypeError, match="path"):
        on_oom(file=3)  # type: ignore[arg-type]


def test_each_backend_gets_the_observer_once(fake: OomFake) -> None:
    """The allocator cannot detach an observer: one attach per backend, whichever test (or
    earlier guard) attached one to another backend first."""
    on_oom(stderr=False)
    assert len(fake.observers) == 1
    cudamem.ledger.oom_guard._guard.uninstall()  # type: ignore[attr-defined]
    on_oom(stderr=False)  # installed again on the same backend: no second observer
    assert len(fake.observers) == 1
    other = OomFake()
    with _backend.use(other):
        cudamem.ledger.oom_guard._guard.uninstall()  # type: ignore[attr-defined]
        on_oom(stderr=False)
        assert len(other.observers) == 1  # a backend of its own gets its own

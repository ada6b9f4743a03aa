"""The worker watcher's judgement on a fake ``/proc``: which loaders warn, with what text,
how often ``smaps_rollup`` is read, and loaders whose workers exit or that are abandoned."""

from __future__ import annotations

import gc
import warnings
from typing import Any

import numpy as np
import pytest

import cudamem
from cudamem.host import procfs as _procfs
from cudamem.host import workers
from cudamem.host.workers import HostMemoryWarning, WatchSettings, WorkerWatcher
from tests.procfs_fakes import FakeProc, MiB

PAGE = workers.PAGE


class Proc:
    def __init__(self, pid: int, method: str = "fork") -> None:
        self.pid = pid
        self._start_method = method


class FakeIter:
    """What the watcher reads of a ``_MultiProcessingDataLoaderIter``."""

    def __init__(
        self, dataset: object, pids: list[int], method: str = "fork", persistent: bool = False
    ) -> None:
        self._dataset = dataset
        self._workers = [Proc(p, method) for p in pids]
        self._persistent_workers = persistent


class Dicts:
    def __init__(self) -> None:
        self.items = [{"id": i, "label": i % 10} for i in range(100_000)]


class Arrays:
    def __init__(self) -> None:
        self.labels = np.arange(20_000)


def _watch(fake: FakeProc, it: Any, **settings: Any) -> WorkerWatcher:
    watcher = WorkerWatcher(WatchSettings(budget=1.0, **settings))
    watcher.register(it)
    watcher.tick()  # first readings
    return watcher


def _grow(fake: FakeProc, pids: list[int], uss: int, faults: int) -> None:
    for pid in pids:
        fake.set(pid, uss=uss, pss=uss + 60 * MiB, rss=800 * MiB, minflt=faults)


def _warnings(record: list[warnings.WarningMessage]) -> list[HostMemoryWarning]:
    return [w.message for w in record if isinstance(w.message, HostMemoryWarning)]


def test_growing_forked_workers_warn_copy_on_read_naming_the_attribute() -> None:
    fake = FakeProc()
    _grow(fake, [11, 12], 12 * MiB, 100)
    it = FakeIter(Dicts(), [11, 12])
    with _procfs.use(fake), warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        watcher = _watch(fake, it)
        _grow(fake, [11, 12], 226 * MiB, 100 + (214 * MiB) // PAGE)
        watcher.tick()
    (warning,) = _warnings(record)
    report = warning.report
    assert report is not None
    assert [w.growth for w in report.workers] == [214 * MiB, 214 * MiB]
    assert report.growth == 428 * MiB and report.cause == "copy-on-read"
    text = str(warning)
    assert "grew by 428.0 MiB in all (+214.0 MiB, +214.0 MiB per worker)" in text
    assert "cause: copy-on-read" in text
    assert "dataset.items: list of 100,000 dicts" in text
    assert "numpy arrays or tensors" in text and "serialized bytes" in text
    assert "RSS stays flat" in text
    # Once per dataset: more growth does not warn again.
    with _procfs.use(fake), warnings.catch_warnings(record=True) as again:
        warnings.simplefilter("always")
        _grow(fake, [11, 12], 300 * MiB, 100 + (300 * MiB) // PAGE)
        watcher.tick()
    assert _warnings(again) == []
    assert watcher.reports()[0].growth == 2 * 288 * MiB


def test_workers_that_do_not_grow_never_warn_and_are_not_reread() -> None:
    fake = FakeProc()
    _grow(fake, [21, 22], 11 * MiB, 50)
    with _procfs.use(fake), warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        it = FakeIter(Arrays(), [21, 22])
        watcher = _watch(fake, it)
        for _ in range(5):
            watcher.tick()
    assert _warnings(record) == []
    rollups = [r for r in fake.reads if r[1] == "smaps_rollup"]
    assert rollups == [(21, "smaps_rollup"), (22, "smaps_rollup")]  # first readings only
    (report,) = watcher.reports()
    assert report.growth == 0 and not report.warned and report.containers == ()


def test_growth_without_python_containers_needs_the_higher_threshold() -> None:
    fake = FakeProc()
    _grow(fake, [31], 10 * MiB, 0)
    with _procfs.use(fake), warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        it = FakeIter(Arrays(), [31])
        watcher = _watch(fake, it)
        _grow(fake, [31], 100 * MiB, (90 * MiB) // PAGE)
        watcher.tick()
        assert _warnings(record) == []
        _grow(fake, [31], 300 * MiB, (290 * MiB) // PAGE)
        watcher.tick()
    (warning,) = _warnings(record)
    assert "cause: the workers' own allocations" in str(warning)
    assert "cause: copy-on-read" not in str(warning) and "not copy-on-read" in str(warning)


def test_spawned_workers_are_said_to_unpickle_their_own_copy() -> None:
    fake = FakeProc()
    _grow(fake, [41, 42], 200 * MiB, 0)
    with _procfs.use(fake), warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        it = FakeIter(Dicts(), [41, 42], method="spawn")
        watcher = _watch(fake, it)
        _grow(fake, [41, 42], 260 * MiB, (60 * MiB) // PAGE)
        watcher.tick()
    (warning,) = _warnings(record)
    text = str(warning)
    assert "cause: spawn: each worker unpickled its own copy of the dataset" in text
    assert "no copy-on-read" in text and "cause: copy-on-read" not in text
    assert "(2 workers, spawn, not persistent)" in text


def test_an_exited_worker_keeps_its_last_reading_and_is_marked() -> None:
    fake = FakeProc()
    _grow(fake, [51, 52], 12 * MiB, 0)
    with _procfs.use(fake):
        it = FakeIter(Arrays(), [51, 52], persistent=True)
        watcher = _watch(fake, it)
        _grow(fake, [51], 14 * MiB, MiB // PAGE + 1)
        watcher.tick()
        fake.exit(51)
        watcher.tick()
    (report,) = watcher.reports()
    first, second = report.workers
    assert first.exited and first.last.uss == 14 * MiB and first.growth == 2 * MiB
    assert not second.exited
    assert report.live == (second,) and report.uss == 12 * MiB
    assert "persistent" in str(report) and "exited" in str(report)


def test_an_abandoned_loader_ends_and_keeps_its_report() -> None:
    fake = FakeProc()
    _grow(fake, [61], 12 * MiB, 0)
    it = FakeIter(Arrays(), [61])
    with _procfs.use(fake):
        watcher = _watch(fake, it)
        del it
        gc.collect()
        watcher.tick()
    (report,) = watcher.reports()
    assert report.ended and report.workers[0].last.uss == 12 * MiB
    assert "ended" in str(report)


def test_full_reads_wait_for_the_budget() -> None:
    fake = FakeProc()
    _grow(fake, [71], 12 * MiB, 0)
    watcher = WorkerWatcher(WatchSettings(budget=1e-9))
    it = FakeIter(Arrays(), [71])
    with _procfs.use(fake):
        watcher.register(it)
        watcher.tick()  # the first reading is always taken
        _grow(fake, [71], 40 * MiB, (28 * MiB) // PAGE)
        watcher.tick()  # due, but the budget has not come round
        assert watcher.reports()[0].workers[0].last.uss == 12 * MiB
        assert watcher.reports(refresh=True)[0].workers[0].last.uss == 40 * MiB
    assert watcher.full_reads == 2


def test_watch_workers_names_a_bad_argument() -> None:
    with pytest.raises(ValueError, match="min_growth must be a number of bytes"):
        workers.watch_workers(min_growth=-1)
    with pytest.raises(ValueError, match="budget must be a share of one core"):
        workers.watch_workers(budget=2)
    with pytest.raises((TypeError, ValueError), match="interval"):
        workers.watch_workers(interval="often")  # type: ignore[arg-type]
    assert workers.watcher() is None


def test_the_hook_registers_new_iterators_and_is_removed_by_stop() -> None:
    from torch.utils.data import dataloader

    cls = dataloader._MultiProcessingDataLoaderIter
    original = cls.__init__
    shutdown = cls._shutdown_workers
    watcher = workers.watch_workers(interval=60)
    try:
        assert cls.__init__ is not original and cls.__init__.__wrapped__ is original
        assert cls._shutdown_workers.__wrapped__ is shutdown
        assert workers.watch_workers() is watcher and watcher.running
    finally:
        assert workers.stop_watching() == ()
    assert cls.__init__ is original and cls._shutdown_workers is shutdown
    assert not watcher.running and workers.watcher() is None


def test_host_memory_warning_is_exported() -> None:
    assert cudamem.HostMemoryWarning is HostMemoryWarning
    assert issubclass(HostMemoryWarning, UserWarning)


@pytest.mark.parametrize("method", ["fork", "spawn", "forkserver"])
def test_the_start_method_is_read_off_the_workers_process_objects(method: str) -> None:
    import multiprocessing

    it = FakeIter(Arrays(), [])
    it._workers = [multiprocessing.get_context(method).Process(target=print)]  # type: ignore[list-item]
    assert workers._start_method(it) == method


def test_the_default_context_reads_the_default_start_method() -> None:
    import multiprocessing

    it = FakeIter(Arrays(), [])
    it._workers = [multiprocessing.Process(target=print)]  # type: ignore[list-item]  # no method
    assert workers._start_method(it) == multiprocessing.get_start_method()


def test_a_new_iterator_at_a_dead_ones_address_keeps_both_reports() -> None:
    fake = FakeProc()
    _grow(fake, [81, 82], 12 * MiB, 0)
    first, second = FakeIter(Arrays(), [81]), FakeIter(Arrays(), [82])
    watcher = WorkerWatcher(WatchSettings(budget=1.0))
    with _procfs.use(fake):
        watcher.register(first)
        watcher.tick()
        watcher._loaders[id(second)] = watcher._loaders.pop(id(first))  # as if freed, reused
        watcher.register(second)
        watcher.tick()
    one, two = watcher.reports()
    assert (one.number, one.ended, [w.pid for w in one.workers]) == (1, True, [81])
    assert (two.number, two.ended, [w.pid for w in two.workers]) == (2, False, [82])


class ArraysAndNames(Arrays):
    """Numpy data plus a small list (class names): too small to explain 20 MiB of growth."""

    def __init__(self) -> None:
        super().__init__()
        self.classes = [f"class {i}" for i in range(1000)]


def test_growth_that_the_containers_are_too_small_to_explain_does_not_warn() -> None:
    fake = FakeProc()
    _grow(fake, [91], 8 * MiB, 0)
    it = FakeIter(ArraysAndNames(), [91])
    with _procfs.use(fake), warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        watcher = _watch(fake, it)
        _grow(fake, [91], 28 * MiB, (20 * MiB) // PAGE)
        watcher.tick()
    assert _warnings(record) == []
    assert watcher.reports()[0].containers == ()  # 1,000 short strings: under 1 MiB


def test_later_loaders_of_a_judged_dataset_wait_for_the_budget() -> None:
    fake = FakeProc()
    _grow(fake, [111, 112], 12 * MiB, 0)
    dataset = Arrays()
    epoch1, epoch2 = FakeIter(dataset, [111]), FakeIter(dataset, [112])
    watcher = WorkerWatcher(WatchSettings(budget=1e-9))  # any read's wait outlasts the test
    with _procfs.use(fake):
        watcher.register(epoch1)
        watcher.tick()  # a new dataset's first loader: read at its start ...
        _grow(fake, [111], 14 * MiB, MiB // PAGE + 1)
        watcher.final(epoch1)  # ... and as torch shuts it down
        watcher.register(epoch2)
        watcher.tick()  # the same dataset again: the budget decides, and says wait
        watcher.final(epoch2)
    one, two = watcher.reports()
    assert one.workers[0].growth == 2 * MiB
    assert two.workers == ()
    assert watcher.full_reads == 2


def test_a_datasets_first_loader_is_read_at_its_end_whatever_the_budget() -> None:
    fake = FakeProc()
    _grow(fake, [121], 12 * MiB, 0)
    it = FakeIter(Arrays(), [121])
    watcher = WorkerWatcher(WatchSettings(budget=1e-9))
    with _procfs.use(fake):
        watcher.register(it)
        watcher.tick()
        watcher.tick(force=True)  # a second reading: the dataset counts as judged now
        _grow(fake, [121], 20 * MiB, (8 * MiB) // PAGE)
        watcher.final(it)  # torch ends the workers: still read, budget or not
    assert watcher.reports()[0].workers[0].last.uss == 20 * MiB

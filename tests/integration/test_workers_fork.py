"""Real DataLoader workers, forked (and one spawned): the watcher finds them from torch's
iterator with no change to the loop, measures their USS growth as ``/proc`` does, names the
dataset's list of dicts, and stays quiet for numpy-backed data. (Spawned workers take
seconds each to import torch here: ``tests/unit/test_workers_watch.py`` reads the start
method off real ``multiprocessing`` process objects instead.)"""

from __future__ import annotations

import gc
import warnings
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from torch.utils.data import DataLoader, Dataset

from cudamem.host import procfs as _procfs
from cudamem.host import workers
from cudamem.host.workers import HostMemoryWarning, LoaderReport

N = 200_000
MiB = 1024**2


class DictItems(Dataset[int]):
    """Labels in a list of 200 k small dicts: every read writes a dict's reference count."""

    def __init__(self, n: int = N) -> None:
        self.items = [{"id": i, "path": f"img_{i:07d}.jpg", "label": i % 10} for i in range(n)]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> int:
        return int(self.items[i]["label"])


class ArrayItems(Dataset[int]):
    """The same labels in one numpy array: workers read it without writing a page."""

    def __init__(self, n: int = N) -> None:
        self.labels = np.arange(n) % 10
        self.paths = np.array([f"img_{i:07d}.jpg" for i in range(n)], dtype="S16")

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> int:
        return int(self.labels[i])


@pytest.fixture
def watch() -> Iterator[workers.WorkerWatcher]:
    # A budget of 20 % lets the few-second test read often; the default is 0.5 %.
    watcher = workers.watch_workers(interval=0.05, budget=0.2)
    try:
        yield watcher
    finally:
        workers.stop_watching()


def _run(loader: DataLoader[int], batches: int) -> tuple[list[int], dict[int, int]]:
    it = iter(loader)
    pids = [w.pid for w in it._workers]  # type: ignore[attr-defined]
    first = {p: _procfs.read_memory(p).uss or 0 for p in pids}
    for k, _ in enumerate(it):
        if k + 1 == batches:
            break
    return pids, first


def _host_warnings(record: list[warnings.WarningMessage]) -> list[HostMemoryWarning]:
    return [w.message for w in record if isinstance(w.message, HostMemoryWarning)]


def test_forked_workers_reading_dicts_warn_copy_on_read_within_ten_percent(
    watch: workers.WorkerWatcher, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The test's own baseline is read the moment the watcher has read its own (in torch's
    # iterator __init__, right after the fork): the growth both see starts together.
    direct_first: dict[int, int] = {}
    register = watch.register

    def register_then_read(it: Any, **kwargs: Any) -> None:
        register(it, **kwargs)
        for w in it._workers:
            direct_first[w.pid] = _procfs.read_memory(w.pid).uss or 0

    monkeypatch.setattr(watch, "register", register_then_read)
    loader = DataLoader(DictItems(), batch_size=256, num_workers=2, shuffle=True)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        it = iter(loader)
        pids = [w.pid for w in it._workers]  # type: ignore[attr-defined]
        for k, _ in enumerate(it):
            if k == 300:
                break
        (report,) = watch.reports(refresh=True)
        direct_now = {p: _procfs.read_memory(p).uss or 0 for p in pids}
        del it
    # The growth since the watcher's first readings, measured directly now: within 10 %.
    firsts = {w.pid: w.first.uss or 0 for w in report.workers}
    direct_growth = sum(direct_now[p] - firsts[p] for p in pids)
    assert direct_growth > 32 * MiB  # what the test relies on: the workers did grow
    assert abs(report.growth - direct_growth) <= 0.1 * direct_growth, (report, direct_growth)
    for w in report.workers:
        assert abs((w.last.uss or 0) - direct_now[w.pid]) <= 0.1 * direct_now[w.pid]
    # A baseline read a few ms later (the test's, after the watcher's) sees a little less:
    # a worker's start-up allocates a few MiB right after the fork.
    later = sum(direct_now[p] - direct_first[p] for p in pids)
    assert 0.75 * report.growth <= later <= report.growth + 0.1 * later, (report, later)
    assert [w.pid for w in report.workers] == pids
    assert report.start_method == "fork" and report.cause == "copy-on-read"
    (warning,) = _host_warnings(record)
    (shown,) = [w for w in record if w.message is warning]
    # Located in this test's code (its register wrapper is the first frame outside cudamem
    # and torch), whichever thread judged it: never threading.py or cudamem's own file.
    assert shown.filename == __file__
    text = str(warning)
    assert "cause: copy-on-read" in text
    assert "dataset.items: list of 200,000 dicts" in text
    assert "numpy arrays or tensors" in text


def test_numpy_backed_workers_do_not_grow_and_never_warn(watch: workers.WorkerWatcher) -> None:
    loader = DataLoader(ArrayItems(), batch_size=256, num_workers=2, shuffle=True)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        pids, _ = _run(loader, 300)
        (report,) = watch.reports(refresh=True)
    assert _host_warnings(record) == []
    assert not report.warned and report.containers == ()
    # A worker's start-up allocates a few MiB after its first reading (up to ~7 MiB seen):
    # under the 16 MiB a worker must grow to warn, far from the dict workers' ~25 MiB each.
    assert report.growth / len(report.workers) < 8 * MiB, report
    assert sorted(w.pid for w in report.workers) == sorted(pids)


def test_persistent_workers_are_one_loader_across_epochs(watch: workers.WorkerWatcher) -> None:
    loader = DataLoader(ArrayItems(20_000), batch_size=512, num_workers=2, persistent_workers=True)
    for _ in range(2):
        for _ in loader:
            pass
    (report,) = watch.reports(refresh=True)
    assert report.persistent and not report.ended
    assert len(report.live) == 2 and report.uss > 0 and report.pss >= report.uss
    del loader
    gc.collect()


def test_a_loader_abandoned_mid_epoch_ends_and_its_workers_exit(
    watch: workers.WorkerWatcher,
) -> None:
    loader = DataLoader(ArrayItems(50_000), batch_size=256, num_workers=2)
    it = iter(loader)
    next(it)
    pids = [w.pid for w in it._workers]  # type: ignore[attr-defined]
    watch.reports(refresh=True)
    del it  # abandoned: torch shuts its workers down
    gc.collect()
    (report,) = watch.reports(refresh=True)
    assert isinstance(report, LoaderReport) and report.ended
    assert [w.pid for w in report.workers] == pids
    assert all(w.last.uss for w in report.workers)  # the last reading is kept
    assert "ended" in str(report)


def test_explain_lists_live_workers_without_a_watcher() -> None:
    import cudamem

    assert workers.watcher() is None
    loader = DataLoader(ArrayItems(20_000), batch_size=256, num_workers=2)
    it = iter(loader)
    next(it)
    pids = sorted(w.pid for w in it._workers)  # type: ignore[attr-defined]
    host = cudamem.explain(host=True).host
    assert host is not None
    (report,) = host.loaders
    assert sorted(w.pid for w in report.workers) == pids and not report.watched
    assert host.workers_uss == sum(w.last.uss or 0 for w in report.workers) > 0
    text = str(host)
    assert "DataLoader workers: 2 live workers" in text and "one reading" in text
    html = cudamem.explain()._repr_html_()  # a notebook cell shows the host section too
    assert "host, this process (pid " in html and "DataLoader workers: 2 live workers" in html
    del it

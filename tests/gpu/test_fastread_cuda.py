"""The C++ counter reader on a real GPU (H200): it builds, its three numbers equal the dict
read's through allocations, frees, ``empty_cache`` and peak resets, the background build
becomes active without a read waiting for it, and a refused build leaves the dict path.

Every build goes to a temporary cache (``CUDAMEM_CACHE_DIR``), never the user's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from cudamem.allocator import torch_backend as _torch_backend
from cudamem.native import cache as _native_cache
from cudamem.native import fastread as _fastread
from cudamem.native.fastread import FastReader, Reader

pytestmark = pytest.mark.cuda
ROOT = Path(__file__).resolve().parents[2]
MiB = 1024**2


def _memory_stats(device: int) -> tuple[int, int, int]:
    stats = torch.cuda.memory_stats(device)
    return (
        stats["allocated_bytes.all.current"],
        stats["reserved_bytes.all.current"],
        stats["allocated_bytes.all.peak"],
    )


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[FastReader, Reader]]:
    root = tmp_path_factory.mktemp("reader-cache")
    manager = FastReader(root=str(root))
    manager.build_now()
    assert manager.state == "ready", manager.status()
    reader = manager._candidate
    assert reader is not None
    yield manager, reader


def test_reader_equals_the_dict_read_through_allocations(
    built: tuple[FastReader, Reader],
) -> None:
    _, reader = built
    torch.cuda.init()
    backend = _torch_backend.TorchBackend(reader=FastReader(lambda force: reader))
    kept: list[torch.Tensor] = []
    for size in (1, 512, MiB, 3 * MiB + 7, 64 * MiB, 256 * MiB):
        kept.append(torch.empty(size, dtype=torch.uint8, device="cuda:0"))
        assert reader.counters(0) == backend._dict_counters(0) == _memory_stats(0)
    peak = reader.counters(0)[2]
    del kept[-1]
    after_free = reader.counters(0)
    assert after_free == _memory_stats(0)
    assert after_free[2] == peak and after_free[0] <= peak - 256 * MiB
    torch.cuda.empty_cache()
    snapshot = _memory_stats(0)
    assert reader.counters(0) == snapshot and snapshot[2] == peak
    assert reader.counters_reset_peak(0) == snapshot  # the values before the reset
    allocated, reserved, reset = reader.counters(0)
    assert reset == allocated  # the peak was reset to the current value
    assert (allocated, reserved, reset) == _memory_stats(0)
    kept.clear()
    torch.cuda.empty_cache()
    assert reader.counters(0) == _memory_stats(0)


def test_reader_on_a_device_without_context_creates_none(
    built: tuple[FastReader, Reader],
) -> None:
    _, reader = built
    if torch.cuda.device_count() < 2 or torch._C._cuda_hasPrimaryContext(1):
        pytest.skip("needs a second GPU without a context")
    assert reader.counters(1) == (0, 0, 0)
    assert not torch._C._cuda_hasPrimaryContext(1)


def test_invalid_device_raises_and_the_backend_falls_back(
    built: tuple[FastReader, Reader],
) -> None:
    _, reader = built
    torch.cuda.init()
    with pytest.raises(RuntimeError):
        reader.counters(torch.cuda.device_count() + 3)
    with pytest.raises(ValueError, match=r"0\.\.127"):
        reader.counters(-1)


def test_backend_validates_then_serves_from_the_reader(
    built: tuple[FastReader, Reader],
) -> None:
    _, reader = built
    x = torch.ones(MiB, device="cuda:0")
    manager = FastReader(lambda force: reader)
    backend = _torch_backend.TorchBackend(reader=manager)
    assert backend.counters(0) == _memory_stats(0)  # starts: the dict answers
    manager.join(30)
    assert backend.counters(0) == _memory_stats(0)  # validates
    assert manager.state == "active", manager.status()
    assert backend.fast_counters is reader.counters
    y = torch.ones(4 * MiB, device="cuda:0")
    assert backend.counters(0) == _memory_stats(0)
    values = backend.counters_reset_peak(0)
    assert values[:2] == _memory_stats(0)[:2]
    assert backend.counters(0)[2] == backend.counters(0)[0]
    del x, y


def _run(code: str, cache: Path, **env: str) -> subprocess.CompletedProcess[str]:
    full = {**os.environ, "PYTHONPATH": str(ROOT), _native_cache.CACHE_ENV: str(cache), **env}
    if _fastread.SWITCH_ENV not in env:
        full.pop(_fastread.SWITCH_ENV, None)
    if "CXX" not in env:
        full.pop("CXX", None)
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
        env=full,
        cwd=str(ROOT),
    )


_BACKGROUND = """
    import torch, cudamem
    from cudamem.allocator import backend as _backend
    x = torch.ones(1 << 20, device="cuda:0")
    b = _backend.get()
    first = b.counters(0)
    print("first", _backend.reader_status().state)
    print("first_equal", first == (torch.cuda.memory_allocated(0),
          torch.cuda.memory_reserved(0), torch.cuda.max_memory_allocated(0)))
    b.reader.join(600)  # the background build (no polling on the clock)
    y = torch.ones(1 << 18, device="cuda:0")
    b.counters(0)  # what a span does at its edges: validates the built reader
    del y
    status = _backend.reader_status()
    print("final", status.state)
    print("line", status)
    print("equal", b.counters(0) == (torch.cuda.memory_allocated(0),
          torch.cuda.memory_reserved(0), torch.cuda.max_memory_allocated(0)))
"""


def test_background_build_becomes_active_and_is_reused(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    done = _run(_BACKGROUND, cache)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    # The first read came back while the build had only started: no read waits for it.
    assert "first building" in out and "first_equal True" in out, out
    assert "final active" in out, out + done.stderr
    assert "line reader: C++ counter reader" in out and "built in" in out, out
    assert "equal True" in out, out
    assert list(cache.glob("reader/*/_cudamem_reader_*.so")), list(cache.rglob("*"))

    # A new process finds the build: `cudamem status` says spans will use it...
    status = _run("import sys; from cudamem.__main__ import main; main(['status'])", cache)
    assert status.returncode == 0, status.stderr
    line = next(x for x in status.stdout.splitlines() if x.startswith("reader: "))
    assert line.startswith("reader: C++ counter reader, once CUDA starts [cached]"), line
    # ...and a process using CUDA loads it instead of compiling.
    again = _run(_BACKGROUND, cache)
    assert again.returncode == 0, again.stderr
    assert "final active" in again.stdout and "loaded from the cache" in again.stdout


def test_bad_compiler_leaves_the_dict_path_and_is_retried_with_a_good_one(
    tmp_path: Path,
) -> None:
    cache = tmp_path / "cache"
    done = _run(_BACKGROUND, cache, CXX="/bin/false")
    assert done.returncode == 0, done.stderr
    assert "final failed" in done.stdout, done.stdout
    assert "equal True" in done.stdout  # the dict path kept answering
    assert "line reader: dict" in done.stdout and "the build failed" in done.stdout
    (marker,) = cache.glob("reader/*/failed.json")
    assert json.loads(marker.read_text())["cxx"] == "/bin/false"
    assert (marker.parent / "build.log").read_text().strip()
    # The same bad compiler again: the marker answers at once, no second build.
    second = _run(_BACKGROUND, cache, CXX="/bin/false")
    assert "final failed" in second.stdout and "build-reader" in second.stdout
    # The default compiler: retried, and it works.
    good = _run(_BACKGROUND, cache)
    assert "final active" in good.stdout, good.stdout + good.stderr


def test_switched_off_by_the_environment(tmp_path: Path) -> None:
    done = _run(_BACKGROUND, tmp_path / "cache", CUDAMEM_FAST_READER="0")
    assert done.returncode == 0, done.stderr
    assert "first disabled" in done.stdout and "final disabled" in done.stdout
    assert "line reader: dict" in done.stdout and "CUDAMEM_FAST_READER=0" in done.stdout
    assert "equal True" in done.stdout
    assert not list((tmp_path / "cache").rglob("*.so"))


def test_build_reader_command(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    done = _run(
        "import sys; from cudamem.__main__ import main; sys.exit(main(['build-reader']))", cache
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.startswith("reader: C++ counter reader (three integers a read) [active]")
    assert "equal to the dict read on cuda:0" in done.stdout

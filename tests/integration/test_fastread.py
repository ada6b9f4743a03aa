"""The C++ counter reader's life without a GPU: cache keys, markers, the background build,
validation against the dict read, the switch, and that importing cudamem costs nothing.

The real build and the real reader run in tests/gpu/test_fastread_cuda.py on the H200. Here the
backend's CUDA checks are faked at the seam (``_initialized``, ``_dict_counters``); a tiny
CPython extension compiled by the test stands in for a cached build where a compiler exists.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import textwrap
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from cudamem.allocator import backend as _backend
from cudamem.allocator import torch_backend as _torch_backend
from cudamem.base.data import to_data
from cudamem.base.present import present
from cudamem.cli.commands import main
from cudamem.native import cache as _native_cache
from cudamem.native import fastread as _fastread
from cudamem.native import reader_build
from cudamem.native import reader_toolchain as _native_reader_toolchain
from cudamem.native.fastread import FastReader
from cudamem.native.reader_toolchain import BuildSpec, cache_key
from cudamem.native.states import ReaderStatus, ReaderUnavailable

from ..fakes import FakeAllocator

ROOT = Path(__file__).resolve().parents[2]
SOURCE = reader_build.bundle()


def _spec(**changes: Any) -> BuildSpec:
    values: dict[str, Any] = {
        "torch_version": "2.11.0+cu130",
        "torch_git": "0123456789abcdef",
        "cuda_version": "13.0",
        "cxx11_abi": True,
        "python_tag": "cpython-311",
        "machine": "x86_64",
        "source": SOURCE,
    }
    values.update(changes)
    return BuildSpec(**values)


class FakeReader:
    """A loaded reader whose answers the test chooses (``shift`` makes it disagree)."""

    def __init__(self, backend: SeamBackend, shift: tuple[int, int, int] = (0, 0, 0)) -> None:
        self.backend = backend
        self.shift = shift
        self.calls = 0
        self.resets = 0
        self.moving = 0  # reads that still see the counters move

    def counters(self, device: int, /) -> tuple[int, int, int]:
        self.calls += 1
        a, r, p = self.backend.values[device]
        if self.moving:
            self.moving -= 1
            a += self.calls  # another thread allocating between two reads
        return (a + self.shift[0], r + self.shift[1], p + self.shift[2])

    def counters_reset_peak(self, device: int, /) -> tuple[int, int, int]:
        values = self.counters(device)
        self.resets += 1
        a, r, _ = self.backend.values[device]
        self.backend.values[device] = (a, r, a)
        return values


class SeamBackend(_torch_backend.TorchBackend):
    """The real TorchBackend with CUDA "initialised" and the dict read answered from
    ``values``: everything between a counter read and the reader's manager is real."""

    def __init__(self, reader: FastReader) -> None:
        super().__init__(reader=reader)
        self._compiled = True
        self._reader_pending = True
        self.values: dict[int, tuple[int, int, int]] = {0: (1024, 2048, 4096)}
        self.dict_reads = 0
        self.dict_resets = 0

    def _initialized(self) -> bool:
        return True

    def _dict_counters(self, device: int) -> tuple[int, int, int]:
        self.dict_reads += 1
        return self.values[device]

    def reset_peak(self, device: int) -> None:
        self.dict_resets += 1


def _manager(
    make: Any, *, spec: BuildSpec | None = None, root: Path | None = None
) -> tuple[FastReader, list[int]]:
    provided: list[int] = []

    def provide(force: bool) -> Any:
        provided.append(int(force))
        return make()

    reader = FastReader(provide, spec=lambda: spec or _spec(), root=str(root) if root else None)
    return reader, provided


@pytest.fixture(autouse=True)
def _switch_on(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv(_fastread.SWITCH_ENV, raising=False)
    monkeypatch.setenv(_native_cache.CACHE_ENV, str(tmp_path / "cache"))


# --------------------------------------------------------------------------- cache key


def test_cache_key_changes_with_every_input() -> None:
    base = _spec()
    assert base.key == _spec().key  # deterministic
    changed = [
        _spec(torch_version="2.12.0+cu130"),
        _spec(torch_git="fedcba9876543210"),
        _spec(cuda_version="12.8"),
        _spec(cxx11_abi=False),
        _spec(python_tag="cpython-313"),
        _spec(machine="aarch64"),
        _spec(source=SOURCE + "\n// changed\n"),
    ]
    keys = {s.key for s in changed}
    assert base.key not in keys and len(keys) == len(changed)
    assert "torch2.11.0+cu130" in base.key and "cuda13.0" in base.key and "abi1" in base.key
    assert _spec(cxx11_abi=False).key.count("abi0") == 1
    # The module name follows the source only: the symbol PyInit_<name> must be valid C.
    assert _spec(source="x").module_name != base.module_name
    assert base.module_name.isidentifier()


def test_cache_key_is_one_safe_path_component() -> None:
    key = cache_key(
        torch_version="2.11.0a0+git/../../etc",
        cuda_version="13.0 beta",
        cxx11_abi=True,
        source="s",
        python_tag="cpython-311",
        machine="x86_64",
    )
    assert "/" not in key and " " not in key and os.sep not in key
    assert key == os.path.basename(key)


def test_cache_root_follows_the_environment(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv(_native_cache.CACHE_ENV, str(tmp_path / "mine"))
    assert _native_reader_toolchain.cache_root() == str(tmp_path / "mine" / "reader")
    monkeypatch.delenv(_native_cache.CACHE_ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert _native_reader_toolchain.cache_root() == str(tmp_path / "xdg" / "cudamem" / "reader")
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert _native_reader_toolchain.cache_root() == str(
        tmp_path / "home" / ".cache" / "cudamem" / "reader"
    )


def test_spec_from_this_torch() -> None:
    found = _fastread.torch_spec()
    if torch.version.cuda is None:
        assert isinstance(found, ReaderUnavailable)
        assert found.state == "unsupported"
        assert "without CUDA" in found.reason and torch.__version__ in found.reason
    else:
        assert isinstance(found, BuildSpec)
        assert found.torch_version == torch.__version__
        assert found.cxx11_abi == bool(torch._C._GLIBCXX_USE_CXX11_ABI)
        assert found.source == SOURCE


# --------------------------------------------------------------------------- real backend


def test_cpu_torch_reads_zeros_and_never_starts_the_reader() -> None:
    backend = _torch_backend.TorchBackend()
    threads = {t.name for t in threading.enumerate()}
    assert backend.counters(0) == (0, 0, 0)
    assert backend.counters_reset_peak(0) == (0, 0, 0)
    assert backend.reader.state == "idle"  # CUDA is not initialised: nothing started
    assert {t.name for t in threading.enumerate()} == threads
    status = backend.reader.status()
    assert not status.active and status.reader == "dict"
    if torch.version.cuda is None:
        assert status.state == "unsupported" and "without CUDA" in status.reason


def test_fake_allocator_counters_through_the_base_class() -> None:
    fake = FakeAllocator()
    fake.alloc(300)
    fake.free(200)
    assert fake.counters(0) == (100, 300, 300)
    assert fake.counters_reset_peak(0) == (100, 300, 300)  # the values before the reset
    assert fake.counters(0) == (100, 300, 100)
    assert fake.calls["reset_peak"] == 1
    two = FakeAllocator(devices=2, contexts=(0,))
    assert two.counters(1) == (0, 0, 0)  # no context: zeros, as read() gives


# --------------------------------------------------------------------------- validation


def test_agreeing_reader_is_validated_then_serves_every_read() -> None:
    backend: SeamBackend
    reader, provided = _manager(lambda: FakeReader(backend))
    backend = SeamBackend(reader)
    assert backend.counters(0) == (1024, 2048, 4096)  # starts the build, dict answers
    reader.join(10)
    assert provided == [0] and reader.state == "ready"
    assert backend.counters(0) == (1024, 2048, 4096)  # validates, dict still answers
    assert reader.state == "active" and not reader.pending
    fake: FakeReader = backend.fast_counters.__self__  # type: ignore[union-attr]
    dict_reads, calls = backend.dict_reads, fake.calls
    backend.values[0] = (5000, 8192, 6000)
    assert backend.counters(0) == (5000, 8192, 6000)
    assert (backend.dict_reads, fake.calls) == (dict_reads, calls + 1)  # served by C++
    assert backend.counters_reset_peak(0) == (5000, 8192, 6000)
    assert fake.resets == 1 and backend.dict_resets == 0
    assert backend.counters(0) == (5000, 8192, 5000)
    status = reader.status()
    assert status.active and status.reader == "C++" and "equal to the dict read" in status.reason


def test_disagreeing_reader_is_dropped_with_a_note(tmp_path: Path) -> None:
    backend: SeamBackend
    spec = _spec()
    reader, _ = _manager(lambda: FakeReader(backend, shift=(0, 0, 8)), spec=spec, root=tmp_path)
    backend = SeamBackend(reader)
    backend.counters(0)
    reader.join(10)
    for _ in range(5):
        assert backend.counters(0) == (1024, 2048, 4096)  # never the wrong value
    assert reader.state == "dropped" and not reader.pending
    assert backend.fast_counters is None and not backend._reader_pending
    status = reader.status()
    assert not status.active and status.reader == "dict"
    assert "(1024, 2048, 4104)" in status.reason and "(1024, 2048, 4096)" in status.reason
    # Later processes (a new manager with the default provider) skip it from the marker.
    marker = tmp_path / spec.key / "dropped.json"
    assert "disagreed" in json.loads(marker.read_text())["reason"]
    later = FastReader(spec=lambda: spec, root=str(tmp_path))
    assert later.status().state == "dropped"
    later_backend = SeamBackend(later)
    later_backend.counters(0)
    later.join(10)
    assert later.state == "dropped" and "earlier process" in later.status().reason


def test_reader_that_raises_is_dropped_without_a_marker(tmp_path: Path) -> None:
    class Raising:
        def counters(self, device: int, /) -> tuple[int, int, int]:
            raise RuntimeError("CUDA allocator does not implement getDeviceStats")

        counters_reset_peak = counters

    spec = _spec()
    reader, _ = _manager(Raising, spec=spec, root=tmp_path)
    backend = SeamBackend(reader)
    backend.counters(0)
    reader.join(10)
    assert backend.counters(0) == (1024, 2048, 4096)
    assert reader.state == "dropped" and "getDeviceStats" in reader.status().reason
    assert not (tmp_path / spec.key / "dropped.json").exists()  # this process's problem only


def test_moving_or_zero_counters_postpone_validation() -> None:
    backend: SeamBackend
    made: list[FakeReader] = []

    def make() -> FakeReader:
        made.append(FakeReader(backend))
        return made[-1]

    reader, _ = _manager(make)
    backend = SeamBackend(reader)
    backend.values[0] = (0, 0, 0)
    backend.counters(0)
    reader.join(10)
    for _ in range(3):
        assert backend.counters(0) == (0, 0, 0)
    assert reader.state == "ready"  # all zero proves nothing
    backend.values[0] = (512, 2048, 512)
    made[0].moving = 4  # two validations see the counters move
    backend.counters(0)
    backend.counters(0)
    assert reader.state == "ready"
    backend.counters(0)
    assert reader.state == "active"


def test_validation_gives_up_on_counters_that_never_hold_still(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_fastread, "VALIDATION_ATTEMPTS", 3)
    backend: SeamBackend
    made: list[FakeReader] = []

    def make() -> FakeReader:
        made.append(FakeReader(backend))
        made[-1].moving = 10**6
        return made[-1]

    reader, _ = _manager(make)
    backend = SeamBackend(reader)
    backend.counters(0)
    reader.join(10)
    for _ in range(4):
        backend.counters(0)
    assert reader.state == "dropped" and "never held still" in reader.status().reason


# --------------------------------------------------------------------------- never blocking


def test_a_slow_build_never_blocks_a_read() -> None:
    started, release = threading.Event(), threading.Event()
    backend: SeamBackend

    def slow() -> FakeReader:
        started.set()
        assert release.wait(60), "the test never released the build"
        return FakeReader(backend)

    reader, _ = _manager(slow)
    backend = SeamBackend(reader)
    assert backend.counters(0) == (1024, 2048, 4096)
    assert started.wait(10)
    for i in range(200):  # every read returns while the "compiler" is still running
        backend.values[0] = (i, 2048, 4096)
        assert backend.counters(0) == (i, 2048, 4096)
        assert backend.counters_reset_peak(0) == (i, 2048, 4096)
    assert reader.state == "building" and not release.is_set()
    assert "background" in reader.status().reason
    assert any(t.name == "cudamem-reader-build" and t.daemon for t in threading.enumerate())
    release.set()
    reader.join(10)
    backend.counters(0)
    assert reader.state == "active"


def test_concurrent_first_reads_start_one_build() -> None:
    backend: SeamBackend
    gate = threading.Event()

    def make() -> FakeReader:
        gate.wait(10)
        return FakeReader(backend)

    reader, provided = _manager(make)
    backend = SeamBackend(reader)
    barrier = threading.Barrier(8)
    results: list[tuple[int, int, int]] = []

    def work() -> None:
        barrier.wait()
        for _ in range(50):
            results.append(backend.counters(0))

    threads = [threading.Thread(target=work) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    gate.set()
    reader.join(10)
    assert provided == [0]
    assert results == [(1024, 2048, 4096)] * 400


def test_provider_crash_leaves_the_dict_path() -> None:
    def crash() -> Any:
        raise MemoryError("no memory for the build")

    reader, _ = _manager(crash)
    backend = SeamBackend(reader)
    backend.counters(0)
    reader.join(10)
    assert backend.counters(0) == (1024, 2048, 4096)
    assert reader.state == "failed" and "MemoryError" in reader.status().reason
    assert not backend._reader_pending


def test_spec_failure_never_escapes_a_read() -> None:
    def broken() -> BuildSpec:
        raise RuntimeError("torch.version is broken")

    reader = FastReader(lambda force: None, spec=broken)  # type: ignore[arg-type,return-value]
    backend = SeamBackend(reader)
    assert backend.counters(0) == (1024, 2048, 4096)
    assert reader.state == "dropped" and "torch.version is broken" in reader.status().reason


# --------------------------------------------------------------------------- switch


@pytest.mark.parametrize("value", ["0", "false", "OFF", "no"])
def test_environment_variable_turns_it_off(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv(_fastread.SWITCH_ENV, value)
    reader, provided = _manager(lambda: pytest.fail("the reader was built while switched off"))
    assert reader.status().state == "disabled"  # before it starts, too
    backend = SeamBackend(reader)
    for _ in range(3):
        assert backend.counters(0) == (1024, 2048, 4096)
    assert provided == [] and reader.state == "disabled"
    status = reader.status()
    assert f"CUDAMEM_FAST_READER={value}" in status.reason
    assert present(status).startswith("reader: dict")
    reader.build_now()
    assert provided == [] and reader.state == "disabled"


# --------------------------------------------------------------------------- default provider


def _compile_stand_in(path: Path, name: str) -> None:
    """A real CPython extension with the reader's two functions (answers 100+device, 200,
    300), for the cache's load path."""
    cxx = shutil.which("c++") or shutil.which("g++")
    if cxx is None:
        pytest.skip("no C++ compiler")
    src = path.parent / "stand_in.c"
    src.write_text(
        textwrap.dedent(
            f"""
            #include <Python.h>
            static PyObject* counters(PyObject* m, PyObject* d) {{
                long v = PyLong_AsLong(d);
                if (v == -1 && PyErr_Occurred()) return NULL;
                return Py_BuildValue("(LLL)", 100LL + v, 200LL, 300LL);
            }}
            static PyMethodDef methods[] = {{
                {{"counters", counters, METH_O, NULL}},
                {{"counters_reset_peak", counters, METH_O, NULL}},
                {{NULL, NULL, 0, NULL}}}};
            static struct PyModuleDef def = {{PyModuleDef_HEAD_INIT, "{name}", NULL, -1,
                                              methods}};
            PyMODINIT_FUNC PyInit_{name}(void) {{ return PyModule_Create(&def); }}
            """
        )
    )
    include = sysconfig.get_path("include")
    done = subprocess.run(
        [cxx, "-x", "c++", "-shared", "-fPIC", f"-I{include}", str(src), "-o", str(path)],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot build a CPython extension here: {done.stderr[-300:]}")


def test_cached_build_is_loaded_without_compiling(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    spec = _spec()
    reader = FastReader(spec=lambda: spec, root=str(tmp_path))
    paths = reader._paths(spec)
    os.makedirs(paths.directory)
    _compile_stand_in(Path(paths.library), spec.module_name)
    status = reader.status()
    assert status.state == "cached" and status.cache_dir == paths.directory
    assert present(status).startswith("reader: C++ counter reader, once CUDA starts [cached]")

    def no_build(*args: Any) -> float:
        raise AssertionError("a cached build was compiled again")

    monkeypatch.setattr(_fastread, "build_in_subprocess", no_build)
    backend = SeamBackend(reader)
    backend.values[0] = (100, 200, 300)
    backend.counters(0)
    reader.join(30)
    assert reader.state == "ready", reader.status()
    backend.counters(0)
    assert reader.state == "active", reader.status()
    assert "loaded from the cache" in reader.status().reason
    assert backend.counters(2) == (102, 200, 300)  # the compiled function answers


def test_damaged_cached_build_is_rebuilt(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    spec = _spec()
    reader = FastReader(spec=lambda: spec, root=str(tmp_path))
    paths = reader._paths(spec)
    os.makedirs(paths.directory)
    Path(paths.library).write_bytes(b"\x7fELF not really")
    built: list[str] = []

    def build(spec_: BuildSpec, paths_: Any) -> float:
        built.append(paths_.library)
        _compile_stand_in(Path(paths_.library), spec_.module_name)
        return 0.5

    monkeypatch.setattr(_fastread, "build_in_subprocess", build)
    monkeypatch.setattr(_fastread, "_toolchain_problem", lambda: None)
    reader.build_now(force=False)
    assert built == [paths.library]
    assert reader.state == "ready"
    assert "would not load" in reader._origin


def test_failed_build_is_reported_remembered_and_retried(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # A real build subprocess that cannot succeed on this machine (a CPU torch has no
    # CUDA build support; on a CUDA torch the bogus compiler fails it).
    monkeypatch.setenv("CXX", "/bin/false")
    monkeypatch.setattr(_fastread, "_toolchain_problem", lambda: None)
    spec = _spec()
    reader = FastReader(spec=lambda: spec, root=str(tmp_path))
    reader.build_now(force=False)
    status = reader.status()
    assert status.state == "failed" and not status.active
    assert "the build failed (" in status.reason and "build.log" in status.reason
    paths = reader._paths(spec)
    assert Path(paths.log).read_text().strip()
    marker = json.loads(Path(paths.failed).read_text())
    assert marker["cxx"] == "/bin/false"
    assert not [p for p in os.listdir(paths.directory) if p.startswith("build-")]

    calls: list[str] = []

    def counting_build(spec_: BuildSpec, paths_: Any) -> float:
        calls.append(os.environ.get("CXX", ""))
        raise ReaderUnavailable("failed", "still failing")

    monkeypatch.setattr(_fastread, "build_in_subprocess", counting_build)
    # The next process, same compiler: the marker answers, no second 10 s build.
    again = FastReader(spec=lambda: spec, root=str(tmp_path))
    assert again.status().state == "failed" and "build-reader" in again.status().reason
    backend = SeamBackend(again)
    backend.counters(0)
    again.join(30)
    assert again.state == "failed" and calls == []
    # Another compiler: retried.
    monkeypatch.setenv("CXX", "g++")
    other = FastReader(spec=lambda: spec, root=str(tmp_path))
    SeamBackend(other).counters(0)
    other.join(30)
    assert calls == ["g++"]
    # build-reader retries whatever the marker says.
    monkeypatch.setenv("CXX", "/bin/false")
    forced = FastReader(spec=lambda: spec, root=str(tmp_path))
    forced.build_now()
    assert calls == ["g++", "/bin/false"]


def test_toolchain_problems_are_named(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    assert "no C++ compiler" in (_fastread._toolchain_problem() or "")
    cxx = shutil.which("c++") or shutil.which("g++")
    if cxx is not None:
        monkeypatch.setenv("CXX", cxx)
        monkeypatch.setattr(
            _native_reader_toolchain, "_tool_path", lambda: str(tmp_path)
        )  # no ninja
        assert "ninja" in (_fastread._toolchain_problem() or "")
        (tmp_path / "ninja").write_text("#!/bin/sh\n")
        (tmp_path / "ninja").chmod(0o755)
        monkeypatch.setattr(_native_reader_toolchain, "_cuda_home", lambda: None)
        assert "no CUDA headers" in (_fastread._toolchain_problem() or "")
    spec = _spec()
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    reader = FastReader(spec=lambda: spec, root=str(tmp_path / "cache"))
    assert reader.status().state == "unsupported"
    backend = SeamBackend(reader)  # the read path: the dict answers, before and after
    assert backend.counters(0) == (1024, 2048, 4096)
    reader.join(30)
    assert backend.counters(0) == (1024, 2048, 4096)
    assert reader.state == "unsupported" and "no C++ compiler" in reader.status().reason
    assert not backend._reader_pending
    again = FastReader(spec=lambda: spec, root=str(tmp_path / "cache"))
    again.build_now()
    assert again.state == "unsupported" and "no C++ compiler" in again.status().reason


def test_tool_path_puts_this_pythons_bin_first(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", "/nowhere")
    first, rest = _native_reader_toolchain._tool_path().split(os.pathsep)
    assert first == os.path.dirname(os.path.abspath(sys.executable)) and rest == "/nowhere"


def test_cuda_home_skips_directories_without_headers(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    empty, good = tmp_path / "empty", tmp_path / "good"
    (good / "include").mkdir(parents=True)
    (good / "include" / "cuda_runtime_api.h").write_text("")
    empty.mkdir()
    monkeypatch.setenv("CUDA_HOME", str(empty))
    monkeypatch.setenv("CUDA_PATH", str(good))
    assert _native_reader_toolchain._cuda_home() == str(good)


def test_error_tail_keeps_the_error_lines() -> None:
    output = "\n".join(
        [
            "[1/2] c++ -c main.cpp",
            "main.cpp:14: fatal error: c10/cuda/x.h: No such file",
            "ninja: build stopped: subcommand failed.",
        ]
    )
    tail = _native_reader_toolchain._error_tail(output)
    assert "fatal error: c10/cuda/x.h" in tail and "[1/2]" not in tail
    assert len(_native_reader_toolchain._error_tail("error " * 500)) <= 400
    assert _native_reader_toolchain._error_tail("") == "no output"


def test_status_values_and_json() -> None:
    status = ReaderStatus(True, "active", "built in 4.0 s; equal to the dict read", "/c/k")
    assert status.reader == "C++"
    assert to_data(status) == {
        "reader": "C++",
        "active": True,
        "state": "active",
        "reason": "built in 4.0 s; equal to the dict read",
        "cache_dir": "/c/k",
    }
    assert present(status) == (
        "reader: C++ counter reader (three integers a read) [active]: built in 4.0 s; "
        "equal to the dict read"
    )
    off = ReaderStatus(False, "failed", "the build failed (x)")
    assert present(off).startswith("reader: dict (torch._C._cuda_memoryStats")
    # str() is the same line (the registry looked up, not imported, by _fastread).
    assert str(status) == present(status) and str(off) == present(off)


# --------------------------------------------------------------------------- command line


def test_status_command_names_the_reader(capsys: pytest.CaptureFixture[str]) -> None:
    from cudamem.ledger import nvml as _nvml
    from cudamem.native import cext as _cext
    from cudamem.native import heapscan as _heapscan
    from cudamem.spans.span import span_core_status

    from ..nvml_fakes import FakeGpu, make_nvml

    with _nvml.use_module(make_nvml([FakeGpu("GPU-11111111-2222-3333-4444-555555555555")])):
        assert main(["status"]) == 0
        text = capsys.readouterr().out
        assert main(["status", "--json"]) == 0
        data = json.loads(capsys.readouterr().out)
    reader_line, core_line, heap_line = text.strip().splitlines()[-3:]
    expected = _backend.reader_status()
    assert reader_line == present(expected) and reader_line.startswith("reader: ")
    core, heap = span_core_status(), _heapscan.status()
    gpu = _backend.get().device_count() > 0
    if gpu:
        # The span core's line: the command waited for its build and switched to it.
        if _cext.compiler() is not None:
            assert core_line.startswith(
                "span core: compiled [active]: compiled span core, validated"
            )
        if _cext.compiler() is not None and heap.state != "disabled":  # CUDAMEM_FAST_HEAP=0
            assert heap_line.startswith(
                "heap pass: compiled [active]: compiled heap pass, validated"
            )
    else:
        # Without a GPU (NVML faked, torch sees none) status builds nothing and says so.
        why = "status builds nothing on a machine without a CUDA GPU"
        core, heap = (dataclasses.replace(s, reason=f"{s.reason}; {why}") for s in (core, heap))
    assert core_line == present(core)
    assert heap_line == present(heap)
    assert "GPU 0 NVIDIA H200" in text
    assert data["reader"] == to_data(expected)
    assert data["span_core"] == to_data(core) and data["span_core"]["name"] == "span core"
    assert data["heap_pass"] == to_data(heap)
    assert data["devices"][0]["index"] == 0


def test_build_reader_command_says_why_not(capsys: pytest.CaptureFixture[str]) -> None:
    if torch.version.cuda is not None:
        pytest.skip("a CUDA torch builds it (tests/gpu/test_fastread_cuda.py)")
    assert main(["build-reader"]) == 1
    out = capsys.readouterr()
    assert "without CUDA" in out.out and "building" in out.err
    assert main(["build-reader", "--json"]) == 1
    assert json.loads(capsys.readouterr().out)["state"] == "unsupported"


# --------------------------------------------------------------------------- import


def test_import_cudamem_compiles_nothing_and_starts_no_thread() -> None:
    code = textwrap.dedent(
        """
        import sys, threading
        import torch
        before = {t.ident for t in threading.enumerate()}
        import cudamem
        from cudamem.allocator import backend as _backend
        with cudamem.track("step"):
            x = torch.ones(4)
        assert _backend.get().counters(0) == (0, 0, 0) or torch.cuda.is_initialized()
        after = {t.ident for t in threading.enumerate()}
        print("threads", len(after - before))
        print("cpp_extension", "torch.utils.cpp_extension" in sys.modules)
        print("state", _backend._torch.reader.state)
        """
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env=env,
        cwd=str(ROOT),
    )
    assert done.returncode == 0, done.stderr
    assert "threads 0" in done.stdout
    assert "cpp_extension False" in done.stdout
    assert "state idle" in done.stdout


# --------------------------------------------------------------------------- by-path build

# Imported by the build subprocess at start-up (it is on its PYTHONPATH): cudamem cannot be
# imported there, as in a process that loads _fastread.py by path from an installed wheel
# whose package is not importable, and torch.utils.cpp_extension.load_inline is a stub that
# writes the library file the real compiler would. Nothing else of the build is changed.
_SITECUSTOMIZE = """
import importlib.abc, os, sys, types

class _NoCudamem(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "cudamem" or name.startswith("cudamem."):
            raise ImportError(f"{name} is not importable in the build subprocess (test)")
        return None

sys.meta_path.insert(0, _NoCudamem())

def load_inline(*, name, build_directory, **options):
    with open(os.path.join(build_directory, name + ".so"), "w") as fh:
        fh.write("stub library: " + ",".join(sorted(options)))

torch = types.ModuleType("torch")
torch.__path__ = []
utils = types.ModuleType("torch.utils")
utils.__path__ = []
cpp = types.ModuleType("torch.utils.cpp_extension")
cpp.load_inline = load_inline
torch.utils, utils.cpp_extension = utils, cpp
sys.modules.update({"torch": torch, "torch.utils": utils, "torch.utils.cpp_extension": cpp})
"""


@pytest.mark.skipif(os.name == "nt", reason="the stub writes a .so")
def test_the_build_subprocess_loads_fastread_by_path_without_cudamem(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # The background build's own entry, run as it runs: the same interpreter, `python -c`
    # with _BOOTSTRAP loading this very _fastread.py by path. Only the compiler is a stub.
    # A module-level `from ._present import present` in _fastread.py failed here with
    # "attempted relative import with no known parent package" (the H200 run of 7e81094).
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(_SITECUSTOMIZE)
    monkeypatch.setenv("PYTHONPATH", str(site))
    spec = _spec()
    paths = _fastread._Paths.of(spec, str(tmp_path / "cache"))
    seconds = _fastread.build_in_subprocess(spec, paths)
    assert seconds > 0
    library = Path(paths.library)
    options = set(library.read_text().removeprefix("stub library: ").split(","))
    assert {"cpp_sources", "with_cuda", "is_python_module"} <= options
    assert library.name == spec.module_name + ".so"
    assert (Path(paths.directory) / (spec.module_name + ".cpp")).read_text() == SOURCE
    assert not Path(paths.failed).exists()
    assert [p.name for p in Path(paths.directory).iterdir() if p.name.startswith("build-")] == []


def test_the_build_subprocess_failing_to_load_fastread_is_reported(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # The same entry when the stub says no cudamem import may succeed and the compiler
    # fails: the error reaches the reason and the failed marker, not an exception upward.
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        _SITECUSTOMIZE.replace(
            "    with open(",
            '    raise RuntimeError("error: stub compiler refused")\n    with open(',
        )
    )
    monkeypatch.setenv("PYTHONPATH", str(site))
    spec = _spec()
    paths = _fastread._Paths.of(spec, str(tmp_path / "cache"))
    with pytest.raises(ReaderUnavailable) as caught:
        _fastread.build_in_subprocess(spec, paths)
    assert caught.value.state == "failed"
    assert "stub compiler refused" in caught.value.reason
    assert "stub compiler refused" in Path(paths.log).read_text()
    assert json.loads(Path(paths.failed).read_text())["reason"] == caught.value.reason

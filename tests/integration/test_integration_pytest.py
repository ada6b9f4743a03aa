"""The pytest plugin, run for real on inner test files through pytest's ``pytester``.

The inner runs use CPU mode (``device='cpu'`` / ``--cudamem-device=cpu``), which counts CPU
storages with the same code that counts CUDA ones; the ``cuda`` tests at the end run the
same inner files on the GPU.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

import cudamem
from cudamem.holders.census import StorageSnapshot
from cudamem.integrations.pytest_plugin import MemoryCheck, TestMemory, parse_size

from ..fakes import FakeAllocator

pytest_plugins = ["pytester"]

ROOT = Path(__file__).resolve().parents[2]

LEAKY = """
    import pytest
    import torch

    CACHE = []

    @pytest.mark.limit_gpu_leaks(device="cpu")
    def test_leaks():
        CACHE.append(torch.ones(256, 1024))  # 1 MiB that outlives the test

    @pytest.mark.limit_gpu_leaks(device="cpu")
    def test_clean():
        x = torch.ones(256, 1024)
        assert float(x.sum()) == 256 * 1024
"""


@pytest.fixture
def inner(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> pytest.Pytester:
    """Inner runs load only this plugin (whatever entry points are installed)."""
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")
    return pytester


def run(p: pytest.Pytester, *args: str) -> pytest.RunResult:
    return p.runpytest("-p", "pytest_cudamem", "-p", "no:cacheprovider", *args)


def test_a_leaking_test_fails_with_its_holder_and_a_clean_one_passes(
    inner: pytest.Pytester,
) -> None:
    inner.makepyfile(test_leaky=LEAKY)
    result = run(inner, "-v")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(
        [
            "*test_leaks FAILED*",
            "*test_clean PASSED*",
            "*1 cpu storage (1.0 MiB) created by this test is still alive after it (limit 0 B)*",
            "*1.0 MiB float32?256×1024? on cpu, held by:*",
            "*test_leaky.CACHE?0?",
        ]
    )


def test_the_limit_tolerates_small_leaks(inner: pytest.Pytester) -> None:
    inner.makepyfile(
        test_small="""
        import pytest
        import torch

        KEEP = []

        @pytest.mark.limit_gpu_leaks("2 MiB", device="cpu")
        def test_small_leak():
            KEEP.append(torch.ones(256, 1024))

        @pytest.mark.limit_gpu_leaks("512 KiB", device="cpu")
        def test_over():
            KEEP.append(torch.ones(256, 1024))
        """
    )
    result = run(inner)
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["*test_over*", "*limit 512.0 KiB*", "*test_small.KEEP?1?"])


def test_cudamem_option_checks_every_test(inner: pytest.Pytester) -> None:
    inner.makepyfile(
        test_all="""
        import torch

        SEEN = {}

        def test_keeps_a_dict_entry():
            SEEN["batch"] = torch.zeros(64, 1024)

        def test_nothing():
            torch.zeros(64, 1024)
        """
    )
    result = run(inner, "--cudamem", "--cudamem-device=cpu")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(
        ["cudamem: every test is checked for cpu storages*", "*test_all.SEEN??batch??"]
    )
    # Without the option (and without markers) nothing is checked.
    run(inner).assert_outcomes(passed=2)


def test_gpu_checks_without_a_gpu_pass_and_say_they_measured_nothing(
    inner: pytest.Pytester,
) -> None:
    """No CUDA device: the GPU limits and the fixture pass (nothing to fail on) and the
    terminal summary says, once, that they measured nothing; CPU checks are measured and
    not counted in it."""
    from cudamem.allocator import backend as _backend

    inner.makepyfile(
        test_gpu="""
        import pytest
        import torch

        KEPT = []

        @pytest.mark.limit_gpu_leaks
        def test_leaks():
            KEPT.append(torch.ones(256, 1024))

        @pytest.mark.limit_gpu_memory("1 MiB")
        def test_peak():
            torch.empty(8 * 1024**2, dtype=torch.uint8)

        def test_fixture(gpu_memory):
            KEPT.append(torch.ones(8))

        @pytest.mark.limit_gpu_leaks(device="cpu")
        def test_cpu_is_measured():
            torch.ones(8)
        """
    )
    line = (
        "cudamem: the GPU checks of 3 tests measured nothing: torch sees no CUDA device "
        "(device='cpu' or --cudamem-device=cpu counts CPU storages instead)"
    )
    with _backend.use(FakeAllocator(devices=0, contexts=())):
        result = run(inner)
    result.assert_outcomes(passed=4)
    assert result.stdout.lines.count(line) == 1, result.stdout.str()
    # With a device to measure (the CPU's storages here), no such line.
    cpu = run(inner, "--cudamem-device=cpu", "-k", "test_peak")
    cpu.assert_outcomes(failed=1, deselected=3)  # measured: 8 MiB of CPU storage at once
    assert not any("measured nothing" in x for x in cpu.stdout.lines)


def test_a_peak_over_the_limit_fails(inner: pytest.Pytester) -> None:
    inner.makepyfile(
        test_peak="""
        import pytest
        import torch

        @pytest.mark.limit_gpu_memory("16 MiB", device="cpu")
        def test_big_temporary():
            x = torch.empty(32 * 1024 * 1024, dtype=torch.uint8)  # 32 MiB, freed on return
            y = x[:10].sum()
            del x
            assert int(y) >= 0

        @pytest.mark.limit_gpu_memory("16 MiB", device="cpu")
        def test_small_temporary():
            x = torch.empty(4 * 1024 * 1024, dtype=torch.uint8)
            del x
        """
    )
    result = run(inner)
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(
        ["*test_big_temporary*", "*allocated up to 32.0 MiB on cpu at once*16.0 MiB*"]
    )


def test_warmup_runs_are_not_judged(inner: pytest.Pytester) -> None:
    inner.makepyfile(
        test_warm="""
        import pytest
        import torch

        _cache = {}
        CALLS = []

        def lookup():
            # A cache filled on the first call only: not a leak of the test.
            if "table" not in _cache:
                _cache["table"] = torch.ones(256, 1024)
            return _cache["table"]

        @pytest.mark.limit_gpu_leaks(warmup=1, device="cpu")
        def test_cached():
            CALLS.append(1)
            assert float(lookup()[0, 0]) == 1.0

        @pytest.mark.limit_gpu_leaks(device="cpu")
        def test_cold_cache():
            _cache.clear()
            lookup()

        def test_calls():
            assert len(CALLS) == 2  # the warm-up call and the judged one
        """
    )
    result = run(inner, "-p", "no:randomly")
    result.assert_outcomes(passed=2, failed=1)
    result.stdout.fnmatch_lines(["*test_cold_cache*", "*test_warm._cache??table??"])


def test_a_failing_test_is_not_judged_again(inner: pytest.Pytester) -> None:
    inner.makepyfile(
        test_fail="""
        import pytest
        import torch

        KEEP = []

        @pytest.mark.limit_gpu_leaks(device="cpu")
        def test_raises():
            KEEP.append(torch.ones(256, 1024))
            raise AssertionError("the test's own failure")
        """
    )
    result = run(inner)
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*the test's own failure*"])
    result.stdout.no_fnmatch_line("*still alive after it*")


def test_a_broken_check_never_changes_the_outcome(inner: pytest.Pytester) -> None:
    inner.makeconftest(
        """
        from cudamem.integrations import pytest_plugin

        SAVED = pytest_plugin._judge

        def _broken(*args, **kwargs):
            raise MemoryError("census exploded")

        pytest_plugin._judge = _broken

        def pytest_unconfigure(config):
            pytest_plugin._judge = SAVED
        """
    )
    inner.makepyfile(
        test_ok="""
        import pytest

        @pytest.mark.limit_gpu_leaks(device="cpu")
        def test_passes():
            pass
        """
    )
    result = run(inner, "-W", "always")
    result.assert_outcomes(passed=1, warnings=1)
    result.stdout.fnmatch_lines(["*cudamem could not check*census exploded*"])


def test_bad_marker_arguments_name_the_argument(inner: pytest.Pytester) -> None:
    inner.makepyfile(
        test_bad="""
        import pytest

        @pytest.mark.limit_gpu_memory("12 parsecs", device="cpu")
        def test_unit():
            pass

        @pytest.mark.limit_gpu_leaks(warmup=-1, device="cpu")
        def test_warmup():
            pass

        @pytest.mark.limit_gpu_memory(device="cpu")
        def test_missing():
            pass
        """
    )
    result = run(inner)
    result.assert_outcomes(failed=3)
    result.stdout.fnmatch_lines(
        [
            "*limit='12 parsecs' is not a size*",
            "*warmup must be an int >= 0, got -1*",
            "*a limit is required*",
        ]
    )


def test_fixture_reports_what_the_test_still_holds(inner: pytest.Pytester) -> None:
    inner.makepyfile(
        test_fixture="""
        import torch

        def test_check(gpu_memory):
            kept = torch.ones(256, 1024)
            temporary = torch.ones(256, 1024)
            del temporary
            check = gpu_memory.check()
            assert check.leaked_bytes == 1024 * 1024, check
            assert "local 'kept'" in check.leaked[0].paths[0], check
            del kept
            assert gpu_memory.check().leaked_bytes == 0
        """
    )
    run(inner, "--cudamem-device=cpu").assert_outcomes(passed=1)


def test_collection_imports_neither_torch_nor_cuda(tmp_path: Path) -> None:
    """With the plugin loaded (and --cudamem on), collecting imports no torch at all."""
    (tmp_path / "test_light.py").write_text(
        textwrap.dedent(
            """
            import pytest

            @pytest.mark.limit_gpu_leaks
            def test_marked():
                pass

            def test_plain():
                pass
            """
        )
    )
    (tmp_path / "conftest.py").write_text(
        textwrap.dedent(
            """
            import sys

            def pytest_collection_finish(session):
                assert "torch" not in sys.modules, "torch imported during collection"
                assert "cudamem" not in sys.modules, "cudamem imported during collection"
                print("COLLECTED WITHOUT TORCH")
            """
        )
    )
    env = {
        **os.environ,
        "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1",
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "pytest_cudamem", "--cudamem", "--co", "-q", "-s"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "COLLECTED WITHOUT TORCH" in proc.stdout
    assert "2 tests collected" in proc.stdout


def test_checks_never_initialise_cuda(inner: pytest.Pytester) -> None:
    """The CUDA-mode check of a CPU-only test reads nothing that would create a context."""
    inner.makeconftest(
        """
        import torch

        CALLS = []
        SAVED = (torch.cuda._lazy_init, torch.cuda.init)

        def _refuse(*args, **kwargs):
            CALLS.append(args)
            raise AssertionError("cudamem initialised CUDA")

        torch.cuda._lazy_init = _refuse
        torch.cuda.init = _refuse

        def pytest_sessionfinish(session):
            assert not CALLS
            print("NO CUDA INIT")

        def pytest_unconfigure(config):
            # The inner run shares this process: put torch back as it was.
            torch.cuda._lazy_init, torch.cuda.init = SAVED
        """
    )
    inner.makepyfile(
        test_cpu="""
        import pytest
        import torch

        @pytest.mark.limit_gpu_leaks
        @pytest.mark.limit_gpu_memory("1 GiB")
        def test_cpu_only():
            torch.ones(8).sum()
        """
    )
    lazy_init = torch.cuda._lazy_init
    result = run(inner, "-s")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["*NO CUDA INIT*"])
    assert torch.cuda._lazy_init is lazy_init


# --------------------------------------------------------------------------- units


def test_parse_size() -> None:
    assert parse_size("512 MiB") == 512 * 1024**2
    assert parse_size("1.5GiB") == 3 * 1024**3 // 2
    assert parse_size("2 MB") == 2_000_000
    assert parse_size("100") == 100
    assert parse_size(0) == 0
    with pytest.raises(ValueError, match="limit"):
        parse_size("-1 MiB")
    with pytest.raises(ValueError, match="limit"):
        parse_size(-5)
    with pytest.raises(TypeError, match="limit"):
        parse_size(1.5)
    with pytest.raises(TypeError, match="limit"):
        parse_size(True)


def test_memory_check_verdicts() -> None:
    clean = MemoryCheck("t", "cpu", (), 0, 0, (), (("cpu", 10),), None)
    assert not clean.failed and "no cpu storage outlived" in str(clean)
    over = MemoryCheck("t", "cuda", (), 0, None, (), (("cuda:0", 10),), 5)
    assert over.failed and "over the limit of 5 B" in str(over)
    grown = MemoryCheck("t", "cuda", (), 0, 0, (("cuda:0", 4096),), (), None)
    assert grown.failed and "4.0 KiB more allocated" in str(grown)


def test_test_memory_fixture_object_validates_device() -> None:
    with pytest.raises(ValueError, match="device"):
        TestMemory("t", "tpu")
    with pytest.raises(ValueError, match="leak_limit"):
        TestMemory("t", "cpu").check(leak_limit="lots")


def test_cuda_peak_is_folded_through_the_tests_own_spans() -> None:
    """The fake GPU: a span inside the test resets PyTorch's peak counter; the check still
    sees the test's peak, and its own measurement joins neither the history nor growth
    detection."""
    from cudamem.allocator import backend as _backend

    fake = FakeAllocator()
    MiB = 1024**2
    with _backend.use(fake):
        mem = TestMemory("t", "cuda")
        fake.alloc(8 * MiB)
        fake.free(8 * MiB)
        with cudamem.track("inner"):  # resets the counter on entry
            fake.alloc(MiB)
            fake.free(MiB)
        first = mem.check()
        fake.alloc(12 * MiB)
        fake.free(12 * MiB)
        second = mem.check()
        mem.close()
    assert first.peaks == (("cuda:0", 8 * MiB),)
    assert second.peaks == (("cuda:0", 12 * MiB),) and second.peak == 12 * MiB
    assert first.leaked_bytes == 0 and first.unexplained == ()
    assert [r.name for r in cudamem.history().spans] == ["inner"]


class CountingFake(FakeAllocator):
    """A fake allocator that counts its allocations (PyTorch's cumulative
    ``allocation.all.allocated``) and holds a cuBLAS workspace until it is cleared."""

    allocations = 0
    workspace = 0

    def alloc(self, nbytes: int, device: int = 0) -> None:
        self.allocations += 1
        super().alloc(nbytes, device)

    def read(self, device: int) -> Any:
        return super().read(device)._replace(alloc_count=self.allocations)

    def clear_cublas_workspaces(self) -> bool:
        self.free(self.workspace)
        self.workspace = 0
        return True


def test_the_last_look_serves_as_the_next_baseline_only_when_nothing_was_allocated(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A clean test costs one census: its last look is the next test's baseline, unless the
    allocator counted an allocation since (a fixture's tensor, a warm-up call), the test
    failed, or the counts cannot tell (CPU mode, an allocator without counts)."""
    from cudamem.allocator import backend as _backend
    from cudamem.integrations import pytest_plugin as pp

    censuses: list[str] = []

    def census(device: str) -> StorageSnapshot:
        censuses.append(device)
        return StorageSnapshot()

    monkeypatch.setattr(pp, "live_refs", census)
    fake = CountingFake()
    fake.alloc(1024)

    def one_test(allocate: bool = False) -> int:
        before = len(censuses)
        base = pp._baseline("cuda", peak=False, reuse=True)
        if allocate:
            fake.alloc(4096)
        pp._survivors(base, settle_first=False)
        return len(censuses) - before

    with _backend.use(fake):
        pp._last.clear()
        # Nothing to reuse yet: the baseline's census. The test left the allocated bytes
        # as they were and every baseline storage alive: no census after it.
        assert one_test() == 1
        assert one_test() == 0  # the baseline serves again: a clean test costs no census
        assert one_test(allocate=True) == 1  # the test's own allocation: bytes grew
        assert one_test() == 0  # that look serves as the baseline; the test is clean
        fake.alloc(512)  # a fixture between tests: an allocation since the last look
        assert one_test() == 1
        pp._last.clear()  # as finish() does for a failed test
        assert one_test() == 1
    assert pp._alloc_counts("cpu") is None
    with _backend.use(FakeAllocator()):  # counts of zero: the allocator cannot tell
        assert pp._alloc_counts("cuda") is None
    pp._last.clear()


def test_a_clean_test_skips_the_census_only_while_every_baseline_storage_lives(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """No census after a test that left the allocated bytes as they were, unless a storage
    of the baseline died: its block may then hold a new storage of the same size."""
    from cudamem.allocator import backend as _backend
    from cudamem.integrations import pytest_plugin as pp

    MiB = 1024**2
    censuses: list[str] = []
    kept = [torch.ones(256), torch.ones(512)]
    swapped = torch.ones(64)

    def census(device: str) -> StorageSnapshot:
        censuses.append(device)
        return StorageSnapshot.of([*kept, swapped])  # the storages "alive on cuda" now

    monkeypatch.setattr(pp, "live_refs", census)
    fake = CountingFake()
    fake.alloc(3 * MiB)
    with _backend.use(fake):
        pp._last.clear()
        base = pp._baseline("cuda", peak=False)
        assert censuses == ["cuda"] and base.allocated == {0: 3 * MiB}
        new, settled = pp._survivors(base, settle_first=False)
        assert censuses == ["cuda"] and not new and not settled  # no census: unchanged
        assert pp._last and pp._last[0].keys is base.keys  # it serves the next test
        fake.workspace = 32 * MiB  # a matmul's cuBLAS workspace: cleared, then no census
        fake.alloc(fake.workspace)
        assert pp._survivors(base, settle_first=False) == (StorageSnapshot(), False)
        assert censuses == ["cuda"] and fake.read(0).allocated == 3 * MiB
        # The test freed a baseline storage and made one of the same size: a census.
        swapped = torch.ones(64)
        new, _ = pp._survivors(base, settle_first=False)
        assert len(censuses) == 1 + pp.RECHECKS + 1  # it stays alive through every look
        assert [n for _d, n in new.values()] == [64 * 4]
        # The bytes changed: a census, whatever the storages did.
        base = pp._baseline("cuda", peak=False)
        fake.alloc(1 * MiB)
        pp._survivors(base, settle_first=False)
        assert len(censuses) == 1 + pp.RECHECKS + 1 + 2
    with _backend.use(FakeAllocator()):  # allocation counts of zero: it cannot tell
        base = pp._baseline("cuda", peak=False)
        assert base.allocated == {0: 0} and not pp._nothing_new(base)
    assert not pp._nothing_new(pp._Baseline("cpu", StorageSnapshot(), {}))  # CPU: no counts
    pp._last.clear()


def test_before_cuda_starts_no_census_runs_and_a_cuda_leak_after_it_is_still_found(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A CUDA storage needs a context: while no device has one, the baseline is empty and
    the look after the test is skipped (a CPU-only machine pays no census); a test that
    starts CUDA gets the census after it, and its storage is new against that baseline."""
    from cudamem.allocator import backend as _backend
    from cudamem.integrations import pytest_plugin as pp

    censuses: list[str] = []
    leaked = torch.ones(128)

    def census(device: str) -> StorageSnapshot:
        censuses.append(device)
        return StorageSnapshot.of([leaked])  # the storage "alive on cuda" after the test

    monkeypatch.setattr(pp, "live_refs", census)
    fake = CountingFake(devices=1, contexts=())
    with _backend.use(fake):
        pp._last.clear()
        base = pp._baseline("cuda", peak=False, reuse=True)
        assert censuses == [] and not base.keys and base.allocated == {}
        assert pp._survivors(base, settle_first=False) == (StorageSnapshot(), False)
        assert pp._survivors(base, settle_first=True) == (StorageSnapshot(), False)
        assert censuses == []  # nothing could exist: no look at all
        base = pp._baseline("cuda", peak=False, reuse=True)
        fake.alloc(512)  # the test starts CUDA (a context) and keeps a storage
        new, _ = pp._survivors(base, settle_first=False)
        assert censuses and [n for _d, n in new.values()] == [128 * 4]
        # CPU storages are always looked for: a CPU tensor needs no context.
        censuses.clear()
        pp._baseline("cpu", peak=False)
        assert censuses == ["cpu"]
    pp._last.clear()


def test_plugin_module_is_light() -> None:
    """Importing the registered plugin module imports neither torch nor cudamem."""
    code = (
        "import sys, pytest_cudamem\n"
        "print(sorted(m for m in ('torch', 'cudamem') if m in sys.modules))"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


# --------------------------------------------------------------------------- GPU


@pytest.mark.cuda
def test_cuda_leak_fails_with_holder_and_peak_is_measured(inner: pytest.Pytester) -> None:
    inner.makepyfile(
        test_gpu="""
        import pytest
        import torch

        CACHE = []

        @pytest.mark.limit_gpu_leaks
        def test_leaks():
            CACHE.append(torch.ones(1024, 1024, device="cuda"))

        @pytest.mark.limit_gpu_leaks(warmup=1)
        def test_matmul_is_clean():
            a = torch.randn(1024, 1024, device="cuda")
            (a @ a).sum().item()  # the cuBLAS workspace is cleared before judging

        @pytest.mark.limit_gpu_memory("64 MiB")
        def test_peak_over():
            x = torch.empty(128 * 1024 * 1024, dtype=torch.uint8, device="cuda")
            del x

        @pytest.mark.limit_gpu_memory("64 MiB")
        def test_peak_under():
            x = torch.empty(16 * 1024 * 1024, dtype=torch.uint8, device="cuda")
            del x
        """
    )
    result = run(inner, "-v")
    result.assert_outcomes(passed=2, failed=2)
    result.stdout.fnmatch_lines(
        [
            "*test_leaks FAILED*",
            "*test_matmul_is_clean PASSED*",
            "*test_peak_over FAILED*",
            "*test_peak_under PASSED*",
        ]
    )
    result.stdout.fnmatch_lines(
        [
            "*1 cuda storage (4.0 MiB) created by this test is still alive*",
            "*test_gpu.CACHE?0?",
        ]
    )
    result.stdout.fnmatch_lines(["*allocated up to 128.0 MiB on cuda:0 at once*"])


@pytest.mark.cuda
def test_cuda_verdicts_with_reused_baselines(inner: pytest.Pytester) -> None:
    """A leak right after a clean test (whose last look is its baseline) fails; a fixture's
    tensor made between tests (an allocation: no reuse) is never blamed on the test."""
    inner.makepyfile(
        test_reuse="""
        import pytest
        import torch

        CACHE = []
        OLD = [torch.ones(128, 1024, device="cuda")]

        @pytest.fixture
        def fresh():
            return torch.ones(1024, 1024, device="cuda")  # set up before the baseline

        def test_clean_first():
            x = torch.ones(512, 1024, device="cuda")
            del x

        def test_swaps_an_old_tensor_for_a_leak():
            # The same bytes allocated after as before: the old storage's death forces a
            # census, which finds the new one.
            OLD.pop()
            CACHE.append(torch.ones(128, 1024, device="cuda"))

        def test_leaks_after_clean():
            CACHE.append(torch.ones(256, 1024, device="cuda"))

        def test_with_fixture(fresh):
            assert fresh.sum().item() == 1024 * 1024

        def test_clean_last():
            y = torch.zeros(64, device="cuda")
            del y
        """
    )
    result = run(inner, "-v", "--cudamem")
    result.assert_outcomes(passed=3, failed=2)
    result.stdout.fnmatch_lines(
        [
            "*test_clean_first PASSED*",
            "*test_swaps_an_old_tensor_for_a_leak FAILED*",
            "*test_leaks_after_clean FAILED*",
            "*test_with_fixture PASSED*",
            "*test_clean_last PASSED*",
        ]
    )
    result.stdout.fnmatch_lines(["*1 cuda storage (512.0 KiB) created by this test*"])
    result.stdout.fnmatch_lines(["*1 cuda storage (1.0 MiB) created by this test*"])


@pytest.mark.cuda
def test_cuda_fixture_sees_gpu_storages() -> None:
    mem = TestMemory("t", "cuda")
    kept = torch.ones(1024, 1024, device="cuda")
    check = mem.check()
    assert check.leaked_bytes == 4 * 1024**2
    assert any("kept" in h for h in check.leaked[0].paths)
    assert check.peak is not None and check.peak >= 4 * 1024**2
    del kept
    assert mem.check().leaked_bytes == 0

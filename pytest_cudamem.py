"""cudamem's pytest plugin: fail tests that leave CUDA storages behind or pass a peak limit.

Registered through the ``pytest11`` entry point ``cudamem`` (``-p no:cudamem`` turns it off).
This module is what pytest imports at start-up, so it imports neither torch nor cudamem: it
only adds the options, the markers and the ``gpu_memory`` fixture. The measuring code
(:mod:`cudamem.integrations.pytest_plugin`) is imported when the first checked test runs, so
collecting tests never imports torch through this plugin and never initialises CUDA.

* ``@pytest.mark.limit_gpu_leaks(limit="0 B", *, warmup=0, device=None)``: fail when storages
  the test created are still alive after it (beyond ``limit`` bytes), naming their holders;
* ``@pytest.mark.limit_gpu_memory(limit, *, warmup=0, device=None)``: fail when the test's
  peak (the most it had allocated at once beyond what was allocated when it started) passes
  ``limit``;
* ``--cudamem``: apply ``limit_gpu_leaks()`` to every test; ``--cudamem-device=cpu``: measure
  CPU storages instead of CUDA ones (for CPU-only projects, and to test the plugin in CI).
"""

from __future__ import annotations

import warnings
from collections.abc import Generator, Iterator
from typing import Any

import pytest

__all__ = ["gpu_memory"]

_MARKERS = ("limit_gpu_leaks", "limit_gpu_memory")

#: The tests whose CUDA checks measured nothing (no CUDA device), for the terminal summary.
_UNMEASURED = pytest.StashKey[list[str]]()


def _unmeasured(config: pytest.Config, nodeid: str) -> None:
    config.stash.setdefault(_UNMEASURED, []).append(nodeid)


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("cudamem", "GPU memory checks (cudamem)")
    group.addoption(
        "--cudamem",
        action="store_true",
        default=False,
        help="fail every test whose CUDA storages outlive it (as @pytest.mark.limit_gpu_leaks)",
    )
    group.addoption(
        "--cudamem-device",
        choices=("cuda", "cpu"),
        default=None,
        help="which storages the checks count: cuda (default) or cpu",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "limit_gpu_leaks(limit='0 B', *, warmup=0, device=None): fail when storages the test "
        "created are still alive after it, naming their holders (cudamem)",
    )
    config.addinivalue_line(
        "markers",
        "limit_gpu_memory(limit, *, warmup=0, device=None): fail when the test's peak "
        "allocation passes limit, e.g. '512 MiB' (cudamem)",
    )


def pytest_report_header(config: pytest.Config) -> str | None:
    if config.getoption("cudamem"):
        device = config.getoption("cudamem_device") or "cuda"
        return f"cudamem: every test is checked for {device} storages that outlive it"
    return None


def _wanted(item: pytest.Item) -> bool:
    if item.config.getoption("cudamem"):
        return True
    return any(item.get_closest_marker(name) is not None for name in _MARKERS)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, Any, None]:
    if not _wanted(item):
        yield
        return
    from cudamem.integrations import pytest_plugin

    # Bad marker arguments raise a UsageError here; warm-up calls of the test run here too.
    run = pytest_plugin.start(item)
    outcome = yield
    if run is None:
        return
    if pytest_plugin.measured_nothing(run.spec.device):
        _unmeasured(item.config, item.nodeid)
    try:
        failure = pytest_plugin.finish(run, failed=outcome.excinfo is not None)
    except Exception as exc:  # a broken check must not change the test's outcome
        warnings.warn(f"cudamem could not check {item.nodeid}: {exc!r}", stacklevel=1)
        return
    if failure is not None:
        force = getattr(outcome, "force_exception", None)
        if callable(force):
            force(failure)
        else:  # pragma: no cover - pluggy < 1.1
            raise failure


@pytest.fixture
def gpu_memory(request: pytest.FixtureRequest) -> Iterator[Any]:
    """Measure the test by hand: ``gpu_memory.check()`` settles and returns what the test
    created that is still alive (with holders) and its peak, as a
    :class:`cudamem.integrations.pytest_plugin.MemoryCheck`."""
    from cudamem.integrations import pytest_plugin

    device = request.config.getoption("cudamem_device") or "cuda"
    memory = pytest_plugin.TestMemory(request.node.nodeid, device)
    if pytest_plugin.measured_nothing(device):
        _unmeasured(request.config, request.node.nodeid)
    yield memory
    memory.close()


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    """One line when GPU checks measured nothing: on a machine without a CUDA device
    ``limit_gpu_leaks``, ``limit_gpu_memory`` and ``gpu_memory`` pass unchecked, and a pass
    must not read as "no leak"."""
    names = config.stash.get(_UNMEASURED, [])
    if not names:
        return
    from cudamem.base.format import plural  # torch is imported already: a check ran

    terminalreporter.write_line(
        f"cudamem: the GPU checks of {plural(len(dict.fromkeys(names)), 'test')} measured "
        "nothing: torch sees no CUDA device (device='cpu' or --cudamem-device=cpu counts "
        "CPU storages instead)"
    )

"""What a demo experiment is and how one registers: ``Experiment`` (a table, a one-line
explanation and PASS/FAIL ``Check``s), ``@_experiment(key, text, gpus=..., device=...)`` (its
key, title, the GPUs it needs and where it runs, said once) and the helpers the experiments
share.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass, replace

from ..allocator import backend as _backend
from ..base.format import format_bytes
from ..spans.span import MemorySpan

__all__ = ["Check", "Experiment"]


MiB = 1024**2


@dataclass(frozen=True, slots=True)
class Check:
    """One PASS/FAIL line of the demo."""

    name: str
    passed: bool
    detail: str = ""


@dataclass(frozen=True, slots=True)
class Experiment:
    """One reproduced experiment: what it shows, its table and its checks.

    An experiment's function returns its table, notes and checks; its registration
    (``_experiment``) adds the key, title and explanation."""

    key: str = ""
    title: str = ""
    explanation: str = ""
    headers: tuple[str, ...] = ()
    rows: tuple[tuple[str, ...], ...] = ()
    checks: tuple[Check, ...] = ()
    #: Why the experiment did not run (no GPU), or None when it ran.
    skipped: str | None = None
    notes: tuple[str, ...] = ()

    @property
    def passed(self) -> bool:
        """True when it ran and every check passed."""
        return self.skipped is None and all(c.passed for c in self.checks)


#: Every experiment of the demo, in order: (key, function), as ``_experiment`` registers them.
_EXPERIMENTS: list[tuple[str, Callable[[], Experiment]]] = []


def _experiment(
    key: str, text: str, *, gpus: int = 0, device: int = 0
) -> Callable[[Callable[[int | None], Experiment]], Callable[[], Experiment]]:
    """Register the decorated run as the demo's next experiment, ``key``.

    ``text`` is its title, a blank line, and its explanation (``{device}`` is the device's
    index). The function registered runs it on ``cuda:device``, on the CPU where no GPU
    exists if ``gpus`` is 0, else skipped on a machine with fewer than ``gpus`` GPUs, and
    completes its result with the key, title and explanation.
    """
    title, _, explanation = inspect.cleandoc(text.replace("{device}", str(device))).partition(
        "\n\n"
    )
    explanation = " ".join(explanation.split())

    def register(run: Callable[[int | None], Experiment]) -> Callable[[], Experiment]:
        def experiment() -> Experiment:
            skip = _needs(gpus)
            if skip is not None:
                return Experiment(key, title, explanation, skipped=skip)
            out = run(device if gpus or _backend.get().device_count() > device else None)
            return replace(out, key=key, title=title, explanation=explanation)

        functools.update_wrapper(experiment, run, updated=())
        experiment.__doc__ = f"{title}\n\n{explanation}"
        _EXPERIMENTS.append((key, experiment))
        return experiment

    return register


def _needs(gpus: int) -> str | None:
    """Why an experiment cannot run here (too few GPUs), or None."""
    count = _backend.get().device_count() if gpus else 0
    if count >= gpus:
        return None
    if gpus == 1:
        return "needs a CUDA GPU"
    return f"needs two CUDA GPUs (this machine has {count}); the single-GPU variants run on cuda:0"


def _cuda(device: int | None) -> int:
    """The GPU of an experiment registered with ``gpus`` (it never runs without one)."""
    if device is None:
        raise RuntimeError("an experiment registered with gpus=0 asked for a GPU")
    return device


def _where(device: int | None) -> str:
    """Where the experiment's tensors live: the GPU, else the CPU."""
    return f"cuda:{device}" if device is not None else "cpu"


def _span_row(span: MemorySpan, device: int) -> tuple[str, ...]:
    d = span.device(device)
    return (
        span.name,
        format_bytes(d.allocated_delta, signed=True),
        format_bytes(d.reserved_delta, signed=True),
        format_bytes(d.after.allocated),
        format_bytes(d.after.reserved),
    )


def _bytes_check(name: str, measured: int | None, expected: int, *, within: int = 0) -> Check:
    """Passes when ``measured`` is known and ``expected`` give or take ``within`` bytes."""
    ok = measured is not None and abs(measured - expected) <= within
    return Check(name, ok, format_bytes(measured))


def _expect(name: str, span: MemorySpan, device: int, alloc: int, reserved: int) -> Check:
    d = span.device(device)
    ok = d.allocated_delta == alloc and d.reserved_delta == reserved
    detail = (
        f"allocated {format_bytes(d.allocated_delta, signed=True)} "
        f"(expected {format_bytes(alloc, signed=True)}), "
        f"reserved {format_bytes(d.reserved_delta, signed=True)} "
        f"(expected {format_bytes(reserved, signed=True)})"
    )
    return Check(name, ok, detail)

"""The seeds' experiments, reproduced through cudamem: collection only, no printing.

Each experiment returns a frozen ``Experiment`` (a table, a one-line explanation and
PASS/FAIL checks); ``python -m cudamem demo`` renders them. Experiments that need a GPU are
returned as skipped on a machine without one.

``@_experiment(key, text, gpus=..., device=...)`` registers each, in the demo's order: its
key, its title and explanation (``text``), the GPUs it needs and where it runs are said once,
there; the function below it only runs the experiment and returns its table and checks.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from ..base.format import format_bytes, plural
from ..holders.census import live_tensors
from .registry import _EXPERIMENTS, Check, Experiment, MiB, _cuda, _experiment, _where
from .seed001 import (
    _THREAD_PER_RUN,
    _judge_flat,
    _judge_plain,
    _judge_thread,
    _ledger_says,
    _line_text,
    _lines,
    _run,
    _runs,
)

__all__ = ["experiments", "run_demo"]


@_experiment(
    "seed001-gpu1-context-on-gpu0",
    """Seed 001: work on cuda:1 from a thread whose current device is cuda:0

    Every thread starts on cuda:0. Leaving `with torch.cuda.stream(s)` for a stream on
    cuda:1 restores cuda:0's stream and makes cuda:0 current again, and CUDA creates a
    context there (~0.5 GiB) that only the process exiting frees.
    torch.cuda.set_device(1) first avoids it.""",
    gpus=2,
    device=1,
)
def seed001_gpu1_context_on_gpu0(on: int | None) -> Experiment:
    device = _cuda(on)
    bad, good = _run("stream", device), _run("stream-set-device", device)
    context = next(iter(_lines(bad, 0, "context")), None)
    zero = bad["ledgers"].get("0", {})
    never = _ledger_says(
        bad, 0, r"never used|never allocated|did not use|never touched|untouched|unused device"
    )
    rows = []
    for label, out in (("no set_device (current: cuda:0)", bad), ("set_device(1) first", good)):
        ctx = next(iter(_lines(out, 0, "context")), None)
        rows.append(
            (
                label,
                ", ".join(f"cuda:{d}" for d in out["contexts"]),
                format_bytes(None if ctx is None else ctx["nbytes"]),
                format_bytes(out["nvml_process"].get("0")),
            )
        )
    checks = (
        Check(
            "without set_device, a CUDA context appears on cuda:0",
            0 in bad["contexts"]
            and context is not None
            and context["nbytes"] is not None
            and 256 * MiB <= context["nbytes"] <= 1536 * MiB,
            "no context line" if context is None else _line_text(context),
        ),
        Check(
            "nothing of PyTorch's is on cuda:0 (allocated and reserved 0)",
            zero.get("allocated") == 0 and zero.get("reserved") == 0,
            f"allocated {format_bytes(zero.get('allocated'))}, "
            f"reserved {format_bytes(zero.get('reserved'))}",
        ),
        Check(
            "explain() says this process never used cuda:0",
            never is not None,
            never or "no line of cuda:0's ledger says so",
        ),
        Check(
            "nvidia-smi lists this process on GPU 0",
            bad["nvml_process"].get("0") is not None,
            format_bytes(bad["nvml_process"].get("0")),
        ),
        Check(
            "the ledger says only exiting frees it (release() cannot)",
            context is not None and "exit" in context["frees"],
            "" if context is None else context["frees"],
        ),
        Check(
            "torch.cuda.set_device(1) first: no context on cuda:0",
            0 not in good["contexts"],
            ", ".join(f"cuda:{d}" for d in good["contexts"]),
        ),
    )
    notes = tuple(zero.get("text", "").splitlines())
    return Experiment(
        headers=("run", "contexts", "cuda:0 context (explain)", "NVML on GPU 0"),
        rows=tuple(rows),
        checks=checks,
        notes=notes,
    )


seed001_gpu1_thread_per_run = _experiment(
    "seed001-gpu1-thread-per-run", _THREAD_PER_RUN, gpus=2, device=1
)(_runs("thread", _judge_thread))


seed001_gpu1_plain_loop = _experiment(
    "seed001-gpu1-plain-loop",
    """Seed 001: the plain loop on torch.device('cuda:1')

    The same stream and thread every run: the workspaces of the first run are reused, so
    allocated stays flat.""",
    gpus=2,
    device=1,
)(_runs("plain", _judge_plain))


seed001_gpu1_pin_memory = _experiment(
    "seed001-gpu1-pin-memory",
    """Seed 001: a pin-memory DataLoader feeding cuda:1

    Pinned host buffers live in host memory (the CUDA host allocator caches them), not in the
    device's allocator: allocated on cuda:1 stays flat.""",
    gpus=2,
    device=1,
)(_runs("pin-memory", _judge_flat))


@_experiment(
    "census",
    """The census: every live storage once, largest first

    live_tensors() counts storages (views and saved tensors share one), not tensors.""",
)
def census_now(device: int | None) -> Experiment:
    where = _where(device)
    base = torch.zeros(256, 1024, device=where)
    views = [base[i] for i in range(4)]
    census = live_tensors(where)
    mine = [s for s in census if s.data_ptr == base.untyped_storage().data_ptr()]
    checks = (
        Check(
            "a tensor and four views are one storage of 1 MiB",
            len(mine) == 1 and mine[0].nbytes == 1 * MiB and mine[0].tensors == 5,
            f"{plural(len(mine), 'storage')}, {plural(mine[0].tensors if mine else 0, 'tensor')}",
        ),
    )
    rows = tuple(
        (s.device, format_bytes(s.nbytes), s.dtype, "×".join(map(str, s.shape)), str(s.tensors))
        for s in list(census)[:5]
    )
    del views, base
    return Experiment(
        headers=("device", "bytes", "dtype", "shape", "tensors"), rows=rows, checks=checks
    )


def experiments() -> Sequence[tuple[str, Callable[[], Experiment]]]:
    """Every experiment of the demo, in order: (key, function)."""
    return tuple(_EXPERIMENTS)


def run_demo(
    only: Sequence[str] | None = None,
    progress: Callable[[str], None] | None = None,
) -> list[Experiment]:
    """Run the experiments (or ``only`` those keys) and return their results.

    An experiment that fails with an exception becomes a failed check, not a crash.
    Raises ValueError naming an unknown key in ``only`` (and the valid ones).
    """
    keys = [key for key, _ in experiments()]
    if only is not None:
        if isinstance(only, str):
            raise TypeError("only must be a sequence of experiment keys, not a str")
        unknown = [k for k in only if k not in keys]
        if unknown:
            raise ValueError(
                f"only: unknown experiment key {unknown[0]!r}; valid keys: {', '.join(keys)}"
            )
    results = []
    for key, func in experiments():
        if only and key not in only:
            continue
        if progress is not None:
            progress(key)
        try:
            results.append(func())
        except Exception as exc:
            results.append(
                Experiment(
                    key,
                    key,
                    "the experiment raised",
                    checks=(Check("ran without error", False, f"{type(exc).__name__}: {exc}"),),
                )
            )
    return results

"""Seed 001's candidate causes of "memory grows by one training per run", one per process.

Run as ``python -m cudamem.demo.seed001_runs CASE DEVICE``: trains the seed's ``NaiveN`` once per
run, ``RUNS`` times, the way ``CASE`` says, each run inside ``cudamem.track("seed001 run")``
and cleaned up as the seed did (every variable deleted, ``empty_cache()``); then asks
``cudamem.explain()`` and ``cudamem.release()`` and prints one JSON object. A fresh process per
case, so that contexts, cuBLAS handles and stream pools start empty.

Cases:

``stream``
    each run on a new ``torch.cuda.Stream(device)``, from a thread whose current device stays
    cuda:0 (no ``torch.cuda.set_device``).
``stream-set-device``
    the same after ``torch.cuda.set_device(device)``.
``thread``
    each run in a new thread (which sets its device first).
``plain``
    each run on the current stream of the main thread (``torch.device(f"cuda:{n}")`` only).
``pin-memory``
    each run fed by a ``DataLoader(pin_memory=True)``.

``cudamem.demo`` turns the JSON into experiments with PASS/FAIL checks.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import threading
import warnings
from collections.abc import Callable
from typing import Any

import torch

import cudamem
from cudamem.base.data import to_data

from .seed001 import NaiveN

__all__ = ["CASES", "RUNS", "main", "run_case"]

RUNS = 6
CASES = ("stream", "stream-set-device", "thread", "plain", "pin-memory")


def _train(device: str, batches: Any = None) -> None:
    """One run of seed 001's loop: a new model and optimizer, one step, everything deleted."""
    model = NaiveN(1024).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    if batches is None:
        batches = [(torch.ones(1024, 1024), torch.ones(1024, 1))]
    for x_, y_ in batches:
        x = x_.to(device, non_blocking=True)
        y = y_.to(device, non_blocking=True)
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()  # type: ignore[no-untyped-call]
        optimizer.step()
        del loss, x, y
    del model, optimizer


def _on_new_stream(device: str) -> None:
    stream = torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]
    with torch.cuda.stream(stream):
        _train(device)
    stream.synchronize()


def _in_new_thread(device: str) -> None:
    failure: list[BaseException] = []

    def work() -> None:
        try:
            torch.cuda.set_device(device)
            _train(device)
        except BaseException as exc:  # re-raised in the caller's thread
            failure.append(exc)

    thread = threading.Thread(target=work, name="seed001 run")
    thread.start()
    thread.join()
    if failure:
        raise failure[0]


def _with_pinned_loader(device: str) -> None:
    data = torch.utils.data.TensorDataset(torch.ones(2048, 1024), torch.ones(2048, 1))
    loader = torch.utils.data.DataLoader(data, batch_size=1024, pin_memory=True)
    _train(device, loader)


def _process_on_gpus() -> dict[str, int | None]:
    """NVML's figure for this process on each GPU it appears on (NVML index → bytes)."""
    status = cudamem.machine_status()
    out: dict[str, int | None] = {}
    for dev in status.devices:
        for proc in dev.processes or ():
            if proc.pid == os.getpid():
                out[str(dev.index)] = proc.used
    return out


def _ledgers() -> dict[str, Any]:
    explanation = cudamem.explain()
    return {
        str(ledger.device): {
            "text": str(ledger),
            "lines": to_data(ledger.lines),
            "notes": list(ledger.notes),
            "allocated": ledger.allocator.allocated,
            "reserved": ledger.allocator.reserved,
        }
        for ledger in explanation.devices
    }


def run_case(case: str, index: int) -> dict[str, Any]:
    """Run ``case`` on ``cuda:index`` in this process; the figures as plain data."""
    if case not in CASES:
        raise ValueError(f"case must be one of {CASES}, got {case!r}")
    device = f"cuda:{index}"
    runs: dict[str, Callable[[str], None]] = {
        "stream": _on_new_stream,
        "stream-set-device": _on_new_stream,
        "thread": _in_new_thread,
        "plain": _train,
        "pin-memory": _with_pinned_loader,
    }
    if case == "stream-set-device":
        torch.cuda.set_device(device)
    levels = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(RUNS):
            with cudamem.track("seed001 run", device=index) as span:
                runs[case](device)
                gc.collect()
                torch.cuda.empty_cache()  # as the seed did after each run
            after = span.device(index).after
            levels.append({"allocated": after.allocated, "reserved": after.reserved})
    leak_texts = [str(w.message) for w in caught if isinstance(w.message, cudamem.LeakWarning)]
    contexts = list(cudamem.allocator.backend.get().initialized_devices())
    ledgers = _ledgers()
    on_gpus = _process_on_gpus()
    released = cudamem.release(index, clear_cublas=True)
    freed = released[index]
    return {
        "case": case,
        "device": index,
        "current_device": torch.cuda.current_device(),
        "runs": levels,
        "leak_warnings": leak_texts,
        "contexts": contexts,
        "ledgers": ledgers,
        "nvml_process": on_gpus,
        "release": {
            "freed_allocated": freed.freed_allocated,
            "freed_reserved": freed.freed_reserved,
            "still_allocated": freed.still_allocated,
            "nvml_freed": freed.nvml_freed,
            "cublas_cleared": released.cublas_cleared,
        },
        "ledgers_after_release": _ledgers(),
    }


def main(argv: list[str] | None = None) -> int:
    """``python -m cudamem.demo.seed001_runs CASE DEVICE``: print the case's figures as JSON."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2 or not args[1].isdigit():
        print(f"usage: python -m cudamem.demo.seed001_runs {{{','.join(CASES)}}} DEVICE_INDEX")
        return 2
    print(json.dumps(run_case(args[0], int(args[1]))))
    return 0


if __name__ == "__main__":
    sys.exit(main())

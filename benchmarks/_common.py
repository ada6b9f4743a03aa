"""Shared helpers of the benchmark scripts: timing statistics, tables, JSON output."""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
from collections.abc import Sequence
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from cudamem.render.text import render_table


def machine() -> dict[str, Any]:
    """What the figures were measured on."""
    info: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cpu": platform.processor() or platform.machine(),
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
        info["gpus"] = torch.cuda.device_count()
    return info


def median(xs: Sequence[float]) -> float:
    return statistics.median(xs)


def spread(xs: Sequence[float]) -> tuple[float, float]:
    """(min, max) of the samples."""
    return min(xs), max(xs)


def emit(
    title: str,
    headers: Sequence[str],
    rows: Sequence[Sequence[str]],
    data: dict[str, Any],
    out: str,
) -> None:
    """Print the table and write the JSON next to it."""
    print(render_table(headers, rows, title=title))
    data = {"machine": machine(), **data}
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as fh:
        json.dump(data, fh, indent=2)
    print(f"\nwrote {out}")

"""Which generations ``gc.collect`` was asked for, in order, while a test runs."""

from __future__ import annotations

import gc

import pytest


def counted_collections(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """``gc.collect`` replaced (for the test) by one that appends each call's generation to
    the list returned (2 for a full collection), then collects."""
    generations: list[int] = []
    real = gc.collect

    def counting(generation: int = 2) -> int:
        generations.append(generation)
        return real(generation)

    monkeypatch.setattr(gc, "collect", counting)
    return generations

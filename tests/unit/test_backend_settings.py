"""The allocator settings the backend reads from the environment (no GPU needed)."""

from __future__ import annotations

import pytest

from cudamem.allocator import backend as _backend

MiB = 1024**2


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("expandable_segments:True", True),
        ("max_split_size_mb:128,expandable_segments:True", True),
        ("expandable_segments:False", False),
        ("", False),
        ("garbage_collection_threshold:0.8", False),
    ],
)
def test_expandable_segments_read_from_the_alloc_conf(
    monkeypatch: pytest.MonkeyPatch, value: str, expected: bool
) -> None:
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", value)
    assert _backend.expandable_segments() is expected


def test_reserved_for_rounds_to_segments_or_pages(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "")
    assert _backend.reserved_for(256 * MiB) == 256 * MiB
    assert _backend.reserved_for(11 * MiB) == 12 * MiB
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    assert _backend.reserved_for(256 * MiB) == 260 * MiB  # 13 pages of 20 MiB (H200)
    assert _backend.reserved_for(20 * MiB) == 20 * MiB

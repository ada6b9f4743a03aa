"""An alloc/free pattern that runs out of memory with half of what it reserved free.

One segment of ``PIECES`` blocks of ``PIECE`` bytes, every other block freed: holes of
``PIECE`` that the segment's live blocks keep in the cache. Under a per-process memory fraction
that leaves ``SPARE`` bytes beside the segment, a request of ``1.5 × PIECE`` fits in the free
bytes together but in no hole: the default allocator raises OOM, expandable segments unmap the
holes' pages and map the request at the end of the segment.

``python -m tests.gpu.fragment_pattern`` runs it once and prints what happened as JSON (the
GPU test runs it under ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``).
"""

from __future__ import annotations

import json

import torch

MiB = 1024**2
#: A multiple of the 20 MiB page of expandable segments: each hole is whole pages.
PIECE = 200 * MiB
PIECES = 20
#: Allowed above the segment: less than the request, so the request needs the holes.
SPARE = 96 * MiB
REQUEST = PIECE * 3 // 2


def limit_memory() -> None:
    """Allow this process what it reserves now plus the segment plus ``SPARE``."""
    torch.cuda.empty_cache()
    base = torch.cuda.memory_reserved()
    total = torch.cuda.mem_get_info()[1]
    torch.cuda.set_per_process_memory_fraction((base + PIECES * PIECE + SPARE) / total)


def unlimit_memory() -> None:
    torch.cuda.set_per_process_memory_fraction(1.0)
    torch.cuda.empty_cache()


def fragment() -> list[torch.Tensor]:
    """The segment with every other block freed: the live half, returned."""
    whole = torch.empty(PIECES * PIECE, dtype=torch.uint8, device="cuda")
    del whole  # the segment stays cached as one free block; the pieces split it
    pieces = [torch.empty(PIECE, dtype=torch.uint8, device="cuda") for _ in range(PIECES)]
    return pieces[0::2]


def main() -> None:
    import cudamem

    torch.cuda.init()
    limit_memory()
    kept = fragment()
    try:
        before = cudamem.fragmentation()
        big = torch.empty(REQUEST, dtype=torch.uint8, device="cuda")
        print(
            json.dumps(
                {
                    "ran": big.numel() == REQUEST,
                    "expandable": before.expandable,
                    "free_before": before.cached,
                    "reserved_before": before.reserved,
                    "largest_free_before": before.largest_free,
                }
            )
        )
        del big
    finally:
        del kept
        unlimit_memory()


if __name__ == "__main__":
    main()

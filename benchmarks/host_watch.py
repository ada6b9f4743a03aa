"""What watching DataLoader workers costs: whole epochs with and without
``cudamem.host.workers.watch_workers()`` (the defaults ``cudamem run`` uses), interleaved.

An epoch iterates a DataLoader (2 forked workers, batch 256, shuffled) over a dataset whose
200,000 labels sit in a list of dicts: the copy-on-read case the watcher is for, so its
workers grow and it reads them. Rounds run bare, watched, bare, watched, ...; each watched
epoch is divided by the mean of the bare epochs on either side of it. The table gives the
median of those ratios and their range, and the watcher's own ``/proc`` reading time as a share
of its epoch (what the budget bounds: 0.5 % of one core for ``smaps_rollup``, plus the fault
reads). One watcher serves the whole run, as in ``cudamem run``: the dataset's first epoch is
read at its start and end whatever the budget (reported apart), later epochs as the budget
allows. Goal: at most 1 % of an epoch.

Each sample also runs a 1,000-step loop (``--work``), standing in for decoding, so that an
epoch lasts seconds rather than the fraction of one a bare list lookup takes.

Usage: ``python benchmarks/host_watch.py [--rounds 5] [--items 200000] [--work 1000]
[--out benchmarks/results/host_watch.json]`` (~1 minute on the 2-core CPU machine).
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from _common import emit, median, spread
from torch.utils.data import DataLoader, Dataset

from cudamem.host import workers


class Records(Dataset[int]):
    """Labels in a list of dicts; ``work`` stands for a sample's decoding (a loop of that many
    additions, ~15 ns each)."""

    def __init__(self, n: int, work: int) -> None:
        self.records = [{"id": i, "path": f"img_{i:07d}.jpg", "label": i % 10} for i in range(n)]
        self.work = range(work)

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, i: int) -> int:
        return int(self.records[i]["label"]) + (sum(self.work) & 0)


def epoch(dataset: Records) -> float:
    loader = DataLoader(dataset, batch_size=256, num_workers=2, shuffle=True)
    t0 = time.perf_counter()
    for _ in loader:
        pass
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--items", type=int, default=200_000)
    parser.add_argument("--work", type=int, default=1000, help="per-sample loop length")
    parser.add_argument("--out", default="benchmarks/results/host_watch.json")
    args = parser.parse_args()
    dataset = Records(args.items, args.work)
    epoch(dataset)  # warm-up: imports, first fork
    # One watcher for the run, as `cudamem run` has: its first epoch of this dataset is read
    # in full (at its start and as its workers end), later ones as the budget allows. Bare
    # epochs unhook torch's iterator, so the watcher sees nothing of them.
    watcher = workers.watch_workers()
    t_first = time.perf_counter()
    epoch(dataset)
    first = {"epoch_s": time.perf_counter() - t_first, "read_s": watcher.cost}
    first["smaps_reads"] = watcher.full_reads
    bare: list[float] = []
    watched: list[float] = []
    own: list[float] = []
    reads: list[int] = []
    for _ in range(args.rounds):
        workers._remove_hook()
        bare.append(epoch(dataset))
        workers._install_hook()
        cost, count = watcher.cost, watcher.full_reads
        watched.append(epoch(dataset))
        own.append(watcher.cost - cost)
        reads.append(watcher.full_reads - count)
    workers._remove_hook()
    bare.append(epoch(dataset))
    reports = workers.stop_watching()
    growth = [r.growth for r in reports]
    ratios = [w / ((bare[i] + bare[i + 1]) / 2) - 1 for i, w in enumerate(watched)]
    shares = [c / w for c, w in zip(own, watched, strict=True)]
    lo, hi = spread(ratios)
    rows = [
        ["epoch, bare", f"{median(bare):.2f} s ({min(bare):.2f}–{max(bare):.2f})", ""],
        ["epoch, watched", f"{median(watched):.2f} s ({min(watched):.2f}–{max(watched):.2f})", ""],
        ["watched vs bare", f"{median(ratios):+.2%} ({lo:+.2%} to {hi:+.2%})", "wall clock"],
        [
            "watcher's /proc reads",
            f"{median(shares):.3%} ({min(shares):.3%}–{max(shares):.3%})",
            f"{statistics.median(reads):.0f} smaps_rollup reads an epoch",
        ],
        [
            "first epoch of the dataset",
            f"{first['read_s'] / first['epoch_s']:.3%} of {first['epoch_s']:.2f} s",
            f"{first['smaps_reads']:.0f} smaps_rollup reads (its start and end)",
        ],
    ]
    data: dict[str, Any] = {
        "items": args.items,
        "work": args.work,
        "workers": 2,
        "batch": 256,
        "rounds": args.rounds,
        "bare_s": bare,
        "watched_s": watched,
        "ratio_minus_1": ratios,
        "watcher_read_s": own,
        "watcher_share": shares,
        "smaps_reads": reads,
        "growth_bytes": growth,
        "first_epoch": first,
        "median_ratio_minus_1": median(ratios),
        "median_watcher_share": median(shares),
    }
    emit(
        f"watching DataLoader workers: {args.items:,} dicts, 2 workers, batch 256 "
        f"({args.rounds} interleaved rounds; median (range))",
        ["", "figure", "note"],
        rows,
        data,
        args.out,
    )


if __name__ == "__main__":
    main()

"""One memory report for a whole ``torch.distributed`` job, gathered on rank 0.

Every rank calls ``gather_report`` at the same point (after a training phase, before
``destroy_process_group``). Each collects its own row — pid, host, the CUDA devices it holds a
context on, allocated/reserved/peak per device, its spans (``cudamem.history``
aggregates) and how fast their level grows, the growth the leak detector found, its device
ledgers (``cudamem.explain``) and NVML's list of which process holds memory on which GPU —
and rank 0 receives every row and builds a ``DistributedReport``:

* a table per rank, and the outlier ranks named (highest peak, highest growth per call);
* memory outside PyTorch's allocator per rank and device (NVML's figure for the process minus
  the allocator's reserved bytes, as the ledger computes it), and of it what NCCL's buffers
  probably take: that figure minus a bare CUDA context (inferred, never measured);
* the GPU map (rank ↔ PID ↔ GPU, from NVML's per-GPU process lists and each rank's own
  contexts), and for every rank that holds memory on a GPU other than its own, the usual cause
  (``torch.cuda.set_device`` missing, a tensor created on ``cuda:0``, ``barrier()`` without
  ``device_ids``): the answer to "why is there memory on GPU 0 from every rank".

The rows travel as JSON text through the job's key-value store (``._transport`` says why
not through a collective). Nothing here can hang a job: a rank whose collection fails sends a
row with its errors instead, and a rank that never answers shows as a row saying so once the
timeout passes. Collection (``collect_rank``), analysis (``build_report``,
pure) and rendering (``cudamem.render.distributed``) stay apart.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from typing import Any

from ..base.args import check_bool
from ..base.data import to_data
from . import _transport
from . import results as _results
from ._analysis import build_report
from ._collect import collect_rank
from .results import *  # noqa: F403  (re-exports the results: ``_results.__all__``)
from .results import DistributedReport, RankReport, absent_row, describe, failure

__all__ = [*_results.__all__, "build_report", "collect_rank", "gather_report"]


def _decode(raw: Any, rank: int, size: int) -> RankReport:
    if not isinstance(raw, str):
        return absent_row(rank, size, f"rank {rank} sent no row ({type(raw).__name__})")
    try:
        row = RankReport.from_dict(json.loads(raw))
    except Exception as exc:
        return absent_row(rank, size, failure(f"rank {rank} sent a row that cannot be read", exc))
    return row


def _encode(row: RankReport) -> str:
    try:
        return json.dumps(to_data(row))
    except Exception as exc:  # a row must always travel, if only with its error
        fallback = absent_row(row.rank, row.world_size, failure("encoding the row", exc))
        return json.dumps({**to_data(fallback), "pid": row.pid, "host": row.host})


def gather_report(
    group: Any = None,
    *,
    timeout: float = 60.0,
    all_ranks: bool = False,
    ledger: bool = True,
    context_estimate: int | None = None,
) -> DistributedReport | None:
    """Every rank's memory, gathered on the group's first rank: a collective, call it on all.

    Each rank collects its row (``collect_rank``) and puts it, as JSON, in the job's
    key-value store (the one ``init_process_group`` used); the first rank of ``group``
    (default: the whole job) waits up to ``timeout`` seconds for every row and returns the
    ``DistributedReport``. The other ranks return ``None`` at once — or, with
    ``all_ranks=True``, every rank waits and returns the report. Without
    ``torch.distributed`` initialised, the report has this process only.

    Never hangs and never raises from its own bookkeeping: a rank whose collection fails sends
    a row with its errors, and a rank that does not answer within ``timeout`` gets a row
    saying so. Call it on every rank of ``group`` the same number of times (each call's rows
    are told apart by a per-group count).

    Args:
        group: a ``torch.distributed`` process group (``None``: the default group).
        timeout: seconds to wait for the slowest rank (collection included).
        all_ranks: return the report on every rank, not only the collector.
        ledger: run ``cudamem.explain`` per device (a census: slower on big heaps).
        context_estimate: bytes of a bare CUDA context, against which NCCL's share of the
            memory outside the allocator is inferred (default ``CONTEXT_ESTIMATE``).
    """
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
    check_bool("all_ranks", all_ranks)
    check_bool("ledger", ledger)
    if context_estimate is not None and (
        isinstance(context_estimate, bool)
        or not isinstance(context_estimate, int)
        or context_estimate < 0
    ):
        raise ValueError(
            f"context_estimate must be a number of bytes >= 0, got {context_estimate!r}"
        )
    dist = _dist_module()
    if dist is None or not dist.is_initialized():
        if group is not None:
            raise ValueError("group was given but torch.distributed is not initialised")
        why = (
            "torch.distributed is not available in this build"
            if dist is None
            else "torch.distributed is not initialised"
        )
        row = collect_rank(0, 1, ledger=ledger, context_estimate=context_estimate)
        return build_report([row], world_size=1, notes=(f"{why}: this process only",))
    try:
        size = int(dist.get_world_size(group))
        rank = int(dist.get_rank())
        members = [
            int(r)
            for r in dist.get_process_group_ranks(dist.group.WORLD if group is None else group)
        ]
        backend = str(dist.get_backend(group))
    except Exception as exc:
        raise ValueError(f"group is not a usable process group: {exc}") from None
    if rank not in members:
        raise ValueError(f"this process (rank {rank}) is not a member of group")
    try:
        row = collect_rank(
            rank, size, backend=backend, ledger=ledger, context_estimate=context_estimate
        )
    except Exception as exc:  # still send a row: the others are waiting for it
        row = absent_row(rank, size, failure("collecting this rank's row", exc))
        row = dataclasses.replace(row, pid=os.getpid())
    started = time.perf_counter()
    try:
        got = _transport.exchange(
            dist, _encode(row), group, members, timeout=timeout, all_ranks=all_ranks
        )
    except Exception as exc:  # the gloo fallback failed as a whole
        got = ([None] * len(members), describe(exc)) if rank == members[0] or all_ranks else None
    seconds = time.perf_counter() - started
    if got is None:
        return None  # not the collector
    payloads, error = got
    rows = []
    for raw, r in zip(payloads, members, strict=True):
        if raw is not None:
            rows.append(_decode(raw, r, size))
        elif r == rank:
            rows.append(row)
        else:
            rows.append(absent_row(r, size, f"no answer within {timeout:g} s"))
    notes = (f"the exchange ended after {seconds:.1f} s: {error}",) if error else ()
    return build_report(rows, world_size=size, collector=rank, seconds=seconds, notes=notes)


def _dist_module() -> Any:
    try:
        import torch.distributed as dist
    except Exception:
        return None
    try:
        return dist if dist.is_available() else None
    except Exception:
        return None

"""Transport: every rank's row (JSON text) to the collector, with a timeout that holds.

The rows go through the job's key-value store, the one ``init_process_group`` rendezvoused
through: each rank ``set``\\ s its row under a key of this call, and the collector ``wait``\\ s for
the keys with the timeout given, then reads what arrived. No process group, no tensor, no GPU
and no background thread is involved, so nothing here can put memory on cuda:0 (NCCL's object
collectives stage the rows on the current GPU), abort the process (a timed-out NCCL
collective does), or race the interpreter's exit (a gloo collective's work object drops its
tensors from gloo's own thread, which aborts a process that is already finalising). The other
ranks do not even wait: they set their key and return.

Only when the store cannot be reached (it is private to ``torch.distributed``, and the MPI
backend has none) do the rows go through ``gather_object`` / ``all_gather_object`` on the
group itself, under that group's own timeout.
"""

from __future__ import annotations

import threading
import zlib
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

from ..base.format import plural
from .results import describe

__all__ = ["Exchanged", "exchange"]

#: ``(payloads, error)``: one payload per member in group order (``None`` for a rank that sent
#: nothing in time), and why some are missing.
Exchanged = tuple[list[str | None], str | None]


class _Calls:
    """How many reports each group has exchanged: every member counts the same calls in the
    same order, so the count names this call's keys on every rank."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.counts: dict[tuple[int, ...], int] = {}

    def next(self, members: tuple[int, ...]) -> int:
        with self.lock:
            n = self.counts.get(members, 0) + 1
            self.counts[members] = n
            return n


_calls = _Calls()


def _store(dist: Any) -> Any:
    """The default group's store, or ``None`` when this torch does not expose it."""
    try:
        get = dist.distributed_c10d._get_default_store
    except AttributeError:
        return None
    try:
        return get()
    except Exception:
        return None


def _via_store(
    store: Any,
    payload: str,
    members: tuple[int, ...],
    me: int,
    *,
    timeout: float,
    all_ranks: bool,
) -> Exchanged | None:
    n = _calls.next(members)
    tag = f"{zlib.crc32(','.join(map(str, members)).encode()):08x}-{len(members)}"
    prefix = f"cudamem/report/{tag}/{n}"
    keys = [f"{prefix}/{r}" for r in members]
    store.set(f"{prefix}/{me}", payload)
    if not all_ranks and me != members[0]:
        return None
    late: str | None = None
    try:
        store.wait(keys, timedelta(seconds=timeout))
    except Exception as exc:  # some rank did not answer in time: read what arrived
        late = describe(exc)
    payloads: list[str | None] = []
    for key in keys:
        if late is not None and not store.check([key]):
            payloads.append(None)
            continue
        payloads.append(bytes(store.get(key)).decode("utf-8", "replace"))
    missing = payloads.count(None)
    error = None
    if late is not None:
        # The store's own message lists every key: name the count instead.
        error = f"{missing} of {plural(len(keys), 'row')} missing" if missing else late
    _clean(store, prefix, keys, len(members), all_ranks=all_ranks)
    return payloads, error


def _clean(store: Any, prefix: str, keys: Sequence[str], size: int, *, all_ranks: bool) -> None:
    """Delete this call's keys once nobody needs them (the last reader does it)."""
    try:
        if all_ranks and store.add(f"{prefix}/read", 1) < size:
            return
        for key in (*keys, f"{prefix}/read"):
            store.delete_key(key)
    except Exception:
        pass  # a store without delete_key keeps a few kilobytes; nothing breaks


def _via_group(
    dist: Any, payload: str, group: Any, size: int, *, all_ranks: bool
) -> Exchanged | None:
    """The object collectives over ``group`` itself (its own timeout applies)."""
    if all_ranks:
        out: list[Any] = [None] * size
        dist.all_gather_object(out, payload, group=group)
    else:
        dst = dist.get_global_rank(group, 0) if group is not None else 0
        mine = dist.get_rank() == dst
        out = [None] * size
        dist.gather_object(payload, out if mine else None, dst=dst, group=group)
        if not mine:
            out = []
    if "gloo" in str(dist.get_backend(group)).lower():
        # gloo's worker thread drops the collective's tensors just after the collective ends;
        # were the interpreter exiting by then, that thread would abort the process. One more
        # round trip gives it that moment.
        dist.barrier(group=group)
    if not out:
        return None
    return [x if isinstance(x, str) else None for x in out], None


def exchange(
    dist: Any,
    payload: str,
    group: Any,
    members: Sequence[int],
    *,
    timeout: float,
    all_ranks: bool,
) -> Exchanged | None:
    """Send this rank's ``payload``; on the collector (``members[0]``), and on every rank with
    ``all_ranks``, return every member's payload; ``None`` elsewhere. Raises only when the
    fallback collective fails (its group's timeout, a lost peer)."""
    ranks = tuple(members)
    me = int(dist.get_rank())
    store = _store(dist)
    if store is not None:
        return _via_store(store, payload, ranks, me, timeout=timeout, all_ranks=all_ranks)
    return _via_group(dist, payload, group, len(ranks), all_ranks=all_ranks)

"""The live-tensor census: every live storage once, and what the allocator holds beyond it.

``live_tensors()`` counts storages, not tensors: views, ``detach()`` and saved tensors share
one. Bytes come from ``untyped_storage().nbytes()`` (never numel × element size, which
misreads views and non-contiguous tensors). Storages come from two places: tensor objects
gc tracks, and tensors saved inside autograd graphs (which may have no Python object at all).

What the allocator holds beyond the storages is ``unaccounted.py``'s: it sets the
allocator's ``allocated`` bytes against this census, block by block.
"""

from __future__ import annotations

import gc
import sys
import time
from collections.abc import Container, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from ..allocator.device_arg import DeviceLike, resolve_device
from ..base.format import format_bytes, plural
from ..base.frames import own_frame
from ..base.present import Presented
from ..base.sequence import ItemSequence
from ..native import heap as _heap
from ..native import heapscan as _heapscan
from . import _autograd
from ._autograd import StorageKey
from ._naming import frame_locals
from ._search_base import SearchLimits
from ._storages import StorageRef, matches_type, ref_of
from .finder import Holders, find_holders

__all__ = [
    "Acc",
    "Census",
    "LiveStorage",
    "StorageSnapshot",
    "gather",
    "listing_order",
    "live_refs",
    "live_storage_keys",
    "live_storages",
    "live_tensors",
    "storages_since",
]


@dataclass(frozen=True, slots=True)
class LiveStorage(Presented):
    """One live storage: the value every report uses (census, leaks, OOM post-mortems,
    ``release()``). Plain data but for ``ref``, a weak reference that keeps nothing
    alive."""

    json_properties: ClassVar[tuple[str, ...]] = ("through_autograd",)

    device: str
    nbytes: int
    dtype: str
    #: Shape of the largest tensor found on this storage.
    shape: tuple[int, ...]
    #: Tensor objects sharing it (0: only an autograd graph holds it).
    tensors: int
    #: Whether an autograd graph saved it.
    saved_by_autograd: bool
    #: Where the storage starts: an address, not an identity (after a free the allocator
    #: gives it to the next block of that size). Allocator blocks start there too.
    data_ptr: int
    #: Its holders, when asked for (``live_tensors(holders=True)``, leak and OOM reports).
    holders: Holders | None = None
    #: ``file:line in function`` where it was allocated (OOM reports with history on).
    allocated_at: str | None = None
    #: The CUDA graphs' private pool it lives in, while graphs still use that pool
    #: (``release()``): ``private pool (1, 0) of a torch.cuda.graph``.
    pool: str | None = None
    #: Its identity, the one cudamem compares storages by: a weak reference to the
    #: StorageImpl, equal to another ref of the same storage whenever either was taken
    #: (``None`` for a storage with no real data).
    ref: StorageRef | None = field(
        default=None, compare=False, repr=False, metadata={"json": False}
    )

    @property
    def alive(self) -> bool:
        """Whether this storage still exists now."""
        return self.ref is not None and self.ref.alive

    @property
    def paths(self) -> tuple[str, ...]:
        """The holder paths, most direct first (empty when holders were not asked for)."""
        return () if self.holders is None else tuple(h.path for h in self.holders)

    @property
    def through_autograd(self) -> bool:
        """Held only through other tensors' autograd graphs."""
        found = self.holders
        return bool(found) and all(h.route.through_graph for h in found or ())

    @property
    def truncated(self) -> bool:
        """Whether the holder search was cut short or left graph nodes uninspected."""
        return self.holders is not None and bool(self.holders.notes)

    @property
    def python(self) -> bool:
        """Whether a Python tensor object refers to it (else only a graph does)."""
        return self.tensors > 0

    def describe(self) -> str:
        """``float32[256, 256]``, prefixed ``saved by autograd`` when no tensor object holds it,
        and the private pool it lives in, if any."""
        what = f"{self.dtype}[{', '.join(map(str, self.shape))}]"
        if not self.python:
            what = f"saved by autograd {what}"
        if self.pool is not None:
            what += f" (in {self.pool}: freed only with the graphs that use it)"
        return what


def listing_order(storage: LiveStorage) -> tuple[int, str]:
    """Sort key for listing storages: largest first, then by holder path, never by address
    (which differs from run to run), so that the same program gives the same table."""
    return (-storage.nbytes, min(storage.paths, default="\uffff"))


@dataclass(frozen=True, slots=True)
class Census(ItemSequence[LiveStorage], Presented):
    """Every live storage once, largest first."""

    json_properties: ClassVar[tuple[str, ...]] = ("total", "by_device")

    storages: tuple[LiveStorage, ...]
    notes: tuple[str, ...] = ()
    elapsed: float = 0.0

    def _items(self) -> tuple[LiveStorage, ...]:
        """The storages."""
        return self.storages

    @property
    def total(self) -> int:
        """Bytes of all storages."""
        return sum(s.nbytes for s in self.storages)

    def by_device(self) -> dict[str, int]:
        """Bytes per device."""
        out: dict[str, int] = {}
        for s in self.storages:
            out[s.device] = out.get(s.device, 0) + s.nbytes
        return out


class StorageSnapshot(Mapping[StorageRef, tuple[str, int]]):
    """Which storages existed at one moment: each one's identity (``StorageRef``) →
    ``(device, bytes)``. Keeps nothing alive (the refs are weak).

    A read-only mapping that never changes: the analyses return new snapshots, so that
    "what a span or a test created and is still alive" reads as
    ``live_refs().new_since(before).alive()``. Storages are compared by identity, never by
    address: one freed since ``before`` whose address a new storage took is not in
    ``before``, and the new one is new. ``storages()`` is the census of those still alive,
    as ``LiveStorage`` values with holders.
    """

    __slots__ = ("_sizes",)

    def __init__(self, sizes: Mapping[StorageRef, tuple[str, int]] | None = None) -> None:
        self._sizes: dict[StorageRef, tuple[str, int]] = {} if sizes is None else dict(sizes)

    @classmethod
    def _owning(cls, sizes: dict[StorageRef, tuple[str, int]]) -> StorageSnapshot:
        """A snapshot of ``sizes`` without a copy: the caller gives the dict up."""
        snap = cls.__new__(cls)
        snap._sizes = sizes
        return snap

    @classmethod
    def of(cls, tensors: Iterable[Any]) -> StorageSnapshot:
        """The storages of ``tensors`` (each once; views and copies of one storage are
        one): a baseline of chosen tensors rather than of everything alive."""
        sizes: dict[StorageRef, tuple[str, int]] = {}
        for t in tensors:
            info = _autograd.storage_of(t)
            ref = None if info is None else ref_of(t)
            if info is not None and ref is not None and ref not in sizes:
                sizes[ref] = (_autograd.key_device(info[0]), info[1])
        return cls._owning(sizes)

    def __getitem__(self, ref: StorageRef) -> tuple[str, int]:
        return self._sizes[ref]

    def __contains__(self, ref: object) -> bool:
        return ref in self._sizes

    def __iter__(self) -> Iterator[StorageRef]:
        return iter(self._sizes)

    def __len__(self) -> int:
        return len(self._sizes)

    def __repr__(self) -> str:
        return f"<StorageSnapshot: {plural(len(self), 'storage')}, {format_bytes(self.nbytes)}>"

    @property
    def nbytes(self) -> int:
        """Bytes of all its storages."""
        return sum(n for _d, n in self._sizes.values())

    def new_since(self, base: Container[StorageRef]) -> StorageSnapshot:
        """The storages of this snapshot that ``base`` (an earlier snapshot) does not have:
        those created between the two."""
        return self._owning({r: v for r, v in self._sizes.items() if r not in base})

    def alive(self) -> StorageSnapshot:
        """Those of its storages that still exist now (no census: each ref is asked)."""
        return self._owning({r: v for r, v in self._sizes.items() if r.alive})

    def all_alive(self) -> bool:
        """Whether every one of its storages still exists (no census: each ref is asked)."""
        return all(r.alive for r in self._sizes)

    def on(self, device_type: str | None) -> StorageSnapshot:
        """Those on devices of ``device_type`` (``'cuda'``, ``'cpu'``; ``None``: all)."""
        if device_type is None:
            return self
        return self._owning(
            {r: v for r, v in self._sizes.items() if matches_type(v[0], device_type)}
        )

    def largest(self, n: int) -> StorageSnapshot:
        """Its ``n`` largest storages (all of them when it has no more)."""
        if len(self._sizes) <= n:
            return self
        top = sorted(self._sizes.items(), key=lambda kv: kv[1][1], reverse=True)[:n]
        return self._owning(dict(top))

    def union(self, other: Mapping[StorageRef, tuple[str, int]]) -> StorageSnapshot:
        """Its storages and ``other``'s (this snapshot's figures where both have one)."""
        return self._owning({**other, **self._sizes})

    def storages(self, *, holders: bool = True) -> tuple[LiveStorage, ...]:
        """The census of those of its storages still alive now, largest first; ``holders``:
        with the holders of each (one search for all of them)."""
        if not self._sizes:
            return ()
        return _census(None, holders, self, sys._getframe(1))[0].storages


# --------------------------------------------------------------------------- collection


@dataclass
class Acc:
    """One storage's figures while ``gather`` collects them (``first``, a tensor on it, and
    ``ref`` are released before a census returns)."""

    nbytes: int
    dtype: str
    shape: tuple[int, ...]
    numel: int
    tensors: int
    saved: bool
    first: Any  # a tensor on this storage (for holders); released before returning
    ref: StorageRef | None = None


@_heap.gc_paused()
def gather(
    device: str | None, scan: list[Any] | None = None, refs: bool = False, counts: bool = True
) -> tuple[dict[StorageKey, Acc], list[str]]:
    """Every live storage (of ``device``) once; ``refs``: with its ``StorageRef``;
    ``scan`` receives the tensor list, the graph walk, the heap snapshot and its edge cache
    (``_search.Prepared``), for a holder search to start from instead of scanning the heap
    again. ``counts=False``: the caller reads no Python-tensor
    counts, so the referrer pass that corrects them (``_discount_preserved``) is skipped.
    No cyclic collection runs meanwhile (see ``_census``)."""
    # One snapshot of the heap serves the tensor scan, the referrer pass below and the holder
    # search after it (``scan``), with one edge cache, once the compiled pass is active (a
    # listing costs as much as either pass).
    heap: list[Any] | None = None
    edges: Any = None
    if _heapscan.native() is not None and (counts or scan is not None):
        order: list[tuple[int, int]] = []
        kinds = _autograd.tensor_types()
        # A search of CPU storages looks for numpy arrays in its first pass: the walk keeps
        # those among the referents for it.
        arrays = _autograd.array_types() if scan is not None and device in (None, "cpu") else ()
        walked = _heap.walked(order, kinds, arrays[0] if arrays else None)
        if walked is not None:  # one walk of gc's lists: listing, tensors, edge cache
            heap, edges, found = walked
            tensors = _autograd.all_tensors(found=found, found_types=kinds)
        else:
            heap = _heap.snapshot(order)
            edges = _heap.edge_cache()
            tensors = _autograd.all_tensors(heap, order)
    else:  # the tensors only (no pass follows), read off gc's lists in place
        tensors = _autograd.all_tensors()
    # A search in another thread must not name our lists.
    handed = False
    with _heap.ignored(tensors, *(() if heap is None else (heap,))):
        try:
            acc, notes = _gather_from(tensors, device, scan, refs, heap, counts, edges)
            if scan is not None:
                scan.extend((heap, edges))
                handed = True
            return acc, notes
        finally:
            if heap is not None and not handed:
                heap.clear()


def _gather_from(
    tensors: list[Any],
    device: str | None,
    scan: list[Any] | None,
    refs: bool,
    heap: list[Any] | None = None,
    counts: bool = True,
    edges: Any = None,
) -> tuple[dict[StorageKey, Acc], list[str]]:
    notes: list[str] = []
    acc: dict[StorageKey, Acc] = {}
    key_of: dict[int, StorageKey] = {}  # id(tensor) → its storage (reused below)
    for t in tensors:
        info = _autograd.storage_of(t)
        if info is None:
            continue
        key, nbytes = info
        key_of[id(t)] = key
        if device is not None and _autograd.key_device(key) != device:
            continue
        dtype, shape, numel = _autograd.describe_tensor(t)
        a = acc.get(key)
        if a is None:
            acc[key] = Acc(nbytes, dtype, shape, numel, 1, False, t, ref_of(t) if refs else None)
        else:
            a.tensors += 1
            a.nbytes = max(a.nbytes, nbytes)
            if numel > a.numel:
                a.dtype, a.shape, a.numel = dtype, shape, numel
    owners = [t for t in tensors if _autograd.has_graph_or_grad(t)]
    walk = _autograd.walk_graphs(owners, known={id(t) for t in tensors}, refs=refs)
    walk_refs = walk.refs or {}
    for _owner, _chain, key, nbytes, _label in walk.saved:
        if device is not None and _autograd.key_device(key) != device:
            continue
        a = acc.get(key)
        if a is None:
            dtype, shape, numel = walk.saved_meta.get(key, ("?", (), 0))
            acc[key] = Acc(nbytes, dtype, shape, numel, 0, True, None, walk_refs.get(key))
        else:
            a.saved = True
    for _owner, _label, key, nbytes in walk.grads:
        if (device is None or _autograd.key_device(key) == device) and key not in acc:
            acc[key] = Acc(nbytes, "?", (), 0, 0, False, None, walk_refs.get(key))
    if counts:
        _discount_preserved(tensors, key_of, owners, walk, acc, heap, edges)
    if walk.truncated:
        notes.append(f"autograd walk stopped after {plural(walk.nodes, 'node')}")
    if walk.not_inspected:
        notes.append(
            f"{plural(len(walk.not_inspected), 'autograd node')} not inspected (saved-tensor hooks)"
        )
    if scan is not None:
        scan.extend((tensors, walk))
    else:
        tensors.clear()
    owners.clear()
    walk_refs.clear()
    return acc, notes


def _discount_preserved(
    tensors: list[Any],
    key_of: dict[int, StorageKey],
    owners: list[Any],
    walk: _autograd.GraphWalk,
    acc: dict[StorageKey, Acc],
    heap: list[Any] | None = None,
    edges: Any = None,
) -> None:
    """Stop counting tensor objects that only an autograd graph keeps.

    PyTorch keeps a tensor's Python object alive for as long as C++ holds the tensor, even
    after every Python reference is gone. A layer's input saved by its graph is then a
    "Python tensor" that nothing in Python refers to: the memory is held by the graph, and the
    census should say so. Such an object has no referrer but cudamem's own lists and is no
    running frame's local: one referrer pass over the candidates (tensors whose storage a
    graph saved; see ``cudamem.native.heap.referrers``) and a walk of every thread's frames
    tell them apart.
    """
    import types

    saved = {key for _o, _c, key, _n, _l in walk.saved}
    if not saved:
        return
    cands: dict[int, tuple[Any, StorageKey]] = {}
    for t in tensors:
        key = key_of.get(id(t))
        # Only storages this census counts (the device filter left others out of acc).
        if key is not None and key in saved and key in acc:
            cands[id(t)] = (t, key)
    if not cands:
        return
    ours = {id(tensors), id(owners), id(walk.saved), id(walk.grads), id(cands)}
    ours.update(id(entry) for entry in walk.saved)
    ours.update(id(entry) for entry in walk.grads)
    ours.update(id(entry) for entry in cands.values())
    ours.update((id(walk.py_nodes), id(walk.not_inspected)))
    ours.update(id(entry) for entry in walk.py_nodes.values())
    ours.update(id(entry) for entry in walk.not_inspected)
    referenced: set[int] = set()
    objs = [t for t, _k in cands.values()]
    ours.add(id(objs))
    try:
        referrers = _heap.referrers(objs, heap=heap, edges=edges)
        ours.add(id(referrers))
        for r in referrers:
            if id(r) in ours or type(r) is Acc:
                continue
            if type(r) is types.FrameType and own_frame(r):
                continue
            referenced.update(id(o) for o in gc.get_referents(r) if id(o) in cands)
        del referrers, r
        for top in list(sys._current_frames().values()):
            frame: types.FrameType | None = top
            while frame is not None:
                if not own_frame(frame):
                    referenced.update(id(v) for _n, v in frame_locals(frame) if id(v) in cands)
                frame = frame.f_back
            del top
    except Exception:
        return  # cannot tell: keep counting them as Python tensors
    finally:
        objs.clear()
    for ident, (_t, key) in cands.items():
        a = acc.get(key)
        if ident not in referenced and a is not None and a.tensors > 0:
            a.tensors -= 1
    cands.clear()


def _label(a: Acc, key: StorageKey) -> str:
    shape = ", ".join(map(str, a.shape))
    what = "Tensor" if a.tensors else "Saved tensor"
    return f"{what} {a.dtype}[{shape}] on {_autograd.key_device(key)}"


def _device_filter(device: DeviceLike | None) -> str | None:
    if device is None:
        return None
    if isinstance(device, str) and device == "cpu":
        return "cpu"
    if isinstance(device, torch.device) and device.type == "cpu":
        return "cpu"
    return f"cuda:{resolve_device(device)}"


def live_storage_keys(device_type: str | None = None) -> dict[tuple[str, int], int]:
    """``(device, data_ptr) → bytes`` of every live storage on devices of ``device_type``
    (``'cuda'``, ``'cpu'``, ``None`` for all): addresses at one instant, for totals. To
    compare two instants, use ``live_refs``."""
    acc, _ = gather(None, counts=False)
    out: dict[tuple[str, int], int] = {}
    for key, a in acc.items():
        if device_type is None or key[0] == device_type:
            out[(_autograd.key_device(key), key[2])] = a.nbytes
        a.first = None
    return out


def live_refs(device_type: str | None = None) -> StorageSnapshot:
    """Every live storage on devices of ``device_type`` (``'cuda'``, ``'cpu'``, ``None``):
    a ``StorageSnapshot``, each storage's ``cudamem.holders._storages.StorageRef`` →
    ``(device, bytes)``.

    The cheap pass (no holders) that before/after comparisons use: a storage of one pass is
    in another exactly when it is the same storage, wherever the allocator put the others.
    Keeps nothing alive; the refs are released with the snapshot.
    """
    acc, _ = gather(None, refs=True, counts=False)
    out: dict[StorageRef, tuple[str, int]] = {}
    for key, a in acc.items():
        if a.ref is not None and (device_type is None or key[0] == device_type):
            out[a.ref] = (_autograd.key_device(key), a.nbytes)
        a.first = a.ref = None
    return StorageSnapshot._owning(out)


def live_tensors(device: DeviceLike | None = None, *, holders: bool = False) -> Census:
    """Every live storage once, largest first.

    Args:
        device: ``None`` for all devices (CPU included), ``'cpu'``, or a CUDA device
            (``0``, ``'cuda:1'``, ``torch.device('cuda', 0)``).
        holders: also find each storage's holders (one search for all of them).
    """
    return _census(_device_filter(device), holders, None, sys._getframe(1))[0]


def live_storages(
    device_type: str | None = None,
    *,
    holders: bool = False,
    among: Iterable[StorageRef] | None = None,
) -> tuple[LiveStorage, ...]:
    """Live storages on devices of ``device_type`` (``'cuda'``, ``'cpu'``, ``None``), largest
    first; the holder search covers only these.

    ``among``: only the storages of these refs (a ``StorageSnapshot`` from ``live_refs``,
    ``LiveStorage.ref``s, taken at any earlier time) that are still alive.
    """
    only = None if among is None else among if isinstance(among, Mapping) else set(among)
    return _census(None, holders, only, sys._getframe(1), device_type)[0].storages


def storages_since(base: StorageSnapshot, *, limit: int) -> tuple[tuple[LiveStorage, ...], int]:
    """One census for a span's exit: the live storages (any device) new since ``base`` (a
    ``live_refs`` of the entry: ``StorageSnapshot.new_since``), the largest ``limit`` of
    them with holders, largest first; and how many there were before the limit."""
    census, total = _census(None, True, None, sys._getframe(1), since=base, limit=limit)
    return census.storages, total


@_heap.gc_paused()
def _census(
    device: str | None,
    holders: bool,
    only: Container[StorageRef] | None,
    frame: Any,
    device_type: str | None = None,
    *,
    since: StorageSnapshot | None = None,
    limit: int | None = None,
) -> tuple[Census, int]:
    """The census, and how many storages passed the filters (before ``limit``). No cyclic
    collection runs meanwhile: its own bookkeeping (a listing of the whole heap among it)
    would have every young-generation collection traverse it (a quarter of a census on a
    real training process's heap)."""
    t0 = time.perf_counter()
    scan: list[Any] = []
    acc, notes = gather(device, scan if holders else None, refs=True)
    keys = sorted(acc, key=lambda k: (-acc[k].nbytes, k))
    if device_type is not None:
        keys = [k for k in keys if k[0] == device_type]
    if only is not None:
        keys = [k for k in keys if acc[k].ref in only]
    if since is not None:
        sizes: dict[StorageRef, tuple[str, int]] = {}
        for k in keys:
            ref = acc[k].ref
            if ref is not None:
                sizes[ref] = (_autograd.key_device(k), acc[k].nbytes)
        new = StorageSnapshot._owning(sizes).new_since(since)
        # A storage without an identity cannot have been in ``since``: it counts as new.
        keys = [k for k in keys if acc[k].ref is None or acc[k].ref in new]
        del sizes, new
    total = len(keys)
    if limit is not None:
        keys = keys[:limit]
    found: dict[StorageKey, Holders] = {}
    if holders and keys:
        objs = [acc[k].first for k in keys]
        labels = [_label(acc[k], k) for k in keys]
        for a in acc.values():
            a.first = None  # our own bookkeeping must not show up as a holder
        results = find_holders(
            objs,
            SearchLimits(),
            frame,
            keys=list[StorageKey | None](keys),
            nbytes=list[int | None](acc[k].nbytes for k in keys),
            labels=labels,
            scan=(scan[0], scan[1], scan[2], scan[3]),
        )
        found = dict(zip(keys, results, strict=True))
        objs.clear()
    if scan:
        scan[0].clear()
        if scan[2] is not None:  # the snapshot, when no search took it over
            scan[2].clear()
    scan.clear()
    storages = tuple(
        LiveStorage(
            _autograd.key_device(k),
            acc[k].nbytes,
            acc[k].dtype,
            acc[k].shape,
            acc[k].tensors,
            acc[k].saved,
            k[2],
            found.get(k),
            ref=acc[k].ref,
        )
        for k in keys
    )
    if found:  # the same program lists the same table: by size, then path, not address
        storages = tuple(sorted(storages, key=listing_order))
    for a in acc.values():
        a.first = a.ref = None
    return Census(storages, tuple(notes), time.perf_counter() - t0), total

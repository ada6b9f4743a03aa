"""Finding the referrers of many objects at once, in few passes over the gc heap.

``gc.get_referrers(*objs)`` is one C-level scan, but it compares every reference on the heap
with each of ``objs`` in turn: cheap for a handful, k times the cost for k objects. For more,
a *chunked pass* over a snapshot of the heap asks ``gc.get_referents`` of 1,024 objects at
once (one C call) and tests the whole batch against a set of ids (``set.isdisjoint`` over
``map(id, ...)``, C again); only batches that refer to a wanted object are opened, in
sub-batches of 32 and then object by object. Its cost is a near-constant ~0.1 µs per heap
object whatever the number of wanted objects.

A pass may grow its set of wanted ids while it runs (the holder search adds each referrer it
finds), so one pass can climb several levels when parents lie further along the pass than
their children: passes run from the newest objects to the oldest (``snapshot`` orders
the heap by age), and parents are usually older than what they hold. The next pass then
only needs the newer part of the heap, up to where the last new object was found.

Everything here compares ids and calls only C functions of the interpreter: no ``__eq__``,
``__hash__`` or any other user code runs.
"""

from __future__ import annotations

import contextlib
import gc
import threading
import time
from collections.abc import Callable, Collection, Iterator
from itertools import compress, repeat
from operator import is_, not_
from typing import Any

from . import heapscan as _heapscan

__all__ = [
    "CHUNK",
    "OURS",
    "SMALL",
    "chunked_pass",
    "edge_cache",
    "gc_paused",
    "ignored",
    "referrers",
    "snapshot",
    "untracked_arrays",
    "walked",
]

#: Objects asked about at once below which ``gc.get_referrers`` beats a chunked pass.
SMALL = 64
#: Heap objects per ``gc.get_referents`` call in a chunked pass.
CHUNK = 1024
#: What a chunked pass in Python costs per heap object, in ns.
PASS_NS = 100
_SUB = 32
#: Most referent addresses one edge cache records (8 bytes each, plus 12 bytes per heap
#: object): a heap past it is traversed again, from where the recording stopped.
EDGE_BUDGET = 16 * 1024 * 1024


#: ids of cudamem's own containers alive now, in any thread (a search's bookkeeping, the
#: census's list of tensors): never reported as holders, never climbed through.
OURS: set[int] = set()
OURS_LOCK = threading.Lock()


@contextlib.contextmanager
def ignored(*containers: Any) -> Iterator[None]:
    """While the block runs, no holder search (in any thread) takes ``containers`` for
    holders."""
    ids = [id(c) for c in containers]
    with OURS_LOCK:
        OURS.update(ids)
    try:
        yield
    finally:
        with OURS_LOCK:
            OURS.difference_update(ids)


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """No cyclic collection while a search allocates its bookkeeping (a collection of a
    large heap, every few thousand allocations, tripled a search's cost); gc is enabled
    again on the way out if it was enabled on the way in."""
    was = gc.isenabled()
    if was:
        gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def snapshot(order: list[tuple[int, int]] | None = None) -> list[Any]:
    """Every gc-tracked object, oldest first (the generations' lists keep allocation order).

    The youngest generation is listed first: a list made earlier in this function would be
    young, and would otherwise appear in a later listing (the snapshot holding itself, with
    every object of the heap as a referent to test).

    ``order`` receives the ``(start, end)`` ranges that, read in turn, list the snapshot in
    ``gc.get_objects()``'s order: youngest generation first (the order the tensor scan
    promises).
    """
    with gc_paused():
        young = gc.get_objects(generation=0)
        middle = gc.get_objects(generation=1)
        objs = gc.get_objects(generation=2)
    if order is not None:
        old, mid = len(objs), len(objs) + len(middle)
        order[:] = [(mid, mid + len(young)), (old, mid), (0, old)]
    objs += middle
    objs += young
    return objs


def walked(
    order: list[tuple[int, int]], kinds: tuple[type, ...], array_type: type | None = None
) -> tuple[list[Any], Any, list[Any]] | None:
    """``snapshot(order)``, its ``edge_cache()`` with every object's referents recorded, and
    the objects of exactly the types ``kinds`` in ``gc.get_objects()``'s order, from one walk
    of gc's lists in C (``_heapscan``'s ``walk``): a listing, a type scan and the first
    traversal cost one walk of the heap instead of three. ``array_type``: the edge cache
    also keeps that type's instances (and the untracked dicts and tuples) among the
    referents, for the first array-mode pass. ``None`` while the compiled pass is not active
    or has no walk (Python 3.14 on): the caller lists the heap itself."""
    module = _heapscan.native()
    if module is None or not hasattr(module, "walk"):
        return None
    edges = module.edges(EDGE_BUDGET)
    with gc_paused():
        objs, (old, middle, young), found = module.walk(kinds, edges, array_type)
    mid = old + middle
    order[:] = [(mid, mid + young), (old, mid), (0, old)]
    return objs, edges, found


def edge_cache() -> Any:
    """An empty edge cache for the passes of one search over one snapshot, or ``None`` while
    the compiled pass is not active. The first pass records each object's referent addresses
    as it traverses it; the later passes read them instead of traversing again (a level of a
    search then costs a sequential read, not a walk of every object). The cache binds to the
    first snapshot it is used with; drop it with that snapshot."""
    module = _heapscan.native()
    return None if module is None else module.edges(EDGE_BUDGET)


def chunked_pass(
    objs: list[Any],
    wanted: Collection[int],
    on_hit: Callable[[Any], bool],
    *,
    at_least: int | None = None,
    deadline: float | None = None,
    array_type: type | None = None,
    on_arrays: Callable[[list[Any], list[tuple[Any, Any]]], bool] | None = None,
    added: list[int] | None = None,
    edges: Any = None,
) -> tuple[bool, int, bool]:
    """Call ``on_hit(o)`` for every ``o`` in ``objs`` that refers to an object whose id is in
    ``wanted``; ``on_hit`` may grow ``wanted`` and returns whether it did.

    The pass runs newest objects first (``objs`` is a ``snapshot``, oldest first):
    parents usually predate their children, so a child found early lets its parent, further
    along, be found in the same pass. An id added while the pass is at batch ``c`` has been
    tested against batches ``c`` onwards only; the next pass must cover batches ``0..c``.
    ``at_least``: scan only that many batches (what the previous pass's finds still need);
    ids added by such a shortened pass have been tested against part of the heap only.

    ``array_type`` and ``on_arrays``: objects of exactly that type among the referents
    (numpy arrays, which gc does not track), also inside untracked dicts and tuples, are
    handed to ``on_arrays`` with the edges to them (``untracked_arrays``) before the batch
    is tested, so that it can add them to ``wanted`` (returning whether it did).

    ``added``: a list the caller appends each id it adds to ``wanted`` to. Given it, the
    compiled pass (``cudamem.native.heapscan``), once active, runs the same pass in C: it reads
    the new ids from ``added`` after each callback instead of testing ``wanted`` itself.

    Returns ``(finished, last, whole)``: ``finished`` is ``False`` when ``deadline`` stopped
    it; ``last`` is the index of the last batch at which something was added (``-1``:
    nothing); ``whole`` whether it ran over every batch.

    ``edges``: an ``edge_cache()`` shared by the passes over ``objs`` (compiled pass only).
    """
    module = _heapscan.native() if added is not None else None
    if module is not None:
        seconds = None if deadline is None else deadline - time.perf_counter()
        with gc_paused():
            done, last, whole = module.scan(
                objs,
                wanted,
                added,
                on_hit,
                at_least,
                seconds,
                array_type if on_arrays is not None else None,
                on_arrays,
                edges,
            )
        return bool(done), int(last), bool(whole)
    isdisjoint = _isdisjoint(wanted)
    get = gc.get_referents
    last = -1
    n_batches = (len(objs) + CHUNK - 1) // CHUNK
    for k in range(n_batches):
        if at_least is not None and k >= at_least:
            return True, last, False
        if deadline is not None and not k & 7 and time.perf_counter() > deadline:
            return False, last, False
        end = len(objs) - k * CHUNK
        chunk = objs[max(0, end - CHUNK) : end]
        refs = get(*chunk)
        if on_arrays is not None and array_type is not None:
            found, edges = untracked_arrays(refs, array_type)
            if found and on_arrays(found, edges):
                last = k
        if isdisjoint(map(id, refs)):
            continue
        del refs
        for sub_start in range(len(chunk) - _SUB, -_SUB, -_SUB):
            sub = chunk[max(0, sub_start) : sub_start + _SUB]
            if isdisjoint(map(id, get(*sub))):
                continue
            for o in reversed(sub):
                if not isdisjoint(map(id, get(o))) and on_hit(o):
                    last = k
        del chunk
    return True, last, True


def untracked_arrays(refs: list[Any], array_type: type) -> tuple[list[Any], list[tuple[Any, Any]]]:
    """Objects of exactly ``array_type`` among ``refs``, and inside the dicts and tuples among
    them that gc does not track, at any depth: ``(arrays, edges)``.

    gc tracks no numpy array, and it stops tracking a dict (or, after a collection, a tuple)
    that holds only untracked objects: ``{"arr": t.numpy()}`` is invisible to a heap
    snapshot, so only the tracked object that refers to it (a module's dict, a frame)
    shows it among its referents. ``edges`` are ``(container, child)`` pairs from such an
    untracked container to an array or to another untracked container, so that the caller
    can name the path from what the heap does see down to the array.
    """
    types_ = list(map(type, refs))
    found = list(compress(refs, map(is_, types_, repeat(array_type))))
    edges: list[tuple[Any, Any]] = []
    level = _untracked_containers(refs, types_)
    seen: set[int] = set()
    while level:
        # One C call for the whole level decides whether any of it can lead to an array;
        # only then is each container looked at on its own (to know which holds what).
        kids = gc.get_referents(*level)
        kid_types = list(map(type, kids))
        if array_type not in kid_types and not _untracked_containers(kids, kid_types):
            break
        deeper = []
        for container in level:
            if id(container) in seen:
                continue
            seen.add(id(container))
            for child in gc.get_referents(container):
                tp = type(child)
                if tp is array_type:
                    found.append(child)
                    edges.append((container, child))
                elif (tp is dict or tp is tuple) and child and not gc.is_tracked(child):
                    deeper.append(child)
                    edges.append((container, child))
        level = deeper
    return found, edges


def _untracked_containers(refs: list[Any], types_: list[type]) -> list[Any]:
    """The non-empty dicts and tuples among ``refs`` that gc does not track."""
    out: list[Any] = []
    untracked = gc.is_tracked
    for kind in (dict, tuple):  # C-level filters throughout: this runs for every referent
        some = list(compress(refs, map(is_, types_, repeat(kind))))
        out += compress(some, map(not_, map(untracked, some)))
    return out


def _isdisjoint(wanted: Collection[int]) -> Callable[[Any], bool]:
    if isinstance(wanted, (set, frozenset)):
        return wanted.isdisjoint
    keys = wanted.keys() if isinstance(wanted, dict) else set(wanted)
    return keys.isdisjoint


def referrers(
    objs: list[Any],
    *,
    heap: list[Any] | None = None,
    deadline: float | None = None,
    edges: Any = None,
) -> list[Any]:
    """Every gc-tracked object that refers to one of ``objs``, in no promised order: one
    ``gc.get_referrers`` scan for a few, one chunked pass over ``heap`` (a ``snapshot``,
    taken if not given) for more, and always once the compiled pass is active (a snapshot
    and a compiled pass cost about half a one-object scan). The caller filters out its own
    containers. ``edges``: the ``edge_cache()`` of ``heap``, for passes after this one."""
    if len(objs) <= SMALL and _heapscan.native() is None:
        return gc.get_referrers(*objs)
    wanted = {id(o) for o in objs}
    out: list[Any] = []

    def hit(o: Any) -> bool:
        out.append(o)
        return False

    chunked_pass(
        heap if heap is not None else snapshot(),
        wanted,
        hit,
        deadline=deadline,
        added=[],
        edges=edges if heap is not None else None,
    )
    return out

"""The optional compiled heap pass (``native/src/heapscan/``): one walk of a heap snapshot finds the
referrers of any number of objects, ~10x faster than ``_heap.chunked_pass`` in Python.

Built, cached, loaded and switched like the span core (``cudamem.native.cext``: nothing at import,
a background build at the first heap pass while the Python pass serves, ``CUDAMEM_FAST_HEAP=0``
turns it off, ``status()`` says which pass serves and why); ``validate`` is its check: on a
small heap whose referrers are known (what ``gc.get_referrers`` says), the compiled pass
must find the same.

The traversal runs no Python code and calls no dunder; the pass keeps no reference after it
returns; callbacks (the search's own) run between traversals. See ``native/src/heapscan/``.

``walk`` (Python 3.11 to 3.13) lists the snapshot off gc's lists in place and records its
edge cache in the same walk: validated against three ``gc.get_objects`` listings and a pass
over its recording. The references it keeps (arrays and untracked containers leading to one,
in array mode) live in the edge cache, which its caller drops with the snapshot; the first
array-mode pass lets them go.
"""

from __future__ import annotations

import gc
from contextlib import AbstractContextManager
from typing import Any

from .cext import Extension, ExtensionStatus

__all__ = ["EXTENSION", "SWITCH_ENV", "native", "python_pass", "status", "validate", "wait"]

SWITCH_ENV = "CUDAMEM_FAST_HEAP"


def native() -> Any:
    """The compiled pass's module when it is active, else ``None`` (never waits)."""
    return EXTENSION.native()


def wait(timeout: float = 60.0) -> ExtensionStatus:
    """Start the build if needed, wait for it, validate; the status afterwards (benchmarks
    and tests use this; the search itself never waits)."""
    return EXTENSION.wait(timeout)


def status() -> ExtensionStatus:
    """Which heap pass serves the holder search, and why."""
    return EXTENSION.status()


def python_pass() -> AbstractContextManager[None]:
    """Within the block the Python pass serves (tests compare the two)."""
    return EXTENSION.python_path()


def validate(module: Any) -> str | None:
    """Why ``module`` cannot serve (its answer differs from ``gc.get_referrers`` on a heap
    whose referrers are known), or ``None``."""

    class Box:
        pass

    target = Box()
    other = Box()
    holders: list[Any] = [[target], {"k": target}, (target, 1), Box(), {target: 1}, [other]]
    holders[3].attr = target
    heap = list(holders) + [Box() for _ in range(3000)] + [[1, 2], {"x": other}]
    try:
        found: list[Any] = []
        added: list[int] = []

        def hit(o: Any) -> bool:
            found.append(o)
            return False

        expected = [o for o in gc.get_referrers(target) if any(o is h for h in heap)]

        def wrong(cache: Any) -> str | None:
            found.clear()
            finished, last, whole = module.scan(
                heap, {id(target)}, added, hit, None, None, None, None, cache
            )
            if not (finished and whole and last == -1):
                return f"the compiled pass reported ({finished}, {last}, {whole}) on a full pass"
            if {id(o) for o in found} != {id(o) for o in expected} or len(found) != len(expected):
                return "the compiled pass's referrers differ from gc.get_referrers'"
            return None

        problem = wrong(None)
        if problem is not None:
            return problem
        # With an edge cache: the first pass records, the second reads the recording.
        edges = module.edges(1 << 20)
        problem = wrong(edges) or wrong(edges)
        if problem is not None:
            return problem
        if module.edges_info(edges)[0] != (len(heap) + 1023) // 1024:
            return "the compiled pass's edge cache did not record the heap"
        # The in-place walk of gc's lists: the same objects, in gc.get_objects()'s order.
        listed = [o for o in gc.get_objects() if type(o) is Box]
        walked = module.gc_instances((Box,))
        same = len(walked) == len(listed) and all(
            a is b for a, b in zip(walked, listed, strict=True)
        )
        listed.clear()
        walked.clear()
        if not same:
            return "the compiled walk of gc's lists differs from gc.get_objects()"
        return _wrong_walk(module, Box, target, expected) if hasattr(module, "walk") else None
    except Exception as exc:
        return f"the compiled pass failed its check: {type(exc).__name__}: {exc}"
    finally:
        heap.clear()
        holders.clear()


def _wrong_walk(module: Any, kind: type, target: Any, expected: list[Any]) -> str | None:
    """Why ``module.walk`` cannot serve: its listing is not the three generations' listings
    oldest first, its ``found`` not the objects of ``kind`` in ``gc.get_objects()``'s order,
    or a pass reading the edge cache it recorded misses ``target``'s referrers."""
    was = gc.isenabled()
    gc.disable()  # a collection in between would move objects between generations
    young: list[Any] = []
    middle = old = objs = found = listing = young
    try:
        young = gc.get_objects(generation=0)
        middle = gc.get_objects(generation=1)
        old = gc.get_objects(generation=2)
        cache = module.edges(1 << 26)
        objs, _sizes, found = module.walk((kind,), cache, None)
        listing = old + middle + young
        # What was made after the listing (the listings, the call's argument tuples) is the
        # youngest: it ends the walk's listing.
        n = len(listing)
        if not n <= len(objs) <= n + 16 or not all(
            a is b for a, b in zip(objs[:n], listing, strict=True)
        ):
            return "the compiled walk lists the heap otherwise than gc.get_objects()"
        mine = [o for o in young + middle + old if type(o) is kind]
        same = len(mine) == len(found) and all(a is b for a, b in zip(mine, found, strict=True))
        mine.clear()
        if not same:
            return "the compiled walk's objects of a type differ from gc.get_objects()'"
        hits: list[Any] = []

        def hit(o: Any) -> bool:
            hits.append(o)
            return False

        module.scan(objs, {id(target)}, [], hit, None, None, None, None, cache)
        want = {id(o) for o in expected}
        got = {id(o) for o in hits if id(o) in want}
        hits.clear()
        if got != want:
            return "a pass over the compiled walk's edge cache misses referrers"
        return None
    finally:
        for lst in (young, middle, old, objs, found, listing):
            lst.clear()
        if was:
            gc.enable()


EXTENSION = Extension(
    stem="heapscan",
    name="heap pass",
    switch_env=SWITCH_ENV,
    idle_reason="not needed yet (no holder search has run)",
    exports=("scan", "edges", "edges_info", "instances", "gc_instances", "module_dicts"),
    validate=validate,
)

"""The large Python containers a dataset object holds: what copy-on-read un-shares.

A forked DataLoader worker shares its parent's pages until it touches an object: reading a
list of dicts writes every dict's reference count, and each write copies a page. Arrays,
tensors and ``bytes`` hold their data in one buffer the workers only read: they stay shared.

``large_containers`` walks a dataset's attributes (``__dict__`` and slots, never properties)
a few levels down, bounded in depth, attributes and samples, and calls no ``repr``, ``__eq__``,
``__hash__`` or ``__len__`` of user classes: only ``len`` of built-in containers and
``sys.getsizeof`` of built-in objects. Object bytes are estimated from an evenly spread sample
of the elements and their direct children, each object counted once.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

__all__ = ["ContainerAttr", "large_containers"]

#: Containers whose elements are Python objects (what copy-on-read copies).
_CONTAINERS = (list, tuple, dict, set, frozenset)
#: Built-in values whose size ``sys.getsizeof`` knows without running user code.
_LEAVES = (int, float, complex, str, bytes, bool, type(None))
_ATOMIC_BUFFERS = (bytes, bytearray, memoryview)

#: Elements sampled per container (evenly spread), attributes read per object, levels walked.
SAMPLE = 512
MAX_ATTRS = 64
MAX_DEPTH = 3
#: Below this many elements a container is not worth naming.
MIN_ELEMENTS = 1000


@dataclass(frozen=True, slots=True)
class ContainerAttr:
    """``dataset.items: list of 2,000,000 dicts``: a large container of Python objects."""

    #: Where it hangs: ``dataset.items``, ``dataset.dataset.records``.
    path: str
    #: ``list``, ``dict``, ...
    kind: str
    #: Its elements (for a dict: its values).
    count: int
    #: The elements' type, ``dict``; ``mixed`` when the sample shows several.
    element: str
    #: Estimated bytes of the objects: the container, its elements and their direct children.
    nbytes: int


def _size(obj: object) -> int:
    try:
        return int(sys.getsizeof(obj))
    except Exception:  # a broken __sizeof__ of a user class
        return 0


def _is_builtin(obj: object) -> bool:
    return type(obj) in _CONTAINERS or type(obj) in _LEAVES


def _children(obj: Any) -> list[object]:
    """Direct children of a built-in container or an object's ``__dict__`` values."""
    if type(obj) is dict:
        return [*obj.keys(), *obj.values()]
    if type(obj) in (list, tuple, set, frozenset):
        return list(obj)
    d = _instance_dict(obj)
    return [] if d is None else list(d.values())


def _instance_dict(obj: object) -> dict[str, object] | None:
    try:
        d = object.__getattribute__(obj, "__dict__")
    except Exception:
        return None
    return d if type(d) is dict else None


def _sample(container: Any, count: int) -> list[object]:
    if type(container) is dict:
        values = container.values()
        if count <= SAMPLE:
            return list(values)
        step = count // SAMPLE
        return [v for i, v in enumerate(values) if i % step == 0][:SAMPLE]
    if type(container) in (set, frozenset):
        out = []
        for i, v in enumerate(container):
            if i >= SAMPLE:
                break
            out.append(v)
        return out
    if count <= SAMPLE:
        return list(container)
    spread = count / SAMPLE
    return [container[int(i * spread)] for i in range(SAMPLE)]


def _estimate(container: object, count: int) -> tuple[int, str]:
    """Estimated object bytes of a container of ``count`` elements, and their type."""
    sample = _sample(container, count)
    if not sample:
        return _size(container), "objects"
    seen: set[int] = set()
    total = 0
    types: set[str] = set()
    for element in sample:
        types.add(type(element).__name__)
        for obj in (element, *(_children(element) if _is_builtin(element) else ())):
            if id(obj) in seen:
                continue
            seen.add(id(obj))
            total += _size(obj) if _is_builtin(obj) else 0
        if not _is_builtin(element):
            total += _size(element)
            d = _instance_dict(element)
            if d is not None:
                total += _size(d)
                for v in d.values():
                    if id(v) not in seen and _is_builtin(v):
                        seen.add(id(v))
                        total += _size(v)
    element = types.pop() if len(types) == 1 else "mixed"
    return _size(container) + int(total * count / len(sample)), element


def _attributes(obj: object) -> list[tuple[str, object]]:
    out: list[tuple[str, object]] = []
    d = _instance_dict(obj)
    if d is not None:
        out.extend((k, v) for k, v in d.items() if type(k) is str)
    for cls in type(obj).__mro__:
        slots = cls.__dict__.get("__slots__", ())
        for name in (slots,) if isinstance(slots, str) else slots:
            if not isinstance(name, str) or name in ("__dict__", "__weakref__"):
                continue
            try:
                out.append((name, object.__getattribute__(obj, name)))
            except Exception:
                continue
    return out[:MAX_ATTRS]


def _walkable(kind: type) -> bool:
    """User classes and torch's dataset wrappers (``Subset``, ``ConcatDataset``); not
    tensors, arrays or frames, whose data is one buffer."""
    module = getattr(kind, "__module__", None) or ""
    if module.startswith("torch"):
        return module.startswith("torch.utils.data")
    return not module.startswith(("numpy", "pandas", "builtins"))


def large_containers(dataset: object, *, name: str = "dataset") -> tuple[ContainerAttr, ...]:
    """The dataset's attributes that are large containers of Python objects, largest first.

    Walks attributes of attributes (a ``Subset``'s ``dataset``, a wrapper's ``data``) up to
    ``MAX_DEPTH`` levels; a container of Python objects is reported, not walked into.
    """
    found: list[ContainerAttr] = []
    seen: set[int] = {id(dataset)}
    stack: list[tuple[str, object, int]] = [(name, dataset, 0)]
    while stack:
        path, obj, depth = stack.pop()
        for attr, value in _attributes(obj):
            if id(value) in seen:
                continue
            seen.add(id(value))
            where = f"{path}.{attr}"
            kind = type(value)
            if kind in _CONTAINERS:
                count = len(value)  # type: ignore[arg-type]
                if count < MIN_ELEMENTS:
                    continue
                nbytes, element = _estimate(value, count)
                found.append(ContainerAttr(where, kind.__name__, count, element, nbytes))
            elif (
                depth + 1 < MAX_DEPTH
                and kind not in _LEAVES
                and not isinstance(value, _ATOMIC_BUFFERS)
                and not isinstance(value, type)
                and _instance_dict(value) is not None
                and _walkable(kind)
            ):
                stack.append((where, value, depth + 1))
    return tuple(sorted(found, key=lambda c: (-c.nbytes, c.path)))

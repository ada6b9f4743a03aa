"""Any cudamem result as plain data: one path from frozen results to dicts and lists.

A result's data is its fields, by their own names: a dataclass becomes a dict of its
fields (a ``NamedTuple`` likewise), tuples become lists, mappings dicts. A class may name
derived values worth a key of their own (a sum, a difference: properties, or methods that
take no argument) in a ``json_properties`` class attribute, and leave a field out with
``field(metadata={"json": False})``; ``json_order`` names keys that come first, in that
order (a value computed from a structure that its document has always led with). The same
idea therefore has the same key everywhere: ``nbytes`` for a storage's bytes, ``device`` as
the result holds it.

Results use it for ``to_dict()``; ``cudamem.render.json`` writes it out as a document.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

__all__ = ["to_data"]

_SCALARS = (str, int, float, bool, type(None))


def to_data(obj: Any) -> Any:
    """``obj`` as plain JSON data: dicts, lists, strings, numbers, booleans and ``None``.

    Accepts cudamem's results (frozen dataclasses and named tuples), live objects that
    snapshot themselves through ``to_dict()`` (a ``cudamem.MemorySpan``, a
    ``cudamem.ScalarLogger``), and lists, tuples and mappings of them.

    Raises:
        TypeError: for anything else, naming its type.
    """
    if isinstance(obj, _SCALARS):
        return obj
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        out = {
            f.name: to_data(getattr(obj, f.name))
            for f in dataclasses.fields(obj)
            if f.metadata.get("json", True)
        }
        for name in getattr(type(obj), "json_properties", ()):
            value = getattr(obj, name)
            out[name] = to_data(value() if callable(value) else value)
        first = getattr(type(obj), "json_order", ())
        return {**{k: out[k] for k in first if k in out}, **out} if first else out
    if isinstance(obj, tuple) and hasattr(obj, "_asdict"):
        return {k: to_data(v) for k, v in obj._asdict().items()}
    if isinstance(obj, Mapping):
        return {str(k): to_data(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple, set, frozenset)):
        return [to_data(v) for v in obj]
    to_dict = getattr(type(obj), "to_dict", None)
    if callable(to_dict):
        return to_data(to_dict(obj))
    raise TypeError(f"cudamem cannot render {type(obj).__name__} as JSON")

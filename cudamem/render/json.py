"""JSON rendering of cudamem results: one path from any frozen result to plain data.

A result's JSON is its fields, by their own names: a dataclass becomes an object of its
fields (a ``NamedTuple`` likewise), tuples become arrays, mappings objects. A class may name
derived values worth a key of their own (a sum, a difference: properties, or methods that
take no argument) in a ``json_properties`` class attribute, and leave a field out with
``field(metadata={"json": False})``. The same idea therefore has the same key everywhere:
``nbytes`` for a storage's bytes, ``device`` as the result holds it.

Every document ``to_json`` writes carries ``"schema"``: ``SCHEMA``, the version of
this layout, raised when a key changes its meaning or goes (new keys do not raise it).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import Any

__all__ = ["SCHEMA", "to_data", "to_json"]

#: Version of the JSON layout (raised when a key is renamed, removed or changes meaning).
SCHEMA = 1

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
        return out
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


def to_json(result: Any, *, kind: str | None = None, indent: int | None = 2) -> str:
    """A JSON document of ``result`` (or of a list/dict of results).

    The document starts with ``"kind"`` (when given: what it is, e.g. ``"cudamem.run"``)
    and ``"schema"``; an object's keys follow, anything else (a list) is ``"items"``.
    """
    data = to_data(result)
    head: dict[str, Any] = {} if kind is None else {"kind": kind}
    head["schema"] = SCHEMA
    body = data if isinstance(data, dict) else {"items": data}
    return json.dumps({**head, **body}, indent=indent, ensure_ascii=False)

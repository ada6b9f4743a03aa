"""JSON documents of cudamem results: the plain data of ``cudamem.base.data.to_data``, with a
``kind`` and a ``schema`` version in front.

Every document ``to_json`` writes carries ``"schema"``, the version of its layout, raised
when a key changes its meaning or goes (new keys do not raise it): ``SCHEMA``, or the
highest ``json_schema`` that a result type inside the document declares, so that a change
raises the version of the documents it changes and of no other. Raised so far:

* 2: ``DeviceRelease.remaining`` (``release()``, ``release_trainer()``) lists
  ``LiveStorage`` values, as every other report does, where it had ``device`` (an index),
  ``nbytes``, ``description`` and ``holders`` (paths).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import Any

from ..base.data import to_data

__all__ = ["SCHEMA", "schema_of", "to_data", "to_json"]

#: Version of the JSON layout of documents whose types declare none (raised when a key is
#: renamed, removed or changes meaning).
SCHEMA = 1


def schema_of(obj: Any) -> int:
    """The layout version of ``obj``'s document: the highest ``json_schema`` of the result
    types in it, ``SCHEMA`` where none declares one."""
    version: int = getattr(type(obj), "json_schema", SCHEMA)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        inner = [
            getattr(obj, f.name) for f in dataclasses.fields(obj) if f.metadata.get("json", True)
        ]
    elif isinstance(obj, Mapping):
        inner = list(obj.values())
    elif isinstance(obj, (list, tuple, set, frozenset)) and not hasattr(obj, "_asdict"):
        inner = list(obj)
    else:
        return version
    return max([version, *map(schema_of, inner)])


def to_json(result: Any, *, kind: str | None = None, indent: int | None = 2) -> str:
    """A JSON document of ``result`` (or of a list/dict of results).

    The document starts with ``"kind"`` (when given: what it is, e.g. ``"cudamem.run"``)
    and ``"schema"``; an object's keys follow, anything else (a list) is ``"items"``.
    """
    data = to_data(result)
    head: dict[str, Any] = {} if kind is None else {"kind": kind}
    head["schema"] = schema_of(result)
    body = data if isinstance(data, dict) else {"items": data}
    return json.dumps({**head, **body}, indent=indent, ensure_ascii=False)

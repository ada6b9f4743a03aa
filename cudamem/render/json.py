"""JSON documents of cudamem results: the plain data of ``cudamem._data.to_data``, with a
``kind`` and a ``schema`` version in front.

Every document ``to_json`` writes carries ``"schema"``: ``SCHEMA``, the version of
this layout, raised when a key changes its meaning or goes (new keys do not raise it).
"""

from __future__ import annotations

import json
from typing import Any

from .._data import to_data

__all__ = ["SCHEMA", "to_data", "to_json"]

#: Version of the JSON layout (raised when a key is renamed, removed or changes meaning).
SCHEMA = 1


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

"""JSON rendering of cudamem results (anything with ``to_dict()``)."""

from __future__ import annotations

import json
from typing import Any

__all__ = ["to_json"]


def _default(obj: Any) -> Any:
    to_dict = getattr(type(obj), "to_dict", None)
    if callable(to_dict):
        return to_dict(obj)
    if isinstance(obj, (set, frozenset, tuple)):
        return list(obj)
    raise TypeError(f"cudamem cannot render {type(obj).__name__} as JSON")


def to_json(result: Any, *, indent: int | None = 2) -> str:
    """Serialise a result object (or a list/dict of them) to a JSON string."""
    return json.dumps(result, default=_default, indent=indent, ensure_ascii=False)

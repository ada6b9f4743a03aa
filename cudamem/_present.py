"""The one interface between results and their renderers.

A result never imports a renderer. Its ``__str__`` (and ``_repr_html_``, for notebooks)
calls ``present(self)``, which looks up the renderer registered for the result's type. A
renderer registers itself with ``@renders(ResultType)`` (``@renders(ResultType, "html")``
for notebook HTML) when its module is imported, and ``cudamem/__init__`` imports
``cudamem.render``, which imports every renderer. So imports only run one way —
renderers → results → here — and every renderer is in place once ``import cudamem``
has returned, whichever cudamem module a user imports.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal, TypeVar

__all__ = ["Format", "present", "renderer_for", "renders"]

#: What a renderer writes: plain text (``str()``, the command line) or HTML (notebooks).
Format = Literal["text", "html"]
_FORMATS = ("text", "html")

_R = TypeVar("_R", bound=Callable[[Any], str])
_renderers: dict[tuple[str, type], Callable[[Any], str]] = {}


def renders(cls: type, fmt: Format = "text") -> Callable[[_R], _R]:
    """Register the decorated function as the ``fmt`` renderer of ``cls`` (and subclasses).

    Raises:
        TypeError: ``cls`` is not a class.
        ValueError: ``fmt`` is not ``"text"`` or ``"html"``.
    """
    if not isinstance(cls, type):
        raise TypeError(f"cls must be a class, not {type(cls).__name__}")
    if fmt not in _FORMATS:
        raise ValueError(f"fmt must be 'text' or 'html', not {fmt!r}")

    def register(fn: _R) -> _R:
        _renderers[(fmt, cls)] = fn
        return fn

    return register


def renderer_for(cls: type, fmt: Format = "text") -> Callable[[Any], str] | None:
    """The renderer registered for ``cls`` or its nearest base class, or ``None``."""
    for klass in cls.__mro__:
        fn = _renderers.get((fmt, klass))
        if fn is not None:
            return fn
    return None


def present(obj: object, fmt: Format = "text") -> str:
    """``obj`` rendered by its registered renderer.

    Without one (only possible while ``cudamem`` itself is still being imported) the text
    is ``object.__repr__``'s, never an exception: ``str()`` of a result must not fail.
    """
    fn = renderer_for(type(obj), fmt)
    if fn is None:
        return object.__repr__(obj)
    return fn(obj)

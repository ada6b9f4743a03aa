"""The one interface between results and their renderers.

A result never imports a renderer. It derives from ``Presented`` (or ``PresentedHtml``, for
notebooks), whose ``__str__`` (and ``_repr_html_``) calls ``present(self)``, which looks up
the renderer registered for the result's type. A renderer registers itself with
``@renders(ResultType)`` (``@renders(ResultType, "html")`` for notebook HTML) when its
module is imported. ``import cudamem`` imports no renderer: the first ``present`` (or
``renderer_for``) imports ``cudamem.render``, which imports every renderer module, once per
process. So imports only run one way — renderers → results → here — and every renderer is
in place before the first result is drawn, whichever cudamem
module a user imported.
"""

from __future__ import annotations

import importlib
import threading
from collections.abc import Callable
from typing import Any, Literal, TypeVar

__all__ = ["Format", "Presented", "PresentedHtml", "present", "renderer_for", "renders"]

#: What a renderer writes: plain text (``str()``, the command line) or HTML (notebooks).
Format = Literal["text", "html"]
_FORMATS = ("text", "html")

#: The package whose import registers every renderer (imported by name: a module here,
#: below every result, must not import it).
_RENDERERS = "cudamem.render"

_R = TypeVar("_R", bound=Callable[[Any], str])
_renderers: dict[tuple[str, type], Callable[[Any], str]] = {}

# Whether ``cudamem.render`` has been imported (or tried): set once, read without the lock.
_loaded = False
# Reentrant: a renderer module that draws a result while it is being imported finds the
# table as far as it is filled instead of waiting on itself.
_load_lock = threading.RLock()
_loading = False


def _load_renderers() -> None:
    """Import ``cudamem.render`` (every renderer registers itself) the first time only.

    Thread-safe: a second thread waits for the first one's import. A failed import is not
    retried and raises nothing: ``present`` then falls back to ``object.__repr__``.
    """
    global _loaded, _loading
    with _load_lock:
        if _loaded or _loading:
            return
        _loading = True
        try:
            importlib.import_module(_RENDERERS)
        except Exception:  # str() of a result must not fail
            pass
        finally:
            _loading = False
            _loaded = True


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
    """The renderer registered for ``cls`` or its nearest base class, or ``None``.

    The first call imports every renderer (``cudamem.render``).
    """
    if not _loaded:
        _load_renderers()
    for klass in cls.__mro__:
        fn = _renderers.get((fmt, klass))
        if fn is not None:
            return fn
    return None


def present(obj: object, fmt: Format = "text") -> str:
    """``obj`` rendered by its registered renderer.

    The first call imports every renderer. Without one for ``obj`` (only possible while
    the renderers themselves are being imported) the text is ``object.__repr__``'s, never
    an exception: ``str()`` of a result must not fail.
    """
    fn = renderer_for(type(obj), fmt)
    if fn is None:
        return object.__repr__(obj)
    return fn(obj)


class Presented:
    """The base of every result: ``str(result)`` is its registered text renderer's.

    No state (``__slots__ = ()``): frozen, slotted dataclasses derive from it unchanged.
    """

    __slots__ = ()

    def __str__(self) -> str:
        return present(self)


class PresentedHtml(Presented):
    """A result that notebooks draw as HTML too: ``_repr_html_`` is its HTML renderer's."""

    __slots__ = ()

    def _repr_html_(self) -> str:
        return present(self, "html")

"""Naming one reference edge (referrer → referent) without running user code.

Everything here reads objects through the C-level descriptors of builtin types (``dict.items``
unbound, ``list.__iter__``, getset/member descriptors found in ``type.__mro__``) and compares by
identity. No ``repr``/``str``/``__eq__``/``__hash__``/``__getattr__``/properties/``__len__`` of a
user object is ever called: a diagnostics call must not run the code it is diagnosing, and a
hostile ``__getattr__`` must not be able to raise into it.
"""

from __future__ import annotations

import collections
import enum
import gc
import os
import sys
import types
from typing import Any, NamedTuple

__all__ = [
    "Seg",
    "frame_label",
    "instance_dict",
    "is_sub",
    "key_text",
    "name_edges",
    "type_name",
]

_MRO = type.__dict__["__mro__"]
_QUALNAME = type.__dict__["__qualname__"]
_TYPE_DICT = type.__dict__["__dict__"]
_MODULE_OF = type.__dict__["__module__"]
_GETSET = types.GetSetDescriptorType
_MEMBER = types.MemberDescriptorType
_FUNC = types.FunctionType
_FUNC_DICT = {
    name: _FUNC.__dict__[name]
    for name in ("__closure__", "__defaults__", "__kwdefaults__", "__code__", "__dict__")
}
_METHOD = types.MethodType
_EXC_ATTRS = ("__traceback__", "__context__", "__cause__", "args")
_MAX_KEY_TEXT = 60


class Seg(NamedTuple):
    """One step of a path. ``kind`` decides how it is written (see ``holders._join``)."""

    kind: str  # attr key index member keyof local dictattrs closure via autograd storage
    text: str
    #: For ``dictattrs``: the owner is an ``nn.Module``; for ``local``: the frame's label.
    extra: str = ""


def is_sub(tp: type, base: type) -> bool:
    """``issubclass`` by identity over the stored MRO (no metaclass ``__subclasscheck__``)."""
    try:
        return any(b is base for b in _MRO.__get__(tp))
    except Exception:
        return False


def type_name(tp: type) -> str:
    """A type's ``__qualname__`` read through ``type``'s own descriptor."""
    try:
        name = _QUALNAME.__get__(tp)
        return name if type(name) is str else "?"
    except Exception:
        return "?"


def _type_module(tp: type) -> str:
    try:
        mod = _TYPE_DICT.__get__(tp).get("__module__")
        if mod is None:
            mod = _MODULE_OF.__get__(tp)
        return mod if type(mod) is str else ""
    except Exception:
        return ""


def class_label(tp: type) -> str:
    """``Cache`` for ``__main__``/builtins classes, ``pkg.mod.Cache`` otherwise."""
    mod = _type_module(tp)
    name = type_name(tp)
    if mod in ("", "__main__", "builtins"):
        return name
    return f"{mod}.{name}"


def _class_attr(tp: type, name: str) -> Any:
    """The first ``name`` in the namespaces of ``tp``'s MRO, or ``None`` (no descriptor call)."""
    try:
        for klass in _MRO.__get__(tp):
            ns = _TYPE_DICT.__get__(klass)
            if name in ns:  # mappingproxy of str keys: no user code
                return ns[name]
    except Exception:
        return None
    return None


def instance_dict(obj: Any) -> dict[str, Any] | None:
    """``obj.__dict__`` when it comes from a C getset (never a user property), else ``None``."""
    tp = type(obj)
    if tp is type or is_sub(tp, type):
        return None
    descr = _class_attr(tp, "__dict__")
    if type(descr) is not _GETSET:
        return None
    try:
        d = descr.__get__(obj, tp)
    except Exception:
        return None
    return d if isinstance(d, dict) else None


def _slot_values(obj: Any) -> list[tuple[str, Any]]:
    """``(name, value)`` for every ``__slots__`` member set on ``obj``."""
    out: list[tuple[str, Any]] = []
    try:
        for klass in _MRO.__get__(type(obj)):
            for name, descr in list(_TYPE_DICT.__get__(klass).items()):
                if type(descr) is _MEMBER:
                    try:
                        out.append((name, descr.__get__(obj, type(obj))))
                    except Exception:  # an unset slot raises AttributeError
                        continue
    except Exception:
        return out
    return out


def key_text(key: Any, depth: int = 0) -> str | None:
    """Python source for simple dict keys (str/int/float/bool/None/enum, tuples of those)."""
    tp = type(key)
    try:
        if tp is str:
            text = repr(key if len(key) <= _MAX_KEY_TEXT else key[:_MAX_KEY_TEXT] + "…")
            return text
        if tp is bool or key is None or tp is float:
            return repr(key)
        if tp is int:
            return repr(key) if -(10**30) < key < 10**30 else "<int>"
        if tp is tuple and depth < 2:
            parts = [key_text(k, depth + 1) for k in tuple.__iter__(key)]
            if any(p is None for p in parts) or len(parts) > 8:
                return None
            return (
                "("
                + ", ".join(p for p in parts if p is not None)
                + ("," if len(parts) == 1 else "")
                + ")"
            )
        if is_sub(tp, enum.Enum):
            d = instance_dict(key)
            name = d.get("_name_") if d is not None else None
            if type(name) is str:
                return f"{type_name(tp)}.{name}"
    except Exception:
        return None
    return None


def frame_label(frame: types.FrameType) -> str:
    """``train.py:42 in step()``: file base name, current line, function name."""
    try:
        code = frame.f_code
        return f"{os.path.basename(code.co_filename)}:{frame.f_lineno} in {code.co_name}()"
    except Exception:
        return "<frame>"


_SNAPSHOT_LOCALS = sys.version_info < (3, 13)
_CO_OPTIMIZED = 0x0001


def _tracer_active(frame: types.FrameType) -> bool:
    try:
        return (
            sys.gettrace() is not None
            or sys.getprofile() is not None
            or (frame.f_trace is not None)
        )
    except Exception:
        return True


def frame_locals(frame: types.FrameType) -> list[tuple[str, Any]]:
    """``(name, value)`` of a frame's locals (3.13's ``f_locals`` is a proxy, not a dict).

    Before 3.13, reading ``f_locals`` of a function frame copies its locals into a dict
    stored on the frame; that copy would keep a tensor alive after the function ``del``s
    its name, until it returns. So the copy is emptied again after reading. Not while a
    tracer runs: a debugger writes that dict back into the frame (``PyFrame_LocalsToFast``)
    and would lose the variables.
    """
    try:
        loc = frame.f_locals
        if isinstance(loc, dict):
            items = list(dict.items(loc))
            if (
                _SNAPSHOT_LOCALS
                and frame.f_code.co_flags & _CO_OPTIMIZED
                and loc is not frame.f_globals
                and not _tracer_active(frame)
            ):
                dict.clear(loc)
            return items
        return list(loc.items())
    except Exception:
        return []


def _frame_edges(frame: types.FrameType, child: Any, label: str) -> list[Seg]:
    return [Seg("local", name, label) for name, v in frame_locals(frame) if v is child]


def _gen_frame(obj: Any) -> types.FrameType | None:
    for attr in ("gi_frame", "cr_frame", "ag_frame"):
        descr = _class_attr(type(obj), attr)
        if type(descr) is _GETSET or type(descr) is _MEMBER:
            try:
                f = descr.__get__(obj, type(obj))
            except Exception:
                return None
            return f if type(f) is types.FrameType else None
    return None


def name_edges(
    ref: Any,
    child: Any,
    module_types: tuple[type, ...] = (),
    odd_keys: dict[int, Any] | None = None,
) -> list[Seg]:
    """How ``ref`` refers to ``child``: one :class:`Seg` per distinct reference.

    Dict keys that have no source form (a tensor keying ``optimizer.state``) are named by type;
    their objects go into ``odd_keys`` (by id) so the caller may name them by a path later.
    """
    try:
        return _name_edges(ref, child, module_types, odd_keys)
    except Exception:
        return [Seg("via", type_name(type(ref)))]


def _name_edges(
    ref: Any, child: Any, module_types: tuple[type, ...], odd_keys: dict[int, Any] | None
) -> list[Seg]:
    tp = type(ref)
    out: list[Seg] = []
    if is_sub(tp, dict):
        for k, v in list(dict.items(ref)):
            if v is child:
                text = key_text(k)
                if text is not None:
                    out.append(Seg("key", text))
                else:
                    if odd_keys is not None:
                        odd_keys[id(k)] = k
                    out.append(Seg("key", f"<{type_name(type(k))}>", str(id(k))))
            if k is child:
                out.append(Seg("keyof", ""))
        return out or [Seg("via", type_name(tp))]
    if is_sub(tp, list) or is_sub(tp, tuple) or is_sub(tp, collections.deque):
        it = (
            list.__iter__(ref)
            if is_sub(tp, list)
            else tuple.__iter__(ref)
            if is_sub(tp, tuple)
            else collections.deque.__iter__(ref)
        )
        out = [Seg("index", str(i)) for i, v in enumerate(it) if v is child]
        return out or [Seg("via", type_name(tp))]
    if is_sub(tp, set) or is_sub(tp, frozenset):
        return [Seg("member", "")]
    if tp is types.CellType:
        return [Seg("attr", "cell_contents")]
    if tp is _FUNC:
        for name, descr in _FUNC_DICT.items():
            if descr.__get__(ref) is child:
                if name == "__closure__":
                    code = _FUNC_DICT["__code__"].__get__(ref)
                    return [Seg("closure", ",".join(code.co_freevars))]
                if name == "__dict__":
                    return [Seg("dictattrs", "")]
                return [Seg("attr", name)]
        return [Seg("via", "function")]
    if tp is _METHOD:
        if ref.__self__ is child:
            return [Seg("attr", "__self__")]
        return [Seg("attr", "__func__")]
    if tp is types.FrameType:
        return _frame_edges(ref, child, frame_label(ref)) or [Seg("via", "frame")]
    if tp is types.TracebackType:
        if ref.tb_frame is child:
            return [Seg("tbframe", "")]
        return [Seg("attr", "tb_next")]
    if tp in (types.GeneratorType, types.CoroutineType, types.AsyncGeneratorType):
        frame = _gen_frame(ref)
        if frame is not None:
            label = frame_label(frame) + f" (suspended {type_name(tp)})"
            segs = _frame_edges(frame, child, label)
            if segs:
                return segs
        return [Seg("via", type_name(tp))]
    if tp is type or is_sub(tp, type):
        # A class refers to its namespace dict (class attributes) and to its bases/MRO.
        ns = _TYPE_DICT.__get__(ref)
        if any(r is child for r in gc.get_referents(ns)):
            return [Seg("dictattrs", "")]
        return [Seg("via", "type")]
    if is_sub(tp, BaseException):
        for name in _EXC_ATTRS:
            descr = _class_attr(BaseException, name)
            if descr is not None and descr.__get__(ref, tp) is child:
                out.append(Seg("attr", name))
    d = instance_dict(ref)
    is_module = "m" if module_types and any(is_sub(tp, m) for m in module_types) else ""
    if d is not None and d is child:
        out.append(Seg("dictattrs", "", is_module))
    elif d is not None:
        # 3.11+ keeps attributes inline: gc shows object -> value with no dict in between.
        for k, v in list(dict.items(d)):
            if v is child and type(k) is str:
                out.append(Seg("attr", k, is_module))
    for name, v in _slot_values(ref):
        if v is child:
            out.append(Seg("attr", name))
    return out or [Seg("via", type_name(tp))]

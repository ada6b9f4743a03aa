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
import functools
import gc
import os
import sys
import types
from collections.abc import Iterator, Mapping
from collections.abc import Set as AbstractSet
from itertools import compress, count
from typing import Any, NamedTuple

__all__ = [
    "MAX_SEGS",
    "Ref",
    "Seg",
    "class_attr",
    "class_label",
    "frame_label",
    "frame_locals",
    "instance_dict",
    "is_sub",
    "key_text",
    "name_children",
    "resolve_lazy",
    "type_module",
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

    #: attr key index member keyof local dictattrs closure via autograd storage; self: the
    #: object a bound method is bound to (``text``: its class); lazy: an
    #: instance attribute named only once the path is read (see ``resolve_lazy``);
    #: framelocals: a finished frame's copy of its locals (no path goes through it).
    kind: str
    text: str
    #: For ``dictattrs``: the owner is an ``nn.Module``; for ``local``: the frame's label.
    extra: str = ""


def is_sub(tp: type, base: type) -> bool:
    """``issubclass`` by identity over the stored MRO (no metaclass ``__subclasscheck__``)."""
    if tp is base:
        return True
    try:
        mro = _MRO.__get__(tp)
    except Exception:
        return False
    for b in mro:  # noqa: SIM110 (a plain loop: any() over a generator costs 2-3x here)
        if b is base:
            return True
    return False


def type_name(tp: type) -> str:
    """A type's ``__qualname__`` read through ``type``'s own descriptor."""
    try:
        name = _QUALNAME.__get__(tp)
        return name if type(name) is str else "?"
    except Exception:
        return "?"


def type_module(tp: type) -> str:
    try:
        mod = _TYPE_DICT.__get__(tp).get("__module__")
        if mod is None:
            mod = _MODULE_OF.__get__(tp)
        return mod if type(mod) is str else ""
    except Exception:
        return ""


def class_label(tp: type) -> str:
    """``Cache`` for ``__main__``/builtins classes, ``pkg.mod.Cache`` otherwise."""
    mod = type_module(tp)
    name = type_name(tp)
    if mod in ("", "__main__", "builtins"):
        return name
    return f"{mod}.{name}"


def class_attr(tp: type, name: str) -> Any:
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
    descr = class_attr(tp, "__dict__")
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
        descr = class_attr(type(obj), attr)
        if type(descr) is _GETSET or type(descr) is _MEMBER:
            try:
                f = descr.__get__(obj, type(obj))
            except Exception:
                return None
            return f if type(f) is types.FrameType else None
    return None


class Ref(NamedTuple):
    """Every reference from one referrer to one child: one edge of the search graph.

    ``[t] * 3000`` is one edge with ``times=3000`` and ``span=(0, 2999)``, named in one pass
    over the list; writing it out is the renderer's business.
    """

    #: The first references, in the referrer's own order (at most ``MAX_SEGS``).
    segs: tuple[Seg, ...]
    #: How many references in all.
    times: int = 1
    #: ``(first, last)`` when the references are the list indices ``first..last``, each once.
    span: tuple[int, int] | None = None

    @property
    def seg(self) -> Seg:
        """The first reference: what a path shows."""
        return self.segs[0]


_new_ref: Any = functools.partial(tuple.__new__, Ref)


def _ref(segs: tuple[Seg, ...], times: int, span: tuple[int, int] | None) -> Ref:
    """``Ref(...)`` without the generated ``__new__`` (a hot path: one per search edge)."""
    ref: Ref = _new_ref((segs, times, span))
    return ref


#: References kept per edge (a module dict binding one tensor to many names lists them all).
MAX_SEGS = 8


class _Found:
    """References found so far from one referrer to one child."""

    __slots__ = ("count", "hi", "ints", "lo", "segs")

    def __init__(self) -> None:
        self.segs: list[Seg] = []
        self.count = 0
        self.ints = True  # every reference is a list index or an int dict key
        self.lo = self.hi = 0  # the lowest and highest of them

    def add(self, seg: Seg, index: int | None = None) -> None:
        if index is None:
            self.ints = False
        elif not self.count:
            self.lo = self.hi = index
        else:
            self.lo, self.hi = min(self.lo, index), max(self.hi, index)
        self.count += 1
        if len(self.segs) < MAX_SEGS:
            self.segs.append(seg)

    def ref(self) -> Ref:
        if self.count == 1:
            return _ref((self.segs[0],), 1, None)
        span = None
        # distinct positions (list indices, dict keys) covering lo..hi once each
        if self.ints and self.hi - self.lo + 1 == self.count:
            span = (self.lo, self.hi)
        return _ref(tuple(self.segs), self.count, span)


def _found(out: dict[int, _Found], key: int) -> _Found:
    f = out.get(key)
    if f is None:
        f = out[key] = _Found()
    return f


def name_children(
    ref: Any,
    kids: Mapping[int, Any] | AbstractSet[int],
    module_types: tuple[type, ...] = (),
    odd_keys: dict[int, Any] | None = None,
) -> dict[int, Ref]:
    """How ``ref`` refers to each of ``kids`` (ids): one ``Ref`` per child it refers to.

    One pass over the referrer whatever the number of children asked about: a list holding
    one tensor 20,000 times, or 60,000 dicts, costs one walk of the list. Dict keys with no
    source form (a tensor keying ``optimizer.state``) are named by type; their objects go into
    ``odd_keys`` (by id) so the caller may name them by a path later. A child the referrer
    refers to in a way this module cannot name gets ``Seg('via', <type name>)``.
    """
    out: dict[int, _Found] = {}
    tp = type(ref)
    kind = _EXACT.get(tp) or _kind_of(tp)
    try:
        if kind == "dict":
            if tp is dict and dict.__len__(ref) <= 8:
                _small_dict_refs(ref, kids, out, odd_keys)
            else:
                _dict_refs(ref, kids, out, odd_keys, _key_seg)
        elif kind == "list":
            _sequence_refs(list.__iter__(ref), kids, out)
        elif kind == "tuple":
            _sequence_refs(tuple.__iter__(ref), kids, out)
        elif kind == "deque":
            _sequence_refs(collections.deque.__iter__(ref), kids, out)
        elif kind == "set":
            it = set.__iter__(ref) if is_sub(tp, set) else frozenset.__iter__(ref)
            for v in it:
                if id(v) in kids:
                    _found(out, id(v)).add(Seg("member", ""))
        elif kind == "special":
            for cid in kids:
                for seg in _SPECIAL[tp](ref, _kid(kids, cid)):
                    _found(out, cid).add(seg)
        elif kind == "type":
            # A class refers to its namespace (class attributes) and to its bases and MRO.
            ns = _TYPE_DICT.__get__(ref)
            in_ns = {id(r) for r in gc.get_referents(ns)}
            for cid in kids:
                _found(out, cid).add(Seg("dictattrs", "") if cid in in_ns else Seg("via", "type"))
        else:
            _object_refs(ref, tp, kids, out, module_types)
    except Exception:
        pass  # whatever was named stays named; the rest falls back below
    result = {cid: f.ref() for cid, f in out.items() if f.segs}
    if len(result) < len(kids):
        via = Seg("via", type_name(tp))
        for cid in kids:
            if cid not in result:
                result[cid] = _ref((via,), 1, None)
    return result


_EXACT: dict[type, str] = {
    dict: "dict",
    list: "list",
    tuple: "tuple",
    collections.deque: "deque",
    set: "set",
    frozenset: "set",
    type: "type",
    **dict.fromkeys(
        (
            types.CellType,
            types.FunctionType,
            types.MethodType,
            types.FrameType,
            types.TracebackType,
            types.GeneratorType,
            types.CoroutineType,
            types.AsyncGeneratorType,
        ),
        "special",
    ),
}


def _kind_of(tp: type) -> str:
    """Which naming rule a type follows (subclasses of the builtin containers included)."""
    for base, kind in (
        (dict, "dict"),
        (list, "list"),
        (tuple, "tuple"),
        (collections.deque, "deque"),
        (set, "set"),
        (frozenset, "set"),
        (type, "type"),
    ):
        if is_sub(tp, base):
            return kind
    return "object"


def _key_seg(text: str, extra: str) -> Seg:
    return Seg("key", text, extra)


def _small_dict_refs(
    d: dict[Any, Any], kids: Any, out: dict[int, _Found], odd_keys: dict[int, Any] | None
) -> None:
    for k, v in dict.items(d):
        if id(v) in kids:
            text = key_text(k)
            if text is not None:
                _found(out, id(v)).add(Seg("key", text), _int_key(k))
            else:
                if odd_keys is not None:
                    odd_keys[id(k)] = k
                _found(out, id(v)).add(Seg("key", f"<{type_name(type(k))}>", str(id(k))))
        if id(k) in kids:
            _found(out, id(k)).add(Seg("keyof", ""))


def _int_key(key: Any) -> int | None:
    return key if type(key) is int else None


def _kid(kids: Mapping[int, Any] | AbstractSet[int], cid: int) -> Any:
    return kids[cid] if isinstance(kids, Mapping) else None


def _sequence_refs(it: Iterator[Any], kids: Any, out: dict[int, _Found]) -> None:
    # One C-level pass finds the matching positions; only those are looked at in Python.
    items = list(it)
    for i in compress(count(), map(kids.__contains__, map(id, items))):
        _found(out, id(items[i])).add(Seg("index", str(i)), i)
    items.clear()


def _dict_refs(
    d: dict[Any, Any],
    kids: Any,
    out: dict[int, _Found],
    odd_keys: dict[int, Any] | None,
    make: Any,
) -> None:
    contains = kids.__contains__
    # Parallel C-level views of one dict: same order while nobody mutates it (we do not).
    for k, v in compress(dict.items(d), map(contains, map(id, dict.values(d)))):
        text = key_text(k)
        if text is not None:
            _found(out, id(v)).add(make(text, ""), _int_key(k))
        else:
            if odd_keys is not None:
                odd_keys[id(k)] = k
            _found(out, id(v)).add(make(f"<{type_name(type(k))}>", str(id(k))))
    for k in compress(dict.keys(d), map(contains, map(id, dict.keys(d)))):
        _found(out, id(k)).add(Seg("keyof", ""))


def _object_refs(
    ref: Any,
    tp: type,
    kids: Any,
    out: dict[int, _Found],
    module_types: tuple[type, ...],
) -> None:
    if is_sub(tp, BaseException):
        for name in _EXC_ATTRS:
            descr = class_attr(BaseException, name)
            if descr is not None:
                v = descr.__get__(ref, tp)
                if id(v) in kids:
                    _found(out, id(v)).add(Seg("attr", name))
    for name, v in _slot_values(ref):
        if id(v) in kids:
            _found(out, id(v)).add(Seg("attr", name))
    if type(class_attr(tp, "__dict__")) is _GETSET:
        # Named when the path is read (resolve_lazy): reading ``__dict__`` of an object
        # whose attributes live inline (3.11+) creates the dict, which would change what
        # the object refers to while the search is still climbing.
        is_module = "m" if module_types and any(is_sub(tp, m) for m in module_types) else ""
        lazy = Seg("lazy", "", is_module)
        for cid in kids:
            if cid not in out:
                _found(out, cid).add(lazy)


def resolve_lazy(ref: Any, child: Any, seg: Seg) -> Seg:
    """The attribute (or ``__dict__``) of ``ref`` that a ``lazy`` seg stands for."""
    d = instance_dict(ref)
    if d is not None:
        if d is child:
            return Seg("dictattrs", "", seg.extra)
        try:
            for k, v in list(dict.items(d)):
                if v is child and type(k) is str:
                    return Seg("attr", k, seg.extra)
        except Exception:
            pass
    return Seg("via", type_name(type(ref)))


def _cell_refs(ref: Any, child: Any) -> list[Seg]:
    return [Seg("attr", "cell_contents")]


def _function_refs(ref: Any, child: Any) -> list[Seg]:
    for name, descr in _FUNC_DICT.items():
        if descr.__get__(ref) is child:
            if name == "__closure__":
                code = _FUNC_DICT["__code__"].__get__(ref)
                return [Seg("closure", ",".join(code.co_freevars))]
            if name == "__dict__":
                return [Seg("dictattrs", "")]
            return [Seg("attr", name)]
    return [Seg("via", "function")]


def _method_refs(ref: Any, child: Any) -> list[Seg]:
    if _METHOD_SELF.__get__(ref) is child:
        # The object a bound method is bound to reads as itself, by type (``cb.log →
        # LitModel.seen``): the user knows it as that object, not as ``__self__``.
        return [Seg("self", type_name(type(child)))]
    return [Seg("attr", "__func__")]


def _frame_refs(ref: Any, child: Any) -> list[Seg]:
    if type(child) is dict:
        try:
            # A finished frame (a traceback's) keeps a dict copy of its locals (3.11, 3.12):
            # its values are the frame's own locals, named as such; the copy is no holder.
            if ref.f_locals is child:
                return [Seg("framelocals", "")]
        except Exception:
            pass
    label = frame_label(ref)
    if type(child) is types.CellType:
        # A variable the frame shares with its inner functions lives in a cell: named by
        # the variable (``train.py:9 in step(): local 'hidden'``), its cell step skipped.
        try:
            value = _CELL_CONTENTS.__get__(child)
        except Exception:  # an empty cell
            value = _EMPTY
        named = [Seg("local", n, label) for n, v in frame_locals(ref) if v is value]
        if named:
            return named
    return _frame_edges(ref, child, label) or [Seg("via", f"{label} frame")]


def _traceback_refs(ref: Any, child: Any) -> list[Seg]:
    if _TB_FRAME.__get__(ref) is child:
        return [Seg("tbframe", "")]
    return [Seg("attr", "tb_next")]


def _generator_refs(ref: Any, child: Any) -> list[Seg]:
    tp = type(ref)
    frame = _gen_frame(ref)
    if frame is not None:
        label = frame_label(frame) + f" (suspended {type_name(tp)})"
        segs = _frame_edges(frame, child, label)
        if segs:
            return segs
    return [Seg("via", type_name(tp))]


_METHOD_SELF = _METHOD.__dict__["__self__"]
_CELL_CONTENTS = types.CellType.__dict__["cell_contents"]
_EMPTY = object()
_TB_FRAME = types.TracebackType.__dict__["tb_frame"]
_SPECIAL: dict[type, Any] = {
    types.CellType: _cell_refs,
    _FUNC: _function_refs,
    _METHOD: _method_refs,
    types.FrameType: _frame_refs,
    types.TracebackType: _traceback_refs,
    types.GeneratorType: _generator_refs,
    types.CoroutineType: _generator_refs,
    types.AsyncGeneratorType: _generator_refs,
}

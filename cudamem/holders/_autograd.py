"""Tensor storages and autograd graphs, read without running user code or unpack hooks.

gc cannot see tensor → ``grad_fn`` → saved tensors, nor ``.grad``; this module reads them
through torch's own C descriptors (``TensorBase.__dict__[...]``), never through attributes a
tensor subclass could override, and with ``__torch_function__`` dispatch disabled.

Saved tensors are read through ``SavedTensor.data`` (the packed value), never ``_saved_*``:
``_saved_*`` unpacks, and under saved-tensor hooks (non-reentrant activation checkpointing,
``save_on_cpu``) unpacking runs the hook, which recomputes the forward or copies to the GPU.
A node whose saved tensor has an unpack hook and whose packed value is not a tensor is
reported as *not inspected*.

Only tensors with real memory count. ``torch.compile`` leaves FakeTensors on the heap (their
storage is a meta storage, and asking its ``data_ptr()`` warns that it "will error"); meta
tensors, functional tensors and wrapper subclasses (``__torch_dispatch__``, e.g. DTensor, whose
real data lives in inner tensors found on their own) have no memory of their own either. They
are recognised by type, device and dispatch flags, never by touching their data.
"""

from __future__ import annotations

import contextlib
import sys
import time
import weakref
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..native import heapscan as _heapscan
from ._naming import class_attr, is_sub, type_name
from ._storages import StorageRef, ref_of

__all__ = [
    "GraphWalk",
    "StorageKey",
    "all_tensors",
    "array_region",
    "array_types",
    "base_of",
    "describe_tensor",
    "grad_fn_of",
    "grad_of",
    "has_graph_or_grad",
    "has_memory",
    "storage_of",
    "walk_graphs",
]

#: ``(device type, device index or -1, data_ptr)``: where a storage's memory is, within one
#: pass (which holds every storage it names meanwhile). Not an identity: the allocator gives
#: a freed address to the next block; storages are compared across time only by
#: ``cudamem.holders._storages.StorageRef``.
StorageKey = tuple[str, int, int]

_TB = torch._C.TensorBase
_TB_DICT = _TB.__dict__
_GRAD_FN = _TB_DICT["grad_fn"]
_GRAD = _TB_DICT["_grad"] if "_grad" in _TB_DICT else _TB_DICT["grad"]
_BASE = _TB_DICT.get("_base")
_IS_LEAF = _TB_DICT["is_leaf"]
_IS_META = _TB_DICT["is_meta"]
_RETAINS = _TB_DICT["retains_grad"]
_STORAGE = _TB_DICT["untyped_storage"]
_DTYPE = _TB_DICT["dtype"]
_SHAPE = _TB_DICT["shape"]
_FUNCTION_BASE = torch._C._FunctionBase
_FB_DICT = _FUNCTION_BASE.__dict__
_TYPE_DICT = type.__dict__["__dict__"]
_SAVED_NAMES = {"result": "saved result", "self": "saved self", "other": "saved other"}


def _no_torch_function() -> Any:
    return torch._C.DisableTorchFunctionSubclass()


_NO_DISPATCH = torch.Tensor.__dict__.get("__torch_dispatch__")
_is_functional = getattr(torch, "_is_functional_tensor", None)
#: id(tensor type) -> (weak reference to the type, whether its instances may own memory).
_type_memory: dict[int, tuple[weakref.ref[type], bool]] = {}


def _type_has_memory(tp: type) -> bool:
    """Whether instances of ``tp`` may own memory: not a FakeTensor, a FunctionalTensor or
    another subclass that dispatches in Python (a wrapper whose data lives elsewhere)."""
    entry = _type_memory.get(id(tp))
    if entry is not None and entry[0]() is tp:
        return entry[1]
    real = (
        tp is torch.Tensor
        or tp is torch.nn.Parameter
        or (class_attr(tp, "__torch_dispatch__") is _NO_DISPATCH)
    )
    for module, name in _NO_MEMORY_TYPES:
        mod = sys.modules.get(module)
        base = getattr(mod, name, None) if mod is not None else None
        if isinstance(base, type) and is_sub(tp, base):
            real = False
    with contextlib.suppress(TypeError):
        _type_memory[id(tp)] = (weakref.ref(tp), real)
    return real


# Looked up in sys.modules only: never imported by cudamem (they load half of torch._dynamo).
_NO_MEMORY_TYPES = (
    ("torch._subclasses.fake_tensor", "FakeTensor"),
    ("torch._subclasses.functional_tensor", "FunctionalTensor"),
)


def has_memory(t: Any) -> bool:
    """Whether the tensor ``t`` may own real memory (see the module notes): by its type, its
    ``is_meta`` flag and the functionalization flag, never by its data."""
    if not _type_has_memory(type(t)):
        return False
    try:
        with _no_torch_function():
            if _IS_META.__get__(t):
                return False
            if _is_functional is not None and _is_functional(t):
                return False
    except Exception:
        return False
    return True


def storage_of(t: Any) -> tuple[StorageKey, int] | None:
    """``(key, nbytes)`` of a tensor's storage, or ``None`` (no storage, empty, no memory of
    its own: fake, meta, functional or a wrapper subclass)."""
    if not has_memory(t):
        return None
    try:
        with _no_torch_function():
            st = _STORAGE(t)
            dev = st.device
            if dev.type == "meta":
                return None  # never ask a meta storage (a FakeTensor's) for its data
            ptr = int(st.data_ptr())
            nbytes = int(st.nbytes())
    except Exception:
        return None
    if ptr == 0:
        return None
    index = dev.index
    return (str(dev.type), -1 if index is None else int(index), ptr), nbytes


def grad_fn_of(t: Any) -> Any:
    """``t.grad_fn`` through torch's own descriptor, or ``None``."""
    try:
        with _no_torch_function():
            return _GRAD_FN.__get__(t)
    except Exception:
        return None


def has_graph_or_grad(t: Any) -> bool:
    """Whether ``t`` has a ``grad_fn`` or a ``.grad`` (what the graph walk starts from)."""
    try:
        with _no_torch_function():
            return _GRAD_FN.__get__(t) is not None or grad_of(t) is not None
    except Exception:
        return False


def array_types() -> tuple[type, ...]:
    """numpy's array types, when numpy is loaded (it is never imported here)."""
    np = sys.modules.get("numpy")
    nd = getattr(np, "ndarray", None) if np is not None else None
    if not isinstance(nd, type):
        return ()
    memmap = getattr(np, "memmap", None)
    return (nd, memmap) if isinstance(memmap, type) else (nd,)


def array_region(arr: Any) -> tuple[int, int] | None:
    """``(address, nbytes)`` of a numpy array's data, read through ndarray's own descriptors."""
    np = sys.modules.get("numpy")
    if np is None:
        return None
    try:
        nd = np.ndarray.__dict__
        iface = nd["__array_interface__"].__get__(arr)
        return int(iface["data"][0]), int(nd["nbytes"].__get__(arr))
    except Exception:
        return None


def array_base(arr: Any) -> Any:
    """``arr.base`` (a tensor for ``t.numpy()``), or ``None``."""
    np = sys.modules.get("numpy")
    try:
        return np.ndarray.__dict__["base"].__get__(arr) if np is not None else None
    except Exception:
        return None


def describe_tensor(t: Any) -> tuple[str, tuple[int, ...], int]:
    """``(dtype, shape, numel)`` of a tensor, read through torch's descriptors."""
    try:
        with _no_torch_function():
            dtype = str(_DTYPE.__get__(t)).replace("torch.", "")
            shape = tuple(int(s) for s in _SHAPE.__get__(t))
    except Exception:
        return "?", (), 0
    numel = 1
    for s in shape:
        numel *= s
    return dtype, shape, numel


def is_view(t: Any) -> bool:
    """Whether ``t`` is a view of another tensor (``t._base`` is set)."""
    if _BASE is None:
        return False
    try:
        with _no_torch_function():
            return _BASE.__get__(t) is not None
    except Exception:
        return False


def base_of(t: Any) -> Any:
    """``t._base`` (the tensor a view was taken from), or ``None``."""
    if _BASE is None:
        return None
    try:
        with _no_torch_function():
            return _BASE.__get__(t)
    except Exception:
        return None


def grad_of(t: Any) -> Any:
    """``t.grad`` without the non-leaf warning of the public property."""
    try:
        with _no_torch_function():
            # A non-leaf has a .grad only with retain_grad(); asking otherwise warns.
            if not _IS_LEAF.__get__(t) and not _RETAINS.__get__(t):
                return None
            return _GRAD.__get__(t)
    except Exception:
        return None


def key_device(key: StorageKey) -> str:
    """``cuda:0``, ``cpu``, ...: the device of a storage key, as results name it."""
    return key[0] if key[1] < 0 else f"{key[0]}:{key[1]}"


def tensor_types() -> tuple[type, ...]:
    """``torch.Tensor`` and every subclass alive now (``nn.Parameter``, ``Buffer``, ...)."""
    seen: list[type] = []
    stack: list[type] = [torch.Tensor]
    while stack:
        tp = stack.pop()
        if any(tp is s for s in seen):
            continue
        seen.append(tp)
        try:
            stack.extend(type.__subclasses__(tp))
        except Exception:
            continue
    return tuple(seen)


def all_tensors(
    heap: list[Any] | None = None,
    ranges: list[tuple[int, int]] | None = None,
    found: list[Any] | None = None,
    found_types: tuple[type, ...] = (),
) -> list[Any]:
    """Every tensor object gc tracks, in one heap scan.

    A tensor's ``tp_traverse`` visits its class, so ``gc.get_referrers`` on the tensor types
    finds every tensor in one C-level pass (~2× one referrer scan) instead of a Python loop
    over all objects. With the compiled heap pass, the tensors are read off by type instead:
    off a ``gc.get_objects()`` listing (``heap``, when the caller has one) or off gc's own
    lists in place. ``ranges``: the parts of ``heap`` to read, in turn, when it is a
    ``_heap.snapshot`` (the ``order`` it gave). ``found``: the objects of exactly the
    ``tensor_types()`` in ``gc.get_objects()``'s order, when the caller's walk of the heap
    (``_heap.walked``) read them off already (``found_types``: the ``tensor_types()`` it
    looked for); emptied.
    """
    import gc

    module = _heapscan.native()
    if found is not None:
        types_ = found_types
    elif module is not None:
        types_ = tensor_types()
        # The same objects in the same order (gc.get_objects lists the generations in the
        # order gc.get_referrers scans them), read off each object's type pointer only:
        # off ``heap``, a listing the caller took (and uses again), or off gc's own lists
        # in place (no listing of the whole heap).
        if heap is not None:
            found = []
            for start, end in ranges or [(0, len(heap))]:
                found += module.instances(heap, tuple(types_), start, end)
        else:
            found = module.gc_instances(tuple(types_))
    else:
        types_ = tensor_types()
        found = gc.get_referrers(*types_)
    # Most referrers of the tensor types are not tensors (module dicts, MRO tuples): decide
    # once per type, by identity (the objects keep their types alive meanwhile).
    is_tensor = {id(tp): True for tp in types_}
    out = []
    for o in found:
        tp = type(o)
        yes = is_tensor.get(id(tp))
        if yes is None:
            yes = is_tensor[id(tp)] = is_sub(tp, torch.Tensor)
        if yes and not _is_our_wrapper(o) and has_memory(o):
            out.append(o)
    found.clear()
    return out


# Reading a saved tensor (``SavedTensor.data``, ``AccumulateGrad.variable``) makes a Python
# wrapper for a C++ tensor that had none. When we drop it, PyTorch keeps ("preserves") the
# wrapper alive for as long as C++ holds the tensor, so it would show up in every later scan
# as a tensor object nobody refers to. We note the wrappers we made (weakly, by id) and leave
# them out of later scans. (A user who later fetches that very wrapper, e.g. through
# ``grad_fn._saved_result``, gets the same object; it is then missed as an alias holder.)
_our_wrappers: dict[int, weakref.ref[Any]] = {}


def _is_our_wrapper(t: Any) -> bool:
    ref = _our_wrappers.get(id(t))
    return ref is not None and ref() is t


def _note_wrapper(t: Any, known: set[int] | None) -> None:
    if known is None or id(t) in known:
        return
    key = id(t)

    def forget(_ref: weakref.ref[Any], k: int = key) -> None:
        _our_wrappers.pop(k, None)

    with contextlib.suppress(TypeError):
        _our_wrappers[key] = weakref.ref(t, forget)


@dataclass
class GraphWalk:
    """What the walk of every live graph found."""

    #: ``(owner tensor, chain text, storage key, nbytes, label)`` for each saved tensor.
    saved: list[tuple[Any, str, StorageKey, int, str]] = field(default_factory=list)
    #: ``(owner tensor, chain text, storage key, nbytes)`` for ``.grad`` of any tensor.
    grads: list[tuple[Any, str, StorageKey, int]] = field(default_factory=list)
    #: gc-visible nodes (custom ``Function`` contexts) → ``(owner, chain text)``.
    py_nodes: dict[int, tuple[Any, Any, str]] = field(default_factory=dict)
    #: Node names whose saved tensors were not inspected (unpack hooks).
    not_inspected: list[tuple[Any, str]] = field(default_factory=list)
    nodes: int = 0
    truncated: bool = False
    #: ids of the tensor objects that existed before the walk (to spot wrappers it makes).
    known: set[int] | None = None
    #: Bytes of saved storages already counted, by key (for the census).
    saved_meta: dict[StorageKey, tuple[str, tuple[int, ...], int]] = field(default_factory=dict)
    #: A weak reference to each storage found, by key (only when ``walk_graphs(refs=True)``).
    refs: dict[StorageKey, StorageRef] | None = None

    def note_ref(self, key: StorageKey, t: Any) -> None:
        """Remember the identity of ``t``'s storage (found under ``key``) when asked to."""
        if self.refs is not None and key not in self.refs:
            ref = ref_of(t)
            if ref is not None:
                self.refs[key] = ref


@dataclass(frozen=True)
class _NodeKind:
    """What the graph walk reads off one node type, looked up once per type: its name,
    torch's own descriptors for ``next_functions`` and ``variable`` (no user override), and
    ``(label, descriptor)`` of each saved slot."""

    tp: type
    name: str
    custom: bool  # a Python ``autograd.Function``'s node: its saved tensors are a tuple
    next_functions: Any
    variable: Any
    saved: tuple[tuple[str, Any], ...]


#: ``id(node type) -> _NodeKind`` for torch's own (C++) node types, which live as long as
#: torch (a ``Function``'s node type can die with its class: it is read afresh each time).
_KINDS: dict[int, _NodeKind] = {}


def _kind(tp: type) -> _NodeKind:
    kind = _KINDS.get(id(tp))
    if kind is not None and kind.tp is tp:
        return kind
    name = type_name(tp)
    if is_sub(tp, _FUNCTION_BASE):
        saved = (("saved_tensors", _FB_DICT.get("_raw_saved_tensors")),)
        return _NodeKind(tp, name, True, _FB_DICT.get("next_functions"), None, saved)
    try:
        attrs = dict(_TYPE_DICT.__get__(tp))
    except Exception:
        attrs = {}
    slots = tuple(
        (_SAVED_NAMES.get(short, f"saved {short}"), descr)
        for attr, descr in attrs.items()
        if type(attr) is str and attr.startswith("_raw_saved_")
        for short in (attr[len("_raw_saved_") :],)
    )
    kind = _NodeKind(tp, name, False, attrs.get("next_functions"), attrs.get("variable"), slots)
    _KINDS[id(tp)] = kind
    return kind


def _read(descr: Any, node: Any) -> Any:
    return None if descr is None else descr.__get__(node, type(node))


def _saved_slots(node: Any, kind: _NodeKind) -> list[tuple[str, Any]]:
    """``(label, SavedTensor)`` of a node, without unpacking anything."""
    out: list[tuple[str, Any]] = []
    for label, descr in kind.saved:
        value = _read(descr, node)
        if kind.custom or isinstance(value, (list, tuple)):
            out.extend((f"{label}[{i}]", st) for i, st in enumerate(value or ()))
        else:
            out.append((label, value))
    return out


def _packed_tensor(st: Any) -> tuple[Any, bool]:
    """``(tensor or None, inspected)`` for one ``SavedTensor``, never calling its unpack hook."""
    if st is None:
        return None, True
    st_type = type(st)
    if "data" not in st_type.__dict__ or "unpack_hook" not in st_type.__dict__:
        # This PyTorch cannot hand out the packed value without unpacking: stay safe.
        return None, False
    hook = st.unpack_hook
    data = st.data
    if data is None or is_sub(type(data), torch.Tensor):
        return data, True  # freed by backward() (None), or a plain/packed tensor
    return None, hook is None


def walk_graphs(
    owners: Iterable[Any],
    *,
    max_nodes: int = 200_000,
    deadline: float | None = None,
    known: set[int] | None = None,
    refs: bool = False,
) -> GraphWalk:
    """Walk every graph reachable from ``owners``' ``grad_fn`` once (multi-source BFS).

    A node shared by several owners is named through the first owner that reaches it, the
    outermost owners first: an owner whose ``grad_fn`` lies inside another owner's graph (an
    intermediate tensor, not ``loss_history[3]``) is walked after the others. The walk finds
    such owners as it goes; only when there are some does it walk again in that order.
    ``refs``: also keep a ``cudamem.holders._storages.StorageRef`` per storage found.
    """
    # (owner, its grad_fn): node wrappers are cached only while a Python reference lives,
    # so the list keeps them, or ids lie.
    pairs = [(owner, _grad_fn(owner)) for owner in owners]
    fns: dict[int, int] = {}  # id(grad_fn) -> the first owner with it
    for i, (_owner, fn) in enumerate(pairs):
        if fn is not None:
            fns.setdefault(id(fn), i)
    inner: set[int] = set()
    found = GraphWalk(known=known, refs={} if refs else None)
    _walk_groups(found, (pairs,), fns if len(fns) > 1 else {}, inner, max_nodes, deadline)
    if inner:
        found = GraphWalk(known=known, refs={} if refs else None)
        outer_first = (
            [p for i, p in enumerate(pairs) if i not in inner],
            [p for i, p in enumerate(pairs) if i in inner],
        )
        _walk_groups(found, outer_first, {}, set(), max_nodes, deadline)
    pairs.clear()
    return found


def _grad_fn(owner: Any) -> Any:
    try:
        with _no_torch_function():
            return _GRAD_FN.__get__(owner)
    except Exception:
        return None


def _walk_groups(
    walk: GraphWalk,
    groups: tuple[list[tuple[Any, Any]], ...],
    fns: dict[int, int],
    inner: set[int],
    max_nodes: int,
    deadline: float | None,
) -> None:
    """One BFS per group of ``(owner, grad_fn)`` in turn (each group's graphs to the end
    before the next starts); the owners (by ``fns``) whose ``grad_fn`` a walked node leads
    to go into ``inner``."""
    queue: deque[tuple[Any, Any, str]] = deque()
    seen: set[int] = set()
    keep: list[Any] = []  # nodes stay alive while their ids are in ``seen``
    for group in groups:
        for owner, fn in group:
            grad = grad_of(owner)
            if grad is not None:
                info = storage_of(grad)
                if info is not None:
                    walk.grads.append((owner, ".grad", info[0], info[1]))
                    walk.note_ref(info[0], grad)
            if fn is not None and id(fn) not in seen:
                seen.add(id(fn))
                keep.append(fn)
                queue.append((fn, owner, f"grad_fn {_kind(type(fn)).name}"))
        _drain(queue, seen, keep, walk, max_nodes, deadline, fns, inner)
    keep.clear()


def _drain(
    queue: deque[tuple[Any, Any, str]],
    seen: set[int],
    keep: list[Any],
    walk: GraphWalk,
    max_nodes: int,
    deadline: float | None,
    fns: dict[int, int],
    inner: set[int],
) -> None:
    """Walk the queued nodes breadth-first, queueing their ``next_functions``; the owners
    (by ``fns``) whose ``grad_fn`` one of them is go into ``inner``."""
    while queue:
        if walk.nodes >= max_nodes or (deadline is not None and time.perf_counter() > deadline):
            walk.truncated = True
            break
        node, owner, chain = queue.popleft()
        walk.nodes += 1
        try:
            kind = _kind(type(node))
            _visit(node, kind, owner, chain, walk)
            nexts = _read(kind.next_functions, node) or ()
        except Exception:
            continue
        for pair in nexts:
            try:
                nxt = pair[0]
            except Exception:
                continue
            if nxt is None:
                continue
            if fns and id(nxt) in fns:
                inner.add(fns[id(nxt)])
            if id(nxt) in seen:
                continue
            seen.add(id(nxt))
            keep.append(nxt)
            queue.append((nxt, owner, f"{chain} → {_kind(type(nxt)).name}"))


def _visit(node: Any, kind: _NodeKind, owner: Any, chain: str, walk: GraphWalk) -> None:
    if kind.custom:
        walk.py_nodes[id(node)] = (node, owner, chain)
    if kind.name == "AccumulateGrad":
        var = _read(kind.variable, node)
        if var is not None:
            _note_wrapper(var, walk.known)
            info = storage_of(var)
            if info is not None:
                walk.saved.append((owner, chain, info[0], info[1], "variable"))
                walk.saved_meta.setdefault(info[0], describe_tensor(var))
                walk.note_ref(info[0], var)
        return
    skipped = False
    for label, st in _saved_slots(node, kind):
        try:
            tensor, inspected = _packed_tensor(st)
        except Exception:
            continue  # freed by backward(): skip quietly
        if not inspected:
            skipped = True
            continue
        if tensor is None:
            continue
        _note_wrapper(tensor, walk.known)
        info = storage_of(tensor)
        if info is None:
            continue
        walk.saved.append((owner, chain, info[0], info[1], label))
        walk.saved_meta.setdefault(info[0], describe_tensor(tensor))
        walk.note_ref(info[0], tensor)
    if skipped:
        walk.not_inspected.append((owner, chain))

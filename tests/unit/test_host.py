"""CPU tests of to_host: detached host copies of tensors and structures of them, cycles,
shared tensors, deep nesting, container types, argument errors (no GPU needed)."""

from __future__ import annotations

import collections
import gc
import sys
import warnings
import weakref
from typing import Any, NamedTuple

import pytest
import torch

import cudamem
from cudamem.host import copy as _host
from cudamem.host import ledger as host_ledger
from cudamem.host.copy import HostCopy, to_host


def test_to_host_cpu_tensor_is_detached() -> None:
    x = torch.randn(4, requires_grad=True) * 2
    out = to_host(x)
    assert out.grad_fn is None and not out.requires_grad
    assert out.device.type == "cpu"
    assert torch.equal(out, x.detach())  # (torch.testing imports ~500 modules)


def test_to_host_keeps_no_graph() -> None:
    x = torch.randn(64, requires_grad=True)
    h = x * 2
    ref = weakref.ref(h)
    outputs = [to_host(torch.sin(h))]
    del h
    gc.collect()
    assert ref() is None
    assert outputs[0].shape == (64,)


def test_to_host_structures() -> None:
    Pair = collections.namedtuple("Pair", ["a", "b"])
    nested = {
        "logits": torch.ones(2, requires_grad=True) * 3,
        "parts": [torch.zeros(1), (torch.tensor(1.0), "label")],
        "pair": Pair(torch.tensor(2.0), 5),
        "dd": collections.defaultdict(list, {"k": torch.tensor(1.0)}),
    }
    out = to_host(nested)
    assert out["logits"].grad_fn is None
    assert out["parts"][1][1] == "label"
    assert isinstance(out["pair"], Pair) and out["pair"].b == 5
    assert out["pair"].a.item() == 2.0
    assert out["dd"]["k"].item() == 1.0


def test_to_host_non_blocking_returns_a_handle() -> None:
    handle = to_host({"x": torch.tensor([1.0, 2.0])}, non_blocking=True)
    assert isinstance(handle, HostCopy)
    assert handle.done()  # CPU tensors: nothing in flight
    assert handle.wait()["x"].tolist() == [1.0, 2.0]
    assert "done" in repr(handle)


def test_to_host_pin_false_with_non_blocking_is_refused() -> None:
    with pytest.raises(ValueError, match="pinned"):
        to_host(torch.ones(1), non_blocking=True, pin=False)


def test_public_names() -> None:
    assert "to_host" in cudamem.__all__ and cudamem.to_host is _host.to_host
    # The result type is imported from the module that defines it.
    assert "HostCopy" in _host.__all__ and "HostCopy" not in cudamem.__all__


# --------------------------------------------------------------------------- cycles


def test_list_containing_itself_keeps_the_cycle() -> None:
    t = torch.ones(3, requires_grad=True) * 2
    data: list[Any] = [t]
    data.append(data)
    out = to_host(data)
    assert out is not data
    assert out[1] is out  # the copy contains the copy, as copy.deepcopy would
    assert out[0].grad_fn is None and out[0].tolist() == [2.0, 2.0, 2.0]


def test_dict_cycle_through_a_tuple() -> None:
    t = torch.zeros(2)
    node: dict[str, Any] = {"t": t}
    node["pair"] = (node, 5)
    out = to_host(node)
    assert out["pair"][0] is out and out["pair"][1] == 5
    assert isinstance(out["pair"], tuple)
    assert out["t"].tolist() == [0.0, 0.0]


def test_tuple_reached_again_through_its_own_list() -> None:
    inner: list[Any] = [torch.tensor(1.0)]
    outer = (inner,)
    inner.append(outer)
    out = to_host(outer)
    assert type(out) is tuple and out[0][1] is out  # one tuple, not two copies of it
    assert out[0][0].item() == 1.0


def test_mutual_cycle_between_two_dicts() -> None:
    a: dict[str, Any] = {"x": torch.tensor([1.0])}
    b: dict[str, Any] = {"a": a}
    a["b"] = b
    out = to_host([a, b])
    assert out[0]["b"] is out[1] and out[1]["a"] is out[0]


def test_a_tensor_that_appears_twice_is_copied_once() -> None:
    t = torch.arange(4.0, requires_grad=True) * 1
    out = to_host({"first": t, "again": [t, (t,)]})
    assert out["first"] is out["again"][0] is out["again"][1][0]
    assert out["first"].grad_fn is None


def test_deep_nesting_beyond_the_recursion_limit() -> None:
    depth = sys.getrecursionlimit() * 3
    leaf = torch.tensor(7.0, requires_grad=True) * 1
    nested: Any = leaf
    for i in range(depth):
        nested = [nested] if i % 3 == 0 else ((nested,) if i % 3 == 1 else {"k": nested})
    out = to_host(nested)
    for i in reversed(range(depth)):
        kind = (list, tuple, dict)[i % 3]
        assert type(out) is kind
        out = out["k"] if kind is dict else out[0]
    assert out.item() == 7.0 and out.grad_fn is None


def test_huge_flat_container() -> None:
    ts = [torch.tensor(float(i)) for i in range(100_000)]
    out = to_host(ts)
    assert len(out) == 100_000 and out[99_999].item() == 99_999.0


# --------------------------------------------------------------------------- container types


class _Point(NamedTuple):
    x: Any
    y: Any


class _TaggedList(list):  # type: ignore[type-arg]
    pass


class _NeedsArgs(dict):  # type: ignore[type-arg]
    def __init__(self, required: int) -> None:
        super().__init__()
        self.required = required


def test_container_types_survive() -> None:
    dd: collections.defaultdict[str, list[Any]] = collections.defaultdict(list)
    dd["k"].append(torch.tensor(1.0))
    od = collections.OrderedDict([("b", torch.tensor(2.0)), ("a", torch.tensor(3.0))])
    tagged = _TaggedList([torch.tensor(4.0)])
    needs = _NeedsArgs(1)
    needs["v"] = torch.tensor(5.0)
    out = to_host(
        {"dd": dd, "od": od, "p": _Point(torch.tensor(6.0), "y"), "tl": tagged, "na": needs}
    )
    assert type(out["dd"]) is collections.defaultdict and out["dd"].default_factory is list
    assert out["dd"]["missing"] == []  # the factory still works
    assert type(out["od"]) is collections.OrderedDict and list(out["od"]) == ["b", "a"]
    assert type(out["p"]) is _Point and out["p"].x.item() == 6.0 and out["p"].y == "y"
    assert type(out["tl"]) is _TaggedList and out["tl"][0].item() == 4.0
    assert type(out["na"]) is dict and out["na"]["v"].item() == 5.0  # could not be rebuilt


def test_other_leaves_are_returned_as_they_are() -> None:
    marker = object()
    s = {1, 2}
    out = to_host([marker, s, "text", None, 3.5])
    assert out[0] is marker and out[1] is s and out[2:] == ["text", None, 3.5]


def test_no_user_dunders_run() -> None:
    class Loud(list):  # type: ignore[type-arg]
        def __iter__(self) -> Any:
            raise AssertionError("__iter__ ran")

        def __getattr__(self, name: str) -> Any:
            raise AssertionError(f"__getattr__({name}) ran")

        def __eq__(self, other: object) -> bool:
            raise AssertionError("__eq__ ran")

        __hash__ = None  # type: ignore[assignment]

    loud = Loud([torch.tensor(1.0)])
    out = to_host({"loud": loud})
    assert out["loud"][0].item() == 1.0


def test_to_host_keeps_nothing_of_the_input_alive() -> None:
    x = torch.randn(8, requires_grad=True)
    data: list[Any] = [x * 2]
    data.append(data)
    ref = weakref.ref(data[0])
    out = to_host(data)
    del data
    gc.collect()
    assert ref() is None
    assert out[1] is out


@pytest.mark.parametrize(
    ("kwargs", "error", "name"),
    [
        ({"non_blocking": 1}, TypeError, "non_blocking"),
        ({"non_blocking": "yes"}, TypeError, "non_blocking"),
        ({"pin": 1}, TypeError, "pin"),
        ({"non_blocking": True, "pin": False}, ValueError, "pin"),
    ],
)
def test_wrong_arguments_name_themselves(
    kwargs: dict[str, Any], error: type[Exception], name: str
) -> None:
    with pytest.raises(error, match=name):
        to_host(torch.ones(1), **kwargs)


def test_in_use_is_the_live_pinned_blocks_not_torchs_active_counter() -> None:
    """torch 2.11's ``active_bytes`` keeps blocks freed (and emptied): the pool's in-use
    bytes are the live pinned storages' power-of-two blocks, the rest of what it owns is
    cached."""
    MiB, GiB = 1024**2, 1024**3
    stale = {"active_bytes.current": 3 * GiB, "allocated_bytes.current": 2 * GiB}
    pool = host_ledger.build_pinned(stale, (1100 * MiB,), None)
    assert (pool.in_use, pool.cached) == (2 * GiB, 0)
    assert (pool.requested, pool.rounding) == (1100 * MiB, 2 * GiB - 1100 * MiB)
    assert any("its active counter still counts" in n for n in pool.notes)
    freed = {"active_bytes.current": GiB, "allocated_bytes.current": GiB}
    pool = host_ledger.build_pinned(freed, (), None)  # the tensor deleted, its block cached
    assert (pool.in_use, pool.cached) == (0, GiB)


def test_pinned_sizes_never_touch_an_objects_class() -> None:
    """The pinned-storage listing reads ``type(o)``: a dead ``weakref.proxy`` (whose
    ``__class__`` raises ``ReferenceError``) and an object whose ``__class__`` warns (as
    ``torch.distributed.reduce_op`` does) are passed over with no error and no warning."""
    from cudamem.allocator.torch_backend import pinned_storage_sizes

    class Target:
        pass

    dead = weakref.proxy(Target())  # its referent is gone at once

    class Deprecated:
        @property  # type: ignore[misc]
        def __class__(self) -> type:
            warnings.warn("deprecated", FutureWarning, stacklevel=2)
            return type(self)

    with pytest.raises(ReferenceError):
        isinstance(dead, torch.Tensor)
    plain = torch.ones(4)  # not pinned: not listed
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert pinned_storage_sizes([dead, Deprecated(), plain, 3, "x"]) == ()


def test_a_host_memory_warning_from_the_watchers_thread_is_located_at_the_users_line() -> None:
    """The watcher judges loaders in a thread of its own: its HostMemoryWarning is located
    where the user's code started the loader (recorded when it registered), never in
    threading.py or cudamem, in this file's registry and with this file's source line."""
    import threading

    from cudamem.host import workers

    site = workers._user_site()  # what register() records, from the user's frame
    line = sys._getframe().f_lineno - 1
    assert site is not None and (site.filename, site.lineno) == (__file__, line)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        thread = threading.Thread(
            target=workers._warn_at, args=(workers.HostMemoryWarning("grew"), site)
        )
        thread.start()
        thread.join()
    (w,) = seen
    assert isinstance(w.message, workers.HostMemoryWarning)
    assert (w.filename, w.lineno) == (__file__, line)
    assert "site = workers._user_site()" in warnings.formatwarning(
        str(w.message), w.category, w.filename, w.lineno
    )

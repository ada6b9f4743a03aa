"""``@track`` over odd callables: static and class methods, generators, async generators,
callable objects, partials, classes (fake allocator)."""

from __future__ import annotations

import asyncio
import functools
import inspect
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest

import cudamem
from cudamem.allocator import backend as _backend

from ..fakes import FakeAllocator

#: Every test runs on the Python path and on the compiled span core.
pytestmark = pytest.mark.usefixtures("span_path")

MiB = 1024**2


@pytest.fixture
def fake() -> Iterator[FakeAllocator]:
    alloc = FakeAllocator(devices=1, contexts=(0,))
    with _backend.use(alloc):
        yield alloc


def names() -> list[str]:
    return [r.name for r in cudamem.history().spans]


def test_staticmethod_and_classmethod_in_both_orders(fake: FakeAllocator) -> None:
    class Model:
        scale = 3

        @cudamem.track
        @staticmethod
        def static_outer(n: int) -> int:
            fake.alloc(n)
            return n

        @staticmethod
        @cudamem.track
        def static_inner(n: int) -> int:
            return n + 1

        @cudamem.track("cls")
        @classmethod
        def cls_outer(cls, n: int) -> int:
            fake.alloc(n)
            return n * cls.scale

        @classmethod
        @cudamem.track
        def cls_inner(cls, n: int) -> int:
            return n * cls.scale

    m = Model()
    assert m.static_outer(5) == 5 and Model.static_outer(6) == 6
    assert m.static_inner(1) == 2
    assert m.cls_outer(2) == 6 and Model.cls_outer(1) == 3
    assert Model.cls_inner(4) == 12
    assert isinstance(Model.__dict__["static_outer"], staticmethod)
    assert isinstance(Model.__dict__["cls_outer"], classmethod)
    qual = "test_staticmethod_and_classmethod_in_both_orders.<locals>.Model"
    assert names() == [
        f"{qual}.static_outer",
        f"{qual}.static_outer",
        f"{qual}.static_inner",
        "cls",
        "cls",
        f"{qual}.cls_inner",
    ]
    assert [r.allocated_delta for r in cudamem.history().spans[:2]] == [5, 6]


def test_generator_function_measured_over_the_whole_iteration(fake: FakeAllocator) -> None:
    @cudamem.track("batches")
    def batches(n: int) -> Iterator[int]:
        for i in range(n):
            fake.alloc(MiB)  # one batch kept per item
            with cudamem.track("load"):
                pass
            yield i
        return None

    assert inspect.isgeneratorfunction(batches)
    gen = batches(3)
    assert names() == []  # nothing runs until the first next()
    seen = []
    for item in gen:
        with cudamem.track("step"):  # the consumer's spans do not nest under the loader
            seen.append(item)
    assert seen == [0, 1, 2]
    assert names() == ["step", "step", "step", "batches"]
    loader = cudamem.history().spans[-1]
    assert loader.allocated_delta == 3 * MiB
    assert [c.name for c in loader.children] == ["load", "load", "load"]
    assert loader.exception is None


def test_generator_send_throw_return_and_early_close(fake: FakeAllocator) -> None:
    @cudamem.track
    def echo() -> Iterator[int]:
        total = 0
        try:
            while True:
                got = yield total
                total += got
        except KeyError:
            yield -1
        return None

    gen = echo()
    assert next(gen) == 0
    assert gen.send(5) == 5
    assert gen.send(2) == 7
    assert gen.throw(KeyError("x")) == -1  # handled inside, the generator goes on
    gen.close()  # stopped early: not an error of the block
    rec = cudamem.history().spans[-1]
    assert rec.name.endswith("echo") and rec.exception is None

    @cudamem.track("returns")
    def returns() -> Iterator[int]:
        yield 1
        return 42  # the value reaches ``yield from``

    def outer() -> Iterator[int]:
        value = yield from returns()
        yield value

    assert list(outer()) == [1, 42]


def test_generator_that_raises_records_and_propagates(fake: FakeAllocator) -> None:
    @cudamem.track("bad")
    def bad() -> Iterator[int]:
        yield 1
        raise ValueError("broken batch")

    with pytest.raises(ValueError, match="broken batch"):
        list(bad())
    rec = cudamem.history().spans[-1]
    assert rec.exception is not None and rec.exception.message == "broken batch"


def test_async_generator_measured_over_the_whole_iteration(fake: FakeAllocator) -> None:
    @cudamem.track("stream")
    async def stream(n: int) -> AsyncIterator[int]:
        for i in range(n):
            await asyncio.sleep(0)
            fake.alloc(MiB)
            with cudamem.track("fetch"):
                pass
            yield i

    assert inspect.isasyncgenfunction(stream)

    async def main() -> list[int]:
        out = []
        async for item in stream(4):
            with cudamem.track("use"):
                out.append(item)
        agen = stream(10)
        await agen.__anext__()
        await agen.aclose()  # stopped early
        return out

    assert asyncio.run(main()) == [0, 1, 2, 3]
    spans = cudamem.history().spans
    assert [r.name for r in spans] == ["use"] * 4 + ["stream", "stream"]
    assert spans[4].allocated_delta == 4 * MiB
    assert [c.name for c in spans[4].children] == ["fetch"] * 4
    assert spans[5].allocated_delta == MiB and spans[5].exception is None


def test_coroutine_functions_still_work(fake: FakeAllocator) -> None:
    @cudamem.track
    async def work() -> int:
        fake.alloc(11)
        await asyncio.sleep(0)
        return 1

    assert inspect.iscoroutinefunction(work)
    assert asyncio.run(work()) == 1
    assert cudamem.history().spans[-1].allocated_delta == 11


def test_callable_objects_are_named_without_calling_user_code(fake: FakeAllocator) -> None:
    class Step:
        def __call__(self, n: int) -> int:
            return n

        def __repr__(self) -> str:
            raise AssertionError("cudamem called repr")

    def add(a: int, b: int) -> int:
        return a + b

    step = cudamem.track(Step())
    part = cudamem.track(functools.partial(add, 1))
    assert step(4) == 4 and part(2) == 3
    qual = "test_callable_objects_are_named_without_calling_user_code.<locals>.Step"
    assert names() == [qual, "partial"]


def test_classes_and_non_callables_are_refused() -> None:
    class Model:
        pass

    with pytest.raises(TypeError, match=r"cannot decorate a class \(.*Model\)"):
        cudamem.track(Model)
    with pytest.raises(TypeError, match="cannot decorate a class"):
        cudamem.track("x")(Model)
    with pytest.raises(TypeError, match="non-callable property"):
        cudamem.track("x")(property(lambda self: 1))  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "decorate",
    [
        cudamem.track,
        cudamem.track(),
        cudamem.track("named"),
        cudamem.track(peak=False),
        cudamem.MemorySpan("cls"),
    ],
    ids=["bare", "called", "named", "options", "MemorySpan"],
)
def test_track_over_a_classmethod_is_a_working_classmethod(
    fake: FakeAllocator, decorate: Any
) -> None:
    class Model:
        scale = 4

        def build(cls: type[Model], n: int) -> int:  # type: ignore[misc]
            fake.alloc(n)
            return n * cls.scale

        built = decorate(classmethod(build))

    wrapped = Model.__dict__["built"]
    assert wrapped is not None and isinstance(wrapped, classmethod)
    assert Model.built(2) == 8 and Model().built(3) == 12
    assert [r.allocated_delta for r in cudamem.history().spans] == [2, 3]


class _Odd(classmethod):  # type: ignore[type-arg]
    """A classmethod subclass whose constructor wants more than the function."""

    def __init__(self, func: Any, tag: str) -> None:
        super().__init__(func)
        self.tag = tag


def test_track_over_a_method_it_cannot_rebuild_says_where_it_goes() -> None:
    with pytest.raises(TypeError, match=r"put @cudamem.track under @_Odd"):
        cudamem.track(_Odd(lambda cls: 1, "x"))
    with pytest.raises(TypeError, match=r"classmethod of a property: put @cudamem.track under"):
        cudamem.track(classmethod(property(lambda self: 1)))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"staticmethod of a classmethod"):
        cudamem.track(staticmethod(classmethod(lambda cls: 1)))

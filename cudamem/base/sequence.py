"""A frozen result that reads as the tuple of items it holds."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TypeVar, overload

__all__ = ["ItemSequence"]

T = TypeVar("T")


class ItemSequence(Sequence[T]):
    """``len()``, indexing and iteration over ``_items`` (a result's main tuple: a census's
    storages, a search's holders), so the result reads as a read-only list of them."""

    __slots__ = ()

    def _items(self) -> tuple[T, ...]:
        """The tuple the result reads as."""
        raise NotImplementedError

    @overload
    def __getitem__(self, index: int) -> T: ...
    @overload
    def __getitem__(self, index: slice) -> Sequence[T]: ...
    def __getitem__(self, index: int | slice) -> T | Sequence[T]:
        return self._items()[index]

    def __len__(self) -> int:
        return len(self._items())

    def __iter__(self) -> Iterator[T]:
        return iter(self._items())

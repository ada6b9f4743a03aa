"""Logging numbers without keeping tensors: ``log_scalar``, ``ScalarLogger``.

``loss_history.append(loss)`` keeps every step's autograd graph alive (seed 000: ten losses of
``sigmoid(x * 2).mean()`` on a 1024×1024 input kept 40 MiB); ``loss.item()`` frees it but makes
the host wait for the GPU every step. ``ScalarLogger`` stores floats only and moves device
values to the host in batches: each value is copied (one tiny kernel, no sync) into a small
preallocated device buffer, and every ``flush_every`` values the buffer goes to pinned host
memory with one non-blocking copy and an event. The host waits on that event only when the
next batch needs the other buffer or when someone reads, by which time the copy has long
finished, so the GPU's queue never drains because of logging.

Why copies rather than ``loss.detach()``: a detached tensor shares its storage, so a
one-element view (``outputs[0, 3]``) would keep the whole ``outputs`` alive, and an accumulator
updated in place (``total += loss``) would change every value already logged.
"""

from __future__ import annotations

import atexit
import contextlib
import threading
import weakref
from collections import deque
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, overload

import numpy as np
import torch

from ..base.args import check_int
from ..base.format import plural
from ..base.present import Presented
from ..base.warn import warn_once
from ._device_buffer import _DeviceBuffer
from .log import _check_step, _check_tensor, _plain_0d, log_scalar
from .series import LoggerStats, SeriesSummary, _mean, _Record, _SeriesData, _summarize

__all__ = ["ScalarLogger", "Series"]


#: Largest ``flush_every``: two device buffers of this many float64 values (1 MiB each).
MAX_FLUSH_EVERY = 1 << 17


_DEFAULT_NAME = "value"


_live_loggers: weakref.WeakSet[ScalarLogger] = weakref.WeakSet()


@atexit.register
def _close_all_at_exit() -> None:
    # Finish pending transfers and drop the device buffers while CUDA is still up; values
    # become readable by anything that runs later (other atexit hooks, finalizers).
    for logger in list(_live_loggers):
        # Interpreter shutdown: there is nobody to report a failure to.
        with contextlib.suppress(Exception):
            logger.close()


class Series:
    """A live view of one named series of a ``ScalarLogger``: a read-only sequence of
    floats with their steps. Reading waits for the values still on a device."""

    __slots__ = ("_data", "_logger")

    def __init__(self, logger: ScalarLogger, data: _SeriesData) -> None:
        self._logger = logger
        self._data = data

    @property
    def name(self) -> str:
        """The series' name."""
        return self._data.name

    def append(self, value: Any, *, step: int | None = None) -> None:
        """Log one value into this series (see ``ScalarLogger.log``)."""
        self._logger.log(self._data.name, value, step=step)

    def extend(self, values: Iterable[Any]) -> None:
        """Log each value of ``values`` into this series with consecutive steps."""
        for value in values:
            self._logger.log(self._data.name, value)

    @property
    def values(self) -> tuple[float, ...]:
        """The values on the host, oldest first (flushes pending values first)."""
        with self._logger._lock:
            self._logger._flush_locked()
            return tuple(self._data.ordered_values())

    @property
    def steps(self) -> tuple[int, ...]:
        """The step of each value in ``values``."""
        with self._logger._lock:
            self._logger._flush_locked()
            return tuple(self._data.ordered_steps())

    def items(self) -> list[tuple[int, float]]:
        """``(step, value)`` pairs, oldest first."""
        with self._logger._lock:
            self._logger._flush_locked()
            data = self._data
            return list(zip(data.ordered_steps(), data.ordered_values(), strict=True))

    def to_numpy(self) -> np.ndarray[Any, np.dtype[np.float64]]:
        """The values as a float64 array (a copy, without a Python float per value)."""
        values: np.ndarray[Any, np.dtype[np.float64]] = self._array(False, np.float64)
        return values

    def _array(self, steps: bool, dtype: type[np.generic]) -> Any:
        with self._logger._lock:
            self._logger._flush_locked()
            data = self._data
            return np.array(data.ordered_steps() if steps else data.ordered_values(), dtype=dtype)

    def mean(self) -> float:
        """Mean of the values kept (NaN when empty; a NaN value makes it NaN)."""
        with self._logger._lock:
            self._logger._flush_locked()
            return _mean(self._data.values)  # order does not matter for a sum

    @property
    def last(self) -> float:
        """The most recent value (``IndexError`` when empty)."""
        with self._logger._lock:
            self._logger._flush_locked()
            if not len(self._data):
                raise IndexError(f"series {self.name!r} is empty")
            return self._data.last()[1]

    def summary(self) -> SeriesSummary:
        """Count, last, mean/min/max (NaN skipped) at this instant."""
        with self._logger._lock:
            self._logger._flush_locked()
            return _summarize(self._data)

    def __len__(self) -> int:
        with self._logger._lock:
            self._logger._flush_locked()
            return len(self._data)

    @overload
    def __getitem__(self, index: int) -> float: ...
    @overload
    def __getitem__(self, index: slice) -> list[float]: ...
    def __getitem__(self, index: int | slice) -> float | list[float]:
        with self._logger._lock:
            self._logger._flush_locked()
            data = self._data
            if isinstance(index, slice):
                return data.ordered_values()[index].tolist()
            if not isinstance(index, int) or isinstance(index, bool):
                raise TypeError(f"series indices must be int or slice, not {type(index).__name__}")
            try:
                return data.at(index)
            except IndexError:
                raise IndexError(
                    f"series {self.name!r} index {index} out of range "
                    f"({plural(len(data), 'value')})"
                ) from None

    def __iter__(self) -> Iterator[float]:
        # A snapshot: logging while iterating neither fails nor shows up in the loop.
        return iter(self.values)

    def __contains__(self, value: object) -> bool:
        with self._logger._lock:
            self._logger._flush_locked()
            return value in self._data.values

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray[Any, Any]:
        array = self.to_numpy()
        return array if dtype is None else array.astype(dtype)

    def __repr__(self) -> str:
        return f"<Series {self.summary()}>"


class ScalarLogger(Presented):
    """A list of floats that replaces ``loss_history.append(loss)`` without keeping graphs,
    device memory, or stalling the GPU every step.

    ``append``/``extend``/``len``/iteration/indexing/slicing, ``to_numpy``, ``mean``
    and ``last`` act on the default series (named ``name``); ``log`` and
    ``logger["acc"]`` handle several named series with steps. Values are floats on the host;
    what is logged is never kept: tensors are copied into the logger's own buffer.

    Args:
        flush_every: device values kept before one batched transfer to the host. Device
            tensors are copied into a buffer of two banks of ``flush_every`` float64 slots per
            device (``2 * 8 * flush_every`` bytes; 1 KiB at the default 64) and move to the
            host without a synchronisation. ``1`` converts every value at once (one wait per
            value, like ``.item()``). Reading any value (``len`` included) first moves every
            pending value, which waits for the device: read every N steps, not every step.
        maxlen: keep only the newest ``maxlen`` values per series, in a ring of
            ``16 * maxlen`` bytes however many values arrive (``count`` in the summary
            still counts them all). ``None`` keeps every value: 16 bytes each (value and
            step in flat arrays; 10 M values take 160 MB), see ``stats``.
        name: the default series' name.

    Cost per logged device tensor: one copy kernel into the buffer and a few µs of Python;
    one non-blocking transfer and one event per ``flush_every`` values.

    Thread safe: several threads may log and read concurrently. Use it as a context manager
    (or call ``close``) to finish pending transfers and release the device buffers;
    loggers still open at interpreter exit are closed by an ``atexit`` hook.

    Values logged from a CUDA side stream must be complete on the stream that is current
    when the batch moves (the default stream in ordinary training loops).
    """

    def __init__(
        self, flush_every: int = 64, *, maxlen: int | None = None, name: str = _DEFAULT_NAME
    ) -> None:
        check_int("flush_every", flush_every)
        if not 1 <= flush_every <= MAX_FLUSH_EVERY:
            raise ValueError(f"flush_every must be in 1..{MAX_FLUSH_EVERY}, got {flush_every}")
        if maxlen is not None and (
            isinstance(maxlen, bool) or not isinstance(maxlen, int) or maxlen < 1
        ):
            raise ValueError(f"maxlen must be a positive int or None, got {maxlen!r}")
        if not isinstance(name, str):
            raise TypeError(f"series name must be a str, not {type(name).__name__}")
        self._flush_every = flush_every
        self._maxlen = maxlen
        self._name = name
        self._init_state()

    def _init_state(self) -> None:
        self._lock = threading.RLock()
        self._series: dict[str, _SeriesData] = {}
        self._buffers: dict[torch.device, _DeviceBuffer] = {}
        # Values in log order from the oldest one not yet on the host; empty almost always
        # on the host-only path, so plain floats skip it.
        self._order: deque[_Record] = deque()
        self._logged = 0
        self._transfers = 0
        _live_loggers.add(self)

    # -- configuration ---------------------------------------------------------------

    @property
    def flush_every(self) -> int:
        """Device values kept before one batched transfer."""
        return self._flush_every

    @property
    def maxlen(self) -> int | None:
        """Values kept per series (``None``: all)."""
        return self._maxlen

    @property
    def name(self) -> str:
        """The default series' name."""
        return self._name

    # -- logging ---------------------------------------------------------------------

    def log(self, name: str, value: Any, *, step: int | None = None) -> None:
        """Log ``value`` into the series ``name`` (created on first use).

        ``value`` is anything ``log_scalar`` accepts. ``step`` defaults to the series'
        previous step + 1 (0 for the first value) and must fit in 64 bits. Raises like
        ``log_scalar``; a value that raises is not logged.
        """
        if not isinstance(name, str):
            raise TypeError(f"series name must be a str, not {type(name).__name__}")
        if step is not None:
            step = _check_step(step)
        if isinstance(value, torch.Tensor):
            # The hot path (a loss every step): one copy kernel into the device buffer.
            tensor = _plain_0d(value)
            if tensor is None:
                tensor = _check_tensor(value)
            with self._lock:
                data, step = self._series_at(name, step)
                try:
                    self._write(tensor, data, step)
                except Exception as exc:
                    # The buffer could not be made or written (out of memory, a broken
                    # tensor subclass): read this value the eager way instead.
                    warn_once(
                        "logger:write",
                        f"cudamem.ScalarLogger: buffered logging failed: {exc!r}",
                        stacklevel=2,
                    )
                    self._add_number(data, step, log_scalar(tensor))
                data.next_step = step + 1
                self._logged += 1
            return
        number = log_scalar(value)
        with self._lock:
            data, step = self._series_at(name, step)
            self._add_number(data, step, number)
            data.next_step = step + 1
            self._logged += 1

    def _add_number(self, data: _SeriesData, step: int, number: float) -> None:
        if self._order:  # keep log order behind values still on a device
            self._order.append(_Record(data, step, number, True))
        else:
            data.add(step, number)

    def _series_at(self, name: str, step: int | None) -> tuple[_SeriesData, int]:
        """The series ``name`` (made on first use) and the step of its next value; the lock
        is held."""
        data = self._series.get(name)
        if data is None:
            data = self._series[name] = _SeriesData(name, self._maxlen)
        return data, data.next_step if step is None else step

    def _write(self, tensor: torch.Tensor, data: _SeriesData, step: int) -> None:
        device = tensor.device
        buffer = self._buffers.get(device)
        if buffer is None:
            buffer = self._buffers[device] = _DeviceBuffer(device, self._flush_every)
        record = _Record(data, step, 0.0, False)
        full = buffer.write(tensor, record)
        self._order.append(record)
        if full:
            self._move(buffer, complete=self._flush_every == 1)
            self._drain()

    def _move(self, buffer: _DeviceBuffer, *, complete: bool) -> None:
        """Launch ``buffer``'s active bank (and wait for it with ``complete``). A failure
        turns that buffer's values into NaN instead of escaping into the training step."""
        try:
            if buffer.launch():
                self._transfers += 1
            if complete:
                buffer.complete()
        except Exception as exc:
            warn_once(
                "logger:move",
                f"cudamem.ScalarLogger: moving values to the host failed: {exc!r}",
                stacklevel=2,
            )
            buffer.abandon()
            self._buffers = {d: b for d, b in self._buffers.items() if b is not buffer}

    def log_dict(self, values: Mapping[str, Any], *, step: int | None = None) -> None:
        """Log several series at one step: ``logger.log_dict({"loss": loss, "acc": acc})``."""
        for name, value in values.items():
            self.log(name, value, step=step)

    def append(self, value: Any) -> None:
        """Log ``value`` into the default series (the ``list.append`` of a loss history)."""
        self.log(self._name, value)

    def extend(self, values: Iterable[Any]) -> None:
        """Log each value into the default series."""
        for value in values:
            self.log(self._name, value)

    # -- moving values ---------------------------------------------------------------

    def _drain(self) -> None:
        """Deliver values, in log order, up to the first one still on a device."""
        order = self._order
        while order and order[0].ready:
            record = order.popleft()
            record.series.add(record.step, record.value)

    def _flush_locked(self) -> None:
        if not self._order:
            return
        for buffer in list(self._buffers.values()):
            self._move(buffer, complete=True)
        self._drain()

    def flush(self) -> None:
        """Move every pending value to the host now (waits for the devices' copies)."""
        with self._lock:
            self._flush_locked()

    def close(self) -> None:
        """Flush and release the device buffers. The logger stays usable: logging a device
        value again allocates a new buffer."""
        with self._lock:
            self._flush_locked()
            self._buffers.clear()

    def __enter__(self) -> ScalarLogger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- reading ---------------------------------------------------------------------

    @property
    def names(self) -> tuple[str, ...]:
        """Names of the series logged so far, in order of first use."""
        with self._lock:
            return tuple(self._series)

    def series(self, name: str) -> Series:
        """The series ``name``, created empty if it does not exist yet."""
        if not isinstance(name, str):
            raise TypeError(f"series name must be a str, not {type(name).__name__}")
        with self._lock:
            data = self._series.get(name)
            if data is None:
                data = self._series[name] = _SeriesData(name, self._maxlen)
            return Series(self, data)

    def _default(self) -> Series:
        # Reading must not create the default series (a logger used only through log()
        # would list an empty "value"); an unregistered empty view reads the same.
        with self._lock:
            data = self._series.get(self._name)
            if data is None:
                data = _SeriesData(self._name, self._maxlen)
            return Series(self, data)

    def to_numpy(self) -> np.ndarray[Any, np.dtype[np.float64]]:
        """The default series as a float64 array."""
        return self._default().to_numpy()

    def mean(self) -> float:
        """Mean of the default series (NaN when empty)."""
        return self._default().mean()

    @property
    def last(self) -> float:
        """The default series' most recent value (``IndexError`` when empty)."""
        return self._default().last

    def summary(self) -> tuple[SeriesSummary, ...]:
        """One ``SeriesSummary`` per series."""
        with self._lock:
            self._flush_locked()
            return tuple(_summarize(d) for d in self._series.values())

    @property
    def stats(self) -> LoggerStats:
        """Values logged, transfers made, values pending, buffer bytes, values kept and
        their host bytes (does not flush)."""
        with self._lock:
            return LoggerStats(
                logged=self._logged,
                transfers=self._transfers,
                pending=sum(not r.ready for r in self._order),
                buffer_bytes={str(d): b.nbytes for d, b in self._buffers.items()},
                kept=sum(len(d) for d in self._series.values()),
                host_bytes=sum(d.nbytes for d in self._series.values()),
            )

    def clear(self) -> None:
        """Forget every series' values (pending ones included); steps restart at 0."""
        with self._lock:
            self._flush_locked()
            self._series.clear()

    def __len__(self) -> int:
        return len(self._default())

    @overload
    def __getitem__(self, index: str) -> Series: ...
    @overload
    def __getitem__(self, index: int) -> float: ...
    @overload
    def __getitem__(self, index: slice) -> list[float]: ...
    def __getitem__(self, index: str | int | slice) -> Series | float | list[float]:
        """``logger["acc"]`` is a series; ``logger[3]``, ``logger[-10:]`` read the default."""
        if isinstance(index, str):
            with self._lock:
                data = self._series.get(index)
                if data is None:
                    known = ", ".join(map(repr, self._series)) or "none yet"
                    raise KeyError(f"no series {index!r} (series: {known})")
                return Series(self, data)
        return self._default()[index]

    def __iter__(self) -> Iterator[float]:
        return iter(self._default())

    def __contains__(self, item: object) -> bool:
        """``"acc" in logger``: a series name; a number: a value of the default series."""
        if isinstance(item, str):
            with self._lock:
                return item in self._series
        return item in self._default()

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray[Any, Any]:
        array = self.to_numpy()
        return array if dtype is None else array.astype(dtype)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready mapping: every series' steps and values."""
        with self._lock:
            self._flush_locked()
            return {
                "flush_every": self._flush_every,
                "maxlen": self._maxlen,
                "series": {
                    name: {
                        "steps": d.ordered_steps().tolist(),
                        "values": d.ordered_values().tolist(),
                        "count": d.count,
                    }
                    for name, d in self._series.items()
                },
            }

    def __repr__(self) -> str:
        with self._lock:
            parts = ", ".join(f"{n}: {len(d)}" for n, d in self._series.items())
            pending = sum(not r.ready for r in self._order)
        return f"<ScalarLogger {parts or 'empty'}; {pending} pending>"

    # -- pickling (checkpoints): floats only, no buffers, no lock ------------------------

    def __getstate__(self) -> dict[str, Any]:
        state = self.to_dict()
        state["name"] = self._name
        state["next_steps"] = {n: d.next_step for n, d in self._series.items()}
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._flush_every = int(state["flush_every"])
        self._maxlen = state["maxlen"]
        self._name = state["name"]
        self._init_state()
        for name, saved in state["series"].items():
            data = self._series[name] = _SeriesData(name, self._maxlen)
            for step, value in zip(saved["steps"], saved["values"], strict=True):
                data.add(int(step), float(value))
            data.count = int(saved["count"])
            data.next_step = int(state["next_steps"].get(name, 0))

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
import decimal
import math
import numbers
import threading
import weakref
from array import array
from collections import deque
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, overload

import numpy as np
import torch

from ..allocator import backend as _backend
from ..base.args import check_int
from ..base.format import plural
from ..base.present import Presented
from ..base.warn import warn_once

__all__ = [
    "LoggerStats",
    "ScalarLogger",
    "Series",
    "SeriesSummary",
    "log_scalar",
]

#: Largest ``flush_every``: two device buffers of this many float64 values (1 MiB each).
MAX_FLUSH_EVERY = 1 << 17

_DEFAULT_NAME = "value"


# --------------------------------------------------------------------------- conversion


def _shape(t: torch.Tensor | np.ndarray[Any, Any]) -> str:
    return "(" + ", ".join(str(int(d)) for d in t.shape) + ("," if t.ndim == 1 else "") + ")"


def _check_tensor(x: torch.Tensor) -> torch.Tensor:
    """A detached, dense, real, 0-d tensor sharing ``x``'s data; raises for anything else."""
    if x.is_complex():
        raise TypeError(f"cannot log a complex tensor ({x.dtype}) as one float")
    if x.numel() != 1:
        raise ValueError(
            f"expected a 0-d or one-element tensor, got shape {_shape(x)} "
            f"({x.numel()} elements); reduce it first (e.g. .mean())"
        )
    if x.is_meta:
        raise ValueError("a meta tensor has no value to log")
    t = x.detach()
    if t.is_quantized:
        t = t.dequantize()
    if t.layout != torch.strided:
        t = t.to_dense()
    return t if t.dim() == 0 else t.reshape(())


_PLAIN_DTYPES = frozenset(
    {
        torch.float16,
        torch.bfloat16,
        torch.float32,
        torch.float64,
        torch.uint8,
        torch.int8,
        torch.int16,
        torch.int32,
        torch.int64,
        torch.bool,
    }
)


def _plain_0d(x: torch.Tensor) -> torch.Tensor | None:
    """``x.detach()`` when ``x`` is what a loss is (0-d, dense, a real dtype, not meta):
    four cheap checks instead of ``_check_tensor``'s nine. None: ask that one."""
    if x.dim() == 0 and x.layout is torch.strided and x.dtype in _PLAIN_DTYPES and not x.is_meta:
        return x.detach()
    return None


_STEP_MIN, _STEP_MAX = -(2**63), 2**63 - 2  # int64, and the next step still fits


def _check_step(step: Any) -> int:
    if isinstance(step, bool) or not isinstance(step, (int, np.integer, torch.Tensor)):
        raise TypeError(f"step must be an int, not {type(step).__name__}")
    value = int(step)
    if not _STEP_MIN <= value <= _STEP_MAX:
        raise ValueError(f"step must fit in 64 bits, got {value}")
    return value


def log_scalar(x: Any) -> float:
    """The value of ``x`` as a Python float, keeping nothing of ``x``.

    Accepts a 0-d or one-element tensor on any device (with or without ``requires_grad``;
    the graph is not kept), numpy scalars and one-element arrays, Python ``int``/``float``/
    ``bool``, ``fractions.Fraction`` and ``decimal.Decimal``. NaN and infinities pass through.
    ``bool`` values (and bool tensors) log as ``1.0``/``0.0``, as ``float(True)`` does.

    A device tensor is read with one transfer, which waits for the device (like ``.item()``);
    ``ScalarLogger`` avoids that wait.

    Raises:
        ValueError: a tensor or array with more or fewer than one element (the message names
            its shape), a meta tensor, or an integer too large for a float.
        TypeError: anything that is not a real number (strings, ``None``, lists, complex).
    """
    if isinstance(x, torch.Tensor):
        t = _check_tensor(x)
        return float(t.item())
    if isinstance(x, (bool, int, float)):
        return _real_to_float(x)
    if isinstance(x, np.ndarray):
        if x.size != 1:
            raise ValueError(f"expected a one-element array, got shape {_shape(x)}")
        x = x.reshape(())[()]
    if isinstance(x, np.generic):
        if x.dtype.kind not in "biuf":
            raise TypeError(f"cannot log a numpy {x.dtype} value as a float")
        return _real_to_float(x.item())
    if isinstance(x, (numbers.Real, decimal.Decimal)):
        return _real_to_float(x)
    raise TypeError(
        f"cannot log a {type(x).__module__}.{type(x).__qualname__} as a float; "
        "pass a number, a numpy scalar or a one-element tensor"
    )


def _real_to_float(x: Any) -> float:
    try:
        return float(x)
    except OverflowError:
        raise ValueError(f"{type(x).__name__} value is too large for a float") from None


# --------------------------------------------------------------------------- results


@dataclass(frozen=True, slots=True)
class SeriesSummary(Presented):
    """Count and simple statistics of one series at one instant (NaN-aware: ``mean``,
    ``min`` and ``max`` skip NaN; ``nan`` counts them)."""

    name: str
    count: int
    #: Values that left the series because of ``maxlen`` (still counted in ``count``).
    dropped: int
    last: float | None
    mean: float | None
    min: float | None
    max: float | None
    nan: int
    last_step: int | None


@dataclass(frozen=True, slots=True)
class LoggerStats(Presented):
    """What a ``ScalarLogger`` has done: how often it moved values to the host."""

    #: Values logged (all series), including those still on a device.
    logged: int
    #: Batches moved from a device buffer to the host (one per device per flush).
    transfers: int
    #: Values logged but not yet on the host.
    pending: int
    #: Device memory of the logger's buffers, by device (``'cuda:0'``, ``'cpu'``).
    buffer_bytes: Mapping[str, int]
    #: Values kept on the host (all series; at most ``maxlen`` per series).
    kept: int = 0
    #: Host memory those values take: 8 bytes for the value and 8 for its step.
    host_bytes: int = 0


# --------------------------------------------------------------------------- internals


class _SeriesData:
    """Host-side values of one series: floats and their steps in two flat arrays (8 bytes
    each per value, no Python object per value), nothing else.

    Without ``maxlen`` every value is kept (16 bytes a value: 10 M values take 160 MB, half
    a list of Python floats). With ``maxlen`` the arrays are a ring of the newest ``maxlen``
    values: memory stays at ``16 * maxlen`` bytes however many values arrive, and ``count``
    still counts them all.
    """

    __slots__ = ("count", "maxlen", "name", "next_step", "start", "steps", "values")

    def __init__(self, name: str, maxlen: int | None) -> None:
        self.name = name
        self.maxlen = maxlen
        self.values = array("d")
        self.steps = array("q")
        self.start = 0  # index of the oldest value once the ring is full
        self.count = 0  # values ever delivered (dropped ones included)
        self.next_step = 0

    def add(self, step: int, value: float) -> None:
        if self.maxlen is None or len(self.values) < self.maxlen:
            self.values.append(value)
            self.steps.append(step)
        else:
            i = self.start
            self.values[i] = value
            self.steps[i] = step
            i += 1
            self.start = 0 if i == self.maxlen else i
        self.count += 1

    def __len__(self) -> int:
        return len(self.values)

    def ordered_values(self) -> array[float]:
        """The values, oldest first (a copy when the ring has wrapped)."""
        s = self.start
        return self.values[s:] + self.values[:s] if s else self.values

    def ordered_steps(self) -> array[int]:
        s = self.start
        return self.steps[s:] + self.steps[:s] if s else self.steps

    def at(self, index: int) -> float:
        """The value at ``index`` in log order (negative counts from the newest)."""
        n = len(self.values)
        if not -n <= index < n:
            raise IndexError(index)
        return self.values[(self.start + index) % n]

    def last(self) -> tuple[int, float]:
        i = self.start - 1  # -1 (the end) until the ring wraps
        return self.steps[i], self.values[i]

    @property
    def nbytes(self) -> int:
        return len(self.values) * (self.values.itemsize + self.steps.itemsize)

    def clear(self) -> None:
        self.values = array("d")
        self.steps = array("q")
        self.start = 0


class _Record:
    """A value in log order that may still be on a device (``ready`` once it is not)."""

    __slots__ = ("ready", "series", "step", "value")

    def __init__(self, series: _SeriesData, step: int, value: float, ready: bool) -> None:
        self.series = series
        self.step = step
        self.value = value
        self.ready = ready


def _wants_async(device: torch.device) -> bool:
    """CUDA buffers go to pinned memory with a non-blocking copy and an event; other devices
    (CPU, MPS, XPU) are read with a plain copy when a batch completes."""
    return device.type == "cuda"


class _DeviceBuffer:
    """Two banks of ``capacity`` float64 slots on one device, used in turn.

    Logging copies into the next slot of the active bank. When it is full (or on flush) the
    bank is *launched*: on CUDA a non-blocking copy into pinned memory plus an event; the
    other bank becomes active. A launched bank *completes* (its floats are read) before it is
    written again, at the next launch or on read; by then its event has usually passed, so
    waiting for it costs nothing and never drains the GPU's queue.
    """

    __slots__ = (
        "active",
        "banks",
        "capacity",
        "device",
        "device_index",
        "events",
        "hosts",
        "in_flight",
        "is_async",
        "records",
        "slots",
        "used",
    )

    def __init__(self, device: torch.device, capacity: int) -> None:
        self.device = device
        self.capacity = capacity
        self.device_index = device.index if device.index is not None else -1
        self.is_async = _wants_async(device)
        # MPS has no float64; float32 holds every fp16/bf16/fp32 value exactly.
        dtype = torch.float32 if device.type == "mps" else torch.float64
        # Allocate outside inference mode: an inference tensor cannot be written to later.
        with torch.inference_mode(False), torch.no_grad():
            store = torch.zeros(2, capacity, dtype=dtype, device=device)
            self.banks = (store[0], store[1])
            # 0-d views made once: a log is then one copy_, without creating a view per step.
            self.slots = (tuple(store[0].unbind(0)), tuple(store[1].unbind(0)))
            # The CUDA caching host allocator picks a device that already has a context,
            # so pinning here creates none.
            pin = device.type == "cuda"
            self.hosts: tuple[torch.Tensor, ...] = ()
            if self.is_async:
                self.hosts = tuple(
                    torch.empty(capacity, dtype=dtype, pin_memory=pin) for _ in range(2)
                )
        self.events: list[Any] = [None, None]
        self.active = 0
        self.used = 0
        self.records: list[list[_Record]] = [[], []]
        self.in_flight: tuple[int, int] | None = None  # (bank, n)

    @property
    def nbytes(self) -> int:
        return 2 * self.capacity * self.banks[0].element_size()

    def write(self, value: torch.Tensor, record: _Record) -> bool:
        """Copy ``value`` (detached, 0-d) into the next slot; True when the bank is full."""
        used, active = self.used, self.active
        self.slots[active][used].copy_(value)
        self.records[active].append(record)
        self.used = used = used + 1
        return used >= self.capacity

    def launch(self) -> bool:
        """Start moving the active bank to the host; True if a transfer was started."""
        if self.used == 0:
            return False
        self.complete()  # frees the other bank before it becomes active
        bank, n = self.active, self.used
        if self.is_async:
            with torch.no_grad():
                self.hosts[bank][:n].copy_(self.banks[bank][:n], non_blocking=True)
            self.events[bank] = _backend.get().record_event(self.device_index, self.events[bank])
        self.in_flight = (bank, n)
        self.active, self.used = 1 - bank, 0
        return True

    def complete(self) -> None:
        """Read the launched bank's floats into its records (waits for its event if needed)."""
        if self.in_flight is None:
            return
        bank, n = self.in_flight
        if self.is_async:
            _backend.get().wait_event(self.events[bank])
            values = self.hosts[bank][:n].tolist()
        else:
            values = self.banks[bank][:n].tolist()
        records = self.records[bank]
        for record, value in zip(records, values, strict=True):
            record.value = float(value)
            record.ready = True
        self.records[bank] = []
        self.in_flight = None

    def abandon(self) -> None:
        """After a failed copy: resolve every record of this buffer as NaN so that values
        logged after them still reach the host in order."""
        for records in self.records:
            for record in records:
                record.value = math.nan
                record.ready = True
        self.records = [[], []]
        self.in_flight = None
        self.used = 0


_live_loggers: weakref.WeakSet[ScalarLogger] = weakref.WeakSet()


@atexit.register
def _close_all_at_exit() -> None:
    # Finish pending transfers and drop the device buffers while CUDA is still up; values
    # become readable by anything that runs later (other atexit hooks, finalizers).
    for logger in list(_live_loggers):
        # Interpreter shutdown: there is nobody to report a failure to.
        with contextlib.suppress(Exception):
            logger.close()


# --------------------------------------------------------------------------- series view


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

    def steps_numpy(self) -> np.ndarray[Any, np.dtype[np.int64]]:
        """The steps as an int64 array."""
        steps: np.ndarray[Any, np.dtype[np.int64]] = self._array(True, np.int64)
        return steps

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


def _mean(values: Sequence[float]) -> float:
    """Exact mean (``fsum``); NaN when empty; ``inf - inf`` gives NaN instead of raising."""
    if not values:
        return math.nan
    try:
        return math.fsum(values) / len(values)
    except (ValueError, OverflowError):
        return sum(values) / len(values)


def _summarize(data: _SeriesData) -> SeriesSummary:
    n = len(data)
    if not n:
        return SeriesSummary(data.name, data.count, 0, None, None, None, None, 0, None)
    values = np.array(data.values, dtype=np.float64)
    finite = values[~np.isnan(values)]  # inf stays
    last_step, last = data.last()
    return SeriesSummary(
        name=data.name,
        count=data.count,
        dropped=data.count - n,
        last=last,
        mean=_mean(finite.tolist()) if finite.size else None,
        min=float(finite.min()) if finite.size else None,
        max=float(finite.max()) if finite.size else None,
        nan=n - int(finite.size),
        last_step=last_step,
    )


# --------------------------------------------------------------------------- the logger


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

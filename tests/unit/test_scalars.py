"""CPU tests of log_scalar and ScalarLogger (no GPU needed)."""

from __future__ import annotations

import collections
import decimal
import fractions
import gc
import math
import pickle
import threading
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

import cudamem
from cudamem.allocator import backend as _backend
from cudamem.allocator import backend_base as _backend_base
from cudamem.base import warn as _warn
from cudamem.base.data import to_data
from cudamem.render.json import to_json
from cudamem.scalars import _device_buffer as __device_buffer
from cudamem.scalars import log as _log
from cudamem.scalars import logger as _scalars
from cudamem.scalars.log import log_scalar
from cudamem.scalars.logger import ScalarLogger

# --------------------------------------------------------------------------- log_scalar


class Later:
    """A parameter's tensor, built when its test runs rather than at import.

    pytest keeps every parameter alive for the whole session (the test function's
    ``pytestmark`` and each collected item hold it). A CPU tensor made at import would sit
    among the live storages of every later test in the same process: the census and holder
    searches of the leak tests would climb from it into the whole test session, seconds each
    (``tests/conftest.py``). The id pytest gives it is the one a tensor gets (``value12``)."""

    def __init__(self, make: Callable[[], Any]) -> None:
        self.make = make


def made(value: Any) -> Any:
    """``value``, or the tensor a ``Later`` builds."""
    return value.make() if isinstance(value, Later) else value


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (1.5, 1.5),
        (3, 3.0),
        (True, 1.0),
        (False, 0.0),
        (fractions.Fraction(1, 4), 0.25),
        (decimal.Decimal("2.5"), 2.5),
        (np.float32(0.5), 0.5),
        (np.float64(-2.0), -2.0),
        (np.int64(7), 7.0),
        (np.bool_(True), 1.0),
        (np.array(4.0), 4.0),
        (np.array([[5.0]]), 5.0),
        (Later(lambda: torch.tensor(2.25)), 2.25),
        (Later(lambda: torch.tensor([2.25])), 2.25),
        (Later(lambda: torch.tensor([[[-1.0]]])), -1.0),
        (Later(lambda: torch.tensor(3, dtype=torch.int64)), 3.0),
        (Later(lambda: torch.tensor(True)), 1.0),
        (Later(lambda: torch.tensor(0.5, dtype=torch.float16)), 0.5),
        (Later(lambda: torch.tensor(0.5, dtype=torch.bfloat16)), 0.5),
        (Later(lambda: torch.tensor(1.0, requires_grad=True) * 2), 2.0),
        (Later(lambda: torch.nn.Parameter(torch.tensor([1.5]))), 1.5),
    ],
)
def test_log_scalar_converts(value: Any, expected: float) -> None:
    result = log_scalar(made(value))
    assert type(result) is float
    assert result == expected


@pytest.mark.parametrize("special", [math.nan, math.inf, -math.inf])
def test_log_scalar_passes_nan_and_inf(special: float) -> None:
    for value in (special, np.float32(special), torch.tensor(special), torch.tensor([special])):
        result = log_scalar(value)
        assert type(result) is float
        assert (math.isnan(result) and math.isnan(special)) or result == special


def test_log_scalar_one_element_view_of_big_tensor() -> None:
    big = torch.arange(100.0).reshape(10, 10)
    assert log_scalar(big[3, 4]) == 34.0
    assert log_scalar(big[3:4, 4:5]) == 34.0


@pytest.mark.filterwarnings("ignore:.*quantize.*:UserWarning")
def test_log_scalar_sparse_and_quantized() -> None:
    sparse = torch.tensor([[2.0]]).to_sparse()
    assert log_scalar(sparse) == 2.0
    q = torch.quantize_per_tensor(torch.tensor([1.0]), 0.1, 0, torch.qint8)
    assert log_scalar(q) == pytest.approx(1.0)


@pytest.mark.parametrize(
    ("value", "shape"),
    [
        (Later(lambda: torch.zeros(3)), "(3,)"),
        (Later(lambda: torch.zeros(2, 5)), "(2, 5)"),
        (Later(lambda: torch.zeros(0)), "(0,)"),
        (Later(lambda: torch.zeros(1, 0, 4)), "(1, 0, 4)"),
        (np.zeros(4), "(4,)"),
        (np.zeros((2, 2)), "(2, 2)"),
    ],
)
def test_log_scalar_rejects_many_elements_naming_the_shape(value: Any, shape: str) -> None:
    value = made(value)
    with pytest.raises(ValueError, match=re_escape(shape)):
        log_scalar(value)


def re_escape(text: str) -> str:
    import re

    return re.escape(text)


@pytest.mark.parametrize(
    "value",
    [
        "1.5",
        b"1",
        None,
        [1.0],
        (1.0,),
        {"loss": 1.0},
        object(),
        1 + 2j,
        np.complex64(1),
        np.str_("1"),
        np.array(["a"]),
        Later(lambda: torch.tensor(1 + 1j)),
        Later(lambda: torch.tensor([1j])),
    ],
)
def test_log_scalar_rejects_non_numbers(value: Any) -> None:
    value = made(value)
    with pytest.raises(TypeError):
        log_scalar(value)


def test_log_scalar_other_errors() -> None:
    with pytest.raises(ValueError, match="meta"):
        log_scalar(torch.empty((), device="meta"))
    with pytest.raises(ValueError, match="too large"):
        log_scalar(10**400)
    assert log_scalar(decimal.Decimal("NaN")) != log_scalar(decimal.Decimal("NaN"))


def test_log_scalar_keeps_no_graph() -> None:
    x = torch.randn(256, requires_grad=True)
    h = x * 2
    ref = weakref.ref(h)
    loss = torch.sin(h).mean()  # sin saves its input h in the graph
    expected = loss.item()
    del h
    gc.collect()
    assert ref() is not None  # the graph holds h
    value = log_scalar(loss)
    del loss
    gc.collect()
    assert ref() is None
    assert type(value) is float and value == expected


# --------------------------------------------------------------------------- list behaviour


def test_logger_behaves_like_a_list_of_floats() -> None:
    log = ScalarLogger(flush_every=4)
    log.append(torch.tensor(1.0))
    log.append(2)
    log.extend([torch.tensor([3.0]), np.float32(4.0), 5.5])
    assert len(log) == 5
    assert list(log) == [1.0, 2.0, 3.0, 4.0, 5.5]
    assert all(type(v) is float for v in log)
    assert log[0] == 1.0
    assert log[-1] == 5.5
    assert log[1:3] == [2.0, 3.0]
    assert log[::-2] == [5.5, 3.0, 1.0]
    assert log.last == 5.5
    assert log.mean() == pytest.approx(3.1)
    arr = log.to_numpy()
    assert arr.dtype == np.float64
    np.testing.assert_array_equal(arr, [1.0, 2.0, 3.0, 4.0, 5.5])
    np.testing.assert_array_equal(np.asarray(log), arr)
    assert 2.0 in log
    assert 9.0 not in log
    with pytest.raises(IndexError):
        log[5]
    with pytest.raises(TypeError):
        log[1.0]  # type: ignore[call-overload]


def test_empty_logger() -> None:
    log = ScalarLogger()
    assert len(log) == 0
    assert list(log) == []
    assert math.isnan(log.mean())
    with pytest.raises(IndexError, match="empty"):
        log.last
    assert log.to_numpy().shape == (0,)
    assert str(log) == "ScalarLogger: nothing logged"
    assert log.names == ()


def test_logger_never_stores_a_tensor() -> None:
    log = ScalarLogger(flush_every=3)
    for i in range(10):
        log.append(torch.tensor(float(i), requires_grad=True) * 1)
    log.flush()
    stored = [*log._series[log.name].values, *log._order]
    assert all(type(v) is float for v in log._series[log.name].values)
    assert not any(isinstance(v, torch.Tensor) for v in stored)
    for buffer in log._buffers.values():
        for bank in buffer.banks:
            assert bank.grad_fn is None
            assert not bank.requires_grad


def test_logger_does_not_keep_the_graph_even_before_flush() -> None:
    log = ScalarLogger(flush_every=64)
    x = torch.randn(256, requires_grad=True)
    h = x * 2
    ref = weakref.ref(h)
    loss = torch.sin(h).mean()
    del h
    log.append(loss)  # still pending: not on the "host" yet
    assert log.stats.pending == 1
    del loss
    gc.collect()
    assert ref() is None
    assert log[0] == pytest.approx(log[0])


class _Marker:
    pass


class _Keep(torch.autograd.Function):
    """Saves a plain Python object on ctx: alive exactly as long as the graph is."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, marker: Any) -> torch.Tensor:
        ctx.marker = marker
        return x.sum()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


@pytest.mark.parametrize("flush_every", [1, 8])
def test_logged_loss_graph_dies(flush_every: int) -> None:
    log = ScalarLogger(flush_every=flush_every)
    refs = []
    for _ in range(5):
        marker = _Marker()
        refs.append(weakref.ref(marker))
        loss = _Keep.apply(torch.ones(4, requires_grad=True), marker)
        log.log("loss", loss)
        del marker, loss
    gc.collect()
    assert [r() for r in refs] == [None] * 5
    assert log["loss"].values == (4.0,) * 5


def test_logger_does_not_keep_a_big_base_alive() -> None:
    log = ScalarLogger(flush_every=16)
    big = torch.arange(100_000.0, requires_grad=True) * 1
    ref = weakref.ref(big)
    log.append(big[7])  # a view whose base is 400 KB
    log.append(big.detach()[8:9])
    del big
    gc.collect()
    assert ref() is None
    assert list(log) == [7.0, 8.0]


def test_in_place_updates_after_logging_do_not_change_logged_values() -> None:
    log = ScalarLogger(flush_every=16)
    total = torch.zeros(())
    for i in range(5):
        total += i
        log.append(total)
    assert list(log) == [0.0, 1.0, 3.0, 6.0, 10.0]


def test_logger_rejects_bad_values_without_logging_them() -> None:
    log = ScalarLogger(flush_every=4)
    log.append(1.0)
    with pytest.raises(ValueError, match=r"\(2, 3\)"):
        log.append(torch.zeros(2, 3))
    with pytest.raises(TypeError):
        log.append("2.0")
    with pytest.raises(TypeError):
        log.append(None)
    with pytest.raises(TypeError):
        log.log(3, 1.0)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        log.log("x", 1.0, step=1.5)  # type: ignore[arg-type]
    log.append(torch.tensor(2.0))
    assert list(log) == [1.0, 2.0]
    assert log.stats.logged == 2


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"flush_every": 0}, ValueError),
        ({"flush_every": -3}, ValueError),
        ({"flush_every": 10**9}, ValueError),
        ({"flush_every": 2.0}, TypeError),
        ({"flush_every": True}, TypeError),
        ({"maxlen": 0}, ValueError),
        ({"maxlen": "10"}, ValueError),
        ({"name": 3}, TypeError),
    ],
)
def test_logger_arguments(kwargs: dict[str, Any], error: type[Exception]) -> None:
    with pytest.raises(error):
        ScalarLogger(**kwargs)


def test_nan_and_inf_pass_through_the_logger() -> None:
    log = ScalarLogger(flush_every=2)
    log.extend([torch.tensor(math.nan), math.inf, torch.tensor(-math.inf), 1.0])
    values = list(log)
    assert math.isnan(values[0])
    assert values[1:] == [math.inf, -math.inf, 1.0]
    (summary,) = log.summary()
    assert summary.nan == 1
    assert summary.min == -math.inf
    assert math.isnan(log.mean())


def test_maxlen_keeps_the_newest() -> None:
    log = ScalarLogger(flush_every=3, maxlen=4)
    for i in range(10):
        log.append(torch.tensor(float(i)))
    assert list(log) == [6.0, 7.0, 8.0, 9.0]
    assert log[log.name].steps == (6, 7, 8, 9)
    (summary,) = log.summary()
    assert summary.count == 10
    assert summary.dropped == 6


def test_maxlen_ring_reads_in_log_order_after_wrapping() -> None:
    log = ScalarLogger(flush_every=5, maxlen=7)
    for i in range(23):  # wraps the ring three times, mixing host and device values
        log.log("loss", torch.tensor(float(i)) if i % 2 else float(i), step=100 + i)
    s = log["loss"]
    expected = [float(i) for i in range(16, 23)]
    assert s.values == tuple(expected)
    assert s.steps == tuple(range(116, 123))
    assert [s[i] for i in range(7)] == expected
    assert [s[-i] for i in range(1, 8)] == expected[::-1]
    assert s[2:5] == expected[2:5] and s[::-2] == expected[::-2]
    assert s.last == 22.0 and s.items()[0] == (116, 16.0)
    assert s.to_numpy().tolist() == expected
    assert list(s.steps) == list(range(116, 123))
    assert 16.0 in s and 15.0 not in s
    summary = s.summary()
    assert (summary.count, summary.dropped, summary.min, summary.max) == (23, 16, 16.0, 22.0)
    assert summary.last_step == 122 and summary.mean == pytest.approx(19.0)
    with pytest.raises(IndexError, match="out of range"):
        s[7]
    saved = log.to_dict()["series"]["loss"]
    assert saved["values"] == expected and saved["steps"] == list(range(116, 123))
    back = pickle.loads(pickle.dumps(log))
    assert back["loss"].values == tuple(expected) and back["loss"].summary().count == 23


def test_memory_is_bounded_by_maxlen_and_reported() -> None:
    log = ScalarLogger(maxlen=1000)
    for i in range(200_000):
        log.append(float(i))
    stats = log.stats
    assert stats.logged == 200_000 and stats.kept == 1000
    assert stats.host_bytes == 1000 * 16  # a value and a step, 8 bytes each
    data = log._series[log.name]
    assert len(data.values) == len(data.steps) == 1000  # the arrays never grew past maxlen
    assert log[0] == 199_000.0 and log.last == 199_999.0
    assert log.summary()[0].count == 200_000
    assert "kept 1000 (15.6 KiB)" in str(stats)
    unbounded = ScalarLogger()
    unbounded.extend(range(5000))
    assert unbounded.stats.kept == 5000 and unbounded.stats.host_bytes == 5000 * 16
    assert to_data(unbounded.stats)["host_bytes"] == 80_000


@pytest.mark.parametrize(
    ("step", "error"),
    [(2**63, ValueError), (-(2**63) - 1, ValueError), (2**63 - 1, ValueError), ("3", TypeError)],
)
def test_steps_must_fit_in_64_bits(step: Any, error: type[Exception]) -> None:
    log = ScalarLogger()
    with pytest.raises(error, match="step"):
        log.log("x", 1.0, step=step)
    assert log.stats.logged == 0
    log.log("x", 1.0, step=2**63 - 2)  # the largest: the next default step still fits
    log.log("x", 2.0)
    assert log["x"].steps == (2**63 - 2, 2**63 - 1)
    log.log("x", 3.0, step=np.int64(-5))
    assert log["x"].steps[-1] == -5


@pytest.mark.parametrize(
    "value",
    [
        Later(lambda: torch.tensor(1.5, requires_grad=True) * 2),
        Later(lambda: torch.tensor(3, dtype=torch.int32)),
        Later(lambda: torch.tensor(True)),
        Later(lambda: torch.tensor(0.5, dtype=torch.bfloat16)),
        Later(lambda: torch.tensor([[2.0]])),  # not 0-d: the full check
        Later(lambda: torch.ones(4)[2]),  # a 0-d view
    ],
)
def test_fast_path_agrees_with_the_full_check(value: Later) -> None:
    value = made(value)
    fast = _log._plain_0d(value)
    full = _log._check_tensor(value)
    if fast is not None:
        assert fast.dim() == 0 and fast.grad_fn is None
        assert fast.item() == full.item() and fast.dtype == full.dtype
    else:
        assert value.dim() != 0
    log = ScalarLogger(flush_every=2)
    log.append(value)
    assert list(log) == [full.item()]


def test_fast_path_refuses_what_the_full_check_refuses() -> None:
    assert _log._plain_0d(torch.tensor(1 + 2j)) is None
    assert _log._plain_0d(torch.empty((), device="meta")) is None
    assert _log._plain_0d(torch.tensor(1.0).to_sparse()) is None
    log = ScalarLogger()
    with pytest.raises(TypeError, match="complex"):
        log.append(torch.tensor(1 + 2j))
    with pytest.raises(ValueError, match="meta"):
        log.append(torch.empty((), device="meta"))
    assert log.stats.logged == 0


def test_bookkeeping_warning_under_w_error_does_not_escape(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import warnings

    monkeypatch.setattr(__device_buffer, "_wants_async", lambda device: True)
    monkeypatch.setattr(_warn, "_warned", set())

    class Broken(_FakeEvents):
        def wait_event(self, event: Any) -> None:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

    with _backend.use(Broken()), warnings.catch_warnings():
        warnings.simplefilter("error")
        log = ScalarLogger(flush_every=2)
        for i in range(5):
            log.append(torch.tensor(float(i)))  # a failed transfer inside: no exception
        values = list(log)
    assert sum(math.isnan(v) for v in values) >= 2 and len(values) == 5


# --------------------------------------------------------------------------- named series


def test_named_series_with_steps() -> None:
    log = ScalarLogger(flush_every=4)
    for step in range(0, 30, 10):
        log.log("loss", torch.tensor(1.0 / (step + 1)), step=step)
        log.log_dict({"acc": torch.tensor(0.5), "lr": 1e-3}, step=step)
    log.log("loss", 0.01)  # next step after 20
    loss = log["loss"]
    assert loss.name == "loss"
    assert loss.steps == (0, 10, 20, 21)
    assert loss.values == pytest.approx((1.0, 1 / 11, 1 / 21, 0.01))
    assert loss.items()[0] == (0, 1.0)
    assert len(log["acc"]) == 3
    assert log["lr"].last == 1e-3
    assert log.names == ("loss", "acc", "lr")
    assert "acc" in log
    assert "nope" not in log
    assert len(log) == 0  # the default series is separate
    with pytest.raises(KeyError, match="nope"):
        log["nope"]
    np.testing.assert_array_equal(log["acc"].to_numpy(), [0.5, 0.5, 0.5])
    assert log["loss"].steps == (0, 10, 20, 21)


def test_series_view_is_live_and_appends() -> None:
    log = ScalarLogger(flush_every=4, name="loss")
    view = log.series("val")
    assert len(view) == 0
    view.append(torch.tensor(1.0), step=5)
    view.extend([2.0, torch.tensor(3.0)])
    assert view.steps == (5, 6, 7)
    assert list(view) == [1.0, 2.0, 3.0]
    log.append(torch.tensor(9.0))
    assert log["loss"][0] == 9.0
    assert view.summary().last == 3.0
    assert "val: 3 values" in repr(view)


def test_order_is_kept_across_device_and_host_values() -> None:
    log = ScalarLogger(flush_every=3)
    expected = []
    for i in range(20):
        value: Any = torch.tensor(float(i)) if i % 3 else float(i)
        log.append(value)
        expected.append(float(i))
    assert list(log) == expected
    assert log[log.name].steps == tuple(range(20))


def test_clear_and_context_manager() -> None:
    with ScalarLogger(flush_every=8) as log:
        log.append(torch.tensor(1.0))
        log.log("acc", torch.tensor(2.0))
    assert log.stats.pending == 0
    assert log.stats.buffer_bytes == {}
    assert list(log) == [1.0]
    log.clear()
    assert log.names == ()
    log.append(torch.tensor(3.0))  # usable after close: a new buffer
    assert list(log) == [3.0]
    assert log[log.name].steps == (0,)


def test_str_repr_dict_json_pickle() -> None:
    log = ScalarLogger(flush_every=4)
    log.extend([1.0, torch.tensor(2.0)])
    log.log("acc", 0.5, step=3)
    text = str(log)
    assert "series" in text and "value" in text and "acc" in text
    assert "pending" in repr(log)
    d = log.to_dict()
    assert d["series"]["value"] == {"steps": [0, 1], "values": [1.0, 2.0], "count": 2}
    assert '"acc"' in to_json(log)
    log.append(torch.tensor(4.0))  # pending when pickled
    clone = pickle.loads(pickle.dumps(log))
    assert list(clone) == [1.0, 2.0, 4.0]
    assert clone["acc"].steps == (3,)
    clone.log("acc", 1.0)
    assert clone["acc"].steps == (3, 4)
    assert "transfers" in str(log.stats)
    assert to_data(log.stats)["logged"] == 4
    assert to_data(log.summary()[0])["count"] == 3


# --------------------------------------------------------------------------- buffering


def test_values_move_in_batches_not_per_step(monkeypatch: pytest.MonkeyPatch) -> None:
    # Prove no per-step host transfer: Tensor.item/tolist are never called while logging.
    log = ScalarLogger(flush_every=8)
    calls: collections.Counter[str] = collections.Counter()
    real_tolist = torch.Tensor.tolist

    def counting_tolist(self: torch.Tensor) -> Any:
        calls["tolist"] += 1
        return real_tolist(self)

    def no_item(self: torch.Tensor) -> Any:
        raise AssertionError("ScalarLogger read one value with .item()")

    monkeypatch.setattr(torch.Tensor, "tolist", counting_tolist)
    monkeypatch.setattr(torch.Tensor, "item", no_item)
    for i in range(20):
        log.append(torch.tensor(float(i)))
    # 20 values, banks of 8: two launched (16 values); the first one completed when the
    # second launched, the second is in flight; 4 more wait in the active bank.
    assert log.stats.transfers == 2
    assert calls["tolist"] == 1
    assert log.stats.pending == 12
    assert list(log) == [float(i) for i in range(20)]  # reading flushes
    assert log.stats.transfers == 3
    assert calls["tolist"] == 3
    assert log.stats.pending == 0
    monkeypatch.undo()
    assert len(log) == 20  # nothing pending: no further transfer
    assert log.stats.transfers == 3


def test_flush_every_one_is_eager() -> None:
    log = ScalarLogger(flush_every=1)
    for i in range(5):
        log.append(torch.tensor(float(i)))
        assert log.stats.pending == 0
        assert log._series[log.name].values[-1] == float(i)
    assert log.stats.transfers == 5


def test_host_values_do_not_transfer() -> None:
    log = ScalarLogger(flush_every=2)
    log.extend([1.0, 2, np.float32(3.0)] * 10)
    assert log.stats.transfers == 0
    assert log.stats.buffer_bytes == {}
    assert len(log) == 30


def test_buffer_memory_is_bounded() -> None:
    log = ScalarLogger(flush_every=64)
    for i in range(1000):
        log.append(torch.tensor(float(i)))
    assert log.stats.buffer_bytes == {"cpu": 2 * 64 * 8}
    assert log.stats.pending < 2 * 64
    assert len(log) == 1000


class _FakeEvents(_backend_base.Backend):
    """Events for the pipelined (CUDA) path, driven on CPU tensors."""

    def __init__(self) -> None:
        self.recorded = 0
        self.waited = 0
        self.queried = 0

    def record_event(self, device: int, event: Any = None) -> Any:
        self.recorded += 1
        return event if event is not None else object()

    def event_done(self, event: Any) -> bool:
        self.queried += 1
        return True

    def wait_event(self, event: Any) -> None:
        self.waited += 1


def test_pipelined_path_records_one_event_per_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(__device_buffer, "_wants_async", lambda device: True)
    fake = _FakeEvents()
    with _backend.use(fake):
        log = ScalarLogger(flush_every=4)
        for i in range(10):
            log.append(torch.tensor(float(i)))
        assert fake.recorded == 2  # one per full bank, not per value
        assert fake.waited == 1  # the first bank, when the second launched
        (buffer,) = log._buffers.values()
        assert len(buffer.hosts) == 2
        assert list(log) == [float(i) for i in range(10)]
        assert fake.recorded == 3
        assert fake.waited == 3
        # events are reused, not created per batch
        assert buffer.events[0] is not None and buffer.events[1] is not None


def test_failed_transfer_becomes_nan_and_warns(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(__device_buffer, "_wants_async", lambda device: True)
    monkeypatch.setattr(_warn, "_warned", set())

    class Broken(_FakeEvents):
        def wait_event(self, event: Any) -> None:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

    with _backend.use(Broken()):
        log = ScalarLogger(flush_every=2)
        log.append(torch.tensor(1.0))
        log.append(torch.tensor(2.0))
        log.append(3.0)
        with pytest.warns(RuntimeWarning, match="illegal memory access"):
            values = list(log)
    assert math.isnan(values[0]) and math.isnan(values[1])
    assert values[2] == 3.0


def test_atexit_hook_closes_live_loggers() -> None:
    log = ScalarLogger(flush_every=8)
    log.append(torch.tensor(1.0))
    assert log in set(_scalars._live_loggers)
    _scalars._close_all_at_exit()
    assert log.stats.pending == 0
    assert log.stats.buffer_bytes == {}
    ref = weakref.ref(log)
    del log
    gc.collect()
    assert ref() is None  # the atexit registry does not keep loggers alive


def test_logging_inside_inference_mode_and_no_grad() -> None:
    log = ScalarLogger(flush_every=3)
    with torch.inference_mode():
        log.append(torch.tensor(1.0))  # the buffer is created here
    log.append(torch.tensor(2.0))  # and written outside
    with torch.no_grad():
        log.append(torch.tensor(3.0))
    with torch.inference_mode():
        log.append(torch.tensor(4.0))
    assert list(log) == [1.0, 2.0, 3.0, 4.0]


# --------------------------------------------------------------------------- threads


def test_many_threads_lose_no_value() -> None:
    log = ScalarLogger(flush_every=7)
    threads_n, per_thread = 8, 500
    barrier = threading.Barrier(threads_n)
    errors: list[BaseException] = []

    def work(k: int) -> None:
        try:
            barrier.wait()
            for i in range(per_thread):
                value = float(k * per_thread + i)
                if i % 3 == 0:
                    log.append(value)
                else:
                    log.append(torch.tensor(value))
                log.log(f"t{k}", torch.tensor(float(i)), step=i)
                if i % 97 == 0:
                    len(log)  # concurrent reads flush
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(threads_n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert sorted(log) == [float(v) for v in range(threads_n * per_thread)]
    assert log[log.name].steps == tuple(range(threads_n * per_thread))
    for k in range(threads_n):
        series = log[f"t{k}"]
        assert series.values == tuple(float(i) for i in range(per_thread))
        assert series.steps == tuple(range(per_thread))
    assert log.stats.logged == 2 * threads_n * per_thread


def test_public_names() -> None:
    for name in ("log_scalar", "ScalarLogger"):
        assert name in cudamem.__all__
        assert getattr(cudamem, name) is getattr(_scalars, name)

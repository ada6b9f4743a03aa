"""Growth detection on a real GPU: seed 000's loops, and a small transformer's clean and
leaky loops.

Run on an H200 (``pytest -m cuda tests/gpu/test_leaks_cuda.py``). Each loop runs inside
``cudamem.track`` with the default settings; what the loops keep lives in module globals,
as in the seed's script, so the census names them ``tests.gpu.test_leaks_cuda.<name>``. The
clean loops (eval logging ``.item()``, AdamW with ``zero_grad(set_to_none=True)``, autocast
with GradScaler, ``torch.compile``) must raise no LeakWarning; the leaky ones must name the
container that keeps the memory, with its number of items.
"""

from __future__ import annotations

import contextlib
import gc
import math
import re
import sys
import warnings
from collections.abc import Callable, Iterator

import pytest
import torch

import cudamem
from cudamem import LeakWarning
from cudamem.allocator import backend as _backend

pytestmark = pytest.mark.cuda

MiB = 1024**2

loss_history: list[torch.Tensor] = []
outputs: list[torch.Tensor] = []
errors: list[Exception] = []


def _forget_failed_tests() -> None:
    """pytest keeps the last failed test's traceback (``sys.last_traceback``, for
    post-mortems), and with it that test's frames and globals: the CUDA tensors of an
    earlier test that failed (or of a pytester run in this process) would stay alive."""
    for name in ("last_type", "last_value", "last_traceback", "last_exc"):
        if hasattr(sys, name):
            delattr(sys, name)


@pytest.fixture(autouse=True)
def _clean() -> Iterator[None]:
    cudamem.configure_leaks()
    loss_history.clear()
    outputs.clear()
    errors.clear()
    _forget_failed_tests()
    gc.collect()
    torch.cuda.empty_cache()
    yield
    loss_history.clear()
    outputs.clear()
    errors.clear()
    cudamem.configure_leaks()
    gc.collect()
    torch.cuda.empty_cache()


def _leak_warnings(record: list[warnings.WarningMessage]) -> list[LeakWarning]:
    return [w.message for w in record if isinstance(w.message, LeakWarning)]


def test_loss_history_caught_within_five_calls() -> None:
    """Seed 000: ``loss_history.append(loss)`` keeps sigmoid's 4 MiB output per call."""
    x = torch.randn(1024, 1024, device="cuda", requires_grad=True)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for _ in range(5):
            with cudamem.track("train_step"):
                loss = torch.sigmoid(x * 2).mean()
                loss_history.append(loss)
    found = _leak_warnings(record)
    assert len(found) == 1, [str(w) for w in found]
    growth = found[0].growth
    assert growth is not None and growth.calls <= 5, str(found[0])
    # 4 MiB saved by SigmoidBackward0 + one 512 B block for the loss scalar.
    assert abs(growth.per_call - 4 * MiB) <= 4096, str(found[0])
    top = growth.culprits[0]
    assert top.holder == "tests.gpu.test_leaks_cuda.loss_history", str(found[0])
    assert top.tensors == len(loss_history), str(found[0])
    assert top.autograd_bytes >= 4 * MiB * len(loss_history), str(found[0])
    assert "SigmoidBackward0 saved result" in top.example, str(found[0])
    assert str(found[0]).startswith("train_step retains +4.0 MiB per call")
    assert "held through autograd graphs" in str(found[0])


def test_detached_outputs_caught_within_five_calls() -> None:
    """Seed 000: ``outputs.append(output.detach())`` keeps the 4 MiB output, no graph."""
    x = torch.randn(1024, 1024, device="cuda", requires_grad=True)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for _ in range(5):
            with cudamem.track("val_step"):
                output = torch.sigmoid(x * 2)
                outputs.append(output.detach())
    found = _leak_warnings(record)
    assert len(found) == 1, [str(w) for w in found]
    growth = found[0].growth
    assert growth is not None and growth.calls <= 5, str(found[0])
    assert abs(growth.per_call - 4 * MiB) <= 4096, str(found[0])
    top = growth.culprits[0]
    assert top.holder == "tests.gpu.test_leaks_cuda.outputs", str(found[0])
    assert top.nbytes == 4 * MiB * len(outputs), str(found[0])
    assert top.autograd_bytes == 0, str(found[0])


def test_clean_loop_with_scalar_logger_never_warns() -> None:
    """A real training step logging through ``ScalarLogger``: 200 steps, no warning."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(1024, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 1024)
    ).cuda()
    opt = torch.optim.Adam(model.parameters())
    x = torch.randn(256, 1024, device="cuda")
    logger = cudamem.ScalarLogger()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for _ in range(200):
            with cudamem.track("clean_step"):
                loss = model(x).square().mean()
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                logger.append(loss)
    assert _leak_warnings(record) == []
    assert len(logger) == 200


def test_leaks_true_names_what_a_span_left() -> None:
    x = torch.randn(1024, 1024, device="cuda", requires_grad=True)
    with cudamem.track("val", leaks=True) as span:
        outputs.append(torch.sigmoid(x * 2).detach())
    report = span.leaks
    assert report.nbytes == 4 * MiB
    assert report.culprits[0].holder == "tests.gpu.test_leaks_cuda.outputs"
    outputs.clear()
    assert cudamem.leaks(since=span).count == 0


@pytest.mark.parametrize("span_leaks", [False, True])
def test_kept_errors_culprit_counts_only_what_the_calls_left(span_leaks: bool) -> None:
    """The H200 report of issue 33: each NaN guard's exception kept, its traceback's frame
    holding that call's input (8 MiB) and ReLU output (4 MiB, saved by the loss's graph)
    and, through the step's closure, the model's two 8 MiB weights, made before the loop.
    The culprit is the five calls' 60 MiB: not 76 MiB with the weights, and its example
    never ``model[0].weight``; ``leaks(since=)`` of the loop names the same culprit."""
    model = torch.nn.Sequential(
        torch.nn.Linear(2048, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 2048)
    ).cuda()

    def train_step(x: torch.Tensor) -> None:
        loss = model(x).sum()
        if not torch.isfinite(loss):  # the NaN guard
            raise FloatingPointError("loss is NaN")

    @cudamem.track(leaks=span_leaks)
    def guarded_step() -> None:
        try:
            train_step(torch.full((1024, 2048), math.nan, device="cuda"))
        except FloatingPointError as e:
            errors.append(e)

    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        with cudamem.track("loop", leaks=True) as loop:
            for _ in range(5):
                guarded_step()
    found = _leak_warnings(record)
    assert len(found) == 1, [str(w) for w in found]
    growth = found[0].growth
    assert growth is not None and growth.calls <= 5, str(found[0])
    assert abs(growth.per_call - 12 * MiB) <= 4096, str(found[0])
    top = growth.culprits[0]
    assert top.holder == f"{M}.errors", str(found[0])
    # Each call's input, ReLU output and loss (a 4-byte storage); no weight, no bias.
    assert (top.items, top.tensors, top.storages) == (len(errors), 5, 15), str(found[0])
    assert top.nbytes == 5 * (12 * MiB + 4), str(found[0])
    assert top.autograd_bytes == 5 * 4 * MiB, str(found[0])
    assert re.fullmatch(
        rf"{M}\.errors\[[0-4]\]\.__traceback__\.tb_next → test_leaks_cuda\.py:\d+ in "
        r"train_step\(\): (local 'x'|loss → .* saved mat1)",
        top.example,
    ), str(found[0])
    assert f"{M}.errors: 5 tensors, 60.0 MiB" in str(found[0])
    assert cudamem.leaks(since=loop).culprits[0] == top


# --------------------------------------------------------------------------- a transformer

M = "tests.gpu.test_leaks_cuda"
BATCH, SEQ, DIM = 16, 64, 128

losses: list[torch.Tensor] = []
activations: dict[str, list[torch.Tensor]] = {}


class Trainer:
    """What a Lightning module does with ``validation_step`` outputs."""

    def __init__(self) -> None:
        self.step_outputs: list[dict[str, torch.Tensor]] = []


trainer = Trainer()


@pytest.fixture(autouse=True)
def _clean_transformer_state() -> Iterator[None]:
    losses.clear()
    activations.clear()
    trainer.step_outputs.clear()
    # Workspaces left by earlier tests' streams would count as piling up (a warning of their
    # own, for growth no tensor explains): start from none.
    _backend.get().clear_cublas_workspaces()
    yield
    losses.clear()
    activations.clear()
    trainer.step_outputs.clear()


def _encoder(layers: int = 2) -> torch.nn.Module:
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(
        DIM, nhead=4, dim_feedforward=4 * DIM, dropout=0.0, batch_first=True
    )
    encoder = torch.nn.TransformerEncoder(layer, num_layers=layers, enable_nested_tensor=False)
    return encoder.cuda()


def _batch() -> torch.Tensor:
    return torch.randn(BATCH, SEQ, DIM, device="cuda")


@contextlib.contextmanager
def no_leak_warning() -> Iterator[None]:
    """Fail on any LeakWarning: as an error (cudamem lets it reach the ``with``), or recorded
    in any other form (a hook failure reported as a warning of its own)."""
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        warnings.simplefilter("error", LeakWarning)
        yield
    texts = [str(w.message) for w in record]
    assert not [t for t in texts if "LeakWarning" in t or " retains " in t], texts


def test_transformer_eval_loop_logging_item_never_warns() -> None:
    model = _encoder().eval()
    logged: list[float] = []
    with no_leak_warning(), torch.no_grad():
        for _ in range(40):
            with cudamem.track("eval_step"):
                out = model(_batch())
                logged.append(out.square().mean().item())
    assert len(logged) == 40


def test_transformer_adamw_set_to_none_never_warns() -> None:
    # zero_grad(set_to_none=True) at the start of a step: each step's gradients outlive it
    # and are re-created by the next backward() where the allocator had them.
    model = _encoder().train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    logged: list[float] = []
    with no_leak_warning():
        for _ in range(50):
            with cudamem.track("train_step"):
                opt.zero_grad(set_to_none=True)
                loss = model(_batch()).square().mean()
                loss.backward()
                opt.step()
                logged.append(loss.item())
    assert len(logged) == 50


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_transformer_autocast_gradscaler_never_warns(dtype: torch.dtype) -> None:
    model = _encoder().train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    scaler = torch.amp.GradScaler("cuda")
    with no_leak_warning():
        for _ in range(50):
            with cudamem.track("amp_step"):
                opt.zero_grad(set_to_none=True)
                with torch.autocast("cuda", dtype=dtype):
                    loss = model(_batch()).float().square().mean()
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
    assert scaler.get_scale() > 0


def _until_warned(body: Callable[[], None], name: str, calls: int = 12) -> LeakWarning:
    """Run ``body`` in a span named ``name`` until the first LeakWarning; return it."""
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for _ in range(calls):
            with cudamem.track(name):
                body()
            found = _leak_warnings(record)
            if found:
                return found[0]
    raise AssertionError(f"no LeakWarning in {calls} calls")


def test_transformer_losses_list_is_the_culprit() -> None:
    model = _encoder().train()

    def body() -> None:
        losses.append(model(_batch()).square().mean())  # the graph stays with each loss

    growth = _until_warned(body, "leaky_train").growth
    assert growth is not None
    top = growth.culprits[0]
    assert top.holder == f"{M}.losses"
    assert top.items == top.tensors == len(losses)
    assert top.autograd_bytes * 2 >= top.nbytes
    assert not any(".grad" in c.holder or c.holder.startswith("<") for c in growth.culprits)


def test_transformer_activation_hooks_are_the_culprit() -> None:
    model = _encoder().eval()

    def keep(module: torch.nn.Module, args: object, out: torch.Tensor) -> None:
        activations.setdefault("fc1", []).append(out.detach())

    model.layers[0].linear1.register_forward_hook(keep)

    def body() -> None:
        with torch.no_grad():
            model(_batch())

    growth = _until_warned(body, "hooked_eval").growth
    assert growth is not None
    top = growth.culprits[0]
    assert top.holder == f"{M}.activations['fc1']"
    assert top.items == len(activations["fc1"])
    assert top.nbytes == len(activations["fc1"]) * BATCH * SEQ * 4 * DIM * 4


def test_transformer_step_outputs_are_one_culprit() -> None:
    model = _encoder().eval()

    def body() -> None:
        with torch.no_grad():
            x = _batch()
            trainer.step_outputs.append({"preds": model(x), "target": x.sum(-1)})

    growth = _until_warned(body, "val_step").growth
    assert growth is not None
    top = growth.culprits[0]
    n = len(trainer.step_outputs)
    assert top.holder == f"{M}.trainer.step_outputs"
    assert (top.items, top.tensors) == (n, 2 * n)
    assert top.patterns == (
        f"{M}.trainer.step_outputs[*]['preds']",
        f"{M}.trainer.step_outputs[*]['target']",
    )
    assert len(growth.culprits) == 1


def test_compiled_transformer_never_warns_after_warmup() -> None:
    # Last in the file: importing torch._dynamo grows the heap every later census walks.
    model = _encoder(layers=1).train()
    compiled = torch.compile(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step() -> float:
        opt.zero_grad(set_to_none=True)
        loss = compiled(_batch()).square().mean()
        loss.backward()
        opt.step()
        return loss.item()

    for _ in range(3):  # compilation and the optimizer's state
        step()
    with no_leak_warning():
        for _ in range(30):
            with cudamem.track("compiled_step"):
                step()

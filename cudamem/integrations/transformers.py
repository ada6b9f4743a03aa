"""Hugging Face Transformers: per-step memory in the Trainer's logs, and freeing a Trainer.

::

    from cudamem.integrations.transformers import CudamemTrainerCallback, release_trainer

    trainer = Trainer(model=model, args=args, train_dataset=ds,
                      callbacks=[CudamemTrainerCallback()])
    trainer.train()
    print(release_trainer(trainer))      # drop what the Trainer holds, say what is left

**The callback** opens a cudamem span in ``on_step_begin`` and closes it in ``on_step_end``
(one optimizer step, gradient accumulation included), and adds the figures to the logs in
``on_log`` (so they are in ``trainer.state.log_history`` and reach every reporter that runs
after it). Between two logs (``logging_steps``) the values are: ``allocated_mib`` and
``reserved_mib`` at the last step's end, ``peak_mib`` the highest of those steps,
``retained_mib`` what a step kept on average, ``leak_culprits`` the holder groups of the latest
``cudamem.LeakWarning`` for the step span (see ``cudamem.integrations._steps``).
Reporters that run before it (``report_to="tensorboard"``, ``"wandb"`` are registered before
user callbacks) see the values only when it goes first: ``attach(trainer)`` puts it there.
OOM errors: ``TrainerCallback`` has no exception hook, so use ``cudamem.on_oom()``.

**release_trainer(trainer)** is the recipe for "memory does not come back after
``trainer.train()``": the Trainer, its Accelerator and its callback handler keep the model,
the wrapped model, the optimizer (whose state is twice the model for Adam), the scheduler and
the dataloaders. It drops those references, runs ``gc.collect()`` and ``cudamem.release``
(cuBLAS workspaces, ``empty_cache``), then checks every storage of the model and optimizer
state: those still alive are listed with the paths that hold them (typically your own
``model`` variable: ``del model`` and call it again).

Needs ``transformers`` and ``accelerate`` (``pip install 'cudamem[transformers]'``).
"""

from __future__ import annotations

import contextlib
import gc
import weakref
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

try:
    from transformers import TrainerCallback
except ImportError:
    raise ModuleNotFoundError(
        "cudamem.integrations.transformers needs transformers: pip install 'cudamem[transformers]'",
        name="transformers",
    ) from None

from ..allocator import backend as _backend
from ..holders.census import StorageSnapshot
from ..holders.culprits import Culprit, group_by_owner
from ..ledger.reclaim import release
from ._steps import Meters
from .results import TrainerRelease

if TYPE_CHECKING:
    from ..holders.culprits import Culprit
    from ..ledger.reclaim import ReleaseResult

__all__ = ["CudamemTrainerCallback", "TrainerRelease", "attach", "release_trainer"]

_SPANS = {"train": "train_step"}
_STAGES = {"train": ""}
MiB = 1024**2


class CudamemTrainerCallback(TrainerCallback, Meters):  # type: ignore[misc,unused-ignore]
    """Memory per optimizer step, added to the Trainer's logs.

    Args:
        device: ``'auto'`` (the Trainer's GPU; nothing on the CPU), ``'cuda'``, or ``'cpu'``
            (count live CPU storages, for CPU runs and tests: ``allocated``, ``retained``
            and ``leak_culprits`` only).
        every_n_steps: measure one optimizer step in this many.
        prefix: prepended to every key (``cudamem/peak_mib``).
        peak: track each step's peak (resets PyTorch's peak counter per step).
        modules: profile memory per module over the training (``cudamem.track_modules``)
            and add the top ``modules`` to the last log entry at its end
            (``cudamem/modules/<name>/kept_mib``, ``…/peak_mib``);
            ``callback.module_profile`` is the whole profile. 0: off.
        host: log the host columns (``host_rss_mib``, ``host_uss_mib``, ``workers_uss_mib``,
            ``pinned_mib``), read from the DataLoader worker watcher it starts for the run.
    """

    def __init__(
        self,
        *,
        device: str = "auto",
        every_n_steps: int = 1,
        prefix: str = "cudamem/",
        peak: bool = True,
        modules: int = 0,
        host: bool = True,
    ) -> None:
        self._init_meters(device, every_n_steps, prefix, peak, modules, _SPANS, _STAGES, host)
        self._pending: list[dict[str, float]] = []
        #: The values added to the last log.
        self.last_values: dict[str, float] = {}

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        device = getattr(args, "device", None)
        kind = str(getattr(device, "type", "cpu"))
        index = getattr(device, "index", None)
        if kind == "cuda" and not isinstance(index, int):
            index = _backend.get().current_device()
        self._pending.clear()
        self.meter.begin_run(kind, index if isinstance(index, int) else None)
        if self.meter.note is not None:
            import warnings

            warnings.warn(self.meter.note, UserWarning, stacklevel=2)
        if self.meter.measuring:
            self.modules.begin(kwargs.get("model"))

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.meter.start("train")

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        values = self.meter.end("train")
        self.modules.step()
        if values:
            self._pending.append(values)

    def on_log(
        self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kwargs: Any
    ) -> None:
        if logs is None or not self._pending:
            return
        values = self.meter.summarize("train", self._pending)
        self._pending.clear()
        self.last_values = values
        logs.update(values)
        history = getattr(state, "log_history", None)
        # Trainer.log appended a copy of ``logs`` just before calling on_log.
        if isinstance(history, list) and history and isinstance(history[-1], dict):
            history[-1].update(values)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        top = self.modules.end()
        history = getattr(state, "log_history", None)
        if top and isinstance(history, list) and history and isinstance(history[-1], dict):
            history[-1].update(top)  # the Trainer's last log (its train summary)
        self.meter.end_run()


def attach(trainer: Any, **kwargs: Any) -> CudamemTrainerCallback:
    """Create a ``CudamemTrainerCallback`` and make it the Trainer's first callback, so
    that reporters (TensorBoard, W&B, ...) see its values in the same log."""
    handler = getattr(trainer, "callback_handler", None)
    callbacks = getattr(handler, "callbacks", None)
    if not isinstance(callbacks, list):
        raise TypeError(f"trainer must be a transformers.Trainer, not {type(trainer).__name__}")
    cb = CudamemTrainerCallback(**kwargs)
    callbacks.insert(0, cb)
    return cb


# --------------------------------------------------------------------------- release


def _tensors(model: Any, optimizer: Any) -> Iterator[Any]:
    """Parameters, buffers and gradients of ``model``, tensors of ``optimizer``'s state."""
    import torch

    if isinstance(model, torch.nn.Module):
        for p in model.parameters():
            yield p
            if p.grad is not None:
                yield p.grad
        yield from model.buffers()
    inner = getattr(optimizer, "optimizer", optimizer)  # accelerate wraps the optimizer
    state = getattr(inner, "state", None)
    if isinstance(state, dict):
        for per_param in list(state.values()):
            if isinstance(per_param, dict):
                for value in list(per_param.values()):
                    if isinstance(value, torch.Tensor):
                        yield value


def _track(model: Any, optimizer: Any) -> tuple[StorageSnapshot, list[str]]:
    """The storages of ``model`` and ``optimizer``'s state: keeps nothing alive."""
    tensors: list[Any] = []
    notes: list[str] = []
    try:
        tensors.extend(_tensors(model, optimizer))
    except Exception as exc:
        notes.append(f"could not list every storage: {type(exc).__name__}: {exc}")
    tracked = StorageSnapshot.of(tensors)
    tensors.clear()
    return tracked, notes


def _drop(trainer: Any, name: str, dropped: list[str], *, keep: bool = False) -> None:
    if keep or getattr(trainer, name, None) is None:
        return
    setattr(trainer, name, None)
    dropped.append(f"trainer.{name}")


#: Per Trainer (weakly): storages a release found still alive, checked again next time.
_earlier: weakref.WeakKeyDictionary[Any, StorageSnapshot] = weakref.WeakKeyDictionary()


def release_trainer(trainer: Any, *, keep_model: bool = False) -> TrainerRelease:
    """Free what a finished ``transformers.Trainer`` holds, and name what is still held.

    Args:
        trainer: the Trainer, after ``train()`` (or after it failed).
        keep_model: keep ``trainer.model`` (to save or evaluate it later); the optimizer,
            scheduler, gradients and the Accelerator's references are dropped all the same.

    Returns:
        ``TrainerRelease``. The Trainer cannot train again afterwards (build a new one).
        Storages found still alive are checked again by the next call on the same Trainer,
        so ``del model; release_trainer(trainer)`` confirms they are gone.
    """
    handler = getattr(trainer, "callback_handler", None)
    if handler is None or not hasattr(trainer, "args"):
        raise TypeError(f"trainer must be a transformers.Trainer, not {type(trainer).__name__}")

    model = getattr(trainer, "model", None)
    tracked, notes = _track(None if keep_model else model, getattr(trainer, "optimizer", None))
    # Storages an earlier call found still alive are checked again (after `del model`).
    with contextlib.suppress(TypeError):
        tracked = tracked.union(_earlier.pop(trainer, StorageSnapshot()))
    if keep_model and model is not None:
        # Gradients are not needed to save or evaluate the model.
        import torch

        if isinstance(model, torch.nn.Module):
            model.zero_grad(set_to_none=True)
    del model
    dropped: list[str] = []
    for name in ("optimizer", "lr_scheduler"):
        _drop(trainer, name, dropped)
    _drop(trainer, "model_wrapped", dropped, keep=keep_model)
    _drop(trainer, "model", dropped, keep=keep_model)
    _drop(trainer, "deepspeed", dropped)
    accelerator = getattr(trainer, "accelerator", None)
    if accelerator is not None and callable(getattr(accelerator, "free_memory", None)):
        try:
            accelerator.free_memory()
            dropped.append("trainer.accelerator (free_memory)")
        except Exception as exc:
            notes.append(f"accelerator.free_memory() failed: {type(exc).__name__}: {exc}")
    for name in ("optimizer", "lr_scheduler", "train_dataloader", "eval_dataloader"):
        if getattr(handler, name, None) is not None:
            setattr(handler, name, None)
            dropped.append(f"trainer.callback_handler.{name}")
    if not keep_model and getattr(handler, "model", None) is not None:
        handler.model = None
        dropped.append("trainer.callback_handler.model")
    gc.collect()
    result: ReleaseResult | None = None
    try:
        result = release(holders=False)
    except Exception as exc:
        notes.append(f"cudamem.release() failed: {type(exc).__name__}: {exc}")
    alive = tracked.alive()
    if alive:
        with contextlib.suppress(TypeError):  # a Trainer that takes no weak reference
            _earlier[trainer] = alive
    remaining: tuple[Culprit, ...] = ()
    if alive:
        remaining = _holders_of(alive, notes)
    return TrainerRelease(
        dropped=tuple(dropped),
        tracked=len(tracked),
        tracked_bytes=tracked.nbytes,
        freed=len(tracked) - len(alive),
        freed_bytes=tracked.nbytes - alive.nbytes,
        remaining=remaining,
        release=result,
        notes=tuple(notes),
    )


def _holders_of(alive: StorageSnapshot, notes: list[str]) -> tuple[Culprit, ...]:
    """Still-alive storages grouped by the variable that holds them, the largest first."""

    try:
        found = alive.storages(holders=True)
    except Exception as exc:
        notes.append(f"holders not found: {type(exc).__name__}: {exc}")
        return ()
    return tuple(group_by_owner(found))

"""PyTorch Lightning: ``CudamemCallback``, per-batch memory metrics through the trainer's logger.

::

    from cudamem.integrations.lightning import CudamemCallback

    trainer = L.Trainer(callbacks=[CudamemCallback()], logger=TensorBoardLogger("logs"))

Every training (and validation) batch runs inside a cudamem span opened in
``on_train_batch_start`` and closed in ``on_train_batch_end``. Its figures go to every logger
the trainer has (TensorBoard, W&B, CSV, MLflow, ...: ``logger.log_metrics``) at the trainer's
``log_every_n_steps`` and logging step, like the module's own ``self.log`` values:

========================  ==================================================================
``cudamem/allocated_mib``  allocated at the end of the batch
``cudamem/reserved_mib``   reserved at the end (allocated + the allocator's cache)
``cudamem/peak_mib``       the highest allocated during the batch
``cudamem/retained_mib``   allocated at the end minus at the start: what the batch kept
``cudamem/leak_culprits``  holder groups named by the latest LeakWarning (0 until one)
========================  ==================================================================

Each validation run logs one row of the same under ``cudamem/val_…`` (the last batch's
levels, the highest peak, the mean retained per batch). A batch span that keeps growing
gets cudamem's ``cudamem.LeakWarning`` naming who holds the growth (``callback.leaks``
keeps the findings); an out-of-memory error gets cudamem's post-mortem from ``on_exception``
(``callback.oom_report``). On a CPU model nothing is logged unless ``device='cpu'``, which
counts live CPU storages instead (``allocated``, ``retained`` and ``leak_culprits`` only).
``modules=5`` also profiles memory per module over the fit and logs the top five modules
at its end (``cudamem/modules/<name>/kept_mib``, ``…/peak_mib``; ``callback.module_profile``).

``fit_batch_size(trainer, module)`` is a drop-in for Lightning's
``Tuner(trainer).scale_batch_size(module)``: it sets ``module.batch_size`` to the largest batch
that fits, from ``cudamem.plan``'s probe steps (five steps, no out-of-memory trials, the
module's weights put back after); ``plan_batch_size`` returns the whole ``MemoryPlan``.

Needs ``lightning`` (``pip install 'cudamem[lightning]'``); falls back to ``pytorch_lightning``.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from ..allocator import backend as _backend
from ..fit.planner import plan
from ..growth.detector import leak_settings
from ..ledger import oom
from ._steps import Meters

try:
    from lightning.pytorch import Callback
    from lightning.pytorch.utilities.parsing import (
        lightning_getattr,
        lightning_hasattr,
        lightning_setattr,
    )
except ImportError:  # pragma: no cover - the older package name
    try:
        from pytorch_lightning import Callback  # type: ignore[assignment,no-redef,unused-ignore]
        from pytorch_lightning.utilities.parsing import (  # type: ignore[assignment,no-redef,unused-ignore]
            lightning_getattr,
            lightning_hasattr,
            lightning_setattr,
        )
    except ImportError:
        raise ModuleNotFoundError(
            "cudamem.integrations.lightning needs lightning: pip install 'cudamem[lightning]'",
            name="lightning",
        ) from None

if TYPE_CHECKING:
    from ..fit.memory_plan import MemoryPlan
    from ..ledger.oom import OomReport

__all__ = ["CudamemCallback", "fit_batch_size", "plan_batch_size"]

_SPANS = {"train": "train_batch", "val": "validation_batch"}
_STAGES = {"train": "", "val": "val_"}


def _device_of(pl_module: Any) -> tuple[str, int | None]:
    device = getattr(pl_module, "device", None)
    kind = str(getattr(device, "type", "cpu"))
    index = getattr(device, "index", None)
    return kind, index if isinstance(index, int) else None


class CudamemCallback(Callback, Meters):  # type: ignore[misc,unused-ignore]
    """Memory metrics per batch, leak warnings with culprits, and OOM post-mortems.

    Args:
        device: ``'auto'`` (the model's GPU; nothing on a CPU model), ``'cuda'``, or
            ``'cpu'`` (count live CPU storages: for CPU-only runs and tests).
        every_n_steps: measure one batch in this many (each measured batch costs two
            counter reads, ~0.1 ms; in CPU mode two census passes).
        validation: also measure validation batches (logged as ``cudamem/val_…``).
        prefix: prepended to every metric name.
        peak: track each batch's peak (resets PyTorch's peak counter per batch; use
            ``cudamem.max_allocated()`` for the process-wide peak).
        oom_report: build and print cudamem's post-mortem when an OOM ends the fit.
        modules: profile memory per module over the fit (``cudamem.track_modules``) and
            log the top ``modules`` at its end (``cudamem/modules/<name>/kept_mib`` and
            ``…/peak_mib``); ``callback.module_profile`` is the whole profile. 0: off.
        host: log the host columns (``host_rss_mib``, ``host_uss_mib``, ``workers_uss_mib``,
            ``pinned_mib``), read from the DataLoader worker watcher it starts for the run.
    """

    def __init__(
        self,
        *,
        device: str = "auto",
        every_n_steps: int = 1,
        validation: bool = True,
        prefix: str = "cudamem/",
        peak: bool = True,
        oom_report: bool = True,
        modules: int = 0,
        host: bool = True,
    ) -> None:
        super().__init__()
        self._init_meters(device, every_n_steps, prefix, peak, modules, _SPANS, _STAGES, host)
        self.validation = bool(validation)
        self.report_oom = bool(oom_report)
        #: The post-mortem of the OOM that ended the last fit, if one did.
        self.oom_report: OomReport | None = None
        #: Metrics of the last measured batch of each stage (``'train'``, ``'val'``).
        self.last_metrics: dict[str, dict[str, float]] = {}
        self._val: list[dict[str, float]] = []

    # -- run ----------------------------------------------------------------------------

    def _begin(self, pl_module: Any) -> None:
        kind, index = _device_of(pl_module)
        self.meter.begin_run(kind, index)
        if self.meter.note is not None:
            warnings.warn(self.meter.note, UserWarning, stacklevel=2)

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        self.oom_report = None
        self._begin(pl_module)
        if self.meter.measuring:
            self.modules.begin(pl_module)

    def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
        self._log(trainer, "modules", self.modules.end())
        self.meter.end_run()

    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        if self.meter._stack is None:  # trainer.validate(): no fit around it
            self._begin(pl_module)
        self.modules.pause()

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        self.modules.resume()

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self.modules.end()
        self.meter.end_run()

    # -- batches ------------------------------------------------------------------------

    def _log(self, trainer: Any, stage: str, metrics: Mapping[str, float] | None) -> None:
        """Hand ``metrics`` to every logger of the trainer, at the trainer's logging step.

        Straight to ``logger.log_metrics`` rather than through ``pl_module.log``, which would
        turn each float into a tensor on the model's device (a GPU allocation per metric and
        step, kept in the result collection) inside the very steps being measured.
        """
        if not metrics:
            return
        self.last_metrics[stage] = dict(metrics)
        loggers = getattr(trainer, "loggers", None) or ()
        if not loggers:
            return
        step = getattr(getattr(trainer.fit_loop, "epoch_loop", None), "_batches_that_stepped", None)
        if not isinstance(step, int):
            step = int(trainer.global_step)
        for logger in loggers:
            try:
                logger.log_metrics(dict(metrics), step=step)
            except Exception as exc:  # a logger's failure must not stop the training step
                name = type(logger).__name__
                warnings.warn(
                    f"cudamem: {name} refused the metrics: {exc!r}", RuntimeWarning, stacklevel=2
                )

    @staticmethod
    def _log_now(trainer: Any) -> bool:
        """Lightning's own rule: every ``log_every_n_steps`` batches, and when stopping."""
        connector = getattr(trainer, "_logger_connector", None)
        should = getattr(connector, "should_update_logs", None)
        if isinstance(should, bool):
            return should
        n = max(1, int(getattr(trainer, "log_every_n_steps", 1) or 1))
        return (int(trainer.global_step) + 1) % n == 0

    def on_train_batch_start(
        self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int
    ) -> None:
        self.meter.start("train")

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        metrics = self.meter.end("train")
        self.modules.step()
        if metrics and self._log_now(trainer):
            self._log(trainer, "train", metrics)
        elif metrics:
            self.last_metrics["train"] = metrics

    def on_validation_batch_start(
        self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        if self.validation and not trainer.sanity_checking:
            self.meter.start("val")

    def on_validation_batch_end(
        self,
        trainer: Any,
        pl_module: Any,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        if self.validation and not trainer.sanity_checking:
            metrics = self.meter.end("val")
            if metrics:
                self._val.append(metrics)

    def on_validation_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        """One row per validation run: last levels, highest peak, mean retained per batch."""
        steps, self._val = self._val, []
        if steps and not trainer.sanity_checking:
            self._log(trainer, "val", self.meter.summarize("val", steps))

    # -- failure ------------------------------------------------------------------------

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:

        span_was_open = self.meter.abort(exception)
        self.modules.end()
        try:
            is_oom = _backend.get().is_oom(exception)
        except Exception:
            is_oom = False
        self.meter.end_run()
        if not (is_oom and self.report_oom):
            return
        try:
            self.oom_report = oom.oom_report(exception)
        except Exception as exc:  # a post-mortem never adds a second failure
            sys.stderr.write(f"cudamem: OOM post-mortem failed: {exc!r}\n")
            return
        # The span's exit already printed it unless span reports are off.
        if not (span_was_open and leak_settings().span_oom_reports):
            sys.stderr.write(str(self.oom_report) + "\n")

    def state_dict(self) -> dict[str, Any]:
        """Nothing to checkpoint: the metrics are measured afresh after a resume."""
        return {}


# --------------------------------------------------------------------------- batch size


def _first_optimizer(config: Any) -> Any:
    """The first optimizer of what ``configure_optimizers`` returned (an optimizer, a
    list or tuple of them, ``(optimizers, schedulers)``, a dict with ``"optimizer"``)."""
    import torch

    if isinstance(config, torch.optim.Optimizer):
        return config
    if isinstance(config, Mapping) and "optimizer" in config:
        return _first_optimizer(config["optimizer"])
    if isinstance(config, (list, tuple)) and config:
        return _first_optimizer(config[0])
    raise TypeError(
        "configure_optimizers() returned no optimizer cudamem can step "
        f"({type(config).__name__}); plan the step yourself with cudamem.plan"
    )


def _train_loader(trainer: Any, module: Any) -> Any:
    datamodule = getattr(trainer, "datamodule", None)
    if datamodule is not None and callable(getattr(datamodule, "train_dataloader", None)):
        return datamodule.train_dataloader()
    return module.train_dataloader()


def plan_batch_size(
    trainer: Any,
    module: Any,
    *,
    sizes: tuple[int, ...] = (4, 8),
    batch_arg_name: str = "batch_size",
    restore: bool = True,
) -> MemoryPlan:
    """``cudamem.plan`` of one training step of ``module`` at batch sizes ``sizes``.

    Each step sets ``batch_arg_name`` (on the module, its ``hparams`` or the trainer's
    datamodule, as Lightning's tuner finds it), takes the first batch of the training
    dataloader, moves it to the trainer's device, runs ``training_step``, the backward and
    one step of the first optimizer ``configure_optimizers`` returns. With ``restore``
    (the default) the module's weights are put back after the probes, as Lightning's tuner
    does with its checkpoint. The batch size is set back to its value.

    Raises:
        ValueError: the trainer's device is not a CUDA device, or ``batch_arg_name`` is
            nowhere to be found.
    """
    import torch

    device = trainer.strategy.root_device
    if device.type != "cuda":
        raise ValueError(f"trainer must run on a CUDA device to plan its memory, not {device}")
    if not lightning_hasattr(module, batch_arg_name):
        raise ValueError(
            f"batch_arg_name {batch_arg_name!r} is neither an attribute of the module, nor "
            "of its hparams, nor of the trainer's datamodule"
        )
    original = lightning_getattr(module, batch_arg_name)
    module.to(device)
    optimizer = _first_optimizer(module.configure_optimizers())

    def step(n: int) -> None:
        lightning_setattr(module, batch_arg_name, n)
        batch = next(iter(_train_loader(trainer, module)))
        batch = module.transfer_batch_to_device(batch, device, 0)
        module.train()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # self.log() without a running fit
            out = module.training_step(batch, 0)
        loss = out["loss"] if isinstance(out, Mapping) else out
        if not isinstance(loss, torch.Tensor):
            raise TypeError("training_step returned no loss tensor: cudamem cannot step it")
        loss.backward()  # type: ignore[no-untyped-call,unused-ignore]
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    try:
        return plan(
            step,
            sizes,
            model=module,
            optimizer=optimizer,
            restore=restore,
            device=device,
            max_batch=_dataset_length(trainer, module, sizes),
        )
    finally:
        lightning_setattr(module, batch_arg_name, original)


def _dataset_length(trainer: Any, module: Any, sizes: tuple[int, ...]) -> int | None:
    """The training dataset's length (no batch is larger: the confirming step and the
    answer stop there, as Lightning's tuner does), ``None`` when it has none (an iterable
    dataset) or it is not past the probes."""
    try:
        length = len(_train_loader(trainer, module).dataset)
    except Exception:
        return None
    return length if length >= max(sizes) else None


def fit_batch_size(
    trainer: Any,
    module: Any,
    *,
    margin: float = 0.05,
    sizes: tuple[int, ...] = (4, 8),
    batch_arg_name: str = "batch_size",
) -> int:
    """Set ``module.batch_size`` (``batch_arg_name``) to the largest batch that fits and
    return it: a drop-in for ``Tuner(trainer).scale_batch_size(module)`` with no
    out-of-memory trials. The answer is ``plan_batch_size(...).largest(margin)``: the memory
    this process can use now, less ``margin``.

    Raises:
        ValueError: as ``plan_batch_size``; or not even one sample fits.
        cudamem.fit.memory_plan.NotLinearError: the step's peak is not linear in the batch size.
    """
    measured = plan_batch_size(
        trainer, module, sizes=sizes, batch_arg_name=batch_arg_name, restore=True
    )
    largest = measured.largest(margin)
    if largest < 1:
        raise ValueError(
            f"not even one sample fits: {measured.predict(1)} with {margin:.0%} margin"
        )
    lightning_setattr(module, batch_arg_name, largest)
    return largest

"""The Lightning callback on a real CPU ``Trainer`` with a ``CSVLogger`` (read back), and on
the GPU (``cuda`` tests)."""

from __future__ import annotations

import csv
import gc
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import cudamem
from cudamem.allocator import backend as _backend

from ... import extras

L = extras.need("lightning.pytorch")
from lightning.pytorch.loggers import CSVLogger  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from cudamem.integrations._cpu import CpuStorageBackend  # noqa: E402
from cudamem.integrations.lightning import CudamemCallback  # noqa: E402

from ...fakes import FakeAllocator  # noqa: E402

MiB = 1024**2


class Model(L.LightningModule):  # type: ignore[misc]
    """256 → 1024: one output is 64×1024 float32 = 256 KiB per batch of 64."""

    def __init__(self, *, keep_outputs: bool = False, oom_at: int | None = None) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(256, 1024)
        self.keep_outputs = keep_outputs
        self.oom_at = oom_at
        self.outputs_seen: list[torch.Tensor] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (x,) = batch
        if self.oom_at is not None and batch_idx == self.oom_at:
            raise torch.OutOfMemoryError(
                "CUDA out of memory. Tried to allocate 20.00 GiB. GPU 0 has a total capacity of "
                "79.19 GiB of which 3.94 GiB is free. Of the allocated memory 70.12 GiB is "
                "allocated by PyTorch, and 1.20 GiB is reserved by PyTorch but unallocated."
            )
        out = self.lin(x)
        if self.keep_outputs:
            self.outputs_seen.append(out)  # the seed's leak: a list of step outputs
        loss = out.sigmoid().mean()
        self.log("loss", loss.item())
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (x,) = batch
        return self.lin(x).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def optimizer_zero_grad(self, epoch: int, batch_idx: int, optimizer: Any) -> None:
        # Keep the gradient storages: a gradient re-created each step lands at the address
        # of the one just freed, and leak capture compares storages by address.
        optimizer.zero_grad(set_to_none=False)


def loader() -> DataLoader[Any]:
    return DataLoader(TensorDataset(torch.randn(64 * 8, 256)), batch_size=64)


def fit(
    tmp_path: Path, model: Model, cb: CudamemCallback, steps: int = 8, **kwargs: Any
) -> tuple[list[dict[str, str]], list[warnings.WarningMessage]]:
    logger = CSVLogger(str(tmp_path), name="run")
    trainer = L.Trainer(
        accelerator=kwargs.pop("accelerator", "cpu"),
        devices=1,
        max_steps=steps,
        log_every_n_steps=1,
        limit_val_batches=2,
        val_check_interval=4,
        num_sanity_val_steps=0,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        logger=logger,
        callbacks=[cb],
        **kwargs,
    )
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        trainer.fit(model, loader(), loader())
    with open(Path(logger.log_dir) / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    return rows, record


@pytest.fixture(autouse=True)
def _defaults() -> Any:
    cudamem.configure_leaks()
    yield
    cudamem.configure_leaks()


def test_cpu_mode_logs_the_cpu_metrics_through_the_csv_logger(tmp_path: Path) -> None:
    cb = CudamemCallback(device="cpu")
    rows, _ = fit(tmp_path, Model(), cb)
    columns = set(rows[0])
    assert {"cudamem/allocated_mib", "cudamem/retained_mib", "cudamem/leak_culprits"} <= columns
    assert {"cudamem/val_allocated_mib", "cudamem/val_retained_mib"} <= columns
    # The CPU has no cache and no peak counter: those are not logged, not faked as 0.
    assert not any("reserved" in c or "peak" in c for c in columns)
    # Host columns from the worker watcher; no pinned pool without CUDA.
    assert {"cudamem/host_rss_mib", "cudamem/host_uss_mib", "cudamem/workers_uss_mib"} <= columns
    assert "cudamem/pinned_mib" not in columns
    first = next(r for r in rows if r["cudamem/host_rss_mib"])
    assert float(first["cudamem/host_rss_mib"]) >= float(first["cudamem/host_uss_mib"]) > 10
    train = [r for r in rows if r["cudamem/allocated_mib"]]
    assert [int(r["step"]) for r in train] == list(range(8))
    params = (256 * 1024 + 1024) * 4 / MiB  # the weights alone are 1.0 MiB
    for r in train:
        assert float(r["cudamem/allocated_mib"]) >= params
        assert float(r["cudamem/leak_culprits"]) == 0.0
    # Steady state: after the first step (gradients appear) a step keeps nothing.
    assert all(abs(float(r["cudamem/retained_mib"])) < 0.01 for r in train[1:4])
    assert cb.leaks == ()
    assert not isinstance(_backend.get(), CpuStorageBackend)  # restored after the fit
    # Logged at the trainer's logging steps: the module's own `loss` rows have the same ones.
    assert [int(r["step"]) for r in rows if r["loss"]] == list(range(8))
    val = [r for r in rows if r["cudamem/val_allocated_mib"]]
    assert [int(r["step"]) for r in val] == [3, 7]  # one row per validation run


def test_a_leaking_module_gets_a_leak_warning_naming_its_list(tmp_path: Path) -> None:
    cb = CudamemCallback(device="cpu")
    model = Model(keep_outputs=True)
    rows, record = fit(tmp_path, model, cb, steps=10)
    found = [w.message for w in record if isinstance(w.message, cudamem.LeakWarning)]
    assert found, [str(w.message) for w in record]
    growth = found[0].growth
    assert growth is not None and growth.name == "train_batch"
    assert growth.culprits[0].holder.endswith("outputs_seen")
    assert growth.per_call == pytest.approx(256 * 1024, rel=0.05)
    assert cb.leaks and cb.leaks[0] is growth
    train = [r for r in rows if r["cudamem/allocated_mib"]]
    retained = [float(r["cudamem/retained_mib"]) for r in train]
    assert sorted(retained)[len(retained) // 2] == pytest.approx(0.25, abs=0.01)
    culprits = [float(r["cudamem/leak_culprits"]) for r in train]
    assert culprits[0] == 0.0 and culprits[-1] == 1.0


def test_auto_mode_on_a_cpu_model_logs_nothing_and_says_why(tmp_path: Path) -> None:
    cb = CudamemCallback()
    rows, record = fit(tmp_path, Model(), cb, steps=2)
    assert rows and rows[0]["loss"] and not any(c.startswith("cudamem/") for c in rows[0])
    assert any("no memory metrics are logged" in str(w.message) for w in record)
    assert cb.meter.mode == "off"


def test_oom_in_a_step_gives_a_post_mortem(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cb = CudamemCallback(device="cpu")
    with pytest.raises(torch.OutOfMemoryError):
        fit(tmp_path, Model(oom_at=2), cb, steps=5)
    report = cb.oom_report
    assert report is not None
    assert report.requested == 20 * 1024**3
    assert report.total is not None and report.free == round(3.94 * 1024**3)
    err = capsys.readouterr().err
    assert "Tried to allocate" in err or "20.0 GiB" in err
    # The failed batch's span was closed with the exception and the backend restored.
    assert cb.meter._current is None and not isinstance(_backend.get(), CpuStorageBackend)
    assert cudamem.history().named("train_batch")[-1].exception is not None


def test_every_n_steps_and_argument_checks(tmp_path: Path) -> None:
    cb = CudamemCallback(device="cpu", every_n_steps=3, validation=False)
    rows, _ = fit(tmp_path, Model(), cb, steps=7)
    steps = [int(r["step"]) for r in rows if r.get("cudamem/allocated_mib")]
    assert steps == [0, 3, 6]
    assert not any(c.startswith("cudamem/val_") for c in rows[0])
    with pytest.raises(ValueError, match="device"):
        CudamemCallback(device="tpu")
    with pytest.raises(ValueError, match="every_n_steps"):
        CudamemCallback(every_n_steps=0)
    with pytest.raises(TypeError, match="every_n_steps"):
        CudamemCallback(every_n_steps=1.5)  # type: ignore[arg-type]


def test_user_spans_inside_a_step_stay_top_level(tmp_path: Path) -> None:
    class Spanned(Model):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            with cudamem.track("forward"):
                return super().training_step(batch, batch_idx)

    fit(tmp_path, Spanned(), CudamemCallback(device="cpu"), steps=3)
    assert len(cudamem.history().named("forward")) == 3  # not children of the batch span
    assert len(cudamem.history().named("train_batch")) == 3


@pytest.mark.cuda
def test_cuda_metrics_are_the_allocator_figures(tmp_path: Path) -> None:
    cb = CudamemCallback()
    rows, _ = fit(tmp_path, Model(), cb, steps=6, accelerator="gpu")
    train = [r for r in rows if r.get("cudamem/allocated_mib")]
    assert len(train) == 6
    assert {"cudamem/reserved_mib", "cudamem/peak_mib"} <= set(train[0])
    for r in train:
        allocated = float(r["cudamem/allocated_mib"])
        assert float(r["cudamem/reserved_mib"]) >= allocated
        assert float(r["cudamem/peak_mib"]) >= allocated
        # The weights (1 MiB) are on the GPU for the whole run.
        assert allocated >= (256 * 1024 + 1024) * 4 / MiB
        # Host columns on CUDA include the pinned pool (in use + cached, possibly 0).
        assert float(r["cudamem/pinned_mib"]) >= 0
        assert float(r["cudamem/host_rss_mib"]) >= float(r["cudamem/host_uss_mib"]) > 10
    assert cb.meter.mode == "cuda"


@pytest.mark.cuda
def test_cuda_leak_names_the_list(tmp_path: Path) -> None:
    cb = CudamemCallback()
    rows, record = fit(tmp_path, Model(keep_outputs=True), cb, steps=10, accelerator="gpu")
    found = [w.message for w in record if isinstance(w.message, cudamem.LeakWarning)]
    assert found and found[0].growth is not None
    assert found[0].growth.culprits[0].holder.endswith("outputs_seen")
    retained = [float(r["cudamem/retained_mib"]) for r in rows if r.get("cudamem/retained_mib")]
    assert sorted(retained)[len(retained) // 2] == pytest.approx(0.25, abs=0.01)


def test_a_failing_logger_does_not_stop_training(tmp_path: Path) -> None:
    from lightning.pytorch.loggers import Logger

    class Broken(Logger):  # type: ignore[misc]
        name = "broken"
        version = 0

        def log_hyperparams(self, *args: Any, **kwargs: Any) -> None:
            pass

        def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
            if any(k.startswith("cudamem/") for k in metrics):
                raise OSError("disk full")

    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=3,
        log_every_n_steps=1,
        logger=Broken(),
        callbacks=[CudamemCallback(device="cpu")],
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    with pytest.warns(RuntimeWarning, match="Broken refused the metrics: OSError"):
        trainer.fit(Model(), loader())
    assert trainer.global_step == 3


def test_modules_logs_the_top_modules_at_the_end_of_the_fit(tmp_path: Path) -> None:
    # CPU mode counts live CPU storages: a collection of the earlier tests' garbage during
    # a forward would count as memory the module gave back.
    gc.collect()
    cb = CudamemCallback(device="cpu", modules=3)
    rows, _ = fit(tmp_path, Model(), cb, steps=4)
    profile = cb.module_profile
    assert profile is not None and profile.steps == 4
    lin = profile.module("Model.lin")
    assert lin.backward_calls.max == 1
    # Its output, 64 x 1024 float32, which sigmoid keeps for the backward.
    assert lin.self_kept.max >= 64 * 1024 * 4
    logged = [r for r in rows if r.get("cudamem/modules/Model.lin/kept_mib")]
    assert len(logged) == 1
    assert float(logged[0]["cudamem/modules/Model.lin/kept_mib"]) >= 0.25
    assert "cudamem/modules/Model.lin/peak_mib" in logged[0]
    assert all(len(m._forward_hooks) == 0 for m in Model().modules())
    with pytest.raises(ValueError, match="modules must be >= 0"):
        CudamemCallback(modules=-1)


# --------------------------------------------------------------------------- fit_batch_size


class _SizedDevice(FakeAllocator):
    """A fake 16 GiB device: CUDA's free memory is what its reserved leaves."""

    def mem_get_info(self, device: int) -> tuple[int, int] | None:
        return (16 * 1024 * MiB - self.reserved[device], 16 * 1024 * MiB)


class _Sized(L.LightningModule):  # type: ignore[misc]
    """A step whose peak on the fake device is 200 MiB + 30 MiB per sample."""

    def __init__(self, fake: FakeAllocator) -> None:
        super().__init__()
        self.fake = fake
        self.lin = torch.nn.Linear(8, 1)
        self.batch_size = 2
        self.samples = 1024
        self.seen: list[int] = []

    def to(self, *args: Any, **kwargs: Any) -> _Sized:  # the "GPU" is the fake allocator
        return self

    def transfer_batch_to_device(self, batch: Any, device: Any, dataloader_idx: int) -> Any:
        return batch

    def train_dataloader(self) -> DataLoader[Any]:
        return DataLoader(TensorDataset(torch.ones(self.samples, 8)), batch_size=self.batch_size)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (x,) = batch
        n = x.shape[0]
        self.seen.append(n)
        self.fake.alloc(200 * MiB + 30 * MiB * n)
        self.fake.free(200 * MiB + 30 * MiB * n)
        self.log("loss", 1.0)  # no running fit: Lightning warns, cudamem silences it
        return self.lin(x).square().mean()

    def configure_optimizers(self) -> Any:
        return {"optimizer": torch.optim.AdamW(self.parameters(), lr=0.1)}


def test_fit_batch_size_sets_the_largest_batch_from_five_steps() -> None:
    from types import SimpleNamespace

    from cudamem.fit._terms import UNCONFIRMED
    from cudamem.integrations.lightning import fit_batch_size, plan_batch_size

    fake = _SizedDevice()
    module = _Sized(fake)
    before = {k: v.clone() for k, v in module.state_dict().items()}
    trainer = SimpleNamespace(strategy=SimpleNamespace(root_device=torch.device("cuda", 0)))
    with _backend.use(fake), warnings.catch_warnings():
        warnings.simplefilter("error")  # self.log's warning must not escape
        answer = fit_batch_size(trainer, module, margin=0.05)
        # the confirming step reserved what it allocated: the 64 MiB headroom alone;
        # UNCONFIRMED of a budget no step ran at (the 5 % margin's) kept in reserve
        budget = 0.95 * (1 - UNCONFIRMED) * 16 * 1024 * MiB
        expected = int((budget - 64 * MiB - 200 * MiB) // (30 * MiB))
        assert answer == expected and module.batch_size == expected
        # warm-up, probes, check, then a step at the answer for the whole device: no OOM
        assert module.seen[:4] == [4, 4, 8, 16] and len(module.seen) in (5, 6)
        assert module.seen[-1] == int((16 * 1024 * MiB - 64 * MiB - 200 * MiB) // (30 * MiB))
        after = module.state_dict()
        assert all(torch.equal(before[k], after[k]) for k in before)  # weights put back
        module.batch_size = 32
        plan = plan_batch_size(trainer, module)
        assert module.batch_size == 32  # set back after the probes
        assert plan.per_sample() == 30 * MiB
        module.samples = 300  # no batch is larger than the dataset: nor any step, nor the answer
        module.seen.clear()
        assert fit_batch_size(trainer, module, margin=0.0) == 300 and max(module.seen) == 300
    cpu = SimpleNamespace(strategy=SimpleNamespace(root_device=torch.device("cpu")))
    with pytest.raises(ValueError, match="trainer must run on a CUDA device"):
        fit_batch_size(cpu, module)
    with pytest.raises(ValueError, match="batch_arg_name 'bs' is neither"), _backend.use(fake):
        fit_batch_size(trainer, module, batch_arg_name="bs")

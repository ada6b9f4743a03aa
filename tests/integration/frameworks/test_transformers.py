"""The Transformers callback and ``release_trainer`` on a real ``Trainer`` (CPU, a 2-layer
GPT-2 built from a config: nothing is downloaded)."""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Any

import pytest
import torch

import cudamem
from cudamem.allocator import backend as _backend

from ... import extras

transformers = extras.need("transformers")
extras.need("accelerate")  # transformers' Trainer needs it

from cudamem.integrations._cpu import CpuStorageBackend  # noqa: E402
from cudamem.integrations.transformers import (  # noqa: E402
    CudamemTrainerCallback,
    attach,
    release_trainer,
)


class Tokens(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    def __init__(self, n: int = 32) -> None:
        self.ids = torch.randint(0, 100, (n, 16), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def tiny_model(n_layer: int = 2) -> Any:
    config = transformers.GPT2Config(
        vocab_size=100,
        n_positions=32,
        n_embd=32,
        n_layer=n_layer,
        n_head=2,
        bos_token_id=0,
        eos_token_id=0,
    )
    return transformers.GPT2LMHeadModel(config)


def make_trainer(tmp_path: Path, model: Any, callbacks: list[Any], **kwargs: Any) -> Any:
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"),
        use_cpu=True,
        max_steps=kwargs.pop("max_steps", 6),
        per_device_train_batch_size=4,
        logging_steps=kwargs.pop("logging_steps", 1),
        report_to=[],
        save_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
        **kwargs,
    )
    return transformers.Trainer(model=model, args=args, train_dataset=Tokens(), callbacks=callbacks)


@pytest.fixture(autouse=True)
def _defaults() -> Any:
    cudamem.configure_leaks()
    yield
    cudamem.configure_leaks()


def test_callback_values_are_in_the_log_history(tmp_path: Path) -> None:
    cb = CudamemTrainerCallback(device="cpu")
    trainer = make_trainer(tmp_path, tiny_model(), [cb])
    trainer.train()
    steps = [h for h in trainer.state.log_history if "loss" in h]
    assert len(steps) == 6
    for h in steps:
        assert {"cudamem/allocated_mib", "cudamem/retained_mib", "cudamem/leak_culprits"} <= set(h)
        # CPU mode: no cache, no peak counter, so neither is reported (never a fake 0).
        assert "cudamem/reserved_mib" not in h and "cudamem/peak_mib" not in h
        # Host columns from the worker watcher (num_workers=0: no worker memory).
        assert h["cudamem/host_rss_mib"] >= h["cudamem/host_uss_mib"] > 10
        assert h["cudamem/workers_uss_mib"] == 0 and "cudamem/pinned_mib" not in h
    params = sum(p.numel() * p.element_size() for p in trainer.model.parameters()) / 1024**2
    # Model + Adam's two moments (+ gradients) are alive at every step's end.
    assert all(h["cudamem/allocated_mib"] >= 3 * params for h in steps[1:])
    assert all(abs(h["cudamem/retained_mib"]) < 0.05 for h in steps[2:])
    final = trainer.state.log_history[-1]
    assert "train_runtime" in final and "cudamem/allocated_mib" not in final
    assert cb.last_values == {k: v for k, v in steps[-1].items() if k.startswith("cudamem/")}
    assert not isinstance(_backend.get(), CpuStorageBackend)  # restored at on_train_end


def test_values_between_two_logs_are_summarised(tmp_path: Path) -> None:
    cb = CudamemTrainerCallback(device="cpu")
    trainer = make_trainer(tmp_path, tiny_model(), [cb], max_steps=6, logging_steps=3)
    trainer.train()
    steps = [h for h in trainer.state.log_history if "loss" in h]
    assert [h["step"] for h in steps] == [3, 6]
    assert all("cudamem/retained_mib" in h for h in steps)


def test_attach_goes_first_so_reporters_see_the_values(tmp_path: Path) -> None:
    seen: list[dict[str, Any]] = []

    class Reporter(transformers.TrainerCallback):  # type: ignore[misc]
        def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kw: Any) -> None:
            seen.append(dict(logs or {}))

    trainer = make_trainer(tmp_path, tiny_model(), [Reporter()], max_steps=2)
    cb = attach(trainer, device="cpu")
    assert trainer.callback_handler.callbacks[0] is cb
    trainer.train()
    assert any("cudamem/allocated_mib" in logs for logs in seen)
    with pytest.raises(TypeError, match="trainer"):
        attach(object())


def test_auto_mode_on_the_cpu_logs_nothing(tmp_path: Path) -> None:
    cb = CudamemTrainerCallback()
    trainer = make_trainer(tmp_path, tiny_model(), [cb], max_steps=2)
    with pytest.warns(UserWarning, match="no memory metrics"):
        trainer.train()
    assert not any(k.startswith("cudamem/") for h in trainer.state.log_history for k in h)


def test_release_trainer_frees_model_and_optimizer_state(tmp_path: Path) -> None:
    trainer = make_trainer(tmp_path, tiny_model(), [], max_steps=2)
    trainer.train()
    from torch.multiprocessing.reductions import StorageWeakRef

    weight = trainer.model.transformer.h[0].attn.c_attn.weight
    ref = StorageWeakRef(weight.untyped_storage())
    state = next(iter(trainer.optimizer.optimizer.state.values()))
    moment = StorageWeakRef(state["exp_avg"].untyped_storage())
    del weight, state
    gc.collect()
    assert not ref.expired() and not moment.expired()  # the Trainer keeps both
    result = release_trainer(trainer)
    assert ref.expired() and moment.expired()
    assert result.tracked > 0 and result.freed == result.tracked
    assert result.freed_bytes == result.tracked_bytes > 0
    assert result.remaining == ()
    assert "trainer.optimizer" in result.dropped and "trainer.model" in result.dropped
    assert f"{result.tracked} of {result.tracked} storages" in str(result)


def test_release_trainer_names_the_callers_own_reference(tmp_path: Path) -> None:
    model = tiny_model()
    trainer = make_trainer(tmp_path, model, [], max_steps=2)
    trainer.train()
    result = release_trainer(trainer)
    # The optimizer state is gone; the parameters stay: this test's `model` holds them.
    assert 0 < result.freed < result.tracked
    params = sum(p.untyped_storage().nbytes() for p in model.parameters())
    assert result.remaining_bytes >= params * 0.9
    holders = " ".join(c.holder for c in result.remaining)
    assert "local 'model'" in holders or ": model" in holders, str(result)
    assert "still alive" in str(result) and "del those references" in str(result)
    # The next call checks those storages again: after `del model` they are gone.
    left = result.tracked - result.freed
    del model
    again = release_trainer(trainer)
    assert again.tracked == left and again.freed == left and again.remaining == ()


def test_release_trainer_keep_model(tmp_path: Path) -> None:
    trainer = make_trainer(tmp_path, tiny_model(), [], max_steps=2)
    trainer.train()
    result = release_trainer(trainer, keep_model=True)
    assert trainer.model is not None and trainer.optimizer is None
    assert all(p.grad is None for p in trainer.model.parameters())
    assert result.remaining == () and result.freed == result.tracked > 0
    with pytest.raises(TypeError, match="trainer"):
        release_trainer(object())


@pytest.mark.cuda
def test_cuda_values_are_the_allocator_figures(tmp_path: Path) -> None:
    cb = CudamemTrainerCallback()
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"),
        max_steps=4,
        per_device_train_batch_size=4,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        disable_tqdm=True,
    )
    trainer = transformers.Trainer(
        model=tiny_model(), args=args, train_dataset=Tokens(), callbacks=[cb]
    )
    trainer.train()
    steps = [h for h in trainer.state.log_history if "loss" in h]
    assert len(steps) == 4
    for h in steps:
        assert h["cudamem/reserved_mib"] >= h["cudamem/allocated_mib"] > 0
        assert h["cudamem/peak_mib"] >= h["cudamem/allocated_mib"]
    weight = trainer.model.lm_head.weight
    ref = torch.multiprocessing.reductions.StorageWeakRef(weight.untyped_storage())
    del weight
    result = release_trainer(trainer)
    assert ref.expired()
    assert result.release is not None and result.release.devices
    assert result.release.devices[0].still_allocated < 1024**2


def test_modules_adds_the_top_modules_to_the_last_log(tmp_path: Path) -> None:
    cb = CudamemTrainerCallback(device="cpu", modules=2)
    # One layer: CPU mode counts storages with a census per module call.
    trainer = make_trainer(tmp_path, tiny_model(n_layer=1), [cb], max_steps=2)
    trainer.train()
    profile = cb.module_profile
    assert profile is not None and profile.steps == 2
    top = profile.top(2)
    final = trainer.state.log_history[-1]
    assert "train_runtime" in final
    for row in top:
        assert final[f"cudamem/modules/{row.name}/kept_mib"] == row.self_kept.mean / 1024**2
        assert f"cudamem/modules/{row.name}/peak_mib" in final
    # The logits (4 x 16 x 100 float32) are kept by the head's own code.
    assert profile.module("GPT2LMHeadModel.lm_head").self_kept.max >= 4 * 16 * 100 * 4
    assert all(len(m._forward_pre_hooks) == 0 for m in trainer.model.modules())

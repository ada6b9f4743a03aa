"""Will it fit? ``cudamem.plan`` against accelerate's ``find_executable_batch_size`` and
Lightning's ``Tuner.scale_batch_size(mode="binsearch")``: the largest batch of one training
step (AdamW), how long each takes to answer, how many steps it ran and how many ran out of
memory, and each answer against the true largest batch.

Models, built from configs (no download): GPT-2 small and BERT-base at sequence length 512
(transformers ``GPT2Config``/``BertConfig``), ResNet-50 at 224² (torchvision,
``weights=None``). Each tool starts from a fresh model and optimizer.

* cudamem: ``plan(step, sizes=(4, 8))`` (warm-up, two probes, a check step), then
  ``largest(margin)``. Also predicted against measured peak at that batch.
* accelerate: ``find_executable_batch_size(starting_batch_size=512)`` around one step
  (0.9× after each OOM).
* Lightning: ``Tuner(trainer).scale_batch_size(module, mode="binsearch")``, its defaults
  (3 steps a trial, a 5 % margin where the release has one); a checkpoint is written and
  restored around it.
* The true largest batch: plain steps bisected from cudamem's answer (bracketed upwards by
  4 % until a step runs out of memory), after ``gc.collect()`` and ``empty_cache()`` each;
  and the largest whose measured peak reserved stays within the same budget as cudamem's
  answer (the memory this process can use, less the margin): the answer to compare with.

Goals (issue 34, H200): ``largest()`` never above the true largest and within 3 % of it; an
answer in at most 4 step executions with 0 OOMs; ≥ 10× faster than Lightning's binsearch;
predicted peak allocated within 2 %, reserved within 5 %.

Usage: ``python benchmarks/fit.py [--quick] [--margin 0.02] [--out benchmarks/results/fit.json]``
(``--quick``: GPT-2 small only, about a minute and a half; the full run about 6 minutes on an
H200).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from _common import CUDA, emit, machine

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import cudamem
from cudamem.memory_plan import available_memory

Step = Callable[[int], None]


def _is_oom(exc: BaseException) -> bool:
    return isinstance(exc, torch.OutOfMemoryError) or "out of memory" in str(exc)


def settle() -> None:
    gc.collect()
    torch.cuda.empty_cache()


# --------------------------------------------------------------------------- models


def build(name: str) -> tuple[torch.nn.Module, torch.optim.Optimizer, Step]:
    """A fresh model, its AdamW and ``step(n)``: one training step at batch ``n``."""
    torch.manual_seed(0)
    if name in ("gpt2", "bert"):
        import transformers

        transformers.logging.set_verbosity_error()
        if name == "gpt2":
            config: Any = transformers.GPT2Config(use_cache=False)
            model: torch.nn.Module = transformers.GPT2LMHeadModel(config)
        else:
            config = transformers.BertConfig()
            model = transformers.BertForMaskedLM(config)
        model = model.cuda()
        vocab = config.vocab_size
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

        def step(n: int) -> None:
            ids = torch.randint(0, vocab, (n, 512), device="cuda")
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        return model, opt, step
    import torchvision

    model = torchvision.models.resnet50(weights=None).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def image_step(n: int) -> None:
        x = torch.randn(n, 3, 224, 224, device="cuda")
        y = torch.randint(0, 1000, (n,), device="cuda")
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return model, opt, image_step


LABELS = {"gpt2": "GPT-2 small @512", "bert": "BERT-base @512", "resnet50": "ResNet-50 @224"}


# --------------------------------------------------------------------------- the tools


def run_cudamem(name: str, margin: float) -> dict[str, Any]:
    model, opt, step = build(name)
    calls: list[int] = []

    def counted(n: int) -> None:
        calls.append(n)
        step(n)

    settle()
    start = time.perf_counter()
    plan = cudamem.plan(counted, sizes=(4, 8), model=model, optimizer=opt)
    answer = plan.largest(margin)
    seconds = time.perf_counter() - start
    print(plan)
    oom = sum(1 for p in plan.probes if p.oom)
    predicted = plan.predict(answer)
    usable, _ = available_memory(torch.cuda.current_device())
    trials = Trials(step)
    ran, reserved, allocated = trials(answer)
    if not ran:
        print(f"cudamem's answer {answer} ran out of memory")
    truth = true_largest(trials, answer, (usable or 0) * (1 - margin))
    out = {
        "answer": answer,
        "answers_by_margin": {str(m): plan.largest(m) for m in (0.0, 0.02, 0.05, 0.10)},
        "seconds": seconds,
        "trials": len(calls),
        "ooms": oom,
        "fixed_bytes": plan.fixed,
        "per_sample_bytes": plan.per_sample(),
        "check_error": None if plan.check is None else plan.check.error,
        "predicted": {"allocated": predicted.allocated, "reserved": predicted.reserved},
        "measured": {"allocated": allocated, "reserved": reserved},
        "answer_ran": ran,
        "allocated_error": (predicted.allocated - allocated) / allocated if ran else None,
        "reserved_error": (predicted.reserved - reserved) / reserved if ran else None,
        "true_largest": truth,
        "plan": str(plan),
    }
    return out


class Trials:
    """Plain steps at given sizes, each from an empty cache, remembered: whether it ran, its
    peak reserved and its peak allocated bytes."""

    def __init__(self, step: Step) -> None:
        self.step = step
        self.seen: dict[int, tuple[bool, int, int]] = {}

    def __call__(self, n: int) -> tuple[bool, int, int]:
        if n not in self.seen:
            settle()
            torch.cuda.reset_peak_memory_stats()
            try:
                self.step(n)
                torch.cuda.synchronize()
                peaks = (torch.cuda.max_memory_reserved(), torch.cuda.max_memory_allocated())
                self.seen[n] = (True, *peaks)
            except Exception as exc:
                if not _is_oom(exc):
                    raise
                self.seen[n] = (False, 0, 0)
            settle()
        return self.seen[n]


def bisect(fits: Callable[[int], bool], start: int) -> int:
    """The largest ``n`` with ``fits(n)``, from ``start``: bracketed upwards by 4 % until
    one does not fit (or halved until one does), then bisected."""
    lo: int | None = None
    hi: int | None = None
    if fits(start):
        lo = start
        while hi is None:
            candidate = max(lo + 1, math.ceil(lo * 1.04))
            if fits(candidate):
                lo = candidate
            else:
                hi = candidate
    else:
        hi = start
        while lo is None:
            if hi == 1:
                return 0
            candidate = max(1, hi // 2)
            if fits(candidate):
                lo = candidate
            else:
                hi = candidate
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo


def true_largest(trials: Trials, start: int, budget: float) -> dict[str, Any]:
    """The largest batch a plain step runs at, and the largest whose measured peak
    reserved stays within ``budget`` (the memory less the same margin ``largest`` used)."""
    runs = bisect(lambda n: trials(n)[0], start)
    within = 0
    if runs:
        within = bisect(lambda n: trials(n)[0] and trials(n)[1] <= budget, min(start, runs))
    return {"largest": runs, "largest_within_margin": within, "trials": len(trials.seen)}


def run_accelerate(name: str) -> dict[str, Any]:
    from accelerate.utils import find_executable_batch_size

    _, _, step = build(name)
    tried: list[int] = []
    failed: list[int] = []

    @find_executable_batch_size(starting_batch_size=512)
    def train(batch_size: int) -> int:
        tried.append(batch_size)
        try:
            step(batch_size)
        except Exception as exc:
            if _is_oom(exc):
                failed.append(batch_size)
            raise
        torch.cuda.synchronize()
        return batch_size

    settle()
    start = time.perf_counter()
    answer = train()
    seconds = time.perf_counter() - start
    return {"answer": answer, "seconds": seconds, "trials": len(tried), "ooms": len(failed)}


def run_lightning(name: str) -> dict[str, Any]:
    import lightning.pytorch as pl
    from lightning.pytorch.tuner import Tuner

    model, _, _ = build(name)  # Lightning makes its own optimizer (configure_optimizers)
    started: list[int] = []
    finished: set[int] = set()

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = model
            self.batch_size = 2

        def train_dataloader(self) -> Any:
            data = torch.utils.data.TensorDataset(torch.arange(1 << 16))
            return torch.utils.data.DataLoader(data, batch_size=self.batch_size)

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

        def training_step(self, batch: Any, index: int) -> torch.Tensor:
            n = int(batch[0].shape[0])
            if n not in started:
                started.append(n)
            if name == "resnet50":
                x = torch.randn(n, 3, 224, 224, device=self.device)
                y = torch.randint(0, 1000, (n,), device=self.device)
                loss = F.cross_entropy(self.net(x), y)
            else:
                vocab = self.net.config.vocab_size
                ids = torch.randint(0, vocab, (n, 512), device=self.device)
                loss = self.net(input_ids=ids, labels=ids).loss
            return loss

        def on_train_batch_end(self, outputs: Any, batch: Any, index: int) -> None:
            finished.add(int(batch[0].shape[0]))  # after backward and the optimizer step

    module = Module()
    with tempfile.TemporaryDirectory() as root, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = pl.Trainer(
            accelerator="gpu",
            devices=1,
            max_epochs=1,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            default_root_dir=root,
        )
        settle()
        start = time.perf_counter()
        answer = Tuner(trainer).scale_batch_size(module, mode="binsearch")
        seconds = time.perf_counter() - start
    ooms = len([n for n in started if n not in finished])  # a size that never finished
    return {"answer": answer, "seconds": seconds, "trials": len(started), "ooms": ooms}


# --------------------------------------------------------------------------- main


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="GPT-2 small only")
    parser.add_argument("--margin", type=float, default=0.02)
    parser.add_argument("--out", default="benchmarks/results/fit.json")
    parser.add_argument("--skip", nargs="*", default=[], help="tools to skip")
    parser.add_argument(
        "--models", nargs="*", choices=["gpt2", "bert", "resnet50"], help="only these models"
    )
    args = parser.parse_args()
    if not CUDA:
        print("benchmarks/fit.py needs a CUDA GPU")
        return
    models = args.models or (["gpt2"] if args.quick else ["gpt2", "bert", "resnet50"])
    rows: list[list[str]] = []
    data: dict[str, Any] = {"margin": args.margin, "models": {}}
    for name in models:
        results: dict[str, Any] = {"cudamem": run_cudamem(name, args.margin)}
        settle()  # each tool's model went with its function's frame
        for tool, fn in (("accelerate", run_accelerate), ("lightning", run_lightning)):
            if tool in args.skip:
                continue
            try:
                results[tool] = fn(name)
                settle()
            except ImportError as exc:
                results[tool] = {"error": f"not installed: {exc}"}
        truth = results["cudamem"]["true_largest"]["largest"]
        within = results["cudamem"]["true_largest"]["largest_within_margin"]
        for tool, r in results.items():
            if "error" in r:
                rows.append([LABELS[name], tool, r["error"], "", "", "", ""])
                continue
            versus = f"{(r['answer'] - truth) / truth:+.1%}"
            peak = ""
            if tool == "cudamem":
                if r["answer_ran"]:
                    peak = f"alloc {r['allocated_error']:+.2%}, reserved {r['reserved_error']:+.2%}"
                else:
                    peak = "the answer ran out of memory"
                versus += f"; {within} within the margin ({(r['answer'] - within) / within:+.1%})"
            rows.append(
                [
                    LABELS[name],
                    tool,
                    f"{r['seconds']:.2f} s",
                    f"{r['trials']} / {r['ooms']}",
                    str(r["answer"]),
                    f"{truth} ({versus})",
                    peak,
                ]
            )
        lightning = results.get("lightning", {})
        if "seconds" in lightning:
            results["speedup_vs_lightning"] = lightning["seconds"] / results["cudamem"]["seconds"]
        data["models"][name] = results
        # each model's figures on disk as soon as they exist (a run cut short keeps them)
        with open(args.out, "w") as fh:
            json.dump({"machine": machine(), **data, "partial": True}, fh, indent=2)
    emit(
        f"Will it fit? largest batch (cudamem margin {args.margin:.0%})",
        [
            "model",
            "tool",
            "time",
            "steps / OOMs",
            "answer",
            "true largest",
            "predicted vs measured",
        ],
        rows,
        data,
        args.out,
    )


if __name__ == "__main__":
    main()

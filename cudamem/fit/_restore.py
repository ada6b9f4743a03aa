"""``cudamem.plan(restore=True)``: the model's and the optimizer's state, and the gradients,
copied to host memory before the probes and loaded back after them."""

from __future__ import annotations

import copy
import time
from typing import Any, NamedTuple

import torch

__all__ = ["Saved", "load_state", "save_state"]


def _to_host(value: Any, counter: list[int]) -> Any:
    if isinstance(value, torch.Tensor):
        counter[0] += value.numel() * value.element_size()
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return type(value)((k, _to_host(v, counter)) for k, v in value.items())
    if isinstance(value, list):
        return [_to_host(v, counter) for v in value]
    if isinstance(value, tuple):
        return tuple(_to_host(v, counter) for v in value)
    return copy.deepcopy(value)


class Saved(NamedTuple):
    """The model's and the optimizer's state and the gradients, copied to host memory;
    the copy's bytes and seconds."""

    model: Any
    optimizer: Any
    grads: list[torch.Tensor | None]
    nbytes: int
    seconds: float


def save_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> Saved:
    """A host copy of ``model``'s and ``optimizer``'s state and of the gradients."""
    start = time.perf_counter()
    counter = [0]
    model_state = _to_host(model.state_dict(), counter)
    opt_state = _to_host(optimizer.state_dict(), counter)
    grads = [None if p.grad is None else _to_host(p.grad, counter) for p in model.parameters()]
    return Saved(model_state, opt_state, grads, counter[0], time.perf_counter() - start)


def load_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, saved: Saved) -> float:
    """Put ``saved`` back into ``model`` and ``optimizer`` (state the probes created that
    ``saved`` lacks goes); the seconds it took."""
    start = time.perf_counter()
    model.load_state_dict(saved.model)
    optimizer.load_state_dict(saved.optimizer)
    if not saved.optimizer.get("state"):
        optimizer.state.clear()  # state the probes created (AdamW's moments) goes too
    with torch.no_grad():
        for p, g in zip(model.parameters(), saved.grads, strict=True):
            p.grad = None if g is None else g.to(p.device)
    return time.perf_counter() - start

"""The bytes a module tree holds in parameters, buffers, gradients and optimizer state.

Each storage counts once, at one module: the first, in ``named_modules()`` order, that owns
a tensor on it (a tied weight, GPT-2's ``lm_head.weight`` is ``transformer.wte.weight``,
counts at ``transformer.wte``; views of one storage count once). A module's figure is its
own storages plus its submodules', so a parent's bytes are the sum of its children's and its
own, and the root's are the model's. A gradient belongs where its parameter does, and an
optimizer's state tensors (``optimizer.state[p]``) where ``p`` does.

Reading walks every parameter: the profile reads these at a few points (the end of the first
backward passes, the first step boundaries, exit), never per module call.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

import torch

__all__ = ["StateBytes", "distinct_bytes", "held_bytes", "state_bytes"]


class StateBytes(NamedTuple):
    """Bytes of one module's subtree, each storage counted once in the whole tree."""

    params: int
    buffers: int
    grads: int
    optimizer: int


def _key(t: torch.Tensor) -> tuple[tuple[str, int], int] | None:
    """A storage's identity (device, address) and bytes; ``None`` without real memory."""
    try:
        st = t.untyped_storage()
        ptr = st.data_ptr()
        nbytes = st.nbytes()
    except Exception:  # meta, fake and wrapper tensors have no memory of their own
        return None
    if ptr == 0 or nbytes == 0:
        return None
    return (str(t.device), ptr), nbytes


def distinct_bytes(tensors: Iterable[Any], seen: set[tuple[str, int]]) -> int:
    """Bytes of the storages behind ``tensors`` not in ``seen`` (their identities, added):
    each storage once, however many tensors view it; non-tensors and storages without
    real memory count 0."""
    total = 0
    for t in tensors:
        if isinstance(t, torch.Tensor):
            found = _key(t)
            if found is not None and found[0] not in seen:
                seen.add(found[0])
                total += found[1]
    return total


def held_bytes(
    model: torch.nn.Module | None,
    optimizers: Sequence[Any],
    device_type: str,
    index: int,
) -> int:
    """Bytes of the distinct storages on one device (``device_type``, ``index``; a device
    without an index, ``cpu``, is index 0) among ``model``'s parameters, buffers and
    gradients and ``optimizers``' parameters, gradients and state tensors: what a training
    step's model and optimizer hold there between steps."""
    tensors: list[Any] = []
    if model is not None:
        params = list(model.parameters())
        tensors += params + list(model.buffers()) + [p.grad for p in params]
    for opt in optimizers:
        for group in opt.param_groups:
            params = list(group["params"])
            tensors += params + [p.grad for p in params]
        for entry in opt.state.values():
            tensors += list(entry.values()) if isinstance(entry, dict) else [entry]
    on_device = [
        t
        for t in tensors
        if isinstance(t, torch.Tensor)
        and t.device.type == device_type
        and (t.device.index or 0) == index
    ]
    return distinct_bytes(on_device, set())


def state_bytes(
    modules: Sequence[tuple[str, torch.nn.Module, str | None]],
    optimizers: Sequence[Any] = (),
) -> dict[str, StateBytes]:
    """``{name: StateBytes}`` over ``modules``: ``(name, module, parent name)`` in
    ``named_modules()`` order (parents before children), subtree totals."""
    seen: dict[str, set[tuple[str, int]]] = {"p": set(), "b": set(), "g": set(), "o": set()}
    own: dict[str, list[int]] = {}
    states = [opt.state for opt in optimizers]
    for name, module, _ in modules:
        params = [p for p in module._parameters.values() if p is not None]
        grads = [p.grad for p in params if p.grad is not None]
        opt: list[Any] = []
        for state in states:
            for p in params:
                entry = state.get(p)
                if entry:
                    opt.extend(entry.values())
        own[name] = [
            distinct_bytes(params, seen["p"]),
            distinct_bytes(module._buffers.values(), seen["b"]),
            distinct_bytes(grads, seen["g"]),
            distinct_bytes(opt, seen["o"]),
        ]
    totals = {name: list(v) for name, v in own.items()}
    for name, _, parent in reversed(modules):  # children before parents
        if parent is not None and parent in totals:
            up, mine = totals[parent], totals[name]
            for i in range(4):
                up[i] += mine[i]
    return {name: StateBytes(*v) for name, v in totals.items()}

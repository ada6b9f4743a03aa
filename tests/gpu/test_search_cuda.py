"""The holder search on a GPU (H200): huge containers of CUDA tensors, and no scan touching
the FakeTensors that torch.compile leaves behind."""

from __future__ import annotations

import gc
import warnings
from typing import Any

import pytest
import torch

import cudamem
from cudamem.holders import census

pytestmark = pytest.mark.cuda

M = __name__
MiB = 1024**2


def _clear(*names: str) -> None:
    for n in names:
        globals().pop(n, None)


def test_20000_references_to_a_cuda_tensor_are_one_holder() -> None:
    global log
    t = torch.ones(MiB // 4, device="cuda")  # 1 MiB
    log = [t] * 20000
    try:
        result = cudamem.who_holds(t, timeout=10.0)
        assert result.complete, result.notes
        (h,) = [h for h in result if not h.caller]
        assert (h.pattern, h.count, h.nbytes, h.device) == (
            f"{M}.log[0..19999]",
            20000,
            MiB,
            "cuda:0",
        )
    finally:
        _clear("log")


def test_census_of_many_cuda_storages_names_each() -> None:
    global pool
    pool = {f"layer{i}": [torch.full((256,), float(i), device="cuda")] for i in range(2000)}
    try:
        c = cudamem.live_tensors("cuda:0", holders=True)
        by_ptr = {s.data_ptr: s for s in c}
        for i, (name, (t,)) in enumerate(pool.items()):
            s = by_ptr[t.untyped_storage().data_ptr()]
            assert s.holders is not None and f"{M}.pool['{name}'][0]" in s.holders.paths, i
    finally:
        _clear("pool")


def test_a_cuda_tensor_100000_lists_deep_gets_its_path() -> None:
    # Reading the path recurses per level nowhere (a RecursionError before).
    global deep
    t = torch.ones(MiB // 4, device="cuda")
    deep = [t]
    for _ in range(100_000):
        deep = [deep]
    try:
        result = cudamem.who_holds(t, max_depth=101_000, timeout=60.0)
        assert result.complete, result.notes
        assert f"{M}.deep" + "[0]" * 100_001 in result.paths
        assert result.holders[0].device == "cuda:0"
    finally:
        _clear("deep")


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_after_torch_compile_on_cuda_no_scan_warns(backend: str) -> None:
    global model, outputs
    model = torch.nn.Sequential(
        torch.nn.Linear(256, 256), torch.nn.GELU(), torch.nn.Linear(256, 256)
    ).cuda()
    opt = torch.optim.AdamW(model.parameters())
    compiled = torch.compile(model, backend=backend)
    x = torch.randn(64, 256, device="cuda")

    def step() -> Any:
        loss = compiled(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    try:
        try:
            for _ in range(3):  # warm-up compiles (FakeTensors are made here)
                step()
        except Exception as exc:  # no triton, or an unsupported setup
            pytest.skip(f"torch.compile({backend!r}) does not run here: {exc!r}")
        outputs = [compiled(x) for _ in range(2)]
        gc.collect()
        from torch._subclasses.fake_tensor import FakeTensor

        fakes = sum(1 for o in gc.get_objects() if type(o) is FakeTensor)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            c = cudamem.live_tensors(holders=True)
            census.live_storage_keys()
            assert f"{M}.model[0].weight" in cudamem.who_holds(model[0].weight).paths
            cudamem.explain()
            cudamem.find_graph_holders()
            for _ in range(3):
                with cudamem.track("compiled-step", leaks=True):
                    step()
        assert all(s.data_ptr != 0 for s in c)
        assert any(s.shape == (256, 256) and s.device == "cuda:0" for s in c)
        del fakes
    finally:
        _clear("model", "outputs")
        torch._dynamo.reset()

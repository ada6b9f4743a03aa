"""The ledger (explain), release() and machine status, rendered from hand-built results."""

from __future__ import annotations

from cudamem.ledger.nvml import DeviceMemory
from cudamem.render.ledger import (
    render_explanation,
    render_kept,
    render_ledger,
    render_machine_status,
    render_release,
)

from ..built import (
    GiB,
    MiB,
    cache_split,
    device_ledger,
    device_release,
    explanation,
    machine_status,
    nvml_device,
    nvml_missing,
    private_pool,
    release_result,
)

LEDGER = [
    "cuda:0 NVIDIA H200: NVML used 2.0 GiB of 140.0 GiB (nvidia-smi shows 1.4 GiB: driver "
    "reserve excluded)",
    "line                                     bytes  basis     freed by",
    "-----------------------------------  ---------  --------  -----------------",
    "driver reserve                       615.0 MiB  measured  the driver",
    "this process (pid 42)                      n/a",
    "  CUDA context                       518.0 MiB  measured  exit",
    "  cache empty_cache() returns         20.0 MiB  measured  cudamem.release()",
    "  live tensors                             n/a  measured  del",
    "other processes                      866.0 MiB",
    "  pid 7 python                       866.0 MiB  measured  pid 7",
    "driver memory outside every process    5.0 MiB  inferred  -",
    "total of the lines                     2.0 GiB",
    "  live tensors: the census could not run",
    "  driver memory outside every process: NVML used minus every other line",
]


def test_ledger_groups_lines_and_keeps_the_difference_last() -> None:
    ledger = device_ledger()
    assert render_ledger(ledger) == str(ledger)
    # A group with an unknown line has an unknown subtotal, never a partial sum.
    assert str(ledger).splitlines() == [*LEDGER, "  note: one note"]


def test_ledger_title_without_nvml() -> None:
    ledger = device_ledger(nvml_used=None, name=None, notes=())
    assert str(ledger).splitlines()[0] == "cuda:0: NVML used n/a"


def test_explanation_joins_devices_and_says_why_nvml_is_missing() -> None:
    e = explanation(device_ledger(notes=()), nvml=nvml_missing(), notes=("process note",))
    assert render_explanation(e) == str(e)
    assert str(e) == "\n".join(
        [*LEDGER, "", "NVML unavailable: nvidia-ml-py is not installed", "", "note: process note"]
    )
    assert str(explanation()) == "nothing to explain"


def test_release_per_device() -> None:
    kept = cache_split(
        pools=(
            private_pool(),
            private_pool(pool_id=(0, 1), kind="cudagraph_tree", graphs=None, allocated=40 * MiB),
        ),
        partial_pages=2 * MiB,
        in_live_segments=3 * MiB,
        stranded=4 * MiB,
        pending_free=5 * MiB,
    )
    second = device_release(
        device=1, remaining=(), cublas_freed=0, nvml_used_before=None, kept=kept
    )
    result = release_result(device_release(), second, notes=("release note",))
    assert render_release(result) == str(result)
    assert str(result).splitlines() == [
        "gc collected 12 objects; cuBLAS workspaces cleared",
        "cuda:0: freed 40.0 MiB of cache (allocated 32.0 MiB freed by gc/cuBLAS, 32.0 MiB of it "
        "cuBLAS workspaces), still allocated 4.0 MiB, still reserved 20.0 MiB",
        "  NVML used 2.0 GiB → 2.0 GiB (-40.0 MiB)",
        "  16.0 MiB stays cached (no allocator snapshot to say why)",
        "  largest remaining",
        "  bytes  storage              held by",
        "-------  -------------------  -------------------------",
        "4.0 MiB  float32[1024, 1024]  __main__.kept; __main__.x",
        "cuda:1: freed 40.0 MiB of cache (allocated 32.0 MiB freed by gc/cuBLAS), still "
        "allocated 4.0 MiB, still reserved 20.0 MiB",
        "  16.0 MiB stays cached:",
        # The full pool (no free byte) gets no line.
        "    32.0 MiB free in private pool (1, 0) (a torch.cuda.graph / CUDAGraph capture, "
        "2 graphs): only deleting its graphs (and their outputs) frees it",
        "    2.0 MiB stays mapped in expandable segments: free parts of pages that also hold "
        "live blocks (whole pages are unmapped: 20 MiB in the large pool, 2 MiB in the small)",
        "    3.0 MiB free inside segments that still hold live blocks (a segment goes back to "
        "CUDA only when all of it is free)",
        "    4.0 MiB on idle streams beside live blocks (cuBLAS workspaces or tensors of those "
        "streams)",
        "    5.0 MiB still awaiting stream events (record_stream)",
        "note: release note",
    ]


def test_kept_is_empty_when_nothing_stays() -> None:
    assert render_kept(cache_split()) == []


def test_release_without_clear() -> None:
    text = str(release_result(cublas_cleared=False, gc_collected=0))
    assert text == "gc collected 0 objects; cuBLAS workspaces not cleared"


def test_machine_status_adds_up_to_nvml_used() -> None:
    status = machine_status(
        nvml_device(),
        nvml_device(index=1, name=None, memory=None, memory_reason="no permission (MIG)"),
        nvml_device(
            index=2,
            processes=None,
            processes_reason="NVML_ERROR_NOT_SUPPORTED",
            memory=DeviceMemory(total=GiB, free=GiB // 2, used=GiB // 2, reserved=None, api="v1"),
        ),
    )
    assert render_machine_status(status) == str(status)
    gpu0, gpu1, gpu2 = str(status).split("\n\n")
    lines = gpu0.splitlines()
    assert lines[0] == (
        "GPU 0 NVIDIA H200: used 2.0 GiB of 140.0 GiB, free 138.0 GiB (nvidia-smi shows 1.4 GiB)"
    )
    # This process first, then the others; the difference is what NVML lists under none.
    assert [line[:48].rstrip() for line in lines[3:]] == [
        "driver reserve                       615.0 MiB",
        "pid 42 python (this process)         560.0 MiB",
        "pid 7 python                         866.0 MiB",
        "driver memory outside every process    7.0 MiB",
        "total (NVML used)                      2.0 GiB",
    ]
    assert gpu1 == "GPU 1: memory n/a (no permission (MIG))"
    assert gpu2.splitlines()[0] == "GPU 2 NVIDIA H200: used 512.0 MiB of 1.0 GiB, free 512.0 MiB"
    assert gpu2.splitlines()[3].startswith("driver reserve                             n/a  ")
    assert gpu2.splitlines()[-1] == "  processes n/a: NVML_ERROR_NOT_SUPPORTED"


def test_machine_status_without_nvml_or_gpus() -> None:
    assert str(machine_status(nvml=nvml_missing())) == (
        "cudamem status: NVML unavailable: nvidia-ml-py is not installed"
    )
    assert str(machine_status()) == "cudamem status: NVML sees no GPU on this machine"

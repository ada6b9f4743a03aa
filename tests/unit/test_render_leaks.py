"""Culprits, growth warnings and leak reports, rendered from hand-built results."""

from __future__ import annotations

from cudamem.render.leaks import render_culprit, render_growth, render_leak_report

from ..built import MiB, culprit, growth, leak_report, leaked

GRAPHS = culprit()
OUTPUTS = culprit(
    "__main__.outputs",
    tensors=1,
    storages=1,
    nbytes=4 * MiB,
    autograd_bytes=1 * MiB,
    example="__main__.outputs[0]",
    device_type="cuda",
)
LOCAL = culprit(
    "train.py:10 in step: local 'acts'",
    tensors=2,
    storages=2,
    nbytes=2 * MiB,
    autograd_bytes=0,
    example="train.py:10 in step: local 'acts'",
)
HIDDEN = culprit(
    "(held by a reference gc cannot see)",
    tensors=1,
    storages=1,
    nbytes=1 * MiB,
    autograd_bytes=0,
    example="(held by a reference gc cannot see)",
)


def test_culprit_says_how_much_goes_through_graphs() -> None:
    assert render_culprit(GRAPHS) == (
        "__main__.loss_history: 10 tensors, 40.0 MiB held through autograd graphs"
    )
    assert str(OUTPUTS) == "__main__.outputs: 1 tensor, 4.0 MiB (1.0 MiB through autograd graphs)"
    assert str(LOCAL) == "train.py:10 in step: local 'acts': 2 tensors, 2.0 MiB"


def test_growth_gives_one_fix_per_kind_of_holder() -> None:
    g = growth(GRAPHS, OUTPUTS, LOCAL, HIDDEN, retained=1 * MiB, notes=("one note",))
    assert render_growth(g) == str(g)
    assert str(g).splitlines() == [
        "train_step retains +4.0 MiB per call (12 calls)",
        "  __main__.loss_history: 10 tensors, 40.0 MiB held through autograd graphs",
        "    e.g. __main__.loss_history[3] → grad_fn MeanBackward0 → saved self",
        "    fix: each item keeps its autograd graph: store loss.item() or log through "
        "cudamem.ScalarLogger instead of the tensor",
        "  __main__.outputs: 1 tensor, 4.0 MiB (1.0 MiB through autograd graphs)",
        "    e.g. __main__.outputs[0]",
        "    fix: a container keeps GPU tensors: keep fewer, or copies on the CPU "
        "(cudamem.to_host / .detach().cpu())",
        "  train.py:10 in step: local 'acts': 2 tensors, 2.0 MiB",
        "    fix: a local variable of a running function keeps it: del it or let the call return",
        "  (held by a reference gc cannot see): 1 tensor, 1.0 MiB",
        "  note: one note",
    ]


def test_a_containers_fix_fits_the_device_its_tensors_are_on() -> None:
    """GPU tensors: copy them to the CPU; CPU tensors: keep less of each (never "copies on
    the CPU" of what is on the CPU already); devices unknown or mixed: no device named."""

    def fix(device_type: str | None) -> str:
        c = culprit("__main__.outputs", autograd_bytes=0, device_type=device_type)
        return str(growth(c)).splitlines()[-1]

    assert fix("cuda") == (
        "    fix: a container keeps GPU tensors: keep fewer, or copies on the CPU "
        "(cudamem.to_host / .detach().cpu())"
    )
    assert fix("cpu") == (
        "    fix: a container keeps CPU tensors: keep fewer, or only what you need of each "
        "(a number: .item(); a part: a slice's .clone())"
    )
    assert fix(None) == (
        "    fix: a container keeps tensors: keep fewer, or only what you need of each"
    )


def test_growth_without_culprits_is_one_line() -> None:
    assert str(growth(calls=1, retained=None)) == "train_step retains +4.0 MiB per call (1 call)"
    assert len(str(growth(GRAPHS, retained=3 * MiB)).splitlines()) == 4


def test_leak_report_table() -> None:
    r = leak_report(
        leaked(8 * MiB, ("__main__.a", "__main__.b")),
        leaked(1024, ()),
        leaked(512, ("x",), shape=(), dtype="int64"),
        count=5,
        nbytes=9 * MiB,
        culprits=(OUTPUTS,),
        notes=("searched 5 storages",),
    )
    assert render_leak_report(r) == str(r)
    assert str(r).splitlines() == [
        "step: 5 storages created inside, 9.0 MiB, alive at exit",
        "  __main__.outputs: 1 tensor, 4.0 MiB (1.0 MiB through autograd graphs)",
        "    bytes  device  tensor              held by",
        "  -------  ------  ------------------  -------------------------------",
        "  8.0 MiB  cuda:0  float32[1024×1024]  __main__.a (+1 more)",
        "  1.0 KiB  cuda:0  float32[1024×1024]  no holder reachable from Python",
        "    512 B  cuda:0  int64[scalar]       x",
        "  ... and 2 smaller",
        "  note: searched 5 storages",
    ]


def test_empty_leak_report_keeps_its_notes() -> None:
    r = leak_report(checked="now", notes=("searched 10 storages",))
    assert not r
    assert str(r).splitlines() == [
        "step: no storage created inside is alive now",
        "  note: searched 10 storages",
    ]


def test_culprit_with_items_and_inner_paths() -> None:
    c = culprit(
        "model.step_outputs",
        tensors=60,
        storages=60,
        nbytes=12 * MiB,
        autograd_bytes=0,
        items=30,
        patterns=("model.step_outputs[*]['preds']", "model.step_outputs[*]['target']"),
        example="model.step_outputs[0]['preds']",
    )
    assert str(c) == "model.step_outputs: 30 items, 60 tensors, 12.0 MiB"
    assert str(leak_report(leaked(MiB, ("model.step_outputs[0]['preds']",)), culprits=(c,))).split(
        "\n"
    )[1:3] == [
        "  model.step_outputs: 30 items, 60 tensors, 12.0 MiB",
        "    as model.step_outputs[*]['preds'], model.step_outputs[*]['target']",
    ]

"""Scalar logger summaries and graph holders, rendered from hand-built results."""

from __future__ import annotations

from cudamem.render.holders import render_graph_holders
from cudamem.render.scalars import render_logger

from ..built import MiB, graph_holder, graph_holders, logger_stats, summary


def test_logger_table() -> None:
    empty = dict(count=0, last=None, mean=None, min=None, max=None, last_step=None)
    text = render_logger([summary(), summary("acc", **empty), summary("grad", nan=3, mean=1e8)])
    assert text.splitlines() == [
        "series  count   last   mean  min  max  NaN",
        "------  -----  -----  -----  ---  ---  ---",
        "loss      100  0.125    0.5  0.1    2    0",
        "acc         0      -      -    -    -    0",
        "grad      100  0.125  1e+08  0.1    2    3",
    ]
    assert render_logger([]) == "ScalarLogger: nothing logged"


def test_summary_one_line() -> None:
    assert str(summary()) == "loss: 100 values, last 0.125 (step 99), mean 0.5, min 0.1, max 2"
    assert str(summary("e", last=None)) == "e: empty"
    # All NaN: no mean, but the NaN count.
    assert str(summary("n", nan=100, mean=None)) == "n: 100 values, last 0.125 (step 99), 100 NaN"


def test_logger_stats_one_line() -> None:
    assert str(logger_stats()) == (
        "130 values logged, 2 transfers, 2 pending; kept 128 (2.0 KiB); buffers: cuda:0 1.0 KiB, "
        "cpu 512 B"
    )
    assert str(logger_stats(transfers=1, buffer_bytes={})) == (
        "130 values logged, 1 transfer, 2 pending; kept 128 (2.0 KiB)"
    )


def test_graph_holders_table_and_notes() -> None:
    two = graph_holder(
        "train.py:3 in f: local 'x'",
        root_kind="frame",
        tensors=1,
        graph_bytes=3 * MiB,
        tensor_bytes=4,
        devices=("cuda:0", "cuda:1"),
        example="train.py:3 in f: local 'x'",
    )
    result = graph_holders(graph_holder(), two, notes=("searched 11 tensors",))
    assert render_graph_holders(result) == str(result)
    assert str(result).splitlines() == [
        "container                   tensors     graph  tensors' own  device          e.g.",
        "--------------------------  -------  --------  ------------  --------------  "
        "--------------------------",
        "__main__.loss_history            10  40.0 MiB          40 B  cuda:0          "
        "__main__.loss_history[3]",
        "train.py:3 in f: local 'x'        1   3.0 MiB           4 B  cuda:0, cuda:1  "
        "train.py:3 in f: local 'x'",
        "searched 11 tensors",
    ]
    assert str(graph_holders()) == "no container holds a tensor with an autograd graph"


def test_graph_holder_one_line() -> None:
    assert str(graph_holder()) == (
        "__main__.loss_history: 10 tensors with graphs keep 40.0 MiB of saved tensors alive "
        "on cuda:0 (e.g. __main__.loss_history[3])"
    )

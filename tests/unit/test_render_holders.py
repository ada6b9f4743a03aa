"""Holders, the live-tensor census and unaccounted bytes, rendered from hand-built results."""

from __future__ import annotations

from cudamem.render.holders import render_census, render_holder, render_holders

from ..built import MiB, census, holder, holders, live_storage, unaccounted


def test_holder_marks() -> None:
    assert render_holder(holder()) == "__main__.saved[0]"
    assert str(holder("__main__.views[1]", via="view")) == "__main__.views[1]  (view)"
    assert str(holder("x.grad", via="grad")) == "x.grad  (.grad)"
    assert str(holder("train.py:3 in f: local 't'", root_kind="frame", caller=True)) == (
        "train.py:3 in f: local 't'  (your own reference)"
    )
    assert str(holder("a.b", root_kind="cycle", via="saved")) == (
        "a.b  (saved by autograd; unreachable cycle, freed by gc.collect())"
    )
    assert str(holder("(unknown)", root_kind="unknown", via="alias")) == (
        "(unknown)  (alias; held by a reference gc cannot see (C code or an unread frame))"
    )
    # An object that is no tensor has no via mark.
    assert str(holder("__main__.box", via="object", nbytes=None, device=None)) == "__main__.box"


def test_holders_header_lines_and_notes() -> None:
    result = holders(
        holder(), holder("__main__.views[1]", via="view"), notes=("stopped at 200000 nodes",)
    )
    assert render_holders(result) == str(result)
    assert str(result).splitlines() == [
        "Tensor float32[1024, 1024] on cuda:0, 4.0 MiB: 2 holders",
        "  __main__.saved[0]",
        "  __main__.views[1]  (view)",
        "  note: stopped at 200000 nodes",
    ]


def test_one_holder_is_singular_and_none_says_so() -> None:
    assert str(holders(holder())).splitlines()[0].endswith(": 1 holder")
    assert str(holders()).splitlines() == [
        "Tensor float32[1024, 1024] on cuda:0, 4.0 MiB: 0 holders",
        "  (nothing found: only the caller's temporaries hold it)",
    ]


def test_census_table() -> None:
    c = census(
        live_storage(8 * MiB, holders=holders(holder(), holder("__main__.b"))),
        live_storage(2 * MiB, shape=(), saved_by_autograd=True, tensors=0, holders=holders()),
        live_storage(512, device="cpu", shape=(128,)),
        notes=("3 objects could not be inspected",),
    )
    assert render_census(c) == str(c)
    assert str(c).splitlines() == [
        "  bytes  device  dtype        shape  tensors  autograd  held by",
        "-------  ------  -------  ---------  -------  --------  ----------------------",
        "8.0 MiB  cuda:0  float32  1024×1024        1            __main__.saved[0] (+1)",
        "2.0 MiB  cuda:0  float32         ()        0  yes       ?",
        "  512 B  cpu     float32        128        1",
        "3 storages: cuda:0 10.0 MiB, cpu 512 B",
        "note: 3 objects could not be inspected",
    ]


def test_census_limit_counts_the_rest() -> None:
    c = census(*(live_storage(MiB * (10 - i)) for i in range(4)))
    lines = render_census(c, limit=2).splitlines()
    assert lines[2:] == [
        "10.0 MiB  cuda:0  float32  1024×1024        1",
        " 9.0 MiB  cuda:0  float32  1024×1024        1",
        "... 2 smaller storages not shown",
        "4 storages: cuda:0 34.0 MiB",
    ]
    assert str(census()) == "no live tensors"


def test_storage_one_line() -> None:
    assert str(live_storage()) == "4.0 MiB float32[1024×1024] on cuda:0"
    assert str(live_storage(4, shape=())) == "4 B float32[scalar] on cuda:0"


def test_unaccounted_table() -> None:
    assert str(unaccounted()).splitlines() == [
        "cuda:0 allocated memory by holder (snapshot)",
        "held by                       bytes",
        "------------------------  ---------",
        "reachable from Python     200.0 MiB",
        "saved by autograd graphs   40.0 MiB",
        "cuBLAS workspaces (1)      32.0 MiB",
        "unknown                    28.0 MiB",
        "allocated                 300.0 MiB",
        "note: memory history was off: no allocation stacks",
    ]

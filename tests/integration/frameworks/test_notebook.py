"""Notebooks, in a real IPython ``InteractiveShell``: ``%load_ext cudamem``, ``%%track``,
``%who_holds`` with IPython's own holders explained, ``%forget``, and ``_repr_html_``."""

from __future__ import annotations

import builtins
import sys
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import cudamem
from cudamem.holders.finder import Holder, Holders
from cudamem.integrations.notebook import classify, explain_holders
from cudamem.render.notebook import holders_html, record_html

from ... import extras
from ...routes import route

IPython = extras.need("IPython")

MiB = 1024**2


@pytest.fixture
def shell() -> Iterator[Any]:
    """A fresh InteractiveShell; what it replaces in this process is put back afterwards."""
    from IPython.core.interactiveshell import InteractiveShell
    from traitlets.config import Config

    saved_main = sys.modules["__main__"]
    saved_hooks = (sys.displayhook, sys.excepthook)
    saved_last = {n: getattr(sys, n, None) for n in ("last_type", "last_value", "last_traceback")}
    saved_builtins = set(vars(builtins))
    config = Config()
    config.HistoryManager.enabled = False
    sh = InteractiveShell.instance(config=config)
    try:
        sh.run_cell("%load_ext cudamem", store_history=True)
        yield sh
    finally:
        sh.reset(new_session=False)
        InteractiveShell.clear_instance()
        sys.modules["__main__"] = saved_main
        sys.displayhook, sys.excepthook = saved_hooks
        for name, value in saved_last.items():
            setattr(sys, name, value)
        for name in set(vars(builtins)) - saved_builtins:
            delattr(builtins, name)


def cell(sh: Any, source: str) -> Any:
    result = sh.run_cell(source, store_history=True)
    return result


def test_track_cell_magic_measures_the_cell_and_keeps_its_value(
    shell: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    cell(shell, "import torch")
    result = cell(shell, "%%track load --leaks\nkept = torch.ones(256, 1024)\nkept.shape[0]")
    assert result.error_in_exec is None
    assert result.result == 256  # the cell's last expression is still its value
    out = capsys.readouterr().out
    # The span, then its leak report naming the cell's new storage.
    assert out.startswith("load: ")
    assert "load: 1 storage created inside, 1.0 MiB, alive at exit" in out
    assert "__main__.kept" in out
    span = cudamem.history().named("load")
    assert len(span) == 1


def test_track_cell_magic_lets_exceptions_through_and_still_shows_the_span(
    shell: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    result = cell(shell, "%%track failing\nraise KeyError('missing batch')")
    assert isinstance(result.error_in_exec, KeyError)
    out = capsys.readouterr().out
    assert "failing:" in out and "raised KeyError" in out


def test_track_rejects_unknown_options(shell: Any, capsys: pytest.CaptureFixture[str]) -> None:
    result = cell(shell, "%%track a b --fast\n1")
    assert result.error_in_exec is not None or result.error_before_exec is not None
    assert "usage: %%track" in capsys.readouterr().err + str(result.error_in_exec)


def test_who_holds_explains_the_output_cache(shell: Any) -> None:
    cell(shell, "import torch\nx = torch.ones(256, 1024)")
    cell(shell, "x")  # the tensor is now Out[n], _ and _n as well
    n = shell.execution_count - 1
    cell(shell, "del x")
    found = cell(shell, f"%who_holds Out[{n}]").result
    kinds = {k.kind: k for k in found.ipython}
    assert "output" in kinds, found
    assert f"Out[{n}]" in kinds["output"].what
    assert kinds["output"].fix == "%forget out"
    assert found.user == ()  # the user deleted x: only IPython keeps it
    assert f"Out[{n}]" in str(found) and "fix: %forget out" in str(found)
    assert "fix: <code>%forget out</code>" in found._repr_html_()
    # The fix works: after it nothing holds the storage.
    ref = torch.multiprocessing.reductions.StorageWeakRef(shell.user_ns["Out"][n].untyped_storage())
    cell(shell, "%forget out")
    assert ref.expired()


def test_who_holds_names_user_variables_first(shell: Any) -> None:
    cell(shell, "import torch\nlosses = [torch.ones(128, 1024) for _ in range(3)]")
    found = cell(shell, "%who_holds losses[1]").result
    assert found.user[0] == "losses[1]"
    assert found.holders.nbytes == 128 * 1024 * 4


#: 511 × 1021 float32: a size no other tensor in the process has.
ODD_BYTES = 511 * 1021 * 4


def test_who_holds_explains_the_last_traceback_and_forget_error_frees_it(shell: Any) -> None:
    cell(
        shell,
        "import torch, weakref\n"
        "def step():\n"
        "    activations = torch.zeros(511, 1021)  # a size no other test's tensor has\n"
        "    raise RuntimeError('CUDA out of memory (simulated)')\n",
    )
    assert isinstance(cell(shell, "step()").error_in_exec, RuntimeError)
    # The failed frame's local is reachable only through the stored traceback.
    census = cudamem.live_tensors("cpu", holders=True)
    big = [s for s in census if s.nbytes == ODD_BYTES]
    assert len(big) == 1 and big[0].holders is not None
    found = explain_holders(big[0].holders)
    kinds = {k.kind: k for k in found.ipython}
    assert "traceback" in kinds, found
    assert any("activations" in p for p in kinds["traceback"].paths)
    assert kinds["traceback"].fix == "%forget error"
    assert found.user == ()
    ptr = big[0].data_ptr
    del census, big, found, kinds
    cell(shell, "%forget error")
    assert all(s.data_ptr != ptr or s.nbytes != ODD_BYTES for s in cudamem.live_tensors("cpu"))


def test_who_holds_usage(shell: Any, capsys: pytest.CaptureFixture[str]) -> None:
    result = cell(shell, "%who_holds")
    assert result.result is None
    assert "usage: %who_holds" in capsys.readouterr().err


def test_repr_html_of_spans_holders_and_ledger(shell: Any) -> None:
    cell(shell, "import cudamem, torch\nt = torch.ones(4)")
    cell(shell, "with cudamem.track('step <1>') as span:\n    pass")
    span = shell.user_ns["span"]
    html = span._repr_html_()
    assert "<b>step &lt;1&gt;</b>" in html  # names are escaped
    assert html == record_html(span.record) == span.record._repr_html_()
    holders = cudamem.who_holds(shell.user_ns["t"])
    assert "__main__.t" in holders._repr_html_()
    assert cudamem.explain()._repr_html_().startswith("<div>")
    # Jupyter's formatter picks them up.
    fmt = shell.display_formatter.formatters["text/html"]
    assert fmt(span) == html


def test_html_escapes_hostile_paths() -> None:
    h = Holder(route("__main__.d", "['<script>alert(1)</script>']"), "__main__", "itself", 4, "cpu")
    html = holders_html(Holders("Tensor float32[1] on cpu", 4, "cpu", (h,)))
    assert "<script>" not in html and "&lt;script&gt;" in html
    # A bidi override in a name cannot reorder what the notebook shows (one escaper for
    # every HTML cudamem writes).
    h = Holder(route("__main__.d", "['key\u202egnp.exe']"), "__main__", "itself", 4, "cpu")
    html = holders_html(Holders("Tensor float32[1] on cpu", 4, "cpu", (h,)))
    assert "\u202e" not in html and "key\\u202egnp.exe" in html


def test_classify_notebook_paths() -> None:
    def kind(*steps: str, root_kind: str = "global", caller: bool = False) -> str:
        path = route(*steps, root_kind=root_kind)
        return classify(Holder(path, "__main__", "itself", 1, "cpu", caller))

    assert kind("Out", "[3]", root_kind="ipython") == "output"
    assert kind("_oh", "[3]", root_kind="ipython") == "output"
    assert kind("_", root_kind="ipython") == "output"
    assert kind("__main__._12") == "output"
    hidden = ("IPython.core.interactiveshell.InteractiveShell", "._instance", ".user_ns_hidden")
    assert kind(*hidden, "['_']") == "output"
    assert kind(*hidden, "['x']") == "ipython"  # IPython's own namespace, not the cache
    assert kind("sys.displayhook", ".shell", ".user_ns_hidden", "['__']") == "output"
    tb = " → cell:3 in f(): local 'x'"
    assert kind("sys.last_traceback", tb, root_kind="traceback") == "traceback"
    assert kind("__main__.exit", "._ip", ".InteractiveTB", ".tb", ".tb_next", tb) == "traceback"
    assert kind("__main__.losses", "[3]") == "user"
    assert kind("__main__._private_cache", "[0]") == "user"  # not an output variable
    assert kind("__main__._ip") == "user"  # a name of the user's, through no IPython object
    assert kind("x", caller=True) == "caller"

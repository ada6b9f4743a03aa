"""Notebooks: ``%load_ext cudamem`` adds ``%%track``, ``%who_holds`` and ``%forget``.

* ``%%track [name] [--leaks] [--no-peak]`` runs the cell inside ``cudamem.track(name)`` and
  shows the span (an HTML table in Jupyter); the cell's last expression is still its output.
  ``--leaks`` also lists the storages the cell created that are still alive, with holders.
* ``%who_holds expr`` evaluates ``expr`` in the notebook and names what keeps it alive, your
  variables first, then what IPython itself keeps, each with its fix:

  - the **output cache**: a cell whose last line was the tensor stored it as ``Out[12]``,
    ``_12`` and ``_``/``__``/``___``; ``%forget out`` clears all of them (IPython's own
    ``%reset -f out`` leaves a hidden copy of ``_``, ``__`` and ``___`` behind);
  - the **last error**: ``sys.last_traceback`` (and IPython's copy for ``%debug``) keeps
    every frame of the failed call and their locals; ``%forget error`` drops it.
* ``%forget [out] [error]`` clears the output cache, the last error, or both.

Spans, holders and the device ledger also render as HTML when they are a cell's value
(``span``, ``cudamem.who_holds(t)``, ``cudamem.explain()``).
"""

from __future__ import annotations

import ast
import gc
import itertools
import re
import shlex
import sys
from typing import TYPE_CHECKING, Any

from ..base.present import present
from ..holders.finder import Holder, Holders, who_holds
from ..holders.holder_path import Step
from ..spans.span import track
from .results import IPythonHold, NotebookHolders

if TYPE_CHECKING:
    from ..spans.span import MemorySpan

__all__ = [
    "IPythonHold",
    "NotebookHolders",
    "explain_holders",
    "forget_error",
    "forget_outputs",
    "load_ipython_extension",
]

_OUT_ROOTS = ("Out", "_oh")
_OUT_VAR = re.compile(r"^(?:__main__\.)?_(\d+)$")
_LAST = ("_", "__", "___")
_OUT_NAME = re.compile(r"^_\d+$")
_IPYTHON_ROOTS = ("IPython.", "ipykernel.", "[thread IPython", "interactiveshell.py:")

#: What IPython keeps a value by, in the order they are listed: what keeps it, and its fix.
_IPYTHON_HOLDS = {
    "output": ("IPython's output cache keeps it", "%forget out"),
    "traceback": (
        "the last error's traceback keeps the failed call's frames (and their locals)",
        "%forget error",
    ),
    "ipython": (
        "IPython's own objects reach it",
        "%forget (the output cache and the last error), or %reset -f (everything)",
    ),
}


def classify(holder: Holder) -> str:
    """``user``, ``output``, ``traceback``, ``ipython`` or ``caller`` for one holder, from its
    path's steps."""
    if holder.caller:
        return "caller"
    route = holder.route
    steps = route.steps
    root = steps[0].text if steps else ""
    attrs = [s.text[1:] for s in steps if s.kind == "attr"]
    if (
        route.root_kind == "traceback"
        or _follows(attrs, "InteractiveTB", "tb")
        or ("last_execution_result" in attrs and "error_in_exec" in attrs)
    ):
        return "traceback"
    if (
        route.root_kind == "ipython"
        or _OUT_VAR.match(root)
        or "displayhook" in attrs
        or root.endswith(".displayhook")
        or _hidden_output(steps)
    ):
        return "output"
    held = route.held
    inner = [s.text[1:] for s in held[1:-1] if s.kind == "attr"]  # followed by another step
    if (
        root.startswith(_IPYTHON_ROOTS)
        or any("get_ipython" in s.text for s in held)
        or "_ip" in inner
        or "InteractiveShell" in inner
        or ".InteractiveShell" in root
    ):
        return "ipython"
    return "user"


def _follows(names: list[str], first: str, then: str) -> bool:
    return any(a == first and b == then for a, b in itertools.pairwise(names))


def _hidden_output(steps: tuple[Step, ...]) -> bool:
    """``user_ns_hidden['_']`` (and ``'__'``, ``'___'``, ``'_oh'``, ``'Out'``): IPython's
    hidden copy of the output cache."""
    return any(
        a.kind == "attr"
        and a.text == ".user_ns_hidden"
        and b.kind == "key"
        and b.text[1:-1].strip("'\"") in (*_LAST, *_OUT_ROOTS)
        for a, b in itertools.pairwise(steps)
    )


def _cell(holder: Holder) -> int | None:
    """The cell number of an ``Out[12]`` (``_oh[12]``) path."""
    steps = holder.route.steps
    if len(steps) > 1 and steps[0].text in _OUT_ROOTS and steps[1].index is not None:
        return steps[1].index
    return None


def explain_holders(holders: Holders) -> NotebookHolders:
    """Split ``holders`` into your own paths and IPython's, each of IPython's with its fix."""
    user: list[str] = []
    kinds: dict[str, list[str]] = {}
    cells: set[int] = set()
    for h in holders:
        kind = classify(h)
        if kind == "caller":
            continue
        if kind == "user":
            user.append(h.route.text_in("__main__"))
        else:
            kinds.setdefault(kind, []).append(h.route.text_in("__main__"))
            cell = _cell(h)
            if cell is not None:
                cells.add(cell)
    held = []
    for kind, (what, fix) in _IPYTHON_HOLDS.items():
        paths = kinds.get(kind)
        if not paths:
            continue
        if kind == "output" and cells:
            what += " as " + ", ".join(f"Out[{n}]" for n in sorted(cells))
        held.append(IPythonHold(kind, what, tuple(paths), fix))
    return NotebookHolders(holders, tuple(user), tuple(held))


def forget_outputs(shell: Any) -> int:
    """Clear IPython's output cache: ``Out``/``_oh``, ``_N``, and ``_``/``__``/``___`` both
    in the namespace and in IPython's hidden copy of them (which ``%reset -f out`` leaves);
    returns the objects gc freed."""
    hook = getattr(shell, "displayhook", None)
    if hook is not None and callable(getattr(hook, "flush", None)):
        hook.flush()
    for ns in (getattr(shell, "user_ns", None), getattr(shell, "user_ns_hidden", None)):
        if isinstance(ns, dict):
            for name in ("_", "__", "___"):
                if name in ns:
                    ns[name] = ""
            for name in [k for k in ns if isinstance(k, str) and _OUT_NAME.match(k)]:
                del ns[name]
    return gc.collect()


def forget_error(shell: Any = None) -> int:
    """Drop the stored traceback of the last error (``sys.last_*`` and IPython's copies)
    so the failed call's frames and their locals can be freed; returns the objects gc freed."""
    for name in ("last_type", "last_value", "last_traceback", "last_exc"):
        if getattr(sys, name, None) is not None:
            setattr(sys, name, None)
    if shell is not None:
        tb = getattr(shell, "InteractiveTB", None)
        if tb is not None and getattr(tb, "tb", None) is not None:
            tb.tb = None
        result = getattr(shell, "last_execution_result", None)
        if result is not None and getattr(result, "error_in_exec", None) is not None:
            result.error_in_exec = None
    return gc.collect()


# --------------------------------------------------------------------------- magics


def _run_cell(shell: Any, cell: str) -> Any:
    """Run ``cell`` in the user namespace; the value of its last expression, like a cell."""
    source = shell.transform_cell(cell)
    tree = shell.transform_ast(shell.compile.ast_parse(source))
    last: ast.Expression | None = None
    if tree.body and isinstance(tree.body[-1], ast.Expr):
        last = ast.Expression(tree.body.pop().value)
    filename = shell.compile.cache(source, shell.execution_count, raw_code=cell)
    ns = shell.user_ns
    exec(compile(tree, filename, "exec"), shell.user_global_ns, ns)
    if last is None:
        return None
    return eval(compile(last, filename, "eval"), shell.user_global_ns, ns)


def _show(shell: Any, span: MemorySpan, *, leaks: bool) -> None:
    from IPython.display import display

    text, html = str(span), present(span, "html")
    if leaks and span.closed:
        text += "\n" + str(span.leaks)
        html += present(span.leaks, "html")
    display({"text/plain": text, "text/html": html}, raw=True)  # type: ignore[no-untyped-call,unused-ignore]


def _track_magic(shell: Any, line: str, cell: str) -> Any:
    from IPython.core.error import UsageError

    try:
        words = shlex.split(line)
    except ValueError as exc:
        raise UsageError(f"%%track: {exc}") from None
    flags = {w for w in words if w.startswith("--")}
    unknown = flags - {"--leaks", "--no-peak"}
    names = [w for w in words if not w.startswith("--")]
    if unknown or len(names) > 1:
        raise UsageError("usage: %%track [name] [--leaks] [--no-peak]")
    name = names[0] if names else f"cell {shell.execution_count}"
    leaks = "--leaks" in flags
    span = track(name, leaks=leaks, peak="--no-peak" not in flags)
    try:
        with span:
            return _run_cell(shell, cell)
    finally:
        _show(shell, span, leaks=leaks)


def _who_holds_magic(shell: Any, line: str) -> NotebookHolders:
    from IPython.core.error import UsageError

    expr = line.strip()
    if not expr:
        raise UsageError("usage: %who_holds EXPRESSION (e.g. %who_holds model.fc.weight)")
    obj = shell.ev(expr)
    try:
        found = who_holds(obj)
    finally:
        del obj
    return explain_holders(found)


def _forget_magic(shell: Any, line: str) -> None:
    from IPython.core.error import UsageError

    what = set(line.split()) or {"out", "error"}
    if what - {"out", "error"}:
        raise UsageError("usage: %forget [out] [error]")
    if "out" in what:
        forget_outputs(shell)
    if "error" in what:
        forget_error(shell)


def load_ipython_extension(ipython: Any) -> None:
    """Register ``%%track``, ``%who_holds`` and ``%forget`` on ``ipython``."""

    def track_cell(line: str, cell: str) -> Any:
        """%%track [name] [--leaks] [--no-peak]: run the cell in a cudamem span, show it."""
        return _track_magic(ipython, line, cell)

    def who_holds_line(line: str) -> NotebookHolders:
        """%who_holds expr: what keeps expr alive, with fixes for IPython's own holders."""
        return _who_holds_magic(ipython, line)

    def forget_line(line: str) -> None:
        """%forget [out] [error]: clear the output cache and/or the last error's traceback."""
        _forget_magic(ipython, line)

    ipython.register_magic_function(track_cell, "cell", "track")
    ipython.register_magic_function(who_holds_line, "line", "who_holds")
    ipython.register_magic_function(forget_line, "line", "forget")

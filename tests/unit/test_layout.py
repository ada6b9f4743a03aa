"""The package's shape: imports run one way, and every result reaches its renderer.

Imports are read from the source (``ast``), all of them: module level, inside functions and
under ``TYPE_CHECKING``. A result that imported its renderer while the renderer imported
the result would be a circle even when one side is lazy or type-only.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

import cudamem
from cudamem.base import present as _present

PACKAGE = Path(cudamem.__file__).resolve().parent


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


MODULES = _modules()


def _imports(name: str, path: Path, source: str | None = None) -> set[str]:
    """cudamem modules ``name`` imports anywhere in its source (``path``'s, or ``source``)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    text = path.read_text(encoding="utf-8") if source is None else source
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name in MODULES)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            for alias in node.names:
                sub = f"{module}.{alias.name}"
                if sub in MODULES:
                    found.add(sub)
                elif module in MODULES:
                    found.add(module)
    found.discard(name)
    return found


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                group = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.append(member)
                    if member == node:
                        break
                if len(group) > 1:
                    out.append(sorted(group))
    return out


def test_the_circle_finder_finds_a_circle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _circles(graph) == [["a", "b", "c"]]


def test_imports_are_read_at_module_level_in_functions_and_for_types() -> None:
    detector = "cudamem.growth.detector"
    assert "cudamem.spans.span" in _imports(detector, MODULES[detector])  # top level
    span = MODULES["cudamem.spans.span"]
    assert "cudamem.spans.leftovers" in _imports("cudamem.spans.span", span)  # types
    assert "cudamem.base.data" in _imports("cudamem.spans.span", span)  # in a function


def test_no_import_circle_not_even_lazy_or_type_only() -> None:
    graph = {name: _imports(name, path) for name, path in MODULES.items()}
    assert _circles(graph) == []


def test_the_reader_build_imports_no_cudamem_module_anywhere() -> None:
    # The reader's build subprocess loads native/reader_build.py by path, where no package
    # exists: any cudamem import in it, even in a function, fails there (the H200 run of
    # 7e81094, when the build loaded _fastread.py).
    source = MODULES["cudamem.native.reader_build"].read_text(encoding="utf-8")
    relative = [
        node.lineno
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.ImportFrom) and node.level
    ]
    assert relative == []
    assert _imports("cudamem.native.reader_build", MODULES["cudamem.native.reader_build"]) == set()


def test_the_layout_reader_sees_the_import_that_broke_the_build() -> None:
    # The rule above can fail: the line that broke the build, in a function too.
    path = MODULES["cudamem.native.reader_build"]
    line = "from ..base.present import present\n"
    assert _imports("cudamem.native.reader_build", path, line) == {"cudamem.base.present"}
    lazy = "def f():\n    import cudamem.spans.span\n"
    assert _imports("cudamem.native.reader_build", path, lazy) == {"cudamem.spans.span"}


def test_results_never_import_a_renderer() -> None:
    # The modules whose results the renderers draw (what cudamem.render imports).
    drawn = set().union(
        *(_imports(n, p) for n, p in MODULES.items() if n.startswith("cudamem.render"))
    )
    drawn = {m for m in drawn if not m.startswith("cudamem.render")}
    offenders = {
        m: sorted(i for i in _imports(m, MODULES[m]) if i.startswith("cudamem.render"))
        for m in drawn
    }
    assert {m: r for m, r in offenders.items() if r} == {}


def test_present_uses_the_nearest_registered_class_and_never_raises() -> None:
    class Base:
        pass

    class Child(Base):
        pass

    class Alone:
        pass

    _present.renders(Base)(lambda obj: f"base renderer for {type(obj).__name__}")
    try:
        assert _present.present(Child()) == "base renderer for Child"
        assert _present.present(Child(), "html").startswith("<")  # no html renderer: repr
        assert _present.present(Alone()).startswith("<") and "Alone object" in _present.present(
            Alone()
        )
    finally:
        del _present._renderers[("text", Base)]


def test_renders_names_a_bad_argument() -> None:
    with pytest.raises(TypeError, match="cls must be a class"):
        _present.renders("Holders")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="fmt must be 'text' or 'html', not 'markdown'"):
        _present.renders(int, "markdown")  # type: ignore[arg-type]


def test_nothing_outside_the_span_machinery_uses_a_spans_private_names() -> None:
    """Detached steps go through the public ``StepSpan`` (``cudamem run``, the trainer
    callbacks, the pytest plugin), not through the span machinery's private functions
    (``cudamem.spans``: its modules share them)."""
    import ast

    private = {"_open", "_close", "_detach", "_detached", "_raw", "_new_span", "_new_raw"}
    offenders = []
    for name, path in _modules().items():
        if name.startswith("cudamem.spans."):
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").endswith("span"):
                offenders += [f"{name}: imports {a.name}" for a in node.names if a.name in private]
            if (
                isinstance(node, ast.Attribute)
                and node.attr in private
                and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))
                # _storages' own _detached
                and not (node.attr == "_detached" and name == "cudamem.holders._storages")
            ):
                offenders.append(f"{name}:{node.lineno}: .{node.attr}")
    assert offenders == []


def _texts_with_plural_s(tree: ast.AST) -> list[str]:
    """The string constants (f-strings' literal parts included) that write a plural as
    ``word(s)`` instead of through ``_format.plural``."""
    found = []
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and re.search(r"[A-Za-z]\(s\)", node.value)
            and ".stream(s)" not in node.value
        ):
            found.append(node.value)
    return found


def test_texts_count_with_plural_never_word_s() -> None:
    found = {
        name: hits
        for name, path in _modules().items()
        if (hits := _texts_with_plural_s(ast.parse(path.read_text(encoding="utf-8"))))
    }
    assert not found, found
    # the reader sees one
    assert _texts_with_plural_s(ast.parse('x = f"{n} stream(s) idle"')) == [" stream(s) idle"]

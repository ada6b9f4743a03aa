"""One home for rendering: every result's text comes from ``cudamem/render/``, through
``cudamem.base.present``, and the renderers load with the first result drawn, not with
``import cudamem``.

Each subprocess test starts a fresh interpreter: in this one the renderers are loaded
already (any earlier test's ``str()`` of a result loads them).
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

import cudamem
from cudamem.allocator.stats import AllocatorStats
from cudamem.base import present as _present
from cudamem.growth.settings import LeakSettings
from cudamem.scalars.series import SeriesSummary

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = Path(cudamem.__file__).resolve().parent

#: ``__str__`` methods that may write their own text, and why.
OWN_TEXT = {
    # A live span, not a result: "open" or "not entered" (its private state), else its
    # record's text, which is present()'s.
    "cudamem.spans.span.MemorySpan.__str__",
    # A path's text is the path itself (holder_path.py's structure), not a rendering.
    "cudamem.holders.holder_path.HolderPath.__str__",
}


def _run(code: str) -> str:
    """``code`` run in a fresh interpreter that imports this checkout's cudamem; its stdout."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


#: Run in a fresh interpreter: importing every cudamem module imports the integrations'
#: frameworks (transformers, lightning, matplotlib: ~250 k objects), and in the test process
#: every later census and holder search would walk them.
_WALK = """
import importlib, inspect, json, pkgutil, textwrap
from pathlib import Path
import cudamem
from cudamem.base import present as _present

PACKAGE = Path(cudamem.__file__).resolve().parent
methods = {}
presented = []
for info in pkgutil.walk_packages(cudamem.__path__, "cudamem."):
    if info.name.startswith(("cudamem.render", "cudamem.demo", "cudamem.base.present")):
        continue  # the renderers, the seeds' front end, the bases that call present()
    try:
        module = importlib.import_module(info.name)
    except ImportError:  # an integration whose framework is not installed
        continue
    for _, cls in inspect.getmembers(module, inspect.isclass):
        if cls.__module__ != module.__name__:
            continue
        # A result that inherits its text (and HTML) from the one base.
        inherited = [
            fmt
            for fmt, method, base in (
                ("text", "__str__", _present.Presented),
                ("html", "_repr_html_", _present.PresentedHtml),
            )
            if issubclass(cls, base) and method not in cls.__dict__
        ]
        for fmt in inherited:
            renderer = _present.renderer_for(cls, fmt)
            presented.append([
                f"{cls.__module__}.{cls.__qualname__}",
                fmt,
                None if renderer is None else renderer.__module__,
            ])
        for method in ("__str__", "_repr_html_", "_repr_markdown_", "__repr__"):
            fn = cls.__dict__.get(method)
            code = getattr(fn, "__code__", None)
            # Not there, or generated (a dataclass's or a named tuple's __repr__).
            if code is None or not Path(code.co_filename).resolve().is_relative_to(PACKAGE):
                continue
            source = textwrap.dedent(inspect.getsource(fn))
            name = f"{cls.__module__}.{cls.__qualname__}"
            methods[f"{name}.{method}"] = source
            fmt = {"__str__": "text", "_repr_html_": "html"}.get(method)
            if fmt is not None and "present(" in source:
                renderer = _present.renderer_for(cls, fmt)  # loads every renderer
                presented.append([name, fmt, None if renderer is None else renderer.__module__])
print(json.dumps({"methods": methods, "presented": presented}))
"""


@functools.cache
def _walk() -> dict[str, Any]:
    """Every cudamem class outside ``render/`` and ``demo/``, from a fresh interpreter:
    ``methods`` maps ``module.Class.method`` to the source written in the class
    (``__str__``, ``_repr_html_``, ``_repr_markdown_``, ``__repr__``); ``presented`` lists
    ``[class, format, renderer's module or None]`` for each that asks ``present``."""
    result: dict[str, Any] = json.loads(_run(_WALK))
    return result


def test_import_cudamem_loads_no_renderer() -> None:
    out = _run(
        """
        import json, sys
        import cudamem
        print(json.dumps(sorted(m for m in sys.modules if m.startswith("cudamem"))))
        """
    )
    loaded = json.loads(out)
    assert "cudamem" in loaded and "cudamem.spans.span" in loaded
    assert [m for m in loaded if m.startswith("cudamem.render")] == []
    # The front ends the renderers import come with them, not with cudamem.
    assert "cudamem.run.runner" not in loaded
    assert not [m for m in loaded if m.startswith("cudamem.distributed")]


def test_the_first_str_of_a_result_loads_the_renderers_and_gives_the_same_text() -> None:
    stats = AllocatorStats(0, 1 << 20, 3 << 20, 0, 0, 5 << 20, 0, 0, 0, 0, 0, 0, 0, 0)
    summary = SeriesSummary("loss", 100, 0, 0.25, 0.5, 0.125, 2.0, 3, 99)
    out = _run(
        """
        import json, sys
        import cudamem
        from cudamem.growth.settings import LeakSettings
        from cudamem.scalars.logger import SeriesSummary
        from cudamem.allocator.stats import AllocatorStats

        before = "cudamem.render" in sys.modules
        texts = [
            str(LeakSettings()),
            str(AllocatorStats(0, 1 << 20, 3 << 20, 0, 0, 5 << 20, 0, 0, 0, 0, 0, 0, 0, 0)),
            str(SeriesSummary("loss", 100, 0, 0.25, 0.5, 0.125, 2.0, 3, 99)),
        ]
        after = sorted(m for m in sys.modules if m.startswith("cudamem.render"))
        print(json.dumps([before, after, texts]))
        """
    )
    before, after, texts = json.loads(out)
    assert before is False
    assert "cudamem.render" in after and "cudamem.render.span" in after
    assert "cudamem.render.html" not in after  # the run report's HTML: `cudamem run --html`
    assert texts == [str(LeakSettings()), str(stats), str(summary)]
    assert texts[1] == "cuda:0: allocated 1.0 MiB, reserved 3.0 MiB, peak 5.0 MiB"


def test_plot_and_render_are_still_attributes_of_cudamem() -> None:
    out = _run(
        """
        import sys
        import cudamem
        names = dir(cudamem)
        assert "plot" in names and "render" in names, names
        assert "cudamem.render" not in sys.modules
        from cudamem import plot
        print(plot.__module__, cudamem.render.__name__, "cudamem.render" in sys.modules)
        """
    )
    assert out.split() == ["cudamem.render.plot", "cudamem.render", "True"]
    with pytest.raises(AttributeError, match="no attribute 'nothing_here'"):
        cudamem.nothing_here


def test_threads_drawing_their_first_results_at_once_all_get_the_full_text() -> None:
    out = _run(
        """
        import threading
        import cudamem
        from cudamem.growth.settings import LeakSettings

        start = threading.Barrier(8)
        texts = []

        def draw() -> None:
            start.wait()
            texts.append(str(LeakSettings()))

        threads = [threading.Thread(target=draw) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        print(len(set(texts)), len(texts), texts[0])
        """
    )
    assert out.split(maxsplit=2) == ["1", "8", str(LeakSettings()) + "\n"]


def test_present_never_raises_when_the_renderers_cannot_be_imported() -> None:
    out = _run(
        """
        import cudamem
        from cudamem.base import present as _present
        from cudamem.growth.settings import LeakSettings

        _present._RENDERERS = "cudamem.no_such_package"
        text = str(LeakSettings())
        assert text.startswith("<cudamem.growth.settings.LeakSettings object at "), text
        assert _present.present(LeakSettings(), "html").startswith("<cudamem.growth.settings.")
        print("ok")
        """
    )
    assert out.strip() == "ok"


@pytest.mark.parametrize("fmt", ["text", "html"])
def test_present_never_raises_for_an_object_without_a_renderer(fmt: str) -> None:
    class Unknown:
        pass

    for obj in (Unknown(), object(), 3, None, "text"):
        text = _present.present(obj, fmt)  # type: ignore[arg-type]
        assert text == object.__repr__(obj)


def test_every_str_and_html_of_a_cudamem_class_goes_through_present() -> None:
    # A new result whose __str__ writes its own text fails here: its body belongs in a
    # renderer under cudamem/render/ registered with @renders.
    own = [
        name
        for name, source in _walk()["methods"].items()
        if name.endswith((".__str__", "._repr_html_", "._repr_markdown_"))
        and name not in OWN_TEXT
        and "present(" not in source
    ]
    assert own == []


def test_every_repr_is_a_debugging_form_not_a_result_text() -> None:
    # Text is str()'s (a renderer's); a __repr__ written by hand is ``<Type ...>``.
    bad = [
        name.removesuffix(".__repr__")
        for name, source in _walk()["methods"].items()
        if name.endswith(".__repr__") and 'return f"<' not in source
    ]
    assert bad == []


def test_every_presented_result_has_a_renderer_once_render_is_imported() -> None:
    presented = _walk()["presented"]
    assert len(presented) >= 40  # the walk finds them
    assert [f"{c} ({fmt})" for c, fmt, module in presented if module is None] == []
    # ... and each renderer lives in render/.
    elsewhere = {
        f"{c}: {module}"
        for c, _fmt, module in presented
        if module is not None and not module.startswith("cudamem.render.")
    }
    assert elsewhere == set()


def test_only_present_and_the_package_face_import_render_by_name() -> None:
    # base/present.py imports cudamem.render by name (the one arrow up, at run time, that the
    # layout test cannot see); no other module below render/ may do the same.
    import ast

    allowed = {PACKAGE / "base" / "present.py", PACKAGE / "__init__.py"}
    found = set()
    for path in PACKAGE.rglob("*.py"):
        if path.is_relative_to(PACKAGE / "render") or path in allowed:
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        docstrings = {
            id(node.body[0].value)
            for node in ast.walk(tree)
            if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
            and node.body
            and isinstance(node.body[0], ast.Expr)
        }
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Constant)
                and isinstance(node.value, str)
                and node.value.startswith("cudamem.render")
                and id(node) not in docstrings
            ):
                found.add(str(path.relative_to(PACKAGE)))
    assert found == set()

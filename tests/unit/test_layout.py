"""The package's shape, where imports cannot say it.

The import rules (the layers between capabilities, no circle, results never importing a
renderer, pynvml only in the NVML seam) are import-linter contracts in ``pyproject.toml``,
checked by ``lint-imports`` in ``.ci/run``. What they cannot express is here: attribute use
(``torch.cuda`` only in the allocator's backend seam), the root's size, package faces that
hide their modules, and the reader's build module that must stand alone.
"""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest
import tomllib

import cudamem
from cudamem.base import present as _present

PACKAGE = Path(cudamem.__file__).resolve().parent
ROOT = PACKAGE.parent


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


MODULES = _modules()

#: The modules of the allocator's backend seam: the only ones that touch ``torch.cuda``
#: (the demo's seed 001 scripts are user code, run in processes of their own).
TORCH_CUDA_ALLOWED = {
    "cudamem.allocator.backend",
    "cudamem.allocator.backend_base",
    "cudamem.allocator.torch_backend",
    "cudamem.demo.seed001_runs",
}


def _torch_cuda_uses(source: str) -> list[int]:
    """Lines of ``source`` that touch ``torch.cuda``: the attribute or an import of it."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if (
            (
                isinstance(node, ast.Attribute)
                and node.attr == "cuda"
                and isinstance(node.value, ast.Name)
                and node.value.id == "torch"
            )
            or (
                isinstance(node, ast.ImportFrom)
                and (
                    (node.module or "").startswith("torch.cuda")
                    or (node.module == "torch" and any(a.name == "cuda" for a in node.names))
                )
            )
            or (
                isinstance(node, ast.Import)
                and any(a.name.startswith("torch.cuda") for a in node.names)
            )
        ):
            lines.append(node.lineno)
    return lines


def test_torch_cuda_only_in_the_backend_seam() -> None:
    offenders = {
        name: lines
        for name, path in MODULES.items()
        if name not in TORCH_CUDA_ALLOWED
        and (lines := _torch_cuda_uses(path.read_text(encoding="utf-8")))
    }
    assert offenders == {}


def test_the_torch_cuda_reader_sees_each_form() -> None:
    source = (
        "import torch\nimport torch.cuda\nfrom torch.cuda import Stream\n"
        "from torch import cuda\nx = torch.cuda.memory_allocated()\ny = 'torch.cuda'\n"
    )
    assert _torch_cuda_uses(source) == [2, 3, 4, 5]


def test_the_root_holds_packages_and_at_most_five_modules() -> None:
    modules = {p.stem for p in PACKAGE.glob("*.py")}
    assert len(modules) <= 5, sorted(modules)
    assert {"__init__", "__main__"} <= modules


def _hidden_submodules() -> list[str]:
    """``package.name`` where a package's attribute ``name`` is not its submodule ``name``
    (a function or value bound over it: ``cudamem.leaks`` was one)."""
    hidden = []
    for init in sorted(PACKAGE.rglob("__init__.py")):
        package = init.parent
        name = ".".join(package.relative_to(PACKAGE.parent).parts)
        module = importlib.import_module(name)
        subs = {p.stem for p in package.glob("*.py") if p.stem != "__init__"}
        subs |= {d.name for d in package.iterdir() if (d / "__init__.py").is_file()}
        for sub in sorted(subs):
            value = getattr(module, sub, None)
            if value is not None and getattr(value, "__name__", None) != f"{name}.{sub}":
                hidden.append(f"{name}.{sub}")
    return hidden


def test_no_package_binds_a_name_over_one_of_its_modules() -> None:
    # A submodule not imported yet is no attribute of its package unless something else is
    # bound there: importing the packages is enough (the frameworks stay unimported).
    assert _hidden_submodules() == []


def test_the_contracts_name_every_capability_package() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    contracts = {c["id"]: c for c in config["tool"]["importlinter"]["contracts"]}
    assert set(contracts) >= {"layers", "no-circles", "results-not-renderers", "nvml-seam"}
    layered = {
        part.strip(" ()")
        for layer in contracts["layers"]["layers"]
        for part in re.split(r"[|:]", layer)
    }
    packages = {d.name for d in PACKAGE.iterdir() if (d / "__init__.py").is_file()}
    assert packages <= layered, sorted(packages - layered)
    assert {"spans", "native"} <= layered


def _reader_build_module() -> Path:
    """The module the reader's build subprocess loads by path."""
    return PACKAGE / "native" / "reader_build.py"


def _cudamem_imports(source: str) -> list[str]:
    """Every import of cudamem in ``source``, relative ones included, anywhere in it."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and (
            node.level or (node.module or "").split(".")[0] == "cudamem"
        ):
            found.append("." * node.level + (node.module or ""))
        elif isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.split(".")[0] == "cudamem"]
    return found


def test_the_reader_build_module_imports_no_cudamem_module_anywhere() -> None:
    # The reader's build subprocess loads it by path, where no package exists: any cudamem
    # import in it, even in a function, fails there (the H200 run of 7e81094).
    assert _cudamem_imports(_reader_build_module().read_text(encoding="utf-8")) == []


def test_the_import_reader_sees_the_import_that_broke_the_build() -> None:
    # The rule above can fail: the line that broke the build, in a function too.
    assert _cudamem_imports("from .base.present import present\n") == [".base.present"]
    assert _cudamem_imports("def f():\n    import cudamem.spans\n") == ["cudamem.spans"]


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

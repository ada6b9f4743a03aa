"""Tests that need an optional framework skip without it, naming the extra that installs it.

``need("transformers")`` returns the module, or skips the test (or the whole file, at module
level) with ``needs transformers: pip install 'cudamem[transformers]'``. ``EXTRA`` is the one
table from an importable module to the extra of ``pyproject.toml`` that installs it
(``tests/unit/test_readme_commands.py`` checks it against ``pyproject.toml``).
"""

from __future__ import annotations

import importlib.util
from types import ModuleType

import pytest

#: module -> the smallest extra of pyproject.toml that installs it
EXTRA = {
    "accelerate": "transformers",
    "IPython": "notebook",
    "lightning": "lightning",
    "matplotlib": "plot",
    "transformers": "transformers",
}


def reason(module: str) -> str:
    """The skip reason for a missing ``module``: what to install."""
    top = module.split(".")[0]
    return f"needs {top}: pip install 'cudamem[{EXTRA[top]}]'"


def missing(module: str) -> bool:
    """Whether ``module``'s top-level package cannot be imported here."""
    return importlib.util.find_spec(module.split(".")[0]) is None


def need(module: str) -> ModuleType:
    """``module`` imported, or a skip naming the extra that installs it."""
    return pytest.importorskip(module, reason=reason(module))

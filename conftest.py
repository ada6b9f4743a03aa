"""Collects every code block of README.md and docs/ as tests (``tests/docblocks.py``, Sybil).

Without sybil (``pip install -e '.[test]'`` installs it) a run that names test files works as
before; one that collects a page fails at that page, saying what to install."""

from __future__ import annotations

from pathlib import Path

import pytest

try:
    from tests import docblocks
except ModuleNotFoundError as exc:
    if exc.name != "sybil":
        raise
    docblocks = None  # type: ignore[assignment]


class _NoSybil(pytest.File):
    def collect(self) -> list[pytest.Item]:
        raise pytest.UsageError(
            f"{self.path.name}: its code blocks run as tests through sybil, which is not "
            "installed: pip install -e '.[test]'"
        )


def pytest_collect_file(file_path: Path, parent: pytest.Collector) -> pytest.Collector | None:
    if docblocks is not None:
        return docblocks.SYBIL.pytest()(file_path, parent)  # type: ignore[no-any-return]
    here = Path(__file__).resolve().parent
    page = file_path.resolve()
    if page.suffix == ".md" and (page == here / "README.md" or here / "docs" in page.parents):
        return _NoSybil.from_parent(parent, path=file_path)
    return None


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if docblocks is not None:
        docblocks.mark_items(items)

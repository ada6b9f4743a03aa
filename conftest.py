"""Collects every code block of README.md and docs/ as tests (``tests/docblocks.py``)."""

from __future__ import annotations

import pytest

from tests import docblocks

pytest_collect_file = docblocks.SYBIL.pytest()


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    docblocks.mark_items(items)

"""A test module's globals, for tests whose holders must be module attributes."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import Any


class Globals:
    """A module's globals by name, without holding the module's dict (a frame holding the
    dict would be a holder of everything in it): only the module's name is kept."""

    def __init__(self, module: str) -> None:
        self.module = module

    def __setitem__(self, name: str, value: Any) -> None:
        vars(sys.modules[self.module])[name] = value

    def __getitem__(self, name: str) -> Any:
        return vars(sys.modules[self.module])[name]

    def pop(self, name: str) -> Any:
        return vars(sys.modules[self.module]).pop(name)


def added_globals(module: str) -> Iterator[Globals]:
    """A fixture's body: ``module``'s globals for one test; every name the test adds is
    removed afterwards."""
    before = set(vars(sys.modules[module]))
    yield Globals(module)
    for name in set(vars(sys.modules[module])) - before:
        del vars(sys.modules[module])[name]

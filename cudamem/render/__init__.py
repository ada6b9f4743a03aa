"""Renderers: results in, strings out. Nothing here collects data or prints.

Each module registers its renderers for the result types it draws
(``cudamem._present.renders``); importing this package registers them all, and
``import cudamem`` does that. Results reach them through ``cudamem._present.present``
and never import a renderer.
"""

from . import (
    diff,
    distributed,
    history,
    holders,
    integrations,
    leaks,
    ledger,
    memviz,
    notebook,
    oom,
    reader,
    report,
    scalars,
    span,
)

__all__ = [
    "diff",
    "distributed",
    "history",
    "holders",
    "integrations",
    "leaks",
    "ledger",
    "memviz",
    "notebook",
    "oom",
    "reader",
    "report",
    "scalars",
    "span",
]

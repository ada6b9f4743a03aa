"""Renderers: results in, strings out. Nothing here collects data or prints.

Each module registers its renderers for the result types it draws
(``cudamem.base.present.renders``); importing this package registers them all. ``import cudamem``
does not: the first ``cudamem.base.present.present`` of a process (the first ``str()`` of a
result) imports this package. Results reach their renderers only through ``present`` and
never import one.
"""

from . import (
    diff,
    distributed,
    fragmentation,
    history,
    holders,
    host,
    integrations,
    leaks,
    ledger,
    memviz,
    modules,
    notebook,
    oom,
    plan,
    reader,
    report,
    scalars,
    span,
)

__all__ = [
    "diff",
    "distributed",
    "fragmentation",
    "history",
    "holders",
    "host",
    "integrations",
    "leaks",
    "ledger",
    "memviz",
    "modules",
    "notebook",
    "oom",
    "plan",
    "reader",
    "report",
    "scalars",
    "span",
]

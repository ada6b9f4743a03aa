"""Text rendering of which counter reader serves spans, and which compiled extensions serve
(``cudamem status``, ``build-reader``)."""

from __future__ import annotations

from ..base.present import renders
from ..native.states import ExtensionStatus, ReaderStatus

__all__ = ["render_extension_status", "render_reader_status"]

_NAMES = {
    "C++": "C++ counter reader (three integers a read)",
    "dict": "dict (torch._C._cuda_memoryStats: every counter's dict a read)",
}


@renders(ReaderStatus)
def render_reader_status(status: ReaderStatus) -> str:
    """One line: ``reader: <which> [<state>]: <why>``."""
    if status.state == "cached":
        # Seen from a process that never started CUDA: the build exists and spans will use it.
        which = "C++ counter reader, once CUDA starts"
    else:
        which = _NAMES[status.reader]
    return f"reader: {which} [{status.state}]: {status.reason}"


@renders(ExtensionStatus)
def render_extension_status(status: ExtensionStatus) -> str:
    """One line: ``span core: compiled [active]: <why>`` (or ``Python``, and why)."""
    which = "compiled" if status.active else "Python"
    return f"{status.name}: {which} [{status.state}]: {status.reason}"

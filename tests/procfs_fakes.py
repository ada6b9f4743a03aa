"""A fake ``/proc`` at the ``_procfs`` seam: per-pid files as text, or the error reading them
raises (``PermissionError``, ``FileNotFoundError``)."""

from __future__ import annotations

from cudamem.host.procfs import ProcFS

MiB = 1024**2


def rollup(rss: int, pss: int, uss: int, *, swap: int = 0) -> str:
    """An ``smaps_rollup`` text (kB lines) with these figures in bytes (USS all dirty)."""
    kb = 1024
    return (
        "00400000-7ffd59415000 ---p 00000000 00:00 0                          [rollup]\n"
        f"Rss:            {rss // kb} kB\nPss:            {pss // kb} kB\n"
        f"Pss_Dirty:      {pss // kb} kB\nShared_Clean:   {(rss - uss) // kb} kB\n"
        "Shared_Dirty:          0 kB\nPrivate_Clean:         0 kB\n"
        f"Private_Dirty:  {uss // kb} kB\nSwap:           {swap // kb} kB\n"
        "SwapPss:               0 kB\nLocked:                0 kB\n"
    )


def stat(pid: int, minflt: int, state: str = "S", comm: str = "pt_data_worker") -> str:
    """A ``/proc/<pid>/stat`` line; ``comm`` may hold spaces and parentheses."""
    return f"{pid} ({comm}) {state} 1 {pid} {pid} 0 -1 4194560 {minflt} 0 0 0 5 3 0 0 20 0 1 0"


class FakeProc(ProcFS):
    """``files[(pid, name)]``: the text, or an exception instance to raise."""

    def __init__(self, files: dict[tuple[int, str], str | Exception] | None = None) -> None:
        super().__init__("/fake/proc")
        self.files: dict[tuple[int, str], str | Exception] = dict(files or {})
        self.has_proc = True
        self.reads: list[tuple[int, str]] = []

    def available(self) -> bool:
        return self.has_proc

    def read(self, pid: int, name: str) -> str:
        self.reads.append((pid, name))
        value = self.files.get((pid, name))
        if value is None:
            raise FileNotFoundError(f"/fake/proc/{pid}/{name}")
        if isinstance(value, Exception):
            raise value
        return value

    def set(self, pid: int, *, uss: int, pss: int, rss: int, minflt: int) -> None:
        """A live process with these figures (bytes) and fault count."""
        self.files[(pid, "smaps_rollup")] = rollup(rss, pss, uss)
        self.files[(pid, "stat")] = stat(pid, minflt)

    def exit(self, pid: int) -> None:
        """The process is gone: every file of it disappears."""
        for key in [k for k in self.files if k[0] == pid]:
            del self.files[key]

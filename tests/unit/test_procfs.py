"""Reading a process's RSS/PSS/USS from a fake ``/proc``: the figures, and a plain answer
for every way it can fail."""

from __future__ import annotations

from cudamem.host import procfs as _procfs
from tests.procfs_fakes import FakeProc, MiB, rollup, stat

SMAPS_TWO_MAPPINGS = """\
00400000-00452000 r-xp 00000000 08:02 173521      /usr/bin/python3
Size:                328 kB
Rss:                 300 kB
Pss:                 100 kB
Private_Clean:        40 kB
Private_Dirty:         0 kB
Swap:                  0 kB
7f0000000000-7f0000100000 rw-p 00000000 00:00 0
Size:               1024 kB
Rss:                1024 kB
Pss:                 612 kB
Private_Clean:         0 kB
Private_Dirty:       200 kB
Swap:                 16 kB
"""


def test_rollup_gives_rss_pss_and_uss_in_bytes() -> None:
    fake = FakeProc({(7, "smaps_rollup"): rollup(812 * MiB, 426 * MiB, 232 * MiB, swap=MiB)})
    with _procfs.use(fake):
        m = _procfs.read_memory(7)
    assert (m.pid, m.rss, m.pss, m.uss, m.swap) == (7, 812 * MiB, 426 * MiB, 232 * MiB, MiB)
    assert m.measured and m.reason == ""
    assert str(m) == "pid 7: RSS 812.0 MiB, PSS 426.0 MiB, USS 232.0 MiB, swapped 1.0 MiB"


def test_uss_counts_clean_and_dirty_private_pages_and_huge_pages() -> None:
    text = "Rss: 100 kB\nPss: 50 kB\nPrivate_Clean: 8 kB\nPrivate_Dirty: 16 kB\n"
    text += "Private_Hugetlb: 2048 kB\nShared_Clean: 76 kB\n"
    with _procfs.use(FakeProc({(3, "smaps_rollup"): text})):
        assert _procfs.read_memory(3).uss == (8 + 16 + 2048) * 1024


def test_a_kernel_without_smaps_rollup_sums_smaps() -> None:
    fake = FakeProc({(9, "smaps"): SMAPS_TWO_MAPPINGS, (9, "stat"): stat(9, 0)})
    with _procfs.use(fake):
        m = _procfs.read_memory(9)
    assert (m.rss, m.pss, m.uss, m.swap) == (1324 * 1024, 712 * 1024, 240 * 1024, 16 * 1024)
    assert fake.reads[0] == (9, "smaps_rollup")


def test_an_exited_process_says_so() -> None:
    with _procfs.use(FakeProc()):
        m = _procfs.read_memory(4242)
    assert (m.rss, m.pss, m.uss) == (None, None, None)
    assert m.reason == "pid 4242 has exited"
    assert str(m) == "pid 4242: pid 4242 has exited"


def test_a_zombie_with_an_empty_smaps_has_exited() -> None:
    fake = FakeProc({(5, "smaps_rollup"): "", (5, "stat"): stat(5, 10, state="Z")})
    with _procfs.use(fake):
        assert _procfs.read_memory(5).reason == "pid 5 has exited"
        assert _procfs.read_faults(5) is None


def test_permission_denied_names_the_file_and_what_to_do() -> None:
    fake = FakeProc({(1, "smaps_rollup"): PermissionError(13, "Permission denied")})
    with _procfs.use(fake):
        m = _procfs.read_memory(1)
    assert m.uss is None and not m.measured
    assert m.reason.startswith("permission denied reading /proc/1/smaps_rollup")
    assert "run as that user" in m.reason


def test_no_proc_at_all_is_not_measured_with_the_reason() -> None:
    fake = FakeProc()
    fake.has_proc = False
    with _procfs.use(fake):
        m = _procfs.read_memory(1)
    assert m.rss is None and m.reason.startswith("not measured: no /proc on this system")
    assert fake.reads == []


def test_other_os_errors_are_a_reason_not_an_exception() -> None:
    fake = FakeProc({(2, "smaps_rollup"): OSError(5, "Input/output error")})
    with _procfs.use(fake):
        assert _procfs.read_memory(2).reason.startswith("cannot read /proc/2:")


def test_garbage_lines_are_ignored() -> None:
    text = "Rss: lots kB\nPss: 10 MB\nPrivate_Dirty 5 kB\nRss: 12 kB\nnonsense\n"
    assert _procfs.parse_rollup(text) == {"Rss": 12 * 1024}


def test_faults_are_read_after_the_command_name_whatever_it_holds() -> None:
    fake = FakeProc({(8, "stat"): stat(8, 123456, comm="a) (b c) 9")})
    with _procfs.use(fake):
        assert _procfs.read_faults(8) == 123456
        assert _procfs.read_faults(99) is None


def test_this_process_is_measured_on_linux() -> None:
    m = _procfs.read_memory()
    assert m.measured, m.reason
    assert m.rss is not None and m.pss is not None and m.uss is not None
    assert 0 < m.uss <= m.pss <= m.rss

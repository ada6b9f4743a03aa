"""The test files of ``tests/own_process.py``, each in a pytest process of its own.

Their holder searches walk whatever pytest holds: in a process that collected the whole
suite that is 5 to 15 times the work of the same file collected alone. Every test of the
file runs and the file passes only if all of them do; its output names each failure."""

from __future__ import annotations

from pathlib import Path

import pytest

from ..own_process import ENV, FILES, run_pytest


@pytest.mark.parametrize("name", FILES, ids=[Path(f).name for f in FILES])
def test_file_in_its_own_process(name: str, request: pytest.FixtureRequest) -> None:
    seed = request.config.getoption("--shuffle")
    shuffle = [] if seed is None else ["--shuffle", str(seed)]
    returncode, tail = run_pytest(name, "-rfEs", *shuffle, env={ENV: "1"})
    assert returncode == 0, tail
    assert " passed" in tail, tail
    print(tail)

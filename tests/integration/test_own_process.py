"""The test files of ``tests/own_process.py``, each in a pytest process of its own.

Their holder searches walk whatever pytest holds: in a process that collected the whole
suite that is 5 to 15 times the work of the same file collected alone. Every test of the
file runs and the file passes only if all of them do; its output names each failure."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from ..own_process import ENV, FILES, ROOT


@pytest.mark.parametrize("name", FILES, ids=[Path(f).name for f in FILES])
def test_file_in_its_own_process(name: str, request: pytest.FixtureRequest) -> None:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        ENV: "1",
    }
    env.pop("PYTEST_XDIST_WORKER", None)
    seed = request.config.getoption("--shuffle")
    shuffle = [] if seed is None else ["--shuffle", str(seed)]
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-rfEs",
            "-p",
            "no:cacheprovider",
            "-p",
            "no:xdist",
            *shuffle,
            name,
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
        check=False,
    )
    tail = (out.stdout + out.stderr)[-6000:]
    assert out.returncode == 0, tail
    assert " passed" in out.stdout.splitlines()[-1], tail
    print(tail)

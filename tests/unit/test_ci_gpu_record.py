"""``.ci/gpu``'s record (``.ci/gpu_record.py``) on the CPU: the tree id names cudamem/ as git
does, pytest's counts are read right, and ``check`` tells a verified tree from a changed one."""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _record_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_record", ROOT / ".ci" / "gpu_record.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


rec = _record_module()


def test_tree_id_is_gits_tree_id_of_cudamem(tmp_path: Path) -> None:
    if shutil.which("git") is None:
        pytest.skip("no git")
    # A copy of cudamem/ committed in a scratch repository: git's own tree id must match.
    repo = tmp_path / "repo"
    shutil.copytree(
        ROOT / "cudamem", repo / "cudamem", ignore=shutil.ignore_patterns("__pycache__", "*.pyc")
    )
    (repo / "cudamem" / "__pycache__").mkdir()  # ignored by the id, as by git here
    (repo / "cudamem" / "__pycache__" / "x.pyc").write_bytes(b"\0")

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", "-c", "user.name=t", "-c", "user.email=t@t", *args],
            cwd=repo,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()

    git("init", "-q")
    (repo / ".gitignore").write_text("__pycache__/\n")
    git("add", "-A")
    git("commit", "-qm", "x")
    assert rec.tree_id(repo / "cudamem") == git("rev-parse", "HEAD:cudamem")
    (repo / "cudamem" / "span.py").write_text("changed\n")
    assert rec.tree_id(repo / "cudamem") != git("rev-parse", "HEAD:cudamem")


def test_counts_read_pytests_last_line() -> None:
    log = "....s.F\n\n31 passed, 1 skipped, 2 failed, 4 errors, 3 warnings in 52.10s\n"
    assert rec.counts(log) == {
        "passed": 31,
        "skipped": 1,
        "failed": 2,
        "errors": 4,
        "warnings": 3,
    }
    assert rec.counts("1 error in 0.2s") == {"errors": 1}
    assert rec.counts("") == {}


def _logs(tmp_path: Path, rc: int, state: str, core: str = "active") -> Path:
    logs = tmp_path / "logs"
    logs.mkdir(parents=True)
    tree = rec.tree()
    (logs / "tree.json").write_text(json.dumps(tree))
    for name in rec.GROUPS:
        (logs / f"{name}.rc").write_text(f"{rc} 12")
        (logs / f"{name}.log").write_text("..\n10 passed, 1 skipped in 3.00s\n")
    status = {"reader": {"state": state, "active": False}, "span_core": {"state": core}}
    (logs / "status.json").write_text(json.dumps(status))
    return logs


def test_write_then_check_a_verified_tree(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    record = tmp_path / "gpu-verified.json"
    logs = _logs(tmp_path, 0, "cached")
    (logs / "card.txt").write_text("NVIDIA H100 80GB HBM3, 580.159.04, 81559 MiB\n")
    assert rec.write(logs, record) == 0
    data = json.loads(record.read_text())
    assert data["card"] == {
        "name": "NVIDIA H100 80GB HBM3",
        "driver": "580.159.04",
        "memory": "81559 MiB",
    }
    assert data["groups"]["ledger"] == {"rc": 0, "seconds": 12, "passed": 10, "skipped": 1}
    assert data["cudamem_tree"] == rec.tree_id(ROOT / "cudamem") and data["passed"] is True
    capsys.readouterr()
    assert rec.check(record) == 0
    assert "on NVIDIA H100 80GB HBM3" in capsys.readouterr().out


def test_a_failed_group_a_dict_reader_or_python_spans_are_not_verified(tmp_path: Path) -> None:
    record = tmp_path / "a.json"
    assert rec.write(_logs(tmp_path / "a", 1, "active"), record) == 1
    assert json.loads(record.read_text())["passed"] is False
    assert rec.check(record) == 1
    other = tmp_path / "b.json"
    assert rec.write(_logs(tmp_path / "b", 0, "failed"), other) == 1
    # A span core that did not build or failed its check: spans ran in Python.
    third = tmp_path / "c.json"
    assert rec.write(_logs(tmp_path / "c", 0, "active", core="failed"), third) == 1
    assert json.loads(third.read_text())["span_core"] == {"state": "failed"}


def test_check_says_when_cudamem_changed_since_the_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    record = tmp_path / "gpu-verified.json"
    record.write_text(json.dumps({"cudamem_tree": "0" * 40, "commit": "abc", "passed": True}))
    assert rec.check(record) == 1
    assert "NOT GPU-verified" in capsys.readouterr().out
    assert rec.check(tmp_path / "missing.json") == 1


def test_ci_gpu_refuses_without_a_gpu(tmp_path: Path) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is here: .ci/gpu would run")
    done = subprocess.run(
        ["bash", str(ROOT / ".ci" / "gpu"), str(tmp_path)],
        capture_output=True,
        text=True,
        env={"PYTHON": sys.executable, "PATH": "/usr/bin:/bin"},
        timeout=120,
    )
    assert done.returncode == 2 and "needs a CUDA GPU" in done.stderr


def test_the_callers_commit_wins_over_a_copys_stale_git(monkeypatch: pytest.MonkeyPatch) -> None:
    # A device's copy of the tree carries the landed snapshot's .git: its HEAD is not the
    # commit whose files run there (the H200 run of a8c527d recorded 7e81094, unclean).
    monkeypatch.setenv("GPU_COMMIT", "f" * 40)
    monkeypatch.setenv("GPU_TREE_CLEAN", "1")
    assert rec.tree()["commit"] == "f" * 40 and rec.tree()["clean"] is True
    monkeypatch.setenv("GPU_TREE_CLEAN", "0")
    assert rec.tree()["clean"] is False


def test_the_record_knows_every_group_and_benchmark_that_ci_gpu_runs() -> None:
    """A group .ci/gpu runs but the record does not list would never be checked."""
    import re

    script = (ROOT / ".ci" / "gpu").read_text()
    groups = re.findall(r"^\s*(?:\S+=\S+\s+\\?\s*)?group ([\w-]+) \d+", script, re.M)
    groups += re.findall(r"^\s*group ([\w-]+) \d+", script, re.M)
    benches = re.findall(r"^\s*bench ([\w-]+) \d+", script, re.M)
    assert set(groups) == set(rec.GROUPS)
    assert set(benches) == set(rec.BENCHES)
    # every pytest file a group names exists
    for path in re.findall(r"tests/[\w/]+\.py", script):
        assert (ROOT / path).is_file(), path


def _fake_device(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    """A copy of the repository's ``.ci/`` and ``cudamem/`` with a Python that says a GPU is
    there and passes every pytest group, and an ``nvidia-smi`` that names a card."""
    repo = tmp_path / "repo"
    shutil.copytree(ROOT / ".ci", repo / ".ci")
    shutil.copytree(
        ROOT / "cudamem", repo / "cudamem", ignore=shutil.ignore_patterns("__pycache__", "*.so")
    )
    (repo / "benchmarks" / "results").mkdir(parents=True)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    python = bin_dir / "python"
    python.write_text(
        "#!/bin/bash\n"
        'case "$*" in\n'
        f'  *gpu_record.py*) exec {sys.executable} "$@" ;;\n'
        '  *"-m pytest"*) echo "3 passed in 1.00s" ;;\n'
        "esac\n"
        "exit 0\n"
    )
    smi = bin_dir / "nvidia-smi"
    smi.write_text("#!/bin/bash\necho 'Fake H100 80GB HBM3, 580.1, 81559 MiB'\n")
    for f in (python, smi):
        f.chmod(0o755)
    env = {"PYTHON": str(python), "PATH": f"{bin_dir}:/usr/bin:/bin", "GPU_COMMIT": "f" * 40}
    return repo, env


def _ci_gpu(repo: Path, out: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(repo / ".ci" / "gpu"), str(out)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )


def test_ci_gpu_in_two_parts_writes_one_record_of_every_group(tmp_path: Path) -> None:
    repo, env = _fake_device(tmp_path)
    keep = tmp_path / "keep"
    env = {**env, "CI_GPU_KEEP": str(keep)}
    first = _ci_gpu(repo, tmp_path / "out1", {**env, "CI_GPU_PART": "1"})
    assert first.returncode == 0, first.stderr
    kept = {p.stem for p in (keep / "logs").glob("*.rc")}
    assert {"plan", "trust", "docs", "modules", "build_reader"} <= kept
    assert not kept & {"ledger", "expandable-ledger", "span_overhead"}  # part 2's
    assert not (repo / "benchmarks" / "results" / "gpu-verified.json").exists()
    # what comes back from the device: the summary and the logs packed, not 26 loose files
    out1 = sorted(p.name for p in (tmp_path / "out1").iterdir())
    assert out1 == ["logs.tar.gz", "summary.txt"]
    with tarfile.open(tmp_path / "out1" / "logs.tar.gz") as packed:
        assert "logs/plan.rc" in packed.getnames() and "logs/trust.rc" in packed.getnames()

    second = _ci_gpu(repo, tmp_path / "out2", {**env, "CI_GPU_PART": "2"})
    assert second.returncode in (0, 1), second.stderr  # the fake reader is not active
    record = json.loads((repo / "benchmarks" / "results" / "gpu-verified.json").read_text())
    assert record["card"]["name"] == "Fake H100 80GB HBM3"
    groups = record["groups"]
    for name in ("plan", "trust", "docs", "ledger", "expandable-ledger"):
        assert groups[name]["rc"] == 0 and groups[name]["passed"] == 3, name
    assert record["cudamem_tree"] == rec.tree_id(repo / "cudamem")
    out2 = sorted(p.name for p in (tmp_path / "out2").iterdir())
    assert out2 == ["gpu-verified.json", "results.tar.gz", "summary.txt"]


def test_ci_gpu_part_2_without_part_1_refuses(tmp_path: Path) -> None:
    repo, env = _fake_device(tmp_path)
    env = {**env, "CI_GPU_KEEP": str(tmp_path / "nothing"), "CI_GPU_PART": "2"}
    done = _ci_gpu(repo, tmp_path / "out", env)
    assert done.returncode == 2 and "part 2 found no part 1" in done.stderr
    assert not (repo / "benchmarks" / "results" / "gpu-verified.json").exists()

"""The command line end to end, in subprocesses, on the CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from cudamem.render.json import SCHEMA

ROOT = Path(__file__).resolve().parents[2]


def cudamem(
    *args: str,
    cwd: Path | None = None,
    timeout: float = 180,
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    full_env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1", **(env or {}))
    return subprocess.run(
        [sys.executable, "-m", "cudamem", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=full_env,
        cwd=cwd,
    )


def failed_checks(stdout: str) -> list[str]:
    """The failed checks of ``cudamem demo --json``'s document, each with its experiment and
    detail (the document's tail shows only the last experiments, which may all have
    passed: the GPU suite once failed on a check no log showed)."""
    try:
        experiments = json.loads(stdout)["experiments"]
    except (ValueError, KeyError):
        return [f"no JSON document: {stdout[-2000:]}"]
    return [
        f"{r['key']}: {c['name']}: {c['detail']}"
        for r in experiments
        for c in r["checks"]
        if not c["passed"]
    ]


def test_failed_checks_are_named_with_their_experiment() -> None:
    doc = {
        "experiments": [
            {"key": "a", "checks": [{"name": "ok", "passed": True, "detail": ""}]},
            {"key": "b", "checks": [{"name": "ran", "passed": False, "detail": "ImportError"}]},
        ]
    }
    assert failed_checks(json.dumps(doc)) == ["b: ran: ImportError"]
    assert failed_checks("Traceback (most recent call last)")[0].startswith("no JSON document")


def write(tmp_path: Path, name: str, code: str) -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(code))
    return path


LEAKY = """
    import sys
    import torch

    print("argv", sys.argv[1:], __name__)
    loss_history = []
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(8):
        x = torch.randn(256, 64)
        loss = torch.sigmoid(model(x) * 2).mean()
        opt.zero_grad()
        loss_history.append(loss)
        opt.step()
    del x, loss
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message")
def test_demo_without_gpu_exits_0_and_says_so() -> None:
    out = cudamem("demo")
    assert out.returncode == 0, out.stderr
    assert "no CUDA GPU" in out.stderr
    assert "SKIP: needs a CUDA GPU" in out.stdout
    assert "FAIL" not in out.stdout


def test_demo_json() -> None:
    out = cudamem("demo", "--json")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["schema"] == SCHEMA
    assert data["experiments"]
    assert {"key", "title", "checks", "skipped"} <= set(data["experiments"][0])


def test_run_names_the_holder_and_keeps_argv(tmp_path: Path) -> None:
    script = write(tmp_path, "leaky.py", LEAKY)
    out = cudamem("run", str(script), "--lr", "3")
    assert out.returncode == 0, out.stderr
    assert "argv ['--lr', '3'] __main__" in out.stdout
    assert "training steps seen (optimizer.step() calls): 8" in out.stderr
    assert "__main__.loss_history[" in out.stderr
    assert "storages still alive at exit" in out.stderr


def test_run_json_report(tmp_path: Path) -> None:
    script = write(tmp_path, "leaky.py", LEAKY)
    report = tmp_path / "report.json"
    out = cudamem("run", "--json", str(report), str(script))
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("argv [] __main__")  # stdout is the script's alone
    assert "{" not in out.stdout
    data = json.loads(report.read_text(encoding="utf-8"))
    assert data["kind"] == "cudamem.run" and data["schema"] == 1
    assert data["exit_code"] == 0
    assert data["steps"] == 8
    paths = [
        h["path"] for s in data["live"]["storages"] for h in (s["holders"] or {}).get("holders", [])
    ]
    assert any(p.startswith("__main__.loss_history[") for p in paths), paths
    assert data["history"]["stats"][0]["name"] == "training step"
    assert data["history"]["stats"][0]["calls"] == 7  # the steps between 8 optimizer steps
    assert data["groups"][0]["holder"] == "__main__.loss_history"
    assert data["unlisted"]["storages"] >= 1 and data["unlisted"]["nbytes"] > 0


def test_run_script_that_raises(tmp_path: Path) -> None:
    script = write(
        tmp_path,
        "boom.py",
        """
        def inner():
            raise ValueError("bad batch 7")

        inner()
        """,
    )
    out = cudamem("run", str(script))
    assert out.returncode == 1
    assert "Traceback (most recent call last)" in out.stderr
    assert 'boom.py", line 3, in inner' in out.stderr
    assert "ValueError: bad batch 7" in out.stderr
    assert "cudamem/run/runner.py" not in out.stderr  # cudamem's own frames are cut
    assert "raised ValueError (bad batch 7)" in out.stderr


def test_run_keeps_exit_codes(tmp_path: Path) -> None:
    assert cudamem("run", str(write(tmp_path, "a.py", "import sys; sys.exit(3)"))).returncode == 3
    out = cudamem("run", str(write(tmp_path, "b.py", "import sys; sys.exit('bye')")))
    assert out.returncode == 1 and "bye" in out.stderr
    assert out.stderr.splitlines()[0] == "bye"  # the message first, as Python prints it
    assert "exit code 1 after" in out.stderr
    assert cudamem("run", str(write(tmp_path, "c.py", "raise SystemExit"))).returncode == 0


def test_run_missing_script_and_bad_syntax(tmp_path: Path) -> None:
    out = cudamem("run", str(tmp_path / "nope.py"))
    assert out.returncode == 2
    assert "no such script" in out.stderr
    out = cudamem("run", str(write(tmp_path, "bad.py", "def (:\n")))
    assert out.returncode == 2
    assert "SyntaxError" in out.stderr
    out = cudamem("run", str(tmp_path))
    assert out.returncode == 2 and "directory" in out.stderr


def test_run_html_escapes_hostile_names(tmp_path: Path) -> None:
    script = write(
        tmp_path,
        "hostile.py",
        """
        import torch, cudamem
        store = {"<img src=x onerror=alert(1)>": torch.ones(1000)}
        with cudamem.track("<script>alert('span')</script>"):
            pass
        raise RuntimeError("<b>not bold</b>")
        """,
    )
    html_path = tmp_path / "report.html"
    out = cudamem("run", "--html", str(html_path), str(script))
    assert out.returncode == 1
    page = html_path.read_text()
    assert page.startswith("<!DOCTYPE html>")
    assert "<script>" not in page and "<img src=x" not in page and "<b>not bold" not in page
    assert "&lt;img src=x onerror=alert(1)&gt;" in page
    assert "&lt;script&gt;alert(&#x27;span&#x27;)&lt;/script&gt;" in page
    assert "&lt;b&gt;not bold&lt;/b&gt;" in page
    assert "http://" not in page.replace('xmlns="http://www.w3.org/2000/svg"', "")


def test_unknown_command() -> None:
    out = cudamem("frobnicate")
    assert out.returncode == 2
    assert "invalid choice" in out.stderr


# --------------------------------------------------------------------------- arguments


def test_run_without_a_script_says_what_to_give() -> None:
    out = cudamem("run")
    assert out.returncode == 2
    assert "usage: cudamem run" in out.stderr
    assert "name the script to run: cudamem run script.py" in out.stderr
    assert "-m module" in out.stderr
    assert "required: script, args" not in out.stderr


def test_top_level_unknown_option_is_named() -> None:
    out = cudamem("--bogus")
    assert out.returncode == 2
    assert "unrecognized arguments: --bogus" in out.stderr
    out = cudamem()
    assert out.returncode == 2
    assert "choose a command: demo, run, status or build-reader" in out.stderr


def test_run_unknown_option_prints_runs_usage(tmp_path: Path) -> None:
    script = write(tmp_path, "x.py", "print('ran')")
    out = cudamem("run", "--bogus", str(script))
    assert out.returncode == 2
    assert out.stderr.startswith("usage: cudamem run ")
    assert "cudamem run: error: unrecognized arguments: --bogus" in out.stderr
    assert "ran" not in out.stdout
    out = cudamem("run", "--js", "r.json", str(script))  # no abbreviations of --json
    assert out.returncode == 2 and "unrecognized arguments: --js" in out.stderr


@pytest.mark.parametrize("value", ["-5", "abc", "1.5"])
def test_run_top_must_be_a_non_negative_int(tmp_path: Path, value: str) -> None:
    script = write(tmp_path, "x.py", "print('ran')")
    out = cudamem("run", "--top", value, str(script))
    assert out.returncode == 2
    assert "argument --top" in out.stderr and value in out.stderr
    assert "ran" not in out.stdout


def test_run_passes_the_scripts_own_arguments_untouched(tmp_path: Path) -> None:
    script = write(tmp_path, "args.py", "import sys; print(sys.argv[1:])")
    words = ["--lr", "3", "--json", "x", "--top", "-5", "-m", "y", "--", "-h", "--bogus"]
    out = cudamem("run", "--top", "2", str(script), *words)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == repr(words)
    assert not (tmp_path / "x").exists()  # --json after the script was the script's
    # "--" lets a script whose name starts with "-" be named
    dashed = write(tmp_path, "-dash.py", "print('dash ran')")
    out = cudamem("run", "--", dashed.name, "a", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "dash ran"


def test_run_help_and_report_file_checks(tmp_path: Path) -> None:
    out = cudamem("run", "--help")
    assert out.returncode == 0
    assert "-m module" in out.stdout and "--json FILE" in out.stdout
    script = write(tmp_path, "x.py", "print('ran')")
    # the old flag form would have overwritten the script with JSON
    out = cudamem("run", "--json", str(script))
    assert out.returncode == 2 and "would overwrite a Python file" in out.stderr
    assert script.read_text() == "print('ran')"
    out = cudamem("run", "--html", str(tmp_path / "no" / "such" / "r.html"), str(script))
    assert out.returncode == 2 and "does not exist" in out.stderr
    assert "ran" not in out.stdout  # refused before the script ran


def test_demo_only_rejects_unknown_keys_and_help_lists_them() -> None:
    from cudamem.demo import experiments

    keys = [k for k, _ in experiments()]
    out = cudamem("demo", "--only", "bogus")
    assert out.returncode == 2
    assert "invalid choice: 'bogus'" in out.stderr
    assert all(k in out.stderr for k in keys)
    assert "checks passed" not in out.stdout
    out = cudamem("demo", "--help")
    assert out.returncode == 0
    assert all(k in out.stdout for k in keys)


def test_demo_only_runs_the_named_experiment() -> None:
    out = cudamem("demo", "--json", "--only", "census")
    assert out.returncode == 0, out.stderr
    assert [r["key"] for r in json.loads(out.stdout)["experiments"]] == ["census"]


def test_run_demo_validates_only() -> None:
    from cudamem.demo import run_demo

    with pytest.raises(ValueError, match=r"only: unknown experiment key 'bogus'; valid keys: "):
        run_demo(only=["bogus"])
    with pytest.raises(TypeError, match="only"):
        run_demo(only="census")


def test_status_without_a_gpu_builds_nothing(tmp_path: Path) -> None:
    """On a machine without a CUDA GPU `status` compiles no C extension and prints no cache
    path: it says which path serves and that it builds nothing there."""
    out = cudamem("status", env={"CUDA_VISIBLE_DEVICES": "", "CUDAMEM_CACHE_DIR": str(tmp_path)})
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    why = "status builds nothing on a machine without a CUDA GPU"
    core = next(line for line in lines if line.startswith("span core: "))
    heap = next(line for line in lines if line.startswith("heap pass: "))
    assert core.startswith("span core: Python [idle]: ") and core.endswith(why)
    assert heap.startswith("heap pass: Python [idle]: ") and heap.endswith(why)
    assert str(tmp_path) not in out.stdout and ".so)" not in out.stdout  # no build's path
    assert not [p for p in tmp_path.rglob("*") if p.is_file()]  # nothing built or cached


def test_status_pid_reads_a_process_and_its_children_from_proc() -> None:
    out = cudamem("status", "--pid", str(os.getpid()), env={"CUDA_VISIBLE_DEVICES": ""})
    assert out.returncode == 0, out.stderr
    table = out.stdout[out.stdout.index("host memory") :].split("\n\n")[0].splitlines()
    assert table[1].split() == ["process", "RSS", "PSS", "USS", "note"]  # every column named
    assert table[3].startswith(f"pid {os.getpid()} ")  # this pytest process: the command's parent
    bad = cudamem("status", "--pid", "0")
    assert bad.returncode == 2
    assert "argument --pid: a process id is a positive integer, not '0'" in bad.stderr

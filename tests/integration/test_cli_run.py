"""``cudamem run`` as ``python`` runs a script, and its report, in subprocesses on the CPU."""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import pytest

from .test_cli import cudamem, write

#: Hide any GPU: these tests are about a run that has no CUDA device to measure.
NO_GPU = {"CUDA_VISIBLE_DEVICES": ""}


def test_file_is_absolute_and_argv0_as_typed(tmp_path: Path) -> None:
    write(
        tmp_path, "where.py", "import sys; print(__file__); print(sys.argv[0]); print(sys.path[0])"
    )
    out = cudamem("run", "where.py", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    file, argv0, path0 = out.stdout.splitlines()
    assert file == str(tmp_path / "where.py")  # what `python where.py` gives
    assert argv0 == "where.py"
    assert path0 == str(tmp_path)


def test_traceback_names_the_absolute_file(tmp_path: Path) -> None:
    write(tmp_path, "boom.py", "raise KeyError('k')\n")
    out = cudamem("run", "boom.py", cwd=tmp_path)
    assert out.returncode == 1
    assert f'File "{tmp_path / "boom.py"}", line 1, in <module>' in out.stderr


def test_the_scripts_traceback_comes_before_cudamems_lines(tmp_path: Path) -> None:
    """As `python boom.py` would print it, first; cudamem's progress line and report after."""
    write(tmp_path, "boom.py", "raise KeyError('k')\n")
    out = cudamem("run", "boom.py", cwd=tmp_path, env=NO_GPU)
    assert out.returncode == 1
    lines = out.stderr.splitlines()
    assert lines[0] == "Traceback (most recent call last):"
    assert lines.index("KeyError: 'k'") < lines.index(
        "[cudamem] collecting the report (census, holders, ledger) ..."
    )
    assert out.stderr.count("Traceback (most recent call last):") == 1


ADAM = """
import torch
model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.ReLU(), torch.nn.Linear(512, 8))
opt = torch.optim.Adam(model.parameters())
for _ in range(3):
    model(torch.randn(4, 512)).sum().backward()
    opt.step()
    opt.zero_grad()
"""


def test_an_optimizers_state_is_one_row_and_the_step_count_is_explained(tmp_path: Path) -> None:
    """Adam's exp_avg / exp_avg_sq of every parameter: one row, the optimizer's `state`, not a
    row per key; 3 optimizer.step() calls make 2 `training step` spans, and the report says
    why the two counts differ."""
    script = write(tmp_path, "adam.py", ADAM)
    out = cudamem("run", "--top", "6", str(script), env=NO_GPU)
    assert out.returncode == 0, out.stderr
    rows = [re.split(r"\s{2,}", line.strip()) for line in _table(out.stderr)[2:-1]]
    state = [r for r in rows if ".state" in r[0]]
    assert [r[:3] for r in state] == [["__main__.opt.state", "4", "2.0 MiB"]], rows
    assert state[0][-1] in (
        "__main__.opt.state[<model[0].weight>]['exp_avg']",
        "__main__.opt.state[<model[0].weight>]['exp_avg_sq']",
    )
    assert (
        "training steps seen (optimizer.step() calls): 3; the 'training step' span runs from "
        "one call to the next: 2 spans"
    ) in out.stderr.splitlines()
    assert re.search(r"^training step +2 ", out.stderr, re.M)


@pytest.mark.parametrize(
    ("code", "expected", "message"),
    [
        ("sys.exit(True)", 1, None),
        ("sys.exit(False)", 0, None),
        ("sys.exit(0)", 0, None),
        ("sys.exit(7)", 7, None),
        ("sys.exit('no data')", 1, "no data"),
        ("sys.exit(None)", 0, None),
    ],
)
def test_exit_codes_as_python_gives_them(
    tmp_path: Path, code: str, expected: int, message: str | None
) -> None:
    script = write(tmp_path, "exits.py", f"import sys\n{code}\n")
    out = cudamem("run", str(script))
    assert out.returncode == expected
    assert f"exit code {expected} after" in out.stderr
    assert "exit code True" not in out.stderr and "exit code False" not in out.stderr
    if message is not None:
        assert out.stderr.splitlines()[0] == message


def test_relative_report_paths_resolve_at_launch(tmp_path: Path) -> None:
    (tmp_path / "elsewhere").mkdir()
    write(
        tmp_path,
        "moves.py",
        """
        import os
        os.chdir("elsewhere")
        print("moved")
        """,
    )
    out = cudamem("run", "--html", "r.html", "--json", "r.json", "moves.py", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "r.html").read_text(encoding="utf-8").startswith("<!DOCTYPE html>")
    assert json.loads((tmp_path / "r.json").read_text(encoding="utf-8"))["exit_code"] == 0
    assert not list((tmp_path / "elsewhere").iterdir())
    assert f"wrote {tmp_path / 'r.html'}" in out.stderr


@pytest.mark.skipif(sys.platform != "linux", reason="needs a file system that takes any bytes")
def test_non_utf8_script_name(tmp_path: Path) -> None:
    import subprocess

    name = b"caf\xe9.py"  # Latin-1 "café.py": not UTF-8
    with open(os.path.join(os.fsencode(tmp_path), name), "wb") as fh:
        fh.write(b"print('ran')\n")
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    out = subprocess.run(
        [sys.executable, "-m", "cudamem", "run", "--html", "r.html", "--json", "r.json", name],
        cwd=tmp_path,
        capture_output=True,
        timeout=180,
        env=env,
    )
    err = out.stderr.decode("utf-8", "replace")
    assert out.returncode == 0, err
    assert out.stdout == b"ran\n"
    assert "UnicodeEncodeError" not in err
    page = (tmp_path / "r.html").read_text(encoding="utf-8")
    assert "caf\\udce9.py" in page  # shown escaped, not dropped
    data = json.loads((tmp_path / "r.json").read_text(encoding="utf-8"))
    assert os.fsencode(data["script"]) == name  # the JSON round-trips the exact name
    assert "== cudamem run: caf\\udce9.py" in err


def test_run_module_like_python_m(tmp_path: Path) -> None:
    pkg = tmp_path / "mypkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    show = "import sys; print(__name__, __spec__.name, __file__, sys.argv, sys.path[0])\n"
    (pkg / "__main__.py").write_text(show)
    (pkg / "tool.py").write_text(show + "import torch\nkept = [torch.ones(1000)]\n")
    out = cudamem("run", "-m", "mypkg.tool", "--lr", "3", "-m", "x", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    tool = str(pkg / "tool.py")
    assert (
        out.stdout.strip()
        == f"__main__ mypkg.tool {tool} {[tool, '--lr', '3', '-m', 'x']} {tmp_path}"
    )
    assert "== cudamem run: -m mypkg.tool --lr 3 -m x" in out.stderr
    assert "__main__.kept" in out.stderr  # holders read through the module's __main__
    out = cudamem("run", "-m", "mypkg", "a", cwd=tmp_path)  # a package runs its __main__
    main = str(pkg / "__main__.py")
    assert out.stdout.strip() == f"__main__ mypkg.__main__ {main} {[main, 'a']} {tmp_path}"


def test_run_module_errors(tmp_path: Path) -> None:
    out = cudamem("run", "-m", "no_such_module_here", cwd=tmp_path)
    assert out.returncode == 2
    assert "cudamem run: no module named no_such_module_here" in out.stderr
    pkg = tmp_path / "bare"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    out = cudamem("run", "-m", "bare", cwd=tmp_path)
    assert (
        out.returncode == 2 and "'bare' is a package and cannot be directly executed" in out.stderr
    )
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "__init__.py").write_text("raise RuntimeError('init failed')\n")
    out = cudamem("run", "-m", "broken.sub", cwd=tmp_path)
    assert out.returncode == 2
    assert "cannot run -m broken.sub: RuntimeError: init failed" in out.stderr
    out = cudamem("run", "-m")
    assert out.returncode == 2 and "argument -m: expected one argument" in out.stderr


# --------------------------------------------------------------------------- the report


GROUPS = """
    import torch

    big = torch.ones(512, 1024, requires_grad=True)     # 2 MiB, named directly
    outs = [(big * big).sum() for _ in range(3)]         # graphs that save `big`
    kept = [torch.zeros(256 * 1024) for _ in range(3)]  # 3 × 1 MiB in one list
    one = torch.zeros(128 * 1024)                        # 512 KiB
"""


def _table(stderr: str) -> list[str]:
    lines = stderr.splitlines()
    start = lines.index("storages still alive at exit, by holder (largest first):")
    end = next(i for i in range(start, len(lines)) if "listed" in lines[i])
    return lines[start + 1 : end + 1]


def test_storage_table_groups_by_container(tmp_path: Path) -> None:
    script = write(tmp_path, "groups.py", GROUPS)
    report = tmp_path / "r.json"
    out = cudamem("run", "--top", "5", "--json", str(report), str(script))
    assert out.returncode == 0, out.stderr
    table = _table(out.stderr)
    assert table[0].split() == ["held", "by", "storages", "bytes", "via", "autograd", "e.g."]
    rows = [re.split(r"\s{2,}", line.strip()) for line in table[2:-1]]
    # one row per container, largest first; `big` by its own name, not through `outs`' graphs
    assert rows[0][:3] == ["__main__.kept", "3", "3.0 MiB"]
    assert rows[0][3] == "__main__.kept[0]"
    assert rows[1][:3] == ["__main__.big", "1", "2.0 MiB"]
    assert rows[2][:3] == ["__main__.one", "1", "512.0 KiB"]
    assert not any(r[0] == "__main__.outs" and "MiB" in r[2] for r in rows)
    assert re.fullmatch(
        r"5 storages listed \(cpu 5\.5 MiB\); "
        r"\d+ smaller storages? \(\d+(\.\d)? (B|KiB)\) not listed",
        table[-1],
    ), table[-1]
    assert " bytes)" not in out.stderr  # never a raw byte count
    data = json.loads(report.read_text(encoding="utf-8"))
    assert [g["holder"] for g in data["groups"][:3]] == [
        "__main__.kept",
        "__main__.big",
        "__main__.one",
    ]
    assert data["groups"][1]["autograd_bytes"] == 0


def test_storage_table_singular(tmp_path: Path) -> None:
    script = write(tmp_path, "groups.py", GROUPS)
    out = cudamem("run", "--top", "1", str(script))
    assert out.returncode == 0, out.stderr
    last = _table(out.stderr)[-1]
    assert last.startswith("1 storage listed (cpu 2.0 MiB); ")
    assert "storages listed" not in last
    out = cudamem("run", "--top", "0", str(script))
    assert out.returncode == 0, out.stderr
    assert re.search(
        r"no storage listed; \d+ smaller storages \(5\.\d MiB\) not listed", out.stderr
    )


LEAKS_ON_CPU = """
    import torch

    loss_history = []
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(20):
        loss = torch.sigmoid(model(torch.randn(256, 64)) * 2).mean()
        opt.zero_grad()
        loss.backward(retain_graph=True)
        opt.step()
        loss_history.append(loss)      # leaks its graph every step
"""


def test_without_a_gpu_leaks_are_not_reported_as_none(tmp_path: Path) -> None:
    script = write(tmp_path, "leaks.py", LEAKS_ON_CPU)
    html = tmp_path / "r.html"
    out = cudamem("run", "--html", str(html), str(script), env=NO_GPU)
    assert out.returncode == 0, out.stderr
    assert "leak warnings: none" not in out.stderr
    assert (
        "leak warnings: not measured: growth detection needs a CUDA device "
        "(this machine has none)" in out.stderr
    )
    assert "(spans measure CUDA memory: without a CUDA device their bytes are empty)" in out.stderr
    assert "__main__.loss_history" in out.stderr  # the census still names the holder
    page = html.read_text(encoding="utf-8")
    assert "<svg" not in page and "0 B</text>" not in page
    assert "Nothing to plot: 19 spans finished, but none measured CUDA memory" in page
    assert "growth detection needs a CUDA device" in page
    assert "<p>None.</p>" not in page


def test_html_escapes_bidi_and_invisible_characters(tmp_path: Path) -> None:
    script = write(
        tmp_path,
        "bidi.py",
        """
        import torch, cudamem
        with cudamem.track("train\\u202eptxt.exe"):
            pass
        with cudamem.track("zero\\u200bwidth\\u2066iso\\u0007bell\\u00a0nbsp"):
            pass
        store = {"key\\u202e": torch.ones(1000)}
        raise RuntimeError("bad\\u202ename")
        """,
    )
    html = tmp_path / "r.html"
    arg = "x\u202eyz\u200d"
    out = cudamem("run", "--html", str(html), str(script), arg)
    assert out.returncode == 1
    page = html.read_text(encoding="utf-8")
    for raw in ("\u202e", "\u200b", "\u200d", "\u2066", "\u0007", "\u00a0"):
        assert raw not in page, repr(raw)
    assert "train\\u202eptxt.exe" in page
    assert "zero\\u200bwidth\\u2066iso\\x07bell\\xa0nbsp" in page
    assert "x\\u202eyz\\u200d" in page  # argv, in the title and the heading
    assert "<title>cudamem: " in page and "bidi.py x\\u202eyz\\u200d</title>" in page
    assert "key\\u202e" in page
    assert "bad\\u202ename" in page  # the exception, in the traceback block
    # the text report on stderr escapes the command line too
    assert "bidi.py x\\u202eyz\\u200d" in out.stderr


def test_escape_invisible_writes_python_escapes() -> None:
    from cudamem.base.format import escape_invisible

    assert escape_invisible("plain ascii") == "plain ascii"
    assert escape_invisible("café 日本 ü") == "café 日本 ü"  # visible letters stay
    assert escape_invisible("a\u202eb") == "a\\u202eb"
    assert escape_invisible("\u200b\u200c\u200d\ufeff") == "\\u200b\\u200c\\u200d\\ufeff"
    assert escape_invisible("\x1b[2J\x00") == "\\x1b[2J\\x00"
    assert escape_invisible("caf\udce9") == "caf\\udce9"  # a lone surrogate encodes afterwards
    assert escape_invisible("\U000e0041") == "\\U000e0041"  # tag characters
    assert escape_invisible("a\u2028b\u00a0c") == "a\\u2028b\\xa0c"
    assert escape_invisible("line\nnext\t", keep="\n") == "line\nnext\\x09"


HOST_SCRIPT = Path(__file__).resolve().parents[1] / "data" / "host_records.py"


def test_run_reports_dataloader_workers_copy_on_read_in_text_and_json(tmp_path: Path) -> None:
    # 200 k dicts read by 2 forked workers for 300 batches: the loop breaks mid-epoch, and the
    # workers are read one last time as torch shuts them down.
    out = cudamem("run", "--json", str(tmp_path / "run.json"), str(HOST_SCRIPT), env=NO_GPU)
    assert out.returncode == 0, out.stderr
    assert re.search(
        f"{re.escape(str(HOST_SCRIPT))}:2[0-9]: HostMemoryWarning: DataLoader #1 ", out.stderr
    )
    assert "host at exit (pid " in out.stderr
    assert "DataLoader workers: 1 loader, 2 workers; 1 host memory warning" in out.stderr
    assert "dataset.records: list of 200,000 dicts" in out.stderr
    host = json.loads((tmp_path / "run.json").read_text())["host"]
    (loader,) = host["loaders"]
    assert loader["cause"] == "copy-on-read" and loader["start_method"] == "fork"
    assert loader["ended"] and loader["warned"]
    assert [c["path"] for c in loader["containers"]] == ["dataset.records"]
    assert loader["containers"][0]["count"] == 200_000
    assert host["workers_growth"] == loader["growth"] > 16 * 1024**2
    assert host["process"]["uss"] > 0 and len(host["warnings"]) == 1

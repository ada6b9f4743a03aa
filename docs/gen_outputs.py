"""Write the outputs the docs show from real runs of ``docs/examples/*.py``.

    python docs/gen_outputs.py          # CPU runs (any GPU hidden) -> docs/output/<example>.txt
    python docs/gen_outputs.py --gpu    # GPU runs -> docs/output/<example>-gpu.txt
    python docs/gen_outputs.py --check  # CPU runs compared with the committed files

Pages include the files with pymdownx.snippets (``--8<-- "docs/output/who_holds.txt:inner"``),
so what a page shows is what the example printed. An example prints ``=== name ===`` on a line
of its own to start the section ``name``; those lines become snippet section markers here.
An example that needs a GPU exits on the CPU with one line, ``<file>: this example needs a
CUDA GPU``, and gets no CPU output file.

An example whose first lines hold ``# docs: cudamem run [options]`` is run as
``python -m cudamem run [options] docs/examples/<example>.py`` instead: the output is the
command line's (the script's and cudamem's, interleaved as on a terminal).

A section whose name starts with ``measured-`` holds figures the operating system measures
(RSS, PSS, USS, growth of DataLoader workers): two honest runs differ in them, so ``normalise``
compares its byte figures as ``<bytes>`` and the workers' pids in their tables as ``<pid>``
(names, counts and the text stay compared).

Absolute paths of this checkout are written relative to it, so the files do not depend on
where the docs were built. ``docs/output/environment[-gpu].json`` records where the outputs
came from (Python and torch versions, NVML, GPUs): a fresh run elsewhere may honestly differ,
so tests compare the CPU outputs only on a machine like the one that wrote them. A GPU run
also writes ``docs/output/card-gpu.txt``, the card and PyTorch as a phrase that the guides
include beside the GPU outputs, so that the card they name is the one that ran them.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "docs" / "examples"
OUTPUT = ROOT / "docs" / "output"

NEEDS_GPU = "this example needs a CUDA GPU"
_SECTION = re.compile(r"^=== ([a-z][-_0-9a-z]*) ===$")
_RUN_AS = re.compile(r"^# docs: cudamem run(?P<options>( [^\s]+)*)\s*$")


@dataclass(frozen=True)
class Run:
    """One example's run: exit status and its output (stdout and stderr, interleaved)."""

    example: Path
    returncode: int
    output: str

    @property
    def needs_gpu(self) -> bool:
        """Whether it exited with the one-line "needs a CUDA GPU" message."""
        return self.returncode == 1 and self.output.strip() == needs_gpu_line(self.example)


def needs_gpu_line(example: Path) -> str:
    """The line a GPU-only example prints on a CPU machine."""
    return f"{example.name}: {NEEDS_GPU}"


def examples() -> list[Path]:
    """Every example script, in name order (names starting with ``_`` are helpers)."""
    return sorted(p for p in EXAMPLES.glob("*.py") if not p.name.startswith("_"))


def imports(example: Path) -> list[str]:
    """The top-level packages ``example`` imports at module level, in the order it does,
    those in a top-level ``try`` included (an example checks for its optional framework
    that way; a test skips it where the framework is missing, naming the extra)."""
    tree = ast.parse(example.read_text(encoding="utf-8"))
    names: list[str] = []
    body: list[ast.stmt] = []
    for node in tree.body:
        body.extend(node.body if isinstance(node, ast.Try) else [node])
    for node in body:
        if isinstance(node, ast.Import):
            found = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found = [node.module]
        else:
            continue
        names.extend(n.split(".")[0] for n in found if n.split(".")[0] not in names)
    return names


def command(example: Path) -> list[str]:
    """How the example is run: ``python example.py``, or under ``cudamem run``."""
    rel = str(example)
    with example.open(encoding="utf-8") as fh:
        head = [next(fh, "") for _ in range(3)]
    for line in head:
        m = _RUN_AS.match(line.rstrip("\n"))
        if m:
            return [sys.executable, "-m", "cudamem", "run", *m["options"].split(), rel]
    return [sys.executable, rel]


def run(example: Path, *, gpu: bool, timeout: float = 600) -> Run:
    """Run one example on the CPU (unless ``gpu``), in an empty working directory: files it
    writes (``--html report.html``, ``oom-report.txt``) land there, not in the checkout."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1", PYTHONHASHSEED="0")
    env.pop("PYTHONWARNINGS", None)
    if not gpu:
        env["CUDA_VISIBLE_DEVICES"] = ""  # a CPU run, even on a GPU machine
    with tempfile.TemporaryDirectory(prefix="cudamem-docs-") as tmp:
        proc = subprocess.run(
            command(example),
            cwd=tmp,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,  # one stream, in the order a terminal shows it
            text=True,
            errors="backslashreplace",
            timeout=timeout,
        )
        output = proc.stdout
        for where in {tmp, os.path.realpath(tmp)}:
            output = output.replace(f"{where}{os.sep}", "").replace(where, ".")
    return Run(example, proc.returncode, output)


def to_snippets(output: str) -> str:
    """The output with ``=== name ===`` lines turned into snippet section markers and this
    checkout's absolute paths made relative."""
    output = output.replace(f"{ROOT}{os.sep}", "").replace(str(ROOT), ".")
    lines: list[str] = []
    current: str | None = None
    for line in output.splitlines():
        m = _SECTION.match(line)
        if m is None:
            lines.append(line)
            continue
        if current is not None:
            _end(lines, current)
        current = m[1]
        lines.append(f"--8<-- [start:{current}]")
    if current is not None:
        _end(lines, current)
    return "\n".join(lines).strip("\n") + "\n"


def _end(lines: list[str], name: str) -> None:
    while lines and not lines[-1].strip():  # a section ends at its last printed line
        lines.pop()
    lines.append(f"--8<-- [end:{name}]")


_ENVIRONMENT = """
import json, platform, torch
from cudamem.ledger import nvml as _nvml
print(json.dumps({
    "python": ".".join(platform.python_version_tuple()[:2]),
    "torch": ".".join(torch.__version__.split("+")[0].split(".")[:2]),
    "cuda_devices": torch.cuda.device_count(),
    "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    "nvml": _nvml.status().available,
}))
"""


def environment() -> dict[str, object]:
    """What decides the outputs besides the code: Python and torch (major.minor), the GPUs
    torch sees (none hidden), the first one's name and whether NVML answers."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run(
        [sys.executable, "-c", _ENVIRONMENT],
        env=env,
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    )
    found: dict[str, object] = json.loads(proc.stdout.strip().splitlines()[-1])
    return found


def environment_file(*, gpu: bool) -> Path:
    """``docs/output/environment.json`` (CPU outputs) or ``environment-gpu.json``."""
    return OUTPUT / f"environment{'-gpu' if gpu else ''}.json"


def card_file() -> Path:
    """``docs/output/card-gpu.txt``: the card and PyTorch of the GPU outputs, as a phrase the
    guides include mid-sentence ("... on an NVIDIA H100 80GB HBM3 with PyTorch 2.11 ...")."""
    return OUTPUT / "card-gpu.txt"


def card_phrase(found: dict[str, object]) -> str:
    """The text of ``card_file()`` for the environment ``found``."""
    return f"an {found['gpu']} with PyTorch {found['torch']}\n"


def output_file(example: Path, *, gpu: bool) -> Path:
    """``docs/output/<example>.txt`` or ``<example>-gpu.txt``."""
    return OUTPUT / f"{example.stem}{'-gpu' if gpu else ''}.txt"


_VARYING = [
    # durations: "1.9 ms", "129.7 ms", "25 µs", "4.98 s" (a count such as "5 calls" is kept)
    (re.compile(r"\b\d+(?:\.\d+)? ?(?:ns|µs|us|ms|s)\b"), "<time>"),
    (re.compile(r"\b\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(?:\.\d+)?"), "<when>"),
    (re.compile(r"0x[0-9a-fA-F]+"), "0x<addr>"),
    (re.compile(r"\bpid \d+"), "pid <pid>"),
    (re.compile(r"(pid <pid> on )[^\s,)]+"), r"\1<host>"),  # the distributed report's hosts
    # a process's RSS/PSS/USS, measured by the OS: the host sections' first line
    (
        re.compile(r"^(\s*host(?: at exit|, this process) \(pid <pid>): [^)]*\)", re.M),
        r"\1: <rss>)",
    ),
    (re.compile(r'"(data_ptr|started_at|duration|elapsed|thread)": [-\d.e]+'), r'"\1": <n>'),
    (re.compile(r"-{2,}"), "--"),  # table rules follow the widest cell, timings included
    (re.compile(r"[ \t]+"), " "),
]


_BYTES = re.compile(r"[-+]?\d+(?:\.\d+)? (?:B|KiB|MiB|GiB|TiB)\b")
_WORKER_PID = re.compile(r"^(\s*\d+\s+)\d+(?=\s+<bytes>)", re.M)  # worker tables: index, pid
_MEASURED = re.compile(r"(--8<-- \[start:measured-[^\]]*\])(.*?)(--8<-- \[end:)", re.S)
#: A worker table's state column (``exited`` / ``running``): whether the watcher's last look
#: came after a finished loader's workers exited is the OS's timing, as their bytes are.
_STATE_HEADER = re.compile(r"^(\s*worker\s+pid\b[^\n]*?)\s+state\n(\s*[- ]*?-)\s+-+$", re.M)
_STATE_CELL = re.compile(r"^(\s*\d+\s+\d+\s[^\n]*?)\s+(?:exited|running)$", re.M)


def _measured(section: str) -> str:
    """A ``measured-`` section's OS figures replaced: bytes, worker pids, worker states."""
    section = _STATE_CELL.sub(r"\1", _STATE_HEADER.sub(r"\1\n\2", section))
    return _WORKER_PID.sub(r"\1<pid>", _BYTES.sub("<bytes>", section))


def normalise(text: str) -> str:
    """``text`` with what differs between two honest runs (timings, addresses, pids, column
    widths, the byte figures and worker states of ``measured-`` sections) replaced, and
    nothing else: byte counts, holder paths and counts stay."""
    text = _MEASURED.sub(lambda m: m[1] + _measured(m[2]) + m[3], text)
    for pattern, replacement in _VARYING:
        text = pattern.sub(replacement, text)
    return "\n".join(line.rstrip() for line in text.splitlines()).strip() + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpu", action="store_true", help="run on the GPU, write *-gpu.txt")
    parser.add_argument(
        "--check", action="store_true", help="compare CPU runs with the committed files"
    )
    parser.add_argument("names", nargs="*", help="only these examples (file stems)")
    args = parser.parse_args(argv)
    if args.gpu and args.check:
        parser.error("--check compares the CPU outputs only")
    chosen = [p for p in examples() if not args.names or p.stem in args.names]
    if args.names and len(chosen) != len(set(args.names)):
        known = ", ".join(p.stem for p in examples())
        parser.error(f"unknown example among {args.names}; examples: {known}")
    # read once (a Python that imports torch): checked here for --gpu, recorded at the end
    found = None if args.check else environment()
    if args.gpu and found is not None and not found["cuda_devices"]:
        parser.error("--gpu needs a CUDA GPU: torch sees none here")
    OUTPUT.mkdir(exist_ok=True)
    failed = 0
    for example in chosen:
        result = run(example, gpu=args.gpu)
        target = output_file(example, gpu=args.gpu)
        rel = target.relative_to(ROOT)
        if result.needs_gpu and not args.gpu:
            if args.check and target.exists():
                print(f"{rel}: stale (the example now needs a GPU)")
                failed += 1
            elif not args.check:
                target.unlink(missing_ok=True)
                print(f"{example.name}: needs a CUDA GPU (no CPU output)")
            continue
        if result.returncode != 0:
            print(f"{example.name}: exit code {result.returncode}\n{result.output}")
            failed += 1
            continue
        text = to_snippets(result.output)
        if args.check:
            old = target.read_text(encoding="utf-8") if target.exists() else ""
            if normalise(old) != normalise(text):
                print(f"{rel}: differs from a fresh run (python docs/gen_outputs.py rewrites it)")
                failed += 1
            continue
        target.write_text(text, encoding="utf-8")
        print(f"wrote {rel}")
    if found is not None:
        record = json.dumps(found, indent=2, sort_keys=True) + "\n"
        environment_file(gpu=args.gpu).write_text(record, encoding="utf-8")
        if args.gpu:
            card_file().write_text(card_phrase(found), encoding="utf-8")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

"""The record of a GPU verification run (``.ci/gpu``), and whether it still holds.

    python .ci/gpu_record.py tree               the tree about to run, as JSON
    python .ci/gpu_record.py write LOGS RECORD  the record from a run's logs (exit 1 unless
                                                every group passed and the reader is active)
    python .ci/gpu_record.py check [RECORD]     whether RECORD ran on today's cudamem/ (exit 1
                                                when cudamem/ changed since: not GPU-verified)

``cudamem/`` is identified by its git tree id, computed from the files themselves (as
``git rev-parse HEAD:cudamem`` prints it for a clean checkout), so the device's copy, which
carries no ``.git``, names the same tree as the commit here. Standard library only.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RECORD = ROOT / "benchmarks" / "results" / "gpu-verified.json"
#: pytest groups of .ci/gpu, in the order they run.
GROUPS = (
    "trust",
    "integrations",
    "frameworks",
    "cli",
    "kernel",
    "reader",
    "reader-retry",
    "expandable-kernel",
    "docs",
    "modules",
    "ledger",
    "expandable-ledger",
    "plan",
)
BENCHES = ("build_reader", "gen_outputs", "span_overhead", "soak", "scalars", "module_profile")
_IGNORED_DIRS = {"__pycache__", ".mypy_cache", ".ruff_cache", ".pytest_cache"}
_IGNORED_SUFFIXES = (".pyc", ".pyo")
_COUNT = re.compile(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed|deselected|warnings?)")


def tree_id(path: Path) -> str:
    """Git's tree id of ``path`` (files git would ignore here left out)."""
    entries: list[tuple[str, bytes]] = []
    for child in path.iterdir():
        name = child.name
        if child.is_symlink():
            target = os.readlink(child).encode()
            entries.append((name, b"120000 " + name.encode() + b"\0" + _blob(target)))
        elif child.is_dir():
            if name in _IGNORED_DIRS or name.endswith(".egg-info"):
                continue
            sub = tree_id(child)
            entries.append((name + "/", b"40000 " + name.encode() + b"\0" + bytes.fromhex(sub)))
        elif not name.endswith(_IGNORED_SUFFIXES):
            mode = b"100755" if os.access(child, os.X_OK) else b"100644"
            entries.append((name, mode + b" " + name.encode() + b"\0" + _blob(child.read_bytes())))
    body = b"".join(entry for _key, entry in sorted(entries, key=lambda e: e[0].encode()))
    return hashlib.sha1(b"tree %d\0" % len(body) + body).hexdigest()


def _blob(data: bytes) -> bytes:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).digest()


def _git(*args: str) -> str | None:
    try:
        done = subprocess.run(
            ["git", *args], cwd=ROOT, capture_output=True, text=True, check=True, timeout=30
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip()


def tree() -> dict[str, Any]:
    """The commit this tree is, whether it is clean, and cudamem/'s tree id."""
    # The caller's word first: a device's copy of the tree may carry a stale .git (the
    # landed snapshot's), whose HEAD is not the commit whose files are running.
    commit = os.environ.get("GPU_COMMIT") or _git("rev-parse", "HEAD") or None
    clean: bool | None
    if "GPU_TREE_CLEAN" in os.environ:
        clean = os.environ["GPU_TREE_CLEAN"] == "1"
    else:
        status = _git("status", "--porcelain")
        clean = None if status is None else status == ""
    return {"commit": commit, "clean": clean, "cudamem_tree": tree_id(ROOT / "cudamem")}


def counts(log: str) -> dict[str, int]:
    """pytest's summary counts from the last line of its ``-q`` output."""
    lines = [line for line in log.splitlines() if line.strip()]
    last = lines[-1] if lines else ""
    out: dict[str, int] = {}
    for n, word in _COUNT.findall(last):
        key = {"error": "errors", "warning": "warnings"}.get(word, word)
        out[key] = int(n)
    return out


def _read(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return ""


def _rc(logs: Path, name: str) -> tuple[int | None, int | None]:
    parts = _read(logs / f"{name}.rc").split()
    if len(parts) != 2:
        return None, None
    return int(parts[0]), int(parts[1])


def _json_tail(text: str) -> Any:
    start = text.find("{")
    if start < 0:
        return None
    try:
        return json.loads(text[start:])
    except ValueError:
        return None


def _span_figures(results: Path) -> dict[str, Any] | None:
    data = _json_tail(_read(results / "span_overhead.json"))
    if not isinstance(data, dict):
        return None
    spans = data.get("spans_us") or {}

    def fig(key: str) -> dict[str, float] | None:
        xs = spans.get(key) or []
        if not xs:
            return None
        median = round(statistics.median(xs), 3)
        return {"median_us": median, "min_us": min(xs), "max_us": max(xs), "n": len(xs)}

    return {
        "reader": data.get("reader"),
        "span_core": data.get("span_core"),
        "quick": data.get("quick"),
        "enter_exit": {k: fig(k) for k in spans},
        "goals": data.get("goals"),
        "steps": {
            kind: {case: v for case, v in cases.items() if isinstance(v, dict)}
            for kind, cases in (data.get("steps") or {}).items()
            if isinstance(cases, dict)
        },
    }


def _card(text: str) -> dict[str, str] | None:
    """The card the run used, from ``nvidia-smi --query-gpu=name,driver_version,memory.total
    --format=csv,noheader`` (its first GPU's line)."""
    lines = [line for line in text.splitlines() if line.strip()]
    parts = [p.strip() for p in lines[0].split(",")] if lines else []
    if len(parts) != 3:
        return None
    return {"name": parts[0], "driver": parts[1], "memory": parts[2]}


def write(logs: Path, record: Path) -> int:
    before = _json_tail(_read(logs / "tree.json")) or {}
    groups = {}
    ok = True
    for name in GROUPS:
        rc, seconds = _rc(logs, name)
        groups[name] = {"rc": rc, "seconds": seconds, **counts(_read(logs / f"{name}.log"))}
        ok = ok and rc == 0
    benches = {}
    for name in BENCHES:
        rc, seconds = _rc(logs, name)
        benches[name] = {"rc": rc, "seconds": seconds}
    status = _json_tail(_read(logs / "status.json"))
    reader = status.get("reader") if isinstance(status, dict) else None
    core = status.get("span_core") if isinstance(status, dict) else None
    built = _json_tail(_read(logs / "build_reader.log"))
    active = isinstance(reader, dict) and reader.get("state") in ("active", "cached")
    # The compiled span core serves on a GPU host with a compiler (every H200 has one).
    core_active = isinstance(core, dict) and core.get("state") == "active"
    data = {
        **before,
        "card": _card(_read(logs / "card.txt")),
        "groups": groups,
        "benchmarks": benches,
        "reader_build": built,
        "reader": reader,
        "span_core": core,
        "spans": _span_figures(ROOT / "benchmarks" / "results"),
        "passed": ok and active and core_active,
    }
    record.parent.mkdir(parents=True, exist_ok=True)
    record.write_text(json.dumps(data, indent=2, sort_keys=False) + "\n", encoding="utf-8")
    for name, g in groups.items():
        shown = ", ".join(f"{v} {k}" for k, v in g.items() if k not in ("rc", "seconds"))
        print(f"{name:<14} rc={g['rc']}  {g['seconds']} s  {shown}")
    for name, b in benches.items():
        print(f"bench {name:<14} rc={b['rc']}  {b['seconds']} s")
    state = reader.get("state") if isinstance(reader, dict) else None
    print(f"reader: {state}; commit {before.get('commit')} clean={before.get('clean')}")
    print(f"span core: {core.get('state') if isinstance(core, dict) else None}")
    card = data["card"]
    print(f"card: {card['name'] if card else 'unknown'}")
    print(f"cudamem tree {before.get('cudamem_tree')}; verified: {data['passed']}")
    return 0 if data["passed"] else 1


def check(record: Path) -> int:
    data = _json_tail(_read(record))
    if not isinstance(data, dict):
        print(f"no GPU record at {record}: cudamem/ is not GPU-verified")
        return 1
    now = tree_id(ROOT / "cudamem")
    ran = data.get("cudamem_tree")
    if ran != now:
        print(
            f"NOT GPU-verified: cudamem/ is tree {now[:12]}, the record ran on {str(ran)[:12]} "
            f"(commit {str(data.get('commit'))[:12]}); run .ci/gpu again"
        )
        return 1
    verdict = "passed" if data.get("passed") else "FAILED"
    card = data.get("card")
    on = f" on {card.get('name')}" if isinstance(card, dict) else ""
    print(
        f"GPU-verified ({verdict}): cudamem/ tree {now[:12]} ran at commit {data.get('commit')}{on}"
    )
    return 0 if data.get("passed") else 1


def main(argv: list[str]) -> int:
    if argv[:1] == ["tree"]:
        print(json.dumps(tree()))
        return 0
    if argv[:1] == ["write"] and len(argv) == 3:
        return write(Path(argv[1]), Path(argv[2]))
    if argv[:1] == ["check"] and len(argv) <= 2:
        return check(Path(argv[1]) if len(argv) == 2 else RECORD)
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""The command line: ``python -m cudamem demo | run | status | build-reader``.

``run`` passes everything after the script (or ``-m module``) to the script untouched:
``cudamem run train.py --lr 3`` gives ``--lr 3`` to ``train.py``, never to cudamem. Its own
options therefore come first, and are split off by hand before argparse sees them (argparse's
``REMAINDER`` would otherwise let an unknown option before the script reach the top-level
parser, which prints the wrong usage).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Sequence

__all__ = ["build_parser", "main"]

#: ``run``'s options that take a value (the value is the next word unless given with ``=``).
_RUN_VALUE_OPTIONS = ("--json", "--html", "--top")
#: How long ``status`` waits for each compiled extension's build (a cached one loads at once).
STATUS_WAIT_S = 30.0

_RUN_USAGE = (
    "cudamem run [-h] [--json FILE] [--html FILE] [--top N] [--modules] "
    "(script | -m module) [args ...]"
)


def _cmd_demo(args: argparse.Namespace) -> int:
    from ..allocator import backend as _backend
    from ..demo import render_experiment, render_summary, run_demo
    from ..render.json import to_json

    if _backend.get().device_count() == 0:
        print(
            "cudamem demo: no CUDA GPU on this machine; experiments that need one are "
            "skipped, the rest run on the CPU.",
            file=sys.stderr,
        )
    results = run_demo(
        only=args.only or None,
        progress=lambda key: print(f"[cudamem] running {key} ...", file=sys.stderr),
    )
    if args.json:
        print(to_json({"experiments": results}, kind="cudamem.demo"))
    else:
        for exp in results:
            print(render_experiment(exp))
            print()
        print(render_summary(results))
    failed = any(not c.passed for e in results for c in e.checks)
    return 1 if failed else 0


def _report_path(parser: argparse.ArgumentParser, option: str, value: str | None) -> str | None:
    """An absolute path for a report file, checked before the script runs.

    Resolved against the working directory at launch: the script may ``chdir`` before the
    report is written. A ``.py`` target is refused: ``cudamem run --json train.py`` (the old
    flag form) would otherwise overwrite the script with JSON.
    """
    if value is None:
        return None
    if value.endswith(".py"):
        parser.error(
            f"{option} {value} would overwrite a Python file; {option} takes the report's "
            f"file name (e.g. {option} report.{option.lstrip('-')})"
        )
    path = os.path.abspath(value)
    parent = os.path.dirname(path)
    if os.path.isdir(path):
        parser.error(f"{option} {value} is a directory")
    if not os.path.isdir(parent):
        parser.error(f"{option} {value}: directory {parent} does not exist")
    return path


def _write_report(path: str, text: str) -> str | None:
    """Write ``text`` to ``path`` whole or not at all; an error message, or None."""
    tmp = f"{path}.cudamem-tmp"
    try:
        # backslashreplace: a lone surrogate (a non-UTF-8 file name) becomes ``\\udce9``,
        # which is also a valid JSON escape, instead of an exception and an empty file.
        with open(tmp, "w", encoding="utf-8", errors="backslashreplace") as fh:
            fh.write(text)
        os.replace(tmp, path)
    except OSError as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        return f"cannot write {path}: {exc.strerror or exc}"
    return None


def _cmd_run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from ..run.runner import ScriptError, run_script

    json_path = _report_path(parser, "--json", args.json)
    html_path = _report_path(parser, "--html", args.html)
    if args.module is None and args.script is None:
        parser.error(
            "name the script to run: cudamem run script.py [args ...], "
            "or a module: cudamem run -m module [args ...]"
        )

    def progress(text: str) -> None:
        print(f"[cudamem] {text} ...", file=sys.stderr)

    target = args.module if args.module is not None else args.script
    try:
        report = run_script(
            target,
            args.args,
            module=args.module is not None,
            top=args.top,
            modules=args.modules,
            progress=progress,
            # The script's traceback first, as `python script.py` prints it; then cudamem's.
            on_traceback=lambda text: print(text, file=sys.stderr, end="", flush=True),
        )
    except ScriptError as exc:
        print(f"cudamem run: {exc}", file=sys.stderr)
        return 2
    print(report, file=sys.stderr)
    for path, render in ((json_path, _json), (html_path, _html)):
        if path is None:
            continue
        error = _write_report(path, render(report))
        if error is None:
            print(f"[cudamem] wrote {path}", file=sys.stderr)
        else:
            print(f"cudamem run: {error}", file=sys.stderr)
    return report.exit_code


def _json(report: object) -> str:
    from ..render.json import to_json

    return to_json(report, kind="cudamem.run") + "\n"


def _html(report: object) -> str:
    from ..render.html import render_html
    from ..run.runner import RunReport

    assert isinstance(report, RunReport)
    return render_html(report)


def _pid(text: str) -> int:
    """``--pid``'s value: a positive process id."""
    if not text.isdigit() or int(text) <= 0:
        raise argparse.ArgumentTypeError(f"a process id is a positive integer, not {text!r}")
    return int(text)


def _cmd_status(args: argparse.Namespace) -> int:
    import dataclasses

    from ..allocator import backend as _backend
    from ..base.data import to_data
    from ..base.present import present
    from ..ledger.status import machine_status
    from ..native import heapscan as _heapscan
    from ..render.json import to_json
    from ..spans.span import span_core_status

    status = machine_status(pids=args.pid or ())
    reader = _backend.reader_status()
    if _backend.get().device_count():
        core = span_core_status(wait=STATUS_WAIT_S)
        heap = _heapscan.wait(STATUS_WAIT_S)
    else:  # no GPU: nothing here needs the compiled extensions now, so none is built
        why = "status builds nothing on a machine without a CUDA GPU"
        core, heap = (
            dataclasses.replace(s, reason=f"{s.reason}; {why}")
            for s in (span_core_status(), _heapscan.status())
        )
    if args.json:
        extra = {"reader": reader, "span_core": core, "heap_pass": heap}
        print(to_json({**to_data(status), **extra}, kind="cudamem.status"))
    else:
        print(f"{status}\n\n{present(reader)}\n{present(core)}\n{present(heap)}")
    return 0


def _non_negative(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {value}")
    return value


def _demo_keys() -> list[str]:
    from ..demo import experiments

    return [key for key, _ in experiments()]


def _cmd_build_reader(args: argparse.Namespace) -> int:
    from ..allocator import backend as _backend
    from ..base.present import present
    from ..render.json import to_json

    if not args.json:
        print("[cudamem] building the C++ counter reader ...", file=sys.stderr)
    status = _backend.build_reader(validate=not args.no_validate)
    print(to_json(status, kind="cudamem.reader") if args.json else present(status))
    return 0 if status.state in ("active", "ready", "cached") else 1


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``python -m cudamem`` (``run``'s script arguments excepted)."""
    return _build()[0]


def _build() -> tuple[argparse.ArgumentParser, argparse.ArgumentParser]:
    """The top-level parser and ``run``'s."""
    parser = argparse.ArgumentParser(
        prog="cudamem", description="Where your PyTorch GPU memory went."
    )
    sub = parser.add_subparsers(dest="command", metavar="{demo,run,status,build-reader}")
    keys = _demo_keys()
    demo = sub.add_parser(
        "demo",
        help="reproduce the seeds' experiments with PASS/FAIL checks",
        description="Reproduce the seeds' experiments with PASS/FAIL checks. "
        f"Experiment keys: {', '.join(keys)}.",
    )
    demo.add_argument("--json", action="store_true", help="print the results as JSON")
    demo.add_argument(
        "--only",
        action="append",
        metavar="KEY",
        choices=keys,
        help=f"run only this experiment (repeatable): {', '.join(keys)}",
    )
    demo.set_defaults(func=_cmd_demo)
    run = sub.add_parser(
        "run",
        usage=_RUN_USAGE,
        allow_abbrev=False,  # --js FILE must not pass for --json: the split below is exact
        help="run a script like `python script.py`, with leak detection and an end report",
        description="Run a script (or -m module) as python would, then report what it kept. "
        "Everything after the script or module goes to it untouched.",
    )
    run.add_argument(
        "--json", metavar="FILE", help="also write the report as JSON to FILE (schema 1)"
    )
    run.add_argument("--html", metavar="FILE", help="also write a self-contained HTML report")
    run.add_argument(
        "--top",
        type=_non_negative,
        default=10,
        metavar="N",
        help="largest live storages searched for holders and listed (default 10)",
    )
    run.add_argument(
        "--modules",
        action="store_true",
        help="profile memory per module (nn.Module) and name the top modules at exit",
    )
    run.add_argument(
        "-m", dest="module", metavar="module", help="run a module as `python -m module` does"
    )
    run.add_argument("script", nargs="?", help="the Python script to run")
    run.add_argument("args", nargs="*", help="the script's own arguments, passed untouched")
    run.set_defaults(func=_cmd_run)
    status = sub.add_parser(
        "status", help="this machine's GPUs as NVML sees them, reconciled (all processes)"
    )
    status.add_argument("--json", action="store_true", help="print the status as JSON")
    status.add_argument(
        "--pid",
        type=_pid,
        action="append",
        metavar="PID",
        help="also read this process's host memory and its children's (DataLoader workers)",
    )
    status.set_defaults(func=_cmd_status)
    build = sub.add_parser(
        "build-reader",
        help="compile the C++ counter reader now (spans otherwise build it in the background)",
    )
    build.add_argument("--json", action="store_true", help="print the reader's status as JSON")
    build.add_argument(
        "--no-validate",
        action="store_true",
        help="do not check it against the dict read on cuda:0 (which starts CUDA there)",
    )
    build.set_defaults(func=_cmd_build_reader)
    return parser, run


def _split_run_argv(words: Sequence[str]) -> tuple[list[str], list[str]]:
    """``run``'s own words (its options and the script or ``-m module``) and the script's.

    Stops at the first word that is not one of ``run``'s options: that is the script, and
    every word after it is the script's, whatever it looks like.
    """
    own: list[str] = []
    i = 0
    while i < len(words):
        word = words[i]
        if word == "--":  # the next word is the script, even if it starts with "-"
            own.extend(words[i : i + 2])
            return own, list(words[i + 2 :])
        if word == "-m":
            own.extend(words[i : i + 2])
            return own, list(words[i + 2 :])
        if word.startswith("-m") and not word.startswith("--"):  # -mpkg
            own.append(word)
            return own, list(words[i + 1 :])
        if word in _RUN_VALUE_OPTIONS:
            own.extend(words[i : i + 2])
            i += 2
            continue
        if word.startswith("-") and word != "-":
            own.append(word)  # --json=x, -h, or an unknown option argparse will name
            i += 1
            continue
        own.append(word)
        return own, list(words[i + 1 :])
    return own, []


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``cudamem`` console script."""
    words = list(sys.argv[1:] if argv is None else argv)
    parser, run = _build()
    if words and words[0] == "run":
        own, script_args = _split_run_argv(words[1:])
        args = run.parse_args(own)
        # Everything after the script is the script's, untouched (nargs="*" above is only
        # for the help text).
        args.args = (args.args or []) + script_args
        if args.module is not None and args.script is not None:
            args.args = [args.script, *args.args]
            args.script = None
        code: int = _cmd_run(args, run)
        return code
    args, extra = parser.parse_known_args(words)
    if extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if args.command is None:
        parser.error(
            "choose a command: demo, run, status or build-reader (cudamem -h explains them)"
        )
    code = args.func(args)
    return code

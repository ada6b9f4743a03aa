"""The command line: ``python -m cudamem demo``."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

__all__ = ["main"]


def _cmd_demo(args: argparse.Namespace) -> int:
    from . import _backend
    from .demo import run_demo
    from .render.demo import render_experiment, render_summary
    from .render.json import to_json

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
        print(to_json(results))
    else:
        for exp in results:
            print(render_experiment(exp))
            print()
        print(render_summary(results))
    failed = any(not c.passed for e in results for c in e.checks)
    return 1 if failed else 0


def _cmd_run(args: argparse.Namespace) -> int:
    from .render.json import to_json
    from .runner import ScriptError, run_script

    def progress(text: str) -> None:
        print(f"[cudamem] {text} ...", file=sys.stderr)

    try:
        report = run_script(args.script, args.args, top=args.top, progress=progress)
    except ScriptError as exc:
        print(f"cudamem run: {exc}", file=sys.stderr)
        return 2
    if report.traceback:
        print(report.traceback, file=sys.stderr, end="")
    if args.json:
        print(to_json(report))
    else:
        print(report, file=sys.stderr)
    if args.html:
        from .render.html import render_html

        with open(args.html, "w", encoding="utf-8") as fh:
            fh.write(render_html(report))
        print(f"[cudamem] wrote {args.html}", file=sys.stderr)
    return report.exit_code


def _cmd_status(args: argparse.Namespace) -> int:
    from . import _backend
    from .ledger import machine_status
    from .render.json import to_json

    status = machine_status()
    reader = _backend.reader_status()
    if args.json:
        print(to_json({**status.to_dict(), "reader": reader.to_dict()}))
    else:
        print(f"{status}\n\n{reader}")
    return 0


def _cmd_build_reader(args: argparse.Namespace) -> int:
    from . import _backend
    from .render.json import to_json

    if not args.json:
        print("[cudamem] building the C++ counter reader ...", file=sys.stderr)
    status = _backend.build_reader(validate=not args.no_validate)
    print(to_json(status) if args.json else status)
    return 0 if status.state in ("active", "ready", "cached") else 1


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``python -m cudamem``."""
    parser = argparse.ArgumentParser(
        prog="cudamem", description="Where your PyTorch GPU memory went."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="reproduce the seeds' experiments with PASS/FAIL checks")
    demo.add_argument("--json", action="store_true", help="print the results as JSON")
    demo.add_argument("--only", action="append", metavar="KEY", help="run only this experiment")
    demo.set_defaults(func=_cmd_demo)
    run = sub.add_parser(
        "run",
        help="run a script like `python script.py`, with leak detection and an end report",
    )
    run.add_argument("--json", action="store_true", help="print the report as JSON on stdout")
    run.add_argument("--html", metavar="FILE", help="also write a self-contained HTML report")
    run.add_argument("--top", type=int, default=10, help="live storages listed (default 10)")
    run.add_argument("script", help="the Python script to run")
    run.add_argument("args", nargs=argparse.REMAINDER, help="the script's own arguments")
    run.set_defaults(func=_cmd_run)
    status = sub.add_parser(
        "status", help="this machine's GPUs as NVML sees them, reconciled (all processes)"
    )
    status.add_argument("--json", action="store_true", help="print the status as JSON")
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
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``cudamem`` console script."""
    parser = build_parser()
    args = parser.parse_args(argv)
    code: int = args.func(args)
    return code


if __name__ == "__main__":
    sys.exit(main())

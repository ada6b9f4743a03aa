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
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``cudamem`` console script."""
    parser = build_parser()
    args = parser.parse_args(argv)
    code: int = args.func(args)
    return code


if __name__ == "__main__":
    sys.exit(main())

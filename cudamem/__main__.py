"""``python -m cudamem`` and the ``cudamem`` console script (``cudamem.__main__:main``): the
command line itself is ``cudamem.cli.commands``."""

from __future__ import annotations

import sys

from .cli.commands import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())

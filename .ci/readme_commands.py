"""The README's set-up-and-run commands, read out of README.md for ``.ci/run``.

    python3 .ci/readme_commands.py demo     # prints the demo command
    python3 .ci/readme_commands.py tests    # prints the test command

Each command is the ``sh`` block right after a ``<!-- ci: NAME ... -->`` marker in README.md,
so that CI runs exactly what a new user copies. Standard library only: it runs before any
virtual environment exists.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"
NAMES = ("demo", "tests")
_BLOCK = re.compile(r"<!-- ci: (?P<name>[a-z]+)\b[^>]*-->\n```sh\n(?P<command>.*?)\n```", re.S)


def commands(text: str) -> dict[str, str]:
    """``{name: command}`` for every marked block; a name marked twice, a block of more than
    one line or a missing name is an error (CI must not guess which command a user runs)."""
    found: dict[str, str] = {}
    for m in _BLOCK.finditer(text):
        name, command = m["name"], m["command"].strip()
        if name in found:
            raise ValueError(f"README.md marks {name!r} twice")
        if "\n" in command:
            raise ValueError(f"README.md's {name!r} block holds more than one line")
        found[name] = command
    missing = [n for n in NAMES if n not in found]
    if missing:
        raise ValueError(f"README.md has no marked block for {', '.join(missing)}")
    return found


def main(argv: list[str]) -> int:
    if len(argv) != 1 or argv[0] not in NAMES:
        print(f"usage: readme_commands.py {{{'|'.join(NAMES)}}}", file=sys.stderr)
        return 2
    print(commands(README.read_text(encoding="utf-8"))[argv[0]])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

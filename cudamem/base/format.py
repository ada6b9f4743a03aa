"""Text primitives every layer may use: byte sizes, durations, plurals, escaped names.

They format one value each and know no result type, so results (in their messages and
warnings) and renderers share them without importing each other.
"""

from __future__ import annotations

import html
import unicodedata

__all__ = ["escape_html", "escape_invisible", "format_bytes", "format_duration", "plural"]

#: Unicode categories shown escaped: controls, format characters (bidi overrides such as
#: U+202E, zero-width joiners), surrogates, private use, unassigned, line/paragraph
#: separators, and spaces other than the ASCII space.
_INVISIBLE = frozenset({"Cc", "Cf", "Cs", "Co", "Cn", "Zl", "Zp", "Zs"})

_UNITS = (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024))


def format_bytes(n: int | None, *, signed: bool = False) -> str:
    """``268435456`` → ``'256.0 MiB'`` (binary units; ``signed`` adds ``+``/``-``).

    ``None`` (a value that could not be measured) renders as ``'n/a'``, never as 0.
    """
    if n is None:
        return "n/a"
    sign = ""
    if signed:
        sign = "+" if n >= 0 else "-"
    elif n < 0:
        sign = "-"
    magnitude = abs(n)
    for unit, size in _UNITS:
        if magnitude >= size:
            return f"{sign}{magnitude / size:.1f} {unit}"
    return f"{sign}{magnitude} B"


def escape_invisible(text: str, *, keep: str = "") -> str:
    """``'a\u202eb'`` → ``'a\\u202eb'``: characters that are invisible, reorder text or pose
    as others, written as Python escapes so that one name cannot masquerade as another.

    ``keep`` lists characters left as they are (``"\n\t"`` for preformatted text). A lone
    surrogate (a file name that was not UTF-8) becomes ``\udce9`` instead of failing to encode.
    """
    if text.isascii() and text.isprintable():
        return text
    out = []
    for ch in text:
        if ch == " " or ch in keep or unicodedata.category(ch) not in _INVISIBLE:
            out.append(ch)
            continue
        code = ord(ch)
        if code <= 0xFF:
            out.append(f"\\x{code:02x}")
        elif code <= 0xFFFF:
            out.append(f"\\u{code:04x}")
        else:
            out.append(f"\\U{code:08x}")
    return "".join(out)


def escape_html(value: object, *, keep: str = "") -> str:
    """Any value as HTML text: invisible and bidi characters first written as escapes
    (``escape_invisible``, ``keep`` as there), then ``<>&"'`` escaped. The one escaper of
    every HTML cudamem writes (the run report, its chart, notebook cells)."""
    return html.escape(escape_invisible(str(value), keep=keep), quote=True)


def plural(n: int, word: str, words: str | None = None) -> str:
    """``1 storage``, ``2 storages``."""
    return f"{n} {word}" if n == 1 else f"{n} {words or word + 's'}"


def format_duration(seconds: float) -> str:
    """``0.0032`` → ``'3.2 ms'``."""
    if seconds < 1e-3:
        return f"{seconds * 1e6:.0f} µs"
    if seconds < 1.0:
        return f"{seconds * 1e3:.1f} ms"
    return f"{seconds:.2f} s"

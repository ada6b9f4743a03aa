"""Holder paths built by hand, for tests that feed the culprit rules, renderers and
integrations known paths without a search.

``route(*steps)`` takes each step's text; a step's kind is read off its first characters
(tests only: the library never reads a path's text back). The first step is the root.
"""

from __future__ import annotations

import re

from cudamem.holders.holder_path import HolderPath, Step

_INT = re.compile(r"-?\d+")


def step(text: str) -> Step:
    """One step from its text: ``.x`` attr, ``[3]`` index, ``['a']`` key, `` → ...`` an
    arrow (graph when it names ``grad_fn`` or ``saved``, a frame when it has ``(): ``,
    else an object), `` (dict key)``, `` (set member)``, `` (closure 'x')``."""
    if text.startswith("."):
        return Step("attr", text)
    if text.startswith("[") and text.endswith("]"):
        inner = text[1:-1]
        if _INT.fullmatch(inner):
            return Step("index", text, int(inner))
        if inner in ("*",) or ".." in inner:
            return Step("index", text, 0, inner)
        return Step("key", text)
    if text.startswith(" → "):
        body = text[3:]
        if "grad_fn" in body or " saved " in body or body.endswith(" saved"):
            return Step("graph", text)
        if "(): " in body:
            return Step("frame", text)
        return Step("object", text)
    if text == " (dict key)":
        return Step("keyof", text)
    if text == " (set member)":
        return Step("member", text)
    if text.startswith(" (closure"):
        return Step("closure", text)
    raise ValueError(f"no step kind for {text!r}")


def route(root: str, *steps: str, root_kind: str = "global") -> HolderPath:
    """A path from its root step's text and the other steps' texts."""
    return HolderPath(root_kind, (Step("root", root), *(step(s) for s in steps)))


_TOKEN = re.compile(r"\s→\s[^→]*?(?=\s→\s|$)|\[[^\[\]]*\]|\.[A-Za-z_][\w]*| \(dict key\)")


def split(text: str, root_kind: str = "global") -> HolderPath:
    """A simple written path split into steps: the root step runs to the first ``[``, a
    second ``.``-name after the module (globals), or `` → ``. For hand-written fixtures
    (``__main__.hist[3] → grad_fn X``), not for every path a search can write."""
    m = re.match(r"[^\[→]*?(?=\[| → |$)", text)
    head = m.group(0) if m else text
    rest = text[len(head) :]
    steps = [Step("root", head)]
    while rest:
        t = _TOKEN.match(rest)
        if t is None:
            raise ValueError(f"cannot split {rest!r} of {text!r}")
        steps.append(step(t.group(0)))
        rest = rest[t.end() :]
    return HolderPath(root_kind, tuple(steps))

"""Every code block of README.md and the pages under docs/, collected as tests by Sybil.

The root ``conftest.py`` hands pytest :data:`SYBIL`'s collector, and ``testpaths`` names
``README.md`` and ``docs``, so the README's test command runs every block. A page runs the
way a reader runs it: its ```python blocks top to bottom in one namespace, a module named
``__main__``. What a block needs besides its page is said by an HTML comment just before it
(mkdocs renders it to nothing):

``<!-- cuda -->``
    a GPU block: the item carries pytest's ``cuda`` marker, skips without CUDA and runs in
    ``.ci/gpu``'s ``docs`` group.
``<!-- cpu -->``
    a block that shows what happens without CUDA: skipped where CUDA is available.
``<!-- needs: MODULE -->``
    the block imports an optional framework: without it the block skips naming the extra
    that installs it (``tests/extras.py``); ``.ci/run`` runs these pages again with every
    extra installed.
``<!-- raises: NAME -->``
    the block ends in an exception of that class, as the page says; ``NAME: message`` joins
    what the block printed.
``<!-- not-run: REASON -->``
    not run, for the reason given (kept few: prefer a hidden set-up).
``<!-- invisible-code-block: python ... -->``
    Sybil's hidden code: set-up a reader has of their own (a model, a training step), run in
    the page's namespace at its place.
``<!-- unchecked: REASON -->``
    before a ```text block that directly follows a ```python block: the output is shown but
    cannot be compared (GPU figures, timings of a real run).

A ```text block directly after a ```python block (nothing but blank lines and markers
between) shows that block's output and is compared with what it printed, line by line,
after :func:`normalise` (timings, fold counts, widths); a block of ``>>>`` lines is its own
code and output. Text that includes a generated file (``--8<--``) is checked by
``tests/integration/test_cli_docs.py``. A ```sh block is either one of the README's two
commands (``<!-- ci: ... -->``, run by ``.ci/run``), marked ``<!-- run -->`` (run here, in a
shell, from the repository root; it must exit 0) or ``not-run``.

xdist may hand a page's blocks to several workers, and ``--shuffle`` reorders them: each
item first runs, in this worker's namespace of the page, every earlier block of the page not
yet run here, so a block always runs after the ones above it. A block after one that failed
fails naming it. ``python -m tests.docblocks`` prints the counts per kind.
"""

from __future__ import annotations

import contextlib
import gc
import io
import os
import re
import subprocess
import sys
import traceback
import types
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from sybil import Document, Example, Region, Sybil

ROOT = Path(__file__).resolve().parents[1]
#: What Sybil collects, relative to the repository root (``Path.match`` patterns).
PATTERNS = ("README.md", "docs/*.md", "docs/*/*.md")

#: The kinds a block is counted as.
PY_CPU = "python: runs on the CPU"
PY_GPU = "python: GPU (cuda)"
PY_EXTRA = "python: needs an extra"
PY_NOT_RUN = "python: not run"
HIDDEN = "hidden set-up (invisible-code-block)"
OUT_CHECKED = "output: checked"
OUT_UNCHECKED = "output: not checked"
SHOWN = "text: shown (include or illustration)"
SH_CI = "sh: run by .ci/run"
SH_RUN = "sh: run"
SH_NOT_RUN = "sh: not run"

_COMMENT = re.compile(r"^[ \t]*<!--(?P<body>.*?)-->", re.S | re.M)
_FENCE = re.compile(
    r"^(?P<indent>[ \t]*)(?P<fence>`{3,})(?P<lang>[\w-]*)[^\n]*\n"
    r"(?P<source>.*?)^(?P=indent)(?P=fence)[ \t]*$",
    re.S | re.M,
)
_MARKS = ("cuda", "cpu", "needs", "raises", "not-run", "unchecked", "run", "ci")
_STATE = "__docblocks_state__"


class DocsError(Exception):
    """A page's markers that do not fit its blocks."""


@dataclass
class Block:
    """One fenced block or hidden set-up of a page."""

    index: int
    line: int  # of the opening fence (or of the invisible-code-block comment)
    lang: str  # "python", "text", "sh", ...; "hidden" for invisible python
    source: str
    marks: dict[str, str] = field(default_factory=dict)
    follows: int | None = None  # for output text: the index of the python block it shows
    start: int = 0
    end: int = 0

    @property
    def kind(self) -> str:
        m = self.marks
        if self.lang == "python":
            if "not-run" in m:
                return PY_NOT_RUN
            if "cuda" in m:
                return PY_GPU
            return PY_EXTRA if "needs" in m else PY_CPU
        if self.lang == "hidden":
            return HIDDEN
        if self.lang == "sh":
            return SH_CI if "ci" in m else SH_RUN if "run" in m else SH_NOT_RUN
        if self.follows is not None:
            return OUT_UNCHECKED if "unchecked" in m else OUT_CHECKED
        return SHOWN

    @property
    def code(self) -> str:
        """The code to run: a ``>>>`` block's statements, else the source."""
        if not self.doctest:
            return self.source
        return "\n".join(ln[4:] for ln in self.source.splitlines() if ln.startswith((">>>", "...")))

    @property
    def doctest(self) -> bool:
        return self.lang == "python" and self.source.lstrip().startswith(">>>")

    @property
    def expected(self) -> str | None:
        """The output this block shows: a checked text block's, or a ``>>>`` block's."""
        if self.doctest:
            return "\n".join(
                ln for ln in self.source.splitlines() if not ln.startswith((">>>", "..."))
            )
        return self.source if self.kind == OUT_CHECKED else None

    @property
    def runs_code(self) -> bool:
        return self.lang in ("python", "hidden") and "not-run" not in self.marks


def _marker(body: str) -> tuple[str, str] | None:
    body = body.strip()
    name, _, rest = body.partition(":")
    name = name.strip()
    if name in _MARKS and (rest or name in ("cuda", "cpu", "run")) and "\n" not in body:
        return name, rest.strip()
    return None


def parse_blocks(text: str) -> list[Block]:
    """The page's blocks in order, with their markers; a marker that is not directly before
    a block, or that does not fit its block, is a :class:`DocsError`."""
    tokens: list[tuple[int, int, re.Match[str]]] = []
    pos = 0
    while True:
        comment = _COMMENT.search(text, pos)
        fence = _FENCE.search(text, pos)
        found = [m for m in (comment, fence) if m is not None]
        if not found:
            break
        m = min(found, key=lambda m: m.start())
        tokens.append((m.start(), m.end(), m))
        pos = m.end()
    blocks: list[Block] = []
    marks: dict[str, str] = {}
    marked_at = 0
    last_end = 0
    last_python: int | None = None

    def line_of(offset: int) -> int:
        return text.count("\n", 0, offset) + 1

    for start, end, m in tokens:
        gap = text[last_end:start]
        if gap.strip():  # prose between: the next block does not follow a code block
            if marks:
                raise DocsError(f"line {line_of(marked_at)}: a marker not followed by a block")
            last_python = None
        last_end = end
        if m.re is _COMMENT:
            body = m["body"]
            if body.lstrip().startswith("invisible-code-block: python"):
                source = body.lstrip()[len("invisible-code-block: python") :].lstrip("\n")
                source = source.rstrip() + "\n"
                blocks.append(
                    Block(len(blocks), line_of(start), "hidden", source, marks, None, start, end)
                )
                marks = {}
                continue
            mark = _marker(body)
            if mark is not None:
                if not marks:
                    marked_at = start
                marks[mark[0]] = mark[1]
            continue
        indent = m["indent"]
        source = "".join(
            ln[len(indent) :] if ln.startswith(indent) else ln
            for ln in m["source"].splitlines(keepends=True)
        )
        lang = m["lang"] or "text"
        block = Block(len(blocks), line_of(start), lang, source, marks, None, start, end)
        if lang == "text" and last_python is not None and "--8<--" not in source:
            block.follows = last_python
            if "not-run" in blocks[last_python].marks and "unchecked" not in marks:
                marks = {**marks, "unchecked": "the code above it is not run"}
                block.marks = marks
        allowed = {
            "python": {"cuda", "cpu", "needs", "raises", "not-run"},
            "sh": {"ci", "run", "not-run"},
            "text": {"unchecked"} if block.follows is not None else set(),
        }.get(lang, set())
        if set(marks) - allowed:
            raise DocsError(
                f"line {block.line}: markers {sorted(set(marks) - allowed)} do not fit a "
                f"```{lang} block{' after code' if block.follows is not None else ''}"
            )
        blocks.append(block)
        marks = {}
        last_python = block.index if lang == "python" and not block.doctest else None
    if marks:
        raise DocsError(f"line {line_of(marked_at)}: a marker not followed by a block")
    return blocks


def pages() -> list[Path]:
    """Every page Sybil collects: README.md and each .md under docs/."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def page_blocks(path: Path) -> list[Block]:
    try:
        return parse_blocks(path.read_text(encoding="utf-8"))
    except DocsError as exc:
        raise DocsError(f"{path}: {exc}") from None


def counts(paths: list[Path] | None = None) -> Counter[str]:
    total: Counter[str] = Counter()
    for path in paths or pages():
        total.update(b.kind for b in page_blocks(path))
    return total


# -- running ---------------------------------------------------------------------------------

_TIME = re.compile(r"\b\d+(?:\.\d+)? ?(?:ns|µs|us|ms|s)\b")
_SPACE = re.compile(r"[ \t]+")
_RULE = re.compile(r"-{2,}")
_MORE = re.compile(r"\(\+\d+( more)?\)")
_ADDRESS = re.compile(r"\b0x[0-9a-f]+\b")


def normalise(line: str) -> str:
    """``tests/integration/test_integration_docs.py``'s normalisation (timings, fold counts,
    rules and runs of spaces), and memory addresses."""
    line = _ADDRESS.sub("0x…", _MORE.sub(r"(+N\1)", line))
    return _SPACE.sub(" ", _RULE.sub("--", _TIME.sub("<time>", line))).strip()


def _lines(text: str) -> list[str]:
    out = [normalise(ln) for ln in text.splitlines()]
    while out and not out[-1]:
        out.pop()
    while out and not out[0]:
        out.pop(0)
    return out


def has_cuda() -> bool:
    if "torch" not in sys.modules and os.environ.get("CUDA_VISIBLE_DEVICES") == "":
        return False
    import torch

    try:
        return bool(torch.cuda.is_available())
    except Exception:
        return False


@dataclass
class Outcome:
    status: str  # "ok", "failed", "skipped"
    output: str = ""
    detail: str = ""
    line: int = 0


def _why_not_here(block: Block) -> str | None:
    """Why ``block`` does not run on this machine, or None."""
    if "not-run" in block.marks:
        return f"not run: {block.marks['not-run']}"
    if "cuda" in block.marks and not has_cuda():
        return "needs a CUDA GPU"
    if "cpu" in block.marks and has_cuda():
        return "shows a machine without CUDA"
    if "needs" in block.marks:
        from . import extras

        for module in block.marks["needs"].split(","):
            if extras.missing(module.strip()):
                return extras.reason(module.strip())
    return None


class Page(Document):
    """A page whose namespace is a module named ``__main__``, as when a reader runs it."""

    def __init__(self, text: str, path: str) -> None:
        super().__init__(text, path)
        self.module = types.ModuleType("__main__")
        self.namespace = self.module.__dict__
        self.blocks: list[Block] = []


def _run_code(page: Page, block: Block) -> str:
    """Run ``block`` in the page's namespace; what it printed (and the exception it was
    marked to raise)."""
    code = compile("\n" * block.line + block.code, page.path, "exec")
    out = io.StringIO()
    main = sys.modules.get("__main__")
    sys.modules["__main__"] = page.module
    try:
        with contextlib.redirect_stdout(out):
            exec(code, page.namespace)
    except Exception as exc:
        expected = block.marks.get("raises")
        if expected is None or type(exc).__name__ != expected:
            raise
        out.write(f"{type(exc).__name__}: {exc}\n")
        del exc
    else:
        if "raises" in block.marks:
            raise AssertionError(f"the block was to raise {block.marks['raises']}: it did not")
    finally:
        if main is not None:
            sys.modules["__main__"] = main
    return out.getvalue()


def _page_traceback(exc: BaseException, path: str) -> str:
    """The exception's traceback from the page's own frame on (not this module's)."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename != path:
        tb = tb.tb_next
    return "".join(traceback.format_exception(type(exc), exc, tb or exc.__traceback__))


def _compare(block: Block, printed: str, line: int) -> None:
    expected = block.expected
    assert expected is not None
    want, got = _lines(expected), _lines(printed)
    if want != got:
        raise AssertionError(
            f"the page shows (line {block.line}) what the code (line {line}) does not print:\n"
            + "\n".join(f"  page: {w}" for w in want)
            + "\n"
            + "\n".join(f"  code: {g}" for g in got)
        )


def _attempt(page: Page, block: Block, state: dict[int, Outcome]) -> Outcome:
    why = _why_not_here(block)
    if why is not None:
        return Outcome("skipped", detail=why)
    if block.lang in ("python", "hidden"):
        failed = [  # code that failed (a shown output that differs changes nothing)
            o
            for i, o in state.items()
            if i < block.index and o.status == "failed" and page.blocks[i].runs_code
        ]
        if failed:
            return Outcome("failed", detail=f"not run: the block at line {failed[0].line} failed")
        try:
            printed = _run_code(page, block)
            if block.doctest:
                _compare(block, printed, block.line)
        except Exception as exc:
            return Outcome("failed", detail=_page_traceback(exc, page.path), line=block.line)
        return Outcome("ok", output=printed, line=block.line)
    if block.follows is not None:
        shown = state.get(block.follows)
        if shown is None or shown.status != "ok":
            reason = shown.detail if shown is not None else "its code did not run"
            status = "failed" if shown is not None and shown.status == "failed" else "skipped"
            return Outcome(status, detail=f"the code it shows did not run: {reason}")
        try:
            _compare(block, shown.output, page.blocks[block.follows].line)
        except AssertionError as exc:
            return Outcome("failed", detail=str(exc), line=block.line)
        return Outcome("ok", line=block.line)
    if block.lang == "sh":
        proc = subprocess.run(
            ["bash", "-euo", "pipefail", "-c", block.source],
            cwd=ROOT,
            env=dict(
                os.environ,
                PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
            ),
            capture_output=True,
            text=True,
            timeout=300,
        )
        if proc.returncode != 0:
            return Outcome(
                "failed",
                detail=f"exit {proc.returncode}\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}",
                line=block.line,
            )
        return Outcome("ok", output=proc.stdout, line=block.line)
    return Outcome("skipped", detail="nothing to run")


def evaluate(example: Example) -> None:
    """Run the example's block after every earlier block of its page not yet run here."""
    page = example.document
    assert isinstance(page, Page)
    block: Block = example.parsed
    state: dict[int, Outcome] = page.namespace.setdefault(_STATE, {})
    for earlier in page.blocks[: block.index + 1]:
        if earlier.index not in state and _evaluated(earlier):
            state[earlier.index] = _attempt(page, earlier, state)
    outcome = state[block.index]
    if outcome.status == "skipped":
        # reported at the page's item, not at this line
        raise pytest.skip.Exception(outcome.detail, _use_item_location=True)
    if outcome.status == "failed":
        raise AssertionError(f"{page.path}:{block.line}: {outcome.detail}")


def _evaluated(block: Block) -> bool:
    """Whether the block is an item (anything that runs or is compared, or says why not)."""
    return block.kind not in (SHOWN, OUT_UNCHECKED, SH_CI)


def parser(document: Document) -> Iterator[Region]:
    """Sybil's parser: one region per block that runs, is compared or says why not."""
    assert isinstance(document, Page)
    document.blocks = page_blocks(Path(document.path))
    for block in document.blocks:
        if _evaluated(block):
            yield Region(block.start, block.end, block, evaluate)


def _reset_cudamem() -> None:
    """The state a page leaves in cudamem's globals, reset as ``tests/conftest.py`` resets
    it for every test."""
    if "cudamem" not in sys.modules:
        return
    import importlib

    import cudamem
    from cudamem.spans import history as _history
    from cudamem.spans import state as _spans_state

    leaks: Any = importlib.import_module("cudamem.growth.detector")
    cudamem.configure_leaks()
    leaks._detector.reset()
    _spans_state._reset_state()
    cudamem.set_history_size(_history.DEFAULT_SIZE)
    cudamem.clear_history()


_CWD = "__docblocks_cwd__"


def setup(namespace: dict[str, Any]) -> None:
    """A page starts with cudamem's globals as a fresh process has them; the directory it
    starts in is restored after it (a page may ``os.chdir`` to a temporary one to write)."""
    _reset_cudamem()
    namespace[_CWD] = os.getcwd()


def teardown(namespace: dict[str, Any]) -> None:
    """A page's namespace goes with its last item (a later item of it runs the page again)."""
    cwd = namespace.get(_CWD)
    if cwd is not None:
        os.chdir(cwd)
    namespace.clear()
    namespace["__name__"] = "__main__"
    _reset_cudamem()
    gc.collect()


class _Sybil(Sybil):
    def should_parse(self, path: Path) -> bool:
        # ROOT is resolved; pytest's paths may go through a link to the checkout
        return super().should_parse(Path(path).resolve())


SYBIL = _Sybil(
    parsers=[parser],
    patterns=PATTERNS,
    path=str(ROOT),
    setup=setup,
    teardown=teardown,
    document_types={".md": Page},
    name="docs",
)


def mark_items(items: list[pytest.Item]) -> None:
    """GPU blocks carry pytest's ``cuda`` marker (``-m cuda`` selects them), and skip here
    without CUDA."""
    skip = None
    for item in items:
        example = getattr(item, "example", None)
        block = getattr(example, "parsed", None)
        if not isinstance(block, Block):
            continue
        gpu = "cuda" in block.marks or (
            block.follows is not None and "cuda" in item_page_block(example, block.follows).marks
        )
        if gpu:
            item.add_marker(pytest.mark.cuda)
            if skip is None:
                skip = pytest.mark.skip(reason="needs a CUDA GPU") if not has_cuda() else False
            if skip:
                item.add_marker(skip)


def item_page_block(example: Example, index: int) -> Block:
    page = example.document
    assert isinstance(page, Page)
    return page.blocks[index]


def main() -> int:
    total = counts()
    for kind in (
        PY_CPU,
        PY_EXTRA,
        PY_GPU,
        PY_NOT_RUN,
        HIDDEN,
        OUT_CHECKED,
        OUT_UNCHECKED,
        SHOWN,
        SH_CI,
        SH_RUN,
        SH_NOT_RUN,
    ):
        print(f"{total[kind]:4d}  {kind}")
    for path in pages():
        for b in page_blocks(path):
            if b.kind in (PY_NOT_RUN, SH_NOT_RUN, OUT_UNCHECKED):
                why = b.marks.get("not-run") or b.marks.get("unchecked")
                print(f"      {path.relative_to(ROOT)}:{b.line}: {b.kind}: {why}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Every code block of README.md and docs/ is a test (``tests/docblocks.py``): no page and no
```python block slips out, markers say why, and a shown output that the code does not print
fails."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests import docblocks as d

ROOT = d.ROOT


def test_every_page_is_collected() -> None:
    pages = d.pages()
    assert ROOT / "README.md" in pages
    assert {p.parent.name for p in pages} >= {"docs", "guide", "recipes", "seeds", "reference"}
    assert all(d.SYBIL.should_parse(p) for p in pages), [
        p for p in pages if not d.SYBIL.should_parse(p)
    ]


def test_every_python_block_runs_or_says_why_not() -> None:
    """A ```python block runs on the CPU, on a GPU (``cuda``), with its extra (``needs``), or
    is ``not-run`` with a reason; a ```sh block is run or says why not; parse errors (a marker
    that is not before a block, or does not fit it) fail here."""
    total = d.counts()
    print("\n" + "\n".join(f"{total[k]:4d}  {k}" for k in sorted(total)))
    blocks = [(p, b) for p in d.pages() for b in d.page_blocks(p)]
    python = [(p, b) for p, b in blocks if b.lang == "python"]
    assert python and all(
        b.kind in (d.PY_CPU, d.PY_GPU, d.PY_EXTRA, d.PY_NOT_RUN) for _, b in python
    )
    not_run = [(p, b) for p, b in python if b.kind == d.PY_NOT_RUN]
    assert all(b.marks["not-run"].strip() for _, b in not_run)
    # skips are the exception: a hidden set-up is the way to run a fragment
    assert len(not_run) <= 3, [f"{p.name}:{b.line}" for p, b in not_run]
    assert total[d.PY_CPU] >= len(python) // 2
    sh = [b for _, b in blocks if b.lang == "sh"]
    assert all(b.kind in (d.SH_CI, d.SH_RUN) or b.marks.get("not-run") for b in sh)
    langs = {b.lang for _, b in blocks}
    # mermaid: a picture (design.md's package map), shown, never run
    assert langs <= {"python", "hidden", "text", "sh", "mermaid"}, langs


def test_the_readme_commands_are_the_ci_blocks() -> None:
    readme = d.page_blocks(ROOT / "README.md")
    assert [b.marks["ci"].split()[0] for b in readme if b.kind == d.SH_CI] == ["demo", "tests"]


def test_pages_that_need_an_extra_run_again_in_ci_with_every_extra() -> None:
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    needing = {
        p.relative_to(ROOT).as_posix()
        for p in d.pages()
        if any("needs" in b.marks for b in d.page_blocks(p))
    }
    rerun = set(re.findall(r"docs/[\w/-]+\.md", ci))
    assert needing and needing <= rerun, needing - rerun


def test_ci_gpu_runs_the_gpu_blocks() -> None:
    gpu = (ROOT / ".ci" / "gpu").read_text(encoding="utf-8")
    assert re.search(r"^group docs \d+ README\.md docs\b", gpu, re.M)


PAGE = """\
# A page

<!-- invisible-code-block: python
x = 6
-->

```python
print(x * 7)
print("took 12.5 ms")
```

```text
42
took 3.1 ms
```

<!-- raises: ZeroDivisionError -->
```python
print("before")
1 / 0
```

```text
before
ZeroDivisionError: division by zero
```

<!-- cuda -->
```python
import torch
torch.ones(1, device="cuda")
```

```python
>>> print(x)
6
```
"""


def _run(path: Path) -> list[tuple[int, str]]:
    """(line, "ok", "skipped" or "failed") per item of the page, run in order."""
    document = d.SYBIL.parse(path)
    d.setup(document.namespace)
    results = []
    try:
        for example in document.examples():
            try:
                example.evaluate()
            except pytest.skip.Exception:
                results.append((example.line, "skipped"))
            except AssertionError:
                results.append((example.line, "failed"))
            else:
                results.append((example.line, "ok"))
    finally:
        d.teardown(document.namespace)
    return results


def test_a_page_runs_in_order_and_its_outputs_are_compared(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(PAGE, encoding="utf-8")
    kinds = [b.kind for b in d.parse_blocks(PAGE)]
    assert kinds == [d.HIDDEN, d.PY_CPU, d.OUT_CHECKED, d.PY_CPU, d.OUT_CHECKED, d.PY_GPU, d.PY_CPU]
    results = _run(page)
    gpu = "ok" if d.has_cuda() else "skipped"
    assert [r for _, r in results] == ["ok", "ok", "ok", "ok", "ok", gpu, "ok"]
    # the page's output no longer what the code prints: that block fails, the others run
    page.write_text(PAGE.replace("42\n", "41\n"), encoding="utf-8")
    assert [r for _, r in _run(page)].count("failed") == 1
    # a block that fails fails the blocks after it, naming it
    page.write_text(PAGE.replace("print(x * 7)", "print(y)"), encoding="utf-8")
    assert [r for _, r in _run(page)][1:5] == ["failed"] * 4


def test_a_block_run_alone_runs_the_blocks_above_it_first(tmp_path: Path) -> None:
    """xdist may give a worker only the end of a page: its namespace is built from the top."""
    page = tmp_path / "page.md"
    page.write_text(PAGE, encoding="utf-8")
    document = d.SYBIL.parse(page)
    last = list(document.examples())[-1]
    try:
        last.evaluate()  # x comes from the hidden block at the top
    finally:
        d.teardown(document.namespace)


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("<!-- cuda -->\n\nprose\n\n```python\npass\n```\n", "not followed by a block"),
        ("<!-- raises: ValueError -->\n```text\nx\n```\n", "do not fit"),
        ("```python\npass\n```\n\n<!-- unchecked: why -->\n", "not followed by a block"),
    ],
)
def test_a_misplaced_marker_is_an_error(text: str, error: str) -> None:
    with pytest.raises(d.DocsError, match=error):
        d.parse_blocks(text)

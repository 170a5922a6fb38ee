"""Every Python example of README.md and docs/*.md runs as written.

An example is a ```python block. A comment on the line before it changes how it is run:
``<!-- example: slow -->`` runs it only with SPARSEFOCUS_SLOW_EXAMPLES=1 (it takes minutes on a
CPU), ``<!-- example: skip REASON -->`` never runs it (it needs data or hardware CI lacks) and says
why, ``<!-- example: needs MODULE [MODULE ...] -->`` runs it only where those modules import (an
optional extra such as ``[hf]`` or ``[ray]``) and skips it, naming the module, elsewhere. Any other
example runs in a fresh namespace, so an unmarked example that breaks fails here.
"""

import os
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
MARK = re.compile(r"<!-- example: (slow|skip|needs)\s*(.*?)\s*-->\s*$")


def examples() -> list:
    found = []
    for page in PAGES:
        text = page.read_text()
        for match in FENCE.finditer(text):
            line = text.count("\n", 0, match.start()) + 1
            before = text[: match.start()].rstrip("\n").rsplit("\n", 1)[-1]
            mark = MARK.search(before)
            found.append(pytest.param(match.group(1), mark, id=f"{page.relative_to(ROOT)}:{line}"))
    return found


def test_the_pages_have_examples():
    assert len(examples()) >= 10


@pytest.mark.parametrize("code,mark", examples())
def test_example_runs_as_written(code, mark, tmp_path, monkeypatch):
    if mark is not None and mark.group(1) == "skip":
        pytest.skip(mark.group(2) or "marked skip")
    if mark is not None and mark.group(1) == "slow" and os.environ.get("SPARSEFOCUS_SLOW_EXAMPLES") != "1":
        pytest.skip("slow example (minutes on a CPU); SPARSEFOCUS_SLOW_EXAMPLES=1 runs it")
    if mark is not None and mark.group(1) == "needs":
        for module in mark.group(2).split():
            pytest.importorskip(module, reason=f"needs {module} (an optional extra)")
    monkeypatch.chdir(tmp_path)  # examples that write files write them here
    exec(compile(code, "<example>", "exec"), {"__name__": "__example__"})

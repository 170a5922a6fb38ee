"""Keep the generated pattern table of README.md and docs/patterns.md in step with the registry.

The table sits between ``<!-- catalogue: start -->`` and ``<!-- catalogue: end -->`` and is the
output of ``sparsefocus list --markdown``. Run from anywhere: ``python tools/build_readme.py``
rewrites the files; ``--check`` only reports (exit 1) when a table is out of date, as CI does.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FILES = [ROOT / "README.md", ROOT / "docs" / "patterns.md"]
START, END = "<!-- catalogue: start -->", "<!-- catalogue: end -->"


def catalogue() -> str:
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    command = [sys.executable, "-m", "sparsefocus.cli", "list", "--markdown"]
    return subprocess.run(command, capture_output=True, text=True, check=True, env=env).stdout.strip()


def with_table(text: str, table: str, path: Path) -> str:
    if START not in text or END not in text:
        raise SystemExit(f"{path}: no {START} ... {END} markers")
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{START}\n{table}\n{END}{tail}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="report out-of-date tables instead of rewriting them")
    args = parser.parse_args()
    table, stale = catalogue(), []
    for path in FILES:
        text = path.read_text()
        new = with_table(text, table, path)
        if new != text:
            stale.append(path)
            if not args.check:
                tmp = path.with_name(f".{path.name}.tmp")
                tmp.write_text(new)
                os.replace(tmp, path)
    if args.check and stale:
        print("out of date (run python tools/build_readme.py): " + ", ".join(str(p.relative_to(ROOT)) for p in stale))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

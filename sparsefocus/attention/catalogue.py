"""The catalogue of registered patterns: ``sparsefocus list`` and the README's pattern table."""

from __future__ import annotations

import argparse
import dataclasses

from sparsefocus.attention.patterns import PATTERNS, Pattern


def _parameters(cls: type[Pattern]) -> str:
    parts = []
    for field in dataclasses.fields(cls):
        default = "" if field.default is dataclasses.MISSING else f"={field.default}"
        parts.append(f"{field.name}{default}")
    return ", ".join(parts) or "-"


def catalogue_rows() -> list[dict[str, str]]:
    """One row per registered pattern: name, example, family, parameters, impls, time and memory cost."""
    rows = []
    for name in sorted(PATTERNS, key=lambda n: (PATTERNS[n].family, n)):
        cls = PATTERNS[name]
        rows.append(
            {
                "name": name,
                "example": cls.examples[0] if cls.examples else name,
                "family": cls.family,
                "parameters": _parameters(cls),
                "impls": ", ".join(cls.impls),
                "time": cls.cost[0],
                "memory": cls.cost[1],
            }
        )
    return rows


def catalogue_markdown() -> str:
    """The catalogue as a Markdown table."""
    header = "| pattern | example | family | parameters | impls | time | memory (lean) |\n|---|---|---|---|---|---|---|"
    lines = [
        f"| `{r['name']}` | `{r['example']}` | {r['family']} | {r['parameters']} | {r['impls']} | {r['time']} | {r['memory']} |"
        for r in catalogue_rows()
    ]
    return "\n".join([header, *lines])


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="sparsefocus list",
        description="List every registered pattern: name, family, parameters with defaults, cost.",
        epilog="A pattern is named by a spec such as TOPK:5, BAND:5(1) or zeta:k=32,dk=3.",
    )
    parser.add_argument("--markdown", action="store_true", help="print the table of the documentation (Markdown)")
    args = parser.parse_args(argv)
    if args.markdown:
        print(catalogue_markdown())
        return 0
    for row in catalogue_rows():
        print(f"{row['name']:<12} {row['family']:<15} {row['parameters']:<40} {row['time']}")
    return 0

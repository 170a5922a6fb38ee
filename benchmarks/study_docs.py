"""Write a finished study's committed record into ``docs/studies/<study>/``.

The study's own ``notes.md`` there (how the study was run, and our results beside the paper's
claims, written by hand) goes at the top of ``report.md``; then ``sparsefocus report`` writes
the tables, ``curves.png`` and ``summary.json`` (per mechanism and seed the per-epoch metrics,
the median curves and the speed-up statistics) from the experiment folder, and the dispersion
analysis (``sparsefocus analyze --seed paper``, if it was run into ``<experiment>/analysis``)
is copied beside them as ``dispersion.md`` / ``dispersion.json``, its run paths relative to the
repository (or, for an experiment folder outside it, starting at the folder's own name). With
``--reach`` and a dispersion analysis (the experiment's, or else the ``dispersion.json`` an earlier
call left in the docs folder), ``speed_dispersion.md`` / ``.png`` set each mechanism's learning
speed against its kept/all dispersion (``sparsefocus.analysis.speed_dispersion``).

Usage:
    sparsefocus analyze runs/even_pairs --seed paper      # optional: the dispersion table
    python benchmarks/study_docs.py runs/even_pairs docs/studies/nnch_even_pairs
    python benchmarks/study_docs.py EXPERIMENT docs/studies/listops_fig1a --reach 0.35  # with the paired table
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sparsefocus.analysis.speed_dispersion import write_speed_dispersion
from sparsefocus.train.checkpoint import write_text_atomic
from sparsefocus.train.report import write_report

ROOT = Path(__file__).resolve().parents[1]
COPIED = {"report.md": "report.md", "curves.png": "curves.png", "summary.json": "summary.json"}
ANALYSIS = {"analysis.md": "dispersion.md", "analysis.json": "dispersion.json"}


def copy_atomic(source: Path, target: Path) -> None:
    """Copy ``source`` to ``target`` through a temporary name in the target folder."""
    temporary = target.with_name(f".{target.name}.tmp")
    shutil.copyfile(source, temporary)
    temporary.replace(target)


def portable(text: str, experiment: Path, recorded: str = "", root: Path = ROOT) -> str:
    """``text`` with the experiment folder's path (absolute, and ``recorded``: as the analysis
    wrote it) replaced by the path relative to ``root`` where the folder lies inside it, else by
    the folder's name alone: a committed record names no place outside the repository. Spellings
    without a "/" (".", a bare name) are left alone: they name no place and match too much."""
    absolute = experiment.resolve()
    try:
        shown = absolute.relative_to(root.resolve()).as_posix()
    except ValueError:
        shown = absolute.name
    spellings = {spelling.rstrip("/") for spelling in (absolute.as_posix(), recorded)}
    for spelling in sorted((s for s in spellings if "/" in s), key=len, reverse=True):
        text = text.replace(spelling, shown)
    return text


def write_study(experiment: Path, out: Path, reach: float | None = None) -> list[Path]:
    """Report ``experiment`` with ``out/notes.md`` as its preface and copy the record into ``out``
    (``reach``: the held-out accuracy of the report's seed-paired table, none without it). An
    experiment kept inside ``out`` keeps no second copy of the report, curves and summary."""
    notes = out / "notes.md"
    if not notes.exists():
        raise ValueError(f"{notes} is missing: write how the study was run and what it found first")
    preface = [*notes.read_text().rstrip("\n").splitlines(), ""]
    write_report(experiment, preface=preface, reach=reach)
    written = []
    kept_inside = out.resolve() in experiment.resolve().parents  # docs/studies/<study>/experiment
    for source, target in COPIED.items():
        copy_atomic(experiment / source, out / target)
        written.append(out / target)
        if kept_inside:  # the record lives beside the kept runs once, not twice
            (experiment / source).unlink()
    analysis = experiment / "analysis"
    measured = json.loads((analysis / "analysis.json").read_text()) if (analysis / "analysis.json").exists() else None
    recorded = measured.get("run_dir", "") if measured is not None else ""
    for source, target in ANALYSIS.items():
        if (analysis / source).exists():
            write_text_atomic(out / target, portable((analysis / source).read_text(), experiment, recorded))
            written.append(out / target)
    if measured is None and (out / "dispersion.json").exists():  # the analysis an earlier call copied
        measured = json.loads((out / "dispersion.json").read_text())
    if reach is not None and measured is not None:
        written += write_speed_dispersion(json.loads((out / "summary.json").read_text()), measured, out)
    return written


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("experiment", type=Path, help="the finished experiment folder (holding experiment.yaml)")
    parser.add_argument("out", type=Path, help="the study's docs folder, holding its notes.md")
    parser.add_argument("--reach", type=float, metavar="ACC", help="sparsefocus report's --reach (the seed-paired table)")
    args = parser.parse_args()
    try:
        written = write_study(args.experiment, args.out, args.reach)
    except ValueError as error:
        print(f"study_docs: error: {error}", file=sys.stderr)
        return 2
    for path in written:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())

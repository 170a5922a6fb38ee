"""Compare the first epoch of a retrained NNCH study folder with a committed study summary.

Usage: python benchmarks/probes/first_epoch_compare.py STUDY_FOLDER SUMMARY_JSON OUT_STEM HEADER_JSON

HEADER_JSON: fields put first in the record (what, device, torch, commit, command).

Writes OUT_STEM.json (each run's first-epoch metrics, new and earlier, and their differences) and
OUT_STEM.png (the differences of training loss per fold position and mechanism).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from sparsefocus.train.config import load_config  # noqa: E402

METRICS = ("train_loss", "train_acc", "valid_loss", "valid_acc")


def first_epoch(run: Path) -> dict:
    line = json.loads(run.joinpath("metrics.jsonl").read_text().splitlines()[0])
    return {name: line[name] for name in METRICS}


def main(study: Path, summary_path: Path, stem: Path, header: dict) -> None:
    summary = json.loads(summary_path.read_text())
    mechanisms = summary["settings"]["default"]["mechanisms"]
    config = load_config(study / "experiment.yaml") if (study / "experiment.yaml").exists() else None
    seeds = config.seeds if config else [int(s) for s in next(iter(mechanisms.values()))["seeds"]]
    runs, largest = {}, {name: 0.0 for name in METRICS}
    for mechanism, entry in mechanisms.items():
        folder = next(p for p in (study / "default").iterdir() if p.name == _folder(mechanism))
        for position, seed in enumerate(seeds):
            new = first_epoch(folder / f"seed-{seed}")
            old = {name: entry["runs"][str(seed)][name][0] for name in METRICS}
            diff = {name: new[name] - old[name] for name in METRICS}
            for name in METRICS:
                largest[name] = max(largest[name], abs(diff[name]))
            runs[f"{mechanism}/{seed}"] = {"position": position, "new": new, "earlier": old, "difference": diff}
    record = {**header, "largest_abs_difference": largest, "runs": runs}
    stem.with_suffix(".json").write_text(json.dumps(record, indent=1) + "\n")
    figure, axis = plt.subplots(figsize=(7, 3.5))
    for mechanism in mechanisms:
        points = [(r["position"], r["difference"]["train_loss"]) for k, r in runs.items() if k.startswith(mechanism + "/")]
        axis.plot(*zip(*points), marker="o", linestyle="", label=mechanism)
    axis.axhline(0.0, color="grey", linewidth=0.5)
    axis.set_xlabel("position of the seed in the fold")
    axis.set_ylabel("first-epoch train loss: retrained - earlier")
    axis.legend(fontsize=7, ncol=3)
    figure.tight_layout()
    figure.savefig(stem.with_suffix(".png"), dpi=120)


def _folder(mechanism: str) -> str:
    return mechanism.replace(":", "-").replace("(", "-").replace(")", "")


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]), json.loads(sys.argv[4]))

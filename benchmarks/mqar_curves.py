"""Held-out accuracy and loss per epoch of an MQAR session's runs, finished or not (``sparsefocus
report`` leaves unfinished runs out).

Usage:  python benchmarks/mqar_curves.py SESSION_DIR [SESSION_DIR ...] OUT.png
Each SESSION_DIR holds ``run<i>.config.yaml`` and ``run<i>.metrics.jsonl`` as copied back by
``benchmarks/mqar_zeta_session.py``. Prints a Markdown table of selected epochs. Runs are named by
mechanism, with the seed added where one mechanism ran with several seeds; the legend drops the
part of the names that all runs share.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import yaml

EPOCHS_SHOWN = (1, 3, 5, 8, 10, 12, 15, 20, 25, 30, 33, 40, 49, 63, 64)


def load_runs(folders: list[Path]) -> dict[str, list[dict]]:
    """{run name: metrics rows} for every run<i>.metrics.jsonl in the folders."""
    found = []  # (mechanism, seed, rows)
    for folder in folders:
        for metrics in sorted(folder.glob("run*.metrics.jsonl")):
            config = yaml.safe_load((folder / metrics.name.replace(".metrics.jsonl", ".config.yaml")).read_text())
            rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
            found.append((str(config.get("mechanism") or metrics.stem), config.get("seed"), rows))
    mechanisms = [mechanism for mechanism, _, _ in found]
    return {mechanism + (f" seed={seed}" if mechanisms.count(mechanism) > 1 else ""): rows for mechanism, seed, rows in found}


def short_names(names: list[str]) -> list[str]:
    """Names without the comma-separated leading fields that all of them share."""
    if len(names) < 2:
        return names
    split = [name.split(",") for name in names]
    shared = 0
    while all(len(parts) > shared + 1 and parts[shared] == split[0][shared] for parts in split):
        shared += 1
    return [",".join(parts[shared:]) for parts in split]


def plot(runs: dict[str, list[dict]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for label, rows in zip(short_names(list(runs)), runs.values()):
        epochs = [r["epoch"] for r in rows]
        axes[0].plot(epochs, [r["valid_acc"] for r in rows], "o-", markersize=3, label=label[:48])
        axes[1].semilogy(epochs, [r["valid_loss"] for r in rows], "o-", markersize=3, label=label[:48])
    axes[0].axhline(0.99, color="grey", linestyle=":", label="99%")
    axes[0].set(xlabel="epoch", ylabel="held-out query accuracy", title="MQAR fig2_256")
    axes[1].set(xlabel="epoch", ylabel="held-out loss")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path + ".tmp.png", dpi=110)
    os.replace(path + ".tmp.png", path)


def table(runs: dict[str, list[dict]]) -> str:
    lines = ["| epoch | " + " | ".join(short_names(list(runs))) + " |", "|---" * (len(runs) + 1) + "|"]
    by_epoch = {label: {r["epoch"]: r["valid_acc"] for r in rows} for label, rows in runs.items()}
    for epoch in EPOCHS_SHOWN:
        cells = [f"{by_epoch[label][epoch]:.3f}" if epoch in by_epoch[label] else "" for label in runs]
        if any(cells):
            lines.append(f"| {epoch} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    if len(argv) < 2:
        raise SystemExit("usage: mqar_curves.py SESSION_DIR [SESSION_DIR ...] OUT.png")
    runs = load_runs([Path(folder) for folder in argv[:-1]])
    plot(runs, argv[-1])
    print(table(runs))


if __name__ == "__main__":
    main(sys.argv[1:])

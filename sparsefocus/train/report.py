"""``sparsefocus report RUN_DIR``: curves (median and 25-75% band over seeds) and Markdown tables.

Reads only the run folders (``config.yaml`` + ``metrics.jsonl``), so it works on a finished, a
running or an interrupted experiment. Writes ``report.md`` and one PNG per setting.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from sparsefocus.train.checkpoint import write_text_atomic

REFERENCE = "FULL"
CONVERGED = 0.95
EPOCH_BASES = (1, 0)  # 1: epochs counted from 1 (metrics.jsonl); 0: the paper's trfigs.py (row index)


@dataclass
class Curves:
    """Per-epoch metrics of one mechanism in one setting: arrays [seeds, epochs]."""

    label: str
    seeds: list[int]
    values: dict[str, np.ndarray]

    def median(self, key: str) -> np.ndarray:
        return np.median(self.values[key], axis=0)

    def quantiles(self, key: str) -> tuple[np.ndarray, np.ndarray]:
        return np.percentile(self.values[key], 25, axis=0), np.percentile(self.values[key], 75, axis=0)


def load_runs(root: Path) -> list[dict[str, Any]]:
    """Every run folder under ``root``: its record (config.yaml) plus ``metrics`` and ``complete``."""
    runs = []
    for record_path in sorted(root.rglob("config.yaml")):
        record = yaml.safe_load(record_path.read_text())
        metrics_path = record_path.parent / "metrics.jsonl"
        lines = metrics_path.read_text().splitlines() if metrics_path.exists() else []
        record["metrics"] = [json.loads(line) for line in lines if line.strip()]
        record["complete"] = len(record["metrics"]) >= record["config"]["train"]["epochs"]
        record["dir"] = str(record_path.parent)
        runs.append(record)
    return runs


def group_curves(runs: list[dict[str, Any]], order: list[str]) -> dict[str, dict[str, Curves]]:
    """setting -> mechanism label -> Curves over that group's complete runs, mechanisms in ``order``."""
    grouped: dict[str, dict[str, list[dict]]] = {}
    for run in runs:
        if run["complete"]:
            grouped.setdefault(run["setting"], {}).setdefault(run["label"], []).append(run)
    rank = {label: i for i, label in enumerate(order)}
    out: dict[str, dict[str, Curves]] = {}
    for setting, by_label in grouped.items():
        out[setting] = {}
        for label in sorted(by_label, key=lambda name: (rank.get(name, len(rank)), name)):
            members = sorted(by_label[label], key=lambda run: run["seed"])
            epochs = min(len(run["metrics"]) for run in members)
            keys = [k for k in members[0]["metrics"][0] if k != "epoch"]
            values = {k: np.array([[m[k] for m in run["metrics"][:epochs]] for run in members]) for k in keys}
            out[setting][label] = Curves(label, [run["seed"] for run in members], values)
    return out


def epochs_to_reach(curve: np.ndarray, target: float) -> int | None:
    """First epoch (1-based) at which ``curve`` is at or below ``target``; None if never."""
    hits = np.nonzero(curve <= target)[0]
    return int(hits[0]) + 1 if hits.size else None


def paper_speedup(full: np.ndarray, other: np.ndarray) -> dict[str, float]:
    """The Semantic Focus statistics on median training-loss curves v1 = FULL, v2 = other:
    max_i (v1[i] - v2[i]), max_i 100 (v1[i] - v2[i]) / v1[i], and the max speed-up
    max_i 100 #{j < i : v2[j] <= v1[i]} / (i + 1) (roughly the % of epochs saved to reach FULL's
    epoch-i loss), as in the paper's ``trfigs.py``."""
    length = min(full.size, other.size)
    v1, v2 = full[:length], other[:length]
    counts = [int(np.sum(v2[:i] <= v1[i])) for i in range(length)]
    speedups = [100.0 * c / (i + 1) for i, c in enumerate(counts)]
    best = int(np.argmax(speedups))
    return {
        "max_gap": float(np.max(v1 - v2)),
        "max_relative_gap": float(np.max(100.0 * (v1 - v2) / v1)),
        "max_speedup": speedups[best],
        "max_speedup_epoch": best + 1,
    }


def plot_curves(curves: dict[str, Curves], title: str, path: Path) -> None:
    """Two rows like the paper's figures: training loss (top) and held-out accuracy (bottom),
    median over seeds with the 25-75% band shaded."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (top, bottom) = plt.subplots(2, 1, figsize=(6.4, 6.4), sharex=True)
    for curve in curves.values():
        epochs = np.arange(1, curve.values["train_loss"].shape[1] + 1)
        for axis, key in ((top, "train_loss"), (bottom, "valid_acc")):
            low, high = curve.quantiles(key)
            (line,) = axis.plot(epochs, curve.median(key), label=f"{curve.label} ({len(curve.seeds)} seeds)")
            axis.fill_between(epochs, low, high, color=line.get_color(), alpha=0.2, linewidth=0)
    top.set_ylabel("training loss (cross-entropy)")
    top.set_yscale("log")
    bottom.set_ylabel("held-out accuracy")
    bottom.set_xlabel("epoch")
    top.set_title(title, fontsize=10)
    top.legend(fontsize=8)
    for axis in (top, bottom):
        axis.grid(alpha=0.3)
    figure.tight_layout()
    tmp = path.with_name(f".{path.name}.tmp.png")
    figure.savefig(tmp, dpi=110)
    plt.close(figure)
    tmp.replace(path)


def _iqr(values: np.ndarray, digits: int = 3) -> str:
    low, mid, high = np.percentile(values, [25, 50, 75])
    return f"{mid:.{digits}f} [{low:.{digits}f}, {high:.{digits}f}]"


def final_table(curves: dict[str, Curves], epoch_base: int = 1) -> list[str]:
    """Markdown rows of final metrics per mechanism: median [25%, 75%] over seeds. ``epoch_base``:
    the number of the first epoch in the convergence column (1, or 0 as the paper's code)."""
    counted = "" if epoch_base == 1 else ", counted from 0 as the paper"
    rows = [
        "| mechanism | seeds | final train loss | final held-out loss | final held-out acc "
        f"| best held-out acc (mean ± std) | epoch held-out acc >= {CONVERGED}{counted} (seeds reaching) | s/epoch |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for curve in curves.values():
        best = curve.values["valid_acc"].max(axis=1)
        rows.append(
            f"| {curve.label} | {len(curve.seeds)} | {_iqr(curve.values['train_loss'][:, -1])} "
            f"| {_iqr(curve.values['valid_loss'][:, -1])} | {_iqr(curve.values['valid_acc'][:, -1])} "
            f"| {best.mean():.3f} ± {best.std():.3f} | {_convergence(curve.values['valid_acc'], epoch_base)} "
            f"| {np.median(curve.values['seconds']):.2f} |"
        )
    return rows


def perplexity_table(curves: dict[str, Curves]) -> list[str]:
    """Markdown rows of final per-token perplexities (language-model tasks only; empty otherwise)."""
    if not all("valid_ppl" in curve.values for curve in curves.values()):
        return []
    has_test = all("test_ppl" in curve.values for curve in curves.values())
    rows = [
        "| mechanism | final held-out perplexity | best held-out perplexity |" + (" final test perplexity |" if has_test else ""),
        "|---|---|---|" + ("---|" if has_test else ""),
    ]
    for curve in curves.values():
        best = curve.values["valid_ppl"].min(axis=1)
        test = f" {_iqr(curve.values['test_ppl'][:, -1], 2)} |" if has_test else ""
        rows.append(f"| {curve.label} | {_iqr(curve.values['valid_ppl'][:, -1], 2)} | {_iqr(best, 2)} |{test}")
    return rows + [""]


def convergence_epoch(accuracy: np.ndarray, epoch_base: int = 1) -> int | None:
    """First epoch with accuracy >= 95% of one run's curve [epochs], or None if never. Epochs are
    counted from ``epoch_base``: 1 (the first epoch is epoch 1, as in metrics.jsonl) or 0 (the
    paper's ``trfigs.py`` reports the row index, one less)."""
    if epoch_base not in EPOCH_BASES:
        raise ValueError(f"epoch_base must be 1 or 0 (the paper's convention), got {epoch_base!r}")
    reached = epochs_to_reach(-accuracy, -CONVERGED)
    return None if reached is None else reached - 1 + epoch_base


def _convergence(accuracy: np.ndarray, epoch_base: int = 1) -> str:
    """The paper's convergence epoch: first epoch with held-out accuracy >= 95%, mean ± std over
    the seeds that reach it."""
    epochs = [convergence_epoch(row, epoch_base) for row in accuracy]
    reached = [e for e in epochs if e is not None]
    if not reached:
        return f"never (0/{len(epochs)})"
    return f"{np.mean(reached):.1f} ± {np.std(reached):.1f} ({len(reached)}/{len(epochs)})"


def speed_table(curves: dict[str, Curves]) -> list[str]:
    """Markdown rows: epochs for each mechanism's median training loss to reach the reference's
    (FULL's) final median training loss, the speed-up, and the paper's statistics."""
    reference = REFERENCE if REFERENCE in curves else next(iter(curves))
    full = curves[reference].median("train_loss")
    target = float(full[-1])
    full_epochs = epochs_to_reach(full, target)
    rows = [
        f"Target: {reference}'s final median training loss {target:.4f}, "
        f"which its median curve first reaches at epoch {full_epochs}.",
        "",
        f"| mechanism | epochs to reach target | speed-up over {reference} "
        "| paper's max speed-up (% epochs saved, at epoch) | max loss gap | max relative gap (%) |",
        "|---|---|---|---|---|---|",
    ]
    for curve in curves.values():
        median = curve.median("train_loss")
        reached = epochs_to_reach(median, target)
        speedup = f"{full_epochs / reached:.2f}x" if reached else "not reached"
        if curve.label == reference:
            rows.append(f"| {curve.label} | {reached} | {speedup} | (reference) | | |")
            continue
        stats = paper_speedup(full, median)
        rows.append(
            f"| {curve.label} | {reached if reached else '> ' + str(median.size)} | {speedup} "
            f"| {stats['max_speedup']:.1f} (epoch {stats['max_speedup_epoch']}) | {stats['max_gap']:.4f} "
            f"| {stats['max_relative_gap']:.1f} |"
        )
    return rows


def _summary(experiment: dict[str, Any]) -> list[str]:
    model, optim, train = experiment["model"], experiment["optim"], experiment["train"]
    task = ", ".join(f"{k}={v}" for k, v in experiment["task"].items())
    return [
        f"- task: {task}",
        f"- model: {model['blocks']} blocks, {model['heads']} heads, d={model['dim']}, d_mlp={model['mlp_dim']}, "
        f"{model['activation']}, dropout {model['dropout']}, {model['positions']} positions, {model['pooling']} pooling, "
        f"paper_mode={model['paper_mode']}, impl={model['impl']}",
        f"- optimiser: {optim['name']} lr {optim['lr']}, schedule {optim['schedule']} (decay {optim['decay']}), "
        f"clip {optim['grad_clip']}; {train['epochs']} epochs, batch {train['batch_size']}, train loss = {train['train_loss']}",
        f"- seeds: {', '.join(str(s) for s in experiment['seeds'])}",
    ]


def _setting_picture(setting: str, single: bool) -> str:
    from sparsefocus.train.experiment import slug

    return "curves.png" if single else f"curves-{slug(setting)}.png"


def write_report(
    root: "str | Path", *, preface: list[str] | None = None, epoch_base: int = 1
) -> tuple[Path, list[Path]]:
    """Write ``report.md`` and the curve PNGs of the experiment in ``root``; returns their paths.

    ``preface`` lines (e.g. the demo's measured wall-clock time) go under the title. ``epoch_base``:
    convergence epochs counted from 1 (default) or from 0 (the paper's ``trfigs.py``).
    """
    if epoch_base not in EPOCH_BASES:
        raise ValueError(f"epoch_base must be 1 or 0 (the paper's convention), got {epoch_base!r}")
    root = Path(root)
    experiment_path = root / "experiment.yaml"
    if not experiment_path.exists():
        raise ValueError(f"{root} is not an experiment folder: it has no experiment.yaml")
    experiment = yaml.safe_load(experiment_path.read_text())
    from sparsefocus.models.config import mechanism_label

    order = [mechanism_label(m) for m in experiment["mechanisms"]]
    runs = load_runs(root)
    grouped = group_curves(runs, order)
    lines = [f"# {experiment['name']}", "", *(preface or []), *_summary(experiment), ""]
    incomplete = [run["dir"] for run in runs if not run["complete"]]
    if incomplete:
        lines += [f"Left out, not finished ({len(incomplete)}): " + ", ".join(incomplete), ""]
    pictures = []
    for setting, curves in grouped.items():
        picture = root / _setting_picture(setting, len(grouped) == 1)
        plot_curves(curves, f"{experiment['name']} {'' if setting == 'default' else setting}".strip(), picture)
        pictures.append(picture)
        if setting != "default":
            lines += [f"## {setting}", ""]
        lines += [f"![curves]({picture.name})", "", "Final metrics, median [25%, 75%] over seeds:", ""]
        lines += final_table(curves, epoch_base) + [""] + perplexity_table(curves) + speed_table(curves) + [""]
    if not grouped:
        lines += ["No finished run yet.", ""]
    report = root / "report.md"
    write_text_atomic(report, "\n".join(lines))
    return report, pictures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="sparsefocus report", description="curves and tables of an experiment folder")
    parser.add_argument("run_dir", help="the experiment folder (holds experiment.yaml)")
    parser.add_argument(
        "--epoch-base", type=int, choices=EPOCH_BASES, default=1,
        help="number of the first epoch in the convergence column: 1 (default) or 0 (the paper's trfigs.py)",
    )
    args = parser.parse_args(argv)
    try:
        report, pictures = write_report(args.run_dir, epoch_base=args.epoch_base)
    except ValueError as error:
        print(f"error: {error}")
        return 2
    print(f"report: {report}")
    for picture in pictures:
        print(f"curves: {picture}")
    return 0

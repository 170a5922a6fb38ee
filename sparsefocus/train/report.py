"""``sparsefocus report RUN_DIR``: curves (median and 25-75% band over seeds) and Markdown tables.

Reads only the experiment folder (``experiment.yaml``, ``timing.json``) and the run folders
(``config.yaml``, ``metrics.jsonl``, ``timing.json``), so it works on a finished, a running or an
interrupted experiment, and writing it twice gives the same file. Writes ``report.md`` and one PNG
per setting. Speed-up statistics are shown only for curves that carry a learning signal.
"""

from __future__ import annotations

import argparse
import json
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from sparsefocus.train.checkpoint import write_text_atomic

REFERENCE = "FULL"
CONVERGED = 0.95
EPOCH_BASES = (1, 0)  # 1: epochs counted from 1 (metrics.jsonl); 0: the paper's trfigs.py (row index)
# A median training-loss curve that never falls this far below its epoch-1 value did not learn.
LOSS_DROP = 0.02
# Held-out accuracy within this many binomial standard errors of chance is noise.
CHANCE_SIGMAS = 3.0


@dataclass
class Curves:
    """Per-epoch metrics of one mechanism in one setting: arrays [seeds, epochs]."""

    label: str
    seeds: list[int]
    values: dict[str, np.ndarray]
    run_seconds: list[float] | None = None

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
        timing_path = record_path.parent / "timing.json"
        record["seconds"] = sum(s["seconds"] for s in json.loads(timing_path.read_text())) if timing_path.exists() else None
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
            seconds = [run["seconds"] for run in members]
            run_seconds = None if None in seconds else seconds
            out[setting][label] = Curves(label, [run["seed"] for run in members], values, run_seconds)
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
    from matplotlib.ticker import MaxNLocator

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
    bottom.xaxis.set_major_locator(MaxNLocator(integer=True))
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
        f"| best held-out acc (mean ± std) | epoch held-out acc >= {CONVERGED}{counted} (seeds reaching) | s/epoch | s/run |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for curve in curves.values():
        best = curve.values["valid_acc"].max(axis=1)
        rows.append(
            f"| {curve.label} | {len(curve.seeds)} | {_iqr(curve.values['train_loss'][:, -1])} "
            f"| {_iqr(curve.values['valid_loss'][:, -1])} | {_iqr(curve.values['valid_acc'][:, -1])} "
            f"| {best.mean():.3f} ± {best.std():.3f} | {_convergence(curve.values['valid_acc'], epoch_base)} "
            f"| {np.median(curve.values['seconds']):.2f} "
            f"| {f'{np.median(curve.run_seconds):.1f}' if curve.run_seconds else '–'} |"
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


def learned(curve: Curves, chance: tuple[float, float] | None) -> str | None:
    """None if the curve carries a learning signal, else why not: the median training loss never
    falls ``LOSS_DROP`` below its epoch-1 value, or the best median held-out accuracy stays within
    ``CHANCE_SIGMAS`` standard errors of ``chance`` = (accuracy of always guessing the most common
    target, number of held-out targets)."""
    loss = curve.median("train_loss")
    if loss.size < 2 or loss[1:].min() > (1 - LOSS_DROP) * loss[0]:
        return "no learning (loss never below its epoch-1 value)"
    if chance is not None:
        rate, count = chance
        if curve.median("valid_acc").max() <= rate + CHANCE_SIGMAS * np.sqrt(rate * (1 - rate) / max(count, 1)):
            return f"no learning (held-out accuracy within noise of chance, {rate:.3f})"
    return None


def chance_accuracy(task: dict[str, Any], seed: int) -> tuple[float, float] | None:
    """(share of the most common held-out target, number of held-out targets) of the task built with
    ``seed``; None when the task cannot be built here (e.g. a corpus that is not cached)."""
    from sparsefocus.train.config import make_task_config

    try:
        targets = make_task_config(task).build(seed).valid_targets.reshape(-1)
    except Exception:  # noqa: BLE001  (the report then judges by the loss alone)
        return None
    targets = targets[targets != -100]
    if targets.numel() == 0:
        return None
    counts = np.bincount(targets.cpu().numpy())
    return float(counts.max() / counts.sum()), float(counts.sum())


def speed_table(curves: dict[str, Curves], chance: tuple[float, float] | None = None) -> list[str]:
    """Markdown rows: epochs for each mechanism's median training loss to reach the reference's
    (FULL's) final median training loss, the speed-up, and the paper's statistics; a mechanism (or
    a reference) without a learning signal gets "no learning" instead of numbers."""
    reference = REFERENCE if REFERENCE in curves else next(iter(curves))
    full = curves[reference].median("train_loss")
    target = float(full[-1])
    full_epochs = epochs_to_reach(full, target)
    reference_flat = learned(curves[reference], chance)
    rows = [
        f"Target: {reference}'s final median training loss {target:.4f}, "
        f"which its median curve first reaches at epoch {full_epochs}."
        + (f" {reference}: {reference_flat}, so no speed-up is computed." if reference_flat else ""),
        "",
        f"| mechanism | epochs to reach target | speed-up over {reference} "
        "| paper's max speed-up (% epochs saved, at epoch) | max loss gap | max relative gap (%) |",
        "|---|---|---|---|---|---|",
    ]
    for curve in curves.values():
        median = curve.median("train_loss")
        reached = epochs_to_reach(median, target)
        flat = reference_flat if curve.label == reference else learned(curve, chance)
        if curve.label == reference:
            rows.append(f"| {curve.label} | {flat or reached} | (reference) | (reference) | | |")
        elif flat or reference_flat:
            rows.append(f"| {curve.label} | {flat or '–'} | – | – | | |")
        else:
            stats = paper_speedup(full, median)
            speedup = f"{full_epochs / reached:.2f}x" if reached and full_epochs else "not reached"
            rows.append(
                f"| {curve.label} | {reached if reached else '> ' + str(median.size)} | {speedup} "
                f"| {stats['max_speedup']:.1f} (epoch {stats['max_speedup_epoch']}) | {stats['max_gap']:.4f} "
                f"| {stats['max_relative_gap']:.1f} |"
            )
    return rows


MEANINGS = [
    "How to read the tables:",
    "",
    "- *final* values are those of the last epoch; *median [25%, 75%]* is over seeds.",
    f"- *epoch held-out acc >= {CONVERGED}*: the paper's convergence epoch, mean ± std over the seeds that reach it.",
    "- *s/epoch*: median seconds of one training epoch (evaluation excluded); *s/run*: median wall-clock "
    "seconds the trainer measured per run (data, model and evaluation included, summed over resumptions).",
    "- *epochs to reach target*: first epoch at which the mechanism's median training loss is at or below "
    "the reference's final one; *speed-up* = the reference's epochs / the mechanism's.",
    "- *paper's max speed-up*: max over epochs i of the share of epochs j < i where the mechanism's loss "
    "was already at or below the reference's loss at i (the Semantic Focus paper's statistic); *max loss gap* "
    "and *max relative gap*: the largest (reference - mechanism) training-loss difference, absolute and in %.",
    f"- *no learning*: the median training loss never falls {LOSS_DROP:.0%} below its epoch-1 value, or the "
    f"best median held-out accuracy stays within {CHANCE_SIGMAS:g} standard errors of chance (always guessing "
    "the most common target); speed-up statistics of such curves carry no signal and are not shown.",
    "",
]


def timing_lines(root: Path) -> list[str]:
    """The wall-clock time the trainer measured for the invocations that trained something."""
    path = root / "timing.json"
    if not path.exists():
        return []
    entries = json.loads(path.read_text())
    parts = [
        f"{e['seconds']:.0f} s on {e['date']} ({e['epochs']} epochs, {e['jobs']} runs at once, "
        f"{e['cpus']} CPU cores, torch {e['torch']})"
        for e in entries
    ]
    return [
        f"Wall-clock time measured by the trainer: {sum(e['seconds'] for e in entries):.0f} s in "
        f"{len(entries)} invocation{'s' if len(entries) > 1 else ''} that trained: " + "; ".join(parts) + ".",
        "",
    ]


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


def _title(experiment: dict[str, Any], setting: str) -> str:
    """A figure title that says what was trained: the experiment, its task and the setting."""
    task = experiment["task"]
    fields = ", ".join(f"{k}={v}" for k, v in task.items() if k != "name")
    title = f"{experiment['name']}: task {task.get('name', '?')}" + (f" ({fields})" if fields else "")
    return textwrap.fill(title + ("" if setting == "default" else f"\nsetting {setting}"), 70, replace_whitespace=False)


def _setting_picture(setting: str, single: bool) -> str:
    from sparsefocus.train.experiment import slug

    return "curves.png" if single else f"curves-{slug(setting)}.png"


def write_report(root: "str | Path", *, preface: list[str] | None = None, epoch_base: int = 1) -> tuple[Path, list[Path]]:
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
    lines = [f"# {experiment['name']}", "", *(preface or []), *timing_lines(root), *_summary(experiment), ""]
    incomplete = [run["dir"] for run in runs if not run["complete"]]
    if incomplete:
        lines += [f"Left out, not finished ({len(incomplete)}): " + ", ".join(incomplete), ""]
    pictures = []
    chances: dict[str, tuple[float, float] | None] = {}
    for setting, curves in grouped.items():
        task = next(run["config"]["task"] for run in runs if run["setting"] == setting)
        key = json.dumps(task, sort_keys=True)
        if key not in chances:
            chances[key] = chance_accuracy(task, experiment["seeds"][0])
        picture = root / _setting_picture(setting, len(grouped) == 1)
        plot_curves(curves, _title(experiment, setting), picture)
        pictures.append(picture)
        if setting != "default":
            lines += [f"## {setting}", ""]
        lines += [f"![curves]({picture.name})", "", "Final metrics, median [25%, 75%] over seeds:", ""]
        lines += final_table(curves, epoch_base) + [""] + perplexity_table(curves) + speed_table(curves, chances[key]) + [""]
    lines += MEANINGS if grouped else ["No finished run yet.", ""]
    report = root / "report.md"
    write_text_atomic(report, "\n".join(lines))
    return report, pictures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="sparsefocus report", description="Write report.md and the curves of an experiment folder (finished or not)."
    )
    parser.add_argument("run_dir", help="the experiment folder (the one holding experiment.yaml)")
    parser.add_argument(
        "--epoch-base",
        type=int,
        choices=EPOCH_BASES,
        default=1,
        help="number of the first epoch in the convergence column: 1 (default) or 0 (the paper's trfigs.py)",
    )
    args = parser.parse_args(argv)
    try:
        report, pictures = write_report(args.run_dir, epoch_base=args.epoch_base)
    except ValueError as error:
        print(f"sparsefocus report: error: {error}", file=sys.stderr)
        return 2
    print(f"report: {report}")
    for picture in pictures:
        print(f"curves: {picture}")
    return 0

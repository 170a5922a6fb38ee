"""``sparsefocus report RUN_DIR``: curves (median and 25-75% band over seeds), Markdown tables and
the same numbers as JSON.

Reads only the experiment folder (``experiment.yaml``, ``timing.json``) and the run folders
(``config.yaml``, ``metrics.jsonl``, ``timing.json``), so it works on a finished, a running or an
interrupted experiment, and writing it twice gives the same files. Writes ``report.md``, one PNG
per setting and ``summary.json`` (each setting's per-epoch curves and the tables' numbers, computed
once for both). Speed-up statistics are shown only for curves that carry a learning signal.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import textwrap
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from sparsefocus.train.checkpoint import write_text_atomic
from sparsefocus.train.paired import ReachRow, epochs_to_reach

REFERENCE = "FULL"
CONVERGED = 0.95
EPOCH_BASES = (1, 0)  # 1: epochs counted from 1 (metrics.jsonl); 0: the paper's trfigs.py (row index)
# A median training-loss curve that never falls this far below its epoch-1 value did not learn.
LOSS_DROP = 0.02
# Held-out accuracy within this many binomial standard errors of chance is noise.
CHANCE_SIGMAS = 3.0
# The per-epoch metrics summary.json keeps for every run (those a run's metrics.jsonl has).
CURVE_METRICS = ("train_loss", "train_acc", "valid_loss", "valid_acc")
SUMMARY_NAME = "summary.json"
TIMING_NAME = "timing.json"
# Keys an invocation's timing entry shares with the timing segments of the runs it trained.
CONTEXT_KEYS = ("date", "torch", "cpus", "threads", "jobs", "batched", "concurrent_groups")


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


def first_nonfinite_epoch(metrics: list[dict[str, Any]]) -> int | None:
    """The first epoch whose training or held-out loss is NaN or infinite (a diverged run, or a
    failed computation), or None."""
    for line in metrics:
        if not all(math.isfinite(line.get(key, 0.0)) for key in ("train_loss", "valid_loss")):
            return int(line["epoch"])
    return None


def load_runs(root: Path) -> list[dict[str, Any]]:
    """Every run folder under ``root``: its record (config.yaml) plus ``metrics``, ``complete``
    and ``nonfinite`` (``first_nonfinite_epoch``)."""
    runs = []
    for record_path in sorted(root.rglob("config.yaml")):
        record = yaml.safe_load(record_path.read_text())
        metrics_path = record_path.parent / "metrics.jsonl"
        lines = metrics_path.read_text().splitlines() if metrics_path.exists() else []
        record["metrics"] = [json.loads(line) for line in lines if line.strip()]
        record["complete"] = len(record["metrics"]) >= record["config"]["train"]["epochs"]
        record["nonfinite"] = first_nonfinite_epoch(record["metrics"])
        record["dir"] = str(record_path.parent)
        timing_path = record_path.parent / TIMING_NAME
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


def reference_label(curves: dict[str, Curves]) -> str:
    """The mechanism the others are compared with: FULL, else the first one."""
    return REFERENCE if REFERENCE in curves else next(iter(curves))


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


def convergence_epoch(accuracy: np.ndarray, epoch_base: int = 1) -> int | None:
    """First epoch with accuracy >= 95% of one run's curve [epochs], or None if never. Epochs are
    counted from ``epoch_base``: 1 (the first epoch is epoch 1, as in metrics.jsonl) or 0 (the
    paper's ``trfigs.py`` reports the row index, one less)."""
    if epoch_base not in EPOCH_BASES:
        raise ValueError(f"epoch_base must be 1 or 0 (the paper's convention), got {epoch_base!r}")
    reached = epochs_to_reach(-accuracy, -CONVERGED)
    return None if reached is None else reached - 1 + epoch_base


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


@dataclass(frozen=True)
class Quartiles:
    """The median and the 25% and 75% percentiles over seeds of one number."""

    median: float
    q25: float
    q75: float

    @classmethod
    def of(cls, values: np.ndarray) -> Quartiles:
        """Of ``values`` [seeds]."""
        low, mid, high = np.percentile(values, [25, 50, 75])
        return cls(float(mid), float(low), float(high))

    def text(self, digits: int = 3) -> str:
        return f"{self.median:.{digits}f} [{self.q25:.{digits}f}, {self.q75:.{digits}f}]"


@dataclass(frozen=True)
class Convergence:
    """The paper's convergence epoch of each seed (first epoch with held-out accuracy >=
    ``threshold``, counted from ``epoch_base``; None if never), and its mean and std over the
    ``reached`` seeds that get there (None when none does)."""

    threshold: float
    epoch_base: int
    epochs: list[int | None]
    reached: int
    mean: float | None
    std: float | None

    @classmethod
    def of(cls, accuracy: np.ndarray, epoch_base: int = 1) -> Convergence:
        """Of held-out accuracy [seeds, epochs]."""
        epochs = [convergence_epoch(row, epoch_base) for row in accuracy]
        reached = [epoch for epoch in epochs if epoch is not None]
        if not reached:
            return cls(CONVERGED, epoch_base, epochs, 0, None, None)
        return cls(CONVERGED, epoch_base, epochs, len(reached), float(np.mean(reached)), float(np.std(reached)))

    def text(self) -> str:
        if self.mean is None or self.std is None:
            return f"never (0/{len(self.epochs)})"
        return f"{self.mean:.1f} ± {self.std:.1f} ({self.reached}/{len(self.epochs)})"


@dataclass(frozen=True)
class MechanismStats:
    """One mechanism's numbers in the final-metrics and perplexity tables: ``final`` quartiles of
    the last epoch's ``CURVE_METRICS`` (those the runs have), the best held-out accuracy of each
    seed (mean and std), the convergence epoch, median seconds per epoch and per run (None when a
    run has no timing), and ``perplexity`` quartiles (language-model tasks; None otherwise)."""

    seeds: list[int]
    final: dict[str, Quartiles]
    best_valid_acc_mean: float
    best_valid_acc_std: float
    convergence: Convergence
    seconds_per_epoch: float
    seconds_per_run: float | None
    perplexity: dict[str, Quartiles] | None

    @classmethod
    def of(cls, curve: Curves, epoch_base: int = 1) -> MechanismStats:
        values = curve.values
        best = values["valid_acc"].max(axis=1)
        return cls(
            seeds=list(curve.seeds),
            final={key: Quartiles.of(values[key][:, -1]) for key in CURVE_METRICS if key in values},
            best_valid_acc_mean=float(best.mean()),
            best_valid_acc_std=float(best.std()),
            convergence=Convergence.of(values["valid_acc"], epoch_base),
            seconds_per_epoch=float(np.median(values["seconds"])),
            seconds_per_run=float(np.median(curve.run_seconds)) if curve.run_seconds else None,
            perplexity=_perplexity_stats(values),
        )


def _perplexity_stats(values: dict[str, np.ndarray]) -> dict[str, Quartiles] | None:
    """Final and best held-out perplexity (and final test perplexity when measured) over seeds."""
    if "valid_ppl" not in values:
        return None
    stats = {
        "final_valid": Quartiles.of(values["valid_ppl"][:, -1]),
        "best_valid": Quartiles.of(values["valid_ppl"].min(axis=1)),
    }
    if "test_ppl" in values:
        stats["final_test"] = Quartiles.of(values["test_ppl"][:, -1])
    return stats


@dataclass(frozen=True)
class SpeedRow:
    """One mechanism's median training loss against the reference's. ``verdict``: "no learning
    (...)" or None; ``compared``: whether the speed-up statistics were computed (not for the
    reference itself, nor when it or the mechanism did not learn). ``epochs``: length of the
    median curve; ``epochs_to_target``: first epoch at or below the target (None if never, or not
    shown); ``speedup``: the reference's epochs / the mechanism's (None if not reached); the rest
    are ``paper_speedup``'s."""

    reference: bool
    verdict: str | None
    compared: bool
    epochs: int
    epochs_to_target: int | None
    speedup: float | None = None
    max_speedup: float | None = None
    max_speedup_epoch: int | None = None
    max_gap: float | None = None
    max_relative_gap: float | None = None


@dataclass(frozen=True)
class SpeedStats:
    """The speed-up table of one setting: the reference mechanism, the target (its final median
    training loss), the epoch its median curve first reaches it, its verdict and one row per mechanism."""

    reference: str
    target_train_loss: float
    reference_epochs_to_target: int | None
    reference_verdict: str | None
    rows: dict[str, SpeedRow]

    @classmethod
    def of(cls, curves: dict[str, Curves], chance: tuple[float, float] | None = None) -> SpeedStats:
        """``chance``: as for ``learned``. The reference is FULL, else the first mechanism."""
        reference = reference_label(curves)
        full = curves[reference].median("train_loss")
        target = float(full[-1])
        full_epochs = epochs_to_reach(full, target)
        reference_flat = learned(curves[reference], chance)
        rows = {}
        for label, curve in curves.items():
            median = curve.median("train_loss")
            reached = epochs_to_reach(median, target)
            if label == reference:
                rows[label] = SpeedRow(True, reference_flat, False, median.size, None if reference_flat else reached)
                continue
            flat = learned(curve, chance)
            if flat or reference_flat:
                rows[label] = SpeedRow(False, flat, False, median.size, None)
                continue
            rows[label] = _compared_row(full, median, full_epochs, reached)
        return cls(reference, target, full_epochs, reference_flat, rows)


def _compared_row(full: np.ndarray, median: np.ndarray, full_epochs: int | None, reached: int | None) -> SpeedRow:
    """The speed-up row of a mechanism whose median training loss [epochs] (``median``, first at
    the target at epoch ``reached``) is compared with the reference's (``full``, ``full_epochs``)."""
    stats = paper_speedup(full, median)
    return SpeedRow(
        reference=False,
        verdict=None,
        compared=True,
        epochs=median.size,
        epochs_to_target=reached,
        speedup=full_epochs / reached if reached and full_epochs else None,
        max_speedup=stats["max_speedup"],
        max_speedup_epoch=int(stats["max_speedup_epoch"]),
        max_gap=stats["max_gap"],
        max_relative_gap=stats["max_relative_gap"],
    )


@dataclass(frozen=True)
class SettingStats:
    """Everything report.md's tables and summary.json show for one setting, computed once;
    ``reach``: the seed-paired first epochs at a held-out accuracy (None unless asked for)."""

    mechanisms: dict[str, MechanismStats]
    speed: SpeedStats
    reach: dict[str, ReachRow] | None = None

    @classmethod
    def of(
        cls,
        curves: dict[str, Curves],
        epoch_base: int = 1,
        chance: tuple[float, float] | None = None,
        reach: float | None = None,
    ) -> SettingStats:
        mechanisms = {label: MechanismStats.of(curve, epoch_base) for label, curve in curves.items()}
        return cls(mechanisms, SpeedStats.of(curves, chance), None if reach is None else reach_stats(curves, reach))


def reach_stats(curves: dict[str, Curves], threshold: float) -> dict[str, ReachRow]:
    """Per mechanism the first epochs at held-out accuracy >= ``threshold``, each compared seed by
    seed with the reference's (FULL, else the first mechanism)."""
    rows = {label: ReachRow.of(curve.seeds, curve.values["valid_acc"], threshold) for label, curve in curves.items()}
    reference = reference_label(curves)
    horizon = max(curve.values["valid_acc"].shape[1] for curve in curves.values())
    return {label: row if label == reference else row.against(rows[reference], horizon) for label, row in rows.items()}


def reach_rows(rows: dict[str, ReachRow], reference: str) -> list[str]:
    """Markdown rows of ``reach_stats``: per mechanism the first epochs at the threshold and the
    seed-by-seed comparison with ``reference``."""
    threshold = next(iter(rows.values())).threshold
    lines = [
        f"First epoch at held-out accuracy >= {threshold:g}, seed by seed against {reference} on the same seed:",
        "",
        f"| mechanism | median [first, last] (seeds reaching) | seeds earlier / later / same as {reference} | signed-rank p |",
        "|---|---|---|---|",
    ]
    for label, row in rows.items():
        if label == reference:
            lines.append(f"| {label} | {row.text()} | (reference) | |")
            continue
        if row.earlier is None:
            lines.append(f"| {label} | {row.text()} | no seed shared with {reference} | |")
            continue
        p_value = "–" if row.p_value is None else f"{row.p_value:.3g}"
        lines.append(f"| {label} | {row.text()} | {row.earlier} / {row.later} / {row.same} | {p_value} |")
    return lines + [""]


def final_rows(stats: dict[str, MechanismStats], epoch_base: int = 1) -> list[str]:
    """Markdown rows of final metrics per mechanism (label -> its stats): median [25%, 75%] over
    seeds. ``epoch_base``: the number of the first epoch in the convergence column (1, or 0 as the
    paper's code)."""
    counted = "" if epoch_base == 1 else ", counted from 0 as the paper"
    rows = [
        "| mechanism | seeds | final train loss | final held-out loss | final held-out acc "
        f"| best held-out acc (mean ± std) | epoch held-out acc >= {CONVERGED}{counted} (seeds reaching) | s/epoch | s/run |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for label, row in stats.items():
        run = "–" if row.seconds_per_run is None else f"{row.seconds_per_run:.1f}"
        rows.append(
            f"| {label} | {len(row.seeds)} | {row.final['train_loss'].text()} "
            f"| {row.final['valid_loss'].text()} | {row.final['valid_acc'].text()} "
            f"| {row.best_valid_acc_mean:.3f} ± {row.best_valid_acc_std:.3f} | {row.convergence.text()} "
            f"| {row.seconds_per_epoch:.2f} | {run} |"
        )
    return rows


def final_table(curves: dict[str, Curves], epoch_base: int = 1) -> list[str]:
    """``final_rows`` of ``curves`` (label -> Curves)."""
    return final_rows({label: MechanismStats.of(curve, epoch_base) for label, curve in curves.items()}, epoch_base)


def perplexity_rows(stats: dict[str, MechanismStats]) -> list[str]:
    """Markdown rows of final per-token perplexities (language-model tasks only; empty otherwise)."""
    tables = [row.perplexity for row in stats.values()]
    if not all(tables):
        return []
    has_test = all("final_test" in table for table in tables if table)
    rows = [
        "| mechanism | final held-out perplexity | best held-out perplexity |" + (" final test perplexity |" if has_test else ""),
        "|---|---|---|" + ("---|" if has_test else ""),
    ]
    for label, table in zip(stats, tables):
        assert table is not None
        test = f" {table['final_test'].text(2)} |" if has_test else ""
        rows.append(f"| {label} | {table['final_valid'].text(2)} | {table['best_valid'].text(2)} |{test}")
    return rows + [""]


def perplexity_table(curves: dict[str, Curves]) -> list[str]:
    """``perplexity_rows`` of ``curves`` (label -> Curves)."""
    return perplexity_rows({label: MechanismStats.of(curve) for label, curve in curves.items()})


def speed_rows(speed: SpeedStats) -> list[str]:
    """Markdown rows: epochs for each mechanism's median training loss to reach the reference's
    final median training loss, the speed-up, and the paper's statistics; a mechanism (or a
    reference) without a learning signal gets "no learning" instead of numbers."""
    reference, flat = speed.reference, speed.reference_verdict
    rows = [
        f"Target: {reference}'s final median training loss {speed.target_train_loss:.4f}, "
        f"which its median curve first reaches at epoch {speed.reference_epochs_to_target}."
        + (f" {reference}: {flat}, so no speed-up is computed." if flat else ""),
        "",
        f"| mechanism | epochs to reach target | speed-up over {reference} "
        "| paper's max speed-up (% epochs saved, at epoch) | max loss gap | max relative gap (%) |",
        "|---|---|---|---|---|---|",
    ]
    return rows + [_speed_row_text(label, row) for label, row in speed.rows.items()]


def _speed_row_text(label: str, row: SpeedRow) -> str:
    if row.reference:
        return f"| {label} | {row.verdict or row.epochs_to_target} | (reference) | (reference) | | |"
    if not row.compared:
        return f"| {label} | {row.verdict or '–'} | – | – | | |"
    reached = row.epochs_to_target if row.epochs_to_target else f"> {row.epochs}"
    speedup = "not reached" if row.speedup is None else f"{row.speedup:.2f}x"
    return (
        f"| {label} | {reached} | {speedup} | {row.max_speedup:.1f} (epoch {row.max_speedup_epoch}) "
        f"| {row.max_gap:.4f} | {row.max_relative_gap:.1f} |"
    )


def speed_table(curves: dict[str, Curves], chance: tuple[float, float] | None = None) -> list[str]:
    """``speed_rows`` of ``curves`` (label -> Curves) against FULL (else the first mechanism);
    ``chance``: as for ``learned``."""
    return speed_rows(SpeedStats.of(curves, chance))


def plot_curves(curves: dict[str, Curves], title: str, path: Path, names: dict[str, str] | None = None) -> None:
    """Two rows like the paper's figures: training loss (top) and held-out accuracy (bottom),
    median over seeds with the 25-75% band shaded. The legend sits below both, one entry per
    mechanism, named as ``names`` says (label -> the spec as the experiment wrote it; default: the
    label); beyond ten mechanisms the colours come from a 20-colour map, so none repeats."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    names = names or {}
    columns = 1 if len(curves) <= 4 else 2
    legend_rows = -(-len(curves) // columns)
    figure, (top, bottom) = plt.subplots(2, 1, figsize=(6.4, 6.0 + 0.17 * legend_rows), sharex=True)
    palette = plt.get_cmap("tab10" if len(curves) <= 10 else "tab20")
    colours = [palette(i) for i in range(palette.N)]  # the qualitative map's own colours, in order
    for index, curve in enumerate(curves.values()):
        epochs = np.arange(1, curve.values["train_loss"].shape[1] + 1)
        colour = colours[index % len(colours)]
        for axis, key in ((top, "train_loss"), (bottom, "valid_acc")):
            low, high = curve.quantiles(key)
            name = f"{names.get(curve.label, curve.label)} ({len(curve.seeds)} seeds)"
            axis.plot(epochs, curve.median(key), color=colour, label=name)
            axis.fill_between(epochs, low, high, color=colour, alpha=0.2, linewidth=0)
    top.set_ylabel("training loss (cross-entropy)")
    top.set_yscale("log")
    bottom.set_ylabel("held-out accuracy")
    bottom.set_xlabel("epoch")
    bottom.xaxis.set_major_locator(MaxNLocator(integer=True))
    top.set_title(title, fontsize=10)
    for axis in (top, bottom):
        axis.grid(alpha=0.3)
    handles, labels = top.get_legend_handles_labels()
    figure.legend(handles, labels, loc="lower center", ncol=columns, fontsize=7, frameon=False)
    figure.tight_layout(rect=(0.0, legend_rows * 0.17 / figure.get_figheight() + 0.01, 1.0, 1.0))  # room below for it
    save_png(figure, path, dpi=110, tight=True)  # long mechanism names may be wider than the axes


def save_png(figure, path: Path, dpi: int, tight: bool = False) -> None:
    """Save a matplotlib figure at ``path`` through a temporary name, then close it; ``tight``
    grows the canvas to whatever is drawn outside it (a wide legend)."""
    import matplotlib.pyplot as plt

    tmp = path.with_name(f".{path.name}.tmp.png")
    figure.savefig(tmp, dpi=dpi, bbox_inches="tight" if tight else None)
    plt.close(figure)
    tmp.replace(path)


MEANINGS = [
    "How to read the tables:",
    "",
    "- *final* values are those of the last epoch; *median [25%, 75%]* is over seeds.",
    f"- *epoch held-out acc >= {CONVERGED}*: the paper's convergence epoch, mean ± std over the seeds that reach it.",
    "- *s/epoch*: median seconds of one training epoch (evaluation excluded); *s/run*: median wall-clock "
    "seconds the trainer measured per run (data, model and evaluation included, summed over resumptions); "
    "in batched training a run's time is that of the model its seeds were folded into, and with concurrent "
    "groups the wall-clock time is shared by the models that trained at once.",
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
REACH_MEANING = [
    "- *first epoch at held-out accuracy*: per seed, the first epoch at or above the threshold; *seeds "
    "earlier / later / same*: seeds on which the mechanism gets there before, after or at the reference's "
    "epoch on the same seed (a seed that never gets there counts as one epoch after the last); *signed-rank "
    "p*: the exact two-sided Wilcoxon signed-rank test of those per-seed differences (zeros dropped).",
    "",
]


def timing_lines(root: Path) -> list[str]:
    """The wall-clock time the trainer measured for the invocations that trained something, each
    with how its runs shared the machine (parallel runs, or folded seeds and concurrent models)."""
    path = root / TIMING_NAME
    if not path.exists():
        return []
    entries = json.loads(path.read_text())
    segments = _run_segments(root)
    parts = [
        f"{e['seconds']:.0f} s on {e['date']} ({e['epochs']} epochs, {_how_runs_shared(e, segments)}, "
        f"{e['cpus']} CPU cores, torch {e['torch']})"
        for e in entries
    ]
    return [
        f"Wall-clock time measured by the trainer: {sum(e['seconds'] for e in entries):.0f} s in "
        f"{len(entries)} invocation{'s' if len(entries) > 1 else ''} that trained: " + "; ".join(parts) + ".",
        "",
    ]


def _run_segments(root: Path) -> list[dict[str, Any]]:
    """Every segment of the run folders' timing.json files under ``root`` (not root's own)."""
    segments: list[dict[str, Any]] = []
    for path in sorted(root.rglob(TIMING_NAME)):
        if path.parent != root:
            segments += json.loads(path.read_text())
    return segments


def _how_runs_shared(entry: dict[str, Any], segments: list[dict[str, Any]]) -> str:
    """ "N runs at once", or for batched training "batched: R seeds folded per model, G models at
    once", R read from the run segments. Entries written before they recorded ``batched`` count
    as batched when their run segments record folded seeds (only the batched loop writes those)."""
    same = _same_context(entry, [segment for segment in segments if "folded_runs" in segment])
    if not (entry.get("batched") or same):
        return f"{entry['jobs']} runs at once"
    recorded = [int(segment["concurrent_groups"]) for segment in same if "concurrent_groups" in segment]
    groups = int(entry.get("concurrent_groups", max(recorded, default=1)))
    folded = _folded_runs(entry, segments)
    return "batched: " + (f"{folded}, " if folded else "") + f"{groups} model{'s' if groups != 1 else ''} at once"


def _same_context(entry: dict[str, Any], segments: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The segments written with the invocation's context (date, torch, cores, ...)."""
    return [segment for segment in segments if all(segment.get(key) == entry[key] for key in CONTEXT_KEYS if key in entry)]


def _folded_runs(entry: dict[str, Any], segments: list[dict[str, Any]]) -> str | None:
    """ "R seeds folded per model" (a range when groups differ, e.g. after an interruption), from
    the run segments that share the invocation's context (any run segment if none does); None if
    no segment records ``folded_runs``."""
    folded = [segment for segment in segments if "folded_runs" in segment]
    same = _same_context(entry, folded)
    counts = sorted({int(segment["folded_runs"]) for segment in same or folded})
    if not counts:
        return None
    span = str(counts[0]) if len(counts) == 1 else f"{counts[0]}–{counts[-1]}"
    return f"{span} seed{'s' if counts[-1] != 1 else ''} folded per model"


def _setup_lines(experiment: dict[str, Any]) -> list[str]:
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


def _plain(value: Any) -> Any:
    """``value`` with numpy numbers and arrays as plain Python ones, floats rounded to 6
    significant digits and NaN or infinities as None, so that JSON needs no NaN."""
    if isinstance(value, dict):
        return {str(key): _plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    if isinstance(value, np.ndarray):
        return _plain(value.tolist())
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if isinstance(value, (int, np.integer)):
        return int(value)
    if isinstance(value, (float, np.floating)):
        return float(f"{value:.6g}") if math.isfinite(value) else None
    return value


def curve_summary(curve: Curves) -> dict[str, Any]:
    """One mechanism's per-epoch ``CURVE_METRICS``: ``runs`` (seed -> metric -> [epochs]) and the
    ``median``, ``q25`` and ``q75`` over seeds that its curves draw."""
    keys = [key for key in CURVE_METRICS if key in curve.values]
    bands = {key: curve.quantiles(key) for key in keys}
    return {
        "seeds": list(curve.seeds),
        "runs": {str(seed): {key: curve.values[key][row] for key in keys} for row, seed in enumerate(curve.seeds)},
        "median": {key: curve.median(key) for key in keys},
        "q25": {key: bands[key][0] for key in keys},
        "q75": {key: bands[key][1] for key in keys},
    }


def setting_summary(curves: dict[str, Curves], stats: SettingStats) -> dict[str, Any]:
    """summary.json's entry for one setting: the speed-up target, and per mechanism its curves, its
    table numbers and its speed-up row (``stats``, the numbers report.md shows)."""
    speed = asdict(stats.speed)
    rows = speed.pop("rows")
    mechanisms = {
        label: {**curve_summary(curve), **asdict(stats.mechanisms[label]), "speed": rows[label]}
        | ({"reach": asdict(stats.reach[label])} if stats.reach else {})
        for label, curve in curves.items()
    }
    return _plain({**speed, "mechanisms": mechanisms})


def summary_text(experiment: dict[str, Any], epoch_base: int, incomplete: list[str], settings: dict[str, Any]) -> str:
    """summary.json: the experiment's name and task, the convergence epoch base, the unfinished
    runs (left out, as in report.md) and ``settings`` (setting -> ``setting_summary``)."""
    summary = {
        "experiment": experiment["name"],
        "task": experiment["task"],
        "epoch_base": epoch_base,
        "incomplete": incomplete,
        "settings": settings,
    }
    return _json_text(_plain(summary)) + "\n"


def _json_text(value: Any, depth: int = 0) -> str:
    """JSON of ``value`` indented by one space per level, except that a list of plain values stays
    on one line (a curve of 6000 epochs is one line, not 6000). Refuses NaN and infinities."""
    pad = " " * (depth + 1)
    if isinstance(value, dict) and value:
        items = [f"{pad}{json.dumps(key)}: {_json_text(item, depth + 1)}" for key, item in value.items()]
        return "{\n" + ",\n".join(items) + "\n" + " " * depth + "}"
    if isinstance(value, list) and any(isinstance(item, (dict, list)) for item in value):
        items = [pad + _json_text(item, depth + 1) for item in value]
        return "[\n" + ",\n".join(items) + "\n" + " " * depth + "]"
    return json.dumps(value, allow_nan=False)


def write_report(
    root: "str | Path", *, preface: list[str] | None = None, epoch_base: int = 1, reach: float | None = None
) -> tuple[Path, list[Path]]:
    """Write ``report.md``, the curve PNGs and ``summary.json`` of the experiment in ``root``;
    returns the paths of report.md and the PNGs (summary.json lies beside report.md).

    ``preface`` lines (e.g. the demo's measured wall-clock time) go under the title. ``epoch_base``:
    convergence epochs counted from 1 (default) or from 0 (the paper's ``trfigs.py``). ``reach``: a
    held-out accuracy in (0, 1]; adds the seed-paired table of the first epochs at it (``paired``).
    """
    if epoch_base not in EPOCH_BASES:
        raise ValueError(f"epoch_base must be 1 or 0 (the paper's convention), got {epoch_base!r}")
    if reach is not None and not 0 < reach <= 1:
        raise ValueError(f"reach must be a held-out accuracy in (0, 1], got {reach!r}")
    root = Path(root)
    experiment_path = root / "experiment.yaml"
    if not experiment_path.exists():
        raise ValueError(f"{root} is not an experiment folder: it has no experiment.yaml")
    experiment = yaml.safe_load(experiment_path.read_text())
    from sparsefocus.models.config import mechanism_label

    runs = load_runs(root)
    names = {mechanism_label(m): str(m) for m in experiment["mechanisms"]}  # label -> the spec as written
    grouped = group_curves(runs, list(names))
    lines = [f"# {experiment['name']}", "", *(preface or []), *timing_lines(root), *_setup_lines(experiment), ""]
    incomplete = [run["dir"] for run in runs if not run["complete"]]
    if incomplete:
        lines += [f"Left out, not finished ({len(incomplete)}): " + ", ".join(incomplete), ""]
    nonfinite = [f"{run['dir']} (from epoch {run['nonfinite']})" for run in runs if run["nonfinite"] is not None]
    if nonfinite:
        lines += ["**Non-finite loss** (the curves keep it as written): " + ", ".join(nonfinite), ""]
    pictures, settings = [], {}
    chances: dict[str, tuple[float, float] | None] = {}
    for setting, curves in grouped.items():
        task = next(run["config"]["task"] for run in runs if run["setting"] == setting)
        key = json.dumps(task, sort_keys=True)
        if key not in chances:
            chances[key] = chance_accuracy(task, experiment["seeds"][0])
        picture = root / _setting_picture(setting, len(grouped) == 1)
        plot_curves(curves, _title(experiment, setting), picture, names)
        pictures.append(picture)
        stats = SettingStats.of(curves, epoch_base, chances[key], reach)
        lines += _setting_lines(setting, picture, stats, epoch_base)
        settings[setting] = setting_summary(curves, stats)
    meanings = MEANINGS if reach is None else MEANINGS[:-1] + REACH_MEANING  # the reach item joins the list
    lines += meanings if grouped else ["No finished run yet.", ""]
    report = root / "report.md"
    write_text_atomic(report, "\n".join(lines))
    relative = [Path(folder).relative_to(root).as_posix() for folder in incomplete]
    write_text_atomic(root / SUMMARY_NAME, summary_text(experiment, epoch_base, relative, settings))
    return report, pictures


def _setting_lines(setting: str, picture: Path, stats: SettingStats, epoch_base: int) -> list[str]:
    """report.md's section of one setting: its heading (none for the only, default setting), the
    curves and the three tables."""
    lines = [] if setting == "default" else [f"## {setting}", ""]
    lines += [f"![curves]({picture.name})", "", "Final metrics, median [25%, 75%] over seeds:", ""]
    return (
        lines
        + final_rows(stats.mechanisms, epoch_base)
        + [""]
        + perplexity_rows(stats.mechanisms)
        + speed_rows(stats.speed)
        + [""]
        + (reach_rows(stats.reach, stats.speed.reference) if stats.reach else [])
    )


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
    parser.add_argument(
        "--reach",
        type=float,
        metavar="ACC",
        help="also tabulate each seed's first epoch at held-out accuracy >= ACC, against FULL's on the same seed",
    )
    args = parser.parse_args(argv)
    try:
        report, pictures = write_report(args.run_dir, epoch_base=args.epoch_base, reach=args.reach)
    except ValueError as error:
        print(f"sparsefocus report: error: {error}", file=sys.stderr)
        return 2
    print(f"report: {report}")
    for picture in pictures:
        print(f"curves: {picture}")
    return 0

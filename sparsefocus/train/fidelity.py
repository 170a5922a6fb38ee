"""Does a precision (or any other setting) change the curves? Compare two experiments' runs.

``sparsefocus fidelity REFERENCE CHOSEN`` reads the run folders of two experiment folders (for
example the same study at fp32 and in bf16) and asks, per setting, mechanism and metric, whether
the chosen experiment's curves stay within the seed spread of the reference's: at each epoch
both have, is the median over the chosen seeds inside [min, max] over the reference seeds? It
also asks the reverse (the reference median inside the chosen seeds' range), and reports how far
outside the median went at its worst. Unfinished runs count with the epochs they have; the
comparison runs over the epochs every compared run has.

Writes ``fidelity.json`` and ``fidelity.png`` (per mechanism and metric: both seed ranges and
medians) into ``--out`` (default: the chosen experiment folder) and prints a table.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

from sparsefocus.train.checkpoint import write_text_atomic
from sparsefocus.train.report import load_runs, save_png

METRICS = ("train_loss", "valid_acc")


def seed_curves(runs: list[dict[str, Any]], metric: str) -> dict[tuple[str, str], dict[int, list[float]]]:
    """(setting, mechanism label) -> seed -> the run's per-epoch ``metric`` (as far as it got), from
    ``load_runs`` records."""
    out: dict[tuple[str, str], dict[int, list[float]]] = {}
    for run in runs:
        values = [line[metric] for line in run["metrics"] if metric in line]
        if values:
            out.setdefault((run["setting"], run["label"]), {})[int(run["seed"])] = values
    return out


def _rounded(values: np.ndarray) -> list[float]:
    return [round(float(x), 6) for x in values]


def compare_group(reference: dict[int, list[float]], chosen: dict[int, list[float]]) -> dict[str, Any]:
    """The spread check of one (setting, mechanism, metric): per-seed curves of both sides.

    Raises:
        ValueError: fewer than two reference seeds (no spread), or no epoch in common.
    """
    if len(reference) < 2:
        raise ValueError(f"the seed spread needs at least 2 reference seeds, got {len(reference)}")
    epochs = min(len(v) for v in [*reference.values(), *chosen.values()])
    if epochs == 0:
        raise ValueError("no epoch in common")
    ref = np.array([v[:epochs] for _, v in sorted(reference.items())])  # [S_ref, E]
    cho = np.array([v[:epochs] for _, v in sorted(chosen.items())])  # [S_chosen, E]
    ref_low, ref_high, cho_low, cho_high = ref.min(axis=0), ref.max(axis=0), cho.min(axis=0), cho.max(axis=0)
    ref_median, cho_median = np.median(ref, axis=0), np.median(cho, axis=0)
    inside = (cho_median >= ref_low) & (cho_median <= ref_high)
    reverse = (ref_median >= cho_low) & (ref_median <= cho_high)
    excess = np.maximum(np.maximum(ref_low - cho_median, cho_median - ref_high), 0.0)  # how far outside the reference range
    worst = int(np.argmax(excess))
    return {
        "epochs": epochs,
        "reference_seeds": sorted(reference),
        "chosen_seeds": sorted(chosen),
        "inside": round(float(inside.mean()), 4),
        "reverse_inside": round(float(reverse.mean()) if len(chosen) > 1 else float("nan"), 4),
        "worst_excess": round(float(excess[worst]), 6),
        "worst_epoch": worst + 1 if excess[worst] > 0 else None,
        "mean_reference_range": round(float((ref_high - ref_low).mean()), 6),
        "epochs_outside": [int(e) + 1 for e in np.nonzero(~inside)[0][:20]],
        "reference_median": _rounded(ref_median),
        "chosen_median": _rounded(cho_median),
        "reference_range": [_rounded(ref_low), _rounded(ref_high)],
        "chosen_range": [_rounded(cho_low), _rounded(cho_high)],
    }


def compare_experiments(reference: Path, chosen: Path, metrics: tuple[str, ...] = METRICS) -> dict[str, Any]:
    """{"reference", "chosen", "groups": {"setting/mechanism/metric": compare_group(...)}} over the
    (setting, mechanism) groups both experiments have.

    Raises:
        ValueError: the experiments share no group with a metric.
    """
    groups: dict[str, Any] = {}
    ref_runs, cho_runs = load_runs(reference), load_runs(chosen)  # each folder read once
    for metric in metrics:
        ref_curves, cho_curves = seed_curves(ref_runs, metric), seed_curves(cho_runs, metric)
        for key in sorted(set(ref_curves) & set(cho_curves)):
            groups["/".join((*key, metric))] = compare_group(ref_curves[key], cho_curves[key])
    if not groups:
        raise ValueError(f"{reference} and {chosen} have no (setting, mechanism) with {', '.join(metrics)} in common")
    return {"reference": str(reference), "chosen": str(chosen), "groups": groups}


def plot(result: dict[str, Any], path: Path) -> None:
    """One panel per group: both seed ranges (shaded) and medians, reference solid, chosen dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(result["groups"])
    cols = min(2, len(names))
    rows = -(-len(names) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(6 * cols, 3.6 * rows), squeeze=False)
    for ax, name in zip(axes.flat, names):
        group = result["groups"][name]
        x = np.arange(1, group["epochs"] + 1)
        for side, style, color in (("reference", "-", "C0"), ("chosen", "--", "C1")):
            low, high = group[f"{side}_range"]
            ax.fill_between(x, low, high, color=color, alpha=0.2, linewidth=0)
            ax.plot(x, group[f"{side}_median"], style, color=color, label=f"{side} median, range over seeds")
        ax.set_title(f"{name}: {100 * group['inside']:.0f}% of epochs inside", fontsize=9)
        ax.set_xlabel("epoch")
    for ax in list(axes.flat)[len(names) :]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=7)
    fig.tight_layout()
    save_png(fig, path, dpi=100)


def table(result: dict[str, Any]) -> str:
    lines = ["group | epochs | chosen median inside reference range | reverse | worst excess (epoch) | mean reference range"]
    for name, g in result["groups"].items():
        lines.append(
            f"{name} | {g['epochs']} | {100 * g['inside']:.0f}% | {100 * g['reverse_inside']:.0f}% | "
            f"{g['worst_excess']:.4g} ({g['worst_epoch']}) | {g['mean_reference_range']:.4g}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="sparsefocus fidelity", description=__doc__.split("\n\n")[0])
    parser.add_argument("reference", type=Path, help="the reference experiment folder (e.g. fp32)")
    parser.add_argument("chosen", type=Path, help="the experiment folder to check against it (e.g. bf16)")
    parser.add_argument("--metric", action="append", help=f"metric to compare (repeatable; default: {', '.join(METRICS)})")
    parser.add_argument("--out", type=Path, help="where fidelity.json and fidelity.png go (default: the chosen folder)")
    args = parser.parse_args(argv)
    try:
        result = compare_experiments(args.reference, args.chosen, tuple(args.metric or METRICS))
    except ValueError as error:
        print(f"sparsefocus fidelity: error: {error}", file=sys.stderr)
        return 2
    out = args.out or args.chosen
    out.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out / "fidelity.json", json.dumps(result, indent=1))
    plot(result, out / "fidelity.png")
    print(table(result))
    print(f"fidelity: {out / 'fidelity.json'}, {out / 'fidelity.png'}")
    return 0

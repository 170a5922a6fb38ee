"""Learning speed against semantic dispersion, one point per mechanism.

The Semantic Focus paper's claim is that a mechanism whose kept keys are less dispersed learns
faster. A study gives both halves: ``sparsefocus report --reach ACC`` writes each mechanism's
first epoch at held-out accuracy ACC per seed (``summary.json``), and ``sparsefocus analyze``
writes each mechanism's dispersion of its kept keys beside that of all keys (``analysis.json``,
on one analysis seed). This module sets them side by side, on two x axes:

* the dispersion of the mechanism's kept keys over that of FULL's model over all keys (the
  comparison of the paper's table, delta_h / delta_s; 1 for FULL);
* the dispersion of the kept keys over that of all keys in the mechanism's own model (how much
  its selection narrows what it attends to; 1 for FULL);

both at one percentile (default p75). y: the median over seeds of the epoch at which held-out
accuracy first reaches ACC, with the seeds' 25-75% range. A seed that never reaches it counts as
later than every epoch, so the median is undefined (the mechanism is drawn on the top edge) when
half the seeds or more never get there. For each axis, Spearman's rank correlation over the
mechanisms with a median, with a permutation p-value (a fixed seed, so the same study always
gives the same value).

The dispersion is measured on one trained model per mechanism (the paper's protocol), the speed
on every seed; a correlation over a handful of mechanisms describes this study, not a law.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from sparsefocus.analysis.files import save_figure
from sparsefocus.train.checkpoint import write_text_atomic
from sparsefocus.train.paired import midranks

PERCENTILES = ("p75", "p90", "p95", "p100")


@dataclass(frozen=True)
class Point:
    """One mechanism: ``epochs`` per seed (None: never reached), their median and 25-75% range
    (None where the quantile falls on a seed that never reaches), and at the percentile the
    dispersion of its kept keys (``kept``), of all keys in its model (``every``) and of all keys
    in FULL's model (``full``, None when the analysis has no FULL)."""

    mechanism: str
    epochs: tuple[int | None, ...]
    median: float | None
    q25: float | None
    q75: float | None
    kept: float
    every: float
    full: float | None

    @property
    def ratio(self) -> float:
        """Dispersion of the kept keys over that of all keys of the same model."""
        return self.kept / self.every

    @property
    def vs_full(self) -> float | None:
        """Dispersion of the kept keys over that of FULL's model over all keys (None without FULL)."""
        return None if self.full is None else self.kept / self.full

    @property
    def reached(self) -> int:
        return sum(epoch is not None for epoch in self.epochs)


def censored_quantiles(epochs: list[int | None]) -> tuple[float | None, float | None, float | None]:
    """(q25, median, q75) of ``epochs`` with linear interpolation, None counting as later than
    every epoch; a quantile that depends on a None is None."""
    values = sorted(math.inf if epoch is None else float(epoch) for epoch in epochs)
    out: list[float | None] = []
    for q in (0.25, 0.5, 0.75):
        if not values:
            out.append(None)
            continue
        h = (len(values) - 1) * q
        lo, hi = math.floor(h), math.ceil(h)
        if math.isinf(values[hi]):  # the quantile lies at or beyond a seed that never reaches
            out.append(None)
            continue
        out.append(values[lo] + (values[hi] - values[lo]) * (h - lo))
    return out[0], out[1], out[2]


def check_summary(summary: dict[str, Any]) -> None:
    """ValueError unless every mechanism of every setting of a report's summary has reach statistics."""
    settings = summary.get("settings") if isinstance(summary, dict) else None
    if not settings:
        raise ValueError("the summary has no settings: give the summary.json that sparsefocus report writes")
    for setting, section in settings.items():
        for mechanism, entry in section.get("mechanisms", {}).items():
            _reach(entry, mechanism, setting)


def _reach(entry: dict[str, Any], mechanism: str, setting: str) -> dict[str, Any]:
    """A summary entry's reach statistics; ValueError naming the mechanism when it has none."""
    reach = entry.get("reach")
    if reach is None:
        raise ValueError(f"the summary has no reach statistics for {mechanism} ({setting}): write the report with --reach ACC")
    return reach


def collect_points(
    summary: dict[str, Any], analysis: dict[str, Any], setting: str = "default", percentile: str = "p75"
) -> list[Point]:
    """The mechanisms found in both the report's ``summary`` (with its reach statistics) and the
    dispersion ``analysis`` of one setting, in the summary's order. ValueError naming what is
    missing."""
    if percentile not in PERCENTILES:
        raise ValueError(f"percentile must be one of {', '.join(PERCENTILES)}, got {percentile!r}")
    try:
        reported = summary["settings"][setting]["mechanisms"]
        measured = analysis["settings"][setting]["mechanisms"]
    except KeyError as missing:
        raise ValueError(f"setting {setting!r} is missing from the summary or the analysis ({missing})") from None
    full = measured.get("FULL", {}).get("statistics", {}).get("pooled", {}).get("full_dispersion", {}).get(percentile)
    points = []
    for mechanism, entry in reported.items():
        if mechanism not in measured:
            continue
        reach = _reach(entry, mechanism, setting)
        pooled = measured[mechanism]["statistics"]["pooled"]
        epochs = list(reach["epochs"])
        q25, median, q75 = censored_quantiles(epochs)
        points.append(
            Point(
                mechanism,
                tuple(epochs),
                median,
                q25,
                q75,
                pooled["dispersion"][percentile],
                pooled["full_dispersion"][percentile],
                full,
            )
        )
    if len(points) < 2:
        raise ValueError(f"fewer than two mechanisms have both a reach and a dispersion in setting {setting!r}")
    return points


def spearman(x: np.ndarray, y: np.ndarray) -> float:
    """Spearman's rank correlation (Pearson's on mean ranks); NaN when either side is constant."""
    rx, ry = _centred_ranks(x), _centred_ranks(y)
    scale = math.sqrt(float((rx * rx).sum() * (ry * ry).sum()))
    return float((rx * ry).sum() / scale) if scale > 0 else math.nan


def _centred_ranks(values: np.ndarray) -> np.ndarray:
    ranked = midranks(np.asarray(values, dtype=np.float64))
    return ranked - ranked.mean()


def permutation_p(x: np.ndarray, y: np.ndarray, draws: int = 20000, seed: int = 0) -> float:
    """Two-sided p-value of ``spearman(x, y)`` under random pairings: the share of ``draws``
    seeded permutations of y (the observed pairing counted once) at least as correlated. The
    ranks are computed once: permuting y permutes its ranks."""
    rx, ry = _centred_ranks(x), _centred_ranks(y)
    scale = math.sqrt(float((rx * rx).sum() * (ry * ry).sum()))
    if scale == 0:
        return math.nan
    observed = abs(float((rx * ry).sum())) / scale
    rng = np.random.default_rng(seed)
    permuted = np.stack([rng.permutation(ry) for _ in range(draws)])  # [draws, n]
    hits = int((np.abs(permuted @ rx) / scale >= observed - 1e-12).sum())
    return (hits + 1) / (draws + 1)


AXES = {"vs_full": "kept keys / FULL's all keys", "ratio": "kept keys / all keys of the same model"}


def correlation(points: list[Point], axis: str = "ratio") -> dict[str, Any]:
    """Spearman's rho between the ``axis`` ("ratio" or "vs_full") and the median epochs, over the
    points with a median (and a value on the axis)."""
    usable = [p for p in points if p.median is not None and getattr(p, axis) is not None]
    result: dict[str, Any] = {"mechanisms": len(usable), "rho": None, "p_value": None}
    if len(usable) >= 3:
        x = np.array([getattr(p, axis) for p in usable])
        y = np.array([p.median for p in usable])
        result["rho"], result["p_value"] = spearman(x, y), permutation_p(x, y)
    return result


def short_names(mechanisms: list[str]) -> list[str]:
    """Each mechanism's family (the part before ':'), numbered where families repeat."""
    families = [m.split(":", 1)[0] for m in mechanisms]
    count: dict[str, int] = {}
    names = []
    for family in families:
        count[family] = count.get(family, 0) + 1
        names.append(f"{family} ({count[family]})" if families.count(family) > 1 else family)
    return names


def plot(points: list[Point], path: Path, threshold: float, percentile: str, last_epoch: int) -> None:
    """One panel per axis with values: the points, 25-75% bars, unreached medians on the top edge."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    axes = [axis for axis in AXES if any(getattr(p, axis) is not None for p in points)]
    fig, panels = plt.subplots(1, len(axes), figsize=(6.0 * len(axes), 4.8), squeeze=False, sharey=True)
    top = last_epoch * 1.08
    names = short_names([p.mechanism for p in points])
    for ax, axis in zip(panels[0], axes):
        for point, name in zip(points, names):
            x = getattr(point, axis)
            if point.median is None:
                ax.scatter([x], [top], marker="^", color="grey")
                label = f"{name} ({point.reached}/{len(point.epochs)})"
                ax.annotate(label, (x, top), fontsize=8, xytext=(4, -10), textcoords="offset points")
                continue
            low = point.median - (point.q25 if point.q25 is not None else point.median)
            high = (point.q75 if point.q75 is not None else top) - point.median
            ax.errorbar([x], [point.median], yerr=[[low], [high]], fmt="o", capsize=3)
            ax.annotate(name, (x, point.median), fontsize=8, xytext=(4, 4), textcoords="offset points")
        ax.axhline(last_epoch, color="grey", linewidth=0.5, linestyle=":")
        ax.set_xlabel(f"dispersion, {AXES[axis]} ({percentile})")
        ax.set_ylim(0, top * 1.05)
    panels[0][0].set_ylabel(f"epoch at {threshold:g} held-out accuracy (median, 25-75%)")
    fig.tight_layout()
    save_figure(fig, path)
    plt.close(fig)


def markdown(points: list[Point], threshold: float, percentile: str) -> str:
    """The table of points and one correlation line per axis."""
    lines = [
        f"# Learning speed against dispersion ({percentile})",
        "",
        f"Epoch at which held-out accuracy first reaches {threshold:g} (median and 25-75% over all the seeds, "
        "a seed that never reaches it counting as later than every epoch, so '-' where the quantile falls on "
        "such a seed; the report's median is over the reaching seeds only) against the dispersion of the kept "
        "keys (on the analysis seed) over that of FULL's model over all keys (the paper's comparison) and over "
        "that of all keys in the same model.",
        "",
        "| mechanism | seeds reaching | median epoch [25%, 75%] | kept | all | kept/FULL's all | kept/all |",
        "|---|---|---|---|---|---|---|",
    ]
    for p in points:
        shown = "-" if p.median is None else f"{p.median:g} [{_edge(p.q25)}, {_edge(p.q75)}]"
        vs_full = "-" if p.vs_full is None else f"{p.vs_full:.3g}"
        lines.append(
            f"| {p.mechanism} | {p.reached}/{len(p.epochs)} | {shown} | {p.kept:.3g} | {p.every:.3g} | {vs_full} | {p.ratio:.3g} |"
        )
    lines.append("")
    for axis, label in AXES.items():
        stats = correlation(points, axis)
        if stats["rho"] is None:
            lines.append(
                f"- {label}: too few mechanisms with a median and a value ({stats['mechanisms']}) for a rank correlation."
            )
        else:
            lines.append(
                f"- {label}: Spearman's rho over {stats['mechanisms']} mechanisms {stats['rho']:.2f} "
                f"(permutation p = {stats['p_value']:.3g})."
            )
    lines += ["", "A positive rho means that less dispersed kept keys go with fewer epochs."]
    return "\n".join(lines) + "\n"


def _edge(value: float | None) -> str:
    return "-" if value is None else f"{value:g}"


def write_speed_dispersion(
    summary: dict[str, Any], analysis: dict[str, Any], out_dir: str | Path, setting: str = "default", percentile: str = "p75"
) -> list[Path]:
    """Write ``speed_dispersion.md`` and ``.png`` for one setting into ``out_dir`` (for a setting
    other than "default", ``speed_dispersion_<setting>.*``); returns the paths."""
    points = collect_points(summary, analysis, setting, percentile)
    reported = summary["settings"][setting]["mechanisms"]
    threshold = next(iter(reported.values()))["reach"]["threshold"]
    last_epoch = max(len(entry["median"]["valid_acc"]) for entry in reported.values())
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = "speed_dispersion" if setting == "default" else f"speed_dispersion_{setting}"
    png, md = out_dir / f"{stem}.png", out_dir / f"{stem}.md"
    plot(points, png, threshold, percentile, last_epoch)
    write_text_atomic(md, markdown(points, threshold, percentile))
    return [md, png]

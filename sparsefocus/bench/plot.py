"""Pictures of bench results: time against N per case (one panel per mode), peak memory, and for
the model bench the step time and its ratio to FULL. Log-log axes; files replaced atomically."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from sparsefocus.bench.dense import fastest_dense

MODE_TITLES = {"fwd": "forward only", "fwd+bwd": "forward + backward"}


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _series(rows: list[dict], label_key: str, mode: str, value: str = "ms") -> dict[str, list[tuple[int, float]]]:
    """{label: [(n, value)]} of the ok rows of one mode, sorted by n."""
    series: dict[str, list[tuple[int, float]]] = {}
    for row in rows:
        if row["mode"] == mode and row["status"] == "ok" and row.get(value) is not None:
            series.setdefault(row[label_key], []).append((row["n"], row[value]))
    return {label: sorted(points) for label, points in series.items()}


def length_label(n: int) -> str:
    """4096 -> "4K", 65536 -> "64K", 100 -> "100"."""
    return f"{n // 1024}K" if n >= 1024 and n % 1024 == 0 else str(n)


def _log_axes(ax, ylabel: str, title: str, lengths: list[int]) -> None:
    from matplotlib.ticker import NullLocator

    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(lengths, [length_label(n) for n in lengths])
    ax.xaxis.set_minor_locator(NullLocator())
    ax.set_xlabel("sequence length N (tokens)")
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.grid(True, which="both", alpha=0.3)


def _save(fig, plt, path: Path) -> None:
    tmp = path.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=110, bbox_inches="tight")
    plt.close(fig)
    os.replace(tmp, path)


def _plot_lines(ax, series: dict, colours: dict) -> None:
    for label, points in series.items():
        ax.plot([n for n, _ in points], [y for _, y in points], "-", marker="o", markersize=3, color=colours[label], label=label)


def _plot_graph_lines(ax, series: dict, colours: dict) -> None:
    """Each case's CUDA-graph replay times, dashed in the case's colour (one legend entry)."""
    for label, points in series.items():
        ax.plot([n for n, _ in points], [y for _, y in points], "--", linewidth=1, color=colours[label])
    if series:  # the legend's entry, in grey: the dashes stand for every case
        ax.plot([], [], "--", linewidth=1, color="grey", label="dashed: replayed from a CUDA graph")


def plot_results(payload: dict, path: Path) -> None:
    """PNG of a kernel bench: one time panel per mode with the fastest dense backend drawn in
    black, each case's CUDA-graph replay times dashed (``--cuda-graphs``), and a peak-memory
    panel (forward + backward) when memory was measured (CUDA)."""
    plt = _pyplot()
    rows = payload["results"]
    modes = [m for m in MODE_TITLES if any(r["mode"] == m for r in rows)]
    memory = _series(rows, "case", "fwd+bwd", "peak_mb") or _series(rows, "case", "fwd", "peak_mb")
    panels = len(modes) + bool(memory)
    fig, axes = plt.subplots(1, panels, figsize=(5.2 * panels, 4.6), squeeze=False)
    cases = list(dict.fromkeys(r["case"] for r in rows))
    tab20 = plt.get_cmap("tab20").colors
    palette = tab20[0::2] + tab20[1::2]  # the ten strong colours first, then their light twins
    colours = {case: palette[i % len(palette)] for i, case in enumerate(cases)}
    best = fastest_dense(rows)
    lengths = sorted({r["n"] for r in rows})
    for ax, mode in zip(axes[0], modes):
        _plot_lines(ax, _series(rows, "case", mode), colours)
        _plot_graph_lines(ax, _series(rows, "case", mode, "graph_ms"), colours)
        dense = sorted((n, v["ms"]) for (n, m), v in best.items() if m == mode)
        if dense:
            ax.plot(
                [n for n, _ in dense],
                [ms for _, ms in dense],
                "k-",
                linewidth=3,
                alpha=0.35,
                label="dense = fastest SDPA backend",
            )
        _log_axes(ax, "time per call (ms, median)", MODE_TITLES[mode], lengths)
    if memory:
        _plot_lines(axes[0][-1], memory, colours)
        _log_axes(
            axes[0][-1],
            "peak memory (MB, inputs included)",
            "peak memory, " + MODE_TITLES["fwd+bwd" if "fwd+bwd" in modes else "fwd"],
            lengths,
        )
    handles: dict[str, Any] = {}  # label -> the first artist drawn with it
    for ax in axes[0]:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(label, handle)
    labels = list(handles)
    fig.legend(
        [handles[label] for label in labels],
        labels,
        loc="lower center",
        ncol=min(4, len(labels)),
        fontsize=8,
        bbox_to_anchor=(0.5, -0.02 - 0.035 * ((len(labels) + 3) // 4)),
    )
    shape = payload["shape"]
    causal = "causal" if shape["causal"] else "non-causal"
    fig.suptitle(
        f"Attention time against N: B={shape['batch']}, H={shape['heads']}, D={shape['head_dim']}, {shape['dtype']}, {causal}\n"
        f"{payload['device']}, torch {payload['torch']}, commit {payload['git_commit'][:10]}",
        fontsize=10,
    )
    fig.tight_layout()
    _save(fig, plt, path)


def plot_model_results(payload: dict, path: Path) -> None:
    """PNG of a model bench: ms per training step against N per pattern (one panel per mode,
    eager and compiled) and FULL's step time over each pattern's (> 1: the pattern pays)."""
    from sparsefocus.bench.model import headline_rows, is_full

    plt = _pyplot()
    rows = headline_rows(payload["results"])
    modes = [m for m in ("eager", "compiled") if any(r["mode"] == m and r["status"] == "ok" for r in rows)]
    if not modes:
        return
    fig, axes = plt.subplots(1, len(modes) + 1, figsize=(5.2 * (len(modes) + 1), 4.6), squeeze=False)
    patterns = list(dict.fromkeys(r["pattern"] for r in rows))
    palette = plt.get_cmap("tab10").colors
    colours = {p: palette[i % len(palette)] for i, p in enumerate(patterns)}
    lengths = sorted({r["n"] for r in rows})
    for ax, mode in zip(axes[0], modes):
        _plot_lines(ax, _series(rows, "pattern", mode), colours)
        _log_axes(ax, "training step (ms, median)", f"{mode}: ms per training step", lengths)
    ratio_ax = axes[0][-1]
    for mode, style in (("eager", "-"), ("compiled", "--")):
        for label, points in _series(rows, "pattern", mode, "vs_full").items():
            if not is_full(label):
                ratio_ax.plot(
                    [n for n, _ in points],
                    [y for _, y in points],
                    style,
                    marker="o",
                    markersize=3,
                    color=colours[label],
                    label=f"{label}, {mode}",
                )
    ratio_ax.axhline(1.0, color="k", linewidth=1, label="FULL")
    _log_axes(ratio_ax, "FULL step time / pattern step time", "speed-up over FULL (> 1: the pattern pays)", lengths)
    ratio_ax.legend(fontsize=7, loc="best")
    axes[0][0].legend(fontsize=8, loc="upper left")
    config = payload["config"]
    fig.suptitle(
        f"Decoder training step: {config['blocks']} block{'s' if config['blocks'] != 1 else ''}, d={config['dim']}, {config['heads']} heads, MLP {config['mlp']}, "
        f"batch {config['batch']}, {config['dtype']} autocast, AdamW\n"
        f"{payload['device']}, torch {payload['torch']}, commit {payload['git_commit'][:10]}; FULL = fastest SDPA backend per point",
        fontsize=10,
    )
    fig.tight_layout()
    _save(fig, plt, path)

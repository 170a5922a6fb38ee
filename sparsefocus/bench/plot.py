"""Log-log picture of bench results: time and peak memory against N, one line per case and mode."""

from __future__ import annotations

import os
from pathlib import Path


def plot_results(payload: dict, path: Path) -> None:
    """Write a two-panel PNG (time, memory vs N) of ``payload["results"]``; atomic replace."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_time, ax_mem) = plt.subplots(1, 2, figsize=(12, 4.8))
    series: dict[tuple[str, str], list[dict]] = {}
    for row in payload["results"]:
        series.setdefault((row["case"], row["mode"]), []).append(row)
    colours = plt.get_cmap("tab20").colors
    cases = list(dict.fromkeys(case for case, _ in series))
    for (case, mode), rows in series.items():
        colour = colours[(2 * cases.index(case)) % len(colours)]
        ok = [r for r in sorted(rows, key=lambda r: r["n"]) if r["status"] == "ok"]
        style = "-" if mode == "fwd+bwd" else "--"
        if ok:
            ax_time.plot([r["n"] for r in ok], [r["ms"] for r in ok], style, marker="o", color=colour, label=f"{case} {mode}")
            mem = [r for r in ok if r.get("peak_mb") is not None]
            if mem:
                ax_mem.plot([r["n"] for r in mem], [r["peak_mb"] for r in mem], style, marker="o", color=colour, label=f"{case} {mode}")
    for ax, label in ((ax_time, "time (ms, median)"), (ax_mem, "peak memory (MB)")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("N (sequence length)")
        ax.set_ylabel(label)
        ax.grid(True, which="both", alpha=0.3)
    ax_time.legend(fontsize=7)
    fig.suptitle(f"{payload['device']}  {payload['shape']}  commit {payload['git_commit'][:10]}", fontsize=8)
    fig.tight_layout()
    tmp = path.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    os.replace(tmp, path)

"""``sparsefocus demo``: FULL, TOPK:5, BAND:5(1) and BLOC:5(1) over three seeds on a small task,
then the report and the picture. Sized to finish within 5 minutes on a 2-core CPU (measured: see
docs/readme/laboratory.md); it reports the wall-clock time it measured, whatever the curves show.
"""

from __future__ import annotations

import argparse
import os
import shutil
import time
from pathlib import Path

import torch

from sparsefocus.train.checkpoint import CheckpointError
from sparsefocus.train.config import PAPER_SEEDS, load_config
from sparsefocus.train.experiment import check_experiment, plan, run_experiment
from sparsefocus.train.loop import check_run_folder
from sparsefocus.train.report import write_report

MECHANISMS = "[FULL, TOPK:5, BAND:5(1), BLOC:5(1)]"
# Even pairs at L=20 learns within a few epochs on a CPU. The dense reference attention is faster
# than the memory-lean path at this length on a CPU, so the demo asks for it explicitly.
DEMO_OVERRIDES = [
    "name=demo",
    "task={name: even_pairs, length: 20, num_train: 1000, num_valid: 500}",
    "model.blocks=2",
    "model.dim=32",
    "model.mlp_dim=64",
    "model.impl=reference",
    "optim.name=adamw",
    "optim.lr=0.003",
    "optim.schedule=constant",
    "optim.grad_clip=1.0",
    "train.epochs=15",
    f"mechanisms={MECHANISMS}",
]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="sparsefocus demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="runs", help="parent folder of the demo's run folder. Default: runs")
    parser.add_argument("--seeds", type=int, default=3, help="number of seeds (the paper's, in order). Default: 3")
    parser.add_argument("--jobs", type=int, default=None, help="runs at once. Default: 2 on 2+ cores, else 1")
    parser.add_argument("--fresh", action="store_true", help="delete a previous runs/demo first instead of resuming it")
    parser.add_argument("overrides", nargs="*", help="extra dotted key=value overrides (e.g. train.epochs=5)")
    return parser.parse_intermixed_args(argv)


def demo_overrides(args: argparse.Namespace) -> list[str]:
    jobs = args.jobs if args.jobs is not None else min(2, os.cpu_count() or 1)
    seeds = ",".join(str(seed) for seed in PAPER_SEEDS[: args.seeds])
    return [*DEMO_OVERRIDES, f"out_dir={args.out}", f"seeds=[{seeds}]", f"train.jobs={jobs}", *args.overrides]


def seconds_since_process_start() -> float | None:
    """Wall-clock seconds since this process started (Python start-up and imports included), from
    /proc on Linux; None elsewhere."""
    try:
        start_ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return uptime - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def main(argv: list[str] | None = None) -> int:
    began = time.perf_counter()
    args = parse_args(argv)
    try:
        config = load_config(None, demo_overrides(args))
        root = Path(config.out_dir) / config.name
        if args.fresh and (root / "experiment.yaml").exists():
            shutil.rmtree(root)
        specs = plan(config, check_experiment(config))
        already = sum(check_run_folder(spec)[0] == "done" for spec in specs)
        run_experiment(config)
    except (ValueError, CheckpointError) as error:
        print(f"error: {error}\n`sparsefocus demo --fresh` deletes the previous demo folder and starts over")
        return 2
    since_start = seconds_since_process_start()
    seconds = f"{since_start:.0f} s" if since_start is not None else f"{time.perf_counter() - began:.0f} s (after imports)"
    preface = [
        f"Measured by `sparsefocus demo`: this invocation trained {len(specs) - already} of {len(specs)} runs "
        f"({already} were already finished) in {seconds} wall-clock since the process started, "
        f"on {os.cpu_count()} CPU cores, {config.train.jobs} runs at once, torch {torch.__version__}.",
        "",
    ]
    report, pictures = write_report(root, preface=preface)
    print(f"demo finished in {time.perf_counter() - began:.0f} s")
    print(f"report: {report}")
    for picture in pictures:
        print(f"curves: {picture}")
    return 0

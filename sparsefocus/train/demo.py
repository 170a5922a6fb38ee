"""``sparsefocus demo``: FULL, TOPK:5, BAND:5(1) and BLOC:5(1) over three seeds on a small task,
then the report and the picture. Sized to finish within a few minutes on a 2-core CPU; the report
states the wall-clock time the trainer measured, whatever the curves show.
"""

from __future__ import annotations

import argparse
import os
import shutil
import time
from pathlib import Path

from sparsefocus.clitools import HelpFormatter, fail
from sparsefocus.train.checkpoint import CheckpointError
from sparsefocus.train.config import PAPER_SEEDS, load_config
from sparsefocus.train.experiment import TrainingInterrupted, run_experiment
from sparsefocus.train.report import write_report
from sparsefocus.train.workers import RunLocked

PROG = "sparsefocus demo"
DESCRIPTION = (
    "Train FULL, TOPK:5, BAND:5(1) and BLOC:5(1) on the even-pairs task over a few seeds, then\n"
    "write the report and the curves. Run again, it resumes (or does nothing if finished)."
)

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
    parser = argparse.ArgumentParser(prog=PROG, description=DESCRIPTION, formatter_class=HelpFormatter)
    parser.add_argument("--out", default="runs", help="parent folder of the demo's run folder")
    parser.add_argument(
        "--seeds", type=int, default=3, help=f"number of seeds, 1 to {len(PAPER_SEEDS)} (the paper's seeds, in order)"
    )
    parser.add_argument("--jobs", type=int, default=None, help="runs at once (default: 2 on 2+ cores, else 1)")
    parser.add_argument("--fresh", action="store_true", help="delete a previous demo folder first instead of resuming it")
    parser.add_argument("overrides", nargs="*", help="extra dotted key=value overrides (e.g. train.epochs=5)")
    args = parser.parse_intermixed_args(argv)
    if not 1 <= args.seeds <= len(PAPER_SEEDS):
        parser.error(f"--seeds must be between 1 and {len(PAPER_SEEDS)} (the paper's seeds), got {args.seeds}")
    if args.jobs is not None and args.jobs < 1:
        parser.error(f"--jobs must be >= 1, got {args.jobs}")
    return args


def demo_overrides(args: argparse.Namespace) -> list[str]:
    jobs = args.jobs if args.jobs is not None else min(2, os.cpu_count() or 1)
    seeds = ",".join(str(seed) for seed in PAPER_SEEDS[: args.seeds])
    return [*DEMO_OVERRIDES, f"out_dir={args.out}", f"seeds=[{seeds}]", f"train.jobs={jobs}", *args.overrides]


def main(argv: list[str] | None = None) -> int:
    began = time.perf_counter()
    args = parse_args(argv)
    try:
        config = load_config(None, demo_overrides(args))
        root = Path(config.out_dir) / config.name
        if args.fresh and (root / "experiment.yaml").exists():
            shutil.rmtree(root)
        run_experiment(config)
    except TrainingInterrupted as stop:
        return fail(PROG, stop, 130, kind="stopped")
    except KeyboardInterrupt:
        return fail(PROG, "interrupted before training started", 130, kind="stopped")
    except (ValueError, CheckpointError, RunLocked) as error:
        return fail(PROG, f"{error}; `sparsefocus demo --fresh` deletes the previous demo folder and starts over")
    report, pictures = write_report(root)
    print(f"demo finished in {time.perf_counter() - began:.0f} s")
    print(f"report: {report}")
    for picture in pictures:
        print(f"curves: {picture}")
    return 0

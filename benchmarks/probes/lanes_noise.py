"""Probe: how far two concurrent 10-run CUDA lanes (each StepGraph on its own stream) move each run
from its group trained alone, beside how far the group alone moves from itself when trained twice."""

import json
import os
import sys
import time
from pathlib import Path

import torch

from sparsefocus.train.experiment import run_experiment
from tests.train.test_batched import CUDA_LAB, config, metrics_of

KEYS = ("train_loss", "valid_loss", "train_acc", "valid_acc")


def diffs(a: dict, b: dict) -> dict:
    """Per metric: the largest difference over runs and epochs, and the runs beyond 2e-3."""
    out = {}
    for key in KEYS:
        per_run = {run: max(abs(x[key] - y[key]) for x, y in zip(a[run], b[run])) for run in a}
        out[key] = {
            "max": max(per_run.values()),
            "runs_over_2e-3": sorted(r.split("/", 1)[1] for r, d in per_run.items() if d > 2e-3),
        }
    return out


def main() -> None:
    out, tmp = Path(sys.argv[1]), Path("/tmp/lanes_noise")
    record = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "commit": os.environ.get("SPARSEFOCUS_COMMIT", "?"),
        "cases": {},
    }
    for name, extra in {
        "graphs_nodrop": ["model.dropout=0.0"],
        "graphs_drop": ["model.dropout=0.01"],
        "eager_nodrop": ["model.dropout=0.0", "train.compile=eager"],
    }.items():
        began = time.time()
        lab = (*CUDA_LAB, *extra)
        runs = {
            tag: metrics_of(run_experiment(config(tmp / name / tag, *lab, *more), quiet=True))
            for tag, more in {
                "alone1": [],
                "alone2": [],
                "together1": ["train.concurrent_groups=2"],
                "together2": ["train.concurrent_groups=2"],
            }.items()
        }
        record["cases"][name] = {
            "seconds": round(time.time() - began, 1),
            "alone_vs_alone": diffs(runs["alone1"], runs["alone2"]),
            "together1_vs_alone1": diffs(runs["alone1"], runs["together1"]),
            "together2_vs_alone1": diffs(runs["alone1"], runs["together2"]),
            "together_vs_together": diffs(runs["together1"], runs["together2"]),
        }
        (out / "lanes_noise.json").write_text(json.dumps(record, indent=1))
        print(
            name,
            json.dumps({k: {m: f"{v[m]['max']:.1e}" for m in KEYS} for k, v in record["cases"][name].items() if k != "seconds"}),
            flush=True,
        )


if __name__ == "__main__":
    main()

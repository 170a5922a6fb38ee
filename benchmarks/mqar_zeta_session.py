"""Issue 5's MQAR target (fig2_256, FULL and ZETA) trained across several short device calls.

One call restores the run folders from a previous call's copied-back files, trains with
``sparsefocus train`` (which resumes every run from its last per-epoch checkpoint) until the wall
budget, and copies back what the next call needs. Usage, from the repository root:

    PYTHONPATH=. python benchmarks/mqar_zeta_session.py OUT_DIR --budget 450 [--resume PREV] [key=value ...]
    python benchmarks/mqar_zeta_session.py OUT_DIR --restore runs    # rebuild the run folders for reports

OUT_DIR receives at most 8 flat files: ``session.json`` (progress and timings), ``experiment.yaml``
and per run ``run<i>.config.yaml``, ``run<i>.metrics.jsonl``, ``run<i>.checkpoint.pt``. PREV is a
folder holding a previous call's OUT_DIR files. The overrides must be the same in every call (the
training loop refuses to resume a run under a different config). A run folder already on the
machine (a warm machine) is kept when it is at least as far as PREV's copy.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
import yaml

from sparsefocus.models import Decoder
from sparsefocus.tasks.mqar import MQARConfig
from sparsefocus.train.config import ExperimentConfig, load_config
from sparsefocus.train.checkpoint import write_text_atomic
from sparsefocus.train.experiment import slug

STARTED = time.perf_counter()
CONFIG = "experiments/mqar_zeta.yaml"
WORK = Path("runs/mqar_zeta_session")  # ignored by git; outside OUT so checkpoints never travel twice
RUN_FILES = ("config.yaml", "metrics.jsonl", "checkpoint.pt")
MAX_FILE_BYTES = 16 * 2**20  # the device returns files of at most 16 MiB
STOP_MARGIN_S = 15.0  # to kill the trainer and copy the files back


def check_checkpoint_size(config: ExperimentConfig) -> None:
    """Fail before training if a checkpoint (fp32 weights + two AdamW moments) could not come back."""
    task = MQARConfig(**{key: value for key, value in config.task.items() if key != "name"}).resolved()
    for mechanism in config.mechanisms:
        model = Decoder(config.model, mechanism, vocab_size=task["vocab_size"], max_len=task["seq_len"])
        size = 3 * 4 * model.num_parameters() + 2**20  # 1 MiB for metrics, RNG states, pickling
        if size > MAX_FILE_BYTES:
            raise ValueError(
                f"a {mechanism} checkpoint would be about {size / 2**20:.1f} MiB, over the 16 MiB a call returns; shrink model.dim"
            )


def run_folder(root: Path, record: dict[str, Any]) -> Path:
    """Where the experiment runner keeps the run that ``config.yaml`` ``record`` describes."""
    return root / slug(record["setting"]) / slug(record["label"]) / f"seed-{record['seed']}"


def checkpoint_epoch(path: Path) -> int:
    """Epochs done by the checkpoint at ``path``; -1 if there is none."""
    if not path.exists():
        return -1
    return int(torch.load(path, map_location="cpu", weights_only=True)["epoch"])


def restore(records: Path, root: Path) -> list[str]:
    """Put ``run<i>.*`` files of ``records`` back as ``root/<setting>/<mechanism>/seed-<seed>/``,
    unless that folder already holds a checkpoint at least as far; returns what was restored."""
    restored = []
    for config_path in sorted(records.glob("run*.config.yaml")):
        prefix = config_path.name.removesuffix("config.yaml")  # "run0."
        run_dir = run_folder(root, yaml.safe_load(config_path.read_text()))
        if checkpoint_epoch(run_dir / "checkpoint.pt") >= checkpoint_epoch(records / f"{prefix}checkpoint.pt"):
            continue
        run_dir.mkdir(parents=True, exist_ok=True)
        for name in RUN_FILES:
            if (records / f"{prefix}{name}").exists():
                shutil.copy(records / f"{prefix}{name}", run_dir / f".{name}.restoring")
                os.replace(run_dir / f".{name}.restoring", run_dir / name)
        restored.append(str(run_dir))
    if (records / "experiment.yaml").exists():
        root.mkdir(parents=True, exist_ok=True)
        shutil.copy(records / "experiment.yaml", root / "experiment.yaml")
    return restored


def copy_back(root: Path, out: Path) -> list[str]:
    """experiment.yaml and each run's files, flat, as ``run<i>.<file>`` (the device returns only
    plain names, at most 8 files); raises if a file is too big to come back."""
    copied = []
    if (root / "experiment.yaml").exists():
        shutil.copy(root / "experiment.yaml", out / "experiment.yaml")
    for index, record in enumerate(sorted(root.rglob("config.yaml"))):
        for name in RUN_FILES:
            source = record.parent / name
            if source.exists():
                if source.stat().st_size > MAX_FILE_BYTES:
                    raise ValueError(
                        f"{source} is {source.stat().st_size} bytes, over the 16 MiB the device returns; shrink model.dim"
                    )
                shutil.copy(source, out / f"run{index}.{name}")
                copied.append(f"run{index}.{name}")
    return copied


def progress(root: Path) -> dict[str, dict[str, Any]]:
    """Per run ("label seed=N"): epochs done, the last held-out accuracy and the mean seconds per epoch."""
    out = {}
    for record_path in sorted(root.rglob("config.yaml")):
        record = yaml.safe_load(record_path.read_text())
        lines = record_path.parent / "metrics.jsonl"
        metrics = [json.loads(line) for line in lines.read_text().splitlines()] if lines.exists() else []
        out[f"{record['label']} seed={record['seed']}"] = {  # one entry per seed of a mechanism
            "epochs_done": len(metrics),
            "epochs": record["config"]["train"]["epochs"],
            "valid_acc": metrics[-1]["valid_acc"] if metrics else None,
            "best_valid_acc": max((m["valid_acc"] for m in metrics), default=None),
            "s_per_epoch": round(sum(m["seconds"] for m in metrics) / len(metrics), 2) if metrics else None,
        }
    return out


def train(overrides: list[str], root: Path, seconds: float) -> tuple[Any, float]:
    """``sparsefocus train`` for at most ``seconds`` (killed after, losing at most the current epoch)."""
    command = [
        sys.executable,
        "-m",
        "sparsefocus.cli",
        "train",
        CONFIG,
        *overrides,
        f"out_dir={root.parent}",
        f"name={root.name}",
        "--no-report",
    ]
    began = time.perf_counter()
    child = subprocess.Popen(command, start_new_session=True)
    try:
        returncode: Any = child.wait(timeout=max(1.0, seconds))
    except subprocess.TimeoutExpired:
        os.killpg(child.pid, signal.SIGKILL)
        child.wait()
        returncode = "stopped at the budget's end"
    return returncode, round(time.perf_counter() - began, 1)


def session(out: Path, budget: float, resume: Path | None, overrides: list[str]) -> dict[str, Any]:
    check_checkpoint_size(load_config(CONFIG, overrides))  # a bad override fails here, before any copying
    root = WORK
    report: dict[str, Any] = {
        "overrides": overrides,
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
    }
    report["restored"] = restore(resume, root) if resume is not None else []
    seconds = budget - (time.perf_counter() - STARTED) - STOP_MARGIN_S
    report["returncode"], report["train_wall_s"] = train(overrides, root, seconds)
    report["progress"] = progress(root)
    report["copied"] = copy_back(root, out)
    report["finished"] = all(run["epochs_done"] >= run["epochs"] for run in report["progress"].values())
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="folder for session.json and the files the next call needs")
    parser.add_argument("overrides", nargs="*", help="dotted key=value overrides of experiments/mqar_zeta.yaml")
    parser.add_argument("--budget", type=float, default=450.0, help="wall seconds for the whole call")
    parser.add_argument("--resume", type=Path, help="a previous call's OUT files, to continue from")
    parser.add_argument("--restore", type=Path, help="put the records of OUT back into this run folder and stop")
    args = parser.parse_intermixed_args()
    if args.restore is not None:
        print("\n".join(restore(args.out, args.restore / load_config(CONFIG, args.overrides).name)))
        return
    args.out.mkdir(parents=True, exist_ok=True)
    report = session(args.out, args.budget, args.resume, args.overrides)
    write_text_atomic(args.out / "session.json", json.dumps(report, indent=1))
    print(json.dumps(report, indent=1), flush=True)


if __name__ == "__main__":
    main()

"""One device visit for issue 5's MQAR target: time each mechanism, size the run to a wall budget,
train it with ``sparsefocus train`` and copy the run records back.

Usage (on the GPU machine, from the repository root):
    PYTHONPATH=. python benchmarks/mqar_zeta_session.py OUT_DIR --budget 170 [key=value ...]

1. Times ``--steps`` optimiser steps of every mechanism of ``experiments/mqar_zeta.yaml`` (after
   warm-up) and one held-out evaluation batch.
2. Chooses ``task.num_train`` (a multiple of the batch size, at most the preset's 100k) so that
   ``train.epochs`` epochs of the slowest mechanism fit in what is left of ``--budget`` seconds,
   all mechanisms training at once (``train.jobs`` = number of mechanisms).
3. Runs ``sparsefocus train`` with those overrides, killed at the budget's end if it overruns.
4. Copies ``experiment.yaml``, ``plan.json`` and every run's ``config.yaml`` / ``metrics.jsonl``
   flat into OUT_DIR (``run<i>.config.yaml``), to be put back into a run folder with
   ``--restore``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

from sparsefocus.models import mechanism_label
from sparsefocus.train.config import load_config, make_task_config
from sparsefocus.train.experiment import slug
from sparsefocus.train.loop import build_model, loss_and_counts, make_optimizer, resolve_device
from sparsefocus.tasks import build_task

STARTED = time.perf_counter()
CONFIG = "experiments/mqar_zeta.yaml"
CONCURRENCY_SLOWDOWN = 1.35  # guessed cost of sharing the GPU and the host between the runs
STARTUP_SECONDS = 25.0  # spawned workers import torch, initialise CUDA and build the data


def elapsed() -> float:
    return time.perf_counter() - STARTED


def time_mechanism(config, mechanism, data, device: torch.device, steps: int) -> dict[str, float]:
    """Seconds per optimiser step (batch ``train.batch_size``) and per evaluation batch."""
    torch.manual_seed(0)
    model = build_model(config.model, mechanism, data).to(device)
    optimizer = make_optimizer(config.optim, model)
    batch = config.train.batch_size
    inputs, targets = data.train_inputs[:batch].to(device), data.train_targets[:batch].to(device)

    def step() -> None:
        loss, _, _ = loss_and_counts(model(inputs), targets)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), config.optim.grad_clip)
        optimizer.step()

    for _ in range(3):
        step()
    sync(device)
    began = time.perf_counter()
    for _ in range(steps):
        step()
    sync(device)
    per_step = (time.perf_counter() - began) / steps
    rows = data.valid_inputs[: config.train.eval_batch_size].to(device)
    with torch.no_grad():
        model.eval()
        model(rows)
        sync(device)
        began = time.perf_counter()
        model(rows)
        sync(device)
    return {"step_s": per_step, "eval_batch_s": time.perf_counter() - began}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def choose_num_train(config, timings: dict[str, dict[str, float]], seconds: float, num_valid: int, cap: int) -> int:
    """The largest multiple of the batch size whose ``train.epochs`` epochs fit in ``seconds``."""
    batch, epochs = config.train.batch_size, config.train.epochs
    slowest = max(timings.values(), key=lambda t: t["step_s"])
    eval_s = slowest["eval_batch_s"] * math.ceil(num_valid / config.train.eval_batch_size)
    per_epoch = seconds / epochs / CONCURRENCY_SLOWDOWN - eval_s
    steps = max(1, int(per_epoch / slowest["step_s"]))
    return min(cap, steps * batch)


def copy_records(root: Path, out: Path) -> list[str]:
    """experiment.yaml and each run's config.yaml / metrics.jsonl, flat, as ``run<i>.<file>``
    (the device returns only names of letters, digits, '.', '_' and '-'; config.yaml names the run)."""
    copied = []
    if (root / "experiment.yaml").exists():
        shutil.copy(root / "experiment.yaml", out / "experiment.yaml")
    for index, record in enumerate(sorted(root.rglob("config.yaml"))):
        name = f"run{index}"
        for file in ("config.yaml", "metrics.jsonl"):
            if (record.parent / file).exists():
                shutil.copy(record.parent / file, out / f"{name}.{file}")
                copied.append(f"{name}.{file}")
    return copied


def restore(records: Path, root: Path) -> None:
    """Put copied records back as ``root/<setting>/<mechanism>/seed-<seed>/`` for ``sparsefocus report``."""
    import yaml

    for config_path in sorted(records.glob("*.config.yaml")):
        record = yaml.safe_load(config_path.read_text())
        run_dir = root / slug(record["setting"]) / slug(record["label"]) / f"seed-{record['seed']}"
        run_dir.mkdir(parents=True, exist_ok=True)
        shutil.copy(config_path, run_dir / "config.yaml")
        metrics = records / config_path.name.replace(".config.yaml", ".metrics.jsonl")
        if metrics.exists():
            shutil.copy(metrics, run_dir / "metrics.jsonl")
    if (records / "experiment.yaml").exists():
        shutil.copy(records / "experiment.yaml", root / "experiment.yaml")


def train(out: Path, budget: float, steps: int, overrides: list[str]) -> None:
    config = load_config(CONFIG, overrides)
    device = resolve_device(config.train.device)
    resolved = make_task_config(config.task).resolved()  # the preset's sizes unless overridden
    fields = {key: value for key, value in config.task.items() if key != "name"}
    data = build_task("mqar", 0, **{**fields, "num_train": config.train.batch_size})  # only for timing
    timings = {mechanism_label(m): time_mechanism(config, m, data, device, steps) for m in config.mechanisms}
    num_valid = resolved["num_valid"]
    run_seconds = budget - elapsed() - 8.0  # 8 s to stop the runs and copy the records
    num_train = choose_num_train(config, timings, run_seconds - STARTUP_SECONDS, num_valid, resolved["num_train"])
    chosen = [f"task.num_train={num_train}", f"train.jobs={len(config.mechanisms)}", f"out_dir={out / 'runs'}"]
    plan = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "timings": timings,
            "overrides": overrides + chosen, "run_seconds_limit": round(run_seconds, 1), "planned_at_s": round(elapsed(), 1)}
    print(json.dumps(plan, indent=1), flush=True)
    (out / "plan.json").write_text(json.dumps(plan, indent=1))
    command = [sys.executable, "-m", "sparsefocus.cli", "train", CONFIG, *overrides, *chosen, "--no-report"]
    began = time.perf_counter()
    child = subprocess.Popen(command, start_new_session=True)
    try:
        plan["returncode"] = child.wait(timeout=max(1.0, run_seconds))
    except subprocess.TimeoutExpired:
        os.killpg(child.pid, signal.SIGKILL)
        plan["returncode"] = "killed at the budget's end"
    plan["train_wall_s"] = round(time.perf_counter() - began, 1)
    (out / "plan.json").write_text(json.dumps(plan, indent=1))
    print(plan["returncode"], plan["train_wall_s"], copy_records(out / "runs" / config.name, out), flush=True)
    shutil.rmtree(out / "runs", ignore_errors=True)  # checkpoints do not travel back


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="folder for plan.json and the copied run records")
    parser.add_argument("overrides", nargs="*", help="dotted key=value overrides of experiments/mqar_zeta.yaml")
    parser.add_argument("--budget", type=float, default=170.0, help="wall seconds for the whole visit")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per mechanism")
    parser.add_argument("--restore", type=Path, help="put the records of OUT back into this run folder and stop")
    args = parser.parse_intermixed_args()
    if args.restore is not None:
        restore(args.out, args.restore)
        return
    args.out.mkdir(parents=True, exist_ok=True)
    train(args.out, args.budget, args.steps, args.overrides)


if __name__ == "__main__":
    main()

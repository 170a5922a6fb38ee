"""Train an experiment's runs as Ray tasks: ``sparsefocus train CONFIG --ray [ADDRESS]``.

One task per unfinished run, each asking for ``train.num_cpus`` CPUs and ``train.num_gpus`` GPUs.
The runs write the same folders as ``run_experiment`` (checked, planned and resumed the same
way: finished runs are skipped, partial ones resume from their checkpoint). Without an address a
local Ray is started for the call and shut down after it; with one (``auto``, ``ray://host:10001``)
the tasks go to that cluster, whose nodes must all see ``out_dir`` (the run folders are given to
the tasks as absolute paths). Ray is an optional extra (``pip install 'sparsefocus[ray]'``),
imported only here.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from sparsefocus.train.checkpoint import write_text_atomic
from sparsefocus.train.config import ExperimentConfig, to_yaml
from sparsefocus.train.experiment import _states, check_experiment, plan
from sparsefocus.train.loop import RunSpec, train_run


def _ray():
    try:
        import ray
    except ImportError as error:
        raise ImportError("--ray needs Ray: pip install 'sparsefocus[ray]'") from error
    return ray


def train_task(spec: RunSpec) -> str:
    """The body of one Ray task: train one run with as many torch threads as CPUs it holds."""
    torch.set_num_threads(max(1, int(spec.config.train.num_cpus)))
    train_run(spec)
    return str(spec.run_dir)


def run_experiment_ray(
    config: ExperimentConfig, address: str | None = None, *, quiet: bool = False, init_options: dict[str, Any] | None = None
) -> Path:
    """Check, then train every unfinished run of ``config`` as a Ray task; returns the experiment folder.

    Args:
        address: a Ray cluster address; None or "" starts a local Ray (unless one is already
            initialised in this process, which is then used and left running).
        init_options: extra ``ray.init`` arguments for a Ray started here (e.g. ``num_cpus``).
    """
    ray = _ray()
    specs = plan(config, check_experiment(config))
    states = _states(specs)
    root = Path(config.out_dir) / config.name
    root.mkdir(parents=True, exist_ok=True)
    write_text_atomic(root / "experiment.yaml", to_yaml(config))
    todo = [
        dataclasses.replace(spec, run_dir=spec.run_dir.resolve()) for spec, (state, _) in zip(specs, states) if state != "done"
    ]
    if not todo:
        return root
    started_here = not ray.is_initialized()
    if started_here:
        ray.init(address=address or None, **(init_options or {}))
    try:
        _run_tasks(ray, todo, f"{config.name}: {len(specs)} runs", quiet, initial=len(specs) - len(todo), total=len(specs))
    finally:
        if started_here:
            ray.shutdown()
    return root


def _run_tasks(ray, todo: list[RunSpec], desc: str, quiet: bool, initial: int, total: int) -> None:
    """Submit one task per run and wait for all; the first failure is raised (finished runs stay on disk)."""
    task = ray.remote(train_task)
    pending = [
        task.options(num_cpus=spec.config.train.num_cpus, num_gpus=spec.config.train.num_gpus).remote(spec) for spec in todo
    ]
    with tqdm(total=total, initial=initial, desc=desc, unit="run", disable=quiet) as bar:
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            ray.get(done)
            bar.update(len(done))

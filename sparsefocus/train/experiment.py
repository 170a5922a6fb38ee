"""An experiment: mechanisms x seeds x settings, each run in its own folder, resumable.

``check_experiment`` validates everything (task, mechanisms against the sequence length, model,
optimiser) before any training; ``run_experiment`` skips finished runs, resumes partial ones and
trains the rest, in this process, in a pool of ``train.jobs`` processes, or (``train.batched``)
folded into one model per (setting, mechanism) by ``sparsefocus.train.driver``. A ``Budget``
stops every path at an epoch boundary; calling again continues.
"""

from __future__ import annotations

import multiprocessing
import os
import queue as queue_module
import re
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from sparsefocus.models.blocks import is_softmax_over_kept_keys
from sparsefocus.models.config import block_patterns, mechanism_label
from sparsefocus.train.checkpoint import CheckpointError, write_text_atomic
from sparsefocus.train.config import ExperimentConfig, expand_settings, make_task_config, to_yaml
from sparsefocus.train.driver import Budget, check_batched, group_specs, train_group
from sparsefocus.train.loop import RunSpec, check_run_folder, train_run


def slug(text: str) -> str:
    """A folder-safe name: ``BAND:5(1)`` -> ``BAND-5-1``."""
    return re.sub(r"[^A-Za-z0-9.=+,_-]+", "-", text).strip("-") or "default"


def _check_mechanism(index: int, mechanism: Any, config: ExperimentConfig, seq_len: int, causal: bool) -> None:
    """Parse a mechanism and check it fits the model and the sequence length; errors name it."""
    key = f"mechanisms[{index}]"
    try:
        patterns = block_patterns(mechanism, config.model.blocks)
    except ValueError as error:
        raise ValueError(f"{key} ({mechanism!r}): {error}") from None
    prefix = max(p.num_global_tokens for p in patterns) + int(config.model.pooling == "cls" and not causal)
    for pattern in patterns:
        try:
            pattern.check_sizes(seq_len + prefix, seq_len + prefix, causal)
        except ValueError as error:
            raise ValueError(f"{key} ({pattern.label()}): {error} (task length {seq_len} + {prefix} prefix tokens)") from None
        if config.model.paper_mode and not is_softmax_over_kept_keys(pattern):
            raise ValueError(f"{key} ({pattern.label()}): model.paper_mode needs a softmax-over-kept-keys pattern")


def _check_lists(config: ExperimentConfig) -> None:
    if not config.mechanisms:
        raise ValueError("mechanisms is empty: name at least one pattern")
    if not config.seeds:
        raise ValueError("seeds is empty: give at least one seed")
    if len(set(config.seeds)) != len(config.seeds):
        raise ValueError(f"seeds has repeats: {config.seeds}")
    labels = []
    for index, mechanism in enumerate(config.mechanisms):
        try:
            labels.append(mechanism_label(mechanism))
        except ValueError as error:
            raise ValueError(f"mechanisms[{index}] ({mechanism!r}): {error}") from None
    if len(set(labels)) != len(labels):
        raise ValueError(f"mechanisms has repeats: {labels}")


def check_experiment(config: ExperimentConfig) -> list[tuple[str, ExperimentConfig]]:
    """Validate every setting of ``config`` before training; returns (label, config) per setting.

    Builds each distinct task once (first seed) to learn its sequence length.
    Raises:
        ValueError: naming the bad key (``model.heads``, ``mechanisms[1]``, ``task.name``...).
    """
    _check_lists(config)
    settings = expand_settings(config)
    lengths: dict[str, tuple[int, bool]] = {}
    for label, setting in settings:
        where = "" if label == "default" else f"setting {label}: "
        try:
            for section in (setting.model, setting.optim, setting.train):
                section.validate()
            task_key = repr(sorted(setting.task.items()))
            if task_key not in lengths:
                data = make_task_config(setting.task).build(setting.seeds[0])
                lengths[task_key] = (data.seq_len, data.kind == "next_token")
            for index, mechanism in enumerate(setting.mechanisms):
                _check_mechanism(index, mechanism, setting, *lengths[task_key])
        except ValueError as error:
            raise ValueError(f"{where}{error}") from None
    return settings


def plan(config: ExperimentConfig, settings: list[tuple[str, ExperimentConfig]]) -> list[RunSpec]:
    """One ``RunSpec`` per (setting, mechanism, seed), in that order."""
    root = Path(config.out_dir) / config.name
    return [
        RunSpec(root / slug(label) / slug(mechanism_label(mechanism)) / f"seed-{seed}", setting, label, mechanism, seed)
        for label, setting in settings
        for mechanism in setting.mechanisms
        for seed in setting.seeds
    ]


def _states(specs: list[RunSpec]) -> list[tuple[str, int]]:
    """Folder state of every run; one error listing every broken folder."""
    states, broken = [], []
    for spec in specs:
        try:
            states.append(check_run_folder(spec))
        except CheckpointError as error:
            broken.append(str(error))
    if broken:
        raise CheckpointError("cannot resume:\n  " + "\n  ".join(broken))
    return states


def _worker(spec: RunSpec, threads: int, progress: Any, budget: Budget | None) -> str:
    torch.set_num_threads(threads)
    train_run(spec, on_epoch=lambda: progress.put(1), budget=budget)
    return str(spec.run_dir)


def _run_pool(todo: list[RunSpec], jobs: int, threads: int, bar: tqdm, budget: Budget | None) -> None:
    """Train ``todo`` in ``jobs`` spawned processes, feeding the progress bar from a queue."""
    context = multiprocessing.get_context("spawn")
    with context.Manager() as manager, ProcessPoolExecutor(jobs, mp_context=context) as pool:
        progress = manager.Queue()
        pending: set[Future] = {pool.submit(_worker, spec, threads, progress, budget) for spec in todo}
        while pending:
            done, pending = wait(pending, timeout=0.2, return_when=FIRST_COMPLETED)
            _drain(progress, bar)
            for future in done:
                future.result()  # re-raises a failed run's error; finished runs stay on disk
        _drain(progress, bar)


def _drain(progress: Any, bar: tqdm) -> None:
    while True:
        try:
            bar.update(progress.get_nowait())
        except queue_module.Empty:
            return


def run_experiment(config: ExperimentConfig, *, quiet: bool = False, budget: Budget | None = None) -> Path:
    """Check, then train every unfinished run of ``config``; returns the experiment folder.

    Finished runs are skipped, partial runs resume from their checkpoint, a missing or corrupt
    checkpoint stops everything before training with the folder's path. With a ``budget``,
    training stops at the first epoch boundary where the next epoch would not fit (every run
    checkpointed where it is); ``progress_line`` says what is finished.
    """
    settings = check_experiment(config)
    if config.train.batched:
        check_batched(settings)
    specs = plan(config, settings)
    states = _states(specs)
    root = Path(config.out_dir) / config.name
    root.mkdir(parents=True, exist_ok=True)
    write_text_atomic(root / "experiment.yaml", to_yaml(config))
    todo = [spec for spec, (state, _) in zip(specs, states) if state != "done"]
    jobs = min(config.train.jobs, max(len(todo), 1))
    threads = config.train.threads or max(1, (os.cpu_count() or 1) // jobs)
    total = sum(spec.config.train.epochs for spec in specs)
    finished = sum(epochs for _, epochs in states)
    with tqdm(total=total, initial=finished, desc=f"{config.name}: {len(specs)} runs", unit="epoch", disable=quiet) as bar:
        if config.train.batched:
            torch.set_num_threads(threads)
            _run_batched(specs, states, budget, bar)
        elif jobs <= 1:
            torch.set_num_threads(threads)
            for spec in todo:
                if budget is not None and not budget.allows():
                    break
                bar.set_postfix_str(f"{spec.label} seed {spec.seed}")
                limits = {} if budget is None else {"budget": budget}  # without a budget: train_run's plain call
                train_run(spec, on_epoch=lambda: bar.update(1), **limits)
        else:
            _run_pool(todo, jobs, threads, bar, budget)
    return root


def _run_batched(specs: list[RunSpec], states: list[tuple[str, int]], budget: Budget | None, bar: tqdm) -> None:
    """Unfinished runs grouped by (setting, mechanism, epoch reached), each group one folded model."""
    todo = [(spec, epochs) for spec, (state, epochs) in zip(specs, states) if state != "done"]
    for group in group_specs([spec for spec, _ in todo], [epochs for _, epochs in todo]):
        bar.set_postfix_str(f"{group[0].label} x {len(group)} seeds")
        if not train_group(group, budget, on_epoch=bar.update):
            return


def progress_line(config: ExperimentConfig) -> tuple[str, bool]:
    """(one-line summary of what is finished, whether everything is), from the run folders."""
    specs = plan(config, expand_settings(config))
    states = _states(specs)
    finished = sum(state == "done" for state, _ in states)
    epochs = sum(done for _, done in states)
    total = sum(spec.config.train.epochs for spec in specs)
    complete = finished == len(specs)
    tail = "all finished" if complete else "unfinished: run the same command again to continue"
    return f"{config.name}: {finished}/{len(specs)} runs finished, {epochs}/{total} epochs; {tail}", complete

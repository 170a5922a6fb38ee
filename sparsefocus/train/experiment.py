"""An experiment: mechanisms x seeds x settings, each run in its own folder, resumable.

``check_experiment`` validates everything (task, mechanisms against the sequence length, model,
optimiser) before any training; ``run_experiment`` skips finished runs, resumes partial ones and
trains the rest, in this process, in a pool of ``train.jobs`` processes, or (``train.batched``)
folded into one model per (setting, mechanism) by ``sparsefocus.train.driver``. A ``Budget``
stops every path at an epoch boundary; calling again continues.
"""

from __future__ import annotations

import functools
import json
import os
import re
import time
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from sparsefocus.models.blocks import is_softmax_over_kept_keys
from sparsefocus.models.config import block_patterns, mechanism_label
from sparsefocus.train.checkpoint import CheckpointError, slim_checkpoint, write_text_atomic
from sparsefocus.train.config import ExperimentConfig, expand_settings, make_task_config, to_yaml
from sparsefocus.train.driver import Budget, check_batched, group_specs, train_group, train_groups_together
from sparsefocus.train.loop import RunSpec, check_run_folder, resolve_device, train_run
from sparsefocus.train.report import first_nonfinite_epoch
from sparsefocus.train.workers import TIMING_NAME, WorkerPool, append_timing, lock_runs, machine, train_timed


class TrainingInterrupted(KeyboardInterrupt):
    """Ctrl-C stopped an experiment; the message says what finished and how to resume."""


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
            resolve_device(setting.train.device)
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


def run_experiment(config: ExperimentConfig, *, quiet: bool = False, budget: Budget | None = None) -> Path:
    """Check, then train every unfinished run of ``config``; returns the experiment folder.

    Finished runs are skipped, partial runs resume from their checkpoint, a missing or corrupt
    checkpoint stops everything before training with the folder's path. The run folders to train
    are locked while this runs; the wall-clock time of an invocation that trains anything is added
    to the experiment's ``timing.json`` (and each run's to its own). With a ``budget``, training
    stops at the first epoch boundary where the next epoch would not fit (every run checkpointed
    where it is); ``progress_line`` says what is finished.

    Raises:
        RunLocked: another trainer holds one of the run folders.
        TrainingInterrupted: Ctrl-C; finished runs and the last checkpoints of the others stay.
    """
    settings = check_experiment(config)
    if config.train.batched:
        check_batched(settings)
    specs = plan(config, settings)
    root = Path(config.out_dir) / config.name
    with lock_runs([spec.run_dir for spec in specs]):
        states = _states(specs)
        root.mkdir(parents=True, exist_ok=True)
        write_text_atomic(root / "experiment.yaml", to_yaml(config))
        _train(config, root, specs, states, quiet, budget)
    return root


def _train(
    config: ExperimentConfig, root: Path, specs: list[RunSpec], states: list[tuple[str, int]], quiet: bool, budget: Budget | None
) -> None:
    todo = [(spec, epochs) for spec, (state, epochs) in zip(specs, states) if state != "done"]
    jobs = min(config.train.jobs, max(len(todo), 1))
    threads = config.train.threads or max(1, (os.cpu_count() or 1) // jobs)
    context: dict[str, Any] = {"jobs": jobs, "threads": threads, **machine()}
    if config.train.batched:
        context |= {"batched": True, "concurrent_groups": config.train.concurrent_groups}
    progress = {"runs": 0, "epochs": 0}
    total = sum(spec.config.train.epochs for spec in specs)
    began = time.perf_counter()
    bar = tqdm(
        total=total, initial=sum(e for _, e in states), desc=f"{config.name}: {len(specs)} runs", unit="epoch", disable=quiet
    )

    def on_message(kind: str, spec: RunSpec) -> None:
        if kind == "epoch":
            bar.update(1)
            progress["epochs"] += 1
        else:
            progress["runs"] += 1

    try:
        if config.train.batched:
            torch.set_num_threads(threads)
            _run_batched(todo, budget, bar, progress, context)
        elif jobs <= 1:
            _train_here(todo, threads, context, bar, on_message, budget)
        else:
            _train_in_pool(todo, jobs, threads, context, on_message, budget)
    except KeyboardInterrupt:
        done = len(specs) - len(todo) + progress["runs"]
        raise TrainingInterrupted(
            f"Ctrl-C: {done} of {len(specs)} runs finished, the others keep their last checkpoint; "
            f"run the same command again to resume"
        ) from None
    finally:
        bar.close()
        _add_timing(root, progress, time.perf_counter() - began, context)


def _train_here(
    todo: list[tuple[RunSpec, int]], threads: int, context: dict[str, Any], bar: tqdm, on_message: Any, budget: Budget | None
) -> None:
    torch.set_num_threads(threads)
    train = train_run if budget is None else functools.partial(train_run, budget=budget)
    for spec, epochs in todo:
        if budget is not None and not budget.allows():
            return
        bar.set_postfix_str(f"{spec.label} seed {spec.seed}")
        metrics = train_timed(spec, epochs, context, on_epoch=functools.partial(on_message, "epoch", spec), train=train)
        if metrics is None or len(metrics) >= spec.config.train.epochs:
            on_message("done", spec)


def _train_in_pool(
    todo: list[tuple[RunSpec, int]], jobs: int, threads: int, context: dict[str, Any], on_message: Any, budget: Budget | None
) -> None:
    pool = WorkerPool(jobs, threads)
    try:
        pool.run(todo, context, on_message, budget)
    finally:
        pool.stop()


def _add_timing(root: Path, progress: dict[str, int], seconds: float, context: dict[str, Any]) -> None:
    """Append this invocation's wall-clock time to ``root/timing.json``, if it trained anything."""
    if progress["epochs"] == 0:
        return
    path = root / TIMING_NAME
    history = json.loads(path.read_text()) if path.exists() else []
    entry = {"seconds": round(seconds, 1), "runs_finished": progress["runs"], "epochs": progress["epochs"], **context}
    write_text_atomic(path, json.dumps([*history, entry], indent=1))


def _run_batched(
    todo: list[tuple[RunSpec, int]], budget: Budget | None, bar: tqdm, progress: dict[str, int], context: dict[str, Any]
) -> None:
    """Unfinished runs grouped by (setting, mechanism, epoch reached), each group one folded model;
    with ``train.concurrent_groups`` > 1 that many folded models train at once. Each run's
    ``timing.json`` gets its group's wall-clock time (shared by the runs folded together, and with
    concurrent groups counted from the start of their joint training)."""
    start = {spec.run_dir: epochs for spec, epochs in todo}
    groups = group_specs([spec for spec, _ in todo], [epochs for _, epochs in todo])
    timers = [_GroupTimer(group, start, bar, progress, context) for group in groups]
    width = groups[0][0].config.train.concurrent_groups if groups else 1
    if width > 1:
        bar.set_postfix_str(f"{len(groups)} groups, {width} at a time")
        try:
            train_groups_together(groups, width, budget, on_epochs=[timer.on_epoch for timer in timers])
        finally:
            for timer in timers:
                timer.close()
        return
    for group, timer in zip(groups, timers):
        bar.set_postfix_str(f"{group[0].label} x {len(group)} seeds")
        timer.begin()
        try:
            allowed = train_group(group, budget, on_epoch=timer.on_epoch)
        finally:
            timer.close()
        if not allowed:
            return


class _GroupTimer:
    """Counts one group's trained epochs and appends its wall-clock segment to each run's timing."""

    def __init__(self, group: list[RunSpec], start: dict[Path, int], bar: tqdm, progress: dict[str, int], context: dict) -> None:
        self.group, self.start, self.bar, self.progress, self.context = group, start, bar, progress, context
        self.began = self.ended = time.perf_counter()
        self.trained = 0

    def begin(self) -> None:
        self.began = time.perf_counter()

    def on_epoch(self, count: int = 1) -> None:
        self.bar.update(count)
        self.progress["epochs"] += count
        self.trained += count
        self.ended = time.perf_counter()

    def close(self) -> None:
        epochs = self.trained // len(self.group)
        if not epochs:
            return
        segment = {"seconds": round(self.ended - self.began, 3), "folded_runs": len(self.group), **self.context}
        for spec in self.group:
            first = self.start[spec.run_dir]
            append_timing(spec.run_dir, {"from_epoch": first + 1, "to_epoch": first + epochs} | segment)
            self.progress["runs"] += first + epochs >= spec.config.train.epochs


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


def group_progress(config: ExperimentConfig) -> dict[str, str]:
    """Per mechanism group (``<setting>/<label>``), the epochs its runs have reached out of the
    total: "8/100" when they agree, "8-9/100" when they differ (such runs resume as separate
    folded parts)."""
    specs = plan(config, expand_settings(config))
    reached: dict[str, list[int]] = {}
    for spec, (_, done) in zip(specs, _states(specs)):
        reached.setdefault(f"{spec.setting}/{spec.label}", [spec.config.train.epochs]).append(done)
    spans = {group: (min(done), max(done), total) for group, (total, *done) in reached.items()}
    return {group: f"{low}/{total}" if low == high else f"{low}-{high}/{total}" for group, (low, high, total) in spans.items()}


def nonfinite_runs(config: ExperimentConfig) -> dict[str, int]:
    """Run (``<setting>/<label>/seed-<seed>``) -> the first epoch whose training or held-out loss
    is not finite, for the runs of ``config`` where one is (a diverged run or a failed computation
    keeps training on NaN weights; this names it at once)."""
    found = {}
    for spec in plan(config, expand_settings(config)):
        path = spec.run_dir / "metrics.jsonl"
        if not path.exists():
            continue
        lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        epoch = first_nonfinite_epoch(lines)
        if epoch is not None:
            found[f"{spec.setting}/{spec.label}/seed-{spec.seed}"] = epoch
    return found


def finished_groups(config: ExperimentConfig) -> list[Path]:
    """The mechanism folders (``<experiment>/<setting>/<mechanism>``) of ``config`` whose every run,
    one per seed, has finished; in the order ``plan`` gives."""
    specs = plan(config, expand_settings(config))
    done: dict[Path, bool] = {}
    for spec, (state, _) in zip(specs, _states(specs), strict=True):
        group = spec.run_dir.parent
        done[group] = done.get(group, True) and state == "done"
    return [group for group, finished in done.items() if finished]


def slim_finished_runs(root: str | Path, keep_seeds: tuple[int, ...] = ()) -> list[Path]:
    """Slim the checkpoints of the finished runs under the experiment folder ``root`` (metrics
    only, ``slim_checkpoint``), except the runs of ``keep_seeds`` (for example the seed that
    ``sparsefocus analyze`` reads). They still count as finished, so the experiment resumes past
    them and reports them; analysing them needs their weights and is refused. Returns the
    checkpoints rewritten."""
    slimmed = []
    for path in sorted(Path(root).glob("*/*/seed-*/checkpoint.pt")):
        if int(path.parent.name.removeprefix("seed-")) in keep_seeds:
            continue
        if slim_checkpoint(path):
            slimmed.append(path)
    return slimmed

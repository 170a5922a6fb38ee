"""The flat training loop of one run (one mechanism, one seed, one setting), resumable.

A run folder holds ``config.yaml`` (the resolved run config, written once the first checkpoint
exists, so its presence means "started"), ``metrics.jsonl`` (one line per finished epoch) and
``checkpoint.pt`` (model, optimiser, schedule, RNG states and the metrics so far).
"""

from __future__ import annotations

import contextlib
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.nn.functional as F
import yaml
from torch import Tensor, nn

from sparsefocus.layers import SparseAttention
from sparsefocus.layers.attention import total_aux_loss
from sparsefocus.models import Decoder, Encoder, ModelConfig, mechanism_label
from sparsefocus.tasks.base import TaskData
from sparsefocus.tasks.lm import perplexity
from sparsefocus.train.checkpoint import CheckpointError, load_checkpoint, save_checkpoint, write_text_atomic
from sparsefocus.train.config import ExperimentConfig, OptimConfig, make_task_config
from sparsefocus.train.tensorboard import ScalarLog

if TYPE_CHECKING:
    from sparsefocus.train.driver import Budget

# Keys that may change between an interrupted run and its resumption without changing its result.
# train.batched is free because its exact mode equals this loop (train.batched_mode is recorded).
RESUME_FREE_KEYS = (
    "name",
    "out_dir",
    "train.jobs",
    "train.threads",
    "train.device",
    "train.tensorboard",
    "train.num_cpus",
    "train.num_gpus",
    "train.batched",
    "train.batched_max_runs",
    "train.concurrent_groups",
    "train.checkpoint_every",
    "train.compile",
    "train.compile_scope",
    "train.task_cache",
    "train.topk_select",  # both pick the k largest scores; they differ only between near ties (rounding)
    "train.fast_attention",  # the same attention computed another way (rounding, fast mode's dropout draws)
    "mechanisms",  # the grid's lists: a run is its own mechanism and seed (recorded apart), so a
    "seeds",  # study can be trained a few groups or seeds at a time and reported whole
)


@dataclass
class RunSpec:
    """One run: a setting-resolved config, a mechanism (spec or per-block list) and a seed."""

    run_dir: Path
    config: ExperimentConfig
    setting: str
    mechanism: Any
    seed: int

    @property
    def label(self) -> str:
        return mechanism_label(self.mechanism)

    def record(self) -> dict[str, Any]:
        """What ``config.yaml`` holds: enough to retrain the run and to group it in reports."""
        return {
            "mechanism": self.mechanism,
            "label": self.label,
            "seed": self.seed,
            "setting": self.setting,
            "config": self.config.to_dict(),
        }


def build_model(config: ModelConfig, mechanism: Any, data: TaskData) -> nn.Module:
    """An Encoder for classification tasks, a Decoder for next-token tasks, sized from ``data``."""
    if data.kind == "next_token":
        return Decoder(config, mechanism, vocab_size=data.vocab_size, max_len=data.seq_len, pad_id=data.pad_id)
    return Encoder(
        config, mechanism, vocab_size=data.vocab_size, num_classes=data.num_classes, max_len=data.seq_len, pad_id=data.pad_id
    )


def make_optimizer(config: OptimConfig, model: nn.Module) -> torch.optim.Optimizer:
    """Plain SGD (the paper: no momentum, no weight decay by default) or AdamW."""
    if config.name == "sgd":
        return torch.optim.SGD(model.parameters(), lr=config.lr, momentum=config.momentum, weight_decay=config.weight_decay)
    return torch.optim.AdamW(model.parameters(), lr=config.lr, betas=tuple(config.betas), weight_decay=config.weight_decay)


def lr_factor(config: OptimConfig, step: int, steps_per_epoch: int, total_epochs: int) -> float:
    """Multiplier of the initial lr after ``step`` optimiser steps. The step schedule changes only at
    epoch boundaries, so it equals the paper's per-epoch StepLR; cosine warms up linearly over
    ``warmup_epochs`` and then decays to ``min_lr_ratio`` at the last step."""
    if config.schedule == "step":
        return config.decay ** ((step // steps_per_epoch) // config.step_epochs)
    if config.schedule == "constant":
        return 1.0
    warmup, total = config.warmup_epochs * steps_per_epoch, total_epochs * steps_per_epoch
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(total - warmup, 1))
    return config.min_lr_ratio + (1 - config.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


@contextlib.contextmanager
def matmul_precision(name: str):
    """``torch.set_float32_matmul_precision(name)`` ("highest", "high", "medium") while training."""
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(name)
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(previous)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("train.device is 'cuda' but no CUDA device is available")
    return torch.device(name)


def loss_and_counts(logits: Tensor, targets: Tensor) -> tuple[Tensor, int, int]:
    """Mean cross-entropy, number correct and number scored. logits [B, C] or [B, L, V]; targets
    [B] or [B, L] with -100 = not scored."""
    logits = logits.reshape(-1, logits.shape[-1])  # [B*L, V] (or [B, C])
    targets = targets.reshape(-1)
    scored = targets != -100
    loss = F.cross_entropy(logits, targets, ignore_index=-100)
    correct = int((logits.argmax(-1)[scored] == targets[scored]).sum())
    return loss, correct, int(scored.sum())


def scored_logits(model: nn.Module, inputs: Tensor, targets: Tensor) -> tuple[Tensor, Tensor]:
    """(logits, targets) for ``loss_and_counts``. A Decoder computes its V-way head only at the
    scored positions (logits [S, V], targets [S]): the same loss and counts, but MQAR scores 16 of
    256 positions, so the head over all of them would cost most of the step."""
    if isinstance(model, Decoder):
        scored = targets != -100  # [B, L]
        return model(inputs, scored), targets[scored]
    return model(inputs), targets


@torch.no_grad()
def evaluate(model: nn.Module, inputs: Tensor, targets: Tensor, batch_size: int) -> tuple[float, float]:
    """(mean cross-entropy, accuracy) over a whole split in eval mode."""
    model.eval()
    loss_sum, correct, count = 0.0, 0, 0
    for start in range(0, inputs.shape[0], batch_size):
        rows = slice(start, start + batch_size)
        loss, right, scored = loss_and_counts(*scored_logits(model, inputs[rows], targets[rows]))
        loss_sum, correct, count = loss_sum + float(loss) * scored, correct + right, count + scored
    return loss_sum / max(count, 1), correct / max(count, 1)


def train_epoch(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    data: TaskData,
    config: ExperimentConfig,
    generator: torch.Generator,
) -> tuple[float, float]:
    """One pass over the training set (shuffled unless ``train.shuffle`` is false); returns the
    running (mean batch) loss and accuracy."""
    model.train()
    count = data.train_inputs.shape[0]
    order = torch.randperm(count, generator=generator) if config.train.shuffle else torch.arange(count)
    order = order.to(data.train_inputs.device)
    loss_sum, correct, count = 0.0, 0, 0
    has_aux = any(isinstance(m, SparseAttention) and m.pattern.has_aux_loss for m in model.modules())
    for start in range(0, order.shape[0], config.train.batch_size):
        batch = order[start : start + config.train.batch_size]
        logits, targets = scored_logits(model, data.train_inputs[batch], data.train_targets[batch])
        loss, right, scored = loss_and_counts(logits, targets)
        optimizer.zero_grad(set_to_none=True)
        # a mechanism's auxiliary loss (DSA's indexer distillation) trains what the task loss cannot
        # reach; the logged loss stays the task's
        objective = loss + total_aux_loss(model) if has_aux else loss
        objective.backward()
        if config.optim.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), config.optim.grad_clip)
        optimizer.step()
        scheduler.step()  # per optimiser step; lr_factor makes the step schedule change per epoch
        loss_sum, correct, count = loss_sum + float(loss.detach()) * scored, correct + right, count + scored
    return loss_sum / max(count, 1), correct / max(count, 1)


def epoch_metrics(
    epoch: int,
    model: nn.Module,
    data: TaskData,
    config: ExperimentConfig,
    running: tuple[float, float],
    lr: float,
    seconds: float,
) -> dict[str, float]:
    """One line of metrics.jsonl: the paper evaluates the whole training set in eval mode each epoch."""
    if config.train.train_loss == "full_eval":
        train_loss, train_acc = evaluate(model, data.train_inputs, data.train_targets, config.train.eval_batch_size)
    else:
        train_loss, train_acc = running
    valid_loss, valid_acc = evaluate(model, data.valid_inputs, data.valid_targets, config.train.eval_batch_size)
    metrics = {
        "epoch": epoch,
        "train_loss": train_loss,
        "train_acc": train_acc,
        "valid_loss": valid_loss,
        "valid_acc": valid_acc,
        "lr": lr,
        "seconds": round(seconds, 4),
    }
    if data.kind == "next_token":
        metrics |= language_model_metrics(model, data, config.train.eval_batch_size, valid_loss)
    return metrics


def language_model_metrics(model: nn.Module, data: TaskData, batch_size: int, valid_loss: float) -> dict[str, float]:
    """Per-token perplexity exp(mean NLL) on the held-out split, and on the test split if the task has one."""
    metrics = {"valid_ppl": perplexity(valid_loss)}
    if data.test_inputs is not None:
        test_loss, test_acc = evaluate(model, data.test_inputs, data.test_targets, batch_size)
        metrics |= {"test_loss": test_loss, "test_acc": test_acc, "test_ppl": perplexity(test_loss)}
    return metrics


def build_data(config: ExperimentConfig, seed: int, device: torch.device) -> TaskData:
    """The task's data for ``seed``, tensors moved to ``device``."""
    data = make_task_config(config.task).build(seed)
    for name in ("train_inputs", "train_targets", "valid_inputs", "valid_targets", "test_inputs", "test_targets"):
        if getattr(data, name) is not None:
            setattr(data, name, getattr(data, name).to(device))
    return data


def _flatten(data: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(data, dict):
        out: dict[str, Any] = {}
        for key, value in data.items():
            out.update(_flatten(value, f"{prefix}{key}."))
        return out
    return {prefix.rstrip("."): data}


def _default_keys() -> dict[str, Any]:
    """Flattened ``config.model.*``, ``config.optim.*`` and ``config.train.*`` defaults, as a
    ``config.yaml`` records them."""
    defaults = ExperimentConfig().to_dict()
    sections = {name: defaults[name] for name in ("model", "optim", "train")}
    return _flatten(yaml.safe_load(yaml.safe_dump({"config": sections})))


EPOCHS_KEY = "config.train.epochs"


def _may_extend(spec: RunSpec, old: dict[str, Any], new: dict[str, Any]) -> bool:
    """Whether a run recorded with ``old`` may continue to ``new``'s larger ``train.epochs``: only
    where its lr schedule does not depend on the total (step, constant), so that the longer run
    is the one a config with the larger total from the start would train."""
    grows = isinstance(old.get(EPOCHS_KEY), int) and new[EPOCHS_KEY] > old[EPOCHS_KEY]
    return grows and spec.config.optim.schedule != "cosine"


def check_run_folder(spec: RunSpec) -> tuple[str, int]:
    """State of a run folder: ("new", 0), ("partial", epochs done) or ("done", epochs).

    A finished run continues ("partial") when the config asks for more epochs than it was
    trained for and its schedule does not depend on the total (``_may_extend``).

    Raises:
        CheckpointError: the folder was started but its checkpoint is missing or corrupt, or a
            slimmed run (metrics only) would have to continue.
        ValueError: the folder was made by a different config (names the first differing key).
    """
    record_path = spec.run_dir / "config.yaml"
    if not record_path.exists():
        return "new", 0
    old = _flatten(yaml.safe_load(record_path.read_text()) or {})
    new = _flatten(yaml.safe_load(yaml.safe_dump(spec.record())))
    defaults = _default_keys()
    extend = _may_extend(spec, old, new)
    for key in sorted(set(old) | set(new)):
        if key.removeprefix("config.") in RESUME_FREE_KEYS or (key == EPOCHS_KEY and extend):
            continue
        if key not in old and key in defaults and new.get(key) == defaults[key]:
            continue  # a key added after the folder was written, at its default: the old behaviour
        if old.get(key) != new.get(key):
            raise ValueError(
                f"{spec.run_dir} was trained with {key}={old.get(key)!r}, the config now says {new.get(key)!r}; "
                f"choose another experiment name or delete that folder"
            )
    state = load_checkpoint(spec.run_dir / "checkpoint.pt")
    epoch = int(state["epoch"])
    if state.get("finished") and epoch >= spec.config.train.epochs:
        return "done", epoch
    if state.get("slim"):
        raise CheckpointError(
            f"{spec.run_dir} finished {epoch} epochs and was slimmed (metrics only): it cannot continue to "
            f"{spec.config.train.epochs}"
        )
    return "partial", epoch


def record_epochs(spec: RunSpec) -> None:
    """Write the config's ``train.epochs`` into a resumed run's config.yaml when it continues past
    the total it was recorded with; the rest of the record stays as first written."""
    path = spec.run_dir / "config.yaml"
    record = yaml.safe_load(path.read_text())
    train = record["config"]["train"]
    if train.get("epochs") != spec.config.train.epochs:
        train["epochs"] = spec.config.train.epochs
        write_text_atomic(path, yaml.safe_dump(record, sort_keys=False))


def _state(epoch: int, finished: bool, model, optimizer, scheduler, generator, metrics) -> dict[str, Any]:
    return {
        "epoch": epoch,
        "finished": finished,
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "torch_rng": torch.get_rng_state(),
        "generator": generator.get_state(),
        "metrics": metrics,
    }


def _write_metrics(run_dir: Path, metrics: list[dict[str, float]]) -> None:
    write_text_atomic(run_dir / "metrics.jsonl", "".join(json.dumps(m) + "\n" for m in metrics))


def train_run(
    spec: RunSpec, on_epoch: Callable[[], None] | None = None, budget: "Budget | None" = None
) -> list[dict[str, float]]:
    """Train one run to ``train.epochs``, resuming from its checkpoint if the folder was started.

    Returns the per-epoch metrics (also in ``metrics.jsonl``). ``on_epoch`` is called after every
    epoch (progress bars). With a ``budget`` it stops before an epoch that would not fit, after
    checkpointing the epoch reached.
    """
    with matmul_precision(spec.config.train.matmul_precision):
        return _train_run(spec, on_epoch, budget)


def _train_run(spec: RunSpec, on_epoch: Callable[[], None] | None, budget: "Budget | None") -> list[dict[str, float]]:
    config = spec.config
    device = resolve_device(config.train.device)
    data = build_data(config, spec.seed, device)
    torch.manual_seed(spec.seed)
    model = build_model(config.model, spec.mechanism, data).to(device)
    optimizer = make_optimizer(config.optim, model)
    steps_per_epoch = math.ceil(data.train_inputs.shape[0] / config.train.batch_size)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(config.optim, step, steps_per_epoch, config.train.epochs)
    )
    generator = torch.Generator().manual_seed(spec.seed)
    start, metrics = _start_or_resume(spec, model, optimizer, scheduler, generator)
    scalars = ScalarLog(spec.run_dir, config.train.tensorboard, first_epoch=start + 1)
    saved = start
    try:
        for epoch in range(start + 1, config.train.epochs + 1):
            if budget is not None and not budget.allows():
                if saved != epoch - 1:
                    save_checkpoint(
                        spec.run_dir / "checkpoint.pt", _state(epoch - 1, False, model, optimizer, scheduler, generator, metrics)
                    )
                return metrics
            began = time.perf_counter()
            lr = optimizer.param_groups[0]["lr"]
            running = train_epoch(model, optimizer, scheduler, data, config, generator)
            metrics.append(epoch_metrics(epoch, model, data, config, running, lr, time.perf_counter() - began))
            _write_metrics(spec.run_dir, metrics)
            scalars.write(metrics[-1])
            last = epoch == config.train.epochs
            if last or epoch % config.train.checkpoint_every == 0:
                state = _state(epoch, last, model, optimizer, scheduler, generator, metrics)
                save_checkpoint(spec.run_dir / "checkpoint.pt", state)
                saved = epoch
            if budget is not None:
                budget.record(time.perf_counter() - began)
            if on_epoch is not None:
                on_epoch()
    finally:
        scalars.close()
    return metrics


def _start_or_resume(spec: RunSpec, model, optimizer, scheduler, generator) -> tuple[int, list[dict[str, float]]]:
    """Restore a started run from its checkpoint, or start the folder: checkpoint first, then config.yaml."""
    if (spec.run_dir / "config.yaml").exists():
        state = load_checkpoint(spec.run_dir / "checkpoint.pt")
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        torch.set_rng_state(state["torch_rng"])
        generator.set_state(state["generator"])
        metrics = list(state["metrics"])
        _write_metrics(spec.run_dir, metrics)  # drop epochs logged after the last checkpoint
        record_epochs(spec)
        return int(state["epoch"]), metrics
    spec.run_dir.mkdir(parents=True, exist_ok=True)
    save_checkpoint(spec.run_dir / "checkpoint.pt", _state(0, False, model, optimizer, scheduler, generator, []))
    write_text_atomic(spec.run_dir / "config.yaml", yaml.safe_dump(spec.record(), sort_keys=False))
    return 0, []

"""Typed experiment configs: dataclass defaults <- a YAML file <- dotted ``key=value`` overrides.

An experiment is mechanisms x seeds x settings; ``settings`` maps dotted keys to lists of values
and every combination is one setting (``{"model.blocks": [6, 10]}`` gives two). Everything is
checked before any training starts, and every error names the key it is about.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from sparsefocus.models.config import ModelConfig

PAPER_SEEDS = [153476998, 235510766, 205084180, 129959864, 149896109, 140439608, 145017219, 162518970, 245293503, 152674004]
OPTIMIZERS = ("sgd", "adamw")
SCHEDULES = ("constant", "step", "cosine")
TRAIN_LOSSES = ("full_eval", "running")
DEVICES = ("cpu", "cuda", "auto")
BATCHED_MODES = ("exact", "fast")
COMPILE_MODES = ("auto", "eager", "default", "reduce-overhead", "step-graph", "eager-graph")
MATMUL_PRECISIONS = ("highest", "high", "medium")
AUTOCASTS = ("none", "bf16")
TOPK_SELECTS = ("torch", "triton")
FAST_ATTENTIONS = ("masks", "lists", "fixed-lists")
COMPILE_SCOPES = ("step", "blocks")


@dataclass
class OptimConfig:
    """Optimiser and learning-rate schedule.

    Args:
        name: "sgd" (the paper: plain, no momentum) or "adamw". Default: "sgd".
        lr: initial learning rate. Default: 0.1.
        momentum: SGD momentum. Default: 0.
        weight_decay: decoupled for AdamW, L2 for SGD. Default: 0 (AdamW with 0 is Adam).
        betas: AdamW betas. Default: [0.9, 0.999].
        grad_clip: max gradient norm; 0 turns clipping off. Default: 0.5 (the paper).
        schedule: "constant", "step" (x decay every step_epochs, the paper's StepLR) or "cosine"
            (linear warmup over warmup_epochs, then cosine to min_lr_ratio x lr). Default: "step".
        decay: the step schedule's factor. Default: 0.9995 (the paper's Chomsky runs).
        step_epochs: epochs between step decays. Default: 1.
        warmup_epochs: cosine warmup length, may be fractional. Default: 0.
        min_lr_ratio: cosine floor as a fraction of lr. Default: 0.
    """

    name: str = "sgd"
    lr: float = 0.1
    momentum: float = 0.0
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    grad_clip: float = 0.5
    schedule: str = "step"
    decay: float = 0.9995
    step_epochs: int = 1
    warmup_epochs: float = 0.0
    min_lr_ratio: float = 0.0

    def validate(self) -> None:
        _choice("optim.name", self.name, OPTIMIZERS)
        _choice("optim.schedule", self.schedule, SCHEDULES)
        _positive("optim.lr", self.lr)
        _positive("optim.decay", self.decay)
        _positive("optim.step_epochs", self.step_epochs)
        for key in ("momentum", "weight_decay", "grad_clip", "warmup_epochs", "min_lr_ratio"):
            if getattr(self, key) < 0:
                raise ValueError(f"optim.{key} must be >= 0, got {getattr(self, key)}")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise ValueError(f"optim.betas must be two numbers in [0, 1), got {self.betas}")


@dataclass
class TrainConfig:
    """Loop settings.

    Args:
        epochs: passes over the training set. Default: 10.
        batch_size: Default: 25 (the paper).
        train_loss: "full_eval" (the paper: loss and accuracy over the whole training set in eval
            mode after every epoch) or "running" (mean of the training batches, cheaper). Default: "full_eval".
        eval_batch_size: batch size for evaluation. Default: 500.
        device: "cpu", "cuda" or "auto". Default: "cpu".
        threads: torch threads per run; 0 = torch's default (or cores / jobs). Default: 0.
        jobs: runs trained at once in separate processes. Default: 1.
        checkpoint_every: epochs between checkpoints (the last epoch is always saved). Default: 1.
        tensorboard: also write each epoch's scalars as TensorBoard events in the run folder
            (needs the ``tensorboard`` package). Default: False.
        num_cpus, num_gpus: resources one run asks for when runs are Ray tasks
            (``sparsefocus train CONFIG --ray``). Default: 1 CPU, 0 GPUs.
        batched: train the seeds of each (setting, mechanism) as one run-folded model on one
            device (``sparsefocus.train.driver``; docs/scale.md). Same run folders. Default: False.
        batched_mode: "exact" (each run's dropout from its own generator in the single-run order,
            materialised attention: equals ``train_run``) or "fast" (fused attention, one shared
            dropout stream, torch.compile on CUDA). Default: "exact".
        batched_max_runs: most runs folded into one model; 0 = every seed. Default: 0.
        concurrent_groups: folded models (groups of one setting and mechanism) the batched path
            trains at once in one process, a step of each in turn, each on its own CUDA stream so
            that small models share the GPU; each keeps its own dropout stream, so results do not
            depend on it on the CPU (tested). On CUDA, lanes whose step graphs shared a capture
            stream moved the later runs of 10-run folds (docs/scale.md); each graph now has a
            stream of its own, and the CUDA test's concurrent runs move no more than lone runs
            trained twice (H200). Not with ``compile="reduce-overhead"``. Default: 1.
        compile: torch.compile of the batched fast step: "auto" (default mode on CUDA, off on
            CPU), "eager" (no compile), "default", "reduce-overhead" (CUDA graphs of the forward
            and backward), or "step-graph" (CUDA only, plain SGD: the forward compiled in default
            mode and the whole step, forward, backward, clipping and update, replayed as one CUDA
            graph), or "eager-graph" (the same graph of PyTorch's own kernels: nothing compiles).
            Default: "auto".
        compile_scope: what a compiling mode compiles: "step" (the folded model's whole forward
            and loss as one graph) or "blocks" (each transformer block, one graph for the blocks
            alike, the rest eager; in step-graph mode the eager rest is captured with the step).
            "blocks" compiled a folded ListOps model in less time on a CPU (38 against 90 s with
            an empty Inductor cache, 4.1 against 12.8 s with a warm one) and gives up the fusions
            across block boundaries; its effect on a GPU step is not measured yet. Default: "step".
        compile_autotune: compile the fast step with Inductor's max-autotune (without its CUDA
            graphs: "reduce-overhead" and "step-graph" keep theirs): it times Triton templates for
            the folded products and fuses the elementwise work around them (LayerNorm, bias,
            activation, dropout, residual) into them; compiling takes minutes longer. Needs a
            compiling ``compile`` mode. Not yet measured on a GPU. Default: False.
        matmul_precision: ``torch.set_float32_matmul_precision`` while training: "highest" (fp32),
            "high" (TF32 on CUDA) or "medium". Default: "highest".
        autocast: "none" or "bf16" (autocast of the batched forward). Default: "none".
        topk_select: how the batched fast path picks TOPK keys: "torch" (scores + topk) or
            "triton" (the fused selection kernel, CUDA). Default: "torch".
        fast_attention: how the batched fast path trains the paper's BAND, BLOC and TOPK: "masks"
            (SDPA with the pattern's [N, M] mask, or a mask of the chosen keys) or "lists" (each
            query over its key list: ``batched.gathered_attention``; global rows over every
            key) or "fixed-lists" (BAND and BLOC over key lists, TOPK through the mask of its
            chosen keys: the faster form of each at the ListOps shape on the H200, where lists
            take BLOC:5's step from 14.2 to 11.1 ms and TOPK's attention over its chosen keys
            alone was slower than the masked form; docs/performance.md). Default: "masks".
        task_cache: the batched path keeps each seed's built task data under
            ``<out_dir>/.task-cache`` (keyed by the task config and its generator's source; one
            file for every seed when ``task.data_seed`` is set) and builds missing seeds in
            parallel processes. Default: False.
        shuffle: reshuffle the training examples every epoch; false feeds them in the task's order
            every epoch (corpus order for ``lm_window``, as the Semantic Focus PTB runs). Default: true.
    """

    epochs: int = 10
    batch_size: int = 25
    train_loss: str = "full_eval"
    eval_batch_size: int = 500
    device: str = "cpu"
    threads: int = 0
    jobs: int = 1
    checkpoint_every: int = 1
    tensorboard: bool = False
    num_cpus: float = 1.0
    num_gpus: float = 0.0
    batched: bool = False
    batched_mode: str = "exact"
    batched_max_runs: int = 0
    concurrent_groups: int = 1
    compile: str = "auto"
    compile_scope: str = "step"
    compile_autotune: bool = False
    matmul_precision: str = "highest"
    autocast: str = "none"
    topk_select: str = "torch"
    fast_attention: str = "masks"
    task_cache: bool = False
    shuffle: bool = True

    def validate(self) -> None:
        for key in ("epochs", "batch_size", "eval_batch_size", "jobs", "checkpoint_every"):
            _positive(f"train.{key}", getattr(self, key))
        for key in ("num_cpus", "num_gpus"):
            if getattr(self, key) < 0:
                raise ValueError(f"train.{key} must be >= 0, got {getattr(self, key)}")
        if self.threads < 0:
            raise ValueError(f"train.threads must be >= 0, got {self.threads}")
        _choice("train.train_loss", self.train_loss, TRAIN_LOSSES)
        _choice("train.device", self.device, DEVICES)
        self.validate_batched()

    def validate_batched(self) -> None:
        """The batched path's keys; those that only the batched path reads need ``batched``."""
        _choice("train.batched_mode", self.batched_mode, BATCHED_MODES)
        _choice("train.compile", self.compile, COMPILE_MODES)
        _choice("train.compile_scope", self.compile_scope, COMPILE_SCOPES)
        _choice("train.matmul_precision", self.matmul_precision, MATMUL_PRECISIONS)
        _choice("train.autocast", self.autocast, AUTOCASTS)
        _choice("train.topk_select", self.topk_select, TOPK_SELECTS)
        _choice("train.fast_attention", self.fast_attention, FAST_ATTENTIONS)
        if self.compile_autotune and self.compile in ("eager", "eager-graph"):
            raise ValueError(f"train.compile_autotune needs a compiling train.compile mode, got {self.compile!r}")
        if self.batched_max_runs < 0:
            raise ValueError(f"train.batched_max_runs must be >= 0, got {self.batched_max_runs}")
        _positive("train.concurrent_groups", self.concurrent_groups)
        if self.concurrent_groups > 1 and not self.batched:
            raise ValueError("train.concurrent_groups is read by the batched path only: set train.batched=true")
        if self.concurrent_groups > 1 and self.compile == "reduce-overhead":
            # Inductor's CUDA graph trees capture every graph on one stream into one memory pool and
            # assume one replay at a time; concurrent groups replay theirs at once on their own streams
            raise ValueError(
                "train.concurrent_groups > 1 cannot take train.compile=reduce-overhead (its CUDA graphs share one"
                " memory pool and assume one replay at a time): use step-graph or eager-graph"
            )
        if not self.batched and self.autocast != "none":
            raise ValueError("train.autocast is read by the batched path only: set train.batched=true")
        if self.fast_attention != "masks" and not (self.batched and self.batched_mode == "fast"):
            raise ValueError(
                "train.fast_attention is read by the batched fast path only: set train.batched=true, train.batched_mode=fast"
            )
        if self.batched and self.jobs > 1:
            raise ValueError("train.jobs must be 1 with train.batched (one process trains the folded runs)")


@dataclass
class ExperimentConfig:
    """A study: ``mechanisms`` x ``seeds`` x every combination of ``settings``.

    Args:
        name: folder name under out_dir. Default: "experiment".
        out_dir: where run folders go. Default: "runs".
        task: ``{"name": <registered task>, <its config fields>...}``. Default: parity.
        model, optim, train: see ``ModelConfig``, ``OptimConfig``, ``TrainConfig``.
        mechanisms: pattern specs; an entry may be a list of one spec per block. Default: FULL, TOPK:5.
        seeds: each seeds both the data and the model. Default: the paper's first three.
        settings: dotted key -> list of values; their product is swept. Default: none.
    """

    name: str = "experiment"
    out_dir: str = "runs"
    task: dict[str, Any] = field(default_factory=lambda: {"name": "parity"})
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    mechanisms: list[Any] = field(default_factory=lambda: ["FULL", "TOPK:5"])
    seeds: list[int] = field(default_factory=lambda: PAPER_SEEDS[:3])
    settings: dict[str, list[Any]] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _choice(key: str, value: str, valid: tuple[str, ...]) -> None:
    if value not in valid:
        raise ValueError(f"{key} must be one of {', '.join(valid)}, got {value!r}")


def _positive(key: str, value: float) -> None:
    if value <= 0:
        raise ValueError(f"{key} must be > 0, got {value}")


def _coerce(key: str, value: Any, hint: Any) -> Any:
    """Check ``value`` against the type ``hint`` (converting int->float, numeric str->float)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None or (isinstance(value, str) and value.lower() in ("none", "null")):
            if type(None) in args:
                return None
        inner = [a for a in args if a is not type(None)]
        return _coerce(key, value, inner[0])
    if hint is Any:
        return value
    if origin is list:
        if not isinstance(value, (list, tuple)):
            raise ValueError(f"{key} must be a list, got {value!r}")
        return [_coerce(f"{key}[{i}]", v, args[0]) for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ValueError(f"{key} must be a mapping, got {value!r}")
        return {str(k): _coerce(f"{key}.{k}", v, args[1]) for k, v in value.items()}
    return _coerce_scalar(key, value, hint)


def _coerce_scalar(key: str, value: Any, hint: type) -> Any:
    if hint is bool:
        if isinstance(value, bool):
            return value
        raise ValueError(f"{key} must be true or false, got {value!r}")
    if hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ValueError(f"{key} must be an integer, got {value!r}")
    if hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)  # PyYAML reads 1e-3 as a string
            except ValueError:
                pass
        raise ValueError(f"{key} must be a number, got {value!r}")
    if hint is str:
        if isinstance(value, str):
            return value
        raise ValueError(f"{key} must be a string, got {value!r}")
    raise ValueError(f"{key}: unsupported field type {hint}")


def _build(cls: type, data: dict[str, Any], prefix: str) -> Any:
    """Make dataclass ``cls`` from a dict, rejecting unknown keys and wrong types by name."""
    if not isinstance(data, dict):
        raise ValueError(f"{prefix.rstrip('.') or 'config'} must be a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    values = {}
    for key, value in data.items():
        if key not in names:
            raise ValueError(f"unknown config key '{prefix}{key}'; valid keys: {', '.join(names)}")
        hint = hints[key]
        if dataclasses.is_dataclass(hint):
            values[key] = _build(hint, value, f"{prefix}{key}.")
        else:
            values[key] = _coerce(f"{prefix}{key}", value, hint)
    return cls(**values)


def merge(base: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    """Deep-merge ``update`` into a copy of ``base`` (mappings merge, everything else replaces).
    ``task`` replaces wholesale when its name changes."""
    out = copy.deepcopy(base)
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict) and key != "settings" and not _new_task(key, out, value):
            out[key] = merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def _new_task(key: str, base: dict[str, Any], value: dict[str, Any]) -> bool:
    """A task section naming another task replaces the old one instead of merging fields into it."""
    return key == "task" and value.get("name", base[key].get("name")) != base[key].get("name")


def set_dotted(data: dict[str, Any], dotted: str, value: Any) -> None:
    """Set ``data[a][b] = value`` for ``dotted='a.b'``; unknown top-level sections are caught by _build."""
    parts = dotted.split(".")
    node = data
    for part in parts[:-1]:
        if part not in node or not isinstance(node[part], dict):
            raise ValueError(f"unknown config key {dotted!r}: {part!r} is not a section")
        node = node[part]
    node[parts[-1]] = value


def parse_override(text: str) -> tuple[str, Any]:
    """``'model.blocks=4'`` -> ("model.blocks", 4); values are read as YAML (``[FULL,TOPK:5]`` is a list)."""
    if "=" not in text:
        raise ValueError(f"an override must look like key=value, got {text!r}")
    key, raw = text.split("=", 1)
    try:
        return key.strip(), yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as error:
        raise ValueError(f"override {text!r}: the value is not valid YAML ({getattr(error, 'problem', None) or error})") from None


def load_dict(path: "str | Path | None" = None, overrides: list[str] | None = None) -> dict[str, Any]:
    """Defaults <- YAML file <- overrides, as a plain dict (not yet checked)."""
    data = ExperimentConfig().to_dict()
    if path is not None:
        text = Path(path).read_text()
        try:
            loaded = yaml.safe_load(text) or {}
        except yaml.YAMLError as error:
            mark = getattr(error, "problem_mark", None)
            where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
            raise ValueError(f"{path}: not valid YAML{where}: {getattr(error, 'problem', None) or error}") from None
        if not isinstance(loaded, dict):
            raise ValueError(f"{path}: a config file must be a mapping of keys, got {type(loaded).__name__}")
        data = merge(data, loaded)
    for item in overrides or []:
        key, value = parse_override(item)
        set_dotted(data, key, value)
    return data


def from_dict(data: dict[str, Any]) -> ExperimentConfig:
    """Typed config from a dict; raises ValueError naming the bad key."""
    return _build(ExperimentConfig, data, "")


def load_config(path: "str | Path | None" = None, overrides: list[str] | None = None) -> ExperimentConfig:
    """Defaults <- YAML <- overrides, typed and checked (``validate_experiment`` checks sizes too)."""
    config = from_dict(load_dict(path, overrides))
    config.model.validate()
    config.optim.validate()
    config.train.validate()
    return config


def expand_settings(config: ExperimentConfig) -> list[tuple[str, ExperimentConfig]]:
    """Every combination of ``settings`` as (label, config with those values and no settings)."""
    if not config.settings:
        plain = copy.deepcopy(config)
        plain.settings = {}
        return [("default", plain)]
    keys = list(config.settings)
    for key in keys:
        if not isinstance(config.settings[key], list) or not config.settings[key]:
            raise ValueError(f"settings.{key} must be a non-empty list of values")
    out = []
    for values in itertools.product(*(config.settings[key] for key in keys)):
        data = config.to_dict()
        data["settings"] = {}
        for key, value in zip(keys, values):
            try:
                set_dotted(data, key, value)
            except ValueError as error:
                raise ValueError(f"settings: {error}") from None
        label = ",".join(f"{key}={value}" for key, value in zip(keys, values))
        out.append((label, from_dict(data)))
    return out


def to_yaml(config: ExperimentConfig) -> str:
    return yaml.safe_dump(config.to_dict(), sort_keys=False)


def make_task_config(task: dict[str, Any], prefix: str = "task") -> Any:
    """The registered task's typed config from ``{"name": ..., fields...}``; errors name the key."""
    from sparsefocus.tasks.base import task_config_class

    if "name" not in task:
        raise ValueError(f"{prefix}.name is missing: say which task to train on")
    try:
        cls = task_config_class(str(task["name"]))
    except ValueError as error:
        raise ValueError(f"{prefix}.name: {error}") from None
    fields = {k: v for k, v in task.items() if k != "name"}
    config = _build(cls, fields, f"{prefix}.")
    try:
        config.validate()
    except ValueError as error:
        raise ValueError(f"{prefix}: {error}") from None
    return config

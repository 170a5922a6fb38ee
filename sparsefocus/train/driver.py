"""The batched loop: the seeds of one (setting, mechanism) trained as one folded model, each run
still in its own folder with the files ``train_run`` writes; and the time budget shared by both
loops.

A group's runs share the config; each has its own data (``build`` with its seed), initial weights
(``torch.manual_seed(seed)`` before building, as ``train_run``), shuffling generator, dropout
stream and checkpoint. The data stay on the device, every step is free of host syncs (loss and
accuracy sums stay on the device and are read once per epoch) and, in fast mode on CUDA, the
forward and loss are compiled.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import inspect
import json
import math
import multiprocessing
import os
import signal
import threading
import time
import traceback
import warnings
from collections.abc import Callable, Generator, Iterator
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any, cast

import torch
import torch.nn.functional as F
import yaml
from torch import Tensor, nn

from sparsefocus.models.blocks import Block
from sparsefocus.tasks.base import TaskData
from sparsefocus.train.batched import (
    RunAttention,
    RunRandomness,
    clip_per_run_,
    default_generator,
    fast_attention,
    fold_models,
    fold_optimizer_states,
    load_run_states,
    run_optimizer_state,
    run_state,
)
from sparsefocus.train.checkpoint import (
    load_checkpoint,
    save_checkpoint,
    write_text_atomic,
)
from sparsefocus.train.config import ExperimentConfig, TrainConfig, make_task_config
from sparsefocus.train.loop import (
    RunSpec,
    _write_metrics,
    build_data,
    build_model,
    lr_factor,
    make_optimizer,
    matmul_precision,
    record_epochs,
    resolve_device,
)


COMPILE_PHASES = ("_compile.compile_inner", "compile_fx.<locals>.bw_compiler")
"""Dynamo's top-level compile phases: tracing and compiling a frame (the forward graph among
them), and the backward graph, which AOTAutograd compiles lazily at the first backward."""


def compile_phases() -> dict[str, float]:
    """Seconds this process has spent in each phase of ``torch.compile`` so far (Dynamo's own
    accounting, summed over frames; nested phases overlap); empty when it keeps none or its
    private accounting API changed."""
    try:
        names, values = cast(tuple[list[str], list[str]], torch._dynamo.utils.compile_times(repr="csv", aggregate=True))
        return {name: float(value) for name, value in zip(names, values)}
    except Exception:  # noqa: BLE001 - a private API: callers go without it
        return {}


def compile_seconds() -> float:
    """Seconds this process has spent compiling so far: the sum of ``COMPILE_PHASES``."""
    phases = compile_phases()
    return sum(phases.get(name, 0.0) for name in COMPILE_PHASES)


@dataclasses.dataclass
class Budget:
    """A wall-clock allowance checked at epoch boundaries (picklable: an absolute deadline).

    ``seconds``: the allowance; ``deadline``: ``time.time()`` when it ends; ``last_epoch``: the
    latest epoch's length in this process less the time it spent compiling (which the next epoch
    does not repeat), the estimate for the next one; ``epochs``: epochs trained under it;
    ``compiled``: ``compile_seconds()`` at the last record in process ``pid``. The first epoch is
    always allowed, so that every call makes progress.
    """

    seconds: float
    deadline: float = 0.0
    last_epoch: float = 0.0
    epochs: int = 0
    compiled: float = 0.0
    pid: int = 0

    def __post_init__(self) -> None:
        if self.seconds <= 0:
            raise ValueError(f"--budget must be > 0 seconds, got {self.seconds}")
        if not self.deadline:
            self.deadline = time.time() + self.seconds
        if not self.pid:
            self.pid, self.compiled = os.getpid(), compile_seconds()

    def allows(self, estimate: float | None = None) -> bool:
        """Whether an epoch expected to take ``estimate`` (default: the latest one's estimate) still fits."""
        if self.epochs == 0:
            return True
        return time.time() + (self.last_epoch if estimate is None else estimate) <= self.deadline

    def record(self, seconds: float) -> None:
        """An epoch of ``seconds`` ended: the next is estimated as this one less its compiling (a
        first epoch that compiled would overstate the rest)."""
        if self.pid != os.getpid():  # unpickled in a worker: its compile accounting starts at zero
            self.pid, self.compiled = os.getpid(), 0.0
        compiled = compile_seconds()
        self.last_epoch = max(seconds - max(compiled - self.compiled, 0.0), 0.0)
        self.compiled, self.epochs = compiled, self.epochs + 1


TASK_TENSORS = ("train_inputs", "train_targets", "valid_inputs", "valid_targets", "test_inputs", "test_targets")
TASK_SCALARS = ("name", "kind", "vocab_size", "num_classes", "pad_id")


def task_cache_path(config: ExperimentConfig, seed: int) -> Path:
    """Where the task cache keeps ``seed``'s data: keyed by the task config and the source of the
    module that generates it, so an edited generator never serves stale data, and by the seed the
    data are drawn from (with ``task.data_seed`` one file serves every training seed)."""
    task = make_task_config(config.task)
    source_file = inspect.getsourcefile(type(task))
    if source_file is None:
        raise ValueError(f"task cache: the source of {type(task).__name__} is not in a file, so it cannot key the cache")
    source = Path(source_file).read_bytes()
    key = hashlib.sha256(json.dumps(config.task, sort_keys=True, default=str).encode() + source).hexdigest()[:16]
    return Path(config.out_dir) / ".task-cache" / key / f"seed-{task.seed_for_data(seed)}.pt"


def _build_into_cache(config: ExperimentConfig, seed: int) -> None:
    """Build ``seed``'s task on the CPU and save its tensors and sizes atomically."""
    data = build_data(config, seed, torch.device("cpu"))
    record = {name: _compact(getattr(data, name)) for name in TASK_TENSORS} | {n: getattr(data, n) for n in TASK_SCALARS}
    path = task_cache_path(config, seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_checkpoint(path, record)


def _load_cached(path: Path, device: torch.device) -> TaskData:
    record = torch.load(path, map_location=device, weights_only=True)
    for name in TASK_TENSORS:
        if record[name] is not None:
            record[name] = record[name].long()
    return TaskData(**record)


def _compact(ids: Tensor | None) -> Tensor | None:
    """Token ids and targets in the smallest integer type that holds them (the cache is re-read
    every call; ListOps' 7000 x 599 ids are 4 MB as uint8, 34 MB as int64)."""
    if ids is None:
        return None
    if ids.numel() and ids.min() >= 0 and ids.max() < 256:
        return ids.to(torch.uint8)
    return ids.to(torch.int16) if ids.numel() and ids.abs().max() < 2**15 else ids


def build_datas(config: ExperimentConfig, seeds: list[int], device: torch.device) -> list[TaskData]:
    """Every seed's task data on ``device``; with ``train.task_cache`` missing seeds are built in
    parallel processes (one per core at most) into the cache, then all are read from it."""
    if not config.train.task_cache:
        return [build_data(config, seed, device) for seed in seeds]
    paths = [task_cache_path(config, seed) for seed in seeds]  # seeds sharing a data seed share a file
    missing = [seed for path, seed in dict(zip(paths, seeds)).items() if not path.exists()]
    if len(missing) == 1:
        _build_into_cache(config, missing[0])
    elif missing:
        workers = min(len(missing), os.cpu_count() or 1)
        with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
            list(pool.map(_build_into_cache, [config] * len(missing), missing))
    loaded = {path: _load_cached(path, device) for path in dict.fromkeys(paths)}  # each file read once; the data are only read
    return [loaded[path] for path in paths]


def _shape_key(data: TaskData) -> tuple:
    """Runs fold together only when their data have the same shapes and sizes."""
    return (
        data.kind,
        tuple(data.train_inputs.shape),
        tuple(data.valid_inputs.shape),
        data.vocab_size,
        data.num_classes,
        data.pad_id,
    )


def _epoch_seed(seeds: list[int], epoch: int) -> int:
    """Fast mode's dropout seed of an epoch: a hash of the group's seeds and the epoch, so that
    a resumed group draws what the uninterrupted one would have."""
    text = ",".join(map(str, seeds)) + f"/{epoch}"
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") & ((1 << 63) - 1)


BLOCK_RECOMPILE_LIMIT = 64
"""Dynamo's recompile limit, for the rest of the process, once blocks are compiled one by one:
every block of every group shares ``Block.forward``'s cache, with an entry per kind of block
(the first differs), train or eval mode and mechanism, and past the limit Dynamo would quietly
run the block eagerly."""


def compile_blocks(model: nn.Module, mode: str) -> int:
    """Compile each transformer block of ``model`` in place (``train.compile_scope=blocks``);
    returns how many. Blocks alike share one graph: Dynamo passes their parameters as inputs."""
    limit = torch._dynamo.config.recompile_limit
    torch._dynamo.config.recompile_limit = max(limit, BLOCK_RECOMPILE_LIMIT)
    blocks = [module for module in model.modules() if isinstance(module, Block)]
    if not blocks:
        raise ValueError("train.compile_scope=blocks: the model has no transformer blocks to compile")
    for block in blocks:
        block.compile(mode=mode, dynamic=False)
    return len(blocks)


AUTOTUNED = {"default": "max-autotune-no-cudagraphs", "reduce-overhead": "max-autotune"}
"""``train.compile_autotune``: the max-autotune form of each compiling mode."""


def _compile_mode(train: TrainConfig, device: torch.device) -> str | None:
    """The torch.compile mode of the fast step, or None for eager."""
    if train.batched_mode != "fast" or train.compile in ("eager", "eager-graph"):
        return None
    if train.compile == "auto":
        mode: str | None = "default" if device.type == "cuda" else None
    elif train.compile == "step-graph":
        mode = "default"  # the step's own CUDA graph holds the compiled kernels
    else:
        mode = train.compile
    return AUTOTUNED[mode] if train.compile_autotune and mode is not None else mode


STEP_GRAPH_MODES = ("step-graph", "eager-graph")
"""The compile modes that record the whole step as one CUDA graph: with the forward compiled, or
with PyTorch's own kernels (nothing to compile, so a short call trains from its first second)."""


def _check_step_graph(config: ExperimentConfig, device: torch.device) -> bool:
    """Whether the whole training step is one CUDA graph; refuses what it cannot capture."""
    mode = config.train.compile
    if mode not in STEP_GRAPH_MODES:
        return False
    optim = config.optim
    if config.train.batched_mode != "fast" or device.type != "cuda":
        raise ValueError(f"train.compile={mode} needs train.batched_mode=fast on a CUDA device")
    if optim.name != "sgd" or optim.momentum or optim.weight_decay:
        raise ValueError(f"train.compile={mode} supports plain SGD only (optim.name=sgd, no momentum, no weight decay)")
    return True


SETUP_LOG: list[dict[str, Any]] = []
"""The one-off work of this process's fast groups, timed with a synchronisation (once per group
and process, so it costs nothing later): each step graph's warm-up steps (which compile) and its
capture, and each group's first evaluation. A budget call's record carries it, to tell where a
call's first epoch goes."""


def _log_setup(group: str, what: str, began: float, device: torch.device) -> None:
    _wait(device)
    SETUP_LOG.append({"group": group, "what": what, "seconds": round(time.perf_counter() - began, 3)})


class StepGraph:
    """The fast step (rows, forward, backward, per-run clipping, SGD update, running sums) of
    full batches recorded once as a CUDA graph and replayed: one launch instead of hundreds.

    The step reads the batch's row indices from a static [R, B] buffer and the learning rate from a
    0-d device tensor, both refreshed before each replay without a host sync. The first ``warmup``
    steps run uncaptured (they compile the forward and settle the allocator), as torch.cuda.graphs
    asks; they are real steps of the epoch. Plain SGD is ``p -= lr * g``, what
    ``torch.optim.SGD`` computes without momentum or weight decay; the optimiser then has no state.

    The warm-ups, the capture and every replay run on one stream of the graph's own, ordered after
    the caller's stream and before its next work. A captured graph embeds the cuBLAS workspace that
    PyTorch keys by the capture stream, so two graphs captured on one stream (torch.cuda.graph's
    shared default) and replayed at once on two streams (concurrent groups) can overwrite each
    other's partial sums there (on an H100, two 10-run lanes captured so moved their later runs'
    losses by up to 0.06). Replaying where it was captured keeps every use of that workspace in one
    stream's order.
    """

    def __init__(self, trainer: "GroupTrainer", warmup: int = 2) -> None:
        self.trainer, self.warmup = trainer, warmup
        self.params = [p for p in trainer.model.parameters() if p.requires_grad]
        device = trainer.device
        self.index = torch.zeros(trainer.runs, trainer.train_cfg.batch_size, dtype=torch.long, device=device)
        self.neg_lr = torch.zeros((), device=device)
        self.loss_sum = torch.zeros(trainer.runs, dtype=torch.float64, device=device)
        self.correct = torch.zeros(trainer.runs, dtype=torch.long, device=device)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.stream: torch.cuda.Stream | None = None  # made at the first step: the body alone also runs on the CPU
        self.steps = 0

    def _body(self) -> None:
        trainer = self.trainer
        inputs, targets = trainer.rows(trainer.train_inputs, trainer.train_targets, self.index)
        loss, losses, right = trainer.forward(inputs, targets)
        loss.backward()
        if trainer.config.optim.grad_clip > 0:
            trainer.clip(self.params, trainer.config.optim.grad_clip)
        with torch.no_grad():
            live: list[Tensor] = [p for p in self.params if p.grad is not None]
            grads: list[Tensor] = [cast(Tensor, p.grad) for p in live]
            torch._foreach_mul_(grads, self.neg_lr)
            torch._foreach_add_(live, grads)
            self.loss_sum += losses.detach().sum(dim=1, dtype=torch.float64)
            self.correct += right.sum(dim=1)

    def _load(self, index: Tensor, lr: float, fresh_grads: bool) -> None:
        """The step's rows and learning rate into the static buffers (no host sync); with
        ``fresh_grads`` the gradients dropped, for a step that runs (or records) the body."""
        self.index.copy_(index)
        self.neg_lr.fill_(-lr)
        if fresh_grads:
            for p in self.params:
                p.grad = None

    def step(self, index: Tensor, lr: float) -> None:
        """One training step on the rows ``index`` [R, B] at learning rate ``lr``."""
        self._load(index, lr, fresh_grads=self.graph is None)
        if self.graph is not None:
            self._on_own_stream(self.graph.replay)
            return
        began, group = time.perf_counter(), self.trainer.label
        if self.stream is None:
            self.stream = torch.cuda.Stream()
        if self.steps < self.warmup:
            self._on_own_stream(self._body)
            self.steps += 1
            _log_setup(group, f"warm-up step {self.steps}", began, self.trainer.device)
            return
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=self.stream):
            self._body()
        self.graph = graph
        self._on_own_stream(graph.replay)  # capturing records the step without running it
        _log_setup(group, "capture and first replay", began, self.trainer.device)

    def _on_own_stream(self, work: Callable[[], None]) -> None:
        """``work`` on the graph's stream, after what the current stream has queued and before
        what it queues next."""
        stream, current = cast(torch.cuda.Stream, self.stream), torch.cuda.current_stream()
        stream.wait_stream(current)
        with torch.cuda.stream(stream):
            work()
        current.wait_stream(stream)

    def run_uncaptured(self, index: Tensor, lr: float) -> None:
        """One step outside the graph, with the same compiled kernels: for profilers, which do not
        see the kernels of a replay."""
        self._load(index, lr, fresh_grads=True)
        self._body()

    def take_sums(self) -> tuple[Tensor, Tensor]:
        """The per-run (loss sum, correct count) of the steps since the last call; resets them."""
        sums = (self.loss_sum.clone(), self.correct.clone())
        self.loss_sum.zero_()
        self.correct.zero_()
        return sums


def scheduler_step_after_graph(scheduler: torch.optim.lr_scheduler.LRScheduler) -> None:
    """Advance ``scheduler`` after a step whose optimizer update ran inside a CUDA graph.

    The graph updates the parameters without calling ``optimizer.step()``, so the scheduler's
    first step would warn that it ran before the optimizer; the order is right, so that one
    warning is silenced here and nothing else. Only the first step can warn, so the later ones
    (every training step) skip the filter."""
    if getattr(scheduler, "_step_count", 0) > 1:
        scheduler.step()
        return
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler.step\(\)` before", category=UserWarning)
        scheduler.step()


class GroupTrainer:
    """R runs of one config as one folded model on one device; see the module docstring.

    Args:
        specs: the runs (same config and mechanism, different seeds), all at the same epoch.
        datas: their data, on ``device``, all of one shape.
        device: where the model and the data live.
    """

    def __init__(self, specs: list[RunSpec], datas: list[TaskData], device: torch.device, fresh_compiler: bool = True) -> None:
        self.specs, self.device, self.config = specs, device, specs[0].config
        self.label = str(specs[0].mechanism)  # names the group in SETUP_LOG
        self.evaluated = False
        self.train_cfg = self.config.train
        self.exact = self.train_cfg.batched_mode == "exact"
        self.runs = len(specs)
        self.train_inputs = torch.stack([d.train_inputs for d in datas])  # [R, n, L]
        self.train_targets = torch.stack([d.train_targets for d in datas])  # [R, n]
        self.valid_inputs = torch.stack([d.valid_inputs for d in datas])
        self.valid_targets = torch.stack([d.valid_targets for d in datas])
        self.cpu_states, device_states, models = [], [], []
        for spec, data in zip(specs, datas):
            torch.manual_seed(spec.seed)  # as train_run: the seed fixes the initial weights
            models.append(build_model(self.config.model, spec.mechanism, data))
            self.cpu_states.append(torch.get_rng_state())
            device_states.append(default_generator(device).get_state())
        self.rng = RunRandomness(device, device_states) if self.exact else None
        mode = "exact" if self.exact else "fast"
        self.model = fold_models(models, mode=mode, rng=self.rng, topk_select=self.train_cfg.topk_select).to(device)
        self.optimizer = make_optimizer(self.config.optim, self.model)
        self.steps_per_epoch = math.ceil(self.train_inputs.shape[1] / self.train_cfg.batch_size)
        epochs = self.train_cfg.epochs
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda step: lr_factor(self.config.optim, step, self.steps_per_epoch, epochs)
        )
        self.generators = [torch.Generator().manual_seed(spec.seed) for spec in specs]
        self.forward = self._make_forward(fresh_compiler)
        self.clip: Callable[..., Tensor] = functools.partial(clip_per_run_, exact=self.exact)
        if _compile_mode(self.train_cfg, device) is not None:
            # ~2 kernels instead of ~3 per parameter; static shapes, as trainers alive at once differ in them
            self.clip = torch.compile(self.clip, dynamic=False)
        self.step_graph = StepGraph(self) if _check_step_graph(self.config, device) else None

    def _make_forward(self, fresh_compiler: bool) -> Callable[[Tensor, Tensor], tuple[Tensor, Tensor, Tensor]]:
        """(inputs [R*B, L], targets [R*B]) -> (sum over runs of each run's mean loss, per-example
        loss [R, B], per-example correct [R, B]); compiled in fast mode on CUDA. ``fresh_compiler``
        resets dynamo first (trainers that live at the same time keep each other's compiled code)."""
        runs = self.runs
        autocast = self.train_cfg.autocast == "bf16"
        # mechanisms with auxiliary losses (DSA's indexer): each run's objective adds its own, as train_run's
        aux_layers = [m for m in self.model.modules() if isinstance(m, RunAttention) and m.pattern.has_aux_loss]

        def forward_loss(inputs: Tensor, targets: Tensor) -> tuple[Tensor, Tensor, Tensor]:
            with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=autocast):
                logits = self.model(inputs)  # [R*B, C]
            losses = F.cross_entropy(logits.float(), targets, reduction="none").view(runs, -1)  # [R, B]
            correct = (logits.argmax(-1) == targets).view(runs, -1)
            objective = losses.mean(dim=1).sum()
            for layer in aux_layers:
                objective = objective + layer.aux_loss
            return objective, losses, correct

        mode = _compile_mode(self.train_cfg, self.device)
        if mode is None:
            return forward_loss
        if fresh_compiler:
            torch._dynamo.reset()  # each group's closure would otherwise count towards dynamo's recompile limit
        if self.train_cfg.compile_scope == "blocks":
            compile_blocks(self.model, mode)
            return forward_loss
        return torch.compile(forward_loss, mode=mode, dynamic=False)

    def rows(self, inputs: Tensor, targets: Tensor, index: Tensor) -> tuple[Tensor, Tensor]:
        """Each run's rows ``index`` [R, B] of [R, n, ...] data, folded: ([R*B, L], [R*B])."""
        run = torch.arange(self.runs, device=index.device)[:, None]
        return inputs[run, index].flatten(0, 1), targets[run, index].flatten(0, 1)

    def epoch_steps(self) -> Generator[None, None, tuple[Tensor, Tensor]]:
        """One shuffled pass per run (each run's order from its own generator, as ``train_epoch``),
        yielding after every step so that several parts can take turns. Returns the running
        per-run (mean loss, accuracy) on the device."""
        self.model.train()
        n, batch = self.train_inputs.shape[1], self.train_cfg.batch_size
        if self.train_cfg.shuffle:
            orders = torch.stack([torch.randperm(n, generator=g) for g in self.generators]).to(self.device)  # [R, n]
        else:
            orders = torch.arange(n, device=self.device).expand(self.runs, -1)
        loss_sum = torch.zeros(self.runs, dtype=torch.float64, device=self.device)
        correct = torch.zeros(self.runs, dtype=torch.long, device=self.device)
        params = [p for p in self.model.parameters()]
        for start in range(0, n, batch):
            index = orders[:, start : start + batch]  # [R, B]
            if self.step_graph is not None and index.shape[1] == batch:
                self.step_graph.step(index, self.optimizer.param_groups[0]["lr"])
                scheduler_step_after_graph(self.scheduler)
                yield
                continue
            inputs, targets = self.rows(self.train_inputs, self.train_targets, index)
            loss, losses, right = self.forward(inputs, targets)
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            if self.config.optim.grad_clip > 0:
                self.clip(params, self.config.optim.grad_clip)
            self.optimizer.step()
            self.scheduler.step()
            loss_sum += losses.detach().sum(dim=1, dtype=torch.float64)
            correct += right.sum(dim=1)
            yield
        if self.step_graph is not None:
            graphed_loss, graphed_correct = self.step_graph.take_sums()
            loss_sum, correct = loss_sum + graphed_loss, correct + graphed_correct
        return loss_sum / n, correct.double() / n

    def train_epoch(self) -> tuple[Tensor, Tensor]:
        """``epoch_steps`` run to the end."""
        return _drain(self.epoch_steps())

    @torch.no_grad()
    def evaluate(self, inputs: Tensor, targets: Tensor) -> tuple[Tensor, Tensor]:
        """Per-run (mean loss, accuracy) [R] over a whole split in eval mode, in the single loop's
        chunks of ``eval_batch_size`` examples per run."""
        self.model.eval()
        n, chunk = inputs.shape[1], self.train_cfg.eval_batch_size
        loss_sum = torch.zeros(self.runs, dtype=torch.float64, device=self.device)
        correct = torch.zeros(self.runs, dtype=torch.long, device=self.device)
        for start in range(0, n, chunk):
            index = torch.arange(start, min(start + chunk, n), device=self.device).expand(self.runs, -1)
            _, losses, right = self.forward(*self.rows(inputs, targets, index))
            loss_sum += losses.sum(dim=1, dtype=torch.float64)
            correct += right.sum(dim=1)
        return loss_sum / n, correct.double() / n

    def metrics_table(self, running: tuple[Tensor, Tensor]) -> Tensor:
        """[4, R] (train loss, train accuracy, held-out loss, held-out accuracy) on the device."""
        began = time.perf_counter()
        if self.train_cfg.train_loss == "full_eval":
            train = self.evaluate(self.train_inputs, self.train_targets)
        else:
            train = running
        valid = self.evaluate(self.valid_inputs, self.valid_targets)
        if not self.evaluated:
            _log_setup(self.label, "first evaluation", began, self.device)
        self.evaluated = True
        return torch.stack([*train, *valid])

    def metric_lines(self, epoch: int, table: Tensor, lr: float, seconds: float) -> list[dict]:
        """One metrics line per run from ``metrics_table``'s table (one host read for the group)."""
        rows = table.cpu().tolist()  # [4, R]
        return [
            {
                "epoch": epoch,
                "train_loss": rows[0][r],
                "train_acc": rows[1][r],
                "valid_loss": rows[2][r],
                "valid_acc": rows[3][r],
                "lr": lr,
                "seconds": round(seconds, 4),
            }
            for r in range(self.runs)
        ]

    def reseed(self, epoch: int) -> None:
        """Fast mode: the epoch's dropout stream from the group's seeds and the epoch."""
        if not self.exact:
            default_generator(self.device).manual_seed(_epoch_seed([s.seed for s in self.specs], epoch))

    def state(self, run: int, epoch: int, finished: bool, metrics: list[dict]) -> dict[str, Any]:
        """Run ``run``'s checkpoint, in ``train_run``'s format (either loop can resume it)."""
        on_cpu = self.device.type == "cpu"
        state = {
            "epoch": epoch,
            "finished": finished,
            "model": run_state(self.model, run),
            "optimizer": run_optimizer_state(self.optimizer.state_dict(), run),
            "scheduler": self.scheduler.state_dict(),
            "torch_rng": self.rng.states[run] if (self.rng is not None and on_cpu) else self.cpu_states[run],
            "generator": self.generators[run].get_state(),
            "metrics": metrics,
        }
        if self.rng is not None and not on_cpu:  # exact mode
            state["device_rng"] = self.rng.states[run]
        return state

    def restore(self, states: list[dict[str, Any]]) -> None:
        """Load R checkpoints of the same epoch into the folded model and its bookkeeping."""
        load_run_states(self.model, [s["model"] for s in states])
        self.optimizer.load_state_dict(fold_optimizer_states([s["optimizer"] for s in states]))
        self.scheduler.load_state_dict(states[0]["scheduler"])
        for r, state in enumerate(states):
            self.generators[r].set_state(state["generator"])
            self.cpu_states[r] = state["torch_rng"]
            if self.rng is not None:  # exact mode
                on_cpu = self.device.type == "cpu"
                self.rng.states[r] = state["torch_rng"] if on_cpu else state.get("device_rng", self.rng.states[r])


def _start_or_resume(trainer: GroupTrainer) -> tuple[int, list[list[dict]]]:
    """Restore the group from its runs' checkpoints, or start every folder (checkpoint, then
    config.yaml, as ``train_run``)."""
    specs = trainer.specs
    started = [(s.run_dir / "config.yaml").exists() for s in specs]
    if any(started):
        if not all(started):
            raise ValueError("a batched group mixes started and new runs; group runs by their epoch first")
        states = [load_checkpoint(s.run_dir / "checkpoint.pt") for s in specs]
        epochs = {int(s["epoch"]) for s in states}
        if len(epochs) > 1:
            raise ValueError(f"a batched group's runs are at different epochs {sorted(epochs)}")
        trainer.restore(states)
        metrics = [list(s["metrics"]) for s in states]
        for spec, lines in zip(specs, metrics):
            _write_metrics(spec.run_dir, lines)  # drop epochs logged after the last checkpoint
            record_epochs(spec)
        return epochs.pop(), metrics
    for r, spec in enumerate(specs):
        spec.run_dir.mkdir(parents=True, exist_ok=True)
        save_checkpoint(spec.run_dir / "checkpoint.pt", trainer.state(r, 0, False, []))
        write_text_atomic(spec.run_dir / "config.yaml", yaml.safe_dump(spec.record(), sort_keys=False))
    return 0, [[] for _ in specs]


HELD_SIGNALS = frozenset({signal.SIGALRM, signal.SIGINT, signal.SIGTERM})


@contextlib.contextmanager
def signals_held() -> Iterator[None]:
    """Hold ``HELD_SIGNALS`` (a time limit's alarm, Ctrl-C, a kill) until the block ends, when a
    pending one is delivered. A no-op off the main thread, whose signals Python never handles."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, HELD_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def _save_all(trainer: GroupTrainer, epoch: int, finished: bool, metrics: list[list[dict]]) -> None:
    """Checkpoint every run of the part at ``epoch``, all or none: an interruption between two
    runs' files would leave the part's runs at different epochs, which resume as separate parts
    (each compiled anew)."""
    with signals_held():
        for r, spec in enumerate(trainer.specs):
            save_checkpoint(spec.run_dir / "checkpoint.pt", trainer.state(r, epoch, finished, metrics[r]))


def _wait(device: torch.device) -> None:
    """Wait for the device's queued work (once per epoch, where the metrics are read anyway)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _drain(steps: Generator[None, None, Any]) -> Any:
    """Run a step generator to its end; its return value."""
    while True:
        try:
            next(steps)
        except StopIteration as stop:
            return stop.value


class PartRun:
    """The runs of one folded part (``GroupTrainer``) advancing one epoch at a time, with their
    folders: started or resumed on construction, metrics written after every epoch, checkpoints
    every ``train.checkpoint_every`` epochs and at the last, and on ``stop``."""

    def __init__(self, specs: list[RunSpec], datas: list[TaskData], device: torch.device, fresh_compiler: bool = True) -> None:
        self.specs = specs
        self.trainer = GroupTrainer(specs, datas, device, fresh_compiler)
        self.epoch, self.metrics = _start_or_resume(self.trainer)
        self.saved = self.epoch
        self.total, self.every = self.trainer.train_cfg.epochs, self.trainer.train_cfg.checkpoint_every
        self.lr = 0.0

    @property
    def finished(self) -> bool:
        return self.epoch >= self.total

    def steps(self) -> Generator[None, None, tuple[Tensor, Tensor]]:
        """The next epoch's training steps (see ``GroupTrainer.epoch_steps``)."""
        self.trainer.reseed(self.epoch + 1)
        self.lr = self.trainer.optimizer.param_groups[0]["lr"]
        return (yield from self.trainer.epoch_steps())

    def end_epoch(self, table: Tensor, seconds: float) -> None:
        """Log the epoch whose ``metrics_table`` is ``table`` (``seconds``: its training time)."""
        self.epoch += 1
        lines = self.trainer.metric_lines(self.epoch, table, self.lr, seconds)
        for r, spec in enumerate(self.specs):
            self.metrics[r].append(lines[r])
            _write_metrics(spec.run_dir, self.metrics[r])
        if self.finished or self.epoch % self.every == 0:
            _save_all(self.trainer, self.epoch, self.finished, self.metrics)
            self.saved = self.epoch

    def stop(self) -> None:
        """Checkpoint every run at the epoch reached (a budget stop)."""
        if self.saved != self.epoch:
            _save_all(self.trainer, self.epoch, False, self.metrics)
            self.saved = self.epoch


def train_part(
    specs: list[RunSpec],
    datas: list[TaskData],
    device: torch.device,
    budget: Budget | None = None,
    on_epoch: Callable[[int], None] | None = None,
) -> bool:
    """Train runs of one data shape as one folded model until ``train.epochs`` or the budget.
    Returns True when they finished. A stop saves every run at the epoch reached."""
    part = PartRun(specs, datas, device)
    while not part.finished:
        if budget is not None and not budget.allows():
            part.stop()
            return False
        began = time.perf_counter()
        running = _drain(part.steps())
        _wait(device)  # the steps run asynchronously: time them, not their queueing
        seconds = time.perf_counter() - began
        part.end_epoch(part.trainer.metrics_table(running), seconds)
        if budget is not None:
            budget.record(time.perf_counter() - began)
        if on_epoch is not None:
            on_epoch(len(specs))
    return True


LANE_STREAMS = True
"""Concurrent groups on CUDA: each lane on a stream of its own (its kernels overlap the others').
False: every lane on the current stream, in turn (no overlap; to tell whether the streams change
what a group computes, which they must not)."""


class _Lane:
    """One part of ``train_parts_together`` with its own CUDA stream and its own state of the
    default generator, swapped in around everything the part does: its dropout draws are then
    those it would make alone, however the parts interleave."""

    def __init__(self, make: Callable[[], PartRun], device: torch.device, on_epoch: Callable[[int], None] | None) -> None:
        self.device, self.on_epoch = device, on_epoch
        self.steps_taken, self.started = 0, 0.0  # in this process, and when the first of them began
        generator = default_generator(device)
        cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if cuda and LANE_STREAMS else None
        if self.stream is not None:
            self.stream.wait_stream(torch.cuda.current_stream(device))  # the data were loaded there
        # CUDA: a state object of its own (a graph replay advances the state it was captured with);
        # CPU: the state's bytes, swapped in and out
        self.cuda_rng = generator.clone_state() if cuda else None
        self.cpu_rng = None if cuda else generator.get_state()
        with self.turn():
            self.part = make()

    @contextlib.contextmanager
    def turn(self) -> Iterator[None]:
        """This lane's stream and generator state for the ``with`` body."""
        generator = default_generator(self.device)
        if self.cuda_rng is not None:
            previous = generator.graphsafe_get_state()
            generator.graphsafe_set_state(self.cuda_rng)
            try:
                with torch.cuda.stream(self.stream):
                    yield
            finally:
                generator.graphsafe_set_state(previous)
            return
        saved = generator.get_state()
        generator.set_state(cast(Tensor, self.cpu_rng))
        try:
            yield
        finally:
            self.cpu_rng = generator.get_state()
            generator.set_state(saved)

    def close(self) -> None:
        """Wait for the lane's work before its tensors are freed."""
        if self.stream is not None:
            self.stream.synchronize()


FIRST_STEPS_TIMED = 3
"""Concurrent groups: each lane's first steps are waited for one by one and logged in
``SETUP_LOG`` (a few synchronisations per process), so that a call whose first epoch does not end
still shows what one step of each group costs."""
PROGRESS_STEPS = (16, 64, 128)
"""Concurrent groups: at these counts of a lane's steps in the process, the seconds since its first
step began are logged in ``SETUP_LOG`` too (one synchronisation each), so that a call stopped
before any epoch ends shows whether the steps went on slowly or stopped."""


def _log_concurrent_step(lane: _Lane, began: float) -> None:
    """Log the lane's step that began at ``began`` if it is one of the first or a progress mark."""
    lane.steps_taken += 1
    if lane.steps_taken == 1:
        lane.started = began
    if lane.steps_taken <= FIRST_STEPS_TIMED:
        _log_setup(lane.part.trainer.label, f"concurrent step {lane.steps_taken}", began, lane.device)
    elif lane.steps_taken in PROGRESS_STEPS:
        what = f"concurrent steps 1-{lane.steps_taken}, since the first began"
        _log_setup(lane.part.trainer.label, what, lane.started, lane.device)


def _epoch_in_turns(lanes: list[_Lane]) -> dict[int, Exception]:
    """One epoch of every lane, a training step of each in turn, then every lane's evaluation
    queued before any is read. A lane whose step raises (its model fails to compile or capture,
    say) drops out of the epoch and the others go on. Returns {lane index: error}."""
    began = time.perf_counter()
    failed: dict[int, Exception] = {}
    epochs: list[Any] = [None] * len(lanes)  # generators: each runs inside its lane's turn
    running: list[Any] = [None] * len(lanes)
    pending = list(range(len(lanes)))
    while pending:
        for index in list(pending):
            with lanes[index].turn():
                try:
                    if epochs[index] is None:
                        epochs[index] = lanes[index].part.steps()
                    step_began = time.perf_counter()
                    next(epochs[index])
                    _log_concurrent_step(lanes[index], step_began)
                except StopIteration as stop:
                    running[index] = stop.value
                    pending.remove(index)
                except Exception as error:
                    failed[index] = error
                    pending.remove(index)
    _wait(lanes[0].device)
    seconds = time.perf_counter() - began
    done = [index for index in range(len(lanes)) if index not in failed]
    tables = {}
    for index in done:
        with lanes[index].turn():
            tables[index] = lanes[index].part.trainer.metrics_table(running[index])
    for index in done:
        lane = lanes[index]
        with lane.turn():
            lane.part.end_epoch(tables[index], seconds)
        if lane.on_epoch is not None:
            lane.on_epoch(len(lane.part.specs))
    return failed


class PartsFailed(RuntimeError):
    """Some folded parts of ``train_parts_together`` raised; the others trained on to the end or
    to the budget. The message names each failed part's runs and error."""


def train_parts_together(
    parts: list[tuple[Callable[[], PartRun], Callable[[int], None] | None]],
    width: int,
    device: torch.device,
    budget: Budget | None = None,
) -> bool:
    """Train folded parts ``width`` at a time in one process, in lock step: every step of every
    active part is queued in turn on the part's own CUDA stream, so the small kernels of several
    models overlap on the GPU. ``parts``: (make the part, its epoch callback), in order; a part
    starts when a lane frees. Each part's results are those it gets trained alone (its own
    generator state, see ``_Lane``). Returns True when all finished; a budget stop saves every
    active part at the epoch reached. A part that raises drops out and the others go on; then
    ``PartsFailed`` names every failed part once the rest are done."""
    torch._dynamo.reset()  # the parts keep their compiled code, so they may not reset it themselves
    with _recompile_limit(8 * len(parts)):  # every part's closures count towards it (none is reset)
        return _run_lanes(list(parts), width, device, budget)


def _run_lanes(
    queue: list[tuple[Callable[[], PartRun], Callable[[int], None] | None]],
    width: int,
    device: torch.device,
    budget: Budget | None,
) -> bool:
    """Raises:
    PartsFailed: a part raised while it was made or trained (the others went on; a failed
    part keeps its last checkpoint)."""
    lanes: list[_Lane] = []
    errors: list[str] = []
    finished = True
    try:
        while queue or lanes:
            if budget is not None and not budget.allows():
                for lane in lanes:
                    with lane.turn():
                        lane.part.stop()
                finished = False
                break
            while queue and len(lanes) < width:
                opened = _open_lane(*queue.pop(0), device, errors)
                if opened is not None and opened.part.finished:
                    opened.close()
                elif opened is not None:
                    lanes.append(opened)
            if not lanes:
                continue
            began = time.perf_counter()
            failed = _epoch_in_turns(lanes)
            if budget is not None:
                budget.record(time.perf_counter() - began)
            for index, error in failed.items():
                errors.append(_failure(lanes[index].part.specs, error))
                _close_failed(lanes[index])
            lanes = [lane for index, lane in enumerate(lanes) if index not in failed]
            for lane in [lane for lane in lanes if lane.part.finished]:
                lane.close()
                lanes.remove(lane)
    finally:
        for lane in lanes:
            lane.close()
    if errors:
        raise PartsFailed("; ".join(errors))
    return finished


def _open_lane(
    make: Callable[[], PartRun], on_epoch: Callable[[int], None] | None, device: torch.device, errors: list[str]
) -> _Lane | None:
    """A lane for the part ``make`` builds, or None with its error appended to ``errors``."""
    try:
        return _Lane(make, device, on_epoch)
    except Exception as error:
        specs = make.args[0] if isinstance(make, functools.partial) else []
        errors.append(_failure(specs, error))
        return None


def _failure(specs: list[RunSpec], error: Exception) -> str:
    """'<mechanism> (<n> runs): <error type>: <first line>' for a failed part."""
    name = specs[0].label if specs else "a part"
    traceback.print_exception(error)
    first = str(error).strip().splitlines()[0] if str(error).strip() else ""
    return f"{name} ({len(specs)} runs): {type(error).__name__}: {first}"


def _close_failed(lane: _Lane) -> None:
    """Close a failed lane; an error waiting for its stream is the failure already recorded."""
    with contextlib.suppress(Exception):
        lane.close()


def _recompile_limit(limit: int) -> Any:
    """A context raising dynamo's per-function recompile limit to ``limit`` (named
    ``cache_size_limit`` before torch 2.6)."""
    config = torch._dynamo.config
    key = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    return config.patch(**{key: max(limit, getattr(config, key))})


def _folded_parts(specs: list[RunSpec], datas: list[TaskData]) -> list[list[int]]:
    """Indices of the runs folded together: data of one shape, at most ``train.batched_max_runs``."""
    by_shape: dict[tuple, list[int]] = {}
    for index, data in enumerate(datas):
        by_shape.setdefault(_shape_key(data), []).append(index)
    size = specs[0].config.train.batched_max_runs or len(specs)
    return [members[at : at + size] for members in by_shape.values() for at in range(0, len(members), size)]


def train_group(specs: list[RunSpec], budget: Budget | None = None, on_epoch: Callable[[int], None] | None = None) -> bool:
    """Train the runs of one (setting, mechanism), all at the same epoch, folded into models of at
    most ``train.batched_max_runs`` runs with data of one shape. Returns True when all finished."""
    config: ExperimentConfig = specs[0].config
    device = resolve_device(config.train.device)
    with matmul_precision(config.train.matmul_precision), fast_attention(config.train.fast_attention):
        datas = build_datas(config, [spec.seed for spec in specs], device)
        for chosen in _folded_parts(specs, datas):
            if budget is not None and not budget.allows():
                return False
            done = train_part([specs[i] for i in chosen], [datas[i] for i in chosen], device, budget, on_epoch)
            if not done:
                return False
    return True


def train_groups_together(
    groups: list[list[RunSpec]],
    width: int,
    budget: Budget | None = None,
    on_epochs: list[Callable[[int], None]] | None = None,
) -> bool:
    """``train_group`` for several groups at once: their folded parts go through
    ``train_parts_together`` ``width`` at a time. The groups must share the device and the matmul
    precision (one process, one setting of it). ``on_epochs``: one epoch callback per group."""
    configs = [group[0].config for group in groups]
    devices = {config.train.device for config in configs}
    precisions = {config.train.matmul_precision for config in configs}
    attentions = {config.train.fast_attention for config in configs}
    if len(devices) > 1 or len(precisions) > 1 or len(attentions) > 1:
        raise ValueError(
            "train.concurrent_groups > 1 needs one train.device, train.matmul_precision and train.fast_attention across settings"
        )
    device = resolve_device(configs[0].train.device)
    parts: list[tuple[Callable[[], PartRun], Callable[[int], None] | None]] = []
    with matmul_precision(configs[0].train.matmul_precision), fast_attention(configs[0].train.fast_attention):
        for index, specs in enumerate(groups):
            datas = build_datas(specs[0].config, [spec.seed for spec in specs], device)
            callback = on_epochs[index] if on_epochs is not None else None
            for chosen in _folded_parts(specs, datas):
                make = functools.partial(PartRun, [specs[i] for i in chosen], [datas[i] for i in chosen], device, False)
                parts.append((make, callback))
        return train_parts_together(parts, width, device, budget)


def check_batched(settings: list[tuple[str, ExperimentConfig]]) -> None:
    """Fail before training when a setting cannot be batched (next-token tasks use the Decoder)."""
    from sparsefocus.train.config import make_task_config

    for label, setting in settings:
        if type(make_task_config(setting.task)).kind != "classify":
            where = "" if label == "default" else f"setting {label}: "
            raise ValueError(f"{where}train.batched supports classification tasks only, task {setting.task['name']!r} is not one")


def group_specs(specs: list[RunSpec], epochs_done: list[int]) -> list[list[RunSpec]]:
    """Runs of one (setting, mechanism) at the same epoch, in plan order."""
    groups: dict[tuple, list[RunSpec]] = {}
    for spec, done in zip(specs, epochs_done):
        groups.setdefault((spec.setting, spec.label, done), []).append(spec)
    return list(groups.values())

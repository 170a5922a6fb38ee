"""The task interface shared by generators, corpora, models and the training loop."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from torch import Tensor

TASKS: dict[str, type["TaskConfig"]] = {}


@dataclass
class TaskData:
    """A built task: integer token sequences and targets, split into train / held-out (/ test).

    inputs: [N, L] long token ids. targets: [N] long class ids for ``kind="classify"``, or
    [N, L] long next-token ids with -100 for positions that are not scored for ``kind="next_token"``.
    """

    name: str
    kind: Literal["classify", "next_token"]
    train_inputs: Tensor
    train_targets: Tensor
    valid_inputs: Tensor
    valid_targets: Tensor
    vocab_size: int
    num_classes: int
    pad_id: int | None = None
    test_inputs: Tensor | None = None
    test_targets: Tensor | None = None
    info: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def seq_len(self) -> int:
        return int(self.train_inputs.shape[1])


@dataclass
class TaskConfig:
    """Base of every task config: a frozen set of typed fields plus ``build(seed)``.

    Args:
        data_seed: None (the default) draws the data from the training seed, so every seed trains
            on its own data; an integer draws it from this seed for every training seed (the
            Semantic Focus ListOps runs: one dataset for all 10 seeds). Text tasks ignore both
            (their data depend on ``split_seed`` only).
    """

    name: ClassVar[str] = ""
    kind: ClassVar[str] = "classify"

    data_seed: int | None = None

    def validate(self) -> None:
        """Raise ValueError naming the bad field."""

    def seed_for_data(self, seed: int) -> int:
        """The seed the data are drawn from when training with ``seed``: ``data_seed`` if set."""
        return seed if self.data_seed is None else self.data_seed

    def build(self, seed: int) -> TaskData:
        """Generate (or load) the data deterministically from ``seed`` (or ``data_seed``)."""
        raise NotImplementedError(f"{type(self).__name__} must define build")


def register_task(cls: type[TaskConfig]) -> type[TaskConfig]:
    """Class decorator adding a task config class to ``TASKS`` under ``cls.name``."""
    if cls.name in TASKS:
        raise ValueError(f"task {cls.name!r} registered twice")
    TASKS[cls.name] = cls
    return cls


def task_config_class(name: str) -> type[TaskConfig]:
    """The config class of task ``name``; ValueError listing the valid names otherwise."""
    _load_all()
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; valid tasks: {', '.join(sorted(TASKS))}")
    return TASKS[name]


def build_task(name: str, seed: int, **fields: Any) -> TaskData:
    """Build task ``name`` with the given config fields and seed."""
    config = task_config_class(name)(**fields)
    config.validate()
    return config.build(seed)


def _load_all() -> None:
    """Import every task module so that their registrations run."""
    import importlib
    import pkgutil

    import sparsefocus.tasks as package

    for module in pkgutil.iter_modules(package.__path__):
        if module.name != "base":
            importlib.import_module(f"sparsefocus.tasks.{module.name}")

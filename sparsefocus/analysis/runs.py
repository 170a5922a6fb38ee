"""Read run folders written by the trainer: find them, rebuild each model and its task data.

A run folder holds ``config.yaml`` (``mechanism``, ``label``, ``seed``, ``setting``, ``config``)
and ``checkpoint.pt`` (the model's state under ``"model"``); an experiment folder holds many.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import yaml
from torch import nn

from sparsefocus.models import mechanism_label
from sparsefocus.tasks.base import TaskData
from sparsefocus.train.checkpoint import checkpoint_weights, load_checkpoint
from sparsefocus.train.config import from_dict, make_task_config
from sparsefocus.train.loop import build_model


@dataclass
class LoadedRun:
    """A trained model in eval mode on the device ``load_run`` was given, with the data it was
    trained on (on the CPU)."""

    run_dir: Path
    label: str
    seed: int
    setting: str
    mechanism: Any
    model: nn.Module
    data: TaskData
    record: dict[str, Any]


def find_runs(path: str | Path) -> list[Path]:
    """The run folders at or below ``path`` (folders with ``config.yaml`` and ``checkpoint.pt``), sorted.

    Raises:
        ValueError: ``path`` does not exist or holds no run folder.
    """
    path = Path(path)
    if not path.exists():
        raise ValueError(f"run folder {path} does not exist")
    found = sorted(p.parent for p in path.rglob("config.yaml") if (p.parent / "checkpoint.pt").exists())
    if not found:
        raise ValueError(f"{path} holds no run folder (a folder with config.yaml and checkpoint.pt); train one first")
    return found


def read_record(run_dir: Path) -> dict[str, Any]:
    """The run's ``config.yaml`` as a dict; ValueError if it is not a run record."""
    record = yaml.safe_load((run_dir / "config.yaml").read_text()) or {}
    missing = [key for key in ("mechanism", "seed", "config") if key not in record]
    if missing:
        raise ValueError(f"{run_dir / 'config.yaml'} is not a run record: missing {', '.join(missing)}")
    return record


def load_run(run_dir: str | Path, device: str | torch.device = "cpu") -> LoadedRun:
    """Rebuild the model of one run folder from its checkpoint, and its task data for its seed.

    The model runs on ``device`` (default the CPU) with the implementation it was trained with,
    except that on the CPU Triton and FlexAttention fall back to ``impl="auto"``, whether or not
    the machine has CUDA.
    """
    run_dir = Path(run_dir)
    device = torch.device(device)
    record = read_record(run_dir)
    config = from_dict(record["config"])
    if device.type == "cpu" and config.model.impl in ("triton", "flex"):
        # the model and its inputs stay on the CPU: with CUDA present Triton would compile its GPU
        # kernels for CPU tensors, and without it the interpreter and eager Flex are far slower
        config.model.impl = "auto"
    seed = int(record["seed"])
    data = make_task_config(config.task).build(seed)
    model = build_model(config.model, record["mechanism"], data)
    path = run_dir / "checkpoint.pt"
    model.load_state_dict(checkpoint_weights(load_checkpoint(path), path))
    model.to(device).eval()
    label = str(record.get("label") or mechanism_label(record["mechanism"]))
    return LoadedRun(run_dir, label, seed, str(record.get("setting", "default")), record["mechanism"], model, data, record)


def group_runs(run_dirs: list[Path]) -> dict[tuple[str, str], list[Path]]:
    """Run folders grouped by (setting, mechanism label), each group sorted by seed."""
    groups: dict[tuple[str, str], list[tuple[int, Path]]] = {}
    for run_dir in run_dirs:
        record = read_record(run_dir)
        label = str(record.get("label") or mechanism_label(record["mechanism"]))
        key = (str(record.get("setting", "default")), label)
        groups.setdefault(key, []).append((int(record["seed"]), run_dir))
    return {key: [path for _, path in sorted(items)] for key, items in groups.items()}

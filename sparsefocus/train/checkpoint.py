"""Atomic files and checkpoints: written under a temporary name, then ``os.replace``d, so a run
killed at any moment leaves either the old file or the new one, never half of one."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch


class CheckpointError(RuntimeError):
    """A run folder whose checkpoint is missing or unreadable; never silently restarted over."""


def _temporary(path: Path) -> Path:
    return path.with_name(f".{path.name}.tmp{os.getpid()}")


def write_text_atomic(path: "str | Path", text: str) -> None:
    """Write ``text`` to ``path`` atomically (temp file in the same folder, then os.replace)."""
    path = Path(path)
    tmp = _temporary(path)
    tmp.write_text(text)
    os.replace(tmp, path)


def save_checkpoint(path: "str | Path", state: dict[str, Any]) -> None:
    """``torch.save`` ``state`` to ``path`` atomically."""
    path = Path(path)
    tmp = _temporary(path)
    torch.save(state, tmp)
    os.replace(tmp, path)


def load_checkpoint(path: "str | Path") -> dict[str, Any]:
    """Load a checkpoint written by ``save_checkpoint``.

    Raises:
        CheckpointError: the file is missing or cannot be read, with the path and what to do.
    """
    path = Path(path)
    if not path.exists():
        raise CheckpointError(
            f"missing checkpoint {path}: the run folder was started but has no checkpoint; "
            f"delete {path.parent} to train this run from scratch"
        )
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # noqa: BLE001  (any unpickling failure means the same thing here)
        raise CheckpointError(
            f"corrupt checkpoint {path} ({type(error).__name__}: {error}); delete {path.parent} to train this run from scratch"
        ) from None
    if not isinstance(state, dict) or "epoch" not in state or "model" not in state:
        raise CheckpointError(
            f"corrupt checkpoint {path}: not a sparsefocus training checkpoint; delete {path.parent} to retrain"
        )
    return state

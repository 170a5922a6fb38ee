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
    slim = isinstance(state, dict) and state.get("slim") is True and state.get("finished") is True
    if not isinstance(state, dict) or "epoch" not in state or ("model" not in state and not slim):
        raise CheckpointError(
            f"corrupt checkpoint {path}: not a sparsefocus training checkpoint; delete {path.parent} to retrain"
        )
    return state


def slim_checkpoint(path: "str | Path") -> bool:
    """Rewrite a finished run's checkpoint with its epoch and metrics only (no weights, optimiser
    or generator states: a finished run never resumes), atomically: about 16 KB for 200 epochs of
    metrics instead of the model's size, so a study's finished runs can be kept and carried
    cheaply. Returns whether the file was rewritten (False: the run is unfinished or already slim)."""
    state = load_checkpoint(path)
    if not state.get("finished") or state.get("slim"):
        return False
    save_checkpoint(path, {"epoch": state["epoch"], "finished": True, "metrics": state["metrics"], "slim": True})
    return True


def checkpoint_weights(state: dict[str, Any], path: "str | Path") -> dict[str, Any]:
    """The model weights of a loaded checkpoint.

    Raises:
        CheckpointError: the checkpoint was slimmed (``slim_checkpoint``) and holds none.
    """
    if state.get("slim"):
        raise CheckpointError(f"{path} holds a finished run's metrics only (slimmed): its weights were not kept")
    return state["model"]

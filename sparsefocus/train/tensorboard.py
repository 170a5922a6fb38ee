"""TensorBoard scalars of a run (``train.tensorboard=true``), written beside ``metrics.jsonl``.

Each epoch's metrics line becomes scalars at step = epoch: ``train/loss``, ``train/acc``,
``valid/loss``, ``valid/acc`` (and ``valid/ppl``, ``test/*`` for language models), ``lr`` and
``time/epoch_seconds``. A resumed run purges the events of epochs after its checkpoint, as
``metrics.jsonl`` drops them. View with ``tensorboard --logdir runs/<experiment>``.
Needs the ``tensorboard`` package (``pip install 'sparsefocus[tensorboard]'``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

SPLITS = ("train", "valid", "test")


def scalar_tag(key: str) -> str:
    """Metrics key -> TensorBoard tag: ``valid_acc`` -> ``valid/acc``, ``seconds`` -> ``time/epoch_seconds``."""
    if key == "seconds":
        return "time/epoch_seconds"
    split, _, stat = key.partition("_")
    return f"{split}/{stat}" if split in SPLITS and stat else key


class ScalarLog:
    """Writes metrics lines to TensorBoard event files in ``run_dir``; a no-op when disabled."""

    def __init__(self, run_dir: Path, enabled: bool, first_epoch: int = 1) -> None:
        self.writer = None
        if not enabled:
            return
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as error:
            raise ImportError(
                "train.tensorboard=true needs the tensorboard package: pip install 'sparsefocus[tensorboard]'"
            ) from error
        # purge_step drops events at epochs >= first_epoch left by an interrupted earlier attempt
        self.writer = SummaryWriter(log_dir=str(run_dir), purge_step=first_epoch if first_epoch > 1 else None)

    def write(self, metrics: dict[str, Any]) -> None:
        """Log one epoch's metrics (its ``epoch`` is the step)."""
        if self.writer is None:
            return
        epoch = int(metrics["epoch"])
        for key, value in metrics.items():
            if key != "epoch" and isinstance(value, (int, float)):
                self.writer.add_scalar(scalar_tag(key), float(value), epoch)
        self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()

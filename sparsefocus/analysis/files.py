"""Atomic figure files: written under a temporary name in the same folder, then ``os.replace``d."""

from __future__ import annotations

import os
from pathlib import Path


def save_figure(fig, path: str | Path, dpi: int = 120) -> None:
    """Save a matplotlib figure as PNG at ``path`` (parent folders created), atomically."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    temp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        fig.savefig(temp, dpi=dpi, format="png")
        os.replace(temp, path)
    finally:
        temp.unlink(missing_ok=True)

"""Test setup: Triton's interpreter on machines without CUDA (set before Triton is imported),
fixed seeds, and NaN-poisoned ``torch.empty`` so that a kernel that leaves outputs unwritten fails."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

_empty = torch.empty


def _nan_empty(*args, **kwargs):
    out = _empty(*args, **kwargs)
    with torch.no_grad():  # also a leaf made with requires_grad=True (torch.utils.checkpoint makes one)
        if out.is_floating_point():
            out.fill_(float("nan"))
        elif out.dtype in (torch.int32, torch.int64):
            out.fill_(-(2**30))
    return out


@pytest.fixture(autouse=True)
def poison_empty(monkeypatch):
    """Every torch.empty in a test is filled with NaN (ints with a large negative number)."""
    monkeypatch.setattr(torch, "empty", _nan_empty)
    torch.manual_seed(42)
    yield

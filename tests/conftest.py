"""Test setup: Triton's interpreter on machines without CUDA (set before Triton is imported),
fixed seeds, and NaN-poisoned ``torch.empty`` so that a kernel that leaves outputs unwritten fails."""

import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

_empty, _empty_like, _new_empty = torch.empty, torch.empty_like, torch.Tensor.new_empty

# Dynamo maps torch's functions to its tracing rules once, by name, on its first compile: built
# while poison_empty below has replaced torch.empty, the map would hold the wrapper and miss the
# builtin, and a test that compiles first would fail on a graph break. Build it now.
_rule_map = getattr(getattr(torch._dynamo, "trace_rules", None), "get_torch_obj_rule_map", None)
if _rule_map is not None:
    _rule_map()


def _poisoned(out: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():  # also a leaf made with requires_grad=True (torch.utils.checkpoint makes one)
        if out.is_floating_point():
            out.fill_(float("nan"))
        elif out.dtype in (torch.int32, torch.int64):
            out.fill_(-(2**30))
    return out


def _poisoning(make):
    """``make`` (torch.empty, torch.empty_like or Tensor.new_empty) with its result poisoned."""

    def poisoned(*args, **kwargs):
        return _poisoned(make(*args, **kwargs))

    return poisoned


@pytest.fixture(autouse=True)
def poison_empty(monkeypatch):
    """Every ``torch.empty``, ``torch.empty_like`` and ``Tensor.new_empty`` in a test is filled
    with NaN (ints with a large negative number), so that an output a kernel leaves unwritten shows."""
    monkeypatch.setattr(torch, "empty", _poisoning(_empty))
    monkeypatch.setattr(torch, "empty_like", _poisoning(_empty_like))
    monkeypatch.setattr(torch.Tensor, "new_empty", _poisoning(_new_empty))
    torch.manual_seed(42)
    yield


def _load_benchmark(name: str) -> ModuleType:
    """``benchmarks/<name>.py`` as a module, registered in ``sys.modules`` (a dataclass defined in
    it needs its module there) and loaded once."""
    if name not in sys.modules:
        path = Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py"
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


@pytest.fixture(scope="session")
def bench_script():
    """``bench_script("gpu_studies")``: a script of ``benchmarks/`` as a module."""
    return _load_benchmark


@pytest.fixture
def two_seed_parity(tmp_path):
    """A trained experiment folder: FULL and TOPK:3 on 8-bit parity, 2 seeds x 2 epochs (seconds on a CPU)."""
    from sparsefocus.train.config import from_dict
    from sparsefocus.train.experiment import run_experiment

    config = from_dict(
        {
            "name": "tiny",
            "out_dir": str(tmp_path / "runs"),
            "task": {"name": "parity", "length": 8, "num_train": 40, "num_valid": 20},
            "model": {"blocks": 1, "heads": 1, "dim": 8, "mlp_dim": 8},
            "train": {"epochs": 2},
            "mechanisms": ["FULL", "TOPK:3"],
            "seeds": [1, 2],
        }
    )
    return run_experiment(config, quiet=True)

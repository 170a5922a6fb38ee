"""impl="triton" on a machine without CUDA: runs in Triton's interpreter by itself, or fails with
one line saying how; impl="auto" never picks Triton for a CPU tensor. Each case runs in a fresh
Python without TRITON_INTERPRET, since the test session itself sets it (conftest)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from sparsefocus.attention.api import resolve_impl
from sparsefocus.attention.patterns import parse_pattern

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = """
import sys, torch
{pre}
import sparsefocus as sf
q, k, v = (torch.randn(1, 2, 33, 16, generator=torch.Generator().manual_seed(i)) for i in range(3))
try:
    out = sf.sparse_attention(q, k, v, "TOPK:5", impl="triton")
except RuntimeError as error:
    print("error:", error)
    sys.exit(3)
ref = sf.sparse_attention(q, k, v, "TOPK:5", impl="reference")
print("max difference", float((out - ref).abs().max()))
"""

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the behaviour without CUDA")


def run_script(pre: str) -> subprocess.CompletedProcess:
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, "-c", SCRIPT.format(pre=pre)], capture_output=True, text=True, env=env, timeout=600)


def test_triton_impl_on_cpu_runs_in_the_interpreter_without_the_variable():
    pytest.importorskip("triton")
    result = run_script("")
    assert result.returncode == 0, result.stdout + result.stderr
    assert float(result.stdout.split()[-1]) < 1e-5


def test_triton_imported_without_the_interpreter_gives_one_clear_line():
    pytest.importorskip("triton")
    result = run_script("import triton")
    assert result.returncode == 3, result.stdout + result.stderr
    message = result.stdout.strip()
    assert message.count("\n") == 0
    assert "TRITON_INTERPRET=1" in message and "before triton is imported" in message


def test_auto_never_picks_triton_for_a_cpu_tensor():
    q = torch.randn(1, 1, 8, 16)
    for name in ("TOPK:3", "BAND:3(1)", "zeta:k=4"):
        pattern = parse_pattern(name)
        assert resolve_impl(pattern, "auto", q) != "triton"

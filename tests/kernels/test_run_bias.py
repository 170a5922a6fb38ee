"""The per-run bias kernel against its twin ``run_bias_add_ref``: output and the gradients of the
matmul output and the bias at odd sizes, fp16 within twice PyTorch's own error, the ops' opcheck,
compiled equal to eager, and the folded linears taking it outside torch.compile. On CPU the
kernel runs in Triton's interpreter (tests/conftest.py)."""

import pytest
import torch

import sparsefocus.train.batched as batched
from sparsefocus.attention.common import run_bias_add_ref
from sparsefocus.kernels import run_bias
from sparsefocus.kernels.run_bias import run_bias_add

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    return ((x.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-12)).item()


def run(fn, out, bias, grad, dtype=None):
    """fn's result and the gradients of out and bias (out cast to dtype first)."""
    out = (out if dtype is None else out.to(dtype)).detach().requires_grad_(True)
    bias = bias.detach().requires_grad_(True)
    y = fn(out, bias)
    y.backward(grad.to(y.dtype))
    return y.detach(), out.grad, bias.grad


@pytest.mark.parametrize("runs,rows,width", [(3, 7, 5), (2, 300, 64), (1, 9, 130), (4, 1, 16), (2, 1025, 8), (1, 4100, 130)])
def test_matches_twin_fp32(runs, rows, width):
    """(1, 4100, 130): 129 tiles of 32 rows, 4 a program, the last program short."""
    out, bias = torch.randn(runs, rows, width, device=DEVICE), torch.randn(runs, width, device=DEVICE)
    grad = torch.randn_like(out)
    got, want = run(run_bias_add, out, bias, grad), run(run_bias_add_ref, out, bias, grad)
    for name, a, b in zip(["out", "d out", "d bias"], got, want):
        assert a.shape == b.shape and a.dtype == b.dtype, name
        assert torch.isfinite(a).all(), f"{name} has NaN/inf (unwritten output?)"
        assert rel_err(a, b) < 1e-6, f"{name}: relative error {rel_err(a, b):.2e}"


def test_fp16_within_twice_torch_error():
    """FlashAttention's rule on fp16 matmul outputs and an fp32 bias: against fp64, the kernel's
    error is at most twice the twin's in fp16 (+ eps), for the result and both gradients."""
    out, bias = torch.randn(3, 517, 48, device=DEVICE).half().float(), torch.randn(3, 48, device=DEVICE)
    grad = torch.randn_like(out).half().float()
    truth = run(run_bias_add_ref, out, bias.double(), grad.double(), torch.float64)
    torch_low = run(run_bias_add_ref, out, bias, grad, torch.float16)
    kernel = run(run_bias_add, out, bias, grad, torch.float16)
    for name, a, b, t in zip(["out", "d out", "d bias"], kernel, torch_low, truth):
        assert a.dtype == b.dtype, name
        assert rel_err(a, t) <= 2 * rel_err(b, t) + 1e-4, f"{name}: {rel_err(a, t):.2e} vs torch {rel_err(b, t):.2e}"


def test_opcheck_and_compiled_equals_eager():
    out, bias = torch.randn(2, 13, 24, device=DEVICE), torch.randn(2, 24, device=DEVICE)
    torch.library.opcheck(run_bias.run_bias_add_op, (out, bias))
    torch.library.opcheck(run_bias.run_bias_grad, (torch.randn_like(out), torch.float32))
    grad = torch.randn_like(out)
    compiled = torch.compile(run_bias_add, fullgraph=True)
    for name, a, b in zip(["out", "d out", "d bias"], run(compiled, out, bias, grad), run(run_bias_add, out, bias, grad)):
        assert torch.allclose(a, b, rtol=1e-6, atol=1e-6), name


def test_bad_shapes_get_one_line_errors():
    with pytest.raises(ValueError, match="run_bias_add needs"):
        run_bias_add(torch.randn(2, 3, 4), torch.randn(3, 4))
    with pytest.raises(ValueError, match="run_bias_add needs"):
        run_bias_add(torch.randn(2, 3, 4, 1), torch.randn(2, 4))


def test_folded_linear_takes_the_kernel_outside_compile(monkeypatch):
    """``run_matmul`` gives the same result and gradients with the kernel as with the twin; under
    torch.compile it adds the bias with the twin (no run_bias_add op in the graph)."""
    x = torch.randn(3 * 2, 7, 12, device=DEVICE)
    weight, bias = torch.randn(3, 20, 12, device=DEVICE), torch.randn(3, 20, device=DEVICE)
    grad = torch.randn(3 * 2, 7, 20, device=DEVICE)
    results = {}
    for choice in ("torch", "triton"):
        monkeypatch.setattr(batched, "BIAS_ADD", choice)
        leaves = [t.detach().requires_grad_(True) for t in (x, weight, bias)]
        batched.run_matmul(*leaves).backward(grad)
        results[choice] = [batched.run_matmul(*leaves).detach()] + [t.grad for t in leaves]
    for name, a, b in zip(["out", "dx", "dweight", "dbias"], results["triton"], results["torch"]):
        assert rel_err(a, b) < 1e-6, name
    ops = []

    def backend(gm, example_inputs):
        ops.extend(str(node.target) for node in gm.graph.nodes if node.op == "call_function")
        return gm

    compiled = torch.compile(batched.run_matmul, backend=backend, fullgraph=True)
    assert rel_err(compiled(x, weight, bias), results["torch"][0]) < 1e-6
    assert ops and not any("run_bias" in op for op in ops)

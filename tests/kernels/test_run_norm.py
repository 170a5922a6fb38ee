"""The per-run LayerNorm kernel against its twin ``run_layer_norm_ref``: outputs and the gradients
of x, weight and bias at odd sizes, fp16 within twice PyTorch's own error, the ops' opcheck,
compiled equal to eager, and the folded models' norm taking it. On CPU the kernel runs in
Triton's interpreter (tests/conftest.py)."""

import pytest
import torch
from torch import nn

import sparsefocus.train.batched as batched
from sparsefocus.attention.common import run_layer_norm_ref
from sparsefocus.kernels import run_norm
from sparsefocus.kernels.run_norm import run_layer_norm

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    return ((x.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-12)).item()


def make_case(runs: int, rows: tuple[int, ...], width: int, dtype=torch.float32):
    """x [runs * rows[0], *rows[1:], width] with an offset and spread per row, weight and bias [runs, width]."""
    x = torch.randn(runs * rows[0], *rows[1:], width, device=DEVICE) * 3 + torch.randn(
        runs * rows[0], *rows[1:], 1, device=DEVICE
    )
    weight = torch.randn(runs, width, device=DEVICE)
    bias = torch.randn(runs, width, device=DEVICE)
    return x.to(dtype), weight, bias


def run(fn, x, weight, bias, grad, dtype=None):
    """fn's output and the gradients of x, weight and bias (x cast to dtype first)."""
    x = (x if dtype is None else x.to(dtype)).detach().requires_grad_(True)
    weight, bias = weight.detach().requires_grad_(True), bias.detach().requires_grad_(True)
    out = fn(x, weight, bias, 1e-5)
    out.backward(grad.to(out.dtype))
    return out.detach(), x.grad, weight.grad, bias.grad


@pytest.mark.parametrize(
    "runs,rows,width", [(3, (2, 7), 5), (2, (1, 11), 64), (1, (3, 4), 37), (4, (5,), 16), (2, (2, 3, 2), 130), (1, (4100,), 130)]
)
def test_matches_twin_fp32(runs, rows, width):
    """(1, (4100,), 130): 257 tiles of 16 rows, 8 a program in the backward, the last one short."""
    x, weight, bias = make_case(runs, rows, width)
    grad = torch.randn_like(x)
    got = run(run_layer_norm, x, weight, bias, grad)
    want = run(run_layer_norm_ref, x, weight, bias, grad)
    for name, a, b in zip(["out", "dx", "dweight", "dbias"], got, want):
        assert a.shape == b.shape and a.dtype == b.dtype, name
        assert torch.isfinite(a).all(), f"{name} has NaN/inf (unwritten output?)"
        assert rel_err(a, b) < 1e-5, f"{name}: relative error {rel_err(a, b):.2e}"


def test_fp16_within_twice_torch_error():
    """FlashAttention's rule: on the same fp16-rounded x, the kernel's error against fp64 is at
    most twice the twin's in fp16 (+ eps), for the output and every gradient."""
    x, weight, bias = make_case(3, (4, 9), 48)
    x = x.half().float()
    grad = torch.randn_like(x)
    truth = run(run_layer_norm_ref, x, weight.double(), bias.double(), grad.double(), torch.float64)
    torch_low = run(run_layer_norm_ref, x, weight, bias, grad, torch.float16)
    kernel = run(run_layer_norm, x, weight, bias, grad, torch.float16)
    for name, a, b, t in zip(["out", "dx", "dweight", "dbias"], kernel, torch_low, truth):
        assert a.dtype == b.dtype, name
        assert rel_err(a, t) <= 2 * rel_err(b, t) + 1e-4, f"{name}: {rel_err(a, t):.2e} vs torch {rel_err(b, t):.2e}"


def test_opcheck_and_compiled_equals_eager():
    x, weight, bias = make_case(2, (3, 5), 24)
    torch.library.opcheck(run_norm.run_layer_norm_op, (x, weight, bias, 1e-5))
    out, mean, rstd = run_norm.run_layer_norm_op(x, weight, bias, 1e-5)
    torch.library.opcheck(run_norm.run_layer_norm_bwd, (torch.randn_like(out), x, weight, mean, rstd))
    grad = torch.randn_like(x)
    compiled = torch.compile(run_layer_norm, fullgraph=True)
    for name, a, b in zip(
        ["out", "dx", "dweight", "dbias"], run(compiled, x, weight, bias, grad), run(run_layer_norm, x, weight, bias, grad)
    ):
        assert torch.allclose(a, b, rtol=1e-6, atol=1e-6), name


def test_bad_shapes_get_one_line_errors():
    x, weight, bias = make_case(2, (3,), 8)
    with pytest.raises(ValueError, match="run_layer_norm needs"):
        run_layer_norm(x[:5], weight, bias)  # 5 rows for 2 runs
    with pytest.raises(ValueError, match="run_layer_norm needs"):
        run_layer_norm(x, weight, bias[:, :4])


def test_folded_norm_takes_the_kernel_under_autocast(monkeypatch):
    """A fast folded LayerNorm gives its twin's result with the kernel, and the exact fold's; on a
    bf16 input under autocast it normalises in fp32, as CUDA's autocast runs LayerNorm."""
    norms = [nn.LayerNorm(20) for _ in range(3)]
    for n in norms:
        nn.init.normal_(n.weight)
        nn.init.normal_(n.bias)
    folded = batched.RunLayerNorm(norms, exact=False).to(DEVICE)
    x = torch.randn(3 * 2, 7, 20, device=DEVICE)
    monkeypatch.setattr(batched, "LAYER_NORM", "torch")
    want, want_cast = folded(x), folded(x.bfloat16().float())
    monkeypatch.setattr(batched, "LAYER_NORM", "triton")
    got = folded(x)
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        got_cast = folded(x.bfloat16())
    assert got.dtype == got_cast.dtype == torch.float32
    assert rel_err(got, want) < 1e-5 and rel_err(got_cast, want_cast) < 1e-5
    exact = batched.RunLayerNorm(norms, exact=True).to(DEVICE)
    assert rel_err(got, exact(x)) < 1e-5


def test_compiled_folded_norm_takes_the_twin(monkeypatch):
    """Under torch.compile the folded norm is the twin (Inductor fuses it): no run_layer_norm op in
    the graph, and the result equals the kernel's."""
    norms = [nn.LayerNorm(12) for _ in range(2)]
    folded = batched.RunLayerNorm(norms, exact=False).to(DEVICE)
    monkeypatch.setattr(batched, "LAYER_NORM", "triton")
    x = torch.randn(2 * 3, 5, 12, device=DEVICE)
    ops = []

    def backend(gm, example_inputs):
        ops.extend(str(node.target) for node in gm.graph.nodes if node.op == "call_function")
        return gm

    compiled = torch.compile(folded, backend=backend, fullgraph=True)
    assert rel_err(compiled(x), folded(x)) < 1e-5
    assert ops and not any("run_layer_norm" in op for op in ops)

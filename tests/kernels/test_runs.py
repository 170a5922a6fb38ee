"""The Triton run (window) attention kernel against ``run_attention_ref``: outputs and dq, dk, dv at
odd sizes, GQA, Dv != D, causal and not, overlapping and unsorted starts, per-query lengths and
empty rows. On CPU the kernel runs in Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1)."""

import pytest
import torch

import sparsefocus.attention.common as common
from sparsefocus.attention.common import run_attention_ref
from sparsefocus.kernels import runs
from sparsefocus.kernels.runs import run_attention

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    return ((x.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-12)).item()


def close(x: torch.Tensor, ref: torch.Tensor) -> bool:
    """fp32 agreement: relative 1e-5, plus 1e-6 absolute for gradients that are exactly 0 in the
    reference (a one-key softmax has dq = 0; the kernel gives rounding noise)."""
    return (x.double() - ref.double()).norm().item() <= 1e-5 * ref.double().norm().item() + 1e-6


def make_case(n, m, q_heads=4, kv_heads=2, dim=6, dim_v=3):
    q = torch.randn(2, q_heads, n, dim, device=DEVICE)
    k = torch.randn(2, kv_heads, m, dim, device=DEVICE)
    v = torch.randn(2, kv_heads, m, dim_v, device=DEVICE)
    return q, k, v


def band_starts(n, m, width, q_heads=4):
    """Sorted, overlapping starts (a sliding window), some before 0 and some past the keys."""
    return (torch.arange(n, device=DEVICE) - width // 2).expand(2, q_heads, n)


def run(fn, q, k, v, start, width, causal, dtype, grad_out):
    leaves = [x.to(dtype).requires_grad_() for x in (q, k, v)]
    out = fn(*leaves, start, width, causal=causal)
    return [out] + list(torch.autograd.grad(out.float(), leaves, grad_out))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("n,m,width,order", [(1, 4, 3, "band"), (7, 7, 5, "random"), (63, 40, 13, "band"), (100, 9, 7, "random")])
def test_run_kernel_matches_reference_fp32(causal, n, m, width, order):
    q, k, v = make_case(n, m)
    if order == "band":
        start = band_starts(n, m, width)
    else:  # unsorted, overlapping, partly out of range
        start = torch.randint(-width, m + 2, (2, 4, n), device=DEVICE)
    grad_out = torch.randn(2, 4, n, 3, device=DEVICE)
    got = run(run_attention, q, k, v, start, width, causal, torch.float32, grad_out)
    want = run(run_attention_ref, q, k, v, start, width, causal, torch.float32, grad_out)
    for name, x, y in zip(["out", "dq", "dk", "dv"], got, want):
        assert torch.isfinite(x).all(), f"{name} has NaN/inf (unwritten output?)"
        assert close(x, y), f"{name}: relative error {rel_err(x, y):.2e}"


@pytest.mark.parametrize("causal", [False, True])
def test_run_kernel_takes_offsets_and_broadcast_runs(causal):
    """An int start (query i from i + o, no run tensor) and starts or lengths broadcast over the
    batch or the heads ([1, 1, N], [B, 1, N], [1, Hq, N], read through strides) give the outputs
    and gradients of the same runs spelled out per row, and of the reference."""
    n, m, width = 45, 45, 6
    q, k, v = make_case(n, m)
    grad_out = torch.randn(2, 4, n, 3, device=DEVICE)
    full = (torch.arange(n, device=DEVICE) - width + 1).expand(2, 4, n).contiguous()
    want = run(run_attention_ref, q, k, v, full, width, causal, torch.float32, grad_out)
    lengths = torch.randint(0, 9, (2, 1, n), device=DEVICE)
    want_lengths = run(run_attention_ref, q, k, v, full, lengths.expand(2, 4, n), causal, torch.float32, grad_out)
    cases = {
        "offset": (1 - width, width, want),
        "starts [1, 1, N]": (full[:1, :1], width, want),
        "starts [B, 1, N]": (full[:, :1], width, want),
        "starts [1, Hq, N]": (full[:1], width, want),
        "offset, lengths [B, 1, N]": (1 - width, lengths, want_lengths),
        "starts [1, Hq, N], lengths [B, 1, N]": (full[:1], lengths, want_lengths),
    }
    for case, (start, widths, expected) in cases.items():
        got = run(run_attention, q, k, v, start, widths, causal, torch.float32, grad_out)
        assert all(close(x, y) for x, y in zip(got, expected)), case
    assert all(
        close(x, y) for x, y in zip(run(run_attention_ref, q, k, v, 1 - width, width, causal, torch.float32, grad_out), want)
    )
    with pytest.raises(ValueError, match="int offset"):
        run_attention(q, k, v, 1.5, width)
    with pytest.raises(ValueError, match="start must be"):  # 3 batch rows for q's 2
        run_attention(q, k, v, full[:1].expand(3, 4, n), width)
    with pytest.raises(ValueError, match="width as a tensor"):
        run_attention(q, k, v, full, lengths.expand(2, 2, n))  # 2 heads for q's 4
    with pytest.raises(ValueError, match="runs must be"):  # the op itself
        runs.runs_fwd(q, k, v, full[:1].expand(3, 4, n).to(torch.int32), None, 0, width, 1.0, causal)


def test_run_kernel_per_query_lengths_and_empty_rows():
    n, m = 37, 30
    q, k, v = make_case(n, m, q_heads=2, kv_heads=1, dim=5, dim_v=7)
    start = torch.randint(-3, m, (1, 2, n), device=DEVICE)
    lengths = torch.randint(0, 11, (2, 1, n), device=DEVICE)
    start[0, 0, :4] = m + 1  # runs past the keys: empty rows
    lengths[1, 0, 5] = 0
    grad_out = torch.randn(2, 2, n, 7, device=DEVICE)
    got = run(run_attention, q, k, v, start, lengths, True, torch.float32, grad_out)
    want = run(run_attention_ref, q, k, v, start, lengths, True, torch.float32, grad_out)
    for name, x, y in zip(["out", "dq", "dk", "dv"], got, want):
        assert close(x, y), f"{name}: relative error {rel_err(x, y):.2e}"
    assert (got[0][0, :, :4] == 0).all() and (got[0][1, :, 5] == 0).all(), "empty rows must be zero"
    assert (got[1][0, :, :4] == 0).all(), "empty rows get no query gradient"


@pytest.mark.parametrize("causal", [False, True])
def test_run_kernel_fp16_within_twice_torch_error(monkeypatch, causal):
    """FlashAttention's rule: on the same fp16-rounded inputs, the kernel's error against fp32 is at
    most twice PyTorch's own error computing in fp16 (the reference without its fp32 upcast)."""
    n, m, width = 63, 50, 21
    q, k, v = (x.half().float() for x in make_case(n, m, dim=16, dim_v=8))
    start = band_starts(n, m, width) + torch.randint(-2, 3, (2, 4, n), device=DEVICE)  # nearly sorted
    grad_out = torch.randn(2, 4, n, 8, device=DEVICE)
    truth = run(run_attention_ref, q, k, v, start, width, causal, torch.float32, grad_out)
    with monkeypatch.context() as patch:
        patch.setattr(common, "upcast", lambda x: x)
        torch_low = run(run_attention_ref, q, k, v, start, width, causal, torch.float16, grad_out)
    kernel = run(run_attention, q, k, v, start, width, causal, torch.float16, grad_out)
    for name, x, y, t in zip(["out", "dq", "dk", "dv"], kernel, torch_low, truth):
        assert x.dtype == torch.float16
        assert rel_err(x, t) <= 2 * rel_err(y, t) + 1e-5, f"{name}: {rel_err(x, t):.2e} vs torch {rel_err(y, t):.2e}"


def test_run_kernel_rejects_bad_input():
    q, k, v = make_case(7, 5)
    start = torch.zeros(2, 4, 7, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="start"):
        run_attention(q, k, v, start.float(), 3)
    with pytest.raises(ValueError, match="width"):
        run_attention(q, k, v, start, -1)
    with pytest.raises(ValueError, match="incompatible"):
        run_attention(q, k[..., :5], v, start, 3)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("pattern,uses_runs", [("BAND:6", True), ("BAND:5(1)", False)])
def test_band_triton_takes_run_kernel_without_global_tokens(monkeypatch, pattern, uses_runs, causal):
    """BAND's triton path: the run kernel when there are no global tokens and no padding (else the
    indexed kernel), equal to the reference in outputs and gradients either way."""
    from sparsefocus.attention import sparse_attention
    from sparsefocus.kernels import runs

    calls = []
    monkeypatch.setattr(runs, "run_attention", lambda *a, **kw: calls.append(1) or run_attention(*a, **kw))
    q, k, v = make_case(37, 37, dim=8, dim_v=5)
    grad_out = torch.randn(2, 4, 37, 5, device=DEVICE)
    results = []
    for impl in ("triton", "reference"):
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        out = sparse_attention(*leaves, pattern, causal=causal, impl=impl)
        results.append([out] + list(torch.autograd.grad(out, leaves, grad_out)))
    assert bool(calls) == uses_runs
    for name, x, y in zip(["out", "dq", "dk", "dv"], *results):
        assert close(x, y), f"{pattern} {name}: relative error {rel_err(x, y):.2e}"

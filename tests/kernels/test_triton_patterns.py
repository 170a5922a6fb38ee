"""``sparse_attention(..., impl="triton")`` equals ``impl="reference"`` (outputs and grads) for
TOPK and BAND, the two patterns whose Triton path is the kernels of this package, and BOTK, whose
selection runs in PyTorch before the same attention kernel; 4 query heads share 2 kv heads."""

import pytest
import torch

from sparsefocus.attention import sparse_attention

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("pattern", ["TOPK:5", "BAND:5(1)", "BOTK:3"])
@pytest.mark.parametrize("causal", [False, True])
def test_triton_impl_matches_reference(pattern, causal):
    q = torch.randn(2, 4, 37, 8, device=DEVICE, requires_grad=True)
    k = torch.randn(2, 2, 37, 8, device=DEVICE, requires_grad=True)
    v = torch.randn(2, 2, 37, 6, device=DEVICE, requires_grad=True)
    grad_out = torch.randn(2, 4, 37, 6, device=DEVICE)
    outs = []
    for impl in ("triton", "reference"):
        out = sparse_attention(q, k, v, pattern, causal=causal, impl=impl)
        outs.append([out] + list(torch.autograd.grad(out, (q, k, v), grad_out)))
    for name, got, want in zip(["out", "dq", "dk", "dv"], *outs):
        assert torch.allclose(got, want, atol=1e-5, rtol=1e-4), f"{pattern} {name}"

"""ZETA's selection kernel reads 16-bit keys as packed int64 words; the decode is exact."""

import pytest
import torch
import triton
import triton.language as tl

from sparsefocus.kernels.zeta_select import _key_component, packed_keys

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@triton.jit
def _decode_packed(W, OUT, N, D: tl.constexpr, BF16: tl.constexpr):
    """OUT [N, D] fp32 = the components of the packed words W [N] (one program, N <= 64)."""
    rows = tl.arange(0, 64)
    word = tl.load(W + rows, mask=rows < N, other=0)
    for d in tl.static_range(D):
        tl.store(OUT + rows * D + d, _key_component(word, d, BF16), mask=rows < N)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("dims", [1, 3, 4])
def test_packed_keys_decode_to_the_exact_fp32_values(dtype, dims):
    """One int64 word per key, decoded in the kernel with integer operations: every value,
    signed zeros, subnormals and infinities included, comes back as ``k.float()`` bit for bit."""
    k = torch.randn(1, 1, 40, dims).mul(100).to(dtype)
    tiny = torch.finfo(dtype).tiny
    k.view(-1)[:6] = torch.tensor([-0.0, 0.0, float("inf"), -float("inf"), tiny / 4, -tiny / 8]).to(dtype)
    words = packed_keys(k).view(-1).to(DEVICE)
    out = torch.full((40, dims), float("nan"), device=DEVICE)
    _decode_packed[(1,)](words, out, 40, D=dims, BF16=dtype == torch.bfloat16)
    want = k.float().view(40, dims)
    assert torch.equal(out.cpu().view(torch.int32), want.view(torch.int32))

"""``masked_sdpa``: SDPA with a mask tensor, kept off cuDNN's backend at the key lengths where its
backward can return NaN; the same numbers either way, compiled too."""

import pytest
import torch
import torch.nn.functional as F

from sparsefocus.attention import common
from sparsefocus.attention.common import avoids_cudnn, cudnn_masked_unsafe, masked_sdpa


@pytest.mark.parametrize("n_keys,unsafe", [(576, True), (704, True), (64, True), (599, False), (600, False), (640, False)])
def test_cudnn_is_avoided_at_64_past_a_multiple_of_128_and_on_cuda_only(n_keys, unsafe):
    assert cudnn_masked_unsafe(n_keys) == unsafe
    assert not avoids_cudnn(torch.empty(0), n_keys)  # a CPU tensor: SDPA has no cuDNN backend there


@pytest.mark.parametrize("avoid", [False, True])
def test_masked_sdpa_equals_sdpa_with_its_mask_and_compiles(avoid, monkeypatch):
    """Both branches (the backend restriction forced on the CPU) give SDPA's output and gradients,
    eager and under torch.compile(fullgraph=True)."""
    monkeypatch.setattr(common, "avoids_cudnn", lambda q, n_keys: avoid)
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, 9, 8, requires_grad=True) for _ in range(3))
    mask = torch.rand(2, 1, 9, 9) > 0.3
    mask[..., 0] = True
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.4)
    want_grads = torch.autograd.grad(want.sum(), (q, k, v))
    for fn in (masked_sdpa, torch.compile(masked_sdpa, fullgraph=True)):
        got = fn(q, k, v, mask, scale=0.4)
        torch.testing.assert_close(got, want)
        for g, w in zip(torch.autograd.grad(got.sum(), (q, k, v)), want_grads):
            torch.testing.assert_close(g, w)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: cuDNN's SDPA backend exists only there")
@pytest.mark.parametrize("n_keys", [576, 599, 704])
def test_masked_sdpa_gradients_stay_finite_when_every_logit_is_far_below_zero(n_keys):
    """The case where cuDNN's masked backward gave non-finite dq (576 and 704 keys, every logit
    about -120): finite gradients, dk and dv equal to the memory-efficient backend's."""
    torch.manual_seed(0)
    q = torch.randn(2, 1, n_keys, 64, device="cuda", dtype=torch.bfloat16) * 0.1
    k = torch.randn(2, 1, n_keys, 64, device="cuda", dtype=torch.bfloat16) * 0.1
    v = torch.randn(2, 1, n_keys, 64, device="cuda", dtype=torch.bfloat16)
    q[..., 0], k[..., 0] = 1.0, -120.0 * 8.0
    mask = (torch.arange(n_keys, device="cuda") < n_keys - 9)[None, None, None, :].expand(2, 1, 1, n_keys)
    leaves = [x.requires_grad_() for x in (q, k, v)]
    out = masked_sdpa(*leaves, mask)
    grads = torch.autograd.grad(out.float().sum(), leaves)
    assert all(bool(torch.isfinite(g).all()) for g in grads)
    with torch.nn.attention.sdpa_kernel([torch.nn.attention.SDPBackend.EFFICIENT_ATTENTION]):
        want = torch.autograd.grad(F.scaled_dot_product_attention(*leaves, attn_mask=mask).float().sum(), leaves)
    for got, ref in zip(grads[1:], want[1:]):  # dk, dv (dq's first column cancels sums of +-960 k terms)
        torch.testing.assert_close(got, ref, rtol=2e-2, atol=2e-2)

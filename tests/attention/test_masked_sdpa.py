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

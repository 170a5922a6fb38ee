"""SparseAttention and the MoE feed-forward layer."""

import pytest
import torch

import sparsefocus as sf
from sparsefocus.layers import MoEFeedForward, SparseAttention


def test_sparse_attention_layer_shapes_gqa_and_gradients():
    layer = SparseAttention(24, 6, "TOPK:3", kv_heads=2, causal=True)
    x = torch.randn(2, 13, 24, requires_grad=True)
    out = layer(x)
    assert out.shape == (2, 13, 24)
    out.sum().backward()
    assert torch.isfinite(x.grad).all() and layer.k_proj.weight.grad.abs().sum() > 0


def test_sparse_attention_layer_equals_functional_call():
    torch.manual_seed(0)
    layer = SparseAttention(16, 2, "BAND:3(1)", head_dim=16)
    x = torch.randn(1, 7, 16)
    q, k, v = layer.project(x)
    expected = layer.out_proj(sf.sparse_attention(q, k, v, "BAND:3(1)").transpose(1, 2).reshape(1, 7, 32))
    torch.testing.assert_close(layer(x), expected)


@pytest.mark.parametrize("kwargs, fragment", [(dict(heads=5), "divide"), (dict(heads=4, kv_heads=3), "multiple")])
def test_sparse_attention_layer_rejects_bad_heads(kwargs, fragment):
    with pytest.raises(ValueError, match=fragment):
        SparseAttention(16, pattern="FULL", **kwargs)


@pytest.mark.parametrize("balance", ["switch", "cv2"])
@pytest.mark.parametrize("renormalize", [False, True])
def test_moe_dispatch_equals_dense_reference(balance, renormalize):
    torch.manual_seed(1)
    moe = MoEFeedForward(12, 20, num_experts=5, top_k=2, balance_loss=balance, renormalize=renormalize)
    x = torch.randn(3, 7, 12, requires_grad=True)
    fast = moe(x)
    fast_aux = moe.aux_loss
    grads_fast = torch.autograd.grad(fast.square().sum() + fast_aux, [x, moe.router.weight, moe.experts[0][0].weight])
    slow = moe.forward_reference(x)
    grads_slow = torch.autograd.grad(slow.square().sum() + moe.aux_loss, [x, moe.router.weight, moe.experts[0][0].weight])
    torch.testing.assert_close(fast, slow, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(fast_aux, moe.aux_loss)
    for a, b in zip(grads_fast, grads_slow):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    assert moe.last_load.sum() == 3 * 7 * 2


def test_moe_balance_loss_is_minimal_for_uniform_routing():
    moe = MoEFeedForward(4, 8, num_experts=4, top_k=1, balance_weight=1.0)
    probs = torch.full((8, 4), 0.25)
    experts = torch.arange(8).remainder(4)[:, None]
    assert moe._balance(probs, experts).item() == pytest.approx(1.0)
    skewed = torch.tensor([[0.7, 0.1, 0.1, 0.1]]).expand(8, 4)
    assert moe._balance(skewed, torch.zeros(8, 1, dtype=torch.long)).item() > 1.0
    moe_cv = MoEFeedForward(4, 8, num_experts=4, top_k=1, balance_loss="cv2", balance_weight=1.0)
    assert moe_cv._balance(probs, experts).item() == pytest.approx(0.0, abs=1e-6)


def test_moe_rejects_bad_arguments():
    with pytest.raises(ValueError, match="top_k"):
        MoEFeedForward(4, 8, num_experts=2, top_k=3)
    with pytest.raises(ValueError, match="activation"):
        MoEFeedForward(4, 8, num_experts=2, activation="tanh")

"""Sparsemax, entmax and the sigmoid gate: known values, gradients, limits."""

import pytest
import torch

import sparsefocus as sf
from sparsefocus.attention.adaptive import _entmax15_forward, _entmax_bisect_forward, entmax, sparsemax


def test_sparsemax_known_values_and_masked_entries():
    x = torch.tensor([[1.0, 0.5, -1.0, float("-inf")], [3.0, 0.0, 0.0, 0.0], [0.2, 0.2, 0.2, 0.2]])
    expected = torch.tensor([[0.75, 0.25, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0], [0.25, 0.25, 0.25, 0.25]])
    torch.testing.assert_close(sparsemax(x), expected)


def test_entmax_15_matches_its_closed_form():
    # For alpha = 1.5, p_i = [z_i/2 - tau]_+^2 with sum 1; on [1, 0] the support is both entries
    # when 1/2 - tau and -tau satisfy (1/2 - tau)^2 + tau^2 = 1 -> tau = (1/2 - sqrt(7/4)) / 2.
    tau = (0.5 - (1.75) ** 0.5) / 2
    expected = torch.tensor([(0.5 - tau) ** 2, tau**2], dtype=torch.float64)
    torch.testing.assert_close(entmax(torch.tensor([1.0, 0.0], dtype=torch.float64), 1.5), expected)


@pytest.mark.parametrize("spread", [0.1, 1.0, 30.0])
def test_entmax_15_by_sorting_equals_bisection_with_masked_entries(spread):
    """1.5-entmax takes the exact sort; the bisection, run to float64 resolution, is its slow twin:
    rows of odd lengths, wide and narrow score spreads, -inf entries, a row of one finite entry."""
    gen = torch.Generator().manual_seed(int(spread * 10))
    x = torch.randn(6, 37, generator=gen, dtype=torch.float64) * spread
    x[1, 5:] = float("-inf")
    x[2, ::3] = float("-inf")
    x[3, 1:] = float("-inf")
    exact = _entmax15_forward(x)
    torch.testing.assert_close(exact, _entmax_bisect_forward(x, 1.5), atol=1e-12, rtol=0)
    torch.testing.assert_close(exact.sum(-1), torch.ones(6, dtype=torch.float64))
    assert torch.equal(exact[torch.isinf(x)], torch.zeros_like(exact[torch.isinf(x)]))
    assert exact[3, 0] == 1.0


def test_entmax_alpha_two_is_sparsemax_and_near_one_is_softmax():
    x = torch.randn(5, 9, dtype=torch.float64)
    torch.testing.assert_close(entmax(x, 2.0), sparsemax(x), atol=1e-9, rtol=0)
    torch.testing.assert_close(entmax(x, 1.001), torch.softmax(x, -1), atol=5e-3, rtol=0)


@pytest.mark.parametrize("fn", [sparsemax, lambda t: entmax(t, 1.5), lambda t: entmax(t, 1.2)])
def test_normaliser_gradients_pass_gradcheck(fn):
    x = torch.randn(3, 7, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(fn, (x,), atol=1e-6)


def test_sparsemax_attention_puts_exact_zeros_and_rows_sum_to_one():
    gen = torch.Generator().manual_seed(0)
    q, k = (torch.randn(1, 2, 20, 8, generator=gen) * 3 for _ in range(2))
    v = torch.eye(20).expand(1, 2, 20, 20)
    weights = sf.sparse_attention(q, k, v, "sparsemax", impl="reference")
    assert (weights == 0).any()
    torch.testing.assert_close(weights.sum(-1), torch.ones(1, 2, 20))
    assert torch.equal(sf.selection_mask("sparsemax", q, k), weights > 0)


def test_gate_parameters_receive_gradients_and_change_the_output():
    layer = sf.layers.SparseAttention(16, 2, "gate")
    x = torch.randn(2, 9, 16)
    layer(x).square().sum().backward()
    assert layer.mechanism["gate_weight"].grad.abs().sum() > 0
    assert layer.mechanism["gate_bias"].grad.abs().sum() > 0
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 9, 8, generator=gen) for _ in range(3))
    closed = {"gate_weight": torch.zeros(2), "gate_bias": torch.full((2,), -30.0)}
    open_ = {"gate_weight": torch.zeros(2), "gate_bias": torch.full((2,), 30.0)}
    full = sf.sparse_attention(q, k, v, "FULL")
    torch.testing.assert_close(sf.sparse_attention(q, k, v, "gate", params=open_), full, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(sf.sparse_attention(q, k, v, "gate", params=closed), full, atol=1e-5, rtol=1e-5)
    tilted = {"gate_weight": torch.full((2,), 4.0), "gate_bias": torch.zeros(2)}
    assert not torch.allclose(sf.sparse_attention(q, k, v, "gate", params=tilted), full, atol=1e-3)

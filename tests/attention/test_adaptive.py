"""Sparsemax, entmax and the sigmoid gate: known values, gradients, limits; the Triton row kernel
of sparsemax and 1.5-entmax against the sorted forms, alone and inside the mechanisms."""

import pytest
import torch
from block_sparse_checks import impl_device

import sparsefocus as sf
from sparsefocus.attention import adaptive
from sparsefocus.attention.adaptive import _entmax15_forward, _entmax_bisect_forward, _sparsemax_forward, entmax, sparsemax
from sparsefocus.kernels.entmax_rows import MAX_KEYS, entmax_rows, fits

DEVICE = impl_device("triton")  # where the row kernel runs (the interpreter on a CPU)


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


@pytest.mark.parametrize(
    "shape, spread", [((7, 37), 1.0), ((3, 5, 600), 3.0), ((40, 17), 30.0), ((2, 1000), 0.01), ((3, 4096), 2.0)]
)
@pytest.mark.parametrize("alpha, twin", [(1.5, _entmax15_forward), (2.0, _sparsemax_forward)])
def test_row_kernel_equals_the_sorted_forms(shape, spread, alpha, twin):
    """Odd lengths, narrow and wide spreads (tiny, few and many kept entries), -inf entries, the
    longest rows: the same weights to fp32 rounding and the same support."""
    torch.manual_seed(int(spread * 100))
    x = torch.randn(shape) * spread
    x[..., 3] = float("-inf")
    got, want = entmax_rows(x.to(DEVICE), alpha).cpu(), twin(x)
    torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)
    assert torch.equal(got > 0, want > 0)
    torch.testing.assert_close(got.sum(-1), torch.ones(shape[:-1]))


def test_row_kernel_takes_half_precision_scores_in_fp32_and_keeps_their_dtype(monkeypatch):
    """Under autocast the scores arrive in 16 bits: the kernel normalises them in fp32 and the
    weights keep the scores' dtype, as the sorted form's."""
    monkeypatch.setattr(adaptive, "ROW_KERNEL", "triton")
    x = (torch.randn(4, 50) * 3).half()
    got = entmax(x.to(DEVICE), 1.5)
    assert got.dtype == torch.float16
    torch.testing.assert_close(got.cpu(), _entmax15_forward(x.float()).half())


def test_row_kernel_ties_rows_of_minus_infinity_and_its_limits():
    ties = torch.tensor([[1.0, 1.0, 1.0, 0.0], [5.0, 5.0, -3.0, 5.0]])
    for alpha, twin in ((1.5, _entmax15_forward), (2.0, _sparsemax_forward)):
        torch.testing.assert_close(entmax_rows(ties.to(DEVICE), alpha).cpu(), twin(ties))
    empty = torch.full((2, 9), float("-inf"))
    empty[1, 2] = 1.0
    assert torch.equal(entmax_rows(empty.to(DEVICE), 1.5).cpu(), torch.eye(9)[[0, 2]] * torch.tensor([[0.0], [1.0]]))
    assert not fits(MAX_KEYS + 1, 1.5) and not fits(10, 1.2) and fits(10, 2.0)
    with pytest.raises(ValueError, match="alpha 1.2 over rows of 10"):
        entmax_rows(torch.randn(2, 10), 1.2)
    torch.library.opcheck(torch.ops.sparsefocus.entmax_rows.default, (torch.randn(5, 13, device=DEVICE), 1.5))


@pytest.mark.parametrize("recompute", [False, True], ids=["kept", "recomputed"])
@pytest.mark.parametrize("spec", ["entmax", "sparsemax"])
def test_mechanisms_through_the_row_kernel_match_in_outputs_and_gradients(spec, recompute, monkeypatch):
    monkeypatch.setattr(adaptive, "RECOMPUTE_MIN_BYTES", 0 if recompute else 2**62)  # chunks checkpointed or kept
    torch.manual_seed(5)
    q, k, v = (torch.randn(2, 2, 29, 8, device=DEVICE) * 2 for _ in range(3))
    padding = torch.rand(2, 29, device=DEVICE) > 0.2
    padding[:, 0] = True

    calls = []
    monkeypatch.setattr(adaptive, "_rows", lambda *args: calls.append(1) or entmax_rows(*args))

    def run(choice: str, impl: str = "lean") -> list[torch.Tensor]:
        monkeypatch.setattr(adaptive, "ROW_KERNEL", choice)
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = sf.sparse_attention(*leaves, spec, causal=True, key_padding_mask=padding, impl=impl)
        return [out, *torch.autograd.grad((out * torch.cos(out)).sum(), leaves)]

    kernel = run("triton")
    assert calls, "the row kernel normalised nothing"
    for want in (run("torch"), run("torch", impl="reference")):  # the sorted form, chunked and dense
        for name, got, expected in zip(["out", "dq", "dk", "dv"], kernel, want):
            torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-4, msg=name)

"""The fused top-k selection sweep kernels against the PyTorch selections: exact positions (same tie
rule), causal and padded keys never chosen, -1 fill for short rows, overflowing rows redone on
the device, the op's registration (opcheck)."""

import pytest
import torch

from sparsefocus.attention.common import expand_kv, row_slice
from sparsefocus.attention.topk import select_extreme_keys
from sparsefocus.kernels import topk_select as topk_select_module
from sparsefocus.kernels.topk_select import topk_select, topk_select_torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(autouse=True)
def sweep_kernels(monkeypatch):
    """These tests are of the sweep kernels at small sizes, which would take the one-launch
    kernel of short rows (tests/kernels/test_topk_select_short.py)."""
    monkeypatch.setattr(topk_select_module, "SHORT_MAX_M", 0)


@pytest.mark.parametrize(
    "n,m,kk,causal,padded",
    [
        (1, 1, 1, True, False),
        (7, 7, 3, True, False),
        (63, 63, 5, True, False),
        (100, 37, 8, False, True),
        (100, 100, 32, True, False),
    ],
)
@pytest.mark.parametrize("order", ["score", "position"])
def test_topk_select_equals_torch_selection(n, m, kk, causal, padded, order):
    q = torch.randn(1, 4, n, 5, device=DEVICE)
    k = torch.randn(1, 2, m, 5, device=DEVICE)
    key_padding_mask = torch.rand(1, m, device=DEVICE) > 0.3 if padded else None
    got = topk_select(q, k, kk, causal=causal, key_padding_mask=key_padding_mask, order=order)
    assert got.shape == (1, 4, n, kk) and got.dtype == torch.int32
    want = topk_select_torch(q, k, kk, causal=causal, key_padding_mask=key_padding_mask, order=order)
    assert torch.equal(got, want)
    reference = select_extreme_keys(q, expand_kv(k, 4), row_slice(n), kk, True, causal, key_padding_mask)
    width = reference.shape[-1]
    assert torch.equal(got.long().sort(-1).values[..., -width:].sort(-1).values, reference.sort(-1).values)


def test_topk_select_never_picks_future_or_padded_keys_and_fills_minus_one():
    q, k = torch.randn(1, 2, 40, 4, device=DEVICE), torch.randn(1, 2, 40, 4, device=DEVICE)
    key_padding_mask = torch.ones(1, 40, dtype=torch.bool, device=DEVICE)
    key_padding_mask[0, 5:9] = False
    got = topk_select(q, k, 6, causal=True, key_padding_mask=key_padding_mask).long()
    rows = torch.arange(40, device=DEVICE)[:, None]
    assert ((got <= rows) | (got == -1)).all()
    assert not ((got >= 5) & (got < 9)).any()
    assert (got[0, :, 0, 1:] == -1).all() and (got[0, :, 0, 0] == 0).all()


def test_topk_select_ties_take_smaller_positions_via_overflow_fallback():
    """Constant inputs: every key ties, the candidate list overflows and the exact kernel runs."""
    q, k = torch.ones(1, 1, 80, 4, device=DEVICE), torch.ones(1, 1, 80, 4, device=DEVICE)
    got = topk_select(q, k, 3, causal=False)
    assert (got == torch.tensor([0, 1, 2], dtype=torch.int32, device=DEVICE)).all()


def test_topk_select_fp16_picks_the_largest_scores():
    q = torch.randn(1, 2, 50, 16, device=DEVICE).half()
    k = torch.randn(1, 2, 50, 16, device=DEVICE).half()
    got = topk_select(q, k, 7, causal=True).long()
    scores = (q.float() @ k.float().transpose(-1, -2)).masked_fill(
        torch.ones(50, 50, dtype=torch.bool, device=DEVICE).triu(1), float("-inf")
    )
    best = scores.topk(7, dim=-1).values
    best = best.masked_fill(torch.isinf(best), 0)  # early rows have fewer than 7 keys
    picked = torch.gather(scores, -1, got.clamp_min(0)).masked_fill(got < 0, 0)
    assert torch.allclose(picked.sum(-1), best.sum(-1), atol=1e-3)


def test_topk_select_large_k_uses_torch_path_and_validates():
    q, k = torch.randn(1, 1, 9, 4, device=DEVICE), torch.randn(1, 1, 200, 4, device=DEVICE)
    assert torch.equal(topk_select(q, k, 150), topk_select_torch(q, k, 150))
    by_position = topk_select(q, k, 150, order="position")
    assert torch.equal(by_position, topk_select_torch(q, k, 150).sort(-1).values)
    with pytest.raises(ValueError, match="kk"):
        topk_select(q, k, 0)
    with pytest.raises(ValueError, match="order must be 'score' or 'position', got 'rank'"):
        topk_select(q, k, 3, order="rank")


def test_position_order_lists_the_same_keys_ascending_with_minus_one_last():
    """The reference's position order is the score order's keys sorted, -1 after the keys."""
    q, k = torch.randn(1, 2, 30, 4, device=DEVICE), torch.randn(1, 1, 30, 4, device=DEVICE)
    best_first = topk_select_torch(q, k, 6, causal=True)
    by_position = topk_select_torch(q, k, 6, causal=True, order="position")
    assert (best_first[0, :, 2, 3:] == -1).all() and not (by_position[0, :, 2, :3] == -1).any()
    assert (by_position[..., :-1] <= by_position[..., 1:]).logical_or(by_position[..., 1:] == -1).all()
    assert torch.equal(by_position.sort(-1).values, best_first.sort(-1).values)


@pytest.mark.parametrize(
    "tiles,kk,causal",
    [
        ({"bound": {"BLOCK_N": 64}, "collect": {"BLOCK_M": 16}, "finish": {"BLOCK_M": 8}}, 4, True),
        ({"bound": {"BLOCK_M": 16, "BLOCK_N": 32}, "collect": {"BLOCK_M": 64}}, 16, False),
    ],
)
@pytest.mark.parametrize("order", ["score", "position"])
def test_topk_select_tile_shapes_and_top1_bound(monkeypatch, tiles, kk, causal, order):
    """Other row tiles and the top-1 bound (kk=4 with 64 column classes) select exactly what
    PyTorch selects; GQA, causal and not."""
    monkeypatch.setattr(topk_select_module, "TILE_OVERRIDES", tiles)
    q, k = torch.randn(1, 2, 150, 6, device=DEVICE), torch.randn(1, 1, 150, 6, device=DEVICE)
    got = topk_select(q, k, kk, causal=causal, order=order)
    assert torch.equal(got, topk_select_torch(q, k, kk, causal=causal, order=order))


def test_topk_select_keys_on_the_sign_bit_of_a_mask_word():
    """Keys 31, 63, 95 (bit 31 of their 32-key mask words) are the best keys of every row."""
    q = torch.randn(1, 1, 100, 4, device=DEVICE).abs() + 0.1
    k = torch.randn(1, 1, 100, 4, device=DEVICE) * 0.01
    k[0, 0, [31, 63, 95]] = torch.tensor([3.0, 2.0, 1.0], device=DEVICE)[:, None]
    got = topk_select(q, k, 5, causal=False)
    assert (got[..., :3] == torch.tensor([31, 63, 95], dtype=torch.int32, device=DEVICE)).all()
    assert torch.equal(got, topk_select_torch(q, k, 5))


def test_topk_select_reports_overflow_rows_and_the_bound_never_exceeds_the_kth_score():
    """The candidate counts are at least kk (the bound is a lower bound), at most a small
    multiple of kk on random data, and constant inputs overflow (count > CAP)."""
    q, k = torch.randn(1, 2, 120, 8, device=DEVICE), torch.randn(1, 2, 120, 8, device=DEVICE)
    _, count = topk_select_module._launch(q, k, 8, True, None)
    rows = torch.arange(120, device=DEVICE)
    assert (count >= torch.clamp(rows + 1, max=8)).all() and (count <= 16).all()
    _, count = topk_select_module._launch(torch.ones_like(q), torch.ones_like(k), 8, False, None)
    assert (count > 16).all()


@pytest.mark.parametrize("causal,padded", [(False, False), (True, True)])
@pytest.mark.parametrize("order", ["score", "position"])
def test_overflowing_rows_are_redone_exactly_on_the_device(causal, padded, order):
    """Small integer inputs (exact scores in every path) with 50 copies of one key: rows that
    rank the copy high list more than CAP candidates and the exact kernel redoes them (tiles mix
    such rows with others); every row equals PyTorch's selection, ties at the kk-th score going
    to the smaller positions."""
    q = torch.randint(-2, 3, (1, 2, 70, 6), device=DEVICE).float()
    k = torch.randint(-2, 3, (1, 1, 70, 6), device=DEVICE).float()
    k[:, :, 20:] = k[:, :, 20:21]
    key_padding_mask = torch.rand(1, 70, device=DEVICE) > 0.2 if padded else None
    _, count = topk_select_module._launch(q, k, 8, causal, key_padding_mask, order == "position")
    overflow = count > 16  # CAP = 2 * next_pow2(8)
    assert overflow.any() and (~overflow).any()
    got = topk_select(q, k, 8, causal=causal, key_padding_mask=key_padding_mask, order=order)
    want = topk_select_torch(q, k, 8, causal=causal, key_padding_mask=key_padding_mask, order=order)
    assert torch.equal(got, want)


def test_topk_select_torch_listed_rows_equal_the_full_selection():
    q, k = torch.randn(2, 2, 30, 4, device=DEVICE), torch.randn(2, 1, 30, 4, device=DEVICE)
    rows = torch.tensor([0, 7, 31, 100, 119], device=DEVICE)
    full = topk_select_torch(q, k, 4, causal=True)
    assert torch.equal(topk_select_torch(q, k, 4, causal=True, rows=rows), full.reshape(-1, 4)[rows])


def test_topk_select_op_passes_opcheck():
    """Schema, fake (meta) implementation and dispatch of the registered op agree with the kernel."""
    q, k = torch.randn(1, 2, 20, 4, device=DEVICE), torch.randn(1, 1, 20, 4, device=DEVICE)
    key_padding_mask = torch.rand(1, 20, device=DEVICE) > 0.3
    for by_position in (False, True):
        torch.library.opcheck(torch.ops.sparsefocus.topk_select.default, (q, k, 3, True, key_padding_mask, by_position))


def test_topk_triton_path_with_padding_equals_lean():
    """The Triton path attends over the selection as is (it never lists a padded key): the same
    outputs and gradients as the lean path, GQA, causal, with padded keys in one batch row."""
    from sparsefocus.attention import sparse_attention

    q = torch.randn(2, 4, 37, 8, device=DEVICE, requires_grad=True)
    k = torch.randn(2, 2, 37, 8, device=DEVICE, requires_grad=True)
    v = torch.randn(2, 2, 37, 6, device=DEVICE, requires_grad=True)
    padding = torch.ones(2, 37, dtype=torch.bool, device=DEVICE)
    padding[1, 3:9] = False
    grad_out = torch.randn(2, 4, 37, 6, device=DEVICE)
    outs = []
    for impl in ("triton", "lean"):
        out = sparse_attention(q, k, v, "TOPK:5", causal=True, key_padding_mask=padding, impl=impl)
        outs.append([out] + list(torch.autograd.grad(out, (q, k, v), grad_out)))
    for name, got, want in zip(["out", "dq", "dk", "dv"], *outs):
        assert torch.allclose(got, want, atol=1e-5, rtol=1e-4), name

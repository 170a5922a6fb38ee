"""The one-launch top-k selection of short rows (at most ``SHORT_MAX_M`` keys) against the
PyTorch selection: exact positions with the same tie rule, causal and padded keys never chosen,
-1 for rows with fewer allowed keys, GQA, and the op's registration (opcheck)."""

import pytest
import torch

from sparsefocus.kernels import topk_select as topk_select_module
from sparsefocus.kernels.topk_select import topk_select, topk_select_torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture
def launches(monkeypatch):
    """Which launcher each selection used."""
    used = []
    for name in ("_launch_short", "_launch"):
        original = getattr(topk_select_module, name)

        def spy(*args, _original=original, _name=name, **kwargs):
            used.append(_name)
            return _original(*args, **kwargs)

        monkeypatch.setattr(topk_select_module, name, spy)
    return used


@pytest.mark.parametrize(
    "n,m,kk,causal,padded",
    [
        (1, 1, 1, True, False),
        (7, 7, 3, True, False),
        (37, 45, 5, False, False),  # the paper's ListOps shape in small: 45 keys, 5 kept
        (63, 63, 5, True, False),
        (100, 37, 8, False, True),
        (33, 100, 32, True, True),
    ],
)
@pytest.mark.parametrize("order", ["score", "position"])
def test_short_rows_select_what_torch_selects(n, m, kk, causal, padded, order, launches):
    q = torch.randn(2, 4, n, 5, device=DEVICE)
    k = torch.randn(2, 2, m, 5, device=DEVICE)
    key_padding_mask = torch.rand(2, m, device=DEVICE) > 0.3 if padded else None
    got = topk_select(q, k, kk, causal=causal, key_padding_mask=key_padding_mask, order=order)
    assert launches == ["_launch_short"]
    assert got.shape == (2, 4, n, kk) and got.dtype == torch.int32
    want = topk_select_torch(q, k, kk, causal=causal, key_padding_mask=key_padding_mask, order=order)
    assert torch.equal(got, want)


def test_short_rows_break_ties_by_position_and_fill_minus_one(launches):
    q, k = torch.ones(1, 1, 20, 4, device=DEVICE), torch.ones(1, 1, 20, 4, device=DEVICE)
    got = topk_select(q, k, 3, causal=True)
    assert launches == ["_launch_short"]
    assert got[0, 0, 0].tolist() == [0, -1, -1] and got[0, 0, 1].tolist() == [0, 1, -1]
    assert (got[0, 0, 2:] == torch.tensor([0, 1, 2], dtype=torch.int32, device=DEVICE)).all()
    assert torch.equal(topk_select(q, k, 3, causal=True, order="position"), got)  # ties: already ascending


def test_short_rows_in_position_order_where_the_best_keys_come_last(launches):
    """Scores rising with the position: best first is descending, position order ascending."""
    q = torch.ones(1, 1, 4, 2, device=DEVICE)
    k = torch.stack([torch.arange(50, device=DEVICE) / 50, torch.zeros(50, device=DEVICE)], -1)[None, None]
    assert topk_select(q, k, 4)[0, 0, 0].tolist() == [49, 48, 47, 46]
    assert topk_select(q, k, 4, order="position")[0, 0, 0].tolist() == [46, 47, 48, 49]
    assert launches == ["_launch_short"] * 2


def test_long_rows_and_large_k_keep_the_sweep_kernels(monkeypatch, launches):
    monkeypatch.setattr(topk_select_module, "SHORT_MAX_M", 16)
    q, k = torch.randn(1, 1, 9, 4, device=DEVICE), torch.randn(1, 1, 40, 4, device=DEVICE)
    assert torch.equal(topk_select(q, k, 4), topk_select_torch(q, k, 4))
    monkeypatch.setattr(topk_select_module, "SHORT_MAX_M", 1024)
    monkeypatch.setattr(topk_select_module, "SHORT_MAX_K", 2)
    assert torch.equal(topk_select(q, k, 4), topk_select_torch(q, k, 4))
    assert launches == ["_launch", "_launch"]


def test_short_rows_op_passes_opcheck():
    q, k = torch.randn(1, 2, 20, 4, device=DEVICE), torch.randn(1, 1, 20, 4, device=DEVICE)
    key_padding_mask = torch.rand(1, 20, device=DEVICE) > 0.3
    for by_position in (False, True):
        torch.library.opcheck(torch.ops.sparsefocus.topk_select.default, (q, k, 3, True, key_padding_mask, by_position))


@pytest.mark.parametrize("m", [601, topk_select_module.SHORT_MAX_M])
def test_the_longest_short_rows_at_a_wide_head(m, launches):
    """A [BN, 64] fp32 key tile at BN = 1024 would not fit in shared memory: the kernel sums the
    scores over slices of dimensions; the ListOps rows (about 600 keys, D = 64) are of this size."""
    q = torch.randn(1, 2, 19, 64, device=DEVICE)
    k = torch.randn(1, 1, m, 64, device=DEVICE)
    got = topk_select(q, k, 5, causal=False)
    assert launches == ["_launch_short"]
    assert torch.equal(got, topk_select_torch(q, k, 5, causal=False))


@pytest.mark.parametrize("n,m,causal,padded", [(45, 601, False, False), (70, 200, False, True), (90, 90, True, False)])
def test_16_bit_rows_select_the_largest_fp32_scores(n, m, causal, padded, launches):
    """bf16 on CUDA (fp16 in the interpreter, which has no bf16): the products of 16-bit q and k
    are exact in fp32, so the chosen keys carry the kk largest allowed fp32 scores of the fp32
    copies; keys closer than summation-order rounding may swap places, so scores are compared."""
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float16
    q = torch.randn(2, 2, n, 64, device=DEVICE).to(dtype)
    k = torch.randn(2, 1, m, 64, device=DEVICE).to(dtype)
    key_padding_mask = torch.rand(2, m, device=DEVICE) > 0.3 if padded else None
    got = topk_select(q, k, 5, causal=causal, key_padding_mask=key_padding_mask)
    assert launches == ["_launch_short"]
    scores = torch.matmul(q.float(), k.float().expand(-1, 2, -1, -1).transpose(-1, -2))  # [2, 2, n, m]
    allowed = (
        torch.ones(n, m, dtype=torch.bool, device=DEVICE).tril() if causal else torch.ones(n, m, dtype=torch.bool, device=DEVICE)
    )
    if padded:
        allowed = allowed & key_padding_mask[:, None, None, :]
    scores = scores.masked_fill(~allowed, float("-inf"))
    best = scores.topk(5, dim=-1).values  # [2, 2, n, 5], -inf where a row has fewer allowed keys
    chosen = scores.gather(-1, got.long().clamp_min(0)).masked_fill(got < 0, float("-inf"))
    torch.testing.assert_close(chosen, best, atol=1e-4, rtol=1e-5)
    listed = got.masked_fill(got < 0, m).sort(dim=-1).values  # -1 slots last
    assert ((listed.diff(dim=-1) > 0) | (listed[..., 1:] == m)).all()  # distinct keys


@pytest.mark.parametrize("kk", [3, 5, 32])
def test_short_rows_merge_tiles_that_keep_improving_and_repeat(kk, launches):
    """Scores rising with the position (every key tile displaces all kept keys) and a pattern
    repeated in every key tile (each tile ties the kept scores, so the earlier keys must stay):
    both the worst-entry replacement and the tie rule across tiles of the one-sweep merge."""
    m = 70
    q = torch.ones(1, 1, 9, 2, device=DEVICE)
    rising = torch.stack([torch.arange(m, device=DEVICE) / m, torch.zeros(m, device=DEVICE)], -1)[None, None]
    repeated = torch.stack([(torch.arange(m, device=DEVICE) % 7).float(), torch.zeros(m, device=DEVICE)], -1)[None, None]
    for k in (rising, repeated, -rising):
        got = topk_select(q, k, kk)
        assert torch.equal(got, topk_select_torch(q, k, kk))
    assert launches == ["_launch_short"] * 3

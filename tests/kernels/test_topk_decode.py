"""The split-key top-k selection of decoding rows against the PyTorch selection of the same
bottom-right rows: the kk largest allowed scores, ties by position, -1 past a row's allowed keys,
GQA, key padding, and the op's registration (opcheck). On CPU the kernel runs in Triton's
interpreter (tests/conftest.py)."""

import pytest
import torch

from sparsefocus.kernels.topk_decode import topk_decode_select

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _allowed(n, m, causal, key_padding_mask):
    """[B or 1, 1, N, M] keys each bottom-right row may choose."""
    query_pos = torch.arange(m - n, m, device=DEVICE)
    allowed = (
        torch.arange(m, device=DEVICE)[None, :] <= query_pos[:, None]
        if causal
        else torch.ones(n, m, dtype=torch.bool, device=DEVICE)
    )
    allowed = allowed[None, None]
    return allowed & key_padding_mask[:, None, None, :] if key_padding_mask is not None else allowed


@pytest.mark.parametrize(
    "n,m,kk,causal,padded",
    [(1, 150, 5, True, False), (3, 97, 8, True, True), (2, 40, 32, False, False), (4, 33, 6, True, True), (5, 7, 6, True, False)],
)
def test_decoding_rows_get_their_largest_allowed_scores(n, m, kk, causal, padded):
    q = torch.randn(2, 4, n, 20, device=DEVICE)
    k = torch.randn(2, 2, m, 20, device=DEVICE)
    key_padding_mask = torch.rand(2, m, device=DEVICE) > 0.4 if padded else None
    got = topk_decode_select(q, k, kk, causal=causal, key_padding_mask=key_padding_mask)
    assert got.shape == (2, 4, n, kk) and got.dtype == torch.int32
    scores = torch.matmul(q, k.repeat_interleave(2, dim=1).transpose(-1, -2))  # [2, 4, n, m]: head h reads kv head h // 2
    scores = scores.masked_fill(~_allowed(n, m, causal, key_padding_mask), float("-inf"))
    best = scores.topk(kk, dim=-1).values
    chosen = scores.gather(-1, got.long().clamp_min(0)).masked_fill(got < 0, float("-inf"))
    torch.testing.assert_close(chosen, best, atol=1e-5, rtol=1e-5)
    listed = got.masked_fill(got < 0, m).sort(dim=-1).values  # -1 slots last
    assert ((listed.diff(dim=-1) > 0) | (listed[..., 1:] == m)).all()  # distinct keys


def test_ties_go_to_smaller_positions_and_short_rows_fill_minus_one():
    q, k = torch.ones(1, 1, 2, 4, device=DEVICE), torch.ones(1, 1, 70, 4, device=DEVICE)
    got = topk_decode_select(q, k, 3)
    assert got[0, 0].tolist() == [[0, 1, 2], [0, 1, 2]]
    padding = torch.zeros(1, 70, dtype=torch.bool, device=DEVICE)
    padding[0, [5, 69]] = True
    got = topk_decode_select(q, k, 3, key_padding_mask=padding)
    assert got[0, 0].tolist() == [[5, -1, -1], [5, 69, -1]]  # the rows sit at positions 68 and 69


def test_bad_calls_are_refused():
    q, k = torch.randn(1, 2, 1, 8, device=DEVICE), torch.randn(1, 1, 10, 8, device=DEVICE)
    with pytest.raises(ValueError, match="kk must be in"):
        topk_decode_select(q, k, 65)
    with pytest.raises(ValueError, match="incompatible"):
        topk_decode_select(q, k[..., :4], 3)


def test_the_op_passes_opcheck():
    q, k = torch.randn(1, 2, 2, 8, device=DEVICE), torch.randn(1, 1, 50, 8, device=DEVICE)
    key_padding_mask = torch.rand(1, 50, device=DEVICE) > 0.3
    torch.library.opcheck(torch.ops.sparsefocus.topk_decode_select.default, (q, k, 4, True, key_padding_mask))


def test_a_prefix_of_a_longer_cache_is_read_in_place():
    """k a view of the first keys of a longer cache (the chunks of decode rows): the same result as
    the contiguous copy."""
    q, cache = torch.randn(2, 4, 3, 16, device=DEVICE), torch.randn(2, 2, 90, 16, device=DEVICE)
    prefix = cache[:, :, :61]
    assert not prefix.is_contiguous()
    assert torch.equal(topk_decode_select(q, prefix, 7), topk_decode_select(q, prefix.contiguous(), 7))

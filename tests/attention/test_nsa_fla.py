"""``nsa`` against fla-core's NSA references (``fla.ops.nsa.naive``, an independent implementation
of the paper): the block choice, the selection branch over given blocks and the compressed branch,
at an odd length with GQA, where the two layouts agree (compression window = stride = selection
block, mean pooling, first block plus the current and previous ones forced). Skipped without
fla-core (``pip install fla-core==0.6.0 einops``)."""

import pytest
import torch

naive = pytest.importorskip("fla.ops.nsa.naive", reason="needs fla-core (pip install fla-core einops)")

from sparsefocus.attention import parse_pattern  # noqa: E402
from sparsefocus.attention.common import dense_masked_attention, expand_kv, row_slice  # noqa: E402
from sparsefocus.attention.nsa import compress, compressed_visible  # noqa: E402

BLOCK, TOP, N, Q_HEADS, KV_HEADS, DIM = 8, 4, 45, 4, 2, 16


def _case(seed: int):
    torch.manual_seed(seed)
    q = torch.randn(2, Q_HEADS, N, DIM)
    k, v = torch.randn(2, KV_HEADS, N, DIM), torch.randn(2, KV_HEADS, N, DIM)
    spec = parse_pattern(f"nsa:block={BLOCK},top={TOP},cmp={BLOCK},stride={BLOCK},window=0")
    ck, _ = compress(k, None, BLOCK, BLOCK, None)  # [B, Hk, Nc, D]
    cv, _ = compress(v, None, BLOCK, BLOCK, None)
    return spec, q, k, v, ck, cv, DIM**-0.5


def _lse(q, ck, scale):
    visible = compressed_visible(row_slice(N), ck.shape[2], BLOCK, BLOCK, True, q.device)
    scores = (q @ expand_kv(ck, Q_HEADS).transpose(-1, -2)) * scale
    return torch.logsumexp(scores.masked_fill(~visible, float("-inf")), dim=-1)  # [B, Hq, N]


def _bthd(x):
    return x.transpose(1, 2).contiguous()  # [B, H, N, D] -> [B, N, H, D]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_block_choice_matches_fla(seed):
    """The same block sets (order aside) for every query whose own block is complete. In the last,
    partial block (positions 40-44 of 45) fla ranks only complete blocks, so it cannot force the
    query's own block; ``nsa`` does, as the paper forces the current block."""
    spec, q, _, _, ck, _, scale = _case(seed)
    ours = spec.selected_blocks(q, ck, _lse(q, ck, scale), None, True, scale).long()  # [B, Hk, N, top]
    theirs = naive.naive_nsa_topk(_bthd(q), _bthd(ck), TOP, BLOCK, scale)  # [B, N, Hk, top]
    ours_sets = ours.permute(0, 2, 1, 3).sort(-1).values
    theirs_sets = theirs.sort(-1).values
    complete = (N // BLOCK) * BLOCK
    assert torch.equal(ours_sets[:, :complete], theirs_sets[:, :complete])
    own = torch.arange(complete, N) // BLOCK
    assert bool((ours_sets[:, complete:] == own[None, :, None, None]).any(-1).all())
    assert not bool((theirs_sets[:, complete:] == own[None, :, None, None]).any(-1).any())


def test_selection_branch_matches_fla_on_the_same_blocks():
    spec, q, k, v, ck, _, scale = _case(3)
    blocks = spec.selected_blocks(q, ck, _lse(q, ck, scale), None, True, scale)  # [B, Hk, N, top]
    mask = spec._selection_mask(blocks, Q_HEADS // KV_HEADS, N, True, row_slice(N))
    ours = dense_masked_attention(q, expand_kv(k, Q_HEADS), expand_kv(v, Q_HEADS), mask, scale)
    theirs = naive.naive_nsa_selection(_bthd(q), _bthd(k), _bthd(v), blocks.permute(0, 2, 1, 3).long(), BLOCK, scale)
    torch.testing.assert_close(_bthd(ours), theirs, rtol=1e-5, atol=1e-5)


def test_compressed_branch_matches_fla():
    _, q, _, _, ck, cv, scale = _case(4)
    visible = compressed_visible(row_slice(N), ck.shape[2], BLOCK, BLOCK, True, q.device)
    ours = dense_masked_attention(q, expand_kv(ck, Q_HEADS), expand_kv(cv, Q_HEADS), visible, scale)  # [B, Hq, N, D]
    theirs, lse = naive.naive_nsa_compression(_bthd(q), _bthd(ck), _bthd(cv), BLOCK, scale)
    seen = visible.any(-1)  # rows before the first complete block see no summary
    torch.testing.assert_close(_bthd(ours)[:, seen], theirs[:, seen], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(_lse(q, ck, scale)[..., seen], lse.transpose(1, 2)[..., seen], rtol=1e-5, atol=1e-5)
    assert bool(theirs[:, ~seen].eq(0).all())

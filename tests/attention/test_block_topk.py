"""Block top-k selection (NSA / MoBA / Quest): hand-made selections, own block, equivalences."""

import pytest
import torch

import sparsefocus as sf
from block_sparse_checks import impl_device
from pattern_checks import assert_equals_full, random_qk


def _kept_blocks(mask_row, block):
    """Sorted block ids that have at least one kept key in a [M] bool row."""
    return sorted({int(j) // block for j in mask_row.nonzero().flatten()})


def _hand_made_keys():
    """Four blocks of two 2-d keys with means (1,0), (0,1), (3,0), (-1,-1): [1, 1, 8, 2]."""
    keys = [[1, 0], [1, 0], [0, 1], [0, 1], [2, 0], [4, 0], [-1, -1], [-1, -1]]
    return torch.tensor(keys, dtype=torch.float32)[None, None]


def test_mean_pool_selects_the_blocks_with_highest_mean_scores():
    k = _hand_made_keys()
    q = torch.tensor([1.0, 0.5]).expand(1, 1, 8, 2)
    one = sf.selection_mask("block_topk:block=2,top=1", q, k)[0, 0]
    two = sf.selection_mask("block_topk:block=2,top=2", q, k)[0, 0]
    # Scores of q=(1, .5) against the means: 1, .5, 3, -1.5.
    assert _kept_blocks(one[0], 2) == [0, 2]
    assert _kept_blocks(one[4], 2) == [0, 2]  # own block 2 plus the best other one, block 0
    assert _kept_blocks(two[6], 2) == [0, 2, 3]
    assert _kept_blocks(two[2], 2) == [0, 1, 2]


def test_minmax_pool_uses_quests_upper_bound_not_the_mean():
    # Block 1 = {(0,0), (4,0)}: mean 2, bound 4. Block 2 = {(3,0), (3,0)}: mean 3, bound 3.
    k = torch.tensor([[0, 0], [0, 0], [0, 0], [4, 0], [3, 0], [3, 0]], dtype=torch.float32)[None, None]
    q = torch.tensor([1.0, 0.0]).expand(1, 1, 6, 2)
    mean = sf.selection_mask("block_topk:block=2,top=1,pool=mean", q, k)[0, 0, 0]
    minmax = sf.selection_mask("block_topk:block=2,top=1,pool=minmax", q, k)[0, 0, 0]
    assert _kept_blocks(mean, 2) == [0, 2]
    assert _kept_blocks(minmax, 2) == [0, 1]


def test_minmax_bound_uses_min_for_negative_query_components():
    k = torch.tensor([[0, 0], [0, 0], [-5, 0], [1, 0], [-2, 0], [-2, 0]], dtype=torch.float32)[None, None]
    q = torch.tensor([-1.0, 0.0]).expand(1, 1, 6, 2)
    # For q=(-1, 0) the bound is -min: block 1 gives 5, block 2 gives 2.
    minmax = sf.selection_mask("block_topk:block=2,top=1,pool=minmax", q, k)[0, 0, 0]
    assert _kept_blocks(minmax, 2) == [0, 1]


@pytest.mark.parametrize("causal", [False, True])
def test_top_covering_every_block_is_full(causal):
    q, k = random_qk(30)
    v = torch.randn(2, 2, 30, 5)
    spec = "block_topk:block=4,top=8"
    assert_equals_full(spec, q, k, v, causal)


@pytest.mark.parametrize("causal", [False, True])
def test_own_block_is_always_kept_and_top_zero_is_block_local(causal):
    q, k = random_qk(30, seed=1)
    for top in (0, 1, 3):
        mask = sf.selection_mask(f"block_topk:block=4,top={top}", q, k, causal=causal)
        bloc = sf.selection_mask("BLOC:4", q, k, causal=causal)
        assert not (bloc & ~mask).any()
        if top == 0:
            assert torch.equal(mask, bloc)


def test_every_row_keeps_own_block_plus_exactly_top_blocks_when_enough_candidates():
    q, k = random_qk(40, seed=2)
    mask = sf.selection_mask("block_topk:block=5,top=3", q, k)
    per_block = mask.reshape(2, 2, 40, 8, 5).any(-1).sum(-1)  # [B, H, N] kept blocks
    assert torch.equal(per_block, torch.full_like(per_block, 4))


def test_causal_selection_reads_no_key_of_the_own_or_later_blocks():
    q, k = random_qk(40, seed=3)
    spec = "block_topk:block=8,top=2,pool=minmax"
    before = sf.selection_mask(spec, q, k, causal=True)
    k2 = k.clone()
    k2[:, :, 21:] = torch.randn_like(k2[:, :, 21:]) * 10  # cut in the middle of block 2 = [16, 24)
    after = sf.selection_mask(spec, q, k2, causal=True)
    assert torch.equal(after[:, :, :21], before[:, :, :21])


def test_padded_keys_do_not_enter_the_block_summaries():
    k = _hand_made_keys()
    k[0, 0, 3] = torch.tensor([100.0, 0.0])  # would make block 1 the best by mean
    q = torch.tensor([1.0, 0.5]).expand(1, 1, 8, 2)
    padding = torch.ones(1, 8, dtype=torch.bool)
    padding[0, 3] = False
    mask = sf.selection_mask("block_topk:block=2,top=1", q, k, key_padding_mask=padding)[0, 0]
    assert _kept_blocks(mask[0], 2) == [0, 2]
    assert not mask[:, 3].any()


@pytest.mark.parametrize(
    "spec, word",
    [("block_topk:block=0", "block"), ("block_topk:top=-1", "top"), ("block_topk:pool=max", "pool")],
)
def test_bad_parameters_raise_naming_the_parameter(spec, word):
    with pytest.raises(ValueError, match=word):
        sf.parse_pattern(spec)


def _leaves(*tensors):
    return [x.detach().clone().requires_grad_() for x in tensors]


def _out_and_grads(pattern, impl, q, k, v, padding=None, causal=True, grad_rows=None):
    """[out, dq, dk, dv] on the CPU; the Triton path runs on CUDA where there is one."""
    device = impl_device(impl)
    q, k, v = _leaves(q.to(device), k.to(device), v.to(device))
    padding = None if padding is None else padding.to(device)
    out = sf.sparse_attention(q, k, v, pattern, causal=causal, key_padding_mask=padding, impl=impl)
    weight = torch.cos(torch.arange(out.numel(), dtype=torch.float32)).reshape(out.shape).to(device)
    if grad_rows is not None:
        weight[:, :, grad_rows:] = 0
    return [t.cpu() for t in (out, *torch.autograd.grad((out.float() * weight).sum(), (q, k, v)))]


@pytest.mark.parametrize("pattern", ["moba:block=16,top=2,tile=16", "quest:block=16,top=2,tile=32"])
def test_tile_patterns_kernel_matches_reference_with_gqa_and_padding(pattern):
    q, k, v = torch.randn(2, 4, 75, 8), torch.randn(2, 2, 75, 8), torch.randn(2, 2, 75, 5)
    padding = torch.rand(2, 75) > 0.2
    ref = _out_and_grads(pattern, "reference", q, k, v, padding)
    tri = _out_and_grads(pattern, "triton", q, k, v, padding)
    for name, a, b in zip(("out", "dq", "dk", "dv"), ref, tri):
        torch.testing.assert_close(b, a, atol=2e-5, rtol=1e-4, msg=f"{pattern} {name}")


@pytest.mark.parametrize("pattern", ["moba:block=16,top=1,tile=16", "quest:block=8,top=2,tile=16"])
def test_tile_patterns_never_leak_the_future_into_outputs_or_gradients(pattern):
    """Perturbing q, k and v after position 37 changes neither earlier outputs nor the gradients a
    loss on those outputs sends to earlier positions (selection scores included)."""
    cut = 37
    q, k, v = torch.randn(1, 2, 70, 8), torch.randn(1, 2, 70, 8), torch.randn(1, 2, 70, 8)
    q2, k2, v2 = (x.clone() for x in (q, k, v))
    for x in (q2, k2, v2):
        x[:, :, cut:] = torch.randn_like(x[:, :, cut:]) * 5
    before = _out_and_grads(pattern, "triton", q, k, v, grad_rows=cut)
    after = _out_and_grads(pattern, "triton", q2, k2, v2, grad_rows=cut)
    for name, a, b in zip(("out", "dq", "dk", "dv"), before, after):
        torch.testing.assert_close(b[:, :, :cut], a[:, :, :cut], atol=1e-6, rtol=1e-6, msg=f"{pattern} {name}")


def test_tile_selection_scores_the_tile_by_its_pooled_queries():
    """Non-causal, one tile of 16 queries: the tile keeps the block with the best summed score even
    when most single queries prefer another one."""
    k = torch.zeros(1, 1, 48, 2)
    k[0, 0, 16:32] = torch.tensor([1.0, 0.0])
    k[0, 0, 32:48] = torch.tensor([0.0, 1.0])
    q = torch.tensor([0.0, 1.0]).repeat(16, 1)
    q[:5] = torch.tensor([10.0, 0.0])  # 5 queries with a strong pull to block 1 outweigh 11 weak ones
    q = q[None, None]
    mask = sf.selection_mask("moba:block=16,top=1,tile=16", q, k[:, :, :48])
    assert _kept_blocks(mask[0, 0, 15], 16) == [0, 1]


@pytest.mark.parametrize("causal", [True, False])
def test_pooled_tile_queries_sum_exactly_the_scoring_queries(causal):
    """Odd N (a short last tile): causal tiles sum the ``tile`` queries ending at their first
    position (fewer at the start), others sum their own queries; positive and negative parts apart."""
    from sparsefocus.attention.block_topk import pooled_tile_queries

    q = torch.randn(2, 3, 77, 5)
    pos, neg = pooled_tile_queries(q, 16, causal)
    assert pos.shape == neg.shape == (2, 3, 5, 5) and pos.dtype == torch.float32
    low = q.bfloat16()  # 16-bit queries are summed in fp32 without an fp32 copy: the same sums
    for a, b in zip(pooled_tile_queries(low, 16, causal), pooled_tile_queries(low.float(), 16, causal)):
        assert a.dtype == torch.float32
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    for t in range(5):
        end = t * 16 + 1 if causal else min(77, t * 16 + 16)
        rows = q[:, :, max(0, end - 16) : end] if causal else q[:, :, t * 16 : end]
        torch.testing.assert_close(pos[:, :, t], rows.clamp_min(0).sum(2), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(neg[:, :, t], rows.clamp_max(0).sum(2), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("pool", ["mean", "minmax"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_full_blocks_summarise_as_the_masked_path(pool, dtype):
    """Whole blocks and no padding take a view of k (no fp32 copy); the summaries equal those of
    the masked path (an all-real padding mask), for fp32 and bf16 keys."""
    from sparsefocus.attention.block_topk import block_summaries

    k = torch.randn(2, 3, 48, 5).to(dtype)
    fast = block_summaries(k, 16, pool, None, 3)
    masked = block_summaries(k, 16, pool, torch.ones(2, 48, dtype=torch.bool), 3)
    for a, b in zip(fast, masked):
        assert a.dtype == b.dtype
        torch.testing.assert_close(a.expand_as(b), b, atol=1e-6, rtol=1e-6)

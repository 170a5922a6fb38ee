"""The Triton block-sparse kernel against ``block_sparse_attention_ref``: outputs, LSE and every
gradient (dq, dk, dv, through the output and the LSE) at odd sizes, both tile kinds, GQA,
Dv != D, padding, windows, strided key positions, empty rows; fp16 within twice PyTorch's own
error; the ops pass ``torch.library.opcheck``. On CPU the kernel runs in Triton's interpreter."""

import pytest
import torch

from sparsefocus.kernels import block_sparse
from sparsefocus.kernels.block_sparse import (
    GROUP_TILE,
    block_sparse_attention,
    block_sparse_attention_ref,
    block_sparse_fwd,
    block_sparse_mask,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    return ((x.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-12)).item()


def random_lists(batch, heads, tiles, n_blocks, slots, unused=0.3):
    """[B, H, T, S] distinct block ids per list, about ``unused`` of the last slot set to -1."""
    ids = torch.rand(batch * heads * tiles, n_blocks, device=DEVICE).argsort(-1)[:, :slots]
    ids = ids.view(batch, heads, tiles, slots).to(torch.int32)
    ids[..., -1] = torch.where(torch.rand(batch, heads, tiles, device=DEVICE) < unused, -1, ids[..., -1])
    return ids


def random_row_bits(blocks, tile):
    """int32 row masks like ``blocks``: each (list, slot) kept by a random subset of the tile's rows."""
    rows = torch.rand(*blocks.shape, tile, device=blocks.device) < 0.5
    weights = torch.tensor([1 << r for r in range(tile)], dtype=torch.int64, device=blocks.device)
    bits = (rows.long() * weights).sum(-1)
    return torch.where(bits >= 2**31, bits - 2**32, bits).to(torch.int32)  # bit 31 as int32's sign bit


def make_case(n=75, block_size=16, tile=GROUP_TILE, group=2, kv_heads=2, dim=24, dim_v=20, slots=3, padded=True, batch=2):
    q = torch.randn(batch, kv_heads * group, n, dim, device=DEVICE)
    k = torch.randn(batch, kv_heads, n, dim, device=DEVICE)
    v = torch.randn(batch, kv_heads, n, dim_v, device=DEVICE)
    heads, tiles = (kv_heads, n) if tile == GROUP_TILE else (kv_heads * group, -(-n // tile))
    blocks = random_lists(batch, heads, tiles, -(-n // block_size), slots)
    padding = (torch.rand(batch, n, device=DEVICE) > 0.2) if padded else None
    return q, k, v, blocks, padding


def run(fn, q, k, v, blocks, dtype, grad_out, grad_lse, **kwargs):
    leaves = [x.to(dtype).requires_grad_() for x in (q, k, v)]
    out, lse = fn(*leaves, blocks, **kwargs)
    finite_lse = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    loss = (out.float() * grad_out).sum() + (finite_lse.float() * grad_lse).sum()
    return [out, finite_lse] + list(torch.autograd.grad(loss, leaves))


def compare(q, k, v, blocks, **kwargs):
    grad_out = torch.randn(*q.shape[:3], v.shape[-1], device=DEVICE)
    grad_lse = torch.randn(*q.shape[:3], device=DEVICE)
    got = run(block_sparse_attention, q, k, v, blocks, torch.float32, grad_out, grad_lse, **kwargs)
    want = run(block_sparse_attention_ref, q, k, v, blocks, torch.float32, grad_out, grad_lse, **kwargs)
    for name, x, y in zip(["out", "lse", "dq", "dk", "dv"], got, want):
        assert torch.isfinite(x).all(), f"{name} has NaN/inf (unwritten output?)"
        assert rel_err(x, y) < 1e-5, f"{name}: relative error {rel_err(x, y):.2e}"
    return got


def test_group_tiles_match_reference_with_gqa_padding_and_causal():
    q, k, v, blocks, padding = make_case(n=45, tile=GROUP_TILE, group=4, kv_heads=1)
    compare(q, k, v, blocks, block_size=16, tile=GROUP_TILE, causal=True, key_padding_mask=padding)


def test_query_tiles_match_reference_with_gqa_and_blocks_of_two_sub_tiles():
    """block_size 80 > 64 keys: every block is read as two sub-tiles of 64, the second one cut."""
    q, k, v, blocks, padding = make_case(n=170, block_size=80, tile=16, group=2, kv_heads=1, slots=2)
    compare(q, k, v, blocks, block_size=80, tile=16, causal=True, key_padding_mask=padding)


@pytest.mark.parametrize("tile", [16, 32])
def test_row_bits_give_each_row_of_a_tile_its_own_blocks(tile):
    """A tile lists the union of its rows' blocks; row r keeps slot s where bit r is set (bit 31
    included, at tile 32), with GQA, padding and causal; every gradient against the reference."""
    q, k, v, blocks, padding = make_case(n=77, block_size=8, tile=tile, group=2, kv_heads=1, slots=6)
    bits = random_row_bits(blocks, tile)
    compare(q, k, v, blocks, block_size=8, tile=tile, causal=True, key_padding_mask=padding, row_bits=bits)
    mask = block_sparse_mask(q, k, blocks, 8, tile, False, None, 0, 1, 0, bits)
    plain = block_sparse_mask(q, k, blocks, 8, tile, False, None, 0, 1, 0)
    assert (mask <= plain).all() and (mask < plain).any()  # the bits only remove rows' blocks


def test_row_bits_are_checked():
    q, k, v, blocks, _ = make_case(n=40, tile=16, group=1, kv_heads=1, padded=False)
    with pytest.raises(ValueError, match="row_bits"):
        block_sparse_attention(q, k, v, blocks, block_size=16, tile=16, row_bits=random_row_bits(blocks, 16).long())
    wide = blocks[:, :, :1]  # one tile of 64 rows: more rows than an int32 has bits
    with pytest.raises(ValueError, match="row_bits"):
        block_sparse_attention(q, k, v, wide, block_size=16, tile=64, row_bits=random_row_bits(wide, 16))


def test_window_and_strided_key_positions_match_reference():
    """NSA's compressed keys: key j sits at position 2 j + 7; a window of 20 on top of causal."""
    q, k, v, blocks, _ = make_case(n=37, tile=GROUP_TILE, group=1, kv_heads=1, padded=False, batch=1)
    compare(q, k, v, blocks, block_size=16, tile=GROUP_TILE, causal=True, window=20, key_stride=2, key_offset=7)


def test_unused_slots_anywhere_in_a_list_are_skipped():
    """-1 before used slots (the kernel reads up to a list's last used slot), and lists of -1 only."""
    q, k, v, blocks, padding = make_case(n=70, tile=16, group=2, kv_heads=1, slots=3)
    blocks[:, :, ::2, 0] = -1
    blocks[:, :, 1] = -1
    compare(q, k, v, blocks, block_size=16, tile=16, causal=True, key_padding_mask=padding)


def test_list_ends_found_over_several_chunks_of_slots(monkeypatch):
    """A list longer than the slots a kernel reads at once (here 16 of 40) ends where its last used
    slot is, wherever that is; every gradient against the reference."""
    monkeypatch.setattr(block_sparse, "LIST_END_SLOTS", 16)
    q, k, v, blocks, padding = make_case(n=330, block_size=8, tile=16, group=1, kv_heads=1, slots=40, batch=1)
    blocks[:, :, 0, 20:] = -1  # ends in the second chunk
    blocks[:, :, 1, :-1] = -1  # only the very last slot used
    blocks[:, :, 2, 16:] = -1  # ends exactly at a chunk's edge
    compare(q, k, v, blocks, block_size=8, tile=16, causal=True, key_padding_mask=padding)


def test_rows_without_keys_are_zero_and_lse_minus_inf():
    q, k, v, blocks, _ = make_case(n=40, tile=16, group=1, kv_heads=1, padded=False)
    blocks[:, :, 0] = -1  # the first tile lists nothing
    out, lse = block_sparse_attention(q, k, v, blocks, block_size=16, tile=16)
    assert (out[:, :, :16] == 0).all() and torch.isinf(lse[:, :, :16]).all()
    mask = block_sparse_mask(q, k, blocks, 16, 16, False, None, 0, 1, 0)
    assert mask[:, :, :16].sum() == 0 and mask[:, :, 16:].any()


def busy_lists(batch, heads, tiles, slots, crowd):
    """Distinct ids per list drawn from the first ``crowd`` blocks only: with short items those
    blocks have several further items, and the later blocks none."""
    return random_lists(batch, heads, tiles, crowd, slots)


@pytest.mark.parametrize("entry_rows", [block_sparse.ENTRY_ROWS, 32, 16])
@pytest.mark.parametrize("tile,with_bits", [(GROUP_TILE, False), (16, True), (32, False)])
def test_inverse_lists_kernel_equals_the_torch_sort(monkeypatch, entry_rows, tile, with_bits):
    """The one-program inverse lists (sorted tile codes, items, extra-item offsets, row masks) are
    the stable PyTorch sort's, with unused slots, crowded blocks and items of 1-2 entries."""
    monkeypatch.setattr(block_sparse, "ENTRY_ROWS", entry_rows)
    q, k, v, _, _ = make_case(n=83, block_size=8, tile=tile, group=2, kv_heads=2, slots=5, padded=False)
    heads, tiles = (2, 83) if tile == GROUP_TILE else (4, -(-83 // tile))
    blocks = busy_lists(2, heads, tiles, 5, crowd=6)  # of 11 blocks
    blocks[:, :, 1] = -1  # a list of unused slots only
    bits = random_row_bits(blocks, tile) if with_bits else None
    run = block_sparse._Launch(q, k, v, blocks, 8, tile)
    got = block_sparse.inverse_lists(blocks, run, bits)
    want = block_sparse._inverse_lists_torch(blocks, run, bits)
    assert got[5] == want[5]  # the item count
    for name, x, y in zip(["codes", "item_block", "item_start", "item_end", "xoff", "width", "entry_bits"], got, want):
        if isinstance(x, torch.Tensor):
            assert x.dtype == y.dtype and torch.equal(x, y), name


def test_gradients_through_the_torch_inverse_lists(monkeypatch):
    """Lists longer than ``INVERSE_KERNEL_ENTRIES`` take the PyTorch sort; every gradient still
    matches the reference, with row masks and many short items."""
    monkeypatch.setattr(block_sparse, "INVERSE_KERNEL_ENTRIES", 0)
    monkeypatch.setattr(block_sparse, "ENTRY_ROWS", 32)
    q, k, v, blocks, padding = make_case(n=77, block_size=8, tile=16, group=2, kv_heads=1, slots=6)
    bits = random_row_bits(blocks, 16)
    compare(q, k, v, blocks, block_size=8, tile=16, causal=True, key_padding_mask=padding, row_bits=bits)


def test_gradients_with_many_items_on_the_inverse_kernel(monkeypatch):
    monkeypatch.setattr(block_sparse, "ENTRY_ROWS", 32)  # items of 2 tiles of 16 rows
    q, k, v, _, padding = make_case(n=77, block_size=8, tile=16, group=2, kv_heads=1, slots=6)
    blocks = busy_lists(2, 2, 5, 6, crowd=7)  # of 10 blocks
    compare(q, k, v, blocks, block_size=8, tile=16, causal=True, key_padding_mask=padding)


@pytest.mark.parametrize("tile", [GROUP_TILE, 16])
def test_fp16_within_twice_torch_error(tile):
    """FlashAttention's rule: kernel error vs fp32 <= 2 x PyTorch's error at fp16 (+ eps)."""
    q, k, v, blocks, padding = make_case(n=33, tile=tile, group=2, kv_heads=1, dim=32, dim_v=16, batch=1)
    q, k, v = (x.half().float() for x in (q, k, v))  # the same rounded inputs for all three
    kwargs = {"block_size": 16, "tile": tile, "causal": True, "key_padding_mask": padding}
    grad_out = torch.randn(*q.shape[:3], v.shape[-1], device=DEVICE)
    grad_lse = torch.zeros(*q.shape[:3], device=DEVICE)
    truth = run(block_sparse_attention_ref, q, k, v, blocks, torch.float32, grad_out, grad_lse, **kwargs)
    torch_low = run(dense_low_precision, q, k, v, blocks, torch.float16, grad_out, grad_lse, **kwargs)
    kernel = run(block_sparse_attention, q, k, v, blocks, torch.float16, grad_out, grad_lse, **kwargs)
    for name, x, y, t in zip(["out", "lse", "dq", "dk", "dv"], kernel, torch_low, truth):
        if name == "lse":
            continue
        assert rel_err(x, t) <= 2 * rel_err(y, t) + 1e-4, f"{name}: {rel_err(x, t):.2e} vs torch {rel_err(y, t):.2e}"


def dense_low_precision(q, k, v, blocks, *, block_size, tile, causal, key_padding_mask):
    """The same masked attention done by PyTorch in the inputs' dtype (the error yardstick)."""
    mask = block_sparse_mask(q, k, blocks, block_size, tile, causal, key_padding_mask, 0, 1, 0)
    group = q.shape[1] // k.shape[1]
    scores = (q @ k.repeat_interleave(group, 1).transpose(-1, -2)) * q.shape[-1] ** -0.5
    has_key = mask.any(-1, keepdim=True)
    weights = torch.softmax(scores.masked_fill(~mask, float("-inf")).masked_fill(~has_key, 0), -1) * has_key
    return weights @ v.repeat_interleave(group, 1), torch.logsumexp(scores.masked_fill(~mask, -1e4), -1)


def test_kernel_rejects_bad_lists_and_tiles():
    q, k, v, blocks, _ = make_case(n=20, tile=16, group=1, kv_heads=1, padded=False, slots=2)
    with pytest.raises(ValueError, match="blocks"):
        block_sparse_attention(q, k, v, blocks.float(), block_size=16, tile=16)
    with pytest.raises(ValueError, match="tile"):
        block_sparse_attention(q, k, v, blocks, block_size=16, tile=24)


@pytest.mark.parametrize("with_bits", [False, True])
def test_forward_op_passes_opcheck(with_bits):
    q, k, v, blocks, padding = make_case(n=20, tile=16, group=2, kv_heads=1, dim=16, dim_v=16, slots=2)
    bits = random_row_bits(blocks, 16) if with_bits else None
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    torch.library.opcheck(block_sparse_fwd, (q, k, v, blocks, padding, bits, 16, 16, True, 0.25, 0, 1, 0))


@pytest.mark.parametrize("with_bits", [False, True])
def test_backward_op_passes_opcheck(with_bits):
    from sparsefocus.kernels.block_sparse import block_sparse_bwd

    q, k, v, blocks, padding = make_case(n=20, tile=16, group=2, kv_heads=1, dim=16, dim_v=16, slots=2, batch=1)
    bits = random_row_bits(blocks, 16) if with_bits else None
    out, lse = block_sparse_attention(
        q, k, v, blocks, block_size=16, tile=16, causal=True, key_padding_mask=padding, row_bits=bits
    )
    args = (torch.randn_like(out), q, k, v, out, lse, torch.zeros_like(lse), blocks, padding, bits, 16, 16, True, 0.25, 0, 1, 0)
    torch.library.opcheck(block_sparse_bwd, args, test_utils=("test_schema", "test_faketensor"))


def test_compiles_with_fullgraph_forward_and_backward():
    q, k, v, blocks, _ = make_case(n=20, tile=16, group=1, kv_heads=1, dim=16, dim_v=16, slots=2, padded=False, batch=1)
    q = q.requires_grad_()

    def step(q, k, v, blocks):
        return block_sparse_attention(q, k, v, blocks, block_size=16, tile=16, causal=True)[0].sum()

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    grad = torch.autograd.grad(compiled(q, k, v, blocks), q)[0]
    torch.testing.assert_close(grad, torch.autograd.grad(step(q, k, v, blocks), q)[0])


@pytest.mark.parametrize(
    "q_heads,kv_heads,n,n_cmp,stride,cmp,rows,causal",
    [
        (4, 2, 29, 12, 2, 6, slice(5, 26), True),  # groups of 2 heads: 8 positions a tile
        (1, 1, 70, 30, 2, 4, slice(3, 70), True),  # one head: 16 positions a tile, the last one short
        (3, 1, 23, 7, 3, 3, slice(2, 21), False),  # a group padded to 4 heads
        (16, 1, 9, 4, 2, 2, slice(0, 9), True),  # a group that fills a tile alone
    ],
)
def test_compressed_importance_matches_its_torch_twin(q_heads, kv_heads, n, n_cmp, stride, cmp, rows, causal):
    from sparsefocus.attention.nsa import group_probabilities
    from sparsefocus.kernels.block_sparse import compressed_importance, nsa_importance

    q, ck = torch.randn(2, q_heads, n, 16, device=DEVICE), torch.randn(2, kv_heads, n_cmp, 16, device=DEVICE)
    lse = torch.randn(2, q_heads, n, device=DEVICE) + 3
    lse[0, q_heads - 1, rows.start + 3] = float("-inf")  # a row without visible keys
    real = torch.rand(2, n_cmp, device=DEVICE) > 0.3
    got = compressed_importance(q, ck, lse, real, rows, scale=0.3, stride=stride, cmp=cmp, causal=causal)
    want = group_probabilities(q[:, :, rows], ck, lse[:, :, rows], real, rows, cmp, stride, causal, 0.3)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    count = rows.stop - rows.start
    torch.library.opcheck(nsa_importance, (q, ck, lse, real, rows.start, count, 0.3, stride, cmp, causal))

"""Equal scores go to the smaller position, so a causal row's choice never depends on how many
later positions a call holds: TOPK on every path (the Triton selection's rule) and DSA's indexer,
whose ReLU scores tie at zero all the time."""

import pytest
import torch
from block_sparse_checks import impl_device

import sparsefocus as sf
from sparsefocus.kernels._ops import top_positions
from sparsefocus.attention.dsa import DSA


def test_top_positions_breaks_ties_by_position_and_marks_disallowed_slots():
    scores = torch.tensor([[1.0, 3.0, 3.0, -0.0, 0.0, 3.0], [2.0, 2.0, 2.0, 2.0, 2.0, 2.0]])
    allowed = torch.tensor([[True, True, True, True, True, True], [False, True, False, True, False, False]])
    got = top_positions(scores, 4, allowed)
    assert got.tolist() == [[1, 2, 5, 0], [1, 3, -1, -1]]
    assert top_positions(scores, 6, allowed)[0, 4:].tolist() == [3, 4]  # -0.0 ties with 0.0


@pytest.mark.parametrize("impl", ["reference", "lean", "triton"])
def test_topk_keeps_the_first_of_equal_keys_on_every_path(impl):
    device = impl_device(impl)
    # small integers: every product and sum is exact in fp32, so the scores tie in any summation order
    q = torch.randint(-2, 3, (1, 2, 9, 8), device=device).float()
    k = torch.randint(-2, 3, (1, 2, 1, 8), device=device).float().expand(1, 2, 20, 8).contiguous()  # rows tie
    v = torch.randn(1, 2, 20, 8, device=device)
    out = sf.sparse_attention(q, k, v, "TOPK:3", impl=impl)
    want = sf.sparse_attention(q, k[:, :, :3], v[:, :, :3], "FULL", impl="reference")  # the first three keys
    torch.testing.assert_close(out.cpu(), want.cpu(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("impl", ["reference", "lean"])
def test_dsa_rows_do_not_depend_on_the_length_of_the_call(impl):
    spec = sf.parse_pattern("dsa:k=4,heads=2,dim=4")
    assert isinstance(spec, DSA)
    torch.manual_seed(3)
    weights = spec.make_layer_parameters(12, 4, 2, 8, 8)
    tokens = torch.randint(0, 3, (2, 23))  # three distinct inputs: equal indexer keys everywhere
    x = torch.randn(3, 12)[tokens]
    q, k, v = torch.randn(2, 4, 23, 8), torch.randn(2, 2, 23, 8), torch.randn(2, 2, 23, 8)

    def call(n):
        params = {**weights, "hidden": x[:, :n]}
        return sf.sparse_attention(q[:, :, :n], k[:, :, :n], v[:, :, :n], spec, causal=True, impl=impl, params=params)

    whole = call(23)
    for n in (5, 9, 16):
        torch.testing.assert_close(call(n), whole[:, :, :n], atol=1e-6, rtol=1e-6, msg=f"first {n} rows")


@pytest.mark.parametrize("pattern", ["block_topk:block=4,top=2", "moba:block=4,top=2,tile=16", "quest:block=4,top=2,tile=16"])
def test_equal_blocks_go_to_the_earlier_blocks(pattern):
    """Identical keys: every candidate block scores the same, so the chosen ones are the earliest."""
    spec = sf.parse_pattern(pattern)
    q = torch.randint(-2, 3, (1, 1, 48, 8)).float()
    k = torch.randint(-2, 3, (1, 1, 1, 8)).float().expand(1, 1, 48, 8).contiguous()
    if hasattr(spec, "tile_blocks"):
        lists = spec.tile_blocks(q, k, True, None)  # [1, 1, T, own + top]: tile t starts at 16 t
        chosen = lists[0, 0, :, -2:]
        assert chosen[0].tolist() == [-1, -1]  # the first tile has no earlier block
        assert chosen[1].tolist() == [0, 1] and chosen[2].tolist() == [0, 1]
    else:
        chosen = spec.selected_blocks(q, k, True, None)[0, 0, :, 1:]  # [N, top] after the own block
        assert chosen[47].tolist() == [0, 1] and chosen[9].tolist() == [0, 1] and chosen[5].tolist() == [0, -1]


def test_nsa_keeps_the_earlier_of_equal_blocks_beyond_the_forced_ones():
    spec = sf.parse_pattern("nsa:block=4,top=3,cmp=4,stride=4,window=0,initial=1,local=1")
    importance = torch.ones(1, 1, 40, 10)  # every block equally important
    chosen = spec._top_blocks(importance, slice(0, 40), True, 10)  # [1, 1, 40, 3]
    assert chosen[0, 0, 39].tolist() == [0, 9, 1]  # forced first (initial, own), then the earliest other
    assert chosen[0, 0, 3].tolist() == [0, -1, -1]  # only block 0 exists before position 4

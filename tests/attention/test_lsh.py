"""LSH (Reformer) attention: equivalences, the per-bucket chunk rule, rounds, seeds, parameters."""

import pytest
import torch

import sparsefocus as sf
from sparsefocus.attention.common import mask_from_indices
from sparsefocus.attention.lsh import hash_buckets, random_rotations
from pattern_checks import assert_equals_full, random_qk


@pytest.mark.parametrize("causal", [False, True])
def test_one_bucket_with_chunk_covering_everything_is_full(causal):
    q, k = random_qk(37)
    v = torch.randn(2, 2, 37, 5)
    assert_equals_full("lsh:buckets=1,chunk=37", q, k, v, causal)


def test_one_bucket_keeps_own_and_previous_chunk_of_positions():
    q, k = random_qk(12)
    mask = sf.selection_mask("lsh:buckets=1,chunk=4", q, k)[0, 0]
    query_chunk = torch.arange(12)[:, None] // 4
    key_chunk = torch.arange(12)[None, :] // 4
    # One bucket: query i sits after the i earlier keys, so its chunk is i // 4.
    expected = (key_chunk == query_chunk) | (key_chunk == query_chunk - 1)
    assert torch.equal(mask, expected)


@pytest.mark.parametrize("buckets", [2, 6, 16])
def test_hash_buckets_is_the_argmax_over_both_signs_ties_included(buckets):
    """hash_buckets against its definition argmax([x R; -x R]) (first maximum on ties), on small
    integer inputs where ties within p, within -p and between max p and -min p are common."""
    generator = torch.Generator().manual_seed(buckets)
    x = torch.randint(-1, 2, (2, 3, 50, 4), generator=generator).float()
    rotation = torch.randint(-1, 2, (4, buckets // 2), generator=generator).float()
    projected = x @ rotation
    expected = torch.cat([projected, -projected], dim=-1).argmax(dim=-1)
    assert (projected.amax(-1) == -projected.amin(-1)).any()  # the cross-half ties do occur
    assert torch.equal(hash_buckets(x, rotation, buckets), expected)


def test_kept_keys_share_the_query_bucket_except_the_own_position():
    q, k = random_qk(40, seed=1)
    spec = sf.parse_pattern("lsh:buckets=4,chunk=40")
    rotation = random_rotations(1, 8, 4, 0, q)[0]
    same = hash_buckets(q, rotation, 4)[..., :, None] == hash_buckets(k, rotation, 4)[..., None, :]
    mask = sf.selection_mask(spec, q, k)
    eye = torch.eye(40, dtype=torch.bool)
    # chunk >= N: every same-bucket key is kept, and nothing else but the diagonal.
    assert torch.equal(mask & ~eye, same & ~eye)
    assert mask[..., eye].all()


def test_more_rounds_keep_a_superset_of_pairs():
    q, k = random_qk(50, seed=2)
    one = sf.selection_mask("lsh:buckets=8,chunk=4,rounds=1", q, k)
    three = sf.selection_mask("lsh:buckets=8,chunk=4,rounds=3", q, k)
    assert not (one & ~three).any()
    assert three.sum() > one.sum()


def test_same_seed_same_mask_and_different_seed_different_mask():
    q, k = random_qk(50, seed=3)
    first = sf.selection_mask("lsh:buckets=8,chunk=4,seed=1", q, k)
    again = sf.selection_mask("lsh:buckets=8,chunk=4,seed=1", q, k)
    other = sf.selection_mask("lsh:buckets=8,chunk=4,seed=2", q, k)
    assert torch.equal(first, again)
    assert not torch.equal(first, other)


@pytest.mark.parametrize("n, m", [(30, 20), (20, 30)])
def test_key_lists_equal_dense_definition_when_lengths_differ(n, m):
    q, k = random_qk(n, m, seed=4)
    padding = torch.rand(2, m, generator=torch.Generator().manual_seed(0)) > 0.3
    spec = sf.parse_pattern("lsh:buckets=4,chunk=3,rounds=2")
    dense = spec.full_mask(q, k, False, padding, None)
    lists = mask_from_indices(spec.indices(q, k, False, padding, None), m)
    assert torch.equal(dense, lists)


@pytest.mark.parametrize("rounds", [1, 2])
@pytest.mark.parametrize("causal", [False, True])
def test_key_lists_hold_each_kept_key_once(rounds, causal):
    """The lists give the definition's mask and list no key twice: one round's own position,
    when its bucket window holds it too, is dropped without sorting; several rounds are deduplicated."""
    q, k = random_qk(45, seed=7)
    spec = sf.parse_pattern(f"lsh:buckets=2,chunk=6,rounds={rounds}")
    index = spec.indices(q, k, causal, None, None)
    assert torch.equal(mask_from_indices(index, 45), spec.full_mask(q, k, causal, None, None))
    ordered = index.sort(-1).values
    repeats = (ordered[..., 1:] == ordered[..., :-1]) & (ordered[..., 1:] >= 0)
    assert not repeats.any()


def test_causal_selection_of_past_rows_ignores_future_queries_and_keys():
    q, k = random_qk(40, seed=5)
    before = sf.selection_mask("lsh:buckets=4,chunk=3,rounds=2", q, k, causal=True)
    q2, k2 = q.clone(), k.clone()
    q2[:, :, 25:] = torch.randn_like(q2[:, :, 25:])
    k2[:, :, 25:] = torch.randn_like(k2[:, :, 25:])
    after = sf.selection_mask("lsh:buckets=4,chunk=3,rounds=2", q2, k2, causal=True)
    assert torch.equal(after[:, :, :25], before[:, :, :25])


def test_padded_keys_take_no_chunk_slot():
    q, k = random_qk(16, seed=6)
    padding = torch.ones(2, 16, dtype=torch.bool)
    padding[:, ::2] = False
    mask = sf.selection_mask("lsh:buckets=1,chunk=2", q, k, key_padding_mask=padding)[0, 0]
    # Real keys are the odd positions; chunks of 2 real keys are {1,3}, {5,7}, ...
    assert mask[9].nonzero().flatten().tolist() == [5, 7, 9, 11]


@pytest.mark.parametrize(
    "spec, word",
    [("lsh:buckets=3", "buckets"), ("lsh:buckets=0", "buckets"), ("lsh:chunk=0", "chunk"), ("lsh:rounds=0", "rounds")],
)
def test_bad_parameters_raise_naming_the_parameter(spec, word):
    with pytest.raises(ValueError, match=word):
        sf.parse_pattern(spec)


def test_reformer_parameter_names_are_accepted():
    assert sf.parse_pattern("reformer:n_buckets=4,n_hashes=2,chunk_size=8") == sf.parse_pattern("lsh:4,8,2")


@pytest.mark.parametrize("causal", [False, True])
def test_key_lists_are_an_op_that_compiles_opaque(causal):
    """The lists come from ``sparsefocus::lsh_key_lists`` (schema, fake and eager agree, GQA and
    padding), and a fullgraph-compiled call gives the eager lists."""
    from sparsefocus.attention.lsh import lsh_key_lists

    q, k = torch.randn(2, 4, 19, 8), torch.randn(2, 2, 23, 8)
    padding = torch.rand(2, 23, generator=torch.Generator().manual_seed(1)) > 0.2
    args = (q, k, 4, 3, 2, 0, causal, padding)
    torch.library.opcheck(torch.ops.sparsefocus.lsh_key_lists.default, args)
    eager = lsh_key_lists(*args)
    assert eager.shape == (2, 4, 19, 2 * 3 * 2 + 1) and eager.dtype == torch.long
    spec = sf.parse_pattern("lsh:buckets=4,chunk=3,rounds=2")
    graphs = []

    def backend(graph_module, example_inputs):
        graphs.append(str(graph_module.graph))
        return graph_module.forward

    compiled = torch.compile(lambda q, k: spec.key_indices(q, k, causal, padding, None), fullgraph=True, backend=backend)
    assert torch.equal(compiled(q, k), eager)
    [graph] = graphs
    assert "sparsefocus.lsh_key_lists" in graph and "sort" not in graph  # one opaque call, nothing traced inside

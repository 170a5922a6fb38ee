"""Routing (k-means) attention: equivalences, cluster and window rules, causal centroids, parameters."""

import pytest
import torch
import torch.nn.functional as F

import sparsefocus as sf
from sparsefocus.attention.common import mask_from_indices
from pattern_checks import assert_equals_full, random_qk


@pytest.mark.parametrize("causal", [False, True])
def test_one_cluster_with_window_covering_everything_is_full(causal):
    q, k = random_qk(33)
    v = torch.randn(2, 2, 33, 5)
    spec = "routing:clusters=1,window=33"
    assert_equals_full(spec, q, k, v, causal)


@pytest.mark.parametrize("causal", [False, True])
def test_kept_keys_are_the_window_nearest_keys_of_the_query_cluster(causal):
    q, k = random_qk(40, seed=1)
    spec = sf.parse_pattern("routing:clusters=3,window=5")
    query_cluster, key_cluster, key_score = spec.assign(q, k, causal, None)
    mask = sf.selection_mask(spec, q, k, causal=causal)
    for i in (0, 7, 39):
        allowed = torch.arange(40) <= (i if causal else 39)
        candidates = (key_cluster[0, 1] == query_cluster[0, 1, i]) & allowed
        best = key_score[0, 1].masked_fill(~candidates, float("-inf")).topk(5).indices
        expected = {int(j) for j in best if candidates[j]} | {i}
        assert set(mask[0, 1, i].nonzero().flatten().tolist()) == expected
    assert (mask.sum(-1) <= 5 + 1).all()


def test_non_causal_queries_of_one_cluster_share_one_key_set():
    q, k = random_qk(40, seed=2)
    spec = sf.parse_pattern("routing:clusters=3,window=6")
    query_cluster, _, _ = spec.assign(q, k, False, None)
    mask = sf.selection_mask(spec, q, k)[0, 0] & ~torch.eye(40, dtype=torch.bool)
    rows = (query_cluster[0, 0] == query_cluster[0, 0, 0]).nonzero().flatten()
    shared = mask[rows].any(0)
    assert len(rows) > 1 and shared.sum() <= 6
    for r in rows:
        expected = shared.clone()
        expected[r] = False  # the diagonal was removed above
        assert torch.equal(mask[r], expected)


def test_causal_centroids_and_selection_ignore_future_queries_and_keys():
    q, k = random_qk(40, seed=3)
    spec = "routing:clusters=3,window=4,iters=3"
    before = sf.selection_mask(spec, q, k, causal=True)
    q2, k2 = q.clone(), k.clone()
    q2[:, :, 25:] = torch.randn_like(q2[:, :, 25:]) * 10
    k2[:, :, 25:] = torch.randn_like(k2[:, :, 25:]) * 10
    after = sf.selection_mask(spec, q2, k2, causal=True)
    assert torch.equal(after[:, :, :25], before[:, :, :25])


def test_non_causal_lloyd_iterations_move_the_centroids_towards_the_data():
    q, k = random_qk(60, seed=4)
    spec = sf.parse_pattern("routing:clusters=4,window=60,iters=0")
    refined = sf.parse_pattern("routing:clusters=4,window=60,iters=5")
    unit = F.normalize(torch.cat([q, k], dim=-2), dim=-1)
    init = spec.centroids(F.normalize(q, dim=-1), F.normalize(k, dim=-1), False, None)
    after = refined.centroids(F.normalize(q, dim=-1), F.normalize(k, dim=-1), False, None)
    # Spherical k-means raises the mean similarity of each point to its nearest centroid.
    assert (unit @ after.transpose(-1, -2)).amax(-1).mean() > (unit @ init.transpose(-1, -2)).amax(-1).mean()
    assert not torch.equal(sf.selection_mask(spec, q, k), sf.selection_mask(refined, q, k))


@pytest.mark.parametrize("causal", [False, True])
def test_key_lists_equal_dense_definition_across_query_chunks(causal):
    n, m = (30, 30) if causal else (30, 22)
    q, k = random_qk(n, m, seed=5)
    padding = torch.rand(2, m, generator=torch.Generator().manual_seed(1)) > 0.3
    spec = sf.parse_pattern("routing:clusters=3,window=4")
    dense = spec.full_mask(q, k, causal, padding, None)
    index = spec.key_indices(q, k, causal, padding, None, chunk=7)
    assert torch.equal(dense, mask_from_indices(index, m) & padding[:, None, None, :])


def test_padded_keys_do_not_move_the_centroids():
    q, k = random_qk(20, seed=6)
    padding = torch.ones(2, 20, dtype=torch.bool)
    padding[:, 15:] = False
    spec = sf.parse_pattern("routing:clusters=3,window=5,iters=3")
    before = sf.selection_mask(spec, q, k, key_padding_mask=padding)
    k2 = k.clone()
    k2[:, :, 15:] = torch.randn_like(k2[:, :, 15:]) * 10
    assert torch.equal(sf.selection_mask(spec, q, k2, key_padding_mask=padding), before)


@pytest.mark.parametrize(
    "spec, word",
    [("routing:clusters=0", "clusters"), ("routing:window=0", "window"), ("routing:iters=-1", "iters")],
)
def test_bad_parameters_raise_naming_the_parameter(spec, word):
    with pytest.raises(ValueError, match=word):
        sf.parse_pattern(spec)

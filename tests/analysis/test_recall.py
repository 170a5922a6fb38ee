import math
from dataclasses import dataclass
from typing import ClassVar

import pytest
import torch
from torch import nn

from sparsefocus.analysis.hooks import AttentionCall, attention_layers, capture_attention
from sparsefocus.analysis.recall import (
    RecallStatistics,
    exact_topk_mask,
    ranking_scores,
    selector_score,
    selector_size,
    topk_recall,
)
from sparsefocus.attention import parse_pattern
from sparsefocus.attention.topk import TopK
from sparsefocus.layers import SparseAttention


@dataclass(frozen=True)
class DistanceTopK(TopK):
    """Unregistered test double: selects by dot product but declares a distance score."""

    score: ClassVar[str] = "neg_sqeuclid"


class Stack(nn.Module):
    def __init__(self, pattern: str, causal: bool = False):
        super().__init__()
        self.layers = nn.ModuleList(SparseAttention(8, 2, pattern, causal=causal) for _ in range(2))

    def forward(self, x, key_padding_mask=None):
        for layer in self.layers:
            x = x + layer(x, key_padding_mask)
        return x


def test_exact_topk_among_allowed_keys():
    scores = torch.tensor([[3.0, 1.0, 2.0, 5.0], [0.0, 1.0, 2.0, 3.0]])
    allowed = torch.tensor([[True, True, True, False], [True, False, False, False]])
    top = exact_topk_mask(scores, allowed, 2)
    assert top.tolist() == [[True, False, True, False], [True, False, False, False]]


def test_recall_is_the_share_of_the_exact_topk_kept():
    exact = torch.tensor([[1, 1, 0, 0], [0, 0, 1, 1], [0, 0, 0, 0]], dtype=torch.bool)
    kept = torch.tensor([[1, 0, 1, 0], [0, 0, 1, 1], [1, 1, 1, 1]], dtype=torch.bool)
    recall = topk_recall(kept, exact)
    assert recall[:2].tolist() == [0.5, 1.0] and math.isnan(recall[2])


def test_distance_scores_rank_by_negative_squared_distance():
    q = torch.tensor([[[[1.0, 0.0]]]])
    k = torch.tensor([[[[10.0, 0.0], [1.0, 0.1]]]])
    assert ranking_scores(q, k, "dot").flatten().tolist() == [10.0, 1.0]
    assert ranking_scores(q, k, "neg_sqeuclid").flatten().tolist() == pytest.approx([-81.0, -0.01])
    with pytest.raises(ValueError, match="unknown selector score"):
        ranking_scores(q, k, "cosine")


def test_selector_score_and_size_come_from_the_pattern():
    assert selector_score(parse_pattern("TOPK:3")) == "dot"
    assert selector_score(DistanceTopK(k=1)) == "neg_sqeuclid"
    kept = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]], dtype=torch.bool)
    assert selector_size(parse_pattern("TOPK:3"), kept) == 3
    assert selector_size(parse_pattern("FULL"), kept) == 4  # mean 3.5 rounds to 4


def test_exact_topk_pattern_has_recall_one_and_band_less_through_the_hooks():
    x = torch.randn(2, 12, 8)
    results = {}
    for spec in ("TOPK:3", "BAND:3"):
        model = Stack(spec)
        stats = RecallStatistics(count=3)
        with torch.no_grad(), capture_attention(model, stats) as names:
            model(x)
        assert names == ["layers.0", "layers.1"]
        results[spec] = stats.summary()
    assert results["TOPK:3"]["pooled"]["mean"] == 1.0
    assert results["TOPK:3"]["per_layer"]["layers.1"]["p5"] == 1.0
    assert results["BAND:3"]["pooled"]["mean"] < 0.9
    assert results["BAND:3"]["k"] == {"layers.0": 3, "layers.1": 3}


def test_a_declared_distance_score_changes_the_reference_topk():
    layer = SparseAttention(2, 1, DistanceTopK(k=1), bias=False)
    q = torch.tensor([[[[1.0, 0.0], [1.0, 0.1]]]])
    k = torch.tensor([[[[10.0, 0.0], [1.0, 0.1]]]])
    call = AttentionCall("layer", layer, q, k, None)
    stats = RecallStatistics()
    stats(call)
    # query 0: dot picks key 0, nearest is key 1 -> 0; query 1: dot picks key 0, nearest is key 1 -> 0
    assert stats.summary()["pooled"]["mean"] == 0.0


def test_hooks_respect_causality_and_padding():
    model = Stack("TOPK:2", causal=True)
    calls = []
    padding = torch.ones(1, 6, dtype=torch.bool)
    padding[0, 5] = False
    with torch.no_grad(), capture_attention(model, calls.append):
        model(torch.randn(1, 6, 8), padding)
    allowed = calls[0].allowed()[0, 0]
    assert allowed[2].tolist() == [True, True, True, False, False, False]
    assert not allowed[:, 5].any()
    kept = calls[0].kept()
    assert not (kept & ~calls[0].allowed()).any()
    assert len(attention_layers(model)) == 2
    with pytest.raises(ValueError, match="no SparseAttention"), capture_attention(nn.Linear(2, 2), calls.append):
        pass


def test_zeta_is_ranked_by_distance():
    assert selector_score(parse_pattern("zeta:k=4,window=6,chunks=3,local=3")) == "cauchy"  # ranked by distance
    assert selector_score(parse_pattern("lsh:buckets=4,chunk=4")) == "dot"


@pytest.mark.parametrize(
    "spec",
    ["zeta:k=4,window=6,chunks=3,local=3", "lsh:buckets=4,chunk=4", "routing:clusters=3,window=8", "block_topk:block=4,top=2"],
)
def test_recall_of_approximate_selectors_is_a_share(spec):
    model = nn.Sequential(SparseAttention(8, 2, spec))
    stats = RecallStatistics()
    with torch.no_grad(), capture_attention(model, stats):
        model(torch.randn(2, 16, 8))
    summary = stats.summary()
    assert 0.0 <= summary["pooled"]["p5"] <= summary["pooled"]["mean"] <= 1.0
    assert summary["k"]["0"] >= 1

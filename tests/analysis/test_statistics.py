import math

import numpy as np
import pytest
import torch

from sparsefocus.analysis.statistics import (
    ScoreStatistics,
    attention_scores,
    dispersion,
    full_dispersion,
    percentiles,
    separation,
    sink_counts,
)

# 3 queries x 5 keys; each query keeps the keys marked 1.
SCORES = torch.tensor(
    [
        [5.0, 1.0, 3.0, 0.0, 2.0],
        [0.5, 4.0, 4.0, -1.0, 3.5],
        [2.0, 2.0, 2.0, 2.0, 2.0],
    ]
)
KEPT = torch.tensor(
    [
        [1, 0, 1, 0, 0],  # top-2: 5 and 3, best dropped 2
        [0, 1, 1, 0, 0],  # top-2: 4 and 4, best dropped 3.5
        [0, 0, 0, 0, 1],  # one kept key among ties
    ],
    dtype=torch.bool,
)


def test_dispersion_is_max_minus_min_of_kept_scores():
    assert dispersion(SCORES, KEPT).tolist() == [2.0, 0.0, 0.0]


def test_full_dispersion_uses_every_allowed_key():
    assert full_dispersion(SCORES).tolist() == [5.0, 5.0, 0.0]
    allowed = torch.tensor([True, True, True, False, True])
    assert full_dispersion(SCORES, allowed).tolist() == [4.0, 3.5, 0.0]


def test_separation_is_min_kept_minus_max_dropped():
    assert separation(SCORES, KEPT).tolist() == [1.0, 0.5, 0.0]


def test_separation_is_negative_for_a_pattern_that_drops_a_higher_score():
    band = torch.tensor([[0, 1, 1, 0, 0]], dtype=torch.bool)
    assert separation(SCORES[:1], band).tolist() == [1.0 - 5.0]


def test_rows_without_kept_or_dropped_keys_are_nan():
    kept = torch.tensor([[0, 0, 0, 0, 0], [1, 1, 1, 1, 1]], dtype=torch.bool)
    assert math.isnan(dispersion(SCORES[:2], kept)[0])
    assert math.isnan(separation(SCORES[:2], kept)[0])
    assert math.isnan(separation(SCORES[:2], kept)[1])
    assert dispersion(SCORES[:2], kept)[1] == 5.0


def test_separation_only_counts_allowed_keys_as_dropped():
    allowed = torch.tensor([True, True, True, False, False])  # key 4 (score 2 / 3.5) is padding
    assert separation(SCORES[:2], KEPT[:2], allowed).tolist() == [2.0, 3.5]


def test_sink_counts_are_column_sums():
    assert sink_counts(KEPT).tolist() == [1, 1, 2, 0, 1]


def test_bad_masks_raise_clear_errors():
    with pytest.raises(ValueError, match="bool"):
        dispersion(SCORES, KEPT.float())
    with pytest.raises(ValueError, match="does not fit"):
        dispersion(SCORES, KEPT[:, :3])


def test_attention_scores_scale_by_inverse_sqrt_dim():
    q = torch.tensor([[[[1.0, 2.0, 0.0, 0.0]]]])
    k = torch.tensor([[[[3.0, 1.0, 0.0, 0.0], [0.0, 0.0, 1.0, 1.0]]]])
    assert attention_scores(q, k).flatten().tolist() == [2.5, 0.0]


def test_percentiles_skip_nan_and_floor():
    values = np.array([0.0, 1.0, 2.0, 3.0, 4.0, float("nan")])
    assert percentiles(values, (0, 50, 75, 100)) == {"p0": 0.0, "p50": 2.0, "p75": 3.0, "p100": 4.0}
    assert percentiles(values, (0,), floor=1e-9) == {"p0": 1e-9}
    assert math.isnan(percentiles(np.array([float("nan")]), (50,))["p50"])


def test_score_statistics_pools_layers_and_uses_the_paper_percentiles():
    stats = ScoreStatistics(keys_per_query=2)
    stats.add("layer0", SCORES[None, None], KEPT[None, None])
    stats.add("layer1", SCORES[None, None] * 2, KEPT[None, None])
    summary = stats.summary()
    assert list(summary["per_layer"]) == ["layer0", "layer1"]
    assert summary["per_layer"]["layer0"]["dispersion"]["p100"] == 2.0
    assert summary["per_layer"]["layer1"]["dispersion"]["p100"] == 4.0
    assert summary["pooled"]["dispersion"]["p100"] == 4.0
    assert summary["pooled"]["full_dispersion"]["p100"] == 10.0
    # separations 1, 0.5, 0, 2, 1, 0 -> p0 is 0, floored at 1e-9
    assert summary["pooled"]["separation"]["p0"] == 1e-9
    assert set(summary["pooled"]["separation"]) == {"p25", "p10", "p5", "p0"}
    assert summary["pooled"]["sinks"]["p100"] == 2.0
    assert summary["pooled"]["sink_ratio"]["p100"] == 1.0


def test_keys_nobody_may_see_are_not_counted_as_sinks():
    allowed = torch.tensor([True, True, True, True, False])
    kept = KEPT & allowed
    stats = ScoreStatistics(keys_per_query=2)
    stats.add("layer0", SCORES[None, None], kept[None, None], allowed)
    assert np.isnan(stats.pooled("sinks")).sum() == 1
    assert np.nanmax(stats.pooled("sinks")) == 2.0


def test_summary_keeps_the_unfloored_separation():
    band = torch.tensor([[0, 1, 1, 0, 0]], dtype=torch.bool)  # drops the top score 5
    stats = ScoreStatistics()
    stats.add("layer0", SCORES[None, None, :1], band[None, None])
    pooled = stats.summary()["pooled"]
    assert pooled["separation_raw"]["p0"] == -4.0
    assert pooled["separation"]["p0"] == 1e-9

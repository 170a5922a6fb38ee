"""MQAR and simple associative recall: targets are the values paired with the queried keys."""

import numpy as np
import pytest

from sparsefocus.tasks import build_task
from sparsefocus.tasks.mqar import PRESETS, MQARConfig, distinct_integers


def check_mqar_row(tokens: list[int], targets: list[int], vocab: int, pairs: int, filler_is_zero: bool) -> None:
    context = 2 * pairs
    keys, values = tokens[0:context:2], tokens[1:context:2]
    assert len(set(keys)) == pairs and len(set(values)) == pairs
    assert all(1 <= k < vocab // 2 for k in keys) and all(vocab // 2 <= v < vocab for v in values)
    value_of = dict(zip(keys, values))
    scored = [i for i, t in enumerate(targets) if t != -100]
    assert len(scored) == pairs and all(i >= context and (i - context) % 2 == 0 for i in scored)
    assert sorted(tokens[i] for i in scored) == sorted(keys)  # every key queried exactly once
    assert all(targets[i] == value_of[tokens[i]] for i in scored)
    assert all(t == -100 for t in targets[:context])
    if filler_is_zero:
        assert all(tokens[i] == 0 for i in range(context, len(tokens)) if i not in scored)


@pytest.mark.parametrize("random_non_queries", [False, True])
def test_mqar_targets_are_the_values_of_the_queried_keys(random_non_queries):
    data = build_task(
        "mqar",
        0,
        vocab_size=40,
        seq_len=24,
        num_kv_pairs=5,
        random_non_queries=random_non_queries,
        num_train=200,
        num_valid=50,
    )
    assert data.kind == "next_token" and data.num_classes == 40
    for inputs, targets in [(data.train_inputs, data.train_targets), (data.valid_inputs, data.valid_targets)]:
        for tokens, row_targets in zip(inputs.tolist(), targets.tolist()):
            check_mqar_row(tokens, row_targets, 40, 5, filler_is_zero=not random_non_queries)


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_mqar_figure2_presets(preset):
    data = build_task("mqar", 0, preset=preset, num_train=20, num_valid=5)
    expected = PRESETS[preset]
    assert data.vocab_size == 8192 and data.seq_len == expected["seq_len"]
    for tokens, targets in zip(data.train_inputs.tolist(), data.train_targets.tolist()):
        check_mqar_row(tokens, targets, 8192, expected["num_kv_pairs"], filler_is_zero=True)


def test_mqar_defaults_are_zoology_figure2():
    config = MQARConfig().resolved()
    assert (config["vocab_size"], config["seq_len"], config["num_kv_pairs"]) == (8192, 64, 4)
    assert (config["num_train"], config["num_valid"], config["random_non_queries"]) == (100_000, 3_000, False)


def test_mqar_gaps_favour_short_distances():
    data = build_task("mqar", 0, vocab_size=200, seq_len=128, num_kv_pairs=4, num_train=400, num_valid=10)
    positions = (data.train_targets != -100).nonzero()[:, 1]
    gaps = (positions - 8) // 2  # slots 0..59
    assert (gaps < 8).float().mean() > 0.3  # power law a=0.01; uniform would give 8/60


@pytest.mark.parametrize("size, span", [(3, 50), (7, 9), (9, 9)])
def test_distinct_integers_rows_are_distinct_and_in_range(size, span):
    out = distinct_integers(np.random.default_rng(0), 500, size, 5, 5 + span)
    assert out.min() >= 5 and out.max() < 5 + span
    assert all(len(set(row)) == size for row in out.tolist())
    assert len({tuple(row) for row in out.tolist()}) > 100  # rows vary


@pytest.mark.parametrize(
    "fields, field",
    [
        (dict(preset="fig3"), "preset"),
        (dict(seq_len=31), "seq_len"),
        (dict(seq_len=12, num_kv_pairs=4), "seq_len"),
        (dict(vocab_size=64), "vocab_size"),
        (dict(power_a=0.0), "power_a"),
        (dict(random_non_queries=1), "random_non_queries"),
        (dict(num_kv_pairs=0), "num_kv_pairs"),
    ],
)
def test_mqar_bad_values_raise_naming_the_field(fields, field):
    with pytest.raises(ValueError, match=field):
        build_task("mqar", 0, **fields)


def test_assoc_recall_label_is_the_value_after_the_query_key():
    data = build_task("assoc_recall", 0, num_train=300, num_valid=100)
    pairs, keys = 8, 16
    assert data.seq_len == 2 * pairs + 2 and data.num_classes == 16 and data.vocab_size == 33
    for tokens, label in zip(data.train_inputs.tolist(), data.train_targets.tolist()):
        context = tokens[: 2 * pairs]
        assert tokens[-2] == 32 and len(set(context[0::2])) == pairs
        position = context[0::2].index(tokens[-1])
        assert label == context[2 * position + 1] - keys


@pytest.mark.parametrize("fields, field", [(dict(num_pairs=0), "num_pairs"), (dict(num_keys=4), "num_keys")])
def test_assoc_recall_bad_values_raise_naming_the_field(fields, field):
    with pytest.raises(ValueError, match=field):
        build_task("assoc_recall", 0, **fields)

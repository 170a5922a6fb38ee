"""Properties every synthetic generator shares: registered, typed output, deterministic by seed,
ids within the vocabulary, and no sequence shared between (or repeated within) splits."""

import pytest
import torch

from sparsefocus.tasks import build_task, task_config_class

SMALL = {
    "parity": dict(num_train=200, num_valid=80, num_test=40),
    "even_pairs": dict(num_train=200, num_valid=80, num_test=40),
    "missing_duplicate": dict(num_train=200, num_valid=80, num_test=40),
    "cycle_navigation": dict(num_train=200, num_valid=80, num_test=40),
    "stack_manipulation": dict(num_train=200, num_valid=80, num_test=40),
    "modular_arithmetic_brackets": dict(num_train=200, num_valid=80, num_test=40),
    "solve_equation": dict(num_train=200, num_valid=80, num_test=40),
    "listops": dict(min_length=20, max_length=60, num_train=200, num_valid=80, num_test=40),
    "mqar": dict(vocab_size=64, seq_len=32, num_kv_pairs=4, num_train=200, num_valid=80, num_test=40),
    "assoc_recall": dict(num_train=200, num_valid=80, num_test=40),
}


def splits(data):
    return [
        (data.train_inputs, data.train_targets),
        (data.valid_inputs, data.valid_targets),
        (data.test_inputs, data.test_targets),
    ]


@pytest.mark.parametrize("name", sorted(SMALL))
def test_built_task_has_documented_shapes_and_ids(name):
    data = build_task(name, 0, **SMALL[name])
    assert data.kind == task_config_class(name).kind and data.name == name
    for (inputs, targets), size in zip(splits(data), (200, 80, 40)):
        assert inputs.dtype == torch.long and targets.dtype == torch.long
        assert inputs.shape == (size, data.seq_len)
        assert 0 <= int(inputs.min()) and int(inputs.max()) < data.vocab_size
        if data.kind == "classify":
            assert targets.shape == (size,)
            assert 0 <= int(targets.min()) and int(targets.max()) < data.num_classes
        else:
            assert targets.shape == inputs.shape
            scored = targets[targets != -100]
            assert len(scored) and 0 <= int(scored.min()) and int(scored.max()) < data.num_classes
    if data.pad_id is not None:
        assert 0 <= data.pad_id < data.vocab_size


@pytest.mark.parametrize("name", sorted(SMALL))
def test_same_seed_same_data_other_seed_other_data(name):
    first, again, other = (build_task(name, seed, **SMALL[name]) for seed in (3, 3, 4))
    for (x1, y1), (x2, y2) in zip(splits(first), splits(again)):
        assert torch.equal(x1, x2) and torch.equal(y1, y2)
    assert not torch.equal(first.train_inputs, other.train_inputs)


@pytest.mark.parametrize("name", sorted(SMALL))
def test_no_sequence_is_shared_between_or_repeated_within_splits(name):
    data = build_task(name, 0, **SMALL[name])
    seen: set[tuple[int, ...]] = set()
    for inputs, _ in splits(data):
        rows = [tuple(row) for row in inputs.tolist()]
        assert len(set(rows)) == len(rows)
        assert seen.isdisjoint(rows)
        seen.update(rows)


def test_repeats_are_dropped_when_the_space_is_small():
    data = build_task("parity", 0, length=4, num_train=10, num_valid=6)  # all 16 bit strings
    rows = {tuple(row) for row in torch.cat([data.train_inputs, data.valid_inputs]).tolist()}
    assert len(rows) == 16
    with pytest.raises(ValueError, match="distinct"):
        build_task("parity", 0, length=4, num_train=10, num_valid=7)


def test_empty_test_split_is_none():
    data = build_task("parity", 0, num_train=10, num_valid=5)
    assert data.test_inputs is None and data.test_targets is None


def test_unknown_task_names_the_valid_ones():
    with pytest.raises(ValueError, match="listops"):
        build_task("listop", 0)

"""ListOps: labels agree with an independent stack machine, lengths honour the strict window, and the
length-conditioned sampler has the same distribution as LRA's draw-and-reject generator."""

import collections
import random

import numpy as np
import pytest
import torch

from sparsefocus.tasks import build_task, listops
from sparsefocus.tasks.listops import (
    OPERATORS,
    TOKENIZATIONS,
    ListOpsConfig,
    TreeSampler,
    apply_operator,
    decode,
    evaluate_tokens,
    length_tables,
)

SMALL = dict(min_length=20, max_length=80, num_train=300, num_valid=100)


def all_rows(data):
    inputs = torch.cat([data.train_inputs, data.valid_inputs]).tolist()
    return list(zip(inputs, torch.cat([data.train_targets, data.valid_targets]).tolist()))


@pytest.mark.parametrize(
    "tokens, value",
    [
        ("[MED 1 2 3 4 ]", 2),
        ("[MED 9 0 4 ]", 4),
        ("[SM 9 9 ]", 8),
        ("[MIN 3 [MAX 1 7 ] 5 ]", 3),
        ("[SM [MED 8 9 ] [MIN 4 6 ] ]", 2),
        ("7", 7),
        ("[MAX 2 0 X", 2),
    ],
)
def test_evaluator_on_hand_examples(tokens, value):
    assert evaluate_tokens(tokens.split()) == value


def test_evaluator_rejects_malformed_sequences():
    with pytest.raises(ValueError):
        evaluate_tokens("[MIN 1 2".split())
    with pytest.raises(ValueError):
        evaluate_tokens("1 2 ]".split())


@pytest.mark.parametrize("tokenization", ["spartan", "lra"])
def test_labels_agree_with_the_stack_machine_on_every_example(tokenization):
    data = build_task("listops", 0, tokenization=tokenization, **SMALL)
    for ids, label in all_rows(data):
        assert evaluate_tokens(decode(ids, tokenization)) == label


def test_lengths_are_strictly_inside_the_window_and_padding_is_trailing():
    data = build_task("listops", 1, **SMALL)
    for ids, _ in all_rows(data):
        length = sum(1 for token in ids if token != 0)
        assert 20 < length < 80
        assert all(token == 0 for token in ids[length:]) and all(token != 0 for token in ids[:length])
    lengths = (torch.cat([data.train_inputs, data.valid_inputs]) != 0).sum(1)
    assert data.seq_len == int(lengths.max())  # spartan pads to the longest sequence


def test_spartan_tokens_keep_the_closer_and_pad_to_a_multiple():
    data = build_task("listops", 0, pad_multiple=16, **SMALL)
    assert data.vocab_size == 16 and data.pad_id == 0 and data.seq_len % 16 == 0
    assert TOKENIZATIONS["spartan"].index("]") in data.train_inputs.unique().tolist()


def test_lra_tokens_write_the_closer_as_x_and_pad_to_max_length():
    data = build_task("listops", 0, tokenization="lra", **SMALL)
    vocab = TOKENIZATIONS["lra"]
    assert data.vocab_size == 17 and data.seq_len == 80
    used = set(data.train_inputs.unique().tolist())
    assert vocab.index("X") in used and vocab.index("<oov>") not in used


def test_semantic_focus_preset_is_the_papers_window():
    config = ListOpsConfig().resolved()
    assert (config["min_length"], config["max_length"], config["max_depth"], config["max_args"]) == (500, 600, 10, 10)
    assert (config["num_train"], config["num_valid"], config["tokenization"]) == (5000, 2000, "spartan")
    data = build_task("listops", 0, num_train=20, num_valid=10)
    for ids, label in all_rows(data):
        assert 500 < sum(1 for token in ids if token) < 600
        assert evaluate_tokens(decode(ids, "spartan")) == label


def test_lra_preset_pads_to_2000():
    config = ListOpsConfig(preset="lra").resolved()
    assert (config["min_length"], config["max_length"], config["num_train"], config["num_test"]) == (500, 2000, 96000, 2000)
    data = build_task("listops", 0, preset="lra", num_train=4, num_valid=2, num_test=2)
    assert data.seq_len == 2000 and data.vocab_size == 17 and data.test_inputs.shape == (2, 2000)


def lra_generate_tree(depth, max_depth, max_args, rnd):
    """LRA's generate_tree, transcribed: returns (tokens, length)."""
    r = rnd.random() if depth < max_depth else 1
    if r > 0.25:
        return [str(rnd.choice(range(10)))], 1
    tokens, length = [], 2
    for _ in range(rnd.randint(2, max_args)):
        child, child_length = lra_generate_tree(depth + 1, max_depth, max_args, rnd)
        tokens += child
        length += child_length
    return [rnd.choice(OPERATORS)] + tokens + ["]"], length


def tree_statistics(trees):
    """Histograms of length, root arity and depth of the first child (a proxy for shape)."""
    stats = collections.Counter()
    for tokens in trees:
        depth, arity, first_depth, first_done = 0, 0, 0, False
        for token in tokens:
            if token in OPERATORS:
                depth += 1
                arity += depth == 2
                first_depth = max(first_depth, depth) if not first_done else first_depth
            elif token == "]":
                depth -= 1
                first_done |= depth == 1
            else:
                arity += depth == 1
                first_done |= depth == 1
        stats[("length", len(tokens))] += 1
        stats[("arity", arity)] += 1
        stats[("first", first_depth)] += 1
    return stats


def total_variation(a, b, kind, count):
    keys = {key for key in a | b if key[0] == kind}
    return 0.5 * sum(abs(a[key] - b[key]) for key in keys) / count


def conditioned_trees(max_depth, max_args, lengths, seed):
    sampler = TreeSampler(length_tables(max_depth, max_args, int(max(lengths)) + 1), random.Random(seed))
    trees = []
    for length in lengths:
        out: list[str] = []
        sampler.tree(1, int(length), out)
        trees.append(out)
    return trees


@pytest.mark.parametrize("scan_steps", [32, 2])  # 2: child lengths > 2 go through the numpy tail
def test_conditioned_sampler_matches_lra_rejection_sampling(scan_steps, monkeypatch):
    monkeypatch.setattr(listops, "SCAN_STEPS", scan_steps)
    max_depth, max_args, low, high, count = 4, 4, 6, 30, 3000
    rnd = random.Random(0)
    rejected = []
    while len(rejected) < count:
        tokens, length = lra_generate_tree(1, max_depth, max_args, rnd)
        if low < length < high:
            rejected.append(tokens)
    theirs = tree_statistics(rejected)
    window = np.arange(low + 1, high)
    weights = length_tables(max_depth, max_args, high).subtree[1][window]
    lengths = np.random.default_rng(2).choice(window, size=count, p=weights / weights.sum())
    ours = tree_statistics(conditioned_trees(max_depth, max_args, lengths, seed=1))
    # two independent LRA draws of 3000 differ by ~0.04 (length), ~0.01 (arity, first child depth)
    for kind, bound in (("length", 0.07), ("arity", 0.03), ("first", 0.03)):
        assert total_variation(ours, theirs, kind, count) < bound, kind
    uniform = tree_statistics(conditioned_trees(max_depth, max_args, np.random.default_rng(2).choice(window, count), 1))
    assert total_variation(uniform, theirs, "length", count) > 0.15  # the check can tell a wrong length law


def test_generator_values_match_lra_semantics():
    assert apply_operator("[MED", [1, 2, 3, 4]) == int(np.median([1, 2, 3, 4]))
    assert apply_operator("[SM", [9, 8, 7]) == 4


@pytest.mark.parametrize(
    "fields, field",
    [
        (dict(preset="long"), "preset"),
        (dict(tokenization="bytes"), "tokenization"),
        (dict(min_length=600, max_length=600), "max_length"),
        (dict(max_args=1), "max_args"),
        (dict(max_depth=0), "max_depth"),
        (dict(seq_len=100), "seq_len"),
        (dict(num_train=0), "num_train"),
        (dict(pad_multiple=0), "pad_multiple"),
        (dict(max_depth=2, min_length=20, max_length=40), "min_length"),
    ],
)
def test_bad_values_raise_naming_the_field(fields, field):
    with pytest.raises(ValueError, match=field):
        build_task("listops", 0, **fields)

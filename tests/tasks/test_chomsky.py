"""Chomsky-hierarchy generators: every label re-derived by a check written independently of the generator."""

import collections

import pytest
import torch

from sparsefocus.tasks import build_task

SMALL = dict(num_train=300, num_valid=100)


def rows(data):
    """(tokens, label) pairs over train and held-out."""
    inputs = torch.cat([data.train_inputs, data.valid_inputs]).tolist()
    labels = torch.cat([data.train_targets, data.valid_targets]).tolist()
    return list(zip(inputs, labels))


def test_parity_label_is_bit_sum_mod_2():
    data = build_task("parity", 0, **SMALL)
    assert data.seq_len == 40 and data.vocab_size == 3 and data.num_classes == 2 and data.pad_id == 2
    for bits, label in rows(data):
        assert set(bits) <= {0, 1}
        assert label == bits.count(1) % 2


def test_even_pairs_label_is_first_xor_last():
    data = build_task("even_pairs", 0, **SMALL)
    for bits, label in rows(data):
        assert label == bits[0] ^ bits[-1]


def test_missing_duplicate_hides_one_bit_of_a_doubled_string():
    data = build_task("missing_duplicate", 0, **SMALL)
    assert data.vocab_size == 4 and data.pad_id == 3
    half = data.seq_len // 2
    for tokens, label in rows(data):
        assert tokens.count(2) == 1
        hidden = tokens.index(2)
        partner = hidden + half if hidden < half else hidden - half
        assert label == tokens[partner]
        assert [t for i, t in enumerate(tokens[:half]) if i != hidden % half] == [
            t for i, t in enumerate(tokens[half:]) if i != hidden % half
        ]


def test_cycle_navigation_label_is_net_moves_mod_5():
    data = build_task("cycle_navigation", 0, **SMALL)
    assert data.num_classes == 5 and data.vocab_size == 4
    for actions, label in rows(data):
        counts = collections.Counter(actions)
        assert label == (counts[2] - counts[0]) % 5


def _final_stack_top(tokens: list[int]) -> int:
    split = next(i for i, t in enumerate(tokens) if t >= 2) if any(t >= 2 for t in tokens) else len(tokens)
    stack = "".join(str(t) for t in tokens[:split])
    for action in tokens[split:]:
        stack = stack[:-1] if action == 2 else stack + str(action - 3)
    return int(stack[-1]) if stack else 2


def test_stack_manipulation_label_is_final_top_or_empty():
    data = build_task("stack_manipulation", 0, **SMALL)
    assert data.num_classes == 3 and data.vocab_size == 6
    for tokens, label in rows(data):
        first_action = next(i for i, t in enumerate(tokens) if t >= 2)
        assert 1 <= first_action <= 39 and all(t >= 2 for t in tokens[first_action:])
        assert label == _final_stack_top(tokens)


def _text(tokens, names):
    return "".join(names[t] for t in tokens)


def test_modular_arithmetic_label_matches_python_eval():
    data = build_task("modular_arithmetic_brackets", 0, **SMALL)
    names = data.info["tokens"]
    assert data.vocab_size == 12 and data.num_classes == 5
    for tokens, label in rows(data):
        text = _text(tokens, names)
        assert len(tokens) == 40 and set(text) <= set("01234+-()")
        assert label == eval(text) % 5  # + and - commute with reduction mod 5


def test_solve_equation_label_is_the_unique_solution():
    data = build_task("solve_equation", 0, **SMALL)
    names = data.info["tokens"]
    for tokens, label in rows(data):
        left, right = _text(tokens, names).split("=")
        assert left.count("x") == 1 and len(right) == 1
        solutions = [d for d in range(5) if eval(left.replace("x", str(d))) % 5 == int(right)]
        assert solutions == [label]


def test_modular_arithmetic_with_multiplication_uses_star():
    data = build_task("modular_arithmetic_brackets", 1, mult=True, **SMALL)
    names = data.info["tokens"]
    texts = [_text(tokens, names) for tokens, _ in rows(data)]
    assert any("*" in text for text in texts)
    assert all(label == eval(text) % 5 for text, (_, label) in zip(texts, rows(data)))


@pytest.mark.parametrize("length", [1, 2, 5, 17])
def test_short_lengths_are_honoured(length):
    for name in ("parity", "cycle_navigation", "stack_manipulation", "modular_arithmetic_brackets"):
        data = build_task(name, 0, length=length, num_train=1, num_valid=1)
        assert data.seq_len == length


@pytest.mark.parametrize(
    "name, fields, field",
    [
        ("parity", dict(length=0), "length"),
        ("missing_duplicate", dict(length=7), "length"),
        ("solve_equation", dict(length=2), "length"),
        ("modular_arithmetic_brackets", dict(modulus=11), "modulus"),
        ("solve_equation", dict(mult="yes"), "mult"),
        ("even_pairs", dict(num_valid=0), "num_valid"),
        ("cycle_navigation", dict(num_train=2.5), "num_train"),
    ],
)
def test_bad_values_raise_naming_the_field(name, fields, field):
    with pytest.raises(ValueError, match=field):
        build_task(name, 0, **fields)

"""Task switches that reproduce the Semantic Focus data, and distinct-row drawing near a full space:
modular arithmetic with multiplication (its label skew), solve_equation refusing it, one data seed
for every training seed, and draw_distinct succeeding whenever the space is large enough."""

import numpy as np
import pytest
import torch

from sparsefocus.tasks import build_task
from sparsefocus.tasks.splits import draw_distinct

STAR_SIZES = dict(num_train=3000, num_valid=10)


def test_modular_arithmetic_with_mult_has_the_papers_star_count_and_zero_skew():
    data = build_task("modular_arithmetic_brackets", 5, mult=True, **STAR_SIZES)
    star = data.info["tokens"].index("*")
    stars = (data.train_inputs == star).sum(dim=1).double().mean()
    zeros = (data.train_targets == 0).double().mean()
    assert 2.2 < float(stars) < 2.8  # about 2.5 '*' per sequence at L=40
    assert 0.26 < float(zeros) < 0.32  # label 0 about 29%: a product with a 0 factor is 0


def test_modular_arithmetic_without_mult_has_no_star_and_near_uniform_labels():
    data = build_task("modular_arithmetic_brackets", 5, mult=False, **STAR_SIZES)
    assert not (data.train_inputs == data.info["tokens"].index("*")).any()
    shares = torch.bincount(data.train_targets, minlength=5).double() / data.train_targets.numel()
    assert float(shares.max()) < 0.24


def test_solve_equation_refuses_mult_in_one_line():
    with pytest.raises(
        ValueError, match=r"^solve_equation: mult=True is not supported: NNCH's solve_equation has no multiplication$"
    ):
        build_task("solve_equation", 0, mult=True, num_train=5, num_valid=5)


@pytest.mark.parametrize(
    "name, fields",
    [("parity", dict(num_train=50, num_valid=20)), ("listops", dict(min_length=20, max_length=60, num_train=30, num_valid=10))],
)
def test_data_seed_gives_every_training_seed_the_same_data(name, fields):
    first, second = (build_task(name, seed, data_seed=7, **fields) for seed in (1, 2))
    direct = build_task(name, 7, **fields)
    for data in (second, direct):
        assert torch.equal(first.train_inputs, data.train_inputs) and torch.equal(first.valid_targets, data.valid_targets)
    assert not torch.equal(build_task(name, 1, **fields).train_inputs, build_task(name, 2, **fields).train_inputs)


def test_parity_draws_4050_of_the_4096_strings_of_length_12():
    data = build_task("parity", 0, length=12, num_train=4000, num_valid=50)
    rows = {tuple(row) for row in torch.cat([data.train_inputs, data.valid_inputs]).tolist()}
    assert len(rows) == 4050
    again = build_task("parity", 0, length=12, num_train=4000, num_valid=50)
    assert torch.equal(data.valid_inputs, again.valid_inputs)


def test_the_whole_space_can_be_drawn_and_one_more_is_refused_before_drawing():
    data = build_task("parity", 3, length=12, num_train=4000, num_valid=96)
    assert len({tuple(row) for row in torch.cat([data.train_inputs, data.valid_inputs]).tolist()}) == 4096
    with pytest.raises(ValueError, match="asks for 4097 distinct sequences .* but only 4096 exist"):
        build_task("parity", 3, length=12, num_train=4000, num_valid=97)


@pytest.mark.parametrize(
    "name, space",
    [("stack_manipulation", 2 * 27 + 4 * 9 + 8 * 3), ("missing_duplicate", 4 * 4), ("cycle_navigation", 3**4)],
)
def test_counted_spaces_are_exact_at_length_4(name, space):
    data = build_task(name, 0, length=4, num_train=space - 1, num_valid=1)
    assert len({tuple(row) for row in torch.cat([data.train_inputs, data.valid_inputs]).tolist()}) == space
    with pytest.raises(ValueError, match=f"only {space} exist"):
        build_task(name, 0, length=4, num_train=space, num_valid=1)


def ten_rows(rng):
    def sample(count):
        codes = rng.integers(0, 10, size=count)
        return codes[:, None] * np.ones((1, 3), dtype=np.int64), codes

    return sample


def test_an_uncounted_space_succeeds_when_large_enough_and_fails_clearly_when_not():
    inputs, targets = draw_distinct("toy", ten_rows(np.random.default_rng(0)), 10)
    assert sorted(targets.tolist()) == list(range(10)) and inputs.shape == (10, 3)
    with pytest.raises(
        ValueError, match=r"toy: drew only 10 distinct sequences of the 11 asked for .* no new one in the last \d+ draws"
    ):
        draw_distinct("toy", ten_rows(np.random.default_rng(0)), 11)


def test_draws_keep_the_first_distinct_rows_of_the_stream_in_order():
    stream = np.random.default_rng(11).integers(0, 2, size=(200, 6))  # 64 strings: repeats occur
    _, first = np.unique(stream, axis=0, return_index=True)
    expected = stream[np.sort(first)][:30]
    rng = np.random.default_rng(11)
    inputs, _ = draw_distinct("bits", lambda n: (bits := rng.integers(0, 2, size=(n, 6)), bits.sum(1)), 30)
    assert np.array_equal(inputs, expected)

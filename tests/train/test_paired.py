"""Seed-paired comparisons (``sparsefocus.train.paired``): first epochs at a held-out accuracy and
the exact signed-rank test, checked against a brute-force count over every sign pattern and hand
cases; and the report's table with ``--reach``."""

import itertools
import json

import numpy as np
import pytest
from test_report_summary import fake_experiment, strict_json, table

from sparsefocus.train.paired import ReachRow, first_reach, midranks, signed_rank_p
from sparsefocus.train.report import main, write_report


def brute_force_p(differences: list[float]) -> float | None:
    """The same test by enumerating every sign pattern of the nonzero differences."""
    nonzero = [d for d in differences if d != 0]
    if not nonzero:
        return None
    ranks = midranks(np.abs(np.asarray(nonzero, dtype=float)))
    observed = ranks[np.asarray(nonzero) > 0].sum()
    centre = ranks.sum() / 2
    sums = [sum(r for r, s in zip(ranks, signs) if s) for signs in itertools.product((0, 1), repeat=len(nonzero))]
    return sum(abs(w - centre) >= abs(observed - centre) - 1e-9 for w in sums) / 2 ** len(nonzero)


def test_midranks_share_the_mean_rank_of_ties():
    assert midranks(np.array([3.0, 1.0, 3.0, 2.0])).tolist() == [3.5, 1.0, 3.5, 2.0]


@pytest.mark.parametrize("seed", range(6))
def test_exact_p_equals_the_count_over_every_sign_pattern_with_ties_and_zeros(seed):
    rng = np.random.default_rng(seed)
    differences = rng.integers(-6, 7, size=9).tolist()  # small range: tied magnitudes and zeros
    assert signed_rank_p(differences) == pytest.approx(brute_force_p(differences), abs=1e-12)


def test_exact_p_of_hand_cases():
    assert signed_rank_p([-1.0] * 10) == pytest.approx(2 / 1024)  # all earlier: the two extreme patterns
    assert signed_rank_p([-3, -1, -2, -5, -4, -6, -7, -8, -9, -10]) == pytest.approx(2 / 1024)
    assert signed_rank_p([4]) == 1.0
    assert signed_rank_p([1, -1]) == 1.0
    assert signed_rank_p([0, 0]) is None


def test_first_reach_counts_from_one_and_none_where_never():
    accuracy = np.array([[0.1, 0.4, 0.5], [0.5, 0.2, 0.2], [0.1, 0.1, 0.1]])
    assert first_reach(accuracy, 0.4) == [2, 1, None]


def test_a_row_against_the_reference_pairs_seeds_and_counts_never_after_the_last_epoch():
    reference = ReachRow.of([1, 2, 3], np.array([[0, 0, 1.0], [0, 1.0, 1.0], [0, 0, 0.0]]), 0.5)  # 3, 2, never
    mine = ReachRow.of([3, 2, 1], np.array([[0, 1.0, 1.0], [0, 1.0, 1.0], [1.0, 1.0, 1.0]]), 0.5)  # seeds 3, 2, 1: 2, 2, 1
    compared = mine.against(reference, horizon=3)
    assert (compared.earlier, compared.later, compared.same) == (2, 0, 1)  # seed 1: 1 < 3; seed 3: 2 < 4 (never)
    assert compared.p_value == pytest.approx(signed_rank_p([1 - 3, 2 - 4]))
    assert (reference.reached, reference.median, reference.first, reference.last) == (2, 2.5, 2, 3)
    assert reference.text() == "2.5 [2, 3] (2/3)"


def test_report_with_reach_shows_the_paired_table_and_its_numbers(tmp_path):
    root = fake_experiment(tmp_path / "fake")
    report, _ = write_report(root, reach=0.9)
    rows = table(report.read_text(), "| mechanism | median [first, last]")
    # FULL's seeds first reach 0.9 at epochs 3, 3, never; TOPK:3's at 2, 2, 3; BAND:3(1) never.
    assert rows["FULL"][:2] == ["3 [3, 3] (2/3)", "(reference)"]
    assert rows["TOPK:3"][:2] == ["2 [2, 3] (3/3)", "3 / 0 / 0"]
    assert rows["TOPK:3"][2] == f"{signed_rank_p([2 - 3, 2 - 3, 3 - 5]):.3g}"
    assert rows["BAND:3(1)"][:2] == ["never (0/3)", "0 / 2 / 1"]  # never, against 3, 3 and never
    summary = strict_json((root / "summary.json").read_text())
    reach = summary["settings"]["default"]["mechanisms"]["TOPK:3"]["reach"]
    assert reach["epochs"] == [2, 2, 3] and reach["earlier"] == 3 and reach["threshold"] == 0.9


def test_report_without_reach_has_no_paired_table_and_bad_reach_is_refused(tmp_path, capsys):
    root = fake_experiment(tmp_path / "fake")
    report, _ = write_report(root)
    assert "seed by seed against" not in report.read_text()
    assert "reach" not in json.loads((root / "summary.json").read_text())["settings"]["default"]["mechanisms"]["FULL"]
    assert main([str(root), "--reach", "1.5"]) == 2
    assert "reach must be a held-out accuracy in (0, 1], got 1.5" in capsys.readouterr().err

import math

import pytest

from sparsefocus.analysis.bounds import (
    PAPER_TABLE,
    BoundInputs,
    check_columns,
    columns_from_summaries,
    columns_from_table,
    format_bound_report,
    keeps_top_scores,
    paper_bound_report,
    w_form_lhs,
    x_form_sides,
)

# W-form left sides per column worked out by hand from the paper's table, 2 decimals (reference sheet, section 6).
EXPECTED_W = {
    "ListOps": [0.97, 0.69, 0.56, 0.57],
    "Parity": [0.70, 0.76, 0.80, 1.22],
    "Even pairs": [3.17, 1.98, 1.32, 1.80],
    "Missing dup": [1.53, 1.09, 0.67, 1.14],
}


@pytest.mark.parametrize("task", list(PAPER_TABLE))
def test_w_form_matches_the_hand_computed_left_sides_of_the_paper_table(task):
    values = [w_form_lhs(column) for column in columns_from_table(PAPER_TABLE[task])]
    for got, expected in zip(values, EXPECTED_W[task]):
        assert abs(got - expected) <= 0.006, (task, values)  # the sheet rounds to 2 decimals


def test_x_form_on_the_listops_p75_column():
    # delta_s 8.61, delta_h 3.51, Delta 0.016, beta 1 -> sink ratio 0.2
    left, right = x_form_sides(BoundInputs(8.61, 3.51, 0.016, 0.2))
    expected_left = 3.51 / 8.61 + math.log(8.61 * 1.2 * (1 + 1 / 0.016) + 0.2) / 8.61
    assert left == pytest.approx(expected_left, rel=1e-12)
    assert left == pytest.approx(1.16104, abs=1e-4)
    assert right == pytest.approx(1 + math.log(9.61) / 8.61, rel=1e-12)


def test_zero_separation_is_floored_instead_of_dividing_by_zero():
    assert math.isfinite(w_form_lhs(BoundInputs(10.0, 1.0, 0.0, 1.0)))
    assert w_form_lhs(BoundInputs(10.0, 1.0, 0.0, 1.0)) == w_form_lhs(BoundInputs(10.0, 1.0, 1e-9, 1.0))


def test_report_says_which_side_each_column_falls_on():
    report = paper_bound_report()
    listops = report.split("Parity:")[0]
    assert listops.count("holds") == 8
    parity_max = [line for line in report.split("Even pairs:")[0].splitlines() if "max" in line][-1]
    assert "W-form LHS 1.220 < 1: fails" in parity_max


def test_summaries_feed_the_bound_check():
    full = {"pooled": {"full_dispersion": {"p75": 8.61, "p90": 18.5, "p95": 29.4, "p100": 87.8}}}
    sparse = {
        "pooled": {
            "dispersion": {"p75": 3.51, "p90": 6.74, "p95": 9.67, "p100": 28.2},
            "separation": {"p25": 0.016, "p10": 0.005, "p5": 0.002, "p0": 1e-9},
            "sink_ratio": {"p75": 0.2, "p90": 0.6, "p95": 3.0, "p100": 119.6},
        }
    }
    from_summaries = check_columns(columns_from_summaries(full, sparse))
    from_table = check_columns(columns_from_table(PAPER_TABLE["ListOps"]))
    for a, b in zip(from_summaries, from_table):
        assert a["w_lhs"] == pytest.approx(b["w_lhs"]) and a["x_lhs"] == pytest.approx(b["x_lhs"])
    assert "ListOps" in format_bound_report("ListOps", from_summaries)


def test_nan_statistics_and_short_rows_are_rejected():
    with pytest.raises(ValueError, match="finite"):
        check_columns([BoundInputs(float("nan"), 1.0, 1.0, 1.0)])
    with pytest.raises(ValueError, match="4 values"):
        columns_from_table({"full_dispersion": [1.0]})


def test_columns_with_non_positive_raw_separation_are_not_applicable():
    sparse = {"pooled": {"separation_raw": {"p25": 0.1, "p10": -0.5, "p5": -1.0, "p0": -3.0}}}
    assert keeps_top_scores(sparse) == [True, False, False, False]
    assert keeps_top_scores({"pooled": {}}) == [True] * 4
    results = check_columns(columns_from_table(PAPER_TABLE["Parity"]))
    results[1]["applies"] = False
    lines = format_bound_report("BAND", results).splitlines()
    assert "not applicable" in lines[2] and "W-form" in lines[1]

"""Learning speed against dispersion: censored quantiles, Spearman's rho and its permutation p,
the points read from a report's summary and an analysis, the files, and ``analyze --summary``."""

import json
import math

import numpy as np
import pytest

from sparsefocus.analysis.commands import main
from sparsefocus.analysis.speed_dispersion import (
    censored_quantiles,
    check_summary,
    collect_points,
    correlation,
    permutation_p,
    short_names,
    spearman,
    write_speed_dispersion,
)


def test_censored_quantiles_count_unreached_seeds_as_latest():
    assert censored_quantiles([10, 20, 30, 40, 50]) == (20.0, 30.0, 40.0)
    assert censored_quantiles([4, 2, 3, 1]) == (1.75, 2.5, 3.25)
    # one seed never reaches: it is the latest, so the upper quartile, past the last that reaches, is None
    assert censored_quantiles([10, 20, 30, None, 40]) == (20.0, 30.0, 40.0)
    assert censored_quantiles([10, 20, None, 30]) == (17.5, 25.0, None)
    assert censored_quantiles([10, None, None, None]) == (None, None, None)
    assert censored_quantiles([10, 20, None, None]) == (17.5, None, None)


def test_spearman_on_ranks_with_ties():
    x = np.array([1.0, 2.0, 3.0, 4.0, 5.0])
    assert spearman(x, x**3) == pytest.approx(1.0)
    assert spearman(x, -x) == pytest.approx(-1.0)
    # ties take their mean rank: ranks of y are (1.5, 1.5, 3, 4, 5)
    y = np.array([2.0, 2.0, 3.0, 7.0, 9.0])
    ry = np.array([1.5, 1.5, 3, 4, 5]) - 3
    assert spearman(x, y) == pytest.approx(float((np.arange(-2, 3) * ry).sum() / math.sqrt(10 * (ry**2).sum())))
    assert math.isnan(spearman(x, np.ones(5)))


def test_permutation_p_is_small_for_a_perfect_order_and_large_for_none():
    x = np.arange(7.0)
    # 2 of 7! pairings are as correlated as the perfect order (it or its reverse): p about 4e-4
    assert permutation_p(x, x, draws=5000) < 0.005
    assert permutation_p(x, np.array([3.0, 0, 6, 2, 5, 1, 4]), draws=5000) > 0.2
    assert permutation_p(x, x, draws=2000) == permutation_p(x, x, draws=2000)  # seeded


def stats(kept: float, every: float) -> dict:
    return {"statistics": {"pooled": {"dispersion": {"p75": kept, "p90": kept}, "full_dispersion": {"p75": every, "p90": every}}}}


def reached(epochs: list, threshold: float = 0.9, length: int = 50) -> dict:
    return {"reach": {"threshold": threshold, "epochs": epochs}, "median": {"valid_acc": [0.5] * length}}


@pytest.fixture
def study():
    summary = {
        "settings": {
            "default": {
                "mechanisms": {
                    "FULL": reached([40, 44, 48]),
                    "TOPK:5": reached([10, 12, None]),
                    "moba:block=5": reached([20, 26, 30]),
                    "moba:block=8": reached([None, None, 30]),
                    "only-reported": reached([1, 2, 3]),
                }
            }
        }
    }
    analysis = {
        "settings": {
            "default": {
                "mechanisms": {
                    "FULL": stats(2.0, 2.0),
                    "TOPK:5": stats(1.0, 4.0),
                    "moba:block=5": stats(3.0, 4.0),
                    "moba:block=8": stats(3.0, 3.2),
                    "only-analysed": stats(1.0, 1.0),
                }
            }
        }
    }
    return summary, analysis


def test_points_pair_the_summary_with_the_analysis(study):
    points = collect_points(*study)
    assert [p.mechanism for p in points] == ["FULL", "TOPK:5", "moba:block=5", "moba:block=8"]
    full, topk, moba, late = points
    assert (full.ratio, full.vs_full, full.median) == (1.0, 1.0, 44.0)
    assert (topk.ratio, topk.vs_full, topk.median, topk.q75, topk.reached) == (0.25, 0.5, 12.0, None, 2)
    assert (moba.ratio, moba.vs_full) == (0.75, 1.5) and late.median is None
    # the three with a median: the same order on the ratio axis as in epochs; against FULL's
    # dispersion ranks (2, 1, 3) against epochs' (3, 1, 2)
    assert correlation(points)["rho"] == pytest.approx(1.0)
    assert correlation(points)["mechanisms"] == 3
    assert correlation(points, "vs_full")["rho"] == pytest.approx(0.5)
    assert collect_points(*study, percentile="p90")[1].ratio == 0.25
    assert short_names([p.mechanism for p in points]) == ["FULL", "TOPK", "moba (1)", "moba (2)"]


def test_missing_pieces_fail_by_name(study):
    summary, analysis = study
    with pytest.raises(ValueError, match="percentile"):
        collect_points(summary, analysis, percentile="p50")
    with pytest.raises(ValueError, match="setting 'other'"):
        collect_points(summary, analysis, setting="other")
    del summary["settings"]["default"]["mechanisms"]["FULL"]["reach"]
    with pytest.raises(ValueError, match="no reach statistics for FULL"):
        check_summary(summary)
    with pytest.raises(ValueError, match="--reach"):
        collect_points(summary, analysis)
    with pytest.raises(ValueError, match="no settings"):
        check_summary({})


def test_files_hold_the_table_and_the_figure(study, tmp_path):
    paths = write_speed_dispersion(*study, tmp_path)
    assert [p.name for p in paths] == ["speed_dispersion.md", "speed_dispersion.png"]
    text = paths[0].read_text()
    assert "| TOPK:5 | 2/3 | 12 [11, -] | 1 | 4 | 0.5 | 0.25 |" in text
    assert "| moba:block=8 | 1/3 | - |" in text
    assert "- kept keys / all keys of the same model: Spearman's rho over 3 mechanisms 1.00" in text
    assert "- kept keys / FULL's all keys: Spearman's rho over 3 mechanisms 0.50" in text
    assert paths[1].read_bytes().startswith(b"\x89PNG")
    assert not list(tmp_path.glob(".*"))  # written through temporary names, none left


def test_without_full_only_the_own_model_axis_is_shown(study, tmp_path):
    summary, analysis = study
    del analysis["settings"]["default"]["mechanisms"]["FULL"]
    points = collect_points(summary, analysis)
    assert all(p.vs_full is None for p in points)
    text = write_speed_dispersion(summary, analysis, tmp_path)[0].read_text()
    assert "| TOPK:5 | 2/3 | 12 [11, -] | 1 | 4 | - | 0.25 |" in text
    assert "- kept keys / FULL's all keys: too few mechanisms with a median and a value (0)" in text


def test_analyze_with_a_summary_writes_the_speed_files(two_seed_parity, tmp_path, capsys):
    from sparsefocus.train.report import write_report

    experiment = two_seed_parity
    write_report(experiment)
    plain = experiment / "summary.json"
    argv = [str(experiment), "--batches", "1", "--batch-size", "20", "--out", str(tmp_path / "a"), "--summary", str(plain)]
    assert main(argv) == 2  # a report without --reach
    assert "write the report with --reach" in capsys.readouterr().err
    write_report(experiment, reach=0.01)
    assert main(argv) == 0
    text = (tmp_path / "a" / "speed_dispersion.md").read_text()
    assert "| FULL | 2/2 |" in text and "| TOPK:3 | 2/2 |" in text
    assert (tmp_path / "a" / "speed_dispersion.png").exists()
    summary = json.loads(plain.read_text())
    summary["settings"] = {"elsewhere": summary["settings"]["default"]}
    plain.write_text(json.dumps(summary))
    assert main(argv) == 2
    assert "share no setting" in capsys.readouterr().err

"""The paper's analysis conventions as options: the Lipschitz window of ``lgrads.py`` (half-open,
shifted by one step), the seed of its statistics (140439608) and its 0-based convergence epoch."""

import numpy as np
import pytest
import yaml

from sparsefocus.analysis.commands import (
    PAPER_ANALYSIS_SEED,
    AnalyzeOptions,
    chosen_runs,
    parse_args,
)
from sparsefocus.analysis.landscape import (
    Landscape,
    lipschitz_profile,
    neighbour_slopes,
    window_indices,
)
from sparsefocus.train.report import Curves, convergence_epoch, final_table


def test_paper_window_on_its_200_point_grid_is_shifted_by_one_step():
    alphas = np.linspace(-1, 1, 200)  # step 2/199; alphas[99] = -0.005, alphas[100] = +0.005
    assert window_indices(alphas, 0.01, "paper").tolist() == [98, 99]
    assert window_indices(alphas, 0.01, "centred").tolist() == [99, 100]


def test_paper_window_is_half_open_on_an_11_point_grid():
    alphas = np.linspace(-1, 1, 11)  # step 0.2
    assert window_indices(alphas, 0.4, "paper").tolist() == [3, 4, 5, 6]  # a = 0.4 (index 7) left out
    assert window_indices(alphas, 0.4, "centred").tolist() == [3, 4, 5, 6, 7]
    with pytest.raises(ValueError, match="window must be one of centred, paper"):
        window_indices(alphas, 0.4, "open")


def test_paper_profile_reads_the_slopes_of_its_own_window():
    alphas = np.linspace(-1, 1, 11)
    land = Landscape(alphas, (alphas[:, None] ** 2 + 3 * alphas[None, :]))  # slopes differ across the grid
    profile = lipschitz_profile(land, percentiles=(100,), window="paper")
    radius = profile["r"][1]
    inside = window_indices(alphas, radius, "paper")
    grid = land.loss[np.ix_(inside, inside)]
    expected = max(np.abs(np.diff(grid, axis=0)).max(), np.abs(np.diff(grid, axis=1)).max()) / land.step
    assert profile["p100"][1] == pytest.approx(expected)
    assert profile["p100"] != lipschitz_profile(land, percentiles=(100,))["p100"]
    assert neighbour_slopes(land, radius, "paper").size == 2 * len(inside) * (len(inside) - 1)


def fake_runs(root, seeds):
    paths = []
    for seed in seeds:
        folder = root / f"seed-{seed}"
        folder.mkdir()
        (folder / "config.yaml").write_text(yaml.safe_dump({"mechanism": "FULL", "label": "FULL", "seed": seed, "config": {}}))
        paths.append(folder)
    return paths


def test_the_analysed_seed_is_the_smallest_by_default_or_the_one_asked_for(tmp_path):
    paths = fake_runs(tmp_path, [129959864, PAPER_ANALYSIS_SEED, 153476998])
    assert chosen_runs(paths, AnalyzeOptions()) == paths[:1]
    assert chosen_runs(paths, AnalyzeOptions(seed=PAPER_ANALYSIS_SEED)) == [paths[1]]
    assert chosen_runs(paths, AnalyzeOptions(all_seeds=True)) == paths
    with pytest.raises(ValueError, match="seed 7 has no run of FULL; its seeds: 129959864, 140439608, 153476998"):
        chosen_runs(paths, AnalyzeOptions(seed=7))


def test_seed_option_on_the_command_line():
    assert parse_args(["runs", "--seed", "paper"]).seed == PAPER_ANALYSIS_SEED == 140439608
    assert parse_args(["runs"]).seed is None
    assert parse_args(["runs", "--seed", "12"]).seed == 12
    assert parse_args(["runs", "--lipschitz-window", "paper"]).lipschitz_window == "paper"
    with pytest.raises(SystemExit):
        parse_args(["runs", "--seed", "largest"])


def test_convergence_epoch_is_1_based_here_and_0_based_in_the_paper():
    accuracy = np.array([0.5, 0.9, 0.96, 0.94, 0.99])
    assert convergence_epoch(accuracy) == 3 and convergence_epoch(accuracy, epoch_base=0) == 2
    assert convergence_epoch(np.array([0.5, 0.6])) is None
    with pytest.raises(ValueError, match="epoch_base must be 1 or 0"):
        convergence_epoch(accuracy, epoch_base=2)


def test_the_report_table_says_which_convention_it_counts_in():
    values = {key: np.array([[0.1, 0.2, 0.3], [0.2, 0.3, 0.4]]) for key in ("train_loss", "valid_loss", "seconds")}
    values["valid_acc"] = np.array([[0.5, 0.96, 0.97], [0.96, 0.97, 0.98]])
    curves = {"FULL": Curves("FULL", [1, 2], values)}
    clean, paper = final_table(curves), final_table(curves, epoch_base=0)
    assert "| 1.5 ± 0.5 (2/2) |" in clean[2] and "counted from 0" not in clean[0]
    assert "| 0.5 ± 0.5 (2/2) |" in paper[2] and "counted from 0 as the paper" in paper[0]

"""benchmarks/study_docs.py: the committed dispersion record names no place outside the repository."""

from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def study_docs(bench_script):
    return bench_script("study_docs")


def test_an_experiment_outside_the_repository_is_named_by_its_folder(study_docs, tmp_path):
    experiment = tmp_path / "md" / "missing_duplicate"
    text = f"# Analysis of `{experiment}`\n{experiment}/default/FULL/seed-1\n"
    assert study_docs.portable(text, experiment, str(experiment), root=tmp_path / "repo") == (
        "# Analysis of `missing_duplicate`\nmissing_duplicate/default/FULL/seed-1\n"
    )


def test_an_experiment_inside_the_repository_keeps_its_relative_path(study_docs, tmp_path, monkeypatch):
    root = tmp_path / "repo"
    experiment = root / "docs" / "studies" / "even" / "experiment"
    experiment.mkdir(parents=True)
    monkeypatch.chdir(root)
    given = Path("docs/studies/even/experiment")
    text = f'{{"run_dir": "{experiment}", "runs": ["{given}/default/FULL/seed-1"]}}'
    assert study_docs.portable(text, given, str(given), root=root) == (
        '{"run_dir": "docs/studies/even/experiment", "runs": ["docs/studies/even/experiment/default/FULL/seed-1"]}'
    )


def test_a_path_without_a_slash_is_left_alone(study_docs, tmp_path, monkeypatch):
    """Analysed as ".", the record's dots stay dots (the absolute path is still replaced)."""
    monkeypatch.chdir(tmp_path)
    text = f"p75 1.5 in ./default and {tmp_path}/default"
    assert (
        study_docs.portable(text, Path("."), ".", root=tmp_path / "repo") == f"p75 1.5 in ./default and {tmp_path.name}/default"
    )

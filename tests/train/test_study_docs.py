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


def test_a_study_record_with_reach_and_an_earlier_dispersion_gets_the_speed_files(study_docs, two_seed_parity, tmp_path):
    from sparsefocus.analysis.commands import AnalyzeOptions, analyze

    experiment = two_seed_parity
    out = tmp_path / "docs"
    out.mkdir()
    (out / "notes.md").write_text("How it ran.\n")
    written = {path.name for path in study_docs.write_study(experiment, out)}
    assert written == {"report.md", "curves.png", "summary.json"}  # no dispersion, no reach
    analyze(experiment, AnalyzeOptions(batches=1, batch_size=20), out / "analysis")
    (out / "analysis" / "analysis.json").rename(out / "dispersion.json")  # as an earlier call left it
    written = {path.name for path in study_docs.write_study(experiment, out, reach=0.01)}
    assert {"speed_dispersion.md", "speed_dispersion.png"} <= written
    assert "| TOPK:3 | 2/2 |" in (out / "speed_dispersion.md").read_text()


@pytest.mark.parametrize("inside", [True, False])
def test_a_kept_experiment_holds_no_second_copy_of_the_record(study_docs, tmp_path, monkeypatch, inside):
    """The report written into the experiment folder is copied to the study folder; where the
    experiment is kept inside that folder the copies in the experiment are removed, elsewhere (a
    runs/ folder) they stay."""
    out = tmp_path / "study"
    out.mkdir()
    (out / "notes.md").write_text("how it was run\n")
    experiment = out / "experiment" if inside else tmp_path / "runs" / "study"
    experiment.mkdir(parents=True)

    def fake_report(folder, preface, reach):
        for name in study_docs.COPIED:
            (folder / name).write_text(f"{name} of {folder.name}\n")

    monkeypatch.setattr(study_docs, "write_report", fake_report)
    written = study_docs.write_study(experiment, out)
    for name in study_docs.COPIED:
        assert (out / name).read_text() == f"{name} of {experiment.name}\n" and out / name in written
        assert (experiment / name).exists() is not inside

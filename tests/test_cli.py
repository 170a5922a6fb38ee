"""The command line: one-line errors on stderr with a non-zero status, checks before anything is
written, --version, and help that shows every option's default."""

import pytest
import torch

from sparsefocus import cli
from sparsefocus.analysis import commands as analyze
from sparsefocus.analysis import pictures
from sparsefocus.train import commands as train
from sparsefocus.train import demo


def exit_code(function, argv):
    with pytest.raises(SystemExit) as stop:
        function(argv)
    return stop.value.code


def test_version_prints_the_package_version(capsys):
    assert cli.main(["--version"]) == 0
    assert capsys.readouterr().out.startswith("sparsefocus 0.")


def test_an_unknown_command_is_one_line_on_stderr(capsys):
    assert cli.main(["trian"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1 and "'trian'" in captured.err


def test_malformed_yaml_names_the_file_and_line_in_one_line(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\nmodel: {blocks: 2\n")
    assert train.main([str(bad), f"out_dir={tmp_path}"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1
    assert str(bad) in captured.err and "not valid YAML at line" in captured.err


def test_a_missing_config_file_is_one_line(tmp_path, capsys):
    assert train.main([str(tmp_path / "none.yaml")]) == 2
    assert capsys.readouterr().err.count("\n") == 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA")
def test_cuda_device_without_cuda_is_refused_before_anything_is_written(tmp_path, capsys):
    assert train.main(["defaults", f"out_dir={tmp_path}", "train.device=cuda"]) == 2
    assert "train.device is 'cuda'" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("seeds", ["0", "11", "20"])
def test_demo_refuses_more_seeds_than_the_paper_has(seeds, tmp_path, capsys):
    assert exit_code(demo.main, ["--out", str(tmp_path), "--seeds", seeds]) == 2
    assert "--seeds must be between 1 and 10" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


def test_patterns_refuses_an_output_in_a_missing_folder(tmp_path, capsys):
    missing = tmp_path / "missing" / "p.png"
    assert exit_code(pictures.main, ["TOPK:5", "--out", str(missing)]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert not missing.parent.exists()


@pytest.mark.parametrize("option", [["--grid", "5"], ["--radius", "0.5"], ["--landscape-samples", "10"]])
def test_analyze_refuses_landscape_options_without_landscape(option, tmp_path, capsys):
    assert exit_code(analyze.main, [str(tmp_path), *option]) == 2
    assert "only applies with --landscape" in capsys.readouterr().err


def test_analyze_of_a_missing_folder_is_one_line_on_stderr(tmp_path, capsys):
    assert analyze.main([str(tmp_path / "none")]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1


@pytest.mark.parametrize(
    "module,expected",
    [(demo, "(default: runs)"), (pictures, "(default: 64)"), (analyze, "(default: 10)")],
)
def test_help_shows_defaults_and_no_markup(module, expected, capsys):
    assert exit_code(module.main, ["--help"]) == 0
    text = capsys.readouterr().out
    assert expected in text and "``" not in text

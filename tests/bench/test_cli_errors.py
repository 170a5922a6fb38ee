"""User errors of ``sparsefocus bench``: one line on stderr, a non-zero exit, no files written;
every option documented with its default."""

import argparse

import pytest
import torch

import sparsefocus.bench.model as model_bench
from sparsefocus.bench import registry
from sparsefocus.bench.registry import BenchShape, Workload
from sparsefocus.bench.run import build_parser, main

SMALL = ["--n", "8", "--batch", "1", "--heads", "1", "--head-dim", "4", "--dtype", "fp32", "--warmup", "0", "--repeats", "1"]
TINY_MODEL = [
    "--model",
    "--blocks",
    "1",
    "--dim",
    "16",
    "--heads",
    "2",
    "--mlp",
    "16",
    "--lengths",
    "16",
    "--steps",
    "1",
    "--warmup",
    "1",
]


def assert_one_line_error(capsys, text: str) -> None:
    err = capsys.readouterr().err.strip().splitlines()
    assert err and err[-1].startswith("sparsefocus bench: error:") and text in err[-1]
    assert not any("Traceback" in line for line in err)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
@pytest.mark.parametrize("extra", [["TOPK:4"], TINY_MODEL])
def test_cuda_device_without_cuda_is_a_one_line_error(tmp_path, capsys, extra):
    out = tmp_path / "b.json"
    assert main([*extra, "--device", "cuda", "--out", str(out)]) == 2
    assert_one_line_error(capsys, "CUDA is not available")
    assert list(tmp_path.iterdir()) == []


def test_cuda_graphs_on_the_cpu_is_a_one_line_error(tmp_path, capsys):
    out = tmp_path / "b.json"
    assert main(["TOPK:4", "--cuda-graphs", *SMALL, "--device", "cpu", "--out", str(out)]) == 2
    assert_one_line_error(capsys, "--cuda-graphs needs a CUDA device")
    assert list(tmp_path.iterdir()) == []


def test_every_case_failing_exits_1_and_writes_nothing(tmp_path, capsys):
    def broken(argument: str, shape: BenchShape) -> Workload:
        raise RuntimeError("this case always fails")

    registry.register_case("always_broken_case", broken)
    try:
        out = tmp_path / "b.json"
        assert main(["always_broken_case", "--baselines", "sdpa:math", *SMALL, "--device", "cpu", "--out", str(out)]) == 1
    finally:
        registry.CASES.pop("always_broken_case")
    captured = capsys.readouterr()
    assert "this case always fails" in captured.err and "this case always fails" not in captured.out
    assert captured.err.strip().splitlines()[-1] == "sparsefocus bench: error: every requested case failed; no files written"
    assert list(tmp_path.iterdir()) == []


def test_every_model_case_failing_exits_1_and_writes_nothing(tmp_path, capsys, monkeypatch):
    def broken_step(*args, **kwargs):
        raise RuntimeError("no model today")

    monkeypatch.setattr(model_bench, "make_step", broken_step)
    out = tmp_path / "m.json"
    assert main([*TINY_MODEL, "--patterns", "BAND:4", "--device", "cpu", "--compile", "off", "--out", str(out)]) == 1
    assert_one_line_error(capsys, "every model case failed")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "bad, text",
    [
        (["--lengths", "70000"], "--lengths"),
        (["--patterns", "NOPE:3"], "NOPE:3"),
        (["--heads", "3"], "divide"),
        (["--top-kernels", "-1"], "--top-kernels"),
    ],
)
def test_bad_model_options_name_the_option(tmp_path, capsys, bad, text):
    assert main([*TINY_MODEL, "--device", "cpu", *bad, "--out", str(tmp_path / "m.json")]) == 2
    assert_one_line_error(capsys, text)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("parser", [build_parser(), model_bench.build_parser()], ids=["kernels", "model"])
def test_every_option_has_help_with_its_default(parser):
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        assert action.help, f"{action.dest} has no help"
    text = parser.format_help()
    assert "(default:" in text
    if parser.prog.endswith("--model"):
        for option in (
            "--blocks",
            "--dim",
            "--heads",
            "--mlp",
            "--lengths",
            "--batch",
            "--patterns",
            "--compile",
            "--steps",
            "--warmup",
            "--dtype",
        ):
            assert option in text


@pytest.mark.parametrize(
    "assignment, text",
    [
        ("KEY_GRADS=inverse", "MODULE.NAME=VALUE"),
        ("sparsefocus.kernels.indexed.NO_SUCH_THING=1", "has no constant NO_SUCH_THING"),
        ("sparsefocus.no_such_module.X=1", "no module sparsefocus.no_such_module"),
        ("sparsefocus.kernels.indexed.KEY_GRADS", "MODULE.NAME=VALUE"),
    ],
)
@pytest.mark.parametrize("extra", [["TOPK:4", *SMALL], [*TINY_MODEL, "--patterns", "BAND:4", "--compile", "off"]])
def test_bad_constants_are_one_line_errors(tmp_path, capsys, assignment, text, extra):
    assert main([*extra, "--device", "cpu", "--constant", assignment, "--out", str(tmp_path / "b.json")]) == 2
    assert_one_line_error(capsys, text)
    assert list(tmp_path.iterdir()) == []

"""The GPU compile check's choice of patterns (the checks themselves need CUDA)."""

import pytest


@pytest.fixture(scope="module")
def check(bench_script):
    return bench_script("gpu_compile_check")


def test_names_and_specs_pick_their_patterns(check):
    assert check.triton_specs(["zeta", "band", "BAND:128"]) == ["zeta", "BAND:64", "BAND:128"]
    every = check.triton_specs(None)
    assert "TOPK:32" in every and "zeta" in every and not any(s.lower().startswith("full") for s in every)


@pytest.mark.parametrize(
    "text, message", [("nope", "is not a pattern"), ("BAND:x", "is not a pattern"), ("full", "has no Triton path")]
)
def test_a_name_it_cannot_check_is_refused_by_name(check, text, message):
    with pytest.raises(SystemExit, match=message):
        check.triton_specs([text])


def test_a_bad_constant_is_refused_before_any_check(check, monkeypatch, tmp_path):
    argv = ["gpu_compile_check.py", "--device", "cpu", "--out", str(tmp_path), "--constant", "sparsefocus.kernels._ops.NOPE=1"]
    monkeypatch.setattr("sys.argv", argv)
    with pytest.raises(SystemExit, match="sparsefocus.kernels._ops has no constant NOPE"):
        check.main()
    assert not list(tmp_path.iterdir())

import json
import math
import shutil

import pytest
import torch
import yaml

pytest.importorskip("sparsefocus.train.experiment")

from sparsefocus.analysis.commands import main
from sparsefocus.analysis.pictures import main as patterns_main
from sparsefocus.analysis.runs import load_run
from sparsefocus.layers.attention import SparseAttention
from sparsefocus.train.config import from_dict
from sparsefocus.train.experiment import run_experiment


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """FULL and TOPK:3 trained for one epoch on 8-bit parity."""
    config = from_dict(
        {
            "name": "tiny",
            "out_dir": str(tmp_path_factory.mktemp("runs")),
            "task": {"name": "parity", "length": 8, "num_train": 60, "num_valid": 20},
            "model": {"blocks": 2, "heads": 2, "dim": 8, "mlp_dim": 8},
            "train": {"epochs": 1},
            "mechanisms": ["FULL", "TOPK:3"],
            "seeds": [1],
        }
    )
    return run_experiment(config, quiet=True)


def test_analyze_writes_the_paper_table_bounds_recall_and_landscape(tiny_run, capsys):
    argv = [str(tiny_run), "--batches", "2", "--batch-size", "30", "--landscape", "--grid", "3", "--landscape-samples", "20"]
    assert main(argv) == 0
    out = tiny_run / "analysis"
    report = json.loads((out / "analysis.json").read_text())
    mechanisms = report["settings"]["default"]["mechanisms"]
    assert list(mechanisms) == ["FULL", "TOPK:3"]
    topk = mechanisms["TOPK:3"]
    assert topk["samples_per_seed"] == 60
    assert list(topk["statistics"]["per_layer"]) == ["blocks.0.attn", "blocks.1.attn"]
    assert topk["statistics"]["pooled"]["sinks"]["p100"] <= 8  # at most every query keeps a key
    assert topk["recall"]["pooled"]["mean"] == 1.0  # exact top-k recalls itself
    assert mechanisms["FULL"]["recall"] is None
    full = mechanisms["FULL"]["statistics"]["pooled"]
    assert full["dispersion"] == full["full_dispersion"]
    assert len(report["settings"]["default"]["bounds"]["TOPK:3"]["columns"]) == 4
    markdown = (out / "analysis.md").read_text()
    assert "| TOPK:3 |" in markdown and "W-form" in markdown
    for name in ("landscape.png", "lipschitz.png"):
        assert (out / name).read_bytes().startswith(b"\x89PNG")
    assert "The paper's table" in capsys.readouterr().out


def test_patterns_on_a_run_and_its_attention_maps(tiny_run, tmp_path):
    assert patterns_main(["TOPK:3", "BAND:3", "--run", str(tiny_run), "--out", str(tmp_path / "m.png")]) == 0
    assert patterns_main(["--attention", "--run", str(tiny_run), "--layer", "1", "--out", str(tmp_path / "a.png")]) == 0
    for name in ("m.png", "a.png"):
        assert (tmp_path / name).read_bytes().startswith(b"\x89PNG")
    assert patterns_main(["--attention", "--run", str(tiny_run), "--layer", "5", "--out", str(tmp_path / "x.png")]) == 2


def test_analyze_errors_and_paper_bounds(tmp_path, capsys):
    assert main([str(tmp_path / "missing")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["--paper-bounds"]) == 0
    assert "ListOps" in capsys.readouterr().out


def test_analysis_of_a_paper_mode_run_is_the_same_every_time(tmp_path):
    """The paper's attention dropout stays on in evaluation, so the analysis fixes its draws: two
    analyses of the same run give the same statistics, whatever the random state before them."""
    config = from_dict(
        {
            "name": "paper",
            "out_dir": str(tmp_path / "runs"),
            # ListOps: its data does not reseed torch on loading, as the generated tasks do
            "task": {
                "name": "listops",
                "preset": "lra",
                "max_depth": 3,
                "max_args": 3,
                "min_length": 10,
                "max_length": 40,
                "num_train": 40,
                "num_valid": 16,
            },
            "model": {"blocks": 2, "heads": 1, "dim": 8, "mlp_dim": 8, "paper_mode": True, "dropout": 0.3},
            "train": {"epochs": 1},
            "mechanisms": ["TOPK:3"],
            "seeds": [1],
        }
    )
    root = run_experiment(config, quiet=True)
    reports = []
    for name, state in (("a", 1), ("b", 2)):
        torch.manual_seed(state)  # whatever the process drew before
        assert main([str(root), "--batches", "1", "--batch-size", "40", "--out", str(tmp_path / name)]) == 0
        reports.append(json.loads((tmp_path / name / "analysis.json").read_text())["settings"])
    pooled = reports[0]["default"]["mechanisms"]["TOPK:3"]["statistics"]["pooled"]
    assert all(math.isfinite(value) for value in pooled["dispersion"].values())
    assert reports[0] == reports[1]


def _run_trained_on_triton(tiny_run, tmp_path):
    """A copy of the TOPK:3 run recorded as trained with ``impl="triton"`` (as on a GPU)."""
    run = tmp_path / "seed-1"
    shutil.copytree(tiny_run / "default" / "TOPK-3" / "seed-1", run)
    record = yaml.safe_load((run / "config.yaml").read_text())
    record["config"]["model"]["impl"] = "triton"
    (run / "config.yaml").write_text(yaml.safe_dump(record))
    return run


def test_a_run_trained_on_triton_is_analysed_on_the_cpu_path_even_where_cuda_exists(tiny_run, tmp_path, monkeypatch):
    run = _run_trained_on_triton(tiny_run, tmp_path)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    layers = [m for m in load_run(run).model.modules() if isinstance(m, SparseAttention)]
    assert layers and all(layer.impl == "auto" for layer in layers)  # CPU tensors never reach a GPU kernel


def test_analyze_refuses_a_device_it_cannot_use(tiny_run, capsys):
    bad = ["tpu"] if torch.cuda.is_available() else ["tpu", "cuda"]
    for name in bad:
        with pytest.raises(SystemExit):
            main([str(tiny_run), "--device", name])
        assert "--device" in capsys.readouterr().err


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_analysis_on_cuda_matches_the_cpu_and_keeps_the_trained_implementation(tiny_run, tmp_path):
    run = _run_trained_on_triton(tiny_run, tmp_path)
    layers = [m for m in load_run(run, "cuda").model.modules() if isinstance(m, SparseAttention)]
    assert layers and all(layer.impl == "triton" and layer.q_proj.weight.is_cuda for layer in layers)
    pooled = {}
    for device in ("cpu", "cuda"):
        assert main([str(run), "--batches", "2", "--batch-size", "30", "--device", device, "--out", str(tmp_path / device)]) == 0
        report = json.loads((tmp_path / device / "analysis.json").read_text())
        pooled[device] = report["settings"]["default"]["mechanisms"]["TOPK:3"]["statistics"]["pooled"]
    for metric, values in pooled["cpu"].items():
        for key, value in values.items():
            assert pooled["cuda"][metric][key] == pytest.approx(value, rel=1e-3, abs=1e-4), (metric, key)


def _mechanisms(out):
    return json.loads((out / "analysis.json").read_text())["settings"]["default"]["mechanisms"]


def test_update_keeps_unchanged_mechanisms_and_redoes_changed_ones(tiny_run, tmp_path, monkeypatch, capsys):
    from sparsefocus.analysis import commands

    root = tmp_path / "exp"
    shutil.copytree(tiny_run, root, ignore=shutil.ignore_patterns("analysis"))
    out, argv = tmp_path / "out", ["--batches", "1", "--batch-size", "30"]
    assert main([str(root), *argv, "--out", str(out)]) == 0
    first = _mechanisms(out)
    analysed = []
    real = commands.analyze_group
    monkeypatch.setattr(
        commands, "analyze_group", lambda paths, *rest: analysed.append(paths[0].parent.name) or real(paths, *rest)
    )
    assert main([str(root), *argv, "--out", str(out), "--update"]) == 0
    assert analysed == [] and _mechanisms(out) == first
    assert "TOPK:3 (default) unchanged" in capsys.readouterr().err

    checkpoint = root / "default" / "TOPK-3" / "seed-1" / "checkpoint.pt"
    state = torch.load(checkpoint, weights_only=False)
    state["model"] = {name: value + 0.1 if value.is_floating_point() else value for name, value in state["model"].items()}
    torch.save(state, checkpoint)
    assert main([str(root), *argv, "--out", str(out), "--update"]) == 0
    assert analysed == ["TOPK-3"]
    assert main([str(root), *argv, "--out", str(tmp_path / "fresh")]) == 0
    updated, fresh = _mechanisms(out), _mechanisms(tmp_path / "fresh")
    assert updated == fresh and updated["FULL"] == first["FULL"] and updated["TOPK:3"] != first["TOPK:3"]

    analysed.clear()
    assert main([str(root), "--batches", "2", "--batch-size", "30", "--out", str(out), "--update"]) == 0
    assert sorted(analysed) == ["FULL", "TOPK-3"]  # other options: everything again
    assert "other options" in capsys.readouterr().err


def test_update_refuses_landscapes_and_reports_a_broken_earlier_analysis(tiny_run, tmp_path, capsys):
    with pytest.raises(SystemExit):
        main([str(tiny_run), "--update", "--landscape"])
    assert "--update" in capsys.readouterr().err
    (tmp_path / "analysis.json").write_text("[1, 2]")
    assert main([str(tiny_run), "--update", "--out", str(tmp_path)]) == 2
    assert "is not an analysis report" in capsys.readouterr().err

"""benchmarks/zeta_recall_trained.py: ZETA candidate recall on the q/k a run's model produces."""

import json
import math

import pytest
import torch

from sparsefocus.analysis.runs import find_runs, load_run
from sparsefocus.attention.patterns import parse_pattern
from sparsefocus.train.config import from_dict
from sparsefocus.train.experiment import run_experiment

PATTERN = "zeta:k=4,window=6,chunks=4,local=3"


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """A two-block causal decoder with ZETA attention, one epoch on a tiny MQAR (near its initialisation)."""
    config = from_dict(
        {
            "name": "tiny",
            "out_dir": str(tmp_path_factory.mktemp("runs")),
            "task": {"name": "mqar", "vocab_size": 64, "seq_len": 32, "num_kv_pairs": 4, "num_train": 32, "num_valid": 8},
            "model": {"blocks": 2, "heads": 2, "dim": 16, "mlp_dim": 16, "impl": "lean"},
            "train": {"epochs": 1, "batch_size": 16, "device": "cpu", "threads": 1},
            "mechanisms": [PATTERN],
            "seeds": [3],
        }
    )
    return find_runs(run_experiment(config, quiet=True))[0]


def test_collect_qk_gives_each_zeta_layer_its_projected_qk(tiny_run, bench_script):
    script = bench_script("zeta_recall_trained")
    layers = script.collect_qk(load_run(tiny_run), examples=8, batch_size=3)
    assert list(layers) == ["blocks.0.attn", "blocks.1.attn"]
    for layer in layers.values():
        assert layer.causal and layer.pattern == parse_pattern(PATTERN)
        assert layer.q.shape == layer.k.shape == (8, 2, 32, 3)  # batches concatenated, d_K = 3


def test_recall_is_a_fraction_and_one_when_window_and_band_cover_every_key(tiny_run, bench_script):
    script = bench_script("zeta_recall_trained")
    layer = script.collect_qk(load_run(tiny_run), examples=8, batch_size=8)["blocks.0.attn"]
    # window 32 holds every earlier-chunk key; local 8 (the chunk at N <= 32) every own-chunk key
    patterns = [layer.pattern, parse_pattern("zeta:k=4,window=32,chunks=4,local=8")]
    rows = script.layer_recalls(layer, patterns, [16, 32], seed=0)
    assert {r["source"] for r in rows} == {"trained", "matched", "gaussian"} and len(rows) == 3 * 2 * 2
    for row in rows:
        assert 0.0 <= row["recall"] <= 1.0 and all(0.0 <= v <= 1.0 for v in row["recall_per_head"])
        if row["window"] == 32:
            assert row["recall"] == 1.0
    assert any(r["recall"] < 1.0 for r in rows if r["window"] == 6)  # the measurement can tell a narrow window


def test_matched_gaussian_keeps_mean_and_std_per_head_and_dimension(bench_script):
    script = bench_script("zeta_recall_trained")
    x = torch.randn(64, 2, 128, 3) * torch.tensor([0.5, 2.0, 4.0]) + torch.tensor([1.0, -3.0, 0.0])
    y = script.matched_gaussian(x, torch.Generator().manual_seed(0))
    assert torch.allclose(y.mean(dim=(0, 2)), x.mean(dim=(0, 2)), atol=0.05)
    assert torch.allclose(y.std(dim=(0, 2)), x.std(dim=(0, 2)), rtol=0.03)


def test_main_writes_json_and_a_table(tiny_run, tmp_path, capsys, bench_script):
    script = bench_script("zeta_recall_trained")
    out = tmp_path / "recall.json"
    assert script.main([str(tiny_run), "--out", str(out), "--examples", "4", "--lengths", "16"]) == 0
    report = json.loads(out.read_text())
    assert report["command"].startswith("python benchmarks/zeta_recall_trained.py") and report["commit"]
    layer = report["runs"][0]["layers"]["blocks.1.attn"]
    assert {r["n"] for r in layer["rows"]} == {16, 32}
    assert sum(r["own"] for r in layer["rows"]) == 3 * 2  # one own row per source and length
    assert all(math.isfinite(r["recall"]) for r in layer["rows"])
    assert "| curves × window | bits |" in capsys.readouterr().out

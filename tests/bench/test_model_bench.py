"""CPU run of ``sparsefocus bench --model`` at tiny sizes: the JSON has every field, eager and
compiled entries for every pattern, FULL under each backend with the fastest as baseline, and an
attention share taken from the profiler (including attention's backward). No timing assertions."""

import json

import torch
import torch.nn.functional as F

from sparsefocus.bench.model import marked_attention
from sparsefocus.bench.profiling import (
    BACKWARD_PREFIX,
    attention_events,
    attention_share,
    profile_events,
    top_kernels,
)
from sparsefocus.bench.run import main

TINY = [
    "--model",
    "--blocks",
    "1",
    "--dim",
    "32",
    "--heads",
    "2",
    "--mlp",
    "64",
    "--vocab",
    "32",
    "--lengths",
    "64",
    "--steps",
    "1",
    "--warmup",
    "1",
    "--device",
    "cpu",
]
OK_FIELDS = {
    "ms",
    "synced_ms",
    "tokens_per_s",
    "peak_mb",
    "attention_share",
    "attention_share_method",
    "launches",
    "first_step_s",
    "device_ms",
    "device_busy",
    "top_kernels",
    "full_ms",
    "full_backend",
    "vs_full",
}


def test_model_bench_json_has_every_field_and_both_modes(tmp_path):
    out = tmp_path / "model.json"
    assert main([*TINY, "--patterns", "FULL", "BAND:4", "--out", str(out)]) == 0
    payload = json.loads(out.read_text())
    assert payload["command"].startswith("sparsefocus bench --model")
    assert {"git_commit", "device", "torch", "triton", "config", "full_baseline", "results"} <= set(payload)
    assert payload["config"]["blocks"] == 1 and payload["config"]["optimizer"] == "AdamW"
    rows = payload["results"]
    entries = {(r["pattern"], r["sdpa_backend"], r["mode"]) for r in rows}
    for backend in ("cudnn", "flash", "efficient"):
        assert {("FULL", backend, "eager"), ("FULL", backend, "compiled")} <= entries
    assert {("BAND:4", None, "eager"), ("BAND:4", None, "compiled")} <= entries
    for row in rows:
        assert row["status"] in ("ok", "off", "unavailable"), row
        if row["mode"] == "compiled":
            assert row["status"] == "off" and row["error"]  # --compile both runs eager only on CPU
        if row["status"] == "ok":
            assert OK_FIELDS <= set(row)
            assert row["ms"] > 0 and row["synced_ms"] > 0 and row["tokens_per_s"] > 0
            assert row["peak_mb"] is None and row["launches"] is None  # CPU: nothing to report, not 0
            assert row["device_ms"] is None and row["device_busy"] is None
            assert 0.0 < row["attention_share"] < 1.0
            heaviest = row["top_kernels"]  # CPU: the ops by self CPU time
            assert 1 <= len(heaviest) <= 8 and all(set(op) == {"name", "ms", "calls"} for op in heaviest)
            assert [op["ms"] for op in heaviest] == sorted((op["ms"] for op in heaviest), reverse=True)
            assert all(op["calls"] >= 1 for op in heaviest)
    band = next(r for r in rows if r["pattern"] == "BAND:4" and r["mode"] == "eager")
    assert band["status"] == "ok" and band["vs_full"] > 0
    (baseline,) = payload["full_baseline"]
    assert baseline["n"] == 64 and baseline["mode"] == "eager" and baseline["backend"] in ("flash", "math")
    assert band["full_backend"] == baseline["backend"]
    assert (tmp_path / "model.png").stat().st_size > 0


def test_model_bench_records_the_compile_mode_and_optimizer(tmp_path):
    out = tmp_path / "model.json"
    argv = [*TINY, "--patterns", "FULL", "--full-backends", "math", "--compile", "off", "--out", str(out), "--no-plot"]
    assert main([*argv, "--compile-mode", "reduce-overhead", "--fused-optimizer"]) == 0
    config = json.loads(out.read_text())["config"]
    assert config["compile_mode"] == "reduce-overhead" and config["fused_optimizer"] is True
    assert main([*argv]) == 0
    config = json.loads(out.read_text())["config"]
    assert config["compile_mode"] == "default" and config["fused_optimizer"] is False


def test_attention_events_include_the_backward_of_marked_ops():
    q, k, v = (torch.randn(1, 2, 16, 8, requires_grad=True) for _ in range(3))
    weight = torch.randn(8, 8, requires_grad=True)

    def step():
        with torch.profiler.record_function("sparsefocus.attention"):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        (out @ weight).sum().backward()

    events = profile_events(step, torch.device("cpu"))
    names = [e.name for e in attention_events(events)]
    assert any(name.startswith(BACKWARD_PREFIX) and "Attention" in name for name in names)
    assert not any("MmBackward" in name for name in names)  # the matmul after attention is not attention
    assert 0.0 < attention_share(events, torch.device("cpu")) < 1.0


def test_marked_attention_restores_the_layer_function():
    import sparsefocus.layers.attention as layer

    original = layer.sparse_attention
    with marked_attention():
        assert layer.sparse_attention is not original
    assert layer.sparse_attention is original


def test_top_kernels_group_the_calls_of_one_name():
    a = torch.randn(48, 48)
    events = profile_events(lambda: [a @ a for _ in range(3)], torch.device("cpu"))
    heaviest = top_kernels(events, torch.device("cpu"), 50)
    (mm,) = [op for op in heaviest if op["name"] == "aten::mm"]
    assert mm["calls"] == 3 and mm["ms"] > 0
    assert top_kernels(events, torch.device("cpu"), 0) == []


def test_pipelined_timing_runs_warmup_then_repeats_back_to_back():
    import torch

    from sparsefocus.bench.runner import pipelined_ms

    calls = []
    ms = pipelined_ms(lambda: calls.append(len(calls)), torch.device("cpu"), warmup=2, repeats=5)
    assert len(calls) == 7 and ms >= 0

"""CPU run of ``sparsefocus bench``: every case x N x mode gives a row, the dense baselines and
their ratios are in the JSON, custom cases and their extra columns work, errors are recorded.
No timing assertions."""

import json

import pytest
import torch

from sparsefocus.bench import registry
from sparsefocus.bench.registry import (
    BenchShape,
    Workload,
    attention_flops,
    mean_keys,
    register_case,
)
from sparsefocus.bench.run import format_row, main
from sparsefocus.bench.runner import graphed_ms, measure

SMALL = [
    "--batch",
    "1",
    "--heads",
    "2",
    "--head-dim",
    "8",
    "--dtype",
    "fp32",
    "--warmup",
    "0",
    "--repeats",
    "1",
    "--device",
    "cpu",
]


def test_bench_cli_writes_json_with_dense_baselines_and_png(tmp_path):
    out = tmp_path / "bench.json"
    argv = ["TOPK:4", "indexed:4", "BAND:4", "--n", "16", "32", "--kv-heads", "1", "--causal", "--out", str(out), *SMALL]
    assert main(argv) == 0
    payload = json.loads(out.read_text())
    assert payload["command"].startswith("sparsefocus bench TOPK:4")
    assert {"git_commit", "device", "torch", "triton", "shape", "dense", "results"} <= set(payload)
    assert payload["ceilings"] is None  # CPU: no fractions of another device's peak
    rows = payload["results"]
    cases = ["sdpa:cudnn", "sdpa:flash", "sdpa:efficient", "sdpa:math", "flex", "TOPK:4", "indexed:4", "BAND:4"]
    assert list(dict.fromkeys(r["case"] for r in rows)) == cases
    assert len(rows) == len(cases) * 2 * 2
    status = {(r["case"], r["mode"]): r["status"] for r in rows}
    assert status[("sdpa:cudnn", "fwd")] == "unavailable"  # no cuDNN attention on CPU
    assert status[("sdpa:math", "fwd+bwd")] == "ok"
    assert status[("flex", "fwd+bwd")] == "unavailable"  # FlexAttention has no CPU backward
    for row in rows:
        if row["status"] == "unavailable":
            assert row["error"]
    mine = [r for r in rows if r["case"] in ("TOPK:4", "indexed:4", "BAND:4")]
    assert all(r["status"] == "ok" and r["ms"] > 0 and r["flops"] > 0 for r in mine)
    assert all(r["launches"] is None and "frac_peak_flops" not in r for r in mine)
    dense = {(d["n"], d["mode"]): d for d in payload["dense"]}
    assert set(dense) == {(n, m) for n in (16, 32) for m in ("fwd", "fwd+bwd")}
    for row in mine:
        best = dense[(row["n"], row["mode"])]
        assert best["backend"] in ("flash", "math")
        assert row["dense_backend_used"] == best["backend"]
        assert row["speedup_vs_dense"] == pytest.approx(best["ms"] / row["ms"])
    assert (tmp_path / "bench.png").stat().st_size > 0


def test_registered_case_extra_columns_and_errors_are_recorded(tmp_path):
    def scaled_sdpa(argument: str, shape: BenchShape) -> Workload:
        if argument == "fail":
            raise torch.OutOfMemoryError("out of memory (simulated)")
        if argument == "broken":
            raise RuntimeError("broken case\nsecond line")
        return Workload(
            forward=lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(q, k, v) * 1.0,
            flops=attention_flops(shape, shape.n),
            extra=lambda q, k, v: {"recall": 1.0},
        )

    register_case("scaled_test_case", scaled_sdpa)
    try:
        out = tmp_path / "b.json"
        argv = [
            "scaled_test_case",
            "scaled_test_case:fail",
            "scaled_test_case:broken",
            "--baselines",
            "--n",
            "8",
            "--out",
            str(out),
            "--no-plot",
            *SMALL,
        ]
        assert main(argv) == 0
        rows = json.loads(out.read_text())["results"]
        assert [r["status"] for r in rows] == ["ok", "ok", "oom", "oom", "error", "error"]
        assert rows[0]["recall"] == 1.0
        assert rows[4]["error"] == "RuntimeError: broken case"
        assert rows[0]["dense_ms"] is None and rows[0]["speedup_vs_dense"] is None  # no dense baseline ran
        with pytest.raises(ValueError, match="twice"):
            register_case("scaled_test_case", scaled_sdpa)
    finally:
        registry.CASES.pop("scaled_test_case")


def test_sdpa_alone_means_every_backend(tmp_path):
    out = tmp_path / "s.json"
    assert main(["sdpa", "--baselines", "--n", "8", "--modes", "fwd", "--out", str(out), "--no-plot", *SMALL]) == 0
    rows = json.loads(out.read_text())["results"]
    assert [r["case"] for r in rows] == ["sdpa:cudnn", "sdpa:flash", "sdpa:efficient", "sdpa:math"]
    assert [r["dense_backend"] for r in rows] == ["cudnn", "flash", "efficient", "math"]


def test_mean_keys_counts_causal_rows():
    shape = BenchShape(1, 1, 1, 8, 4, torch.float32, True, torch.device("cpu"))
    assert mean_keys(shape, 8) == pytest.approx(4.5)  # (1 + ... + 8) / 8
    assert mean_keys(shape, 2) == pytest.approx((6 * 2 + 1 + 2) / 8)


def test_zeta_case_reports_candidate_recall(tmp_path):
    out = tmp_path / "zeta.json"
    argv = [
        "zeta:k=4,window=6,chunks=2,local=2",
        "zeta:k=4,window=64,chunks=1,local=0",
        "--baselines",
        "--n",
        "24",
        "--out",
        str(out),
        "--no-plot",
        "--modes",
        "fwd",
        *SMALL,
    ]
    assert main(argv) == 0
    narrow, wide = json.loads(out.read_text())["results"]
    assert narrow["status"] == wide["status"] == "ok"
    assert 0.0 < narrow["recall"] <= 1.0
    assert wide["recall"] == pytest.approx(1.0)  # one chunk and a window wider than N sees every key
    with pytest.raises(ValueError, match="wider than"):
        registry.parse_case("zeta:dk=16", BenchShape(1, 1, 1, 8, 8, torch.float32, False, torch.device("cpu")))


@pytest.mark.parametrize("model", [False, True])
def test_constants_apply_during_the_run_are_recorded_and_restored(tmp_path, monkeypatch, model):
    """``--constant`` sets a module constant while the cases run (seen by the timed code), records
    it in the JSON and puts the old value back afterwards."""
    import sparsefocus.kernels.indexed as indexed
    from sparsefocus.bench import run

    import sparsefocus.bench.model as model_bench

    seen = []
    owner, name = (model_bench, "make_step") if model else (run, "measure")
    timed = getattr(owner, name)

    def spy(*args, **kwargs):  # the code under time sees the constant
        seen.append(indexed.KEY_GRADS)
        return timed(*args, **kwargs)

    monkeypatch.setattr(owner, name, spy)
    if model:
        argv = ["--model", "--blocks", "1", "--dim", "16", "--heads", "2", "--mlp", "16", "--lengths", "16"]
        argv += ["--steps", "1", "--warmup", "1", "--patterns", "BAND:4", "--compile", "off"]
    else:
        argv = ["TOPK:4", "--n", "8", "--batch", "1", "--heads", "1", "--head-dim", "4", "--dtype", "fp32"]
        argv += ["--warmup", "0", "--repeats", "1", "--no-plot"]
    out = tmp_path / "b.json"
    before = indexed.KEY_GRADS
    argv += ["--device", "cpu", "--constant", "sparsefocus.kernels.indexed.KEY_GRADS=inverse", "--out", str(out)]
    assert run.main(argv) == 0
    assert seen and set(seen) == {"inverse"}
    assert indexed.KEY_GRADS == before
    record = json.loads(out.read_text())
    assert record["constants"] == {"sparsefocus.kernels.indexed.KEY_GRADS": "inverse"}
    assert "--constant sparsefocus.kernels.indexed.KEY_GRADS=inverse" in record["command"]


def test_graph_timing_refuses_the_cpu():
    with pytest.raises(RuntimeError, match="CUDA graphs need a CUDA device"):
        graphed_ms(lambda: None, torch.device("cpu"), 1, 1)


def test_rows_print_their_graph_timing_or_why_it_failed():
    row = {"case": "zeta", "n": 4096, "mode": "fwd+bwd", "status": "ok", "ms": 4.3, "peak_mb": None, "launches": None}
    row |= {"tflops": 1.0}
    assert format_row(row | {"graph_ms": 1.25}).endswith("graph 1.250 ms")
    assert format_row(row | {"graph_error": "RuntimeError: sync"}).endswith("graph RuntimeError: sync")


def test_measure_records_why_a_run_was_not_replayed_from_a_graph():
    shape = BenchShape(1, 2, 2, 16, 8, torch.float32, True, torch.device("cpu"))
    rows = measure("TOPK:4", shape, ("fwd", "fwd+bwd"), 0, 1, graphs=True)
    assert [row["status"] for row in rows] == ["ok", "ok"]
    assert all("graph_ms" not in row and "CUDA graphs need a CUDA device" in row["graph_error"] for row in rows)
    assert all("graph_error" not in row for row in measure("TOPK:4", shape, ("fwd",), 0, 1))  # off unless asked


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_cuda_graph_timing_replays_a_captured_run_and_records_failures():
    shape = BenchShape(1, 2, 2, 256, 64, torch.bfloat16, True, torch.device("cuda"))
    rows = measure("TOPK:8", shape, ("fwd", "fwd+bwd"), 1, 3, graphs=True)
    assert all(row["status"] == "ok" and isinstance(row["graph_ms"], float) for row in rows)
    x = torch.ones(4, device="cuda")
    with pytest.raises(RuntimeError):  # a host sync cannot be captured
        graphed_ms(lambda: x.sum().item(), shape.device, 1, 1)


def test_the_png_draws_graph_timings_beside_the_eager_ones(tmp_path, monkeypatch):
    from sparsefocus.bench import plot

    drawn = []
    monkeypatch.setattr(plot, "_plot_graph_lines", lambda ax, series, colours: drawn.append(series))
    rows = [
        {"case": case, "n": n, "mode": "fwd+bwd", "status": "ok", "ms": 2.0, "peak_mb": None, "graph_ms": 1.0}
        for case in ("sdpa:cudnn", "zeta")
        for n in (16, 32)
    ]
    shape = {"batch": 1, "heads": 2, "head_dim": 8, "dtype": "fp32", "causal": True}
    plot.plot_results({"results": rows, "shape": shape, "device": "cpu", "torch": "x", "git_commit": "abc"}, tmp_path / "b.png")
    assert (tmp_path / "b.png").stat().st_size > 0
    assert drawn == [{"sdpa:cudnn": [(16, 1.0), (32, 1.0)], "zeta": [(16, 1.0), (32, 1.0)]}]

"""CPU smoke test of ``sparsefocus bench``: every case x N x mode gives a row, JSON and PNG are
written, custom cases and their extra columns work, errors are recorded. No timing assertions."""

import json

import pytest
import torch

from sparsefocus.bench import registry
from sparsefocus.bench.registry import BenchShape, Workload, attention_flops, mean_keys, register_case
from sparsefocus.bench.run import main


def test_bench_cli_writes_json_and_png(tmp_path):
    out = tmp_path / "bench.json"
    argv = ["TOPK:4", "sdpa", "indexed:4", "naive:TOPK:4", "BAND:4", "--n", "16", "32", "--batch", "1", "--heads", "2",
            "--kv-heads", "1", "--head-dim", "8", "--dtype", "fp32", "--causal", "--warmup", "0", "--repeats", "1",
            "--device", "cpu", "--out", str(out)]
    assert main(argv) == 0
    payload = json.loads(out.read_text())
    assert payload["command"].startswith("sparsefocus bench TOPK:4")
    assert {"git_commit", "device", "shape", "ceilings"} <= set(payload)
    rows = payload["results"]
    assert len(rows) == 5 * 2 * 2
    assert all(row["status"] == "ok" and row["ms"] > 0 and row["flops"] > 0 for row in rows)
    assert (tmp_path / "bench.png").stat().st_size > 0


def test_registered_case_extra_columns_and_errors_are_recorded(tmp_path):
    def scaled_sdpa(argument: str, shape: BenchShape) -> Workload:
        if argument == "fail":
            raise torch.OutOfMemoryError("out of memory (simulated)")
        return Workload(
            forward=lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(q, k, v) * 1.0,
            flops=attention_flops(shape, shape.n),
            extra=lambda q, k, v: {"recall": 1.0},
        )

    register_case("scaled_test_case", scaled_sdpa)
    try:
        out = tmp_path / "b.json"
        argv = ["scaled_test_case", "scaled_test_case:fail", "--n", "8", "--batch", "1", "--heads", "1", "--head-dim", "4",
                "--dtype", "fp32", "--warmup", "0", "--repeats", "1", "--device", "cpu", "--out", str(out), "--no-plot"]
        assert main(argv) == 0
        rows = json.loads(out.read_text())["results"]
        assert [r["status"] for r in rows] == ["ok", "ok", "oom", "oom"]
        assert rows[0]["recall"] == 1.0
        with pytest.raises(ValueError, match="twice"):
            register_case("scaled_test_case", scaled_sdpa)
    finally:
        registry.CASES.pop("scaled_test_case")


def test_mean_keys_counts_causal_rows():
    shape = BenchShape(1, 1, 1, 8, 4, torch.float32, True, torch.device("cpu"))
    assert mean_keys(shape, 8) == pytest.approx(4.5)  # (1 + ... + 8) / 8
    assert mean_keys(shape, 2) == pytest.approx((6 * 2 + 1 + 2) / 8)


def test_zeta_case_reports_candidate_recall(tmp_path):
    out = tmp_path / "zeta.json"
    argv = ["zeta:k=4,window=6,chunks=2,local=2", "zeta:k=4,window=64,chunks=1,local=0", "--n", "24", "--batch", "1",
            "--heads", "2", "--head-dim", "8", "--dtype", "fp32", "--warmup", "0", "--repeats", "1", "--device", "cpu",
            "--out", str(out), "--no-plot", "--modes", "fwd"]
    assert main(argv) == 0
    narrow, wide = json.loads(out.read_text())["results"]
    assert narrow["status"] == wide["status"] == "ok"
    assert 0.0 < narrow["recall"] <= 1.0
    assert wide["recall"] == pytest.approx(1.0)  # one chunk and a window wider than N sees every key
    with pytest.raises(ValueError, match="wider than"):
        registry.parse_case("zeta:dk=16", BenchShape(1, 1, 1, 8, 8, torch.float32, False, torch.device("cpu")))

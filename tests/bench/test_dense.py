"""The fastest-dense rule (kernel bench) and the fastest-FULL rule (model bench) on made-up rows:
the minimum over backends per (N, mode), failures and non-dense rows ignored; ceilings only on
the device they were measured on."""

import pytest

from sparsefocus.bench.dense import attach_dense_ratios, dense_table, fastest_dense
from sparsefocus.bench.model import attach_full_ratios, full_baseline, headline_rows
from sparsefocus.bench.run import expand_cases
from sparsefocus.bench.runner import ceilings_for


def dense_row(backend, n, mode, ms=None, status="ok"):
    row = {"case": f"sdpa:{backend}", "dense_backend": backend, "n": n, "mode": mode, "status": status}
    return row | ({"ms": ms} if ms is not None else {})


ROWS = [
    dense_row("flash", 4096, "fwd+bwd", 2.17),
    dense_row("cudnn", 4096, "fwd+bwd", 1.36),
    dense_row("efficient", 4096, "fwd+bwd", 3.1),
    dense_row("math", 4096, "fwd+bwd", 0.01, status="error"),  # a failed row never wins, whatever it holds
    dense_row("flash", 4096, "fwd", 0.55),
    dense_row("cudnn", 4096, "fwd", 0.61),
    dense_row("cudnn", 16384, "fwd+bwd", status="unavailable"),
    dense_row("flash", 16384, "fwd+bwd", 27.6),
    {"case": "TOPK:32", "n": 4096, "mode": "fwd+bwd", "status": "ok", "ms": 0.5},  # not dense, however fast
    {"case": "TOPK:32", "n": 65536, "mode": "fwd+bwd", "status": "ok", "ms": 135.0},
]


def test_fastest_dense_is_the_minimum_over_backends_per_point():
    best = fastest_dense(ROWS)
    assert best == {
        (4096, "fwd+bwd"): {"backend": "cudnn", "ms": 1.36},
        (4096, "fwd"): {"backend": "flash", "ms": 0.55},
        (16384, "fwd+bwd"): {"backend": "flash", "ms": 27.6},
    }
    assert [d["backend"] for d in dense_table(ROWS)] == ["flash", "cudnn", "flash"]  # sorted by (n, mode)


def test_fastest_dense_keeps_the_first_of_equal_times():
    rows = [dense_row("flash", 8, "fwd", 1.0), dense_row("cudnn", 8, "fwd", 1.0)]
    assert fastest_dense(rows)[(8, "fwd")]["backend"] == "flash"


def test_speedup_is_dense_over_case_at_the_same_point():
    rows = attach_dense_ratios(ROWS)
    topk, topk_64k = rows[-2], rows[-1]
    assert topk["speedup_vs_dense"] == pytest.approx(1.36 / 0.5)
    assert topk["dense_backend_used"] == "cudnn"
    assert topk_64k["dense_ms"] is None and topk_64k["speedup_vs_dense"] is None  # no dense at 64K
    assert rows[3]["speedup_vs_dense"] is None  # the failed row has no ratio


def test_graph_ratios_use_the_fastest_graph_dense_at_the_same_point():
    rows = [
        dense_row("flash", 4096, "fwd+bwd", 2.17) | {"graph_ms": 2.0},
        dense_row("cudnn", 4096, "fwd+bwd", 1.36) | {"graph_ms": 1.30},
        dense_row("efficient", 4096, "fwd+bwd", 3.1) | {"graph_error": "RuntimeError: not capturable"},
        {"case": "zeta", "n": 4096, "mode": "fwd+bwd", "status": "ok", "ms": 4.3, "graph_ms": 1.0},
        {"case": "lsh", "n": 4096, "mode": "fwd+bwd", "status": "ok", "ms": 9.0, "graph_error": "RuntimeError: sync"},
        {"case": "TOPK:32", "n": 4096, "mode": "fwd+bwd", "status": "ok", "ms": 3.0},
    ]
    assert fastest_dense(rows, "graph_ms") == {(4096, "fwd+bwd"): {"backend": "cudnn", "ms": 1.30}}
    assert dense_table(rows, "graph_ms") == [{"n": 4096, "mode": "fwd+bwd", "backend": "cudnn", "ms": 1.30}]
    zeta, lsh, topk = attach_dense_ratios(rows)[3:]
    assert zeta["speedup_vs_dense"] == pytest.approx(1.36 / 4.3)
    assert zeta["graph_speedup_vs_dense"] == pytest.approx(1.30 / 1.0)
    assert zeta["graph_dense_backend_used"] == "cudnn"
    assert lsh["graph_dense_ms"] == 1.30 and lsh["graph_speedup_vs_dense"] is None  # not captured: no ratio
    assert "graph_speedup_vs_dense" not in topk  # not timed from graphs: no graph columns


def full_row(backend, n, mode, ms=None, status="ok", pattern="FULL"):
    return {"pattern": pattern, "sdpa_backend": backend, "n": n, "mode": mode, "status": status} | ({"ms": ms} if ms else {})


def test_full_baseline_is_the_fastest_full_backend_and_ratios_use_it():
    rows = [
        full_row("flash", 8192, "eager", 14.9),
        full_row("cudnn", 8192, "eager", 14.1),
        full_row("efficient", 8192, "eager", status="oom"),
        full_row("flash", 8192, "compiled", 12.0),
        full_row(None, 8192, "eager", 19.3, pattern="TOPK:32"),
        full_row(None, 8192, "compiled", 24.0, pattern="TOPK:32"),
    ]
    assert full_baseline(rows) == {
        (8192, "eager"): {"backend": "cudnn", "ms": 14.1},
        (8192, "compiled"): {"backend": "flash", "ms": 12.0},
    }
    ratios = attach_full_ratios(rows)
    assert ratios[4]["vs_full"] == pytest.approx(14.1 / 19.3) and ratios[4]["full_backend"] == "cudnn"
    assert ratios[5]["vs_full"] == pytest.approx(12.0 / 24.0)
    assert ratios[1]["vs_full"] == pytest.approx(1.0)
    kept = headline_rows(ratios)
    assert [(r["pattern"], r["sdpa_backend"], r["mode"]) for r in kept] == [
        ("FULL", "cudnn", "eager"),
        ("FULL", "flash", "compiled"),
        ("TOPK:32", None, "eager"),
        ("TOPK:32", None, "compiled"),
    ]


def test_ceilings_only_on_the_device_they_were_measured_on():
    assert ceilings_for("NVIDIA H200")["tflops"] > 0
    assert ceilings_for("NVIDIA H100 80GB HBM3") is None
    assert ceilings_for("x86_64") is None


def test_sdpa_expands_to_every_backend_without_duplicates():
    assert expand_cases(["sdpa:flash", "sdpa", "TOPK:32", "TOPK:32"]) == [
        "sdpa:flash",
        "sdpa:cudnn",
        "sdpa:efficient",
        "sdpa:math",
        "TOPK:32",
    ]

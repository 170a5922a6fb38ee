"""One device visit: GPU correctness (bf16 vs fp32 references), tile sweeps, then the bench sweep.

Usage on the GPU machine:  PYTHONPATH=. python benchmarks/gpu_session.py OUT_DIR [--tune] [--bench-args ...]
Prints short tables; writes OUT_DIR/check.json and the bench JSON/PNG.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

from sparsefocus.attention import sparse_attention
from sparsefocus.attention.common import indexed_attention_ref
from sparsefocus.bench.registry import BenchShape, random_indices
from sparsefocus.bench.runner import median_ms
from sparsefocus.kernels import indexed
from sparsefocus.kernels.indexed import indexed_attention
from sparsefocus.kernels.topk_select import topk_select, topk_select_torch
from sparsefocus.train.checkpoint import write_text_atomic

DEV = torch.device("cuda")


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def check_indexed(score, n=1000, m=900, b=2, hq=8, hk=2, d=64, dv=48, kk=37):
    q, k, v = (torch.randn(b, h, s, w, device=DEV) for h, s, w in ((hq, n, d), (hk, m, d), (hk, m, dv)))
    index = torch.randint(-1, m, (b, hq, n, kk), device=DEV, dtype=torch.int32)
    gamma = (torch.rand(hq, device=DEV) + 0.5).requires_grad_() if score == "cauchy" else None
    scale = 0.05 if score != "dot" else None
    leaves32 = [x.clone().requires_grad_() for x in (q, k, v)]
    leaves16 = [x.to(torch.bfloat16).requires_grad_() for x in (q, k, v)]
    leavesk = [x.to(torch.bfloat16).requires_grad_() for x in (q, k, v)]
    out = {}
    grad_out = torch.randn(b, hq, n, dv, device=DEV)
    for name, leaves, fn in (
        ("ref32", leaves32, indexed_attention_ref),
        ("ref16", leaves16, indexed_attention_ref),
        ("kernel", leavesk, indexed_attention),
    ):
        g = None if gamma is None else gamma.detach().clone().requires_grad_()
        o = fn(*leaves, index, scale=scale, score=score, gamma=g)
        grads = torch.autograd.grad(o.float(), leaves + ([g] if g is not None else []), grad_out)
        out[name] = [o] + list(grads)
    names = ["out", "dq", "dk", "dv", "dgamma"]
    return {
        names[i]: (rel(out["kernel"][i], out["ref32"][i]), rel(out["ref16"][i], out["ref32"][i]))
        for i in range(len(out["kernel"]))
    }


def check_topk(n=3000, kk=32, causal=True, pad=False):
    q = torch.randn(2, 8, n, 64, device=DEV, dtype=torch.bfloat16)
    k = torch.randn(2, 4, n, 64, device=DEV, dtype=torch.bfloat16)
    kpm = (torch.rand(2, n, device=DEV) > 0.2) if pad else None
    got = topk_select(q, k, kk, causal=causal, key_padding_mask=kpm)
    want = topk_select_torch(q, k, kk, causal=causal, key_padding_mask=kpm)
    same_set = (got.sort(-1).values == want.sort(-1).values).all(-1).float().mean().item()
    return {"rows_identical": same_set}


def check_topk_scores(n=2048, kk=32):
    """Selected score sums vs the torch selection (robust to near-ties)."""
    q = torch.randn(1, 4, n, 64, device=DEV, dtype=torch.bfloat16)
    k = torch.randn(1, 4, n, 64, device=DEV, dtype=torch.bfloat16)
    scores = q.float() @ k.float().transpose(-1, -2)
    scores = scores.masked_fill(torch.ones(n, n, device=DEV, dtype=torch.bool).triu(1), float("-inf"))
    got = topk_select(q, k, kk, causal=True).long()
    want = scores.topk(kk, -1).indices
    got_s = torch.gather(scores, -1, got.clamp_min(0)).masked_fill(got < 0, 0).sum(-1)
    want_s = torch.gather(scores, -1, want).masked_fill(torch.isinf(torch.gather(scores, -1, want)), 0).sum(-1)
    return {
        "max_abs_score_sum_diff": (got_s - want_s).abs().max().item(),
        "set_equal_frac": (
            got.sort(-1).values == want.masked_fill(torch.isinf(torch.gather(scores, -1, want)), -1).sort(-1).values
        )
        .all(-1)
        .float()
        .mean()
        .item(),
    }


def check_api(n=700):
    res = {}
    for pattern in ("TOPK:32", "BAND:64"):
        q = torch.randn(2, 8, n, 64, device=DEV, dtype=torch.bfloat16, requires_grad=True)
        k = torch.randn(2, 4, n, 64, device=DEV, dtype=torch.bfloat16, requires_grad=True)
        v = torch.randn(2, 4, n, 64, device=DEV, dtype=torch.bfloat16, requires_grad=True)
        a = sparse_attention(q, k, v, pattern, causal=True, impl="triton")
        r = sparse_attention(q.float(), k.float(), v.float(), pattern, causal=True, impl="reference")
        ga = torch.autograd.grad(a.float().sum(), (q, k, v))
        qq, kk_, vv = (x.detach().float().requires_grad_() for x in (q, k, v))
        r = sparse_attention(qq, kk_, vv, pattern, causal=True, impl="reference")
        gr = torch.autograd.grad(r.sum(), (qq, kk_, vv))
        res[pattern] = [rel(a, r)] + [rel(x, y) for x, y in zip(ga, gr)]
    return res


def fastest(label, candidates, overrides, run, log):
    """Time run() under each tile override; keep the fastest in ``overrides``; return it."""
    best = (float("inf"), {})
    for tiles in candidates:
        overrides.clear()
        overrides.update(tiles)
        try:
            ms = median_ms(run, DEV, 2, 5)
        except Exception as error:  # noqa: BLE001
            log(f"{label} {tiles}: {type(error).__name__} {str(error)[:200]}")
            continue
        log(f"{label} {tiles}: {ms:.2f} ms")
        best = min(best, (ms, tiles), key=lambda x: x[0])
    overrides.clear()
    overrides.update(best[1])
    return best[1]


def tune(log):
    shape = BenchShape(4, 16, 16, 65536, 64, torch.bfloat16, True, DEV)
    q, k, v = (torch.randn(4, 16, shape.n, 64, device=DEV, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    index = random_indices(shape, 32)
    o = indexed_attention(q, k, v, index)
    do = torch.randn_like(o)
    bwd_overrides = {}
    indexed.TILE_OVERRIDES["bwd"] = bwd_overrides
    chosen = {
        "indexed_bwd": fastest(
            "indexed bwd N=64K",
            [
                {},
                {"BLOCK_M": 16, "BLOCK_K": 2, "num_warps": 2},
                {"BLOCK_M": 32, "BLOCK_K": 4, "num_warps": 4},
                {"BLOCK_M": 8, "BLOCK_K": 8, "num_warps": 4},
            ],
            bwd_overrides,
            lambda: torch.autograd.grad(o, (q, k, v), do, retain_graph=True),
            log,
        )
    }
    # The top-k selection's tiles (three kernels, nested overrides) are tuned by benchmarks/topk_probe.py.
    log(f"TILES {json.dumps(chosen)}")


def main(argv):
    out_dir = Path(argv[0])
    out_dir.mkdir(parents=True, exist_ok=True)
    lines = []

    def log(msg):
        print(msg, flush=True)
        lines.append(msg)

    start = time.time()
    log(f"device {torch.cuda.get_device_name()} torch {torch.__version__}")
    checks = [
        ("indexed dot", lambda: check_indexed("dot")),
        ("indexed cauchy", lambda: check_indexed("cauchy")),
        ("topk causal", lambda: check_topk()),
        ("topk scores", check_topk_scores),
        ("api triton vs reference", check_api),
    ]
    if "--all-checks" in argv:
        checks += [
            ("indexed neg_sqeuclid", lambda: check_indexed("neg_sqeuclid")),
            ("topk noncausal pad", lambda: check_topk(causal=False, pad=True)),
        ]
    for name, fn in checks:
        try:
            log(f"CHECK {name}: {fn()}")
        except Exception as error:  # noqa: BLE001
            log(f"CHECK {name}: FAILED {type(error).__name__}: {str(error)[:400]}")
    log(f"checks took {time.time() - start:.0f}s")
    if "--tune" in argv:
        tune(log)
        log(f"tuning done at {time.time() - start:.0f}s")
    write_text_atomic(out_dir / "check.txt", "\n".join(lines))
    if "--bench-args" in argv:
        from sparsefocus.bench.run import main as bench_main

        bench_main(argv[argv.index("--bench-args") + 1 :])
        log(f"bench done at {time.time() - start:.0f}s")
    write_text_atomic(out_dir / "check.txt", "\n".join(lines))


if __name__ == "__main__":
    main(sys.argv[1:])

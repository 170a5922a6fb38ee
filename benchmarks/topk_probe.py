"""One GPU visit for the top-k selection kernels: exactness, overflow rate, per-kernel times.

Usage on the GPU machine:  PYTHONPATH=. python benchmarks/topk_probe.py OUT_DIR [--variants] [--bench-args ...]

1. checks topk_select against the PyTorch selection (bf16, GQA, causal / padded, kk 32 and 128);
2. with --variants, times each of the three kernels (torch.profiler) under several tile choices
   at N=16K, B=4, H=16, D=64, causal, and keeps the fastest per kernel in TILE_OVERRIDES;
3. times the whole selection at 16K and 64K and TOPK:32 / SDPA forward+backward at 16K;
4. with --bench-args, runs ``sparsefocus bench`` with the arguments that follow (with the tiles
   kept in step 2, recorded in the bench JSON), unless a check of step 1 failed.
Prints short lines; writes OUT_DIR/topk_probe.json.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

from sparsefocus.bench.registry import BenchShape
from sparsefocus.bench.runner import measure, median_ms
from sparsefocus.kernels import topk_select as topk_module
from sparsefocus.kernels.topk_select import topk_select, topk_select_torch

DEV = torch.device("cuda")
KERNELS = ("bound", "collect", "finish")
VARIANTS = [
    {},
    {"bound": dict(BLOCK_M=64, BLOCK_N=128, num_warps=4, num_stages=3), "collect": dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=3),
     "finish": dict(BLOCK_M=32, num_warps=4)},
    {"bound": dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=2), "collect": dict(BLOCK_M=64, BLOCK_N=128, num_warps=4, num_stages=3),
     "finish": dict(BLOCK_M=8, num_warps=2)},
]


def qk(n, heads=16, kv_heads=16, batch=4, dtype=torch.bfloat16, seed=0):
    generator = torch.Generator(device=DEV).manual_seed(seed)
    q = torch.randn(batch, heads, n, 64, device=DEV, generator=generator).to(dtype)
    k = torch.randn(batch, kv_heads, n, 64, device=DEV, generator=generator).to(dtype)
    return q, k


def check(n, kk, causal, pad, log):
    q, k = qk(n, heads=8, kv_heads=4, batch=2, seed=n + kk)
    kpm = (torch.rand(2, n, device=DEV) > 0.2) if pad else None
    got = topk_select(q, k, kk, causal=causal, key_padding_mask=kpm)
    want = topk_select_torch(q, k, kk, causal=causal, key_padding_mask=kpm)
    _, count = topk_module._launch(q, k, kk, causal, kpm)
    cap = 2 * topk_module.triton.next_power_of_2(kk)
    result = {"n": n, "kk": kk, "causal": causal, "pad": pad, "rows_identical": (got == want).all(-1).float().mean().item(),
              "sets_identical": (got.sort(-1).values == want.sort(-1).values).all(-1).float().mean().item(),
              "overflow_rows": int((count > cap).sum()), "mean_candidates": count.float().mean().item()}
    log(f"CHECK {result}")
    return result


def kernel_times(fn, repeats=5):
    """Mean device milliseconds per call of each top-k kernel over ``repeats`` profiled calls."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(repeats):
            fn()
        torch.cuda.synchronize()
    times = {}
    for event in prof.key_averages():
        for name in KERNELS:
            if f"_{name}_kernel" in event.key:
                times[name] = getattr(event, "device_time_total", getattr(event, "cuda_time_total", 0.0)) / 1e3 / repeats
    return times


def sweep_variants(log):
    q, k = qk(16384)
    rows = []
    for tiles in VARIANTS:
        topk_module.TILE_OVERRIDES.clear()
        topk_module.TILE_OVERRIDES.update(tiles)
        try:
            times = kernel_times(lambda: topk_select(q, k, 32, causal=True))
        except Exception as error:  # noqa: BLE001 - a variant that fails to compile is reported, not fatal
            log(f"VARIANT {tiles}: {type(error).__name__} {str(error)[:300]}")
            continue
        log(f"VARIANT {json.dumps(tiles)}: " + " ".join(f"{name} {ms:.2f} ms" for name, ms in times.items()))
        rows.append({"tiles": tiles, "ms": times})
    best = {}
    for name in KERNELS:
        timed = [(row["ms"][name], row["tiles"].get(name, {})) for row in rows if name in row["ms"]]
        if timed:
            best[name] = min(timed, key=lambda item: item[0])[1]
    topk_module.TILE_OVERRIDES.clear()
    topk_module.TILE_OVERRIDES.update({name: tiles for name, tiles in best.items() if tiles})
    log(f"BEST {json.dumps(topk_module.TILE_OVERRIDES)}")
    return rows


def timings(log):
    result = {}
    for n in (16384, 65536):
        q, k = qk(n)
        result[f"select_{n}"] = median_ms(lambda: topk_select(q, k, 32, causal=True), DEV, 2, 5)
        result[f"kernels_{n}"] = kernel_times(lambda: topk_select(q, k, 32, causal=True), repeats=3)
        _, count = topk_module._launch(q, k, 32, True, None)
        result[f"overflow_rows_{n}"] = int((count > 64).sum())
        result[f"mean_candidates_{n}"] = count.float().mean().item()
        log(f"SELECT N={n}: {result[f'select_{n}']:.2f} ms {result[f'kernels_{n}']} overflow {result[f'overflow_rows_{n}']} "
            f"mean candidates {result[f'mean_candidates_{n}']:.1f}")
        del q, k, count
    shape = BenchShape(4, 16, 16, 16384, 64, torch.bfloat16, True, DEV)
    for case in ("TOPK:32", "sdpa"):
        row = measure(case, shape, ("fwd+bwd",), 2, 5)[0]
        result[f"{case}_fwd+bwd_16384"] = row.get("ms", row["status"])
        log(f"{case} fwd+bwd N=16384: {result[f'{case}_fwd+bwd_16384']}")
    return result


def main(argv):
    out_dir = Path(argv[0])
    out_dir.mkdir(parents=True, exist_ok=True)
    start = time.time()

    def log(message):
        print(f"[{time.time() - start:5.0f}s] {message}", flush=True)

    log(f"device {torch.cuda.get_device_name()} torch {torch.__version__} triton {topk_module.triton.__version__}")
    report = {"checks": [check(3000, 32, True, False, log), check(3000, 32, False, True, log), check(2000, 128, True, False, log)]}
    if "--variants" in argv:
        report["variants"] = sweep_variants(log)
    report["best_tiles"] = json.loads(json.dumps(topk_module.TILE_OVERRIDES))
    report["timings"] = timings(log)
    (out_dir / "topk_probe.json").write_text(json.dumps(report, indent=1))
    exact = all(row["sets_identical"] > 0.999 for row in report["checks"])
    if "--bench-args" in argv and not exact:
        log("bench skipped: the selection does not match PyTorch")
    elif "--bench-args" in argv:
        from sparsefocus.bench.run import main as bench_main

        bench_main(argv[argv.index("--bench-args") + 1:])
        log("bench done")


if __name__ == "__main__":
    main(sys.argv[1:])

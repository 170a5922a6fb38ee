"""ZETA forward+backward with the mean token fused into the indexed kernel's function
(``zeta.FUSED_MEAN``: its gradient scan adds onto the atomics' fp32 dk, dv and stores once) and
the scan's per-width tiles, against the previous separate mean and 64-row, 4-warp scan tiles.

Usage on a CUDA machine:  PYTHONPATH=. python benchmarks/zeta_mean_ab.py [N ...] [--reps R]
Prints one JSON row per (N, repetition, variant): "new" (both), "old_mean" (separate mean),
"old_scan" (old scan tiles), "old" (neither); B=4, H=16, Dv=64, bf16, causal, the bench's
pattern and protocol. First, per N: the relative difference of dq, dk, dv, d gamma between
"new" and "old", and the peak memory of both.
"""

from __future__ import annotations

import argparse
import json

from benchmarks.zeta_bench import peak_mb, timed_ms, zeta_inputs, zeta_step
from sparsefocus.attention import zeta
from sparsefocus.kernels import scan

VARIANTS = ("new", "old_mean", "old_scan", "old")


def use(variant: str) -> None:
    zeta.FUSED_MEAN = variant in ("new", "old_scan")
    scan.TILE_OVERRIDES.clear()
    if variant in ("old_scan", "old"):
        scan.TILE_OVERRIDES.update(BLOCK_N=64, num_warps=4)


def compare(q, k, v, gamma) -> dict:
    upstream: list = []  # one upstream gradient for both
    use("old")
    old = zeta_step(q, k, v, gamma, grad_out=upstream)()
    use("new")
    new = zeta_step(q, k, v, gamma, grad_out=upstream)()
    return {name: ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item() for name, a, b in zip(("dq", "dk", "dv", "dgamma"), new, old)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("lengths", type=int, nargs="*", default=[8192, 32768, 65536])
    parser.add_argument("--reps", type=int, default=2)
    args = parser.parse_args()
    for n in args.lengths:
        q, k, v, gamma = zeta_inputs(4, 16, n)
        row = {"N": n, "new_vs_old_rel_diff": compare(q, k, v, gamma)}
        for variant in ("old", "new"):
            use(variant)
            row[f"peak_mb_{variant}"] = peak_mb(zeta_step(q, k, v, gamma))
        print(json.dumps(row), flush=True)
        for rep in range(args.reps):
            for variant in VARIANTS:
                use(variant)
                print(json.dumps({"N": n, "rep": rep, "variant": variant, "fwdbwd_ms": timed_ms(zeta_step(q, k, v, gamma), 7)}), flush=True)
    use("new")


if __name__ == "__main__":
    main()

"""ZETA forward+backward with the indexed backward's locality hint (value gradients summed per
tile over ranked keys, then one atomic add per key) against the plain atomic backward, alternating.

Usage on a CUDA machine:  PYTHONPATH=. python benchmarks/zeta_dense_ab.py [N ...] [--reps R]
Prints one JSON row per (N, repetition, variant); B=4, H=16, Dv=64, bf16, causal, the bench's
pattern. "off" is the backward without the hint (rows in order, 16 x 1 slot, 2 warps, one atomic
add per (query, slot)); "dense" the hint with ``indexed.DENSE_TILES``; the others the hint with
other tiles (VARIANTS: rows x ranked keys, warps). Before timing, per N: the relative
difference of dq, dk, dv, d gamma between "dense" and "off", and the peak memory of each.
"""

from __future__ import annotations

import argparse
import json

from benchmarks.zeta_bench import peak_mb, timed_ms, zeta_inputs, zeta_step
from sparsefocus.attention import zeta
from sparsefocus.kernels import indexed

SORTED_LOCALITY = zeta.sorted_locality
VARIANTS = {  # name: backward tiles with the hint (BLOCK_M rows, DENSE_R ranked keys, warps)
    "dense": {},  # indexed.DENSE_TILES
    "d16x64_w4": dict(BLOCK_M=16, DENSE_R=64, num_warps=4),
    "d32x128_w4": dict(BLOCK_M=32, DENSE_R=128, num_warps=4),
    "d16x256_w8": dict(BLOCK_M=16, DENSE_R=256, num_warps=8),
    "d32x256_w8": dict(BLOCK_M=32, DENSE_R=256, num_warps=8),
    "d16x128_w2": dict(BLOCK_M=16, DENSE_R=128, num_warps=2),
}


def use(variant: str) -> None:
    indexed.TILE_OVERRIDES.clear()
    zeta.sorted_locality = (lambda *args: None) if variant == "off" else SORTED_LOCALITY
    if variant in VARIANTS:
        indexed.TILE_OVERRIDES["bwd"] = dict(VARIANTS[variant])


def gradients(q, k, v, gamma) -> list:
    for x in (q, k, v, gamma):
        x.grad = None
    zeta_step(q, k, v, gamma)()
    return [x.grad.float().clone() for x in (q, k, v, gamma)]


def compare(q, k, v, gamma) -> dict:
    """Relative differences of dq, dk, dv, d gamma: the hint's default against "off"."""
    use("off")
    plain = gradients(q, k, v, gamma)
    use("dense")
    dense = gradients(q, k, v, gamma)
    return {name: ((a - b).norm() / b.norm().clamp_min(1e-30)).item() for name, a, b in zip(("dq", "dk", "dv", "dgamma"), dense, plain)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("lengths", type=int, nargs="*", default=[8192, 32768, 65536])
    parser.add_argument("--reps", type=int, default=2)
    args = parser.parse_args()
    variants = ("off", *VARIANTS)
    for n in args.lengths:
        q, k, v, gamma = zeta_inputs(4, 16, n)
        row = {"N": n, "dense_vs_off_rel_diff": compare(q, k, v, gamma)}
        for variant in ("off", "dense"):
            use(variant)
            row[f"peak_mb_{variant}"] = peak_mb(zeta_step(q, k, v, gamma))
        print(json.dumps(row), flush=True)
        for rep in range(args.reps):
            for variant in variants:
                use(variant)
                both = timed_ms(zeta_step(q, k, v, gamma), 7)
                print(json.dumps({"N": n, "rep": rep, "variant": variant, "fwdbwd_ms": both}), flush=True)
    use("dense")


if __name__ == "__main__":
    main()

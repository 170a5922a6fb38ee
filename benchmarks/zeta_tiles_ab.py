"""ZETA forward and forward+backward with the tile defaults against the previous ones, alternating.

Usage on a CUDA machine:  PYTHONPATH=. python benchmarks/zeta_tiles_ab.py [N ...] [--reps R]
Prints one JSON row per (N, repetition, tiles); B=4, H=16, Dv=64, bf16, causal. "old" is the
selection at 32 rows x 4 warps, the indexed forward at 32 rows x 8 slots x 4 warps and the
backward at 16 rows x 2 slots x 2 warps (the defaults before commit 0d71ae8); "old_select" and
"old_indexed" take only that part of the old tiles. With --key-grads: the default (fp32 atomic
dk/dv) against ``indexed.KEY_GRADS = "inverse"`` (per-key sums over an inverse index), after a
check that both give the same gradients (printed as relative differences), and the inverse
path with other key tiles ("inverse_32x4", "inverse_8x16", "inverse_16x16": BLOCK_N x BLOCK_E) and
with its query pass on the atomic backward's tiles instead of the forward's ("inverse_q1").
With --split-band: "split_band", the selection with the band in its own tile
(``SELECT_OVERRIDES["split"]``; the same keys; the default since fbda9d5). With --indexed: the
indexed kernel's defaults against the tiles of INDEXED_TILES. With --halving: the selection's
cut with its first passes interpolating (the default) against plain halving ("halving").
"""

from __future__ import annotations

import argparse
import json

from benchmarks.zeta_bench import PATTERN, peak_mb, timed_ms, zeta_inputs, zeta_step
from sparsefocus.attention.patterns import parse_pattern
from sparsefocus.attention.zeta import select_keys_fused
from sparsefocus.kernels import indexed, indexed_csr, zeta_select

OLD_SELECT = {"BLOCK_M": 32, "num_warps": 4}
OLD_INDEXED = {"fwd": {"BLOCK_M": 32, "BLOCK_K": 8, "num_warps": 4}, "bwd": {"BLOCK_M": 16, "BLOCK_K": 2, "num_warps": 2}}
KEY_TILES = {
    "inverse": {"BLOCK_N": 16, "BLOCK_E": 8, "num_warps": 4}, "inverse_32x4": {"BLOCK_N": 32, "BLOCK_E": 4, "num_warps": 4},
    "inverse_8x16": {"BLOCK_N": 8, "BLOCK_E": 16, "num_warps": 4}, "inverse_16x16": {"BLOCK_N": 16, "BLOCK_E": 16, "num_warps": 8},
    "inverse_q1": {"BLOCK_N": 16, "BLOCK_E": 8, "num_warps": 4},  # and the query pass on the atomic backward's tiles
}
ATOMIC_BWD_TILES = {"BLOCK_M": 16, "BLOCK_K": 1, "num_warps": 2}
INDEXED_TILES = {  # --indexed: other indexed-kernel tiles against the defaults (16x16 slots x 2 warps fwd, 16x1x2 bwd)
    "fwd_16x8_w2": {"fwd": {"BLOCK_M": 16, "BLOCK_K": 8, "num_warps": 2}},
    "fwd_8x16_w1": {"fwd": {"BLOCK_M": 8, "BLOCK_K": 16, "num_warps": 1}},
    "bwd_8x1_w1": {"bwd": {"BLOCK_M": 8, "BLOCK_K": 1, "num_warps": 1}},
    "fwd_16x8_w2_bwd_8x1_w1": {"fwd": {"BLOCK_M": 16, "BLOCK_K": 8, "num_warps": 2}, "bwd": {"BLOCK_M": 8, "BLOCK_K": 1, "num_warps": 1}},
}


def use(tiles: str) -> None:
    zeta_select.SELECT_OVERRIDES.clear()
    indexed.TILE_OVERRIDES.clear()
    if tiles in ("old", "old_select"):
        zeta_select.SELECT_OVERRIDES.update(OLD_SELECT)
    if tiles == "split_band":
        zeta_select.SELECT_OVERRIDES["split"] = True
    if tiles == "halving":
        zeta_select.SELECT_OVERRIDES["guesses"] = 0
    if tiles in ("old", "old_indexed"):
        indexed.TILE_OVERRIDES.update(OLD_INDEXED)
    indexed.TILE_OVERRIDES.update(INDEXED_TILES.get(tiles, {}))
    indexed.KEY_GRADS = "inverse" if tiles in KEY_TILES else "atomic"
    if tiles == "inverse_q1":
        indexed.TILE_OVERRIDES["bwd"] = ATOMIC_BWD_TILES
    indexed_csr.TILES.update(KEY_TILES.get(tiles, KEY_TILES["inverse"]))


def gradients(q, k, v, gamma, upstream: list) -> list:
    return [x.float() for x in zeta_step(q, k, v, gamma, grad_out=upstream)()]


def compare_key_grads(q, k, v, gamma) -> dict:
    """Relative differences of dq, dk, dv, d gamma between the inverse index and the atomics."""
    upstream: list = []  # one upstream gradient for both
    use("new")
    atomic = gradients(q, k, v, gamma, upstream)
    use("inverse")
    inverse = gradients(q, k, v, gamma, upstream)
    use("new")
    return {name: ((a - b).norm() / b.norm().clamp_min(1e-30)).item() for name, a, b in zip(("dq", "dk", "dv", "dgamma"), inverse, atomic)}


def compare_selection(q, k, variant: str) -> dict:
    """Rows whose selected keys differ (set or order) between the default and a variant."""
    spec = parse_pattern(PATTERN)
    use("new")
    default = select_keys_fused(spec, q.detach(), k.detach(), True, None)
    use(variant)
    other = select_keys_fused(spec, q.detach(), k.detach(), True, None)
    use("new")
    return {"rows_differing": (default != other).any(-1).float().mean().item()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("lengths", type=int, nargs="*", default=[4096, 8192, 65536])
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--parts", action="store_true", help="also old selection tiles alone and old indexed tiles alone")
    parser.add_argument("--key-grads", action="store_true", help="the default against KEY_GRADS='inverse'")
    parser.add_argument("--split-band", action="store_true", help="the default against the band in its own selection tile")
    parser.add_argument("--indexed", action="store_true", help="the default against the INDEXED_TILES (only these)")
    parser.add_argument("--halving", action="store_true", help="the default (the cut's first 8 passes interpolate) against plain halving (only this)")
    args = parser.parse_args()
    variants = ("new", "old", "old_select", "old_indexed") if args.parts else ("new", "old")
    variants = ("new", *KEY_TILES) if args.key_grads else variants
    variants = ((variants if args.key_grads else ("new",)) + ("split_band",)) if args.split_band else variants
    variants = ("new", *INDEXED_TILES) if args.indexed else variants
    variants = ("new", "halving") if args.halving else variants
    for n in args.lengths:
        q, k, v, gamma = zeta_inputs(4, 16, n)
        if args.key_grads:
            print(json.dumps({"N": n, "inverse_vs_atomic_rel_diff": compare_key_grads(q, k, v, gamma)}), flush=True)
        if args.split_band:
            print(json.dumps({"N": n, "split_vs_padded_selection": compare_selection(q, k, "split_band")}), flush=True)
        if args.halving:
            print(json.dumps({"N": n, "halving_vs_guesses_selection": compare_selection(q, k, "halving")}), flush=True)
        for rep in range(args.reps):
            for tiles in variants:
                use(tiles)
                fwd = timed_ms(zeta_step(q, k, v, gamma, backward=False), 7)
                both = timed_ms(zeta_step(q, k, v, gamma), 7)
                row = {"N": n, "rep": rep, "tiles": tiles, "fwd_ms": fwd, "fwdbwd_ms": both}
                if args.key_grads and rep == 0:
                    row["peak_mb"] = peak_mb(zeta_step(q, k, v, gamma))  # the memory target: <= SDPA's
                print(json.dumps(row), flush=True)
    use("new")


if __name__ == "__main__":
    main()

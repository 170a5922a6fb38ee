"""ZETA forward and forward+backward with the tile defaults against the previous ones, alternating.

Usage on a CUDA machine:  PYTHONPATH=. python benchmarks/zeta_tiles_ab.py
Prints one JSON row per (N, repetition, tiles); B=4, H=16, Dv=64, bf16, causal. "old" is the
selection at 32 rows x 4 warps, the indexed forward at 32 rows x 8 slots x 4 warps and the
backward at 16 rows x 2 slots x 2 warps (the defaults before commit 0d71ae8).
"""

from __future__ import annotations

import json

from benchmarks.zeta_bench import timed_ms, zeta_inputs, zeta_step
from sparsefocus.kernels import indexed, zeta_select

OLD_SELECT = {"BLOCK_M": 32, "num_warps": 4}
OLD_INDEXED = {"fwd": {"BLOCK_M": 32, "BLOCK_K": 8, "num_warps": 4}, "bwd": {"BLOCK_M": 16, "BLOCK_K": 2, "num_warps": 2}}


def use(tiles: str) -> None:
    zeta_select.SELECT_OVERRIDES.clear()
    indexed.TILE_OVERRIDES.clear()
    if tiles == "old":
        zeta_select.SELECT_OVERRIDES.update(OLD_SELECT)
        indexed.TILE_OVERRIDES.update(OLD_INDEXED)


def main() -> None:
    for n in (4096, 8192, 65536):
        q, k, v, gamma = zeta_inputs(4, 16, n)
        for rep in range(2):
            for tiles in ("new", "old"):
                use(tiles)
                fwd = timed_ms(zeta_step(q, k, v, gamma, backward=False), 7)
                both = timed_ms(zeta_step(q, k, v, gamma), 7)
                print(json.dumps({"N": n, "rep": rep, "tiles": tiles, "fwd_ms": fwd, "fwdbwd_ms": both}), flush=True)
    use("new")


if __name__ == "__main__":
    main()

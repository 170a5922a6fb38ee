"""The causal mean's scan (``sparsefocus.kernels.scan.scaled_scan``) alone, per tile shape.

Usage on a CUDA machine:  PYTHONPATH=. python benchmarks/zeta_scan_probe.py [N]
Prints one JSON row per (tensor, direction, BLOCK_N, warps): median ms of scaled_scan on ZETA's
v [4, 16, N, 64] and k [4, 16, N, 3] in bf16, forward (the mean) and reversed (its gradient),
with the output checked against the tiles used before it (64 rows, 4 warps).
"""

from __future__ import annotations

import json
import sys

import torch

from benchmarks.zeta_bench import timed_ms
from sparsefocus.kernels import scan


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 65536
    pre = torch.ones(4, n, device="cuda")
    post = 1.0 / torch.arange(1, n + 1, device="cuda", dtype=torch.float32).expand(4, n).contiguous()
    for name, width in (("v", 64), ("k", 3)):
        x = torch.randn(4, 16, n, width, device="cuda", dtype=torch.bfloat16)
        for reverse in (False, True):
            scan.TILE_OVERRIDES.update(BLOCK_N=64, num_warps=4)  # the tiles before this probe
            want = scan.scaled_scan(x, pre, post, reverse)
            for block_n in (32, 64, 128, 256):
                for warps in (1, 2, 4, 8):
                    scan.TILE_OVERRIDES.update(BLOCK_N=block_n, num_warps=warps)
                    got = scan.scaled_scan(x, pre, post, reverse)
                    err = ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()
                    ms = timed_ms(lambda: scan.scaled_scan(x, pre, post, reverse), 20)
                    print(json.dumps({"x": name, "reverse": reverse, "BLOCK_N": block_n, "warps": warps, "ms": ms, "max_rel_diff": err}), flush=True)
    scan.TILE_OVERRIDES.clear()


if __name__ == "__main__":
    main()

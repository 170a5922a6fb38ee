"""The indexed backward kernel alone on ZETA's lists at one N: as used (fp32 atomic dk, dv), without
the atomics (the same kernel with SCATTER_KV off, as the inverse-index mode launches it; dk and
dv are then not computed, so this only places the atomics' cost), and on other tiles.

Usage on a CUDA machine:  PYTHONPATH=. python benchmarks/zeta_bwd_parts.py [N]
B=4, H=16, q/k width 3, Dv=64, bf16, the bench's pattern, the mean token as the extra slot.
Prints one JSON row per variant (median ms of the backward launch, buffers included).
"""

from __future__ import annotations

import json
import sys

import torch

from benchmarks.zeta_bench import PATTERN, timed_ms, zeta_inputs
from sparsefocus.attention.patterns import parse_pattern
from sparsefocus.attention.zeta import mean_tokens, select_keys_fused
from sparsefocus.kernels import indexed, indexed_csr

TILES = {
    "default": {},
    "16x1_w1": {"BLOCK_M": 16, "BLOCK_K": 1, "num_warps": 1},
    "32x1_w2": {"BLOCK_M": 32, "BLOCK_K": 1, "num_warps": 2},
    "32x1_w4": {"BLOCK_M": 32, "BLOCK_K": 1, "num_warps": 4},
    "16x2_w2": {"BLOCK_M": 16, "BLOCK_K": 2, "num_warps": 2},
    "64x1_w4": {"BLOCK_M": 64, "BLOCK_K": 1, "num_warps": 4},
}


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 65536
    spec = parse_pattern(PATTERN)
    q, k, v, gamma = (x.detach() for x in zeta_inputs(4, 16, n))
    index = select_keys_fused(spec, q, k, True, None)
    mean_k, mean_v, present = mean_tokens(k, v, True, None, fused=True)
    extra = indexed.Extra(*indexed._kernel_extras(q, mean_k, mean_v, present))
    gamma_sq = gamma.float().pow(2).contiguous()
    out, stat = indexed._indexed_forward(q, k, v, index, gamma_sq, 1.0, 2, extra)
    grad = torch.randn_like(out)
    backward = lambda: indexed._indexed_backward(q, k, v, index, gamma_sq, out, grad, stat, 1.0, 2, extra, cast=False)
    print(json.dumps({"N": n, "variant": "forward", "ms": timed_ms(lambda: indexed._indexed_forward(q, k, v, index, gamma_sq, 1.0, 2, extra), 10)}), flush=True)
    for name, tiles in TILES.items():
        indexed.TILE_OVERRIDES["bwd"] = tiles
        print(json.dumps({"N": n, "variant": f"backward_{name}", "ms": timed_ms(backward, 10)}), flush=True)
    indexed.TILE_OVERRIDES.clear()
    indexed.KEY_GRADS = "inverse"
    indexed_csr.key_grads = lambda *args: (None, None)  # the kernel's query pass only
    indexed.TILE_OVERRIDES["bwd"] = {"BLOCK_M": 16, "BLOCK_K": 1, "num_warps": 2}  # the atomic default's tiles
    print(json.dumps({"N": n, "variant": "backward_without_atomics", "ms": timed_ms(backward, 10)}), flush=True)


if __name__ == "__main__":
    main()

"""Where the ZETA selection kernel's time goes, by leaving stages out (no hardware counters there).

A copy of ``_zeta_select_kernel`` as of commit 42d65c0 (one curve, causal, distinct candidates,
the band in its own tile, the default 4 rows and 1 warp per program, its own binary search)
with switches:
SEARCH=False takes the middle of the prefix instead of the binary search; GATHER=False skips the
key loads (distance from the candidate position); CUT=False stores the first WIDTH candidates
instead of the nearest. The differences of the timings place the cost.

Usage on a CUDA machine:  PYTHONPATH=. python benchmarks/zeta_select_probe.py OUT_DIR [N]
"""

from __future__ import annotations

import json
import os
import sys

import torch
import triton
import triton.language as tl

from benchmarks.zeta_bench import PATTERN, timed_ms, zeta_inputs
from sparsefocus.attention.patterns import parse_pattern
from sparsefocus.attention.zeta import SENTINEL, _codes, code_bits
from sparsefocus.kernels.zeta_select import _band, _distances, _store_nearest_distinct, sorted_prefixes


@triton.jit
def _lower_bound(SCODES, base, count, code, ok, steps):
    """[BM] number of entries below ``code`` in the sorted runs SCODES[base : base + count]: the
    binary search the selection kernel ran itself before commit 42d65c0+1 (now torch.searchsorted)."""
    lo = tl.zeros_like(count)
    hi = count
    for _ in range(steps):
        active = (lo < hi) & ok
        mid = (lo + hi) // 2
        found = tl.load(SCODES + base + mid, mask=active, other=0)
        lo = tl.where(active & (found < code), mid + 1, lo)
        hi = tl.where(active & (found >= code), mid, hi)
    return lo


@triton.jit
def _probe_kernel(
    Q, K, CODES_Q, SCODES, SPOS, NVALID, REAL, OUT, N, M, B, HQ, CHUNK, STEPS,
    D: tl.constexpr, WINDOW: tl.constexpr, LOCAL: tl.constexpr, WIDTH: tl.constexpr,
    SEARCH: tl.constexpr, GATHER: tl.constexpr, CUT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_B: tl.constexpr,
):
    pid_m, bh = tl.program_id(0), tl.program_id(1)
    b = bh // HQ
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < N
    cols = tl.arange(0, BLOCK_C)
    chunk_start = (rows // CHUNK) * CHUNK
    prefix = rows // CHUNK - 1
    searching = row_ok & (prefix >= 0)
    prefix = tl.maximum(prefix, 0)
    count = tl.load(NVALID + prefix * B + b, mask=searching, other=0)
    code = tl.load(CODES_Q + bh.to(tl.int64) * N + rows, mask=row_ok, other=0)
    base = ((prefix * B + b) * HQ + bh % HQ).to(tl.int64) * M
    if SEARCH:
        insert = _lower_bound(SCODES, base, count, code, searching, STEPS)
    else:
        insert = count // 2
    start = tl.minimum(tl.maximum(insert - WINDOW // 2, 0), tl.maximum(count - WINDOW, 0))
    slot = start[:, None] + cols[None, :]
    ok = searching[:, None] & (slot < count[:, None])
    cand = tl.load(SPOS + base[:, None] + slot, mask=ok, other=-1)
    cand_b = _band(tl.full([BLOCK_M, BLOCK_B], -1, tl.int32), tl.arange(0, BLOCK_B), 0, LOCAL, rows, row_ok, chunk_start, REAL, b, M, False)
    valid, valid_b = cand >= 0, cand_b >= 0
    if GATHER:
        q_base, k_base = Q + (bh.to(tl.int64) * N + rows) * D, K + bh.to(tl.int64) * M * D
        distance, distance_b = _distances(q_base, k_base, cand, row_ok, D), _distances(q_base, k_base, cand_b, row_ok, D)
    else:
        distance, distance_b = (cand * 7919 % 1000).to(tl.float32), (cand_b * 7919 % 1000).to(tl.float32)
    out_rows = OUT + (bh.to(tl.int64) * N + rows) * WIDTH
    if CUT:
        _store_nearest_distinct(
            distance, cand, valid, distance_b, cand_b, valid_b, out_rows, row_ok, M, STEPS, WIDTH, BLOCK_M, BLOCK_W, True, True, 8
        )
    else:
        first = tl.arange(0, BLOCK_C) < WIDTH
        tl.store(out_rows[:, None] + cols[None, :], cand + distance.to(tl.int32) * 0, mask=row_ok[:, None] & first[None, :])
        tl.store(out_rows, tl.sum(cand_b + distance_b.to(tl.int32) * 0, axis=1), mask=row_ok)  # keeps the band's work alive


def probe(n: int) -> list[dict]:
    spec = parse_pattern(PATTERN)
    q, k, _, _ = zeta_inputs(4, 16, n)
    q, k = q.detach(), k.detach()
    bits = code_bits(spec.bits, 3, 1)
    codes_q, codes_k = _codes(spec, q.float(), bits, True), _codes(spec, k.float(), bits, True)
    chunk = spec.chunk_size(n)
    scodes, spos, count = sorted_prefixes(codes_k, None, chunk, spec.chunks - 1, SENTINEL)
    out = torch.empty(4, 16, n, spec.k, dtype=torch.int32, device="cuda")
    rows = []
    for search, gather, cut in ((1, 1, 1), (0, 1, 1), (1, 0, 1), (1, 1, 0), (0, 0, 0), (1, 0, 0), (0, 1, 0), (0, 0, 1)):
        for block_m, warps in ((4, 1), (8, 1)):
            launch = lambda: _probe_kernel[(triton.cdiv(n, block_m), 64)](
                q, k, codes_q, scodes, spos, count, out, out, n, n, 4, 16, chunk, n.bit_length() + 1,
                D=3, WINDOW=spec.window, LOCAL=spec.local, WIDTH=spec.k, SEARCH=bool(search), GATHER=bool(gather), CUT=bool(cut),
                BLOCK_M=block_m, BLOCK_C=spec.window, BLOCK_W=32, BLOCK_B=spec.local, num_warps=warps,
            )
            rows.append({"search": search, "gather": gather, "cut": cut, "BLOCK_M": block_m, "warps": warps, "ms": timed_ms(launch, reps=10)})
            print(rows[-1], flush=True)
    return rows


def main(argv: list[str]) -> None:
    n = int(argv[1]) if len(argv) > 1 else 65536
    result = {"device": torch.cuda.get_device_name(), "commit": os.environ.get("SPARSEFOCUS_COMMIT", "unknown"), "N": n, "rows": probe(n)}
    with open(os.path.join(argv[0], "zeta_select_probe.json.tmp"), "w") as handle:
        json.dump(result, handle, indent=1)
    os.replace(os.path.join(argv[0], "zeta_select_probe.json.tmp"), os.path.join(argv[0], "zeta_select_probe.json"))


if __name__ == "__main__":
    main(sys.argv[1:])

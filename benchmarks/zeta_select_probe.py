"""Where the ZETA selection kernel's time goes, by leaving stages out (no hardware counters there).

A copy of ``_zeta_select_kernel`` (one curve, causal, distinct candidates) with switches:
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
from sparsefocus.kernels.zeta_select import _lower_bound, _store_nearest_distinct, sorted_prefixes


@triton.jit
def _probe_kernel(
    Q, K, CODES_Q, SCODES, SPOS, NVALID, REAL, OUT, N, M, B, HQ, CHUNK, STEPS,
    D: tl.constexpr, WINDOW: tl.constexpr, LOCAL: tl.constexpr, WIDTH: tl.constexpr,
    SEARCH: tl.constexpr, GATHER: tl.constexpr, CUT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_W: tl.constexpr,
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
    mine = cols[None, :] < WINDOW
    ok = mine & searching[:, None] & (slot < count[:, None])
    cand = tl.load(SPOS + base[:, None] + slot, mask=ok, other=-1)
    back = cols - WINDOW
    band = (back >= 0) & (back < LOCAL)
    position = rows[:, None] - back[None, :]
    ok = band[None, :] & row_ok[:, None] & (position >= chunk_start[:, None]) & (position < M)
    cand = tl.where(band[None, :], tl.where(ok, position, -1), cand)
    valid = cand >= 0
    distance = tl.zeros([BLOCK_M, BLOCK_C], tl.float32)
    if GATHER:
        k_base = K + bh.to(tl.int64) * M * D
        for d in tl.static_range(D):
            q_d = tl.load(Q + (bh.to(tl.int64) * N + rows) * D + d, mask=row_ok, other=0.0).to(tl.float32)
            k_d = tl.load(k_base + cand.to(tl.int64) * D + d, mask=valid, other=0.0).to(tl.float32)
            distance += (q_d[:, None] - k_d) * (q_d[:, None] - k_d)
    else:
        distance = (cand * 7919 % 1000).to(tl.float32)
    out_rows = OUT + (bh.to(tl.int64) * N + rows) * WIDTH
    if CUT:
        none = tl.full([BLOCK_M, 1], -1, tl.int32)  # no second (band) tile
        _store_nearest_distinct(
            distance, cand, valid, none.to(tl.float32), none, none >= 0, out_rows, row_ok, M, STEPS, WIDTH, BLOCK_M, BLOCK_W, True, False, 8
        )
    else:
        first = tl.arange(0, BLOCK_C) < WIDTH
        tl.store(out_rows[:, None] + cols[None, :], cand + distance.to(tl.int32) * 0, mask=row_ok[:, None] & first[None, :])


def probe(n: int) -> list[dict]:
    spec = parse_pattern(PATTERN)
    q, k, _, _ = zeta_inputs(4, 16, n)
    q, k = q.detach(), k.detach()
    bits = code_bits(spec.bits, 3, 1)
    codes_q, codes_k = _codes(spec, q.float(), bits, True), _codes(spec, k.float(), bits, True)
    real = torch.ones(4, n, dtype=torch.bool, device="cuda")
    chunk = spec.chunk_size(n)
    scodes, spos, count = sorted_prefixes(codes_k, real, chunk, spec.chunks - 1, SENTINEL)
    out = torch.empty(4, 16, n, spec.k, dtype=torch.int32, device="cuda")
    rows = []
    for search, gather, cut in ((1, 1, 1), (0, 1, 1), (1, 0, 1), (1, 1, 0), (0, 0, 0), (1, 0, 0), (0, 1, 0), (0, 0, 1)):
        for block_m in (16, 32):
            launch = lambda: _probe_kernel[(triton.cdiv(n, block_m), 64)](
                q, k, codes_q, scodes, spos, count, real.to(torch.int8), out, n, n, 4, 16, chunk, n.bit_length() + 1,
                D=3, WINDOW=spec.window, LOCAL=spec.local, WIDTH=spec.k, SEARCH=bool(search), GATHER=bool(gather), CUT=bool(cut),
                BLOCK_M=block_m, BLOCK_C=128, BLOCK_W=32, num_warps=4,
            )
            rows.append({"search": search, "gather": gather, "cut": cut, "BLOCK_M": block_m, "ms": timed_ms(launch, reps=10)})
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

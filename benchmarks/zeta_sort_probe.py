"""The keys' sort of ZETA's selection at B=4, Hk=16 and one curve, in other forms: the stable
sort along the last dim of [S*B*Hk, M] int64 codes (what ``sorted_prefixes`` does), the same
codes with the row number in the bits above them sorted as one flat stable run, and that flat
run unstable (ties cannot occur once the position is packed in too).

Usage on a CUDA machine:  PYTHONPATH=. python benchmarks/zeta_sort_probe.py [N ...]
Prints one JSON row per N with the median ms of each form.
"""

from __future__ import annotations

import json
import sys

import torch

from benchmarks.zeta_bench import timed_ms


def main() -> None:
    for n in [int(x) for x in sys.argv[1:]] or [65536]:
        gen = torch.Generator(device="cuda").manual_seed(0)
        codes = torch.randint(0, 1 << 36, (64, n), generator=gen, device="cuda", dtype=torch.int64)  # 12 bits x 3 dims
        rows = torch.arange(64, device="cuda", dtype=torch.int64)[:, None]
        flat = (codes | (rows << 37)).reshape(-1)
        packed = ((codes << 20) | torch.arange(n, device="cuda")[None, :]).reshape(-1) if n <= 1 << 20 else None
        row = {"N": n, "rows_stable_ms": timed_ms(lambda: torch.sort(codes, dim=-1, stable=True), 10)}
        row["flat_stable_ms"] = timed_ms(lambda: torch.sort(flat, stable=True), 10)
        row["flat_unstable_ms"] = timed_ms(lambda: torch.sort(flat), 10)
        row["rows_packed_unstable_ms"] = timed_ms(lambda: torch.sort(packed.view(64, n), dim=-1), 10)
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()

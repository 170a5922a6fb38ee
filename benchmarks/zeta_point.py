"""ZETA forward and forward+backward time and peak memory at a few N, one JSON row each: the
quick point measurement for comparing two versions of the package in alternating processes
(PYTHONPATH picks the version; the label names it).

Usage on a CUDA machine:  PYTHONPATH=. python benchmarks/zeta_point.py LABEL [N ...]
B=4, H=16, Dv=64, bf16, causal, the bench's pattern and protocol (benchmarks/zeta_bench.py).
"""

from __future__ import annotations

import json
import sys

import sparsefocus
from benchmarks.zeta_bench import peak_mb, timed_ms, zeta_inputs, zeta_step


def main() -> None:
    label = sys.argv[1]
    for n in [int(x) for x in sys.argv[2:]] or [8192, 65536]:
        q, k, v, gamma = zeta_inputs(4, 16, n)
        row = {"label": label, "package": sparsefocus.__file__, "N": n}
        row["fwd_ms"] = timed_ms(zeta_step(q, k, v, gamma, backward=False), 7)
        row["fwdbwd_ms"] = timed_ms(zeta_step(q, k, v, gamma), 7)
        row["peak_mb"] = peak_mb(zeta_step(q, k, v, gamma))
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()

"""Host time of a compiled Decoder step in Inductor's default mode: a cProfile of 10 steps per
pattern (N=8192, B=1, fused AdamW, bf16), to see where the time outside the kernels goes.
Usage: PYTHONPATH=. python benchmarks/probes/compiled_host.py OUT_DIR [PATTERN ...]"""

from __future__ import annotations

import cProfile
import io
import json
import pstats
import sys
import time
from pathlib import Path

import torch

from sparsefocus.bench.model import ModelCase, build_parser, make_step


def main() -> None:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    patterns = sys.argv[2:] or ["BAND:64", "FULL"]
    args = build_parser().parse_args(["--compile", "on", "--fused-optimizer", "--batch", "1"])
    record = {}
    for pattern in patterns:
        step = make_step(args, ModelCase(pattern, 8192, "compiled"), torch.device("cuda"))
        for _ in range(3):
            step()
        torch.cuda.synchronize()
        begin = time.perf_counter()
        for _ in range(10):
            step()
        host = (time.perf_counter() - begin) / 10
        torch.cuda.synchronize()
        record[pattern] = {"host_ms": round(host * 1e3, 3), "wall_ms": round((time.perf_counter() - begin) * 100, 3)}
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(10):
            step()
        torch.cuda.synchronize()
        profile.disable()
        for key in ("tottime", "cumulative"):
            text = io.StringIO()
            pstats.Stats(profile, stream=text).sort_stats(key).print_stats(60)
            (out / f"cprofile_{pattern.replace(':', '')}_{key}.txt").write_text(text.getvalue())
        print(pattern, record[pattern], flush=True)
    (out / "compiled_host.json").write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()

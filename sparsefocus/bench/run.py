"""``sparsefocus bench``: time and memory of patterns and baselines over a sweep of N.

Example (the command of benchmarks/results/)::

    sparsefocus bench TOPK:32 indexed:32 sdpa flex:256 naive:TOPK:32 --n 4096 16384 65536 \\
        --batch 4 --heads 16 --head-dim 64 --dtype bf16 --causal --out benchmarks/results/h200.json

Writes a JSON file (command, git commit, device, one row per case x N x mode) and a log-log PNG
of time and peak memory against N beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from sparsefocus.bench import block_sparse_cases, zeta_cases  # noqa: F401  (register their cases)
from sparsefocus.bench.registry import CASES, BenchShape
from sparsefocus.bench.runner import MODES, PEAK_TBPS, PEAK_TFLOPS, measure

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="sparsefocus bench", description=__doc__.split("\n")[0])
    parser.add_argument("cases", nargs="+", help=f"pattern strings or cases ({', '.join(sorted(CASES))}), e.g. TOPK:32 sdpa flex:256")
    parser.add_argument("--n", type=int, nargs="+", default=[1024, 4096], help="sequence lengths")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=None, help="default: --heads")
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--max-ms", type=float, default=5000.0, help="skip larger N of a case once a run took longer")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", type=Path, default=Path("bench.json"), help="JSON path; the PNG goes beside it")
    parser.add_argument("--no-plot", action="store_true")
    return parser.parse_args(argv)


def git_commit() -> str:
    """HEAD of the working tree, else $SPARSEFOCUS_COMMIT (set when the tree travels without .git)."""
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True, timeout=10)
        return out.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return os.environ.get("SPARSEFOCUS_COMMIT", "unknown")


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"


def sweep(args: argparse.Namespace) -> list[dict]:
    """Measure every case at every N; a case that ran longer than --max-ms skips the larger N."""
    device = torch.device(args.device)
    rows: list[dict] = []
    for case in args.cases:
        too_slow = False
        for n in sorted(args.n):
            if too_slow:
                rows += [{"case": case, "n": n, "mode": mode, "status": "skipped"} for mode in args.modes]
                continue
            shape = BenchShape(args.batch, args.heads, args.kv_heads or args.heads, n, args.head_dim, DTYPES[args.dtype], args.causal, device)
            new = measure(case, shape, tuple(args.modes), args.warmup, args.repeats)
            for row in new:
                print(format_row(row), flush=True)
            too_slow = any(row.get("ms", 0) > args.max_ms for row in new)
            rows += new
    return rows


def format_row(row: dict) -> str:
    if row["status"] != "ok":
        return f"{row['case']:<22} N={row['n']:<7} {row['mode']:<8} {row['status']}"
    peak = "n/a" if row["peak_mb"] is None else f"{row['peak_mb']:.0f} MB"
    return (
        f"{row['case']:<22} N={row['n']:<7} {row['mode']:<8} {row['ms']:10.3f} ms  {peak:>10}  "
        f"{row['tflops']:7.1f} TFLOP/s ({100 * row['frac_peak_flops']:.1f}% peak, {100 * row['frac_peak_bandwidth']:.1f}% bw)"
    )


def write_json_atomic(path: Path, payload: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as handle:
        json.dump(payload, handle, indent=1)
    os.replace(handle.name, path)


def main(argv: list[str]) -> int:
    """Entry point of ``sparsefocus bench``; returns the exit status."""
    args = parse_args(argv)
    device = torch.device(args.device)
    rows = sweep(args)
    payload = {
        "command": "sparsefocus bench " + " ".join(argv),
        "git_commit": git_commit(),
        "device": device_name(device),
        "torch": torch.__version__,
        "triton": _triton_version(),
        "shape": {k: getattr(args, k) for k in ("batch", "heads", "kv_heads", "head_dim", "dtype", "causal", "warmup", "repeats")},
        "ceilings": {"tflops": PEAK_TFLOPS, "tbps": PEAK_TBPS},
        "kernel_tiles": _kernel_tiles(),
        "results": rows,
    }
    write_json_atomic(args.out, payload)
    if not args.no_plot:
        from sparsefocus.bench.plot import plot_results

        plot_results(payload, args.out.with_suffix(".png"))
    print(f"wrote {args.out}", flush=True)
    return 0


def _kernel_tiles() -> dict:
    """Tile overrides in force in the kernels (set by benchmarks/gpu_session.py's tile pick)."""
    tiles = {}
    for name in ("indexed", "topk_select"):
        module = sys.modules.get(f"sparsefocus.kernels.{name}")
        if module is not None:
            tiles[name] = dict(getattr(module, "TILE_OVERRIDES", {}))
    return tiles


def _triton_version() -> str | None:
    try:
        import triton

        return triton.__version__
    except ImportError:
        return None


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

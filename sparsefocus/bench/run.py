"""``sparsefocus bench``: time, memory and kernel launches of attention over a sweep of N.

Every run also times the dense baselines on the same shapes: SDPA under each backend (cuDNN,
FlashAttention, memory-efficient, math) and compiled FlexAttention with the causal block mask.
"dense" in the results is the fastest SDPA backend at each (N, mode) of this run; every row has
``speedup_vs_dense`` = dense ms / its ms. ``sparsefocus bench --model ...`` times a whole training
step of the project's Decoder instead (``sparsefocus/bench/model.py``).

Example::

    sparsefocus bench TOPK:32 zeta BAND:64 --n 4096 16384 65536 --batch 4 --heads 16 \\
        --head-dim 64 --dtype bf16 --causal --out results/kernels.json

Writes the JSON (command, git commit, device, versions, one row per case x N x mode) and a PNG
beside it. Exit status: 0 when at least one requested case ran, 1 when every one failed (no file
is written), 2 for a bad command line.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import json
import os
import platform
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType

import torch

from sparsefocus.bench import block_sparse_cases, zeta_cases  # noqa: F401  (register their cases)
from sparsefocus.bench.dense import DENSE_CASES, attach_dense_ratios, dense_table
from sparsefocus.bench.registry import CASES, BenchShape
from sparsefocus.bench.runner import MODES, ceilings_for, measure

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
BASELINES = (*DENSE_CASES, "flex")
PROG = "sparsefocus bench"


class BenchError(Exception):
    """A problem with the command line or the machine, reported as one line on stderr."""


def parse_constant(assignment: str) -> tuple[ModuleType, str, object]:
    """``sparsefocus.MODULE.NAME=VALUE`` (VALUE a Python literal, else a string) -> (the module, the
    name, the value), for a module constant that exists. BenchError otherwise."""
    target, sep, text = assignment.partition("=")
    module_name, _, name = target.rpartition(".")
    if not sep or not module_name.startswith("sparsefocus") or not name:
        raise BenchError(f"--constant takes sparsefocus.MODULE.NAME=VALUE, got {assignment!r}")
    try:
        module = importlib.import_module(module_name)
    except ImportError:
        raise BenchError(f"--constant {assignment!r}: no module {module_name}") from None
    if not hasattr(module, name):
        raise BenchError(f"--constant {assignment!r}: {module_name} has no constant {name}")
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        value = text
    return module, name, value


@contextmanager
def constants_set(assignments: list[str]) -> Iterator[dict[str, object]]:
    """Set module constants (``--constant``; an implementation choice to A/B, e.g.
    ``sparsefocus.kernels.indexed.KEY_GRADS=inverse``) for the duration of a run, then restore
    them. Yields {dotted name: value}; BenchError for a bad one, before any is set."""
    parsed = [parse_constant(assignment) for assignment in assignments]
    saved = [(module, name, getattr(module, name)) for module, name, _ in parsed]
    try:
        for module, name, value in parsed:
            setattr(module, name, value)
        yield {f"{module.__name__}.{name}": value for module, name, value in parsed}
    finally:
        for module, name, value in reversed(saved):
            setattr(module, name, value)


def add_constant_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--constant",
        action="append",
        default=[],
        metavar="MODULE.NAME=VALUE",
        help="set a sparsefocus module constant for this run (repeatable), e.g. sparsefocus.kernels.zeta_select.PACKED_KEYS=False",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Time attention cases over a sweep of N against the fastest SDPA backend and FlexAttention, same shapes, same run.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "cases",
        nargs="*",
        default=[],
        help=f"pattern strings or registered cases ({', '.join(sorted(CASES))}), e.g. TOPK:32 zeta flex:256; 'sdpa' means every backend",
    )
    parser.add_argument("--model", action="store_true", help="time a training step of the Decoder instead; see --model --help")
    parser.add_argument(
        "--baselines",
        nargs="*",
        default=list(BASELINES),
        help="cases timed in every run for the dense ratio and the peers; give none to skip",
    )
    parser.add_argument("--n", type=int, nargs="+", default=[1024, 4096], help="sequence lengths N")
    parser.add_argument("--batch", type=int, default=4, help="batch size B")
    parser.add_argument("--heads", type=int, default=16, help="query heads H")
    parser.add_argument("--kv-heads", type=int, default=None, help="key/value heads (GQA); None means --heads")
    parser.add_argument("--head-dim", type=int, default=64, help="head width D")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16", help="q, k, v dtype")
    parser.add_argument("--causal", action="store_true", help="causal attention (query i sees keys j <= i)")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES), help="forward alone and/or forward + backward")
    parser.add_argument("--warmup", type=int, default=3, help="untimed runs before timing")
    parser.add_argument("--repeats", type=int, default=10, help="timed runs; the median is reported")
    parser.add_argument(
        "--max-ms", type=float, default=5000.0, help="skip the larger N of a case once one of its runs took longer (ms)"
    )
    parser.add_argument(
        "--cuda-graphs",
        action="store_true",
        help="also time each run replayed from a CUDA graph (graph_ms: device time without host work), with its own dense ratio",
    )
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="torch device")
    parser.add_argument("--out", type=Path, default=Path("bench.json"), help="JSON path; the PNG goes beside it")
    parser.add_argument("--no-plot", action="store_true", help="write no PNG")
    add_constant_argument(parser)
    return parser


def resolve_device(name: str) -> torch.device:
    """The torch device of ``--device``; BenchError when it is malformed or absent here."""
    try:
        device = torch.device(name)
    except RuntimeError as error:
        raise BenchError(f"--device {name!r} is not a torch device ({error})") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise BenchError(f"--device {name} but CUDA is not available here (torch {torch.__version__}); use --device cpu")
    if device.type not in ("cuda", "cpu"):
        raise BenchError(f"--device {name}: only cuda and cpu are supported")
    return device


def expand_cases(cases: list[str]) -> list[str]:
    """Case strings with ``sdpa`` spelled out per backend, duplicates dropped, order kept."""
    expanded: list[str] = []
    for case in cases:
        expanded += list(DENSE_CASES) if case.strip().lower() == "sdpa" else [case]
    return list(dict.fromkeys(expanded))


def git_commit() -> str:
    """$SPARSEFOCUS_COMMIT when set (a tree copied to another machine may carry stale git
    metadata), else HEAD of the working tree."""
    if os.environ.get("SPARSEFOCUS_COMMIT"):
        return os.environ["SPARSEFOCUS_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True, timeout=10)
        return out.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return os.environ.get("SPARSEFOCUS_COMMIT", "unknown")


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"


def run_metadata(argv: list[str], device: torch.device) -> dict:
    """Command, commit, device and library versions of a run (the head of every result JSON)."""
    return {
        "command": f"{PROG} " + " ".join(argv),
        "git_commit": git_commit(),
        "device": device_name(device),
        "torch": torch.__version__,
        "triton": _triton_version(),
    }


def sweep(args: argparse.Namespace, cases: list[str], device: torch.device, ceilings: dict | None) -> list[dict]:
    """Measure every case at every N; a case that ran longer than --max-ms skips the larger N."""
    rows: list[dict] = []
    for case in cases:
        too_slow = False
        for n in sorted(args.n):
            if too_slow:
                rows += [{"case": case, "n": n, "mode": mode, "status": "skipped"} for mode in args.modes]
                continue
            shape = BenchShape(
                args.batch, args.heads, args.kv_heads or args.heads, n, args.head_dim, DTYPES[args.dtype], args.causal, device
            )
            new = measure(case, shape, tuple(args.modes), args.warmup, args.repeats, ceilings, args.cuda_graphs)
            for row in new:
                print(format_row(row), file=sys.stdout if row["status"] == "ok" else sys.stderr, flush=True)
            too_slow = any(row.get("ms", 0) > args.max_ms for row in new)
            rows += new
    return rows


def format_row(row: dict) -> str:
    head = f"{row['case']:<24} N={row['n']:<7} {row['mode']:<8}"
    if row["status"] != "ok":
        return f"{head} {row['status']}" + (f": {row['error']}" if row.get("error") else "")
    peak = "" if row["peak_mb"] is None else f"{row['peak_mb']:9.0f} MB"
    launches = "" if row["launches"] is None else f"{row['launches']:5d} kernels"
    frac = f" ({100 * row['frac_peak_flops']:.1f}% of peak)" if "frac_peak_flops" in row else ""
    graph = f", graph {row['graph_ms']:.3f} ms" if "graph_ms" in row else ""
    graph += f", graph {row['graph_error']}" if "graph_error" in row else ""
    return f"{head} {row['ms']:10.3f} ms {peak} {launches} {row['tflops']:7.1f} TFLOP/s{frac}{graph}"


def write_json_atomic(path: Path, payload: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as handle:
        json.dump(payload, handle, indent=1)
    os.replace(handle.name, path)


def any_ok(rows: list[dict], cases: list[str]) -> bool:
    """True when some row of ``cases`` (of every row, when ``cases`` is empty) measured ok."""
    wanted = set(cases)
    return any(row["status"] == "ok" and (not wanted or row["case"] in wanted) for row in rows)


def main(argv: list[str]) -> int:
    """Entry point of ``sparsefocus bench``; returns the exit status."""
    if "--model" in argv:
        from sparsefocus.bench.model import main as model_main

        return model_main([arg for arg in argv if arg != "--model"])
    args = build_parser().parse_args(argv)
    try:
        device = resolve_device(args.device)
        if args.cuda_graphs and device.type != "cuda":
            raise BenchError(f"--cuda-graphs needs a CUDA device, not {device}")
        requested = expand_cases(args.cases)
        cases = expand_cases(list(args.baselines) + requested)
        if not cases:
            raise BenchError("nothing to time: give cases or --baselines")
        with constants_set(args.constant) as constants:
            return _measure_and_write(args, argv, device, cases, requested, constants)
    except BenchError as error:
        print(f"{PROG}: error: {error}", file=sys.stderr)
        return 2


def _measure_and_write(
    args: argparse.Namespace, argv: list[str], device: torch.device, cases: list[str], requested: list[str], constants: dict
) -> int:
    ceilings = ceilings_for(device_name(device)) if device.type == "cuda" else None
    rows = attach_dense_ratios(sweep(args, cases, device, ceilings))
    if not any_ok(rows, requested):
        print(f"{PROG}: error: every requested case failed; no files written", file=sys.stderr)
        return 1
    payload = run_metadata(argv, device) | {
        "shape": {
            k: getattr(args, k) for k in ("batch", "heads", "kv_heads", "head_dim", "dtype", "causal", "warmup", "repeats")
        },
        "ceilings": ceilings,
        "dense": dense_table(rows),
        "graph_dense": dense_table(rows, "graph_ms") if args.cuda_graphs else None,
        "kernel_tiles": _kernel_tiles(),
        "constants": constants,
        "results": rows,
    }
    write_json_atomic(args.out, payload)
    if not args.no_plot:
        from sparsefocus.bench.plot import plot_results

        plot_results(payload, args.out.with_suffix(".png"))
    print(f"wrote {args.out}", flush=True)
    return 0


def _kernel_tiles() -> dict:
    """Tile overrides in force in the kernels (set by tuning scripts before a run)."""
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

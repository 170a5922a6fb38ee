"""``sparsefocus bench --model``: one training step of the project's ``Decoder`` per pattern and N.

A step is ``zero_grad``, forward under autocast, cross-entropy on random next tokens, backward and
``AdamW.step`` (``--fused-optimizer``: the fused update); eager, and with the model under
``torch.compile`` (``--compile-mode``: Inductor's default, or ``reduce-overhead``, which replays
the compiled forward and backward as CUDA graphs and so removes most launch cost from the
host). The timed steps run unmarked; the eager profile afterwards marks attention. Per (pattern, N, mode) it
reports the median ms per step (CUDA events, after warm-up), tokens per second, peak memory
(``torch.cuda.max_memory_allocated``, reset per case, so parameters, optimizer state and
activations all count), attention's share of the step's device time (``profiling.py``), the
device's busy time over the step's time (well below 1: the step waits on the host, not the GPU),
the heaviest kernels (``--top-kernels``) and the ratio FULL ms / pattern ms at the same N and
mode (> 1: the pattern pays in this model).

FULL is timed under each SDPA backend (``--full-backends``) and the fastest is FULL's baseline,
so a pattern is never compared with a slower dense kernel than the GPU offers.

Example::

    sparsefocus bench --model --lengths 4096 16384 65536 --batch 1 \\
        --patterns FULL BAND:64 TOPK:32 zeta --out results/model.json
"""

from __future__ import annotations

import argparse
import sys
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from sparsefocus.attention import parse_pattern
from sparsefocus.bench.profiling import (
    ATTENTION_RANGE,
    attention_share,
    count_kernels,
    device_ms,
    profile_events,
    top_kernels,
)
from sparsefocus.bench.registry import SDPA_BACKENDS, sdpa_backend
from sparsefocus.bench.run import (
    PROG,
    BenchError,
    add_constant_argument,
    constants_set,
    resolve_device,
    run_metadata,
    write_json_atomic,
)
from sparsefocus.bench.runner import error_message, is_oom, median_ms, pipelined_ms, release_memory
from sparsefocus.models.config import ModelConfig
from sparsefocus.models.decoder import Decoder

DEFAULT_PATTERNS = ("FULL", "BAND:64", "TOPK:32", "zeta")
FULL_BACKENDS = ("cudnn", "flash", "efficient")
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune-no-cudagraphs")
AUTOCAST = {"bf16": torch.bfloat16, "fp32": None}
MAX_N = 65536


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=f"{PROG} --model",
        description="Time one training step of the project's Decoder per pattern and N, eager and compiled, against FULL.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "--patterns", nargs="+", default=list(DEFAULT_PATTERNS), help="pattern strings, one model each (FULL is the baseline)"
    )
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384], help=f"sequence lengths N (at most {MAX_N})")
    parser.add_argument("--batch", type=int, default=1, help="sequences per step")
    parser.add_argument("--blocks", type=int, default=4, help="transformer blocks")
    parser.add_argument("--dim", type=int, default=512, help="model width d")
    parser.add_argument("--heads", type=int, default=8, help="attention heads")
    parser.add_argument("--mlp", type=int, default=2048, help="hidden width of the MLP (GELU)")
    parser.add_argument("--vocab", type=int, default=256, help="vocabulary size (random tokens)")
    parser.add_argument("--dropout", type=float, default=0.0, help="dropout of the model")
    parser.add_argument(
        "--compile",
        choices=("off", "on", "both"),
        default="both",
        help="eager, torch.compile, or both; 'both' on CPU runs eager only (Inductor's C++ build takes minutes), 'on' compiles there too",
    )
    parser.add_argument(
        "--compile-mode",
        choices=COMPILE_MODES,
        default="default",
        help="torch.compile's mode for the compiled runs; reduce-overhead captures the forward and backward in CUDA graphs",
    )
    parser.add_argument(
        "--fused-optimizer", action="store_true", help="AdamW(fused=True): one kernel per step for the update (CUDA)"
    )
    parser.add_argument(
        "--full-backends",
        nargs="+",
        choices=SDPA_BACKENDS,
        default=list(FULL_BACKENDS),
        help="SDPA backends FULL is timed under; the fastest is the baseline",
    )
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first (the first compiles)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps; the median is reported")
    parser.add_argument("--dtype", choices=sorted(AUTOCAST), default="bf16", help="autocast dtype (fp32: no autocast)")
    parser.add_argument("--lr", type=float, default=1e-4, help="AdamW learning rate")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="torch device")
    parser.add_argument("--out", type=Path, default=Path("bench_model.json"), help="JSON path; the PNG goes beside it")
    parser.add_argument(
        "--top-kernels", type=int, default=8, help="heaviest kernels (CPU: ops) per row in the JSON, by device time"
    )
    parser.add_argument("--no-plot", action="store_true", help="write no PNG")
    add_constant_argument(parser)
    return parser


@dataclass(frozen=True)
class ModelCase:
    """One measurement: a pattern (FULL under one SDPA backend) at length n, eager or compiled."""

    pattern: str
    n: int
    mode: str
    sdpa_backend: str | None = None

    def label(self) -> str:
        backend = f" [sdpa:{self.sdpa_backend}]" if self.sdpa_backend else ""
        return f"{self.pattern}{backend}"


def is_full(pattern: str) -> bool:
    return parse_pattern(pattern).name == "full"


def model_cases(args: argparse.Namespace, device: torch.device) -> list[ModelCase]:
    """Every (pattern [x FULL backend], N, mode) of the command line, N ascending."""
    modes = {"off": ["eager"], "on": ["compiled"], "both": ["eager", "compiled"]}[args.compile]
    cases = []
    for pattern in args.patterns:
        backends = args.full_backends if is_full(pattern) else [None]
        for backend in backends:
            for mode in modes:
                cases += [ModelCase(pattern, n, mode, backend) for n in sorted(args.lengths)]
    return cases


@contextmanager
def marked_attention():
    """Run every ``SparseAttention`` call of ``sparse_attention`` inside
    ``record_function(ATTENTION_RANGE)`` so the profiler can tell attention's ops apart."""
    import sparsefocus.layers.attention as layer

    original = layer.sparse_attention

    def marked(*args, **kwargs):
        with torch.profiler.record_function(ATTENTION_RANGE):
            return original(*args, **kwargs)

    layer.sparse_attention = marked
    try:
        yield
    finally:
        layer.sparse_attention = original


def make_step(args: argparse.Namespace, case: ModelCase, device: torch.device):
    """A closure running one training step of a fresh Decoder (seed 0) on random tokens."""
    torch.manual_seed(0)
    config = ModelConfig(
        blocks=args.blocks, heads=args.heads, dim=args.dim, mlp_dim=args.mlp, activation="gelu", dropout=args.dropout
    )
    model = Decoder(config, case.pattern, vocab_size=args.vocab, max_len=case.n).to(device)
    fused = True if args.fused_optimizer and device.type == "cuda" else None  # None: torch's default (foreach)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, fused=fused)
    graphs = case.mode == "compiled" and args.compile_mode == "reduce-overhead"
    forward = torch.compile(model, mode=args.compile_mode) if case.mode == "compiled" else model
    tokens = torch.randint(args.vocab, (args.batch, case.n + 1), device=device)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]  # [B, N] each
    dtype = AUTOCAST[args.dtype]

    def step() -> None:
        if graphs:  # a new iteration: the graphs may overwrite the last step's outputs
            torch.compiler.cudagraph_mark_step_begin()
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=dtype) if dtype is not None else nullcontext():
            logits = forward(inputs)  # [B, N, V]
        loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
        loss.backward()
        optimizer.step()

    return step


def _timed_first_step(step, device: torch.device) -> float:
    begin = time.perf_counter()
    step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - begin


def measure_model_case(args: argparse.Namespace, case: ModelCase, device: torch.device) -> dict:
    """One result row: ms/step, tokens/s, peak MB, attention share, launches; or the failure."""
    row = {"pattern": case.pattern, "sdpa_backend": case.sdpa_backend, "n": case.n, "mode": case.mode, "batch": args.batch}
    if case.mode == "compiled" and device.type == "cpu" and args.compile == "both":
        return row | {"status": "off", "error": "compile runs on CPU only with --compile on (Inductor's C++ build takes minutes)"}
    release_memory(device)
    torch._dynamo.reset()  # a fresh graph per case: no recompile limits, no stale SDPA backend choice
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    backend = sdpa_kernel_context(case.sdpa_backend)
    try:
        with backend:
            step = make_step(args, case, device)
            first_s = _timed_first_step(step, device)
            ms = pipelined_ms(step, device, max(args.warmup - 1, 0), args.steps)
            synced_ms = median_ms(step, device, 0, args.steps)
            # the attention ranges only in the eager profile, after the timing: inside a compiled
            # model Dynamo would trace them (and the share is found by op name there)
            with marked_attention() if case.mode == "eager" else nullcontext():
                events = profile_events(step, device)
    except Exception as error:  # noqa: BLE001 - recorded in the results, the sweep goes on
        # A backend that refuses the model's shapes is "unavailable" for FULL, as in the kernel bench.
        status = "oom" if is_oom(error) else "unavailable" if case.sdpa_backend else "error"
        failed = row | {"status": status, "error": error_message(error, 500)}
        step = None
        torch._dynamo.reset()
        release_memory(device)
        return failed
    peak = torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None
    del step
    release_memory(device)
    return row | {
        "status": "ok",
        "ms": ms,
        "synced_ms": synced_ms,
        "tokens_per_s": args.batch * case.n / (ms / 1e3),
        "peak_mb": peak,
        "attention_share": attention_share(events, device),
        "attention_share_method": share_method(case.mode, device),
        "launches": (count_kernels(events) or None) if device.type == "cuda" else None,  # 0: the profiler saw none
        "first_step_s": first_s,
        **busy_fields(events, device, ms, args.top_kernels),
    }


def busy_fields(events: list, device: torch.device, ms: float, count: int) -> dict:
    """The profiled step's kernel time (device_ms), its share of the timed step (device_busy: well
    below 1 means the GPU waits on the host) and its heaviest kernels."""
    busy = device_ms(events, device)
    return {
        "device_ms": busy,
        "device_busy": None if busy is None else busy / ms,
        "top_kernels": top_kernels(events, device, count),
    }


def sdpa_kernel_context(backend: str | None):
    """``sdpa_kernel`` of a bench backend name, or a no-op for patterns that do not call SDPA."""
    if backend is None:
        return nullcontext()
    from torch.nn.attention import sdpa_kernel

    return sdpa_kernel(sdpa_backend(backend))


def share_method(mode: str, device: torch.device) -> str:
    time_kind = "device time" if device.type == "cuda" else "self CPU time"
    if mode == "eager":
        return f"{time_kind} of the ops inside record_function('{ATTENTION_RANGE}') and their backward"
    return f"{time_kind} of SDPA and sparsefocus ops and kernels by name (selection fused by Inductor not counted)"


def full_baseline(rows: list[dict]) -> dict[tuple[int, str], dict]:
    """{(n, mode): {"backend", "ms"}} of the fastest ok FULL row at each point."""
    best: dict[tuple[int, str], dict] = {}
    for row in rows:
        if row["status"] != "ok" or not is_full(row["pattern"]):
            continue
        key = (row["n"], row["mode"])
        if key not in best or row["ms"] < best[key]["ms"]:
            best[key] = {"backend": row["sdpa_backend"], "ms": row["ms"]}
    return best


def attach_full_ratios(rows: list[dict]) -> list[dict]:
    """Rows with ``full_ms``, ``full_backend`` and ``vs_full`` = FULL ms / ms (None where absent)."""
    best = full_baseline(rows)
    out = []
    for row in rows:
        full = best.get((row["n"], row["mode"]))
        out.append(
            row
            | {
                "full_ms": full["ms"] if full else None,
                "full_backend": full["backend"] if full else None,
                "vs_full": full["ms"] / row["ms"] if full is not None and row["status"] == "ok" else None,
            }
        )
    return out


def headline_rows(rows: list[dict]) -> list[dict]:
    """Rows for tables and plots: every non-FULL row, and at each point only the fastest FULL."""
    best = full_baseline(rows)
    keep = []
    for row in rows:
        if (
            not is_full(row["pattern"])
            or row["status"] == "ok"
            and best[(row["n"], row["mode"])]["backend"] == row["sdpa_backend"]
        ):
            keep.append(row)
    return keep


def sweep(args: argparse.Namespace, device: torch.device) -> list[dict]:
    """Measure every case; after an OOM the larger N of the same (pattern, backend, mode) are skipped."""
    rows: list[dict] = []
    failed_at: dict[tuple[str, str | None, str], int] = {}  # (pattern, backend, mode) -> N of the OOM
    for case in model_cases(args, device):
        key = (case.pattern, case.sdpa_backend, case.mode)
        if key in failed_at:
            row = {
                "pattern": case.pattern,
                "sdpa_backend": case.sdpa_backend,
                "n": case.n,
                "mode": case.mode,
                "batch": args.batch,
            }
            rows.append(row | {"status": "skipped", "error": f"out of memory at N={failed_at[key]}"})
            continue
        row = measure_model_case(args, case, device)
        if row["status"] == "oom":
            failed_at[key] = case.n
        print(format_model_row(row, case), file=sys.stdout if row["status"] in ("ok", "off") else sys.stderr, flush=True)
        rows.append(row)
    return rows


def format_model_row(row: dict, case: ModelCase | None = None) -> str:
    label = (case or ModelCase(row["pattern"], row["n"], row["mode"], row["sdpa_backend"])).label()
    head = f"{label:<26} N={row['n']:<7} {row['mode']:<9}"
    if row["status"] != "ok":
        return f"{head} {row['status']}: {row.get('error', '')}"
    peak = "" if row["peak_mb"] is None else f"{row['peak_mb']:9.0f} MB"
    share = "" if row["attention_share"] is None else f"attention {100 * row['attention_share']:4.1f}%"
    if row.get("device_busy") is not None:
        share += f" GPU busy {100 * row['device_busy']:4.1f}%"
    ratio = f"  FULL/this {row['vs_full']:.2f}x" if row.get("vs_full") else ""
    return f"{head} {row['ms']:10.2f} ms/step {row['tokens_per_s']:12.0f} tok/s {peak} {share}{ratio}"


def check_args(args: argparse.Namespace) -> None:
    """BenchError naming the first bad option."""
    if args.top_kernels < 0:
        raise BenchError(f"--top-kernels must be >= 0, got {args.top_kernels}")
    for name in ("batch", "blocks", "dim", "heads", "mlp", "vocab", "steps"):
        if getattr(args, name) < 1:
            raise BenchError(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.warmup < 1:
        raise BenchError(f"--warmup must be >= 1 (the first step compiles), got {args.warmup}")
    bad = [n for n in args.lengths if not 1 <= n <= MAX_N]
    if bad:
        raise BenchError(f"--lengths must be in 1..{MAX_N}, got {bad[0]}")
    if args.dim % args.heads:
        raise BenchError(f"--heads ({args.heads}) must divide --dim ({args.dim})")
    for pattern in args.patterns:
        try:
            parse_pattern(pattern)
        except ValueError as error:
            raise BenchError(f"--patterns {pattern!r}: {error}") from None


def main(argv: list[str]) -> int:
    """Entry point of ``sparsefocus bench --model``; returns the exit status."""
    args = build_parser().parse_args(argv)
    try:
        device = resolve_device(args.device)
        check_args(args)
        with constants_set(args.constant) as constants:
            return _measure_and_write(args, argv, device, constants)
    except BenchError as error:
        print(f"{PROG}: error: {error}", file=sys.stderr)
        return 2


def _measure_and_write(args: argparse.Namespace, argv: list[str], device: torch.device, constants: dict) -> int:
    rows = attach_full_ratios(sweep(args, device))
    if not any(row["status"] == "ok" for row in rows):
        print(f"{PROG}: error: every model case failed; no files written", file=sys.stderr)
        return 1
    config = {
        k: getattr(args, k)
        for k in (
            "blocks",
            "dim",
            "heads",
            "mlp",
            "vocab",
            "dropout",
            "batch",
            "dtype",
            "warmup",
            "steps",
            "lr",
            "compile_mode",
            "fused_optimizer",
        )
    }
    baseline = full_baseline(rows)
    payload = run_metadata(["--model", *argv], device) | {
        "config": config | {"optimizer": "AdamW", "activation": "gelu"},
        "full_baseline": [{"n": n, "mode": mode} | baseline[(n, mode)] for n, mode in sorted(baseline)],
        "constants": constants,
        "results": rows,
    }
    write_json_atomic(args.out, payload)
    if not args.no_plot:
        from sparsefocus.bench.plot import plot_model_results

        plot_model_results(payload, args.out.with_suffix(".png"))
    print(f"wrote {args.out}", flush=True)
    return 0

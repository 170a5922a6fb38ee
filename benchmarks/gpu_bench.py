"""The benchmark tables of docs/performance.md on one GPU: kernels and a Decoder training step.

Usage (on a CUDA machine, from the repository root)::

    SPARSEFOCUS_COMMIT=$(git rev-parse HEAD) PYTHONPATH=. python benchmarks/gpu_bench.py --out OUT [--resume]

First a correctness check (each sparse case's Triton path in bf16 against its fp32 reference, outputs
and gradients, at a small odd size), then:

- kernel table: B=4, H=16, D=64, bf16, causal, fwd and fwd+bwd, N = 4K..64K, for SDPA under every
  backend, FlexAttention (causal block mask, and a window of 64), TOPK:32, ZETA's default, BAND:64
  and block_topk:block=64,top=15 (``sparsefocus bench``'s cases and runner);
- model table: the 4-block d=512 Decoder (8 heads, MLP 2048), B=1, N = 4K, 8K, 16K, 64K, patterns
  FULL (under each SDPA backend), BAND:64, TOPK:32 and ZETA's default, eager and compiled
  (``sparsefocus bench --model``'s measurement).

Every finished unit (table, case, N) is appended to OUT/gpu_bench_progress.json at once; with
--resume a unit already there is skipped, so a run cut short (by --budget-s, a crash or the machine)
continues where it stopped. On a machine whose OUT starts empty, --resume-from PROGRESS_FILE
continues from a progress file brought along from the last invocation. Lengths run in ascending order and, at each N, every case, so the dense
baselines of a point are normally timed in the same invocation as the cases; each row names its
invocation. At the end (or when the budget is spent) it writes OUT/kernels.{json,png} and
OUT/model.{json,png} in the format of ``sparsefocus bench`` and prints a short table.

Exit status: 0 when every unit is done, 3 when the budget ran out first (re-run with --resume),
2 for a bad command line (e.g. OUT holds a run of another commit).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

from sparsefocus.attention import sparse_attention
from sparsefocus.bench import model as model_bench
from sparsefocus.bench.dense import attach_dense_ratios, dense_table
from sparsefocus.bench.registry import BenchShape
from sparsefocus.bench.run import run_metadata, write_json_atomic
from sparsefocus.bench.runner import (
    MODES,
    ceilings_for,
    error_message,
    measure,
    release_memory,
)

KERNEL_CASES = (
    "sdpa:cudnn",
    "sdpa:flash",
    "sdpa:efficient",
    "sdpa:math",
    "flex",
    "flex:64",
    "TOPK:32",
    "zeta",
    "BAND:64",
    "block_topk:block=64,top=15",
)
KERNEL_LENGTHS = (4096, 8192, 16384, 32768, 65536)
MODEL_PATTERNS = ("FULL", "BAND:64", "TOPK:32", "zeta")
MODEL_LENGTHS = (4096, 8192, 16384, 65536)
CHECK_PATTERNS = ("TOPK:32", "zeta", "BAND:64", "block_topk:block=64,top=15")
PROGRESS = "gpu_bench_progress.json"


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument(
        "--out",
        type=Path,
        default=Path(os.environ["OUT"]) if "OUT" in os.environ else None,
        help="folder for every file this script writes (default: $OUT)",
    )
    parser.add_argument("--resume", action="store_true", help="continue the run in --out, skipping the units already there")
    parser.add_argument(
        "--resume-from",
        type=Path,
        default=None,
        help="continue the run saved in this progress file (e.g. one brought back from an earlier machine), writing to --out",
    )
    parser.add_argument(
        "--tables", nargs="+", choices=("kernel", "model"), default=["kernel", "model"], help="which tables to measure"
    )
    parser.add_argument("--budget-s", type=float, default=480.0, help="start no new unit after this many seconds")
    parser.add_argument("--kernel-lengths", type=int, nargs="+", default=list(KERNEL_LENGTHS), help="N of the kernel table")
    parser.add_argument("--model-lengths", type=int, nargs="+", default=list(MODEL_LENGTHS), help="N of the model table")
    parser.add_argument("--warmup", type=int, default=2, help="kernel table: untimed runs")
    parser.add_argument("--repeats", type=int, default=5, help="kernel table: timed runs (median)")
    parser.add_argument(
        "--max-ms", type=float, default=5000.0, help="kernel table: skip a case's larger N once a run took longer"
    )
    parser.add_argument("--model-steps", type=int, default=10, help="model table: timed steps (median)")
    parser.add_argument("--model-warmup", type=int, default=3, help="model table: untimed steps (the first compiles)")
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="tiny sizes (B=1, H=2, D=16, N=64 and 128, a 1-block d=32 model, 1 step) to check the script end to end; runs on CPU too (eager only there)",
    )
    args = parser.parse_args(argv)
    if args.out is None:
        parser.error("--out is required when $OUT is not set")
    args.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    args.kernel_shape = {"batch": 4, "heads": 16, "head_dim": 64}
    args.model_options = ["--batch", "1", "--steps", str(args.model_steps), "--warmup", str(args.model_warmup)]
    if args.smoke:
        args.kernel_lengths, args.model_lengths, args.warmup, args.repeats = [64, 128], [64, 128], 1, 1
        args.kernel_shape = {"batch": 1, "heads": 2, "head_dim": 16}
        args.model_options = [
            "--batch",
            "1",
            "--blocks",
            "1",
            "--dim",
            "32",
            "--heads",
            "2",
            "--mlp",
            "64",
            "--steps",
            "1",
            "--warmup",
            "1",
        ]
        if args.device.type == "cpu":
            args.model_options += ["--compile", "both", "--device", "cpu"]  # "both" on CPU: compiled entries are "off"
    return args


class Progress:
    """The units measured so far, saved (atomically) after each one."""

    def __init__(self, path: Path, meta: dict, resume: bool, resume_from: Path | None = None) -> None:
        self.path = path
        if path.exists() and not resume:
            raise SystemExit(f"gpu_bench: error: {path} exists; pass --resume to continue it or choose another --out")
        source = resume_from if resume_from is not None else path
        if resume_from is not None and not resume_from.exists():
            raise SystemExit(f"gpu_bench: error: --resume-from {resume_from} does not exist")
        state = json.loads(source.read_text()) if source.exists() else {"meta": meta, "invocations": [], "units": {}}
        if state["meta"]["git_commit"] != meta["git_commit"]:
            raise SystemExit(
                f"gpu_bench: error: {source} was made at commit {state['meta']['git_commit']}, this is {meta['git_commit']}; use another --out"
            )
        self.state = state
        self.invocation = len(state["invocations"])
        state["invocations"].append({"started": time.strftime("%Y-%m-%d %H:%M:%S"), "command": " ".join(sys.argv)})
        self.save()

    def done(self, key: str) -> bool:
        return key in self.state["units"]

    def add(self, key: str, rows: list[dict]) -> None:
        self.state["units"][key] = [row | {"invocation": self.invocation} for row in rows]
        self.save()

    def rows(self, table: str) -> list[dict]:
        return [row for key, rows in self.state["units"].items() if key.startswith(table + "|") for row in rows]

    def save(self) -> None:
        write_json_atomic(self.path, self.state)


def relative_rms(x: torch.Tensor, ref: torch.Tensor) -> float:
    x, ref = x.detach().float(), ref.detach().float()
    return float((x - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt().clamp_min(1e-30))


def check_pattern(pattern: str, device: torch.device, n: int = 515) -> dict:
    """The Triton path and the reference at low precision (bf16; fp16 in Triton's CPU interpreter)
    against the fp32 reference (out, dq, dk, dv relative RMS error); ``ok`` when the kernel's error
    is at most twice the reference's + 1e-3 (an input-dependent selection may keep another key
    where two scores tie at low precision)."""
    low = torch.bfloat16 if device.type == "cuda" else torch.float16
    gen = torch.Generator(device=device).manual_seed(0)
    dk = 3 if pattern.startswith("zeta") else 64
    base = [torch.randn(1, 2, n, d, generator=gen, device=device).to(low) for d in (dk, dk, 64)]
    grad = torch.randn(1, 2, n, 64, generator=gen, device=device)

    def run(impl: str, dtype: torch.dtype) -> list[torch.Tensor]:
        q, k, v = (x.to(dtype).requires_grad_() for x in base)
        out = sparse_attention(q, k, v, pattern, causal=True, impl=impl)
        return [out, *torch.autograd.grad(out, (q, k, v), grad.to(out.dtype))]

    truth = run("reference", torch.float32)
    kernel, torch_low = run("triton", low), run("reference", low)
    names = ("out", "dq", "dk", "dv")
    errors = {name: relative_rms(a, t) for name, a, t in zip(names, kernel, truth)}
    baseline = {name: relative_rms(a, t) for name, a, t in zip(names, torch_low, truth)}
    ok = all(errors[name] <= 2 * baseline[name] + 1e-3 for name in names)
    return {"pattern": pattern, "n": n, "dtype": str(low), "kernel_error": errors, "torch_error": baseline, "ok": ok}


def run_checks(args: argparse.Namespace, progress: Progress) -> None:
    for pattern in CHECK_PATTERNS:
        key = f"check|{pattern}"
        if progress.done(key):
            continue
        try:
            row = check_pattern(pattern, args.device, 100 if args.smoke else 515)
        except Exception as error:  # noqa: BLE001 - recorded; the timing still runs
            row = {"pattern": pattern, "ok": False, "error": error_message(error, 500)}
        print(f"check {pattern:<30} {'ok' if row['ok'] else 'FAILED'} {row.get('kernel_error', row.get('error'))}", flush=True)
        progress.add(key, [row])
        release_memory(args.device)


def kernel_units(args: argparse.Namespace, progress: Progress, deadline: float) -> bool:
    """Measure the kernel table; False when the budget ran out first."""
    device = args.device
    ceilings = ceilings_for(progress.state["meta"]["device"]) if device.type == "cuda" else None
    slow: set[str] = set()
    for n in sorted(args.kernel_lengths):
        for case in KERNEL_CASES:
            key = f"kernel|{case}|{n}"
            if progress.done(key):
                slow |= {case} if any(r.get("ms", 0) > args.max_ms for r in progress.state["units"][key]) else set()
                continue
            if time.monotonic() > deadline:
                return False
            if case in slow:
                rows = [{"case": case, "n": n, "mode": mode, "status": "skipped"} for mode in MODES]
            else:
                size = args.kernel_shape
                shape = BenchShape(size["batch"], size["heads"], size["heads"], n, size["head_dim"], torch.bfloat16, True, device)
                rows = measure(case, shape, MODES, args.warmup, args.repeats, ceilings)
            if any(r.get("ms", 0) > args.max_ms for r in rows):
                slow.add(case)
            for row in rows:
                print(
                    f"kernel {case:<28} N={n:<6} {row['mode']:<8} {row['status']:<11} {row.get('ms', row.get('error', ''))}",
                    flush=True,
                )
            progress.add(key, rows)
    return True


def model_units(args: argparse.Namespace, progress: Progress, deadline: float) -> bool:
    """Measure the model table; False when the budget ran out first."""
    device = args.device
    options = model_bench.build_parser().parse_args(args.model_options)
    for n in sorted(args.model_lengths):
        for pattern in MODEL_PATTERNS:
            backends = options.full_backends if model_bench.is_full(pattern) else [None]
            for backend in backends:
                for mode in ("eager", "compiled"):
                    case = model_bench.ModelCase(pattern, n, mode, backend)
                    key = f"model|{case.label()}|{mode}|{n}"
                    if progress.done(key):
                        continue
                    if time.monotonic() > deadline:
                        return False
                    row = model_bench.measure_model_case(options, case, device)
                    print(model_bench.format_model_row(row, case), flush=True)
                    progress.add(key, [row])
    return True


def write_tables(args: argparse.Namespace, progress: Progress) -> None:
    """kernels.{json,png} and model.{json,png} from every unit so far, and a printed summary."""
    from sparsefocus.bench.plot import plot_model_results, plot_results

    meta = progress.state["meta"]
    kernel_rows = attach_dense_ratios(progress.rows("kernel"))
    if kernel_rows:
        size = args.kernel_shape
        shape = size | {
            "kv_heads": size["heads"],
            "dtype": "bf16",
            "causal": True,
            "warmup": args.warmup,
            "repeats": args.repeats,
        }
        ceilings = ceilings_for(meta["device"]) if args.device.type == "cuda" else None
        payload = meta | {
            "shape": shape,
            "ceilings": ceilings,
            "dense": dense_table(kernel_rows),
            "results": kernel_rows,
            "checks": progress.rows("check"),
            "invocations": progress.state["invocations"],
        }
        write_json_atomic(args.out / "kernels.json", payload)
        plot_results(payload, args.out / "kernels.png")
        print_kernel_summary(kernel_rows)
    model_rows = model_bench.attach_full_ratios(progress.rows("model"))
    if model_rows:
        options = model_bench.build_parser().parse_args(args.model_options)
        config = {
            k: getattr(options, k)
            for k in ("blocks", "dim", "heads", "mlp", "vocab", "dropout", "batch", "dtype", "warmup", "steps", "lr")
        }
        config |= {"optimizer": "AdamW", "activation": "gelu"}
        baseline = model_bench.full_baseline(model_rows)
        payload = meta | {
            "config": config,
            "full_baseline": [{"n": n, "mode": m} | baseline[(n, m)] for n, m in sorted(baseline)],
            "results": model_rows,
            "invocations": progress.state["invocations"],
        }
        write_json_atomic(args.out / "model.json", payload)
        plot_model_results(payload, args.out / "model.png")
        print_model_summary(model_rows)


def print_kernel_summary(rows: list[dict]) -> None:
    print("\nkernel table, fwd+bwd ms (x = dense ms / case ms; dense = fastest SDPA backend at that N)")
    lengths = sorted({r["n"] for r in rows})
    print(f"{'case':<30}" + "".join(f"{n // 1024}K".rjust(15) if n >= 1024 else str(n).rjust(15) for n in lengths))
    for case in dict.fromkeys(r["case"] for r in rows):
        cells = []
        for n in lengths:
            row = next((r for r in rows if r["case"] == case and r["n"] == n and r["mode"] == "fwd+bwd"), None)
            ok = row is not None and row["status"] == "ok"
            ratio = f" {row['speedup_vs_dense']:5.2f}x" if ok and row["speedup_vs_dense"] else ""
            cells.append(f"{row['ms']:8.2f}{ratio}" if ok else (row["status"] if row else "-"))
        print(f"{case:<30}" + "".join(f"{c:>15}" for c in cells))


def print_model_summary(rows: list[dict]) -> None:
    print("\nmodel table, ms/step (x = FULL ms / pattern ms at the same N and mode; FULL = fastest SDPA backend)")
    for row in model_bench.headline_rows(rows):
        if row["status"] == "ok":
            peak = "" if row["peak_mb"] is None else f"  peak {row['peak_mb']:.0f} MB"
            share = "" if row["attention_share"] is None else f"  attention {100 * row['attention_share']:.0f}%"
            print(
                f"{row['pattern']:<12} {row['mode']:<9} N={row['n']:<6} {row['ms']:9.2f} ms  {row['vs_full']:.2f}x{peak}{share}"
            )
    for row in rows:
        if row["status"] not in ("ok", "off"):
            label = model_bench.ModelCase(row["pattern"], row["n"], row["mode"], row["sdpa_backend"]).label()
            print(f"{label:<24} {row['mode']:<9} N={row['n']:<6} {row['status']}: {row.get('error', '')[:100]}")


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    if args.device.type != "cuda" and not args.smoke:
        print("gpu_bench: error: needs a CUDA device (--smoke runs on CPU)", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    meta = run_metadata([], args.device) | {"command": "python benchmarks/gpu_bench.py " + " ".join(argv)}
    try:
        progress = Progress(args.out / PROGRESS, meta, args.resume, args.resume_from)
    except SystemExit as error:
        print(error, file=sys.stderr)
        return 2
    deadline = time.monotonic() + args.budget_s
    run_checks(args, progress)
    finished = True
    if "kernel" in args.tables:
        finished = kernel_units(args, progress, deadline)
    if finished and "model" in args.tables:
        finished = model_units(args, progress, deadline)
    write_tables(args, progress)
    if not finished:
        print(f"\nbudget of {args.budget_s:.0f} s spent; re-run the same command with --resume to continue", flush=True)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

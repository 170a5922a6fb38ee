"""Per-token decoding time against dense decoding (SDPA on the cache), M = 32K to 1M keys.

One new query per step at the end of a KV cache of M positions (bottom-right causal). Cases:
SDPA on the whole cache per backend (cuDNN, flash, efficient, math; "dense" is the fastest that
ran at each M), ``sparse_attention`` decoding rows for TOPK:32 and BAND:64 (``impl="auto"``: on
CUDA TOPK's Triton rows, BAND's window of keys), TOPK:32 on the lean rows ("TOPK:32/lean"), and
ZETA's cached step (``zeta_decode.decode_step`` from a prebuilt ``ZetaCache``; its time
includes appending the new key and value to the cache, which dense decoding here does not pay).
A check first compares every decoding case at ``--check-keys`` keys with its definition, the
last row of the causal call over all keys. Writes ``--out`` (JSON, atomically) after each M,
and at the end the plot beside it (``--plot-only JSON`` redraws the plot of a saved run).

Usage (one H200):
    python benchmarks/gpu_decode.py --out $OUT/decode.json
    python benchmarks/gpu_decode.py --out /tmp/decode.json --device cpu --lengths 512 1024 --check-keys 256  # smoke test
    python benchmarks/gpu_decode.py --plot-only benchmarks/results/h200_decode_c194744.json
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sparsefocus.attention import parse_pattern, sparse_attention
from sparsefocus.attention.zeta_decode import decode_step, start_cache
from sparsefocus.bench.dense import fastest_dense
from sparsefocus.bench.model import sdpa_kernel_context
from sparsefocus.bench.registry import SDPA_BACKENDS
from sparsefocus.bench.run import device_name, git_commit, write_json_atomic
from sparsefocus.bench.runner import failure, median_ms, release_memory

ZETA = "zeta:k=32"
PATTERNS = ("TOPK:32", "BAND:64")
Inputs = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def make_inputs(batch: int, heads: int, n_keys: int, dim: int, dtype: torch.dtype, device: torch.device) -> Inputs:
    """q [B, H, 1, D] and a cache k, v [B, H, M, D]."""
    generator = torch.Generator(device=device).manual_seed(0)
    shape = (batch, heads, n_keys, dim)
    k = torch.randn(shape, generator=generator, device=device, dtype=dtype)
    v = torch.randn(shape, generator=generator, device=device, dtype=dtype)
    q = torch.randn(batch, heads, 1, dim, generator=generator, device=device, dtype=dtype)
    return q, k, v


def zeta_inputs(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """ZETA scores in its own ``dk`` dimensions: the first dk coordinates of q and k."""
    width = parse_pattern(ZETA).qk_dim(q.shape[-1])
    return q[..., :width].contiguous(), k[..., :width].contiguous()


def cases(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> dict[str, Callable[[], object]]:
    """Name -> one decoding step on the cache (k, v: M - 1 cached positions plus the new one)."""
    steps: dict[str, Callable[[], object]] = {}
    for backend in SDPA_BACKENDS:

        def dense(backend: str = backend) -> object:
            with sdpa_kernel_context(backend):
                return torch.nn.functional.scaled_dot_product_attention(q, k, v)

        steps[f"sdpa:{backend}"] = dense
    for pattern in PATTERNS:
        steps[pattern] = lambda pattern=pattern: sparse_attention(q, k, v, pattern, causal=True)
    # impl="auto" decodes TOPK through its Triton rows on CUDA; the lean rows for comparison
    steps["TOPK:32/lean"] = lambda: sparse_attention(q, k, v, "TOPK:32", causal=True, impl="lean")
    zq, zk = zeta_inputs(q, k)
    spec = parse_pattern(ZETA)
    cache = start_cache(spec, zk[:, :, :-1], v[:, :, :-1])  # built once: the prefill, not timed
    steps[ZETA] = lambda: decode_step(spec, zq, zk[:, :, -1:], v[:, :, -1:], cache)[0]
    return steps


def check(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> dict[str, float]:
    """Largest |decoded - last row of the causal call| per case at ``--check-keys`` keys."""
    q, k, v = make_inputs(1, args.heads, args.check_keys, args.dim, dtype, device)
    q_all = torch.randn_like(k)
    q_all[:, :, -1:] = q
    errors = {}
    with torch.no_grad():
        for pattern in PATTERNS:
            whole = sparse_attention(q_all, k, v, pattern, causal=True)[:, :, -1:]
            errors[pattern] = (sparse_attention(q, k, v, pattern, causal=True) - whole).abs().max().item()
        zq_all, zk = zeta_inputs(q_all, k)
        spec = parse_pattern(ZETA)
        whole = sparse_attention(zq_all, zk, v, spec, causal=True, impl="lean")[:, :, -1:]
        cache = start_cache(spec, zk[:, :, :-1], v[:, :, :-1])
        step, _ = decode_step(spec, zq_all[:, :, -1:], zk[:, :, -1:], v[:, :, -1:], cache)
        errors[ZETA] = (step - whole).abs().max().item()
    return errors


def measure_length(args: argparse.Namespace, n_keys: int, device: torch.device, dtype: torch.dtype) -> list[dict]:
    rows = []
    q, k, v = make_inputs(args.batch, args.heads, n_keys, args.dim, dtype, device)
    with torch.no_grad():
        for name, step in cases(q, k, v).items():
            row: dict = {"case": name, "n_keys": n_keys}
            try:
                row |= {"status": "ok", "ms": round(median_ms(step, device, args.warmup, args.repeats), 4)}
            except (RuntimeError, ValueError) as error:  # a backend that refuses the shape, or OOM
                refused = any(text in str(error) for text in ("No available kernel", "No viable backend"))
                row |= failure(error, unavailable=name.startswith("sdpa:") and refused)
            if name.startswith("sdpa:"):
                row["dense_backend"] = name.split(":", 1)[1]
            rows.append(row)
            release_memory(device)
    best = fastest_dense([{**r, "n": r["n_keys"], "mode": "decode"} for r in rows])
    dense = best.get((n_keys, "decode"))
    for row in rows:
        if dense is not None and row.get("status") == "ok":
            row["dense_ms"], row["dense_backend_used"] = dense["ms"], dense["backend"]
            row["speedup_vs_dense"] = round(dense["ms"] / row["ms"], 3)
    return rows


def plot(payload: dict, path: Path) -> None:
    """ms per decoding step against M per case, log-log, with the commit and shape in the title."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for case in dict.fromkeys(row["case"] for row in payload["rows"]):
        points = sorted((r["n_keys"], r["ms"]) for r in payload["rows"] if r["case"] == case and r.get("status") == "ok")
        if points:
            style = "--" if case.startswith("sdpa:") else "-"
            ax.plot(*zip(*points), style, marker="o", markersize=3, label=case)
    ax.set(xscale="log", yscale="log", xlabel="keys in the cache (M)", ylabel="ms per decoding step")
    shape = payload["shape"]
    ax.set_title(
        f"one query, B={shape['batch']} H={shape['heads']} D={shape['dim']} {shape['dtype']}, "
        f"{payload['device']}, {payload['git_commit']}",
        fontsize=9,
    )
    ax.legend(fontsize=7, ncol=2)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    partial = path.with_name(path.name + ".part.png")
    fig.savefig(partial, dpi=120)
    plt.close(fig)
    partial.replace(path)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, help="JSON path; the PNG goes beside it")
    parser.add_argument("--plot-only", type=Path, help="redraw the PNG of this saved JSON and exit")
    parser.add_argument("--lengths", type=int, nargs="+", default=[2**15, 2**16, 2**17, 2**18, 2**19, 2**20])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--dtype", default="bf16", choices=("bf16", "fp16", "fp32"))
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--check-keys", type=int, default=4096)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    if args.plot_only is not None:
        plot(json.loads(args.plot_only.read_text()), args.plot_only.with_suffix(".png"))
        return 0
    if args.out is None:
        parser.error("--out is required unless --plot-only is given")
    device = torch.device(args.device)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    payload: dict = {
        "command": "python benchmarks/gpu_decode.py " + " ".join(sys.argv[1:]),
        "git_commit": git_commit(),
        "device": device_name(device),
        "torch": torch.__version__,
        "shape": {"batch": args.batch, "heads": args.heads, "dim": args.dim, "dtype": args.dtype},
        "check_max_abs_error": check(args, device, dtype),
        "rows": [],
    }
    print(json.dumps({"check": payload["check_max_abs_error"]}), flush=True)
    for n_keys in args.lengths:
        rows = measure_length(args, n_keys, device, dtype)
        payload["rows"] += rows
        write_json_atomic(args.out, payload)
        for row in rows:
            print(json.dumps(row), flush=True)
    plot(payload, args.out.with_suffix(".png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""ZETA on one GPU: correctness against the fp32 definition, fwd+bwd time and peak memory against
SDPA-FlashAttention, the 1M-token run, and candidate recall of the exact top-k.

Usage (on a CUDA machine, from the repo root):
    SPARSEFOCUS_COMMIT=$(git rev-parse HEAD) PYTHONPATH=. python benchmarks/zeta_bench.py --out benchmarks/results [--quick]
Writes zeta_bench.json (after every section, so a run cut short keeps what it measured) and
zeta_bench.png into --out. Every section is wrapped so that one failure (an OOM, say) is recorded
in the JSON and the others still run. The wide and shifted patterns are timed at --ratio-n only.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
import traceback

import torch
import torch.nn.functional as F

import sparsefocus as sf
from sparsefocus.attention.common import mask_from_indices
from sparsefocus.attention.patterns import parse_pattern
from sparsefocus.attention.zeta import candidate_recall, select_keys, select_keys_fused
from sparsefocus.bench.runner import median_ms

PATTERN = "zeta:k=32,window=64,chunks=8,local=32"
SINGLE_WIDE = "zeta:k=32,window=160,chunks=8,local=32"  # the one-curve window that reaches 60% recall
SHIFTED = "zeta:k=32,window=40,chunks=8,local=32,curves=3"  # three shifted curves, 120 candidates


def timed_ms(fn, reps: int = 5, warmup: int = 1) -> float:
    """Median CUDA-event time of fn() in ms (the bench runner's timer)."""
    return median_ms(fn, torch.device("cuda"), warmup, reps)


def zeta_inputs(batch, heads, n, dk=3, dv=64, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    make = lambda *shape: torch.randn(*shape, generator=gen, device="cuda", dtype=torch.bfloat16).requires_grad_()
    gamma = torch.ones(heads, device="cuda", requires_grad=True)
    return make(batch, heads, n, dk), make(batch, heads, n, dk), make(batch, heads, n, dv), gamma


def _backward_of(out: torch.Tensor, inputs: tuple, grad_out: list) -> tuple:
    """The gradients of inputs under one upstream gradient, made once per closure (random, as
    ``sparsefocus.bench.runner.step_fn``): autograd.grad, so no .grad is accumulated from call to
    call (a training step's zero_grad sets them to None; an accumulating add is not attention's)."""
    if not grad_out:
        grad_out.append(torch.randn_like(out))
    return torch.autograd.grad(out, inputs, grad_out[0])


def zeta_step(q, k, v, gamma, pattern=PATTERN, backward=True, grad_out: list | None = None):
    """A closure: ZETA forward (and backward); returns (dq, dk, dv, dgamma) or None. grad_out:
    a list holding (or receiving) the upstream gradient, to share one between closures."""
    grad_out = [] if grad_out is None else grad_out

    def run():
        out = sf.sparse_attention(q, k, v, pattern, causal=True, impl="triton", params={"gamma": gamma})
        return _backward_of(out, (q, k, v, gamma), grad_out) if backward else None

    return run


def sdpa_step(q, k, v, backward=True):
    """A closure: SDPA (FlashAttention backend) forward (and backward, same protocol as zeta_step)."""
    grad_out: list = []

    def run():
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return _backward_of(out, (q, k, v), grad_out) if backward else None

    return run


def peak_mb(fn) -> float:
    """Peak memory of fn() above what was allocated before it, in MB."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def rel_err(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


CHECKED = "zeta:k=32,window=64,chunks=4,local=32,curves=2"


def correctness() -> dict:
    """Triton path in bf16 vs the dense fp32 definition (N=512; also with a sink) and vs lean
    fp32 (N=4096)."""
    results = {}
    for n, impl_ref, sink in ((512, "reference", False), (4096, "lean", False), (512, "reference", True)):
        q, k, v, gamma = zeta_inputs(1, 4, n, dv=64, seed=n)
        sink_key = (0.3 * torch.randn(4, 3, device="cuda", generator=torch.Generator("cuda").manual_seed(n))) if sink else None
        for causal in (False, True):
            grads = {}
            for impl, cast in (("triton", lambda x: x), (impl_ref, lambda x: x.float())):
                xs = [cast(x.detach()).requires_grad_() for x in (q, k, v)]
                params = {"gamma": gamma.detach().clone().requires_grad_()}
                if sink:
                    params["sink_key"] = sink_key.clone().requires_grad_()
                out = sf.sparse_attention(*xs, CHECKED + (",sink=1" if sink else ""), causal=causal, impl=impl, params=params)
                out.float().pow(2).sum().backward()
                grads[impl] = (out, *(x.grad for x in xs), *(p.grad for p in params.values()))
            names = ("out", "dq", "dk", "dv", "dgamma", "dsink")
            results[f"N{n}_{impl_ref}_causal{causal}" + ("_sink" if sink else "")] = {
                name: rel_err(a, b) for name, a, b in zip(names, grads["triton"], grads[impl_ref])
            }
    for pattern in (PATTERN, SHIFTED):
        q, k, _, _ = zeta_inputs(2, 4, 4096, seed=5)
        spec = parse_pattern(pattern)
        for causal in (False, True):
            lean = mask_from_indices(select_keys(spec, q, k, causal, None), 4096)
            fused = mask_from_indices(select_keys_fused(spec, q, k, causal, None), 4096)
            results[f"fused_selection_rows_differing_{pattern}_causal{causal}"] = (lean != fused).any(-1).float().mean().item()
    return results


def speed_and_memory(lengths, ratio_lengths, batch=4, heads=16) -> list[dict]:
    rows = []
    for n in lengths:
        row = {"N": n, "B": batch, "H": heads}
        q, k, v, gamma = zeta_inputs(batch, heads, n)
        reps = 5 if n <= 16384 else 3
        row["zeta_fwd_ms"] = timed_ms(zeta_step(q, k, v, gamma, backward=False), reps)
        row["zeta_fwdbwd_ms"] = timed_ms(zeta_step(q, k, v, gamma), reps)
        row["zeta_select_ms"] = timed_ms(lambda: select_keys_fused(parse_pattern(PATTERN), q, k, True, None), reps)
        if n in ratio_lengths:
            row["zeta_wide_fwdbwd_ms"] = timed_ms(zeta_step(q, k, v, gamma, SINGLE_WIDE), reps)
            row["zeta_wide_select_ms"] = timed_ms(lambda: select_keys_fused(parse_pattern(SINGLE_WIDE), q, k, True, None), reps)
            row["zeta_shifted_fwdbwd_ms"] = timed_ms(zeta_step(q, k, v, gamma, SHIFTED), reps)
            row["zeta_shifted_select_ms"] = timed_ms(lambda: select_keys_fused(parse_pattern(SHIFTED), q, k, True, None), reps)
        row["zeta_peak_mb"] = peak_mb(zeta_step(q, k, v, gamma))
        del q, k, v
        qs, ks, vs, _ = zeta_inputs(batch, heads, n, dk=64)
        row["sdpa_fwd_ms"] = timed_ms(sdpa_step(qs, ks, vs, backward=False), reps)
        row["sdpa_fwdbwd_ms"] = timed_ms(sdpa_step(qs, ks, vs), reps)
        row["sdpa_peak_mb"] = peak_mb(sdpa_step(qs, ks, vs))
        del qs, ks, vs
        torch.cuda.empty_cache()
        print(row, flush=True)
        rows.append(row)
    return rows


def million(n=1 << 20) -> dict:
    q, k, v, gamma = zeta_inputs(1, 16, n)
    start = time.time()
    grads = zeta_step(q, k, v, gamma)()
    torch.cuda.synchronize()
    first = time.time() - start
    row = {"N": n, "B": 1, "H": 16, "first_call_s": first, "fwdbwd_ms": timed_ms(zeta_step(q, k, v, gamma), 2)}
    row["peak_mb"] = peak_mb(zeta_step(q, k, v, gamma))
    row["grads_finite"] = bool(all(torch.isfinite(x).all() for x in grads))
    return row


def recall_sweep(small: bool = False) -> list[dict]:
    """Mean recall of the exact top-32 on Gaussian q/k (B=1, H=16); ``small``: the target configs only."""
    if small:
        return _recall_rows([dict(n=4096, dk=3, window=w, curves=c, bits=12) for w, c in ((64, 1), (128, 1), (160, 1), (40, 3))])
    configs = []
    for window in (32, 40, 64, 128, 160):
        for curves in (1, 2, 3):
            configs.append(dict(n=4096, dk=3, window=window, curves=curves, bits=12))
    configs += [dict(n=4096, dk=dk, window=64, curves=1, bits=12) for dk in (1, 2, 8)]
    configs += [dict(n=4096, dk=3, window=64, curves=1, bits=b) for b in (6, 10, 16)]
    configs += [dict(n=n, dk=3, window=64, curves=1, bits=12) for n in (1024, 16384)]
    return _recall_rows(configs)


def _recall_rows(configs: list[dict]) -> list[dict]:
    rows = []
    for c in configs:
        gen = torch.Generator(device="cuda").manual_seed(1)
        q = torch.randn(1, 16, c["n"], c["dk"], generator=gen, device="cuda")
        k = torch.randn(1, 16, c["n"], c["dk"], generator=gen, device="cuda")
        bits = min(c["bits"], 62 // c["dk"] - (c["curves"] > 1))
        pattern = f"zeta:k=32,window={c['window']},curves={c['curves']},bits={bits},chunks=8,local=32"
        for causal in (False, True):
            recall = candidate_recall(q, k, pattern, causal=causal).nanmean().item()
            rows.append({**c, "bits": bits, "causal": causal, "recall": recall})
    return rows


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result.get("speed", [])
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    if rows:
        ns = [r["N"] for r in rows]
        curves = (
            ("zeta_fwdbwd_ms", "ZETA window 64"),
            ("zeta_wide_fwdbwd_ms", "ZETA window 160"),
            ("zeta_shifted_fwdbwd_ms", "ZETA 3 curves x 40"),
            ("sdpa_fwdbwd_ms", "SDPA flash"),
        )
        for key, label in curves:
            points = [(r["N"], r[key]) for r in rows if key in r]
            axes[0].loglog([p[0] for p in points], [p[1] for p in points], "o-", label=label, base=2)
        axes[0].set(xlabel="N", ylabel="fwd+bwd ms (B=4, H=16, Dv=64, bf16, causal)", title="time")
        axes[0].legend()
        for key, label in (("zeta_peak_mb", "ZETA"), ("sdpa_peak_mb", "SDPA flash")):
            axes[1].loglog(ns, [r[key] for r in rows], "o-", label=label, base=2)
        axes[1].set(xlabel="N", ylabel="peak MB above inputs", title="memory")
        axes[1].legend()
    fig.suptitle(f"{PATTERN} on {result['device']}")
    fig.tight_layout()
    fig.savefig(path + ".tmp.png", dpi=110)
    os.replace(path + ".tmp.png", path)


def section(result: dict, name: str, fn) -> None:
    try:
        result[name] = fn()
    except Exception as error:  # recorded, so the other sections still run
        result[name + "_error"] = "".join(traceback.format_exception_only(type(error), error)).strip()
        traceback.print_exc()
    torch.cuda.empty_cache()
    print(time.strftime("%X"), name, json.dumps(result.get(name, result.get(name + "_error")))[:3000], flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--n", type=int, nargs="+", default=None, help="lengths (default 4K..64K; --quick: 4K, 8K)")
    parser.add_argument(
        "--ratio-n", type=int, nargs="+", default=None, help="lengths that also time the wide and shifted patterns (default: all)"
    )
    parser.add_argument("--recall", choices=("full", "small", "none"), default="full")
    parser.add_argument("--no-million", action="store_true")
    args = parser.parse_args()
    commit = (
        os.environ.get("SPARSEFOCUS_COMMIT")
        or subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    )
    lengths = args.n or ([4096, 8192] if args.quick else [4096, 8192, 16384, 32768, 65536])
    result = {
        "command": "PYTHONPATH=. python benchmarks/zeta_bench.py " + " ".join(sys.argv[1:]),
        "commit": commit,
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "pattern": PATTERN,
        "wide_pattern": SINGLE_WIDE,
        "shifted_pattern": SHIFTED,
        "protocol": "causal, bf16, q/k width 3 (ZETA) or 64 (SDPA), Dv=64; times: CUDA-event median; backward: torch.autograd.grad of the inputs under one random upstream gradient made once (no .grad accumulation, as the bench runner); memory: peak above inputs",
    }
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "zeta_bench.json")
    sections = [("correctness", correctness), ("speed", lambda: speed_and_memory(lengths, args.ratio_n or lengths))]
    if args.recall != "none":
        sections.append(("recall", lambda: recall_sweep(small=args.recall == "small")))
    if not (args.quick or args.no_million):
        sections.append(("million", million))
    for name, fn in sections:
        section(result, name, fn)
        with open(path + ".tmp", "w") as handle:
            json.dump(result, handle, indent=1)
        os.replace(path + ".tmp", path)
    plot(result, os.path.join(args.out, "zeta_bench.png"))


if __name__ == "__main__":
    main()

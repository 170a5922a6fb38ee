"""Short ZETA probe on one GPU: correctness of the fused path (bf16 vs fp32 definition; fused vs
torch selection) and a time split (selection, attention, mean) at a few lengths.

Usage: PYTHONPATH=. python benchmarks/zeta_probe.py [--out DIR] [--n 8192 65536]
"""

from __future__ import annotations

import argparse
import json
import os

import torch

import sparsefocus as sf
from sparsefocus.attention.common import mask_from_indices
from sparsefocus.attention.patterns import parse_pattern
from sparsefocus.attention.zeta import mean_tokens, select_keys, select_keys_fused
from sparsefocus.kernels.indexed import indexed_attention

from zeta_bench import PATTERN, SHIFTED, SINGLE_WIDE, peak_mb, rel_err, sdpa_step, timed_ms, zeta_inputs, zeta_step


def check() -> dict:
    result = {}
    for causal in (False, True):
        q, k, v, gamma = zeta_inputs(1, 4, 512, seed=3)
        grads = {}
        for impl, cast in (("triton", lambda x: x), ("reference", lambda x: x.float())):
            xs = [cast(x.detach()).requires_grad_() for x in (q, k, v)]
            g = gamma.detach().clone().requires_grad_()
            out = sf.sparse_attention(*xs, "zeta:k=32,window=64,chunks=4,local=32,curves=2", causal=causal, impl=impl, params={"gamma": g})
            out.float().pow(2).sum().backward()
            grads[impl] = (out, *(x.grad for x in xs), g.grad)
        result[f"bf16_triton_vs_fp32_reference_causal{causal}"] = {
            name: rel_err(a, b) for name, a, b in zip(("out", "dq", "dk", "dv", "dgamma"), grads["triton"], grads["reference"])
        }
    for pattern in (PATTERN, SHIFTED):
        q, k, _, _ = zeta_inputs(2, 4, 4096, seed=5)
        spec = parse_pattern(pattern)
        for causal in (False, True):
            lean = mask_from_indices(select_keys(spec, q, k, causal, None), 4096)
            fused = mask_from_indices(select_keys_fused(spec, q, k, causal, None), 4096)
            result[f"selection_mismatch_rows_{pattern}_causal{causal}"] = (lean != fused).any(-1).float().mean().item()
    return result


def split(n: int, pattern: str) -> dict:
    q, k, v, gamma = zeta_inputs(4, 16, n)
    spec = parse_pattern(pattern)
    index = select_keys_fused(spec, q, k, True, None)
    row = {"N": n, "pattern": pattern}
    row["select_fused_ms"] = timed_ms(lambda: select_keys_fused(spec, q, k, True, None))
    row["mean_fwd_ms"] = timed_ms(lambda: mean_tokens(k, v, True, None))

    def attend():
        out = spec._attend(q, k, v, index, True, None, {"gamma": gamma}, indexed_attention)
        out.backward(torch.ones_like(out))

    row["attend_fwdbwd_ms"] = timed_ms(attend)
    row["total_fwd_ms"] = timed_ms(zeta_step(q, k, v, gamma, pattern, backward=False))
    row["total_fwdbwd_ms"] = timed_ms(zeta_step(q, k, v, gamma, pattern))
    row["peak_mb"] = peak_mb(zeta_step(q, k, v, gamma, pattern))
    return row


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=".")
    parser.add_argument("--n", type=int, nargs="+", default=[8192, 65536])
    args = parser.parse_args()
    result = {"check": check(), "split": []}
    print(json.dumps(result["check"], indent=0), flush=True)
    for n in args.n:
        for pattern in (PATTERN, SINGLE_WIDE, SHIFTED):
            row = split(n, pattern)
            print(row, flush=True)
            result["split"].append(row)
        qs, ks, vs, _ = zeta_inputs(4, 16, n, dk=64)
        result["split"].append({"N": n, "sdpa_fwdbwd_ms": timed_ms(sdpa_step(qs, ks, vs)), "sdpa_peak_mb": peak_mb(sdpa_step(qs, ks, vs))})
        print(result["split"][-1], flush=True)
        del qs, ks, vs
        torch.cuda.empty_cache()
    with open(os.path.join(args.out, "zeta_probe.json"), "w") as handle:
        json.dump(result, handle, indent=1)


if __name__ == "__main__":
    main()

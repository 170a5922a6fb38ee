"""ZETA forward+backward with the selection's launches as now against the order and passes
of commit 1320ad1 and before ("old_order"), alternating in one process.

Now: without a padding mask no pass over one is issued (no all-True mask, no masked fill, no
int8 copy; the selection kernel's PADDED off), one curve's codes are a view (no stack), and the
keys' codes and sort are issued before the queries' codes. "old_order" rebuilds the previous
sequence from the same pieces: query codes, key codes (each stacked), an all-True mask passed
through every step, then the sort. The GPU waits for the CPU until the sort is issued, so
fewer and earlier launches there shorten the whole call.

Usage on a CUDA machine:  PYTHONPATH=. python benchmarks/zeta_launch_ab.py [N ...] [--reps R]
Prints one JSON row per (N, repetition, variant), after a check that both select the same keys.
"""

from __future__ import annotations

import argparse
import json

import torch

from benchmarks.zeta_bench import PATTERN, timed_ms, zeta_inputs, zeta_step
from sparsefocus.attention import zeta
from sparsefocus.attention.patterns import parse_pattern
from sparsefocus.attention.zeta import SENTINEL, code_bits, curve_codes, upcast
from sparsefocus.kernels.zeta_select import key_prefixes, zeta_select

NEW = zeta.select_keys_fused


def old_order(spec, q, k, causal, key_padding_mask):
    """The previous launch sequence (stacked codes, queries first, an all-True mask throughout)."""
    with torch.no_grad():
        bits = code_bits(spec.bits, q.shape[-1], spec.curves)
        stacked = lambda x: torch.stack([curve_codes(upcast(x), bits, c, spec.curves, True) for c in range(spec.curves)])
        codes_q, codes_k = stacked(q), stacked(k)
        real = torch.ones(k.shape[0], k.shape[2], dtype=torch.bool, device=k.device) if key_padding_mask is None else key_padding_mask
        chunk = spec.chunk_size(q.shape[2]) if causal else None
        prefixes = key_prefixes(codes_k, real, q.shape[2], chunk, SENTINEL)
        local = spec.local if causal else 0
        return zeta_select(
            q, k, codes_q, prefixes, real, width=min(spec.k, spec.curves * spec.window + local), window=spec.window, local=local, chunk=chunk,
        )


def use(variant: str) -> None:
    zeta.select_keys_fused = old_order if variant == "old_order" else NEW


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("lengths", type=int, nargs="*", default=[8192, 65536])
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    spec = parse_pattern(PATTERN)
    for n in args.lengths:
        q, k, v, gamma = zeta_inputs(4, 16, n)
        same = torch.equal(NEW(spec, q.detach(), k.detach(), True, None), old_order(spec, q.detach(), k.detach(), True, None))
        print(json.dumps({"N": n, "same_keys": same}), flush=True)
        for rep in range(args.reps):
            for variant in ("new", "old_order"):
                use(variant)
                row = {"N": n, "rep": rep, "variant": variant, "fwd_ms": timed_ms(zeta_step(q, k, v, gamma, backward=False), 7)}
                row["fwdbwd_ms"] = timed_ms(zeta_step(q, k, v, gamma), 7)
                print(json.dumps(row), flush=True)
    use("new")


if __name__ == "__main__":
    main()

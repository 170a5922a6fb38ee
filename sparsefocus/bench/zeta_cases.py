"""Bench case ``zeta[:PARAMS]``: ZETA attention timed like any case, with the recall of its
candidate selection as an extra column.

ZETA scores low-dimensional queries and keys (d_K channels) against full-width values, so the
case feeds it the first d_K channels of the benchmark's q and k (a contiguous copy, inside the
timed region: a d_K/D share of one read of q and k) and the whole of v. ``recall`` is the mean
fraction of each query's exact top-k (smallest ||q - k||^2 among the keys it may see) that the
selection finds, measured untimed on batch element 0, head 0.
"""

from __future__ import annotations

import torch
from torch import Tensor

from sparsefocus.attention import parse_pattern, sparse_attention
from sparsefocus.attention.zeta import Zeta, candidate_recall
from sparsefocus.bench.registry import (
    BenchShape,
    Workload,
    attention_flops,
    io_bytes,
    register_case,
)


def zeta_pattern(argument: str) -> Zeta:
    """``zeta:ARGUMENT`` (e.g. ``k=32,window=64,curves=3``) as a spec; ValueError if it is not ZETA."""
    spec = parse_pattern(f"zeta:{argument}" if argument else "zeta")
    if not isinstance(spec, Zeta):
        raise ValueError(f"zeta case needs zeta parameters, got {argument!r}")
    return spec


def zeta_case(argument: str, shape: BenchShape) -> Workload:
    """Workload of ``zeta[:PARAMS]``; FLOPs count attention over the k selected keys plus the mean token."""
    pattern = zeta_pattern(argument)
    causal, dk = shape.causal, pattern.dk
    if dk > shape.head_dim:
        raise ValueError(f"zeta case: dk={dk} is wider than --head-dim {shape.head_dim}")

    def forward(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        q_low, k_low = q[..., :dk].contiguous(), k[..., :dk].contiguous()  # [B, H, N, dK]
        return sparse_attention(q_low, k_low, v, pattern, causal=causal)

    def recall(q: Tensor, k: Tensor, v: Tensor) -> dict:
        found = candidate_recall(q[:1, :1, :, :dk], k[:1, :1, :, :dk], pattern, causal=causal)  # [1, 1, N]
        return {"recall": float(torch.nanmean(found))}

    flops = attention_flops(shape, pattern.k + 1)
    return Workload(forward=forward, flops=flops, bytes=io_bytes(shape, pattern.k), extra=recall, notes={"pattern": str(pattern)})


register_case("zeta", zeta_case)

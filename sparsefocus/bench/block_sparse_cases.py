"""Bench cases ``nsa``, ``moba``, ``quest``, ``dsa`` (each ``NAME[:PARAMS]``): the block-sparse
mechanisms timed like any case, with their kept keys per query as the useful work.

``nsa`` runs with fixed gates (1/2, no gate weights: their cost is one small matmul); ``dsa``
builds its indexer weights for a model width of heads x head_dim and feeds a random hidden
state, so the indexer's projections, its chunked scores and the KL loss are all timed.
"""

from __future__ import annotations

from typing import cast

import torch
from torch import Tensor

from sparsefocus.attention import parse_pattern, sparse_attention
from sparsefocus.attention.block_topk import TileBlockTopK
from sparsefocus.attention.dsa import DSA
from sparsefocus.attention.nsa import NSA
from sparsefocus.attention.patterns import AUX_KEY, HIDDEN_KEY, Pattern
from sparsefocus.bench.registry import (
    BenchShape,
    Workload,
    attention_flops,
    io_bytes,
    register_case,
)


def kept_keys(pattern: Pattern, shape: BenchShape) -> float:
    """Keys (or compressed keys) each query attends to, before the causal cut."""
    if isinstance(pattern, NSA):
        return pattern.top * pattern.block + shape.n / pattern.stride / (2 if shape.causal else 1) + pattern.window
    if isinstance(pattern, DSA):
        return pattern.k
    if isinstance(pattern, TileBlockTopK):  # moba, quest
        return (pattern.top + pattern.tile // pattern.block + 1) * pattern.block
    raise ValueError(f"kept_keys: {pattern.label()} is not a block-sparse pattern (nsa, moba, quest, dsa)")


def block_sparse_case(name: str):
    """Factory of the bench case ``name[:PARAMS]`` (the pattern of the same name)."""

    def case(argument: str, shape: BenchShape) -> Workload:
        pattern = parse_pattern(f"{name}:{argument}" if argument else name)
        causal, params = shape.causal, None
        if isinstance(pattern, DSA):
            width = shape.heads * shape.head_dim
            weights = pattern.make_layer_parameters(width, shape.heads, shape.kv_heads, shape.head_dim, shape.head_dim)
            params = {key: w.to(shape.device).requires_grad_() for key, w in weights.items()}
            params[HIDDEN_KEY] = torch.randn(shape.batch, shape.n, width, device=shape.device, dtype=shape.dtype)

        def forward(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
            if params is None:
                return sparse_attention(q, k, v, pattern, causal=causal)
            aux: dict[str, Tensor] = {}  # the mechanism writes its auxiliary losses here
            call = cast(dict[str, Tensor], {**params, AUX_KEY: aux})  # params carry this dict beside tensors
            out = sparse_attention(q, k, v, pattern, causal=causal, params=call)
            return out + 0 * sum(aux.values())

        flops = attention_flops(shape, kept_keys(pattern, shape))
        return Workload(forward=forward, flops=flops, bytes=io_bytes(shape), notes={"pattern": str(pattern)})

    return case


for _name in ("nsa", "moba", "quest", "dsa"):
    register_case(_name, block_sparse_case(_name))

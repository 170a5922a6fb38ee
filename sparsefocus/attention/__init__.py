"""Attention mechanisms: every family behind one API, each defined by a pure-PyTorch reference."""

from sparsefocus.attention import (  # noqa: F401  (importing a family registers its patterns)
    adaptive,
    block_topk,
    dsa,
    fixed,
    full,
    image,
    lsh,
    nsa,
    routing,
    topk,
    zeta,
)
from sparsefocus.attention.api import selection_mask, sparse_attention
from sparsefocus.attention.common import indexed_attention_ref
from sparsefocus.attention.patterns import PATTERNS, IndexedPattern, Pattern, list_patterns, parse_pattern

__all__ = [
    "PATTERNS",
    "IndexedPattern",
    "Pattern",
    "indexed_attention_ref",
    "list_patterns",
    "parse_pattern",
    "selection_mask",
    "sparse_attention",
]

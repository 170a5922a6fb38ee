"""sparsefocus: the PyTorch library and laboratory for sparse attention."""

from sparsefocus.attention import (
    PATTERNS,
    Pattern,
    indexed_attention_ref,
    list_patterns,
    parse_pattern,
    selection_mask,
    sparse_attention,
)
from sparsefocus.layers import MoEFeedForward, SparseAttention

__version__ = "0.1.0"

__all__ = [
    "MoEFeedForward",
    "PATTERNS",
    "Pattern",
    "indexed_attention_ref",
    "list_patterns",
    "parse_pattern",
    "selection_mask",
    "SparseAttention",
    "sparse_attention",
]

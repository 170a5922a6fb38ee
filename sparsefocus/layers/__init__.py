"""nn.Modules built on the attention API."""

from sparsefocus.layers.attention import SparseAttention

__all__ = ["SparseAttention"]

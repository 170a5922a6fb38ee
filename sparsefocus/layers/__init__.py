"""nn.Modules built on the attention API."""

from sparsefocus.layers.attention import SparseAttention
from sparsefocus.layers.moe import MoEFeedForward

__all__ = ["MoEFeedForward", "SparseAttention"]

"""``SparseAttention``: multi-head attention with q/k/v/out projections over any pattern."""

from __future__ import annotations

from torch import Tensor, nn

from sparsefocus.attention import parse_pattern, sparse_attention
from sparsefocus.attention.patterns import Pattern


class SparseAttention(nn.Module):
    """Multi-head self-attention whose score pattern is any registered mechanism.

    Args:
        dim: model width.
        heads: number of query heads.
        pattern: spec or string (``"TOPK:5"``, ``"BAND:5(1)"``...).
        causal: decoder-style masking. Default: False.
        kv_heads: key/value heads for GQA (must divide ``heads``). Default: ``heads``.
        head_dim: width of each head. Default: ``dim // heads`` (the paper's code uses ``dim``).
        bias: biases on the projections. Default: True.
        dropout: dropout on the output projection. Default: 0.
        impl: passed to ``sparse_attention``. Default: "auto".
    Shapes:
        x: [B, N, dim], key_padding_mask: [B, N] bool (True = real token) -> [B, N, dim].
    """

    def __init__(
        self,
        dim: int,
        heads: int,
        pattern: "str | Pattern",
        *,
        causal: bool = False,
        kv_heads: int | None = None,
        head_dim: int | None = None,
        bias: bool = True,
        dropout: float = 0.0,
        impl: str = "auto",
    ) -> None:
        super().__init__()
        kv_heads = heads if kv_heads is None else kv_heads
        if heads < 1 or kv_heads < 1 or heads % kv_heads:
            raise ValueError(f"heads ({heads}) must be a positive multiple of kv_heads ({kv_heads})")
        if head_dim is None and dim % heads:
            raise ValueError(f"heads ({heads}) must divide dim ({dim}) unless head_dim is given")
        self.pattern = parse_pattern(pattern)
        self.heads, self.kv_heads, self.causal, self.impl = heads, kv_heads, causal, impl
        self.head_dim = dim // heads if head_dim is None else head_dim
        self.qk_dim = self.pattern.qk_dim(self.head_dim)
        self.q_proj = nn.Linear(dim, heads * self.qk_dim, bias=bias)
        self.k_proj = nn.Linear(dim, kv_heads * self.qk_dim, bias=bias)
        self.v_proj = nn.Linear(dim, kv_heads * self.head_dim, bias=bias)
        self.out_proj = nn.Linear(heads * self.head_dim, dim, bias=bias)
        self.dropout = nn.Dropout(dropout)
        self.mechanism = nn.ParameterDict(self.pattern.make_parameters(heads))

    def project(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """x [B, N, dim] -> q [B, H, N, Dqk], k [B, Hk, N, Dqk], v [B, Hk, N, Dh]."""
        batch, length, _ = x.shape
        q = self.q_proj(x).view(batch, length, self.heads, self.qk_dim).transpose(1, 2)
        k = self.k_proj(x).view(batch, length, self.kv_heads, self.qk_dim).transpose(1, 2)
        v = self.v_proj(x).view(batch, length, self.kv_heads, self.head_dim).transpose(1, 2)
        return q, k, v

    def forward(self, x: Tensor, key_padding_mask: Tensor | None = None) -> Tensor:
        q, k, v = self.project(x)
        params = {name: value for name, value in self.mechanism.items()} or None  # dict(ParameterDict) does not trace
        out = sparse_attention(
            q, k, v, self.pattern, causal=self.causal, key_padding_mask=key_padding_mask, impl=self.impl, params=params
        )  # [B, H, N, Dh]
        out = out.transpose(1, 2).reshape(x.shape[0], x.shape[1], self.heads * self.head_dim)  # [B, N, H*Dh]
        return self.dropout(self.out_proj(out))

    def extra_repr(self) -> str:
        return f"pattern={self.pattern.label()}, heads={self.heads}, kv_heads={self.kv_heads}, causal={self.causal}, impl={self.impl}"

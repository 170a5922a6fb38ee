"""``SparseAttention``: multi-head attention with q/k/v/out projections over any pattern."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from sparsefocus.attention import parse_pattern, sparse_attention
from sparsefocus.attention.patterns import AUX_KEY, HIDDEN_KEY, Pattern


class HiddenKV(tuple):
    """The cache of a layer whose mechanism reads the layer's input x (DSA's indexer keys, NSA's
    gates): it reads as (k, v) and also carries ``hidden``, the inputs of the cached positions
    [B, P, dim], so that a later step sees x for every key position."""

    hidden: Tensor

    def __new__(cls, k: Tensor, v: Tensor, hidden: Tensor) -> "HiddenKV":
        cache = super().__new__(cls, (k, v))
        cache.hidden = hidden
        return cache


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
        After each forward ``self.aux_loss`` holds the scalar sum of the mechanism's auxiliary
        losses (DSA's indexer KL; 0 for most patterns): add it to the training loss.
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
        self.mechanism = nn.ParameterDict(self.pattern.make_layer_parameters(dim, heads, kv_heads, self.qk_dim, self.head_dim))
        self.aux_loss: Tensor = torch.zeros(())

    def project(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """x [B, N, dim] -> q [B, H, N, Dqk], k [B, Hk, N, Dqk], v [B, Hk, N, Dh]."""
        return self.split_heads(self.q_proj(x), self.k_proj(x), self.v_proj(x))

    def split_heads(self, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Projections q [B, N, H*Dqk], k [B, N, Hk*Dqk], v [B, N, Hk*Dh] -> [B, heads, N, width] each."""
        batch, length = q.shape[:2]
        q = q.view(batch, length, self.heads, self.qk_dim).transpose(1, 2)
        k = k.view(batch, length, self.kv_heads, self.qk_dim).transpose(1, 2)
        v = v.view(batch, length, self.kv_heads, self.head_dim).transpose(1, 2)
        return q, k, v

    def forward(
        self,
        x: Tensor,
        key_padding_mask: Tensor | None = None,
        past_kv: tuple[Tensor, Tensor] | None = None,
        use_cache: bool = False,
    ) -> "Tensor | tuple[Tensor, tuple[Tensor, Tensor]]":
        """x [B, N, dim] -> [B, N, dim]; with ``use_cache``, also the updated cache (k, v).

        past_kv: keys [B, Hk, P, Dqk] and values [B, Hk, P, Dh] of the P earlier positions
        (causal layers only); x holds the next N positions, which attend bottom-right over all
        P + N keys, so stepping token by token gives the rows of the whole-sequence call.
        key_padding_mask is then [B, P + N]. A ZETA layer returns its own cache (it reads as
        (k, v)); given one back with a single new position and no padding mask, the step
        searches the cached sorted key codes instead of re-sorting and recomputing every row.
        Without a padding mask, a BAND:k layer (no global tokens) keeps only the last k - 1
        positions in its cache (P is then at most k - 1). A layer whose mechanism reads x (DSA,
        NSA) returns a ``HiddenKV``, which also keeps the cached positions' inputs.
        """
        q, k, v = self.project(x)
        if past_kv is not None and not self.causal:
            raise ValueError("past_kv needs a causal SparseAttention: a cache only makes sense for decoding")
        hidden = self._hidden(x, past_kv)  # [B, P + N, dim] where the mechanism reads x
        params = self.mechanism_params(hidden)
        stepper = getattr(self.pattern, "decode_step", None)
        own_cache = past_kv is not None and not isinstance(past_kv, tuple)  # the pattern's (start_cache), not (k, v)
        if stepper is not None and own_cache and x.shape[1] == 1 and key_padding_mask is None:
            out, cache = stepper(q, k, v, past_kv, params)  # one position from the pattern's own cache
        else:
            if past_kv is not None:
                k, v = torch.cat([past_kv[0], k], dim=2), torch.cat([past_kv[1], v], dim=2)  # [B, Hk, P+N, *]
            out = sparse_attention(
                q, k, v, self.pattern, causal=self.causal, key_padding_mask=key_padding_mask, impl=self.impl, params=params
            )  # [B, H, N, Dh]
            cache = self._cache(k, v, key_padding_mask, hidden) if use_cache else (k, v)
        out = out.transpose(1, 2).reshape(x.shape[0], x.shape[1], self.heads * self.head_dim)  # [B, N, H*Dh]
        aux = params.get(AUX_KEY, {}) if params else {}
        self.aux_loss = sum(aux.values(), x.new_zeros((), dtype=torch.float32))
        out = self.dropout(self.out_proj(out))
        return (out, cache) if use_cache else out

    def _hidden(self, x: Tensor, past_kv: Any) -> Tensor:
        """x, preceded by the cached positions' inputs when the mechanism reads x and there is a cache."""
        if past_kv is None or not self.pattern.needs_hidden:
            return x
        past = getattr(past_kv, "hidden", None)
        if past is None:
            raise ValueError(
                f"pattern {self.pattern.label()} reads the layer input of every cached position: pass the "
                "cache this layer returned with use_cache=True (a HiddenKV), not a plain (k, v)"
            )
        return torch.cat([past, x], dim=1)

    def _cache(self, k: Tensor, v: Tensor, key_padding_mask: Tensor | None, hidden: Tensor) -> Any:
        """The cache returned with ``use_cache``: the pattern's own decoding cache where it has one
        (ZETA: sorted key codes and running sums; it reads as (k, v)); the last W - 1 positions
        for a pattern whose causal rows read only the W most recent keys (``recent_keys``: BAND
        without global tokens), copied so that the longer tensors are freed; else (k, v). Only
        without a padding mask: a mask names positions of the whole sequence. A mechanism that
        reads x gets a ``HiddenKV`` (k, v and the inputs so far)."""
        if self.pattern.needs_hidden:
            return HiddenKV(k, v, hidden)
        if not self.causal or key_padding_mask is not None:
            return (k, v)
        start = getattr(self.pattern, "start_cache", None)
        if start is not None:
            return start(k, v)
        recent = self.pattern.recent_keys()
        if recent is not None and k.shape[2] >= recent:
            keep = slice(k.shape[2] - recent + 1, None)  # the W - 1 latest: a later row reads those and itself
            return k[:, :, keep].contiguous(), v[:, :, keep].contiguous()
        return (k, v)

    def mechanism_params(self, x: Tensor) -> dict | None:
        """The ``params`` of ``sparse_attention`` for input x (see ``attention_params``)."""
        values = {name: value for name, value in self.mechanism.items()}  # dict(ParameterDict) does not trace
        return attention_params(self.pattern, values, x)

    def extra_repr(self) -> str:
        return f"pattern={self.pattern.label()}, heads={self.heads}, kv_heads={self.kv_heads}, causal={self.causal}, impl={self.impl}"


def attention_params(pattern: Pattern, values: dict[str, Tensor], x: Tensor) -> dict | None:
    """The ``params`` of ``sparse_attention``: the mechanism's parameters ``values``, plus the
    input x [B, N, dim] for patterns that read it and an empty dict that mechanisms fill with
    auxiliary losses; None when there is nothing to pass."""
    params: dict = dict(values)
    if pattern.needs_hidden:
        params[HIDDEN_KEY] = x
    if pattern.has_aux_loss:
        params[AUX_KEY] = {}
    return params or None


def total_aux_loss(model: nn.Module) -> Tensor:
    """Sum of the auxiliary losses the attention layers of ``model`` computed in their last forward."""
    losses = [m.aux_loss for m in model.modules() if isinstance(m, SparseAttention)]
    return sum(losses[1:], losses[0]) if losses else torch.zeros(())

"""Input-agnostic patterns: which keys a query keeps depends only on positions.

Each pattern lists its keys per query (``key_indices``, for the gather path and the Triton
kernel) and states the same rule as a FlexAttention ``mask_mod`` (for the ``flex`` path). The
dense reference is built from ``mask_mod`` evaluated on every pair, so the two statements are
checked against each other by the tests.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Callable, ClassVar

import torch
from torch import Tensor

from sparsefocus.attention.patterns import IndexedPattern, register, require

MaskMod = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]


@lru_cache(maxsize=1)
def _compiled_flex_attention():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def flex_attention_fn(device: torch.device):
    """FlexAttention: compiled on CUDA, eager (unfused, for tests) elsewhere."""
    from torch.nn.attention.flex_attention import flex_attention

    return _compiled_flex_attention() if device.type == "cuda" else flex_attention


def with_causal_and_padding(mask_mod: MaskMod, causal: bool, key_padding_mask: Tensor | None) -> MaskMod:
    """AND a causal rule and a [B, M] key padding mask into a mask_mod."""

    def combined(b, h, q_idx, kv_idx):
        keep = mask_mod(b, h, q_idx, kv_idx)
        if causal:
            keep = keep & (kv_idx <= q_idx)
        if key_padding_mask is not None:
            keep = keep & key_padding_mask[b, kv_idx]
        return keep

    return combined


def with_global_tokens(mask_mod: MaskMod, num_global: int) -> MaskMod:
    """OR in g global tokens: rows and columns 0..g-1 are all kept."""
    if num_global == 0:
        return mask_mod

    def combined(b, h, q_idx, kv_idx):
        return mask_mod(b, h, q_idx, kv_idx) | (q_idx < num_global) | (kv_idx < num_global)

    return combined


def append_global_columns(index: Tensor, num_global: int) -> Tensor:
    """Add key columns 0..g-1 to every row of [1, 1, N, K] lists, dropping repeats -> [1, 1, N, K+g]."""
    if num_global == 0:
        return index
    n_queries = index.shape[-2]
    globals_ = torch.arange(num_global, device=index.device).expand(1, 1, n_queries, num_global)
    local = torch.where(index < num_global, torch.full_like(index, -1), index)
    return torch.cat([local, globals_.to(index.dtype)], dim=-1)


@dataclass(frozen=True)
class FixedPattern(IndexedPattern):
    """Base of position-only patterns: key lists, a mask_mod and a FlexAttention path."""

    impls: ClassVar[tuple[str, ...]] = ("reference", "lean", "triton", "flex")
    family: ClassVar[str] = "input-agnostic"

    def mask_mod(self, n_queries: int, n_keys: int, causal: bool) -> MaskMod:
        """FlexAttention-style rule ``(b, h, q_idx, kv_idx) -> bool``, global tokens included.

        ``causal`` is passed because some rules change shape under causality (BAND keeps the k
        most recent keys); the j <= i cut itself is added by the caller."""
        raise NotImplementedError(f"{type(self).__name__} must define mask_mod")

    def position_indices(self, n_queries: int, n_keys: int, causal: bool, device: torch.device) -> Tensor:
        """[1, 1, N, K] key lists without global tokens; -1 = unused."""
        raise NotImplementedError(f"{type(self).__name__} must define position_indices")

    def key_indices(self, q, k, causal, key_padding_mask, params):
        index = self.position_indices(q.shape[-2], k.shape[-2], causal, q.device)
        index = append_global_columns(index, min(self.num_global_tokens, k.shape[-2]))
        if causal:
            query_pos = torch.arange(q.shape[-2], device=q.device)[:, None]
            index = torch.where(index > query_pos, torch.full_like(index, -1), index)
        return index

    def row_mask(self, q, k, rows, causal, key_padding_mask=None, params=None):
        rule = with_causal_and_padding(self.mask_mod(q.shape[-2], k.shape[-2], causal), causal, None)
        query_pos = torch.arange(rows.start, rows.stop, device=q.device)[:, None]
        key_pos = torch.arange(k.shape[-2], device=q.device)[None, :]
        zero = torch.zeros((), dtype=torch.long, device=q.device)
        return rule(zero, zero, query_pos, key_pos)[None, None]

    def flex(self, q, k, v, *, causal, scale, key_padding_mask, params):
        from torch.nn.attention.flex_attention import create_block_mask

        n_queries, n_keys = q.shape[-2], k.shape[-2]
        rule = with_causal_and_padding(self.mask_mod(n_queries, n_keys, causal), causal, key_padding_mask)
        batch = None if key_padding_mask is None else q.shape[0]
        block_mask = create_block_mask(rule, batch, None, n_queries, n_keys, device=q.device)
        attend = flex_attention_fn(q.device)
        return attend(q, k, v, block_mask=block_mask, scale=scale)


@register
@dataclass(frozen=True)
class Band(FixedPattern):
    """``BAND:k(g)``: exactly k keys per query, floor((k-1)/2) to the left and the rest to the right,
    the window shifted at the edges so every row keeps k keys; causal: the k most recent keys
    including itself. g global tokens (the first g positions) are added."""

    k: int
    g: int = 0
    examples: ClassVar[tuple[str, ...]] = ("BAND:5(1)", "band:k=4", "BAND:1")
    name: ClassVar[str] = "band"
    aliases: ClassVar[tuple[str, ...]] = ("windowed", "sliding_window")
    positional: ClassVar[tuple[str, ...]] = ("k", "g")
    cost: ClassVar[tuple[str, str]] = ("O(N (k+g) D)", "O(N (k+g))")

    def validate(self) -> None:
        require(self.k >= 1, f"band: k must be >= 1, got {self.k}")
        require(self.g >= 0, f"band: g must be >= 0, got {self.g}")

    def _left(self) -> int:
        return (self.k - 1) // 2

    def mask_mod(self, n_queries, n_keys, causal):
        width, left = min(self.k, n_keys), self._left()

        def band(b, h, q_idx, kv_idx):
            start = torch.clamp(q_idx - left, 0, n_keys - width)
            return (kv_idx >= start) & (kv_idx < start + width)

        def recent(b, h, q_idx, kv_idx):
            return (q_idx - kv_idx < self.k) & (kv_idx <= q_idx)

        return with_global_tokens(recent if causal else band, self.g)

    def position_indices(self, n_queries, n_keys, causal, device):
        query_pos = torch.arange(n_queries, device=device)[:, None]
        width = min(self.k, n_keys)
        if causal:
            index = query_pos - self.k + 1 + torch.arange(self.k, device=device)[None, :]
            return torch.where(index < 0, torch.full_like(index, -1), index)[None, None]
        start = torch.clamp(query_pos - self._left(), 0, n_keys - width)
        return (start + torch.arange(width, device=device)[None, :])[None, None]

    def label(self) -> str:
        return f"BAND:{self.k}({self.g})" if self.g else f"BAND:{self.k}"


@register
@dataclass(frozen=True)
class Bloc(FixedPattern):
    """``BLOC:k(g)``: non-overlapping diagonal blocks of size k (the last may be shorter); a query
    keeps the keys of its own block (causal: those up to itself) plus g global tokens."""

    k: int
    g: int = 0
    examples: ClassVar[tuple[str, ...]] = ("BLOC:9(3)", "bloc:k=4")
    name: ClassVar[str] = "bloc"
    aliases: ClassVar[tuple[str, ...]] = ("blklocal", "block_local")
    positional: ClassVar[tuple[str, ...]] = ("k", "g")
    cost: ClassVar[tuple[str, str]] = ("O(N (k+g) D)", "O(N (k+g))")

    def validate(self) -> None:
        require(self.k >= 1, f"bloc: k must be >= 1, got {self.k}")
        require(self.g >= 0, f"bloc: g must be >= 0, got {self.g}")

    def mask_mod(self, n_queries, n_keys, causal):
        def block(b, h, q_idx, kv_idx):
            return (q_idx // self.k) == (kv_idx // self.k)

        return with_global_tokens(block, self.g)

    def position_indices(self, n_queries, n_keys, causal, device):
        query_pos = torch.arange(n_queries, device=device)[:, None]
        index = (query_pos // self.k) * self.k + torch.arange(self.k, device=device)[None, :]
        return torch.where(index >= n_keys, torch.full_like(index, -1), index)[None, None]

    def label(self) -> str:
        return f"BLOC:{self.k}({self.g})" if self.g else f"BLOC:{self.k}"


@register
@dataclass(frozen=True)
class GlobalTokens(FixedPattern):
    """``global:g=G``: the first g positions attend to every position and every position attends
    to them; nothing else is kept. Combine with a local pattern through BAND/BLOC's g."""

    g: int
    examples: ClassVar[tuple[str, ...]] = ("global:g=2",)
    name: ClassVar[str] = "global"
    positional: ClassVar[tuple[str, ...]] = ("g",)
    cost: ClassVar[tuple[str, str]] = ("O(N g D)", "O(N g)")

    def validate(self) -> None:
        require(self.g >= 1, f"global: g must be >= 1, got {self.g}")

    def mask_mod(self, n_queries, n_keys, causal):
        def nothing(b, h, q_idx, kv_idx):
            return q_idx < 0

        return with_global_tokens(nothing, self.g)

    def position_indices(self, n_queries, n_keys, causal, device):
        return torch.full((1, 1, n_queries, 1), -1, dtype=torch.long, device=device)

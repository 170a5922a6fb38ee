"""Input-dependent heavy hitters chosen per query from the scores: exact top-k, bottom-k (the
paper's control) and a cosine-similarity threshold.

The reference computes all N x M scores and keeps the selected ones; the lean path streams query
chunks and gathers the selected keys (memory O(chunk * M + N k)); the Triton path selects with a
fused streaming kernel and attends with the indexed-attention kernel (memory O(N k)).
Gradients flow through the selected scores only, never through the choice.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from sparsefocus.attention.common import (
    DEFAULT_ROW_CHUNK,
    causal_row_mask,
    mask_from_indices,
    row_slice,
    upcast,
)
from sparsefocus.attention.patterns import IndexedPattern, Pattern, register, require
from sparsefocus.kernels._ops import top_positions


def allowed_keys(q: Tensor, k: Tensor, rows: slice, causal: bool, key_padding_mask: Tensor | None) -> Tensor:
    """[B or 1, 1, len(rows), M] bool: the keys a query may select (causal cut and padding)."""
    allowed = torch.ones(1, 1, rows.stop - rows.start, k.shape[-2], dtype=torch.bool, device=q.device)
    if causal:
        allowed = allowed & causal_row_mask(rows, k.shape[-2], q.device)
    if key_padding_mask is not None:
        allowed = allowed & key_padding_mask[:, None, None, :]
    return allowed


def select_extreme_keys(
    q: Tensor, k: Tensor, rows: slice, count: int, largest: bool, causal: bool, key_padding_mask: Tensor | None
) -> Tensor:
    """Indices [B, H, len(rows), min(count, M)] of each query's largest (or smallest) allowed
    scores q.k, ties to the smaller position (as the Triton selection); -1 where a row has fewer
    allowed keys than ``count``. No gradient. k may have
    fewer (kv) heads than q: each kv head serves its group of query heads."""
    with torch.no_grad():
        batch, q_heads, _, dim = q.shape
        kv_heads, n_keys = k.shape[1], k.shape[2]
        # query heads h*G .. h*G+G-1 read kv head h (expand_kv's order): one matmul per kv head
        # over its group's rows, so the keys are never repeated
        n_rows = q[:, :, rows].shape[2]
        # explicit sizes, not -1: an empty batch has no size to infer
        grouped = upcast(q[:, :, rows]).reshape(batch, kv_heads, q_heads // kv_heads * n_rows, dim)  # [B, Hk, G*C, D]
        scores = torch.matmul(grouped, upcast(k).transpose(-1, -2)).view(batch, q_heads, n_rows, n_keys)  # [B, H, C, M]
        if not largest:
            scores = -scores
        return top_positions(scores, count, allowed_keys(q, k, rows, causal, key_padding_mask))  # [B, H, C, K]


@dataclass(frozen=True)
class _ScoreSelection(IndexedPattern):
    """Keep, per query, the k keys with the largest (or smallest) scores among the allowed ones."""

    k: int
    largest: ClassVar[bool] = True
    positional: ClassVar[tuple[str, ...]] = ("k",)
    input_dependent: ClassVar[bool] = True
    family: ClassVar[str] = "heavy hitters"
    needs_square: ClassVar[bool] = False

    def validate(self) -> None:
        require(self.k >= 1, f"{self.name}: k must be >= 1, got {self.k}")

    def check_sizes(self, n_queries, n_keys, causal):
        super().check_sizes(n_queries, n_keys, causal)
        require(self.k <= n_keys, f"{self.name}: k={self.k} is larger than the number of keys {n_keys}")

    def row_indices(self, q, k, rows, causal, key_padding_mask=None, params=None):
        """``row_mask``'s keys as a list: [B, H, len(rows), k] positions, -1 in unused slots."""
        return select_extreme_keys(q, k, rows, self.k, self.largest, causal, key_padding_mask)

    def row_mask(self, q, k, rows, causal, key_padding_mask=None, params=None):
        return mask_from_indices(self.row_indices(q, k, rows, causal, key_padding_mask, params), k.shape[-2])

    def key_indices(self, q, k, causal, key_padding_mask, params, chunk: int = DEFAULT_ROW_CHUNK):
        n_queries = q.shape[-2]
        parts = [
            select_extreme_keys(q, k, row_slice(n_queries, s, s + chunk), self.k, self.largest, causal, key_padding_mask)
            for s in range(0, n_queries, chunk)
        ]
        return torch.cat(parts, dim=-2)  # [B, H, N, K]


@register
@dataclass(frozen=True)
class TopK(_ScoreSelection):
    """``TOPK:k``: each query keeps its k largest scores q.k (causal: among allowed keys only; rows
    with fewer than k allowed keys keep all of them), softmax over those."""

    examples: ClassVar[tuple[str, ...]] = ("TOPK:5", "topk:k=1")
    name: ClassVar[str] = "topk"
    cost: ClassVar[tuple[str, str]] = ("O(N M D) select + O(N k D)", "O(N k) (Triton), O(chunk M) lean")

    def triton(self, q, k, v, *, causal, scale, key_padding_mask, params):
        from sparsefocus.kernels.indexed import indexed_attention
        from sparsefocus.kernels.topk_select import topk_select

        # the selection never lists a padded key (-1 instead), so no drop_padded_keys pass here;
        # the attention needs no ranking, so the keys come in position order (cheaper to select)
        index = topk_select(q, k, self.k, causal=causal, key_padding_mask=key_padding_mask, order="position")
        return indexed_attention(q, k, v, index, scale=scale, score="dot")

    def triton_decodes(self) -> bool:
        from sparsefocus.kernels.topk_decode import MAX_K

        return self.k <= MAX_K

    def triton_decode(self, q, k, v, *, scale, key_padding_mask, params):
        """The split-key selection of the N bottom-right rows (``kernels.topk_decode``), then the
        indexed kernel over the k chosen keys -> [B, Hq, N, Dv]."""
        from sparsefocus.kernels.indexed import indexed_attention
        from sparsefocus.kernels.topk_decode import topk_decode_select

        index = topk_decode_select(q, k, self.k, causal=True, key_padding_mask=key_padding_mask)  # [B, Hq, N, k]
        return indexed_attention(q, k, v, index, scale=scale)

    def label(self) -> str:
        return f"TOPK:{self.k}"


@register
@dataclass(frozen=True)
class BottomK(_ScoreSelection):
    """``BOTK:k``: the control of the Semantic Focus paper, keeping the k *smallest* scores."""

    examples: ClassVar[tuple[str, ...]] = ("BOTK:3",)
    name: ClassVar[str] = "botk"
    aliases: ClassVar[tuple[str, ...]] = ("bottomk",)
    largest: ClassVar[bool] = False
    cost: ClassVar[tuple[str, str]] = ("O(N M D) select + O(N k D)", "O(chunk M) lean")
    impls: ClassVar[tuple[str, ...]] = ("reference", "lean", "triton")

    def label(self) -> str:
        return f"BOTK:{self.k}"


@register
@dataclass(frozen=True)
class Threshold(Pattern):
    """``threshold:tau=T``: keep the pairs whose cosine similarity cos(q_i, k_j) >= tau; softmax of
    the usual scaled dot products over them. The number of keys varies per query; a row with
    none gives zeros."""

    tau: float = 0.5
    examples: ClassVar[tuple[str, ...]] = ("threshold:tau=0.2",)
    name: ClassVar[str] = "threshold"
    aliases: ClassVar[tuple[str, ...]] = ("cosine_threshold",)
    positional: ClassVar[tuple[str, ...]] = ("tau",)
    input_dependent: ClassVar[bool] = True
    family: ClassVar[str] = "heavy hitters"
    needs_square: ClassVar[bool] = False
    cost: ClassVar[tuple[str, str]] = ("O(N M D)", "O(chunk M) lean")

    def validate(self) -> None:
        require(-1.0 <= self.tau <= 1.0, f"threshold: tau must be in [-1, 1], got {self.tau}")

    def row_mask(self, q, k, rows, causal, key_padding_mask=None, params=None):
        with torch.no_grad():
            q_unit = torch.nn.functional.normalize(upcast(q[:, :, rows]), dim=-1)
            k_unit = torch.nn.functional.normalize(upcast(k), dim=-1)
            keep = torch.matmul(q_unit, k_unit.transpose(-1, -2)) >= self.tau  # [B, H, C, M]
            return keep & allowed_keys(q, k, rows, causal, key_padding_mask)

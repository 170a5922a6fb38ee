"""Full softmax attention: every query keeps every (causally allowed, unpadded) key."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor

from sparsefocus.attention.common import causal_row_mask, masked_sdpa
from sparsefocus.attention.patterns import Pattern, register


@register
@dataclass(frozen=True)
class Full(Pattern):
    """``FULL``: dense softmax attention. The lean path is PyTorch SDPA (with padded keys, SDPA with a
    boolean mask: cuDNN or memory-efficient attention on CUDA; ``common.masked_sdpa``)."""

    examples: ClassVar[tuple[str, ...]] = ("FULL",)
    name: ClassVar[str] = "full"
    aliases: ClassVar[tuple[str, ...]] = ("dense",)
    family: ClassVar[str] = "full"
    cost: ClassVar[tuple[str, str]] = ("O(N M D)", "O(N + M) with SDPA")
    needs_square: ClassVar[bool] = False

    def row_mask(self, q, k, rows, causal, key_padding_mask=None, params=None):
        if causal:
            return causal_row_mask(rows, k.shape[-2], q.device)[None, None]
        return torch.ones(1, 1, rows.stop - rows.start, k.shape[-2], dtype=torch.bool, device=q.device)

    def lean(self, q, k, v, *, causal, scale, key_padding_mask, params):
        if key_padding_mask is not None:
            return _padded_sdpa(q, k, v, causal, scale, key_padding_mask)
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)

    def packed_runs(self, local, length, causal):
        """Every key of the document (causal: the kernel cuts the later ones)."""
        return torch.zeros_like(local), length

    def label(self) -> str:
        return "FULL"


def _padded_sdpa(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float, key_padding_mask: Tensor) -> Tensor:
    """SDPA with a boolean mask of the real (and, causal, earlier) keys: q [B, H, N, D], k [B, H, M, D],
    v [B, H, M, Dv], key_padding_mask [B, M] -> [B, H, N, Dv]. The backends that take a mask (cuDNN,
    memory-efficient) hold no N x M scores; the mask itself is [B, 1, 1, M], or one [B, 1, N, M] bool
    tensor when causal. SDPA gives NaN on a row with no allowed key, so such a row attends to key 0
    instead and its output is zeroed: zero, with zero gradients, as on every path."""
    allowed = key_padding_mask[:, None, None, :]  # [B, 1, 1, M]
    if causal:
        allowed = allowed & causal_row_mask(slice(0, q.shape[-2]), k.shape[-2], q.device)[None, None]  # [B, 1, N, M]
    has_key = allowed.any(dim=-1, keepdim=True)  # [B, 1, N or 1, 1]
    first_key = torch.arange(k.shape[-2], device=q.device) == 0  # [M]
    allowed = allowed | (~has_key & first_key)
    out = masked_sdpa(q, k, v, allowed, scale=scale)
    return out.masked_fill(~has_key, 0.0)

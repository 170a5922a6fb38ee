"""Full softmax attention: every query keeps every (causally allowed, unpadded) key."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from sparsefocus.attention.common import causal_row_mask
from sparsefocus.attention.patterns import Pattern, register


@register
@dataclass(frozen=True)
class Full(Pattern):
    """``FULL``: dense softmax attention. The lean path is PyTorch SDPA (flash/memory-efficient)."""

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
            return super().lean(q, k, v, causal=causal, scale=scale, key_padding_mask=key_padding_mask, params=params)
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)

    def packed_runs(self, local, length, causal):
        """Every key of the document (causal: the kernel cuts the later ones)."""
        return torch.zeros_like(local), length

    def label(self) -> str:
        return "FULL"

"""Input-agnostic patterns over a 2-D grid: the sequence is an H x W image flattened in raster
(row-major) order, position i = row * W + column.

Like the 1-D fixed patterns, each states its rule as a ``mask_mod`` (reference and ``flex``)
and as key lists (gather path and Triton kernel). Causal means raster order: query i keeps only
the keys j <= i of its set.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from sparsefocus.attention.fixed import FixedPattern
from sparsefocus.attention.patterns import register, require


@dataclass(frozen=True)
class GridPattern(FixedPattern):
    """Base of the grid patterns: a ``height`` x ``width`` grid that must hold exactly N positions."""

    height: int
    width: int
    family: ClassVar[str] = "image"

    def validate(self) -> None:
        require(self.height >= 1, f"{self.name}: height must be >= 1, got {self.height}")
        require(self.width >= 1, f"{self.name}: width must be >= 1, got {self.width}")

    def check_sizes(self, n_queries: int, n_keys: int, causal: bool) -> None:
        super().check_sizes(n_queries, n_keys, causal)
        require(
            n_queries == self.height * self.width,
            f"{self.name}: the sequence length must equal height * width = {self.height} * {self.width} "
            f"= {self.height * self.width}, got N={n_queries}",
        )

    def _row_col(self, position: Tensor) -> tuple[Tensor, Tensor]:
        return position // self.width, position % self.width


@register
@dataclass(frozen=True)
class Window2d(GridPattern):
    """``window2d:height=H,width=W,size=s``: the query at (r, c) keeps the s x s neighbourhood
    rows r-floor((s-1)/2) .. and columns likewise, shifted at the borders (as BAND) so every query
    keeps exactly s*s keys. Causal: those of them with j <= i in raster order."""

    size: int = 3
    examples: ClassVar[tuple[str, ...]] = (
        "window2d:10,10,3",
        "window2d:height=7,width=9,size=4",
        "window2d:5,8,3",
        "window2d:5,6,2",
        "window2d:3,4,2",
        "window2d:3,11,3",
    )
    name: ClassVar[str] = "window2d"
    aliases: ClassVar[tuple[str, ...]] = ("local2d",)
    positional: ClassVar[tuple[str, ...]] = ("height", "width", "size")
    field_aliases: ClassVar[dict[str, str]] = {"h": "height", "w": "width", "s": "size"}
    cost: ClassVar[tuple[str, str]] = ("O(N s^2 D)", "O(N s^2)")

    def validate(self) -> None:
        super().validate()
        require(self.size >= 1, f"window2d: size must be >= 1, got {self.size}")
        require(
            self.size <= min(self.height, self.width),
            f"window2d: size must be <= height ({self.height}) and width ({self.width}), got {self.size}",
        )

    def _corner(self, position: Tensor) -> tuple[Tensor, Tensor]:
        """Top-left (row, column) of the s x s window of each query position."""
        row, col = self._row_col(position)
        left = (self.size - 1) // 2
        top = torch.clamp(row - left, 0, self.height - self.size)
        return top, torch.clamp(col - left, 0, self.width - self.size)

    def mask_mod(self, n_queries, n_keys, causal):
        size = self.size

        def window2d(b, h, q_idx, kv_idx):
            top, first_col = self._corner(q_idx)
            row, col = self._row_col(kv_idx)
            rows_ok = (row >= top) & (row < top + size)
            return rows_ok & (col >= first_col) & (col < first_col + size)

        return window2d

    def position_indices(self, n_queries, n_keys, causal, device):
        top, first_col = self._corner(torch.arange(n_queries, device=device))
        offsets = torch.arange(self.size, device=device)
        rows = (top[:, None] + offsets[None, :])[:, :, None]  # [N, s, 1]
        cols = (first_col[:, None] + offsets[None, :])[:, None, :]  # [N, 1, s]
        return (rows * self.width + cols).reshape(1, 1, n_queries, self.size**2)


@register
@dataclass(frozen=True)
class Axial(GridPattern):
    """``axial:height=H,width=W`` (axial attention, Ho et al. 2019, as one mask): the query at
    (r, c) keeps every key in row r and every key in column c, H + W - 1 keys.
    Causal: those of them with j <= i in raster order."""

    examples: ClassVar[tuple[str, ...]] = (
        "axial:10,10",
        "axial:height=7,width=9",
        "axial:5,8",
        "axial:5,6",
        "axial:3,4",
        "axial:3,11",
    )
    name: ClassVar[str] = "axial"
    positional: ClassVar[tuple[str, ...]] = ("height", "width")
    field_aliases: ClassVar[dict[str, str]] = {"h": "height", "w": "width"}
    cost: ClassVar[tuple[str, str]] = ("O(N (H+W) D)", "O(N (H+W))")

    def mask_mod(self, n_queries, n_keys, causal):
        def axial(b, h, q_idx, kv_idx):
            q_row, q_col = self._row_col(q_idx)
            k_row, k_col = self._row_col(kv_idx)
            return (q_row == k_row) | (q_col == k_col)

        return axial

    def position_indices(self, n_queries, n_keys, causal, device):
        row, col = self._row_col(torch.arange(n_queries, device=device)[:, None])  # [N, 1] each
        same_row = row * self.width + torch.arange(self.width, device=device)[None, :]  # [N, W]
        other_rows = torch.arange(self.height - 1, device=device)[None, :]
        other_rows = other_rows + (other_rows >= row).long()  # every row but r
        same_col = other_rows * self.width + col  # [N, H-1]
        return torch.cat([same_row, same_col], dim=-1)[None, None]  # [1, 1, N, H+W-1]

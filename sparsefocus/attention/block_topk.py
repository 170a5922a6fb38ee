"""Block top-k selection (the selection branch of NSA, MoBA's gate, Quest's page selection).

Two forms live here. ``block_topk`` selects per query token and attends through the per-query
gather kernel. ``moba`` and ``quest`` select per tile of consecutive queries and attend through
the block-sparse kernel (``sparsefocus.kernels.block_sparse``), with tensor-core tiles.

Keys are cut into consecutive blocks of ``block`` positions (the last may be shorter). Each query
scores every block through a pooled summary of its keys and keeps the ``top`` best blocks plus its
own block (the block holding position i). ``pool="mean"`` scores q . mean(keys) as MoBA does;
``pool="minmax"`` scores Quest's upper bound on any q . k in the block,
sum_d max(q_d min_d, q_d max_d) with the per-dimension min and max over the block's keys.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor

from sparsefocus.attention.common import causal_row_mask, mask_from_indices, upcast
from sparsefocus.attention.lsh import repeat_heads
from sparsefocus.attention.patterns import IndexedPattern, Pattern, register, require
from sparsefocus.kernels._ops import top_positions

POOLS = ("mean", "minmax")


def real_key_blocks(n_keys: int, block: int, key_padding_mask: Tensor | None, device: torch.device) -> Tensor:
    """[B or 1, 1, n_blocks, block] bool: which slots of the blocked key axis hold a real key."""
    n_blocks = -(-n_keys // block)
    real = torch.ones(1, n_keys, dtype=torch.bool, device=device) if key_padding_mask is None else key_padding_mask
    real = F.pad(real, (0, n_blocks * block - n_keys), value=False)  # [B, n_blocks * block]
    return real.reshape(real.shape[0], 1, n_blocks, block)


def block_summaries(
    k: Tensor, block: int, pool: str, key_padding_mask: Tensor | None, q_heads: int
) -> tuple[Tensor, Tensor, Tensor]:
    """Per-block key summaries over real keys only, repeated for the query heads: k [B, Hk, M, D]
    -> (first, second [B, Hq, nb, D] fp32, has_key [B or 1, 1, nb, 1]).

    ``pool="mean"``: (mean, the same tensor); ``"minmax"``: (per-channel min, max); 0 for a block
    without a real key. When every block is full and no key is padded the blocks are a view of k,
    summed in fp32 without an fp32 copy of k (min and max are exact in any precision): at B=4,
    H=16, N=64K that copy alone was 1 GiB."""
    n_keys, dim = k.shape[-2], k.shape[-1]
    n_blocks = -(-n_keys // block)
    if key_padding_mask is None and n_keys == n_blocks * block:
        blocked = k.reshape(*k.shape[:2], n_blocks, block, dim)  # [B, Hk, nb, block, D]
        has_key = torch.ones(1, 1, n_blocks, 1, dtype=torch.bool, device=k.device)
        if pool == "mean":
            mean = repeat_heads(blocked.sum(-2, dtype=torch.float32) / block, q_heads)
            return mean, mean, has_key
        return repeat_heads(blocked.amin(-2).float(), q_heads), repeat_heads(blocked.amax(-2).float(), q_heads), has_key
    real = real_key_blocks(n_keys, block, key_padding_mask, k.device)[..., None]  # [B, 1, nb, block, 1]
    blocked = F.pad(upcast(k), (0, 0, 0, n_blocks * block - n_keys)).reshape(*k.shape[:2], n_blocks, block, dim)
    has_key = real.any(dim=-2)  # [B, 1, nb, 1]
    if pool == "mean":
        mean = repeat_heads((blocked * real).sum(-2) / real.sum(-2).clamp_min(1), q_heads)  # [B, Hq, nb, D]
        return mean, mean, has_key
    low = blocked.masked_fill(~real, float("inf")).amin(-2).masked_fill(~has_key, 0.0)
    high = blocked.masked_fill(~real, float("-inf")).amax(-2).masked_fill(~has_key, 0.0)
    return repeat_heads(low, q_heads), repeat_heads(high, q_heads), has_key


def summary_scores(pos: Tensor, neg: Tensor, k: Tensor, block: int, pool: str, key_padding_mask: Tensor | None) -> Tensor:
    """Block scores of queries given by their positive and negative parts pos, neg [B, Hq, R, D]
    fp32 -> [B, Hq, R, nb]: mean, (pos + neg) . mean(k); minmax, Quest's bound
    sum_d max(q_d min_d, q_d max_d) = pos . max + neg . min. A block without a real key scores -inf."""
    first, second, has_key = block_summaries(k, block, pool, key_padding_mask, pos.shape[1])
    if pool == "mean":
        scores = torch.matmul(pos + neg, first.transpose(-1, -2))
    else:
        scores = torch.matmul(pos, second.transpose(-1, -2)) + torch.matmul(neg, first.transpose(-1, -2))
    return scores.masked_fill(~has_key[..., 0][:, :, None, :], float("-inf"))


def block_scores(q: Tensor, k: Tensor, block: int, pool: str, key_padding_mask: Tensor | None) -> Tensor:
    """Score of every key block for every query: q [B, Hq, N, D], k [B, Hk, M, D] -> [B, Hq, N, n_blocks].

    Only real keys enter a summary; a block without one scores -inf. No gradient."""
    with torch.no_grad():
        q = upcast(q)
        return summary_scores(q.clamp_min(0), q.clamp_max(0), k, block, pool, key_padding_mask)


def own_block(n_queries: int, n_keys: int, block: int, device: torch.device) -> Tensor:
    """[N] block id holding each query's own position, -1 where i >= M."""
    position = torch.arange(n_queries, device=device)
    return torch.where(position < n_keys, position // block, torch.full_like(position, -1))


@register
@dataclass(frozen=True)
class BlockTopK(IndexedPattern):
    """``block_topk:block=S,top=T,pool=mean|minmax``: each query keeps its own key block and the T
    best other blocks by pooled score.

    Candidates are the blocks other than the own block that hold at least one real key; causal:
    only blocks that end before the own block starts (complete past blocks, whose summaries read no
    key after i). The own block needs no score and is always kept, cut at j <= i when causal.
    Rows with fewer than T candidates keep all of them.
    """

    block: int = 16
    top: int = 2
    pool: str = "mean"
    examples: ClassVar[tuple[str, ...]] = ("block_topk:block=4,top=2", "block_topk:block=8,top=1,pool=minmax")
    name: ClassVar[str] = "block_topk"
    aliases: ClassVar[tuple[str, ...]] = ("blocktopk",)
    positional: ClassVar[tuple[str, ...]] = ("block", "top", "pool")
    field_aliases: ClassVar[dict[str, str]] = {"block_size": "block", "topk": "top"}
    input_dependent: ClassVar[bool] = True
    family: ClassVar[str] = "heavy hitters"
    needs_square: ClassVar[bool] = False
    cost: ClassVar[tuple[str, str]] = (
        "O(N (M/S) D) block scores + O(N (T+1) S D) attend",
        "O(N M/S) scores + O(N (T+1) S) key lists",
    )

    def validate(self) -> None:
        require(self.block >= 1, f"block_topk: block must be >= 1, got {self.block}")
        require(self.top >= 0, f"block_topk: top must be >= 0, got {self.top}")
        require(self.pool in POOLS, f"block_topk: pool must be one of {', '.join(POOLS)}, got {self.pool!r}")

    def selected_blocks(self, q: Tensor, k: Tensor, causal: bool, key_padding_mask: Tensor | None) -> Tensor:
        """[B, Hq, N, top + 1] block ids per query: its own block first, then the chosen ones; -1 unused."""
        scores = block_scores(q, k, self.block, self.pool, key_padding_mask)  # [B, Hq, N, nb]
        own = own_block(q.shape[-2], k.shape[-2], self.block, q.device)[:, None]  # [N, 1]
        block_id = torch.arange(scores.shape[-1], device=q.device)[None, :]  # [1, nb]
        candidate = (block_id < own) if causal else (block_id != own)
        chosen = top_positions(scores, self.top, candidate & ~torch.isinf(scores))  # [B, Hq, N, top], ties to earlier blocks
        return torch.cat([own.expand(*chosen.shape[:-1], 1), chosen], dim=-1)

    def row_mask(self, q, k, rows, causal, key_padding_mask=None, params=None):
        blocks = self.selected_blocks(q, k, causal, key_padding_mask)[:, :, rows]
        kept_blocks = mask_from_indices(blocks, -(-k.shape[-2] // self.block))  # [B, H, R, nb]
        key_block = torch.arange(k.shape[-2], device=q.device) // self.block
        mask = kept_blocks[..., key_block]  # [B, H, R, M]
        if causal:
            mask = mask & causal_row_mask(rows, k.shape[-2], q.device)
        return mask

    def key_indices(self, q, k, causal, key_padding_mask, params):
        blocks = self.selected_blocks(q, k, causal, key_padding_mask)  # [B, Hq, N, top + 1]
        index = blocks[..., None] * self.block + torch.arange(self.block, device=q.device)  # [B, Hq, N, top+1, S]
        index = index.flatten(-2)  # [B, Hq, N, (top + 1) S]
        unused = (blocks[..., None] < 0).expand(*blocks.shape, self.block).flatten(-2) | (index >= k.shape[-2])
        if causal:
            unused = unused | (index > torch.arange(q.shape[-2], device=q.device)[:, None])
        return torch.where(unused, torch.full_like(index, -1), index)


def pooled_tile_queries(q: Tensor, tile: int, causal: bool) -> tuple[Tensor, Tensor]:
    """Sums of the positive and negative parts of each tile's scoring queries: q [B, H, N, D] ->
    (pos, neg) [B, H, T, D] fp32, T = ceil(N / tile).

    The scoring queries of tile t are its own queries, or when causal the ``tile`` queries ending
    at its first position t * tile (so no row's selection reads a query after that row): tile
    t - 1 without its first query, plus query t * tile. Both come from per-tile sums (a reshape
    and a sum, no running sum over the sequence)."""
    with torch.no_grad():
        n, tiles = q.shape[2], -(-q.shape[2] // tile)
        padded = q if n == tiles * tile else F.pad(q, (0, 0, 0, tiles * tile - n))
        padded = padded.unflatten(2, (tiles, tile))  # [B, H, T, tile, D]
        total_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32  # the clamps are exact in q's dtype
        parts = []
        for part in (padded.clamp_min(0), padded.clamp_max(0)):
            own = part.sum(3, dtype=total_dtype)  # [B, H, T, D]
            if causal:
                first = part[:, :, :, 0].to(total_dtype)  # [B, H, T, D]: query t * tile
                before = F.pad(own - first, (0, 0, 1, 0))[:, :, :tiles]  # tile t - 1 without its first query
                own = before + first
            parts.append(own)
        return parts[0], parts[1]


def tile_block_scores(
    q: Tensor, k: Tensor, block: int, tile: int, pool: str, causal: bool, key_padding_mask: Tensor | None
) -> Tensor:
    """Sum over each tile's scoring queries of the per-token block score -> [B, Hq, T, nb] fp32.

    Both scores are linear in the positive and negative parts of q, so the sum over queries is the
    score of their pooled parts: mean, (sum q) . mean(k); minmax, sum_d (sum q+)_d max_d + (sum q-)_d min_d."""
    with torch.no_grad():
        pos, neg = pooled_tile_queries(q, tile, causal)
        return summary_scores(pos, neg, k, block, pool, key_padding_mask)  # [B, Hq, T, nb]


@dataclass(frozen=True)
class TileBlockTopK(Pattern):
    """Shared machinery of ``moba`` and ``quest``: per tile of ``tile`` consecutive queries (and
    per query head), keep the blocks that hold the tile's own positions and the ``top`` best other
    blocks by the tile's summed pooled score; attend with the block-sparse kernel.

    Candidates are blocks with a real key other than the own ones; causal: only blocks that end at
    or before the tile's first position, scored by the ``tile`` queries ending there. Own blocks are
    cut at j <= i by the causal mask. Rows with fewer candidates keep all of them.
    """

    block: int = 64
    top: int = 3
    tile: int = 64
    pool: ClassVar[str] = "mean"
    positional: ClassVar[tuple[str, ...]] = ("block", "top")
    field_aliases: ClassVar[dict[str, str]] = {"block_size": "block", "topk": "top", "chunk": "block"}
    input_dependent: ClassVar[bool] = True
    family: ClassVar[str] = "heavy hitters"
    needs_square: ClassVar[bool] = False
    impls: ClassVar[tuple[str, ...]] = ("reference", "lean", "triton")
    cost: ClassVar[tuple[str, str]] = ("O((N/T)(M/S) D) scores + O(N (top + T/S + 1) S D) attend", "O((N/T)(M/S)) scores")

    def validate(self) -> None:
        require(self.block >= 1, f"{self.name}: block must be >= 1, got {self.block}")
        require(self.top >= 0, f"{self.name}: top must be >= 0, got {self.top}")
        require(
            self.tile >= 16 and self.tile & (self.tile - 1) == 0, f"{self.name}: tile must be a power of 2 >= 16, got {self.tile}"
        )

    def tile_blocks(self, q: Tensor, k: Tensor, causal: bool, key_padding_mask: Tensor | None) -> Tensor:
        """[B, Hq, T, S] int32 block lists: the own blocks of each tile, then the chosen ones; -1 unused."""
        n_keys, tiles = k.shape[-2], -(-q.shape[-2] // self.tile)
        n_blocks = -(-n_keys // self.block)
        first = torch.arange(tiles, device=q.device) * self.tile  # [T]
        last = (first + self.tile - 1).clamp_max(q.shape[-2] - 1)
        n_own = (self.tile + self.block - 2) // self.block + 1
        own = first[:, None] // self.block + torch.arange(n_own, device=q.device)  # [T, n_own]
        own = torch.where((own <= last[:, None] // self.block) & (own < n_blocks), own, torch.full_like(own, -1))
        block_id = torch.arange(n_blocks, device=q.device)
        is_own = (block_id >= first[:, None] // self.block) & (block_id <= last[:, None] // self.block)  # [T, nb]
        candidate = ((block_id + 1) * self.block <= first[:, None]) if causal else ~is_own
        scores = tile_block_scores(q, k, self.block, self.tile, self.pool, causal, key_padding_mask)
        chosen = top_positions(scores, self.top, candidate & ~torch.isinf(scores))  # [B, Hq, T, top], ties to earlier blocks
        own = own.expand(*chosen.shape[:2], *own.shape)
        return torch.cat([own, chosen], dim=-1).to(torch.int32)

    def row_mask(self, q, k, rows, causal, key_padding_mask=None, params=None):
        blocks = self.tile_blocks(q, k, causal, key_padding_mask)  # [B, Hq, T, S]
        n_blocks = -(-k.shape[-2] // self.block)
        # Each row's tile list by repetition, not by indexing with arange // tile: Inductor's CPU code
        # for that index, saved for the backward at a length that is not a multiple of the tile,
        # filled only the whole tiles of it (an out-of-bounds read in the compiled backward).
        per_row = blocks.repeat_interleave(self.tile, dim=2)[:, :, rows.start : rows.stop]  # [B, Hq, R, S]
        kept = mask_from_indices(per_row, n_blocks)  # [B, Hq, R, nb]
        mask = kept.repeat_interleave(self.block, dim=-1)[..., : k.shape[-2]]  # [B, Hq, R, M]
        return mask & causal_row_mask(rows, k.shape[-2], q.device) if causal else mask

    def triton(self, q, k, v, *, causal, scale, key_padding_mask, params):
        from sparsefocus.kernels.block_sparse import block_sparse_attention

        blocks = self.tile_blocks(q, k, causal, key_padding_mask)
        out, _ = block_sparse_attention(
            q, k, v, blocks, block_size=self.block, tile=self.tile, causal=causal, scale=scale, key_padding_mask=key_padding_mask
        )
        return out


@register
@dataclass(frozen=True)
class Moba(TileBlockTopK):
    """``moba:block=S,top=T,tile=Q``: MoBA's mean-pooled block gate per tile of Q queries (own
    blocks + the T best past blocks by (sum of the tile's scoring queries) . mean(block keys))."""

    name: ClassVar[str] = "moba"
    pool: ClassVar[str] = "mean"
    examples: ClassVar[tuple[str, ...]] = ("moba:block=8,top=2,tile=16",)


@register
@dataclass(frozen=True)
class Quest(TileBlockTopK):
    """``quest:block=S,top=T,tile=Q``: Quest's min/max bound per tile of Q queries (own blocks + the
    T best past blocks by the summed bound sum_d max(q_d min_d, q_d max_d) over the tile's queries)."""

    name: ClassVar[str] = "quest"
    pool: ClassVar[str] = "minmax"
    examples: ClassVar[tuple[str, ...]] = ("quest:block=8,top=2,tile=16",)

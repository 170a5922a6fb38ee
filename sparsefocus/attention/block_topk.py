"""Block top-k selection (the selection branch of NSA, MoBA's gate, Quest's page selection).

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
from sparsefocus.attention.patterns import IndexedPattern, register, require

POOLS = ("mean", "minmax")


def real_key_blocks(n_keys: int, block: int, key_padding_mask: Tensor | None, device: torch.device) -> Tensor:
    """[B or 1, 1, n_blocks, block] bool: which slots of the blocked key axis hold a real key."""
    n_blocks = -(-n_keys // block)
    real = torch.ones(1, n_keys, dtype=torch.bool, device=device) if key_padding_mask is None else key_padding_mask
    real = F.pad(real, (0, n_blocks * block - n_keys), value=False)  # [B, n_blocks * block]
    return real.reshape(real.shape[0], 1, n_blocks, block)


def block_scores(q: Tensor, k: Tensor, block: int, pool: str, key_padding_mask: Tensor | None) -> Tensor:
    """Score of every key block for every query: q [B, Hq, N, D], k [B, Hk, M, D] -> [B, Hq, N, n_blocks].

    Only real keys enter a summary; a block without one scores -inf. No gradient."""
    with torch.no_grad():
        q, k = upcast(q), upcast(k)
        real = real_key_blocks(k.shape[-2], block, key_padding_mask, k.device)[..., None]  # [B, 1, nb, block, 1]
        blocked = F.pad(k, (0, 0, 0, real.shape[-3] * block - k.shape[-2]))
        blocked = blocked.reshape(*k.shape[:2], -1, block, k.shape[-1])  # [B, Hk, nb, block, D]
        has_key = real.any(dim=-2)  # [B, 1, nb, 1]
        if pool == "mean":
            mean = (blocked * real).sum(-2) / real.sum(-2).clamp_min(1)  # [B, Hk, nb, D]
            scores = torch.matmul(q, repeat_heads(mean, q.shape[1]).transpose(-1, -2))
        else:
            low = blocked.masked_fill(~real, float("inf")).amin(-2).masked_fill(~has_key, 0.0)  # [B, Hk, nb, D]
            high = blocked.masked_fill(~real, float("-inf")).amax(-2).masked_fill(~has_key, 0.0)
            low, high = repeat_heads(low, q.shape[1]), repeat_heads(high, q.shape[1])
            # max(q_d min_d, q_d max_d) picks max_d where q_d >= 0 and min_d where q_d < 0.
            scores = torch.matmul(q.clamp_min(0), high.transpose(-1, -2)) + torch.matmul(
                q.clamp_max(0), low.transpose(-1, -2)
            )
        return scores.masked_fill(~has_key[..., 0][:, :, None, :], float("-inf"))  # [B, Hq, N, nb]


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
    aliases: ClassVar[tuple[str, ...]] = ("blocktopk", "moba")
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
        scores = scores.masked_fill(~candidate, float("-inf"))
        values, chosen = scores.topk(min(self.top, scores.shape[-1]), dim=-1)  # [B, Hq, N, top]
        chosen = torch.where(torch.isinf(values), torch.full_like(chosen, -1), chosen)
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

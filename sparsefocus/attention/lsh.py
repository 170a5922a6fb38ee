"""Reformer-style LSH attention (Kitaev et al. 2020) with separate queries and keys.

Queries and keys are hashed with the same seeded random rotations (angular LSH), so a query and a
key that point the same way tend to share a bucket. Inside each bucket the keys are ordered by
position and cut into chunks of ``chunk`` keys; a query attends to the keys of its bucket that lie
in its own chunk or the chunk before (Reformer's look-one-back), plus its own position.

Chunks are counted per bucket rather than over the whole sorted sequence as Reformer does: with
Reformer's global chunking a future token hashed to an earlier bucket shifts every later chunk
boundary, which leaks the future under causality. Per-bucket chunks depend only on earlier keys.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import ClassVar, Optional

import torch
from torch import Tensor

from sparsefocus.attention.common import causal_row_mask, row_slice, upcast
from sparsefocus.attention.patterns import IndexedPattern, register, require


@functools.lru_cache(maxsize=64)
def _rotations_on(rounds: int, dim: int, buckets: int, seed: int, device: torch.device, dtype: torch.dtype) -> Tensor:
    gen = torch.Generator().manual_seed(seed)
    rotations = torch.randn(rounds, dim, max(buckets // 2, 1), generator=gen, dtype=torch.float64)
    return rotations.to(device=device, dtype=dtype)


@torch.compiler.assume_constant_result
def _constant_rotations(rounds: int, dim: int, buckets: int, seed: int, device: torch.device, dtype: torch.dtype) -> Tensor:
    """``_rotations_on`` as a constant of a compiled graph (torch.compile cannot create a Generator)."""
    return _rotations_on(rounds, dim, buckets, seed, device, dtype)


def random_rotations(rounds: int, dim: int, buckets: int, seed: int, like: Tensor) -> Tensor:
    """[rounds, D, buckets // 2] Gaussian rotations drawn from ``seed`` (CPU generator, so the
    same seed gives the same rotations on every device), in ``like``'s compute dtype.

    Drawn once per device and cached (read-only): no host-to-device copy after the first call,
    so a CUDA graph can capture the pattern, and torch.compile holds them as a graph constant."""
    dtype = torch.float64 if like.dtype == torch.float64 else torch.float32  # upcast's dtype
    return _constant_rotations(rounds, dim, buckets, seed, like.device, dtype)


def hash_buckets(x: Tensor, rotation: Tensor, buckets: int) -> Tensor:
    """Angular LSH: bucket = argmax([x R; -x R]) in [0, buckets). x [B, H, L, D] -> [B, H, L] long."""
    if buckets == 1:
        return torch.zeros(x.shape[:-1], dtype=torch.long, device=x.device)
    projected = torch.matmul(upcast(x), rotation)  # [B, H, L, buckets/2]
    # argmax of [p; -p] without building it: the first maximum of p when max p >= -min p (the
    # first half comes first), else the first minimum of p in the second half
    top, top_at = projected.max(dim=-1)
    low, low_at = projected.min(dim=-1)
    return torch.where(top >= -low, top_at, low_at + projected.shape[-1])


def key_buckets(k: Tensor, rotation: Tensor, buckets: int, key_padding_mask: Tensor | None) -> Tensor:
    """[B, H, M] key buckets; padded keys go to the extra bucket ``buckets``, which no query has,
    so they neither are kept nor take up a chunk slot."""
    hashed = hash_buckets(k, rotation, buckets)
    if key_padding_mask is None:
        return hashed
    return torch.where(key_padding_mask[:, None, :], hashed, torch.full_like(hashed, buckets))


def repeat_heads(x: Tensor, num_q_heads: int) -> Tensor:
    """Repeat per-KV-head data [B, Hk, ...] for grouped-query attention -> [B, Hq, ...]."""
    group = num_q_heads // x.shape[1]
    return x if group == 1 else x.repeat_interleave(group, dim=1)


def own_position(n_queries: int, n_keys: int, device: torch.device) -> Tensor:
    """[1, 1, N, 1] key index of each query's own position, -1 where i >= M."""
    position = torch.arange(n_queries, device=device)
    return torch.where(position < n_keys, position, torch.full_like(position, -1))[None, None, :, None]


def dedupe_indices(index: Tensor) -> Tensor:
    """Sort each row of [.., K] key lists and replace repeated entries by -1 (a key kept by several
    rounds is attended once)."""
    index, _ = index.sort(dim=-1)
    repeated = torch.zeros_like(index, dtype=torch.bool)
    repeated[..., 1:] = index[..., 1:] == index[..., :-1]
    return torch.where(repeated, torch.full_like(index, -1), index)


@register
@dataclass(frozen=True)
class LSH(IndexedPattern):
    """``lsh:buckets=B,chunk=C,rounds=R,seed=S``: Reformer LSH attention, queries and keys hashed apart.

    Per round r, with seeded rotations R_r [D, B/2], query i gets bucket
    hq_i = argmax([q_i R_r; -q_i R_r]) and key j bucket hk_j likewise. Let
    rank_j = #{j' < j : hk_j' = hk_j} (the key's place in its bucket, by position),
    p_i = #{j < i : hk_j = hq_i} (where query i would be inserted in its bucket's keys),
    and chunk numbers c_j = rank_j // C, c_i = p_i // C. Query i keeps key j iff
    hk_j = hq_i and c_j is c_i or c_i - 1. Over rounds the kept pairs are united (softmax once over
    the union; Reformer instead normalises each round and combines with logsumexp weights). The
    query's own position (j = i, if i < M) is always kept, so no row is empty. Causal: j <= i is
    cut; the ranks count only earlier keys, so no future key changes a past row's selection.
    """

    buckets: int = 8
    chunk: int = 16
    rounds: int = 1
    seed: int = 0
    examples: ClassVar[tuple[str, ...]] = ("lsh:buckets=4,chunk=4,rounds=2", "lsh:buckets=2,chunk=8,seed=3")
    name: ClassVar[str] = "lsh"
    aliases: ClassVar[tuple[str, ...]] = ("reformer",)
    positional: ClassVar[tuple[str, ...]] = ("buckets", "chunk", "rounds")
    field_aliases: ClassVar[dict[str, str]] = {"n_buckets": "buckets", "n_hashes": "rounds", "chunk_size": "chunk"}
    input_dependent: ClassVar[bool] = True
    family: ClassVar[str] = "heavy hitters"
    needs_square: ClassVar[bool] = False
    decoding: ClassVar[str] = "replay"  # row_mask builds every row; replay uses the sorted key lists
    cost: ClassVar[tuple[str, str]] = (
        "O(R N D B) hash + O(R N log N) sort + O(N R C D) attend",
        "O(N R C) key lists",
    )

    def validate(self) -> None:
        require(
            self.buckets == 1 or (self.buckets >= 2 and self.buckets % 2 == 0),
            f"lsh: buckets must be 1 or an even number >= 2, got {self.buckets}",
        )
        require(self.chunk >= 1, f"lsh: chunk must be >= 1, got {self.chunk}")
        require(self.rounds >= 1, f"lsh: rounds must be >= 1, got {self.rounds}")

    def _round_buckets(self, q: Tensor, k: Tensor, key_padding_mask: Tensor | None):
        """Yield (query buckets [B, H, N], key buckets [B, H, M]) for every round, no gradient."""
        rotations = random_rotations(self.rounds, q.shape[-1], self.buckets, self.seed, q)
        for rotation in rotations:
            key_bucket = key_buckets(k, rotation, self.buckets, key_padding_mask)  # [B, Hk, M]
            yield hash_buckets(q, rotation, self.buckets), repeat_heads(key_bucket, q.shape[1])

    def round_mask(self, query_bucket: Tensor, key_bucket: Tensor) -> Tensor:
        """The definition of one round, densely: [B, H, N], [B, H, M] buckets -> [B, H, N, M] kept."""
        n_queries, n_keys = query_bucket.shape[-1], key_bucket.shape[-1]
        key_pos = torch.arange(n_keys, device=key_bucket.device)
        query_pos = torch.arange(n_queries, device=key_bucket.device)
        same_bucket = query_bucket[..., :, None] == key_bucket[..., None, :]  # [B, H, N, M]
        same_key_bucket = key_bucket[..., :, None] == key_bucket[..., None, :]  # [B, H, M, M]
        key_rank = (same_key_bucket & (key_pos[None, :] < key_pos[:, None])).sum(-1)  # [B, H, M]
        query_rank = (same_bucket & (key_pos[None, :] < query_pos[:, None])).sum(-1)  # [B, H, N]
        key_chunk = (key_rank // self.chunk)[..., None, :]
        query_chunk = (query_rank // self.chunk)[..., :, None]
        return same_bucket & ((key_chunk == query_chunk) | (key_chunk == query_chunk - 1))

    def row_mask(self, q, k, rows, causal, key_padding_mask=None, params=None):
        with torch.no_grad():
            mask = torch.zeros(q.shape[0], q.shape[1], q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device)
            for query_bucket, key_bucket in self._round_buckets(q, k, key_padding_mask):
                mask |= self.round_mask(query_bucket, key_bucket)
            diagonal = torch.arange(min(q.shape[-2], k.shape[-2]), device=q.device)
            mask[..., diagonal, diagonal] = True
            if causal:
                mask &= causal_row_mask(row_slice(q.shape[-2]), k.shape[-2], q.device)
            return mask[..., rows, :]

    def round_indices(self, query_bucket: Tensor, key_bucket: Tensor) -> Tensor:
        """The same round as key lists: [B, H, N, 2C] key positions, -1 unused, in O(N C) memory.

        Keys are sorted by (bucket, position); a query's window is the slots
        [start + (c_i - 1) C, start + (c_i + 1) C) of that order, clipped to its bucket."""
        n_queries, n_keys = query_bucket.shape[-1], key_bucket.shape[-1]
        stride = max(n_queries, n_keys) + 1
        device = key_bucket.device
        key_code = key_bucket * stride + torch.arange(n_keys, device=device)  # [B, H, M]
        sorted_code, order = key_code.sort(dim=-1)
        boundaries = (torch.arange(self.buckets + 1, device=device) * stride).expand(*key_code.shape[:-1], -1)
        bucket_start = torch.searchsorted(sorted_code, boundaries.contiguous())  # [B, H, buckets + 1]
        query_code = query_bucket * stride + torch.arange(n_queries, device=device)  # [B, H, N]
        start = torch.gather(bucket_start, -1, query_bucket)  # [B, H, N]
        stop = torch.gather(bucket_start, -1, query_bucket + 1)
        query_rank = torch.searchsorted(sorted_code, query_code.contiguous()) - start
        first = start + (query_rank // self.chunk - 1) * self.chunk
        slot = first[..., None] + torch.arange(2 * self.chunk, device=device)  # [B, H, N, 2C]
        valid = (slot >= start[..., None]) & (slot < stop[..., None])
        flat_slot = slot.clamp(0, n_keys - 1).flatten(-2)  # [B, H, N*2C]
        picked = torch.gather(order, -1, flat_slot).reshape(slot.shape)
        return torch.where(valid, picked, torch.full_like(picked, -1))

    def key_indices(self, q, k, causal, key_padding_mask, params):
        return lsh_key_lists(q.detach(), k.detach(), self.buckets, self.chunk, self.rounds, self.seed, causal, key_padding_mask)

    def build_key_lists(self, q: Tensor, k: Tensor, causal: bool, key_padding_mask: Tensor | None) -> Tensor:
        """[B, Hq, N, 2 C R + 1] long: every round's key lists, the own position, the causal cut,
        repeats dropped (the body of ``lsh_key_lists``)."""
        with torch.no_grad():
            lists = [self.round_indices(qb, kb) for qb, kb in self._round_buckets(q, k, key_padding_mask)]
            own = own_position(q.shape[-2], k.shape[-2], q.device).expand(*lists[0].shape[:-1], 1)
            one_round = len(lists) == 1  # its slots are distinct keys: only the own position can repeat one
            if one_round:
                own = torch.where((lists[0] == own).any(-1, keepdim=True), torch.full_like(own, -1), own)
            index = torch.cat(lists + [own], dim=-1)  # [B, H, N, 2 C R + 1]
            if causal:
                query_pos = torch.arange(q.shape[-2], device=q.device)[:, None]
                index = torch.where(index > query_pos, torch.full_like(index, -1), index)
            return index if one_round else dedupe_indices(index)


@torch.library.custom_op("sparsefocus::lsh_key_lists", mutates_args=())
def lsh_key_lists(
    q: Tensor, k: Tensor, buckets: int, chunk: int, rounds: int, seed: int, causal: bool, key_padding_mask: Optional[Tensor]
) -> Tensor:
    """``LSH(buckets, chunk, rounds, seed)``'s key lists [B, Hq, N, 2 chunk rounds + 1] long, -1 unused.

    An op, so that torch.compile takes the hashing, sorts and searches as one opaque call of
    PyTorch's own kernels instead of compiling them: with them compiled, LSH was the one pattern
    whose compiled layer was slower than eager on the H200 (12.6 against 8.3 ms at B=2, H=8,
    N=4096, bf16), and they are the only LSH-specific code Inductor compiled. No gradient, no
    host sync."""
    return LSH(buckets, chunk, rounds, seed).build_key_lists(q, k, causal, key_padding_mask)


@lsh_key_lists.register_fake
def _lsh_key_lists_fake(
    q: Tensor, k: Tensor, buckets: int, chunk: int, rounds: int, seed: int, causal: bool, key_padding_mask: Optional[Tensor]
) -> Tensor:
    return q.new_empty((*q.shape[:-1], 2 * chunk * rounds + 1), dtype=torch.long)

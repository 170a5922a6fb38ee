"""Routing attention (Roy et al. 2021, the Routing Transformer): queries and keys are clustered by
spherical k-means and a query attends to keys of its own cluster.

The functional API keeps no state, so the centroids are recomputed on every call: seeded random
unit directions refined by a few Lloyd iterations on the current unit-normalised queries and keys.
Under causality Lloyd iterations would read future tokens, so causal routing uses the seeded
directions alone (a fixed random clustering; the Routing Transformer's EMA-trained centroids are
training state this library does not keep).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor

from sparsefocus.attention.common import DEFAULT_ROW_CHUNK, causal_row_mask, mask_from_indices, row_slice, upcast
from sparsefocus.attention.lsh import dedupe_indices, own_position, repeat_heads
from sparsefocus.attention.patterns import IndexedPattern, register, require


@functools.lru_cache(maxsize=64)
def _centroids_on(clusters: int, dim: int, seed: int, device: torch.device, dtype: torch.dtype) -> Tensor:
    gen = torch.Generator().manual_seed(seed)
    centroids = torch.randn(clusters, dim, generator=gen, dtype=torch.float64)
    return F.normalize(centroids, dim=-1).to(device=device, dtype=dtype)


@torch.compiler.assume_constant_result
def _constant_centroids(clusters: int, dim: int, seed: int, device: torch.device, dtype: torch.dtype) -> Tensor:
    """``_centroids_on`` as a constant of a compiled graph (torch.compile cannot create a Generator)."""
    return _centroids_on(clusters, dim, seed, device, dtype)


def seeded_centroids(clusters: int, dim: int, seed: int, like: Tensor) -> Tensor:
    """[C, D] unit vectors drawn from ``seed`` on a CPU generator (same on every device), in
    ``like``'s compute dtype. Drawn once per device and cached (read-only), as LSH's rotations."""
    dtype = torch.float64 if like.dtype == torch.float64 else torch.float32  # upcast's dtype
    return _constant_centroids(clusters, dim, seed, like.device, dtype)


def lloyd_iterations(points: Tensor, weight: Tensor, centroids: Tensor, iters: int) -> Tensor:
    """Spherical k-means: points [B, H, P, D] (unit), weight [B or 1, 1, P] (0 = ignore the point),
    centroids [.., C, D] -> [B, H, C, D]. An empty cluster keeps its previous centroid."""
    centroids = centroids.expand(*points.shape[:2], *centroids.shape[-2:])
    for _ in range(iters):
        assign = torch.matmul(points, centroids.transpose(-1, -2)).argmax(-1)  # [B, H, P]
        member = F.one_hot(assign, centroids.shape[-2]).to(points.dtype) * weight[..., None]  # [B, H, P, C]
        sums = torch.matmul(member.transpose(-1, -2), points)  # [B, H, C, D]
        count = member.sum(-2)[..., None]  # [B, H, C, 1]
        centroids = torch.where(count > 0, F.normalize(sums, dim=-1), centroids)
    return centroids


def routed_scores(
    query_cluster: Tensor,
    key_cluster: Tensor,
    key_score: Tensor,
    rows: slice,
    causal: bool,
    key_padding_mask: Tensor | None,
) -> Tensor:
    """[B, H, R, M] candidate scores of rows ``rows``: a key's similarity to its centroid where it
    shares the query's cluster and is allowed (causal, unpadded), -inf elsewhere."""
    same = query_cluster[:, :, rows, None] == key_cluster[:, :, None, :]  # [B, H, R, M]
    if causal:
        same = same & causal_row_mask(rows, key_cluster.shape[-1], key_cluster.device)
    if key_padding_mask is not None:
        same = same & key_padding_mask[:, None, None, :]
    return torch.where(same, key_score[:, :, None, :], torch.full_like(same, float("-inf"), dtype=key_score.dtype))


def top_window(scores: Tensor, window: int) -> Tensor:
    """Indices [.., min(window, M)] of the largest entries of [.., M]; -1 where the entry is -inf."""
    values, index = scores.topk(min(window, scores.shape[-1]), dim=-1)
    return torch.where(torch.isinf(values), torch.full_like(index, -1), index)


@register
@dataclass(frozen=True)
class Routing(IndexedPattern):
    """``routing:clusters=C,window=W,iters=I,seed=S``: k-means routing attention.

    Centroids: C seeded unit directions, then (non-causal only) I Lloyd iterations over the
    unit-normalised queries and real keys. Each query and key joins its most similar centroid.
    Query i keeps, among the allowed keys of its own cluster (causal: j <= i), the W keys most
    similar to that centroid, plus its own position (j = i, if i < M) so that no row is empty.
    Non-causal, all queries of a cluster share one key set: the cluster's W keys nearest to its
    centroid, as in the Routing Transformer's balanced windows.
    """

    clusters: int = 4
    window: int = 16
    iters: int = 2
    seed: int = 0
    examples: ClassVar[tuple[str, ...]] = ("routing:clusters=3,window=8", "routing:clusters=2,window=40,iters=0")
    name: ClassVar[str] = "routing"
    aliases: ClassVar[tuple[str, ...]] = ("routing_transformer", "kmeans")
    positional: ClassVar[tuple[str, ...]] = ("clusters", "window", "iters")
    field_aliases: ClassVar[dict[str, str]] = {"n_clusters": "clusters", "window_size": "window"}
    input_dependent: ClassVar[bool] = True
    family: ClassVar[str] = "heavy hitters"
    needs_square: ClassVar[bool] = False
    cost: ClassVar[tuple[str, str]] = (
        "O(I (N+M) C D) k-means + O(C M) window (causal: O(N M)) + O(N W D) attend",
        "O((N+M) C + N W); causal O(chunk M) selection",
    )

    def validate(self) -> None:
        require(self.clusters >= 1, f"routing: clusters must be >= 1, got {self.clusters}")
        require(self.window >= 1, f"routing: window must be >= 1, got {self.window}")
        require(self.iters >= 0, f"routing: iters must be >= 0, got {self.iters}")

    def centroids(self, q_unit: Tensor, k_unit: Tensor, causal: bool, key_padding_mask: Tensor | None) -> Tensor:
        """[B, H, C, D] or [C, D] unit centroids; Lloyd iterations only when not causal."""
        init = seeded_centroids(self.clusters, q_unit.shape[-1], self.seed, q_unit)
        if causal or self.iters == 0:
            return init
        points = torch.cat([q_unit, k_unit], dim=-2)  # [B, H, N + M, D]
        key_weight = torch.ones(1, k_unit.shape[-2], device=q_unit.device)
        if key_padding_mask is not None:
            key_weight = key_padding_mask.to(q_unit.dtype)
        query_weight = torch.ones(key_weight.shape[0], q_unit.shape[-2], device=q_unit.device)
        weight = torch.cat([query_weight, key_weight], dim=-1)[:, None].to(q_unit.dtype)  # [B or 1, 1, N + M]
        return lloyd_iterations(points, weight, init, self.iters)

    def assign(self, q: Tensor, k: Tensor, causal: bool, key_padding_mask: Tensor | None):
        """Query clusters [B, H, N], key clusters [B, H, M] and key-to-centroid similarity [B, H, M]."""
        with torch.no_grad():
            q_unit = F.normalize(upcast(q), dim=-1)
            k_unit = repeat_heads(F.normalize(upcast(k), dim=-1), q.shape[1])
            centroids = self.centroids(q_unit, k_unit, causal, key_padding_mask)
            query_cluster = torch.matmul(q_unit, centroids.transpose(-1, -2)).argmax(-1)
            key_score, key_cluster = torch.matmul(k_unit, centroids.transpose(-1, -2)).max(-1)
            return query_cluster, key_cluster, key_score

    def row_mask(self, q, k, rows, causal, key_padding_mask=None, params=None):
        query_cluster, key_cluster, key_score = self.assign(q, k, causal, key_padding_mask)
        scores = routed_scores(query_cluster, key_cluster, key_score, rows, causal, key_padding_mask)
        own = own_position(q.shape[-2], k.shape[-2], q.device)[:, :, rows]
        index = torch.cat([top_window(scores, self.window), own.expand(*scores.shape[:-1], 1)], dim=-1)
        return mask_from_indices(index, k.shape[-2])

    def key_indices(self, q, k, causal, key_padding_mask, params, chunk: int = DEFAULT_ROW_CHUNK):
        query_cluster, key_cluster, key_score = self.assign(q, k, causal, key_padding_mask)
        if causal:
            index = self._causal_windows(query_cluster, key_cluster, key_score, key_padding_mask, chunk)
        else:
            index = self._cluster_windows(query_cluster, key_cluster, key_score, key_padding_mask)
        own = own_position(q.shape[-2], k.shape[-2], q.device).expand(*index.shape[:-1], 1)
        return dedupe_indices(torch.cat([index, own], dim=-1))

    def _causal_windows(self, query_cluster, key_cluster, key_score, key_padding_mask, chunk: int) -> Tensor:
        """Causal: each query's W best earlier keys of its cluster, by query chunks -> [B, H, N, W]."""
        n_queries = query_cluster.shape[-1]
        parts = []
        for start in range(0, n_queries, chunk):
            rows = row_slice(n_queries, start, start + chunk)
            scores = routed_scores(query_cluster, key_cluster, key_score, rows, True, key_padding_mask)  # [B, H, R, M]
            parts.append(top_window(scores, self.window))
        return torch.cat(parts, dim=-2)

    def _cluster_windows(self, query_cluster, key_cluster, key_score, key_padding_mask) -> Tensor:
        """Non-causal: each cluster's W best keys, once per cluster, then read by its queries -> [B, H, N, W]."""
        cluster_id = torch.arange(self.clusters, device=key_cluster.device)
        member = key_cluster[:, :, None, :] == cluster_id[:, None]  # [B, H, C, M]
        if key_padding_mask is not None:
            member = member & key_padding_mask[:, None, None, :]
        scores = torch.where(member, key_score[:, :, None, :], torch.full_like(key_score[:, :, None, :], float("-inf")))
        windows = top_window(scores, self.window)  # [B, H, C, W]
        lookup = query_cluster[..., None].expand(*query_cluster.shape, windows.shape[-1])
        return torch.gather(windows, 2, lookup)  # [B, H, N, W]

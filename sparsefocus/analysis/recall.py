"""Top-k recall of approximate selectors (ZETA, LSH, routing, block top-k, any pattern).

Recall of one query = |kept keys & exact top-k keys| / |exact top-k keys|, where the exact top-k
is taken among the keys the query may pick (causal cut, padding) by the score the selector
approximates: the pattern's class variable ``score`` when it declares one (distance scores
"neg_sqeuclid"/"cauchy" rank by -||q - k||^2), -||q - k||^2 for ZETA (its Z-order search looks
for nearest keys), else the dot product. k is the
pattern's field ``k`` when it has one, else the mean number of keys the selector keeps per query.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from sparsefocus.analysis.hooks import AttentionCall
from sparsefocus.analysis.statistics import percentiles
from sparsefocus.attention.patterns import Pattern

DISTANCE_SCORES = ("neg_sqeuclid", "cauchy")
RECALL_PERCENTILES = (50, 25, 10, 5)


def selector_score(pattern: Pattern) -> str:
    """The score a pattern ranks keys by: its ``score`` class variable ("dot" by default)."""
    return str(getattr(pattern, "score", "dot"))


def ranking_scores(q: Tensor, k: Tensor, score: str = "dot") -> Tensor:
    """Higher = better. q [B, H, N, D], k [B, H, M, D] -> [B, H, N, M] fp32: q.k for "dot",
    -||q - k||^2 for distance scores."""
    q, k = q.float(), k.float()
    if score == "dot":
        return torch.matmul(q, k.transpose(-1, -2))  # [B, H, N, M]
    if score in DISTANCE_SCORES:
        return -torch.cdist(q, k).pow(2)  # [B, H, N, M]
    raise ValueError(f"unknown selector score {score!r}; valid: dot, {', '.join(DISTANCE_SCORES)}")


def exact_topk_mask(scores: Tensor, allowed: Tensor, count: int) -> Tensor:
    """[..., N, M] bool: each row's ``count`` highest scores among the allowed keys (all allowed
    keys when fewer). Ties are broken by ``torch.topk``."""
    if count < 1:
        raise ValueError(f"top-k recall needs k >= 1, got {count}")
    allowed = allowed.expand_as(scores)
    masked = scores.masked_fill(~allowed, float("-inf"))
    _, index = masked.topk(min(count, scores.shape[-1]), dim=-1)
    top = torch.zeros_like(allowed).scatter_(-1, index, True)
    # slots that fell on -inf are disallowed keys of rows with fewer than count allowed keys
    return top & allowed


def topk_recall(kept: Tensor, exact: Tensor) -> Tensor:
    """Per query: share of the exact top-k that ``kept`` contains. [..., N, M] bool x2 -> [..., N]
    fp32, NaN for a query with no allowed key."""
    hits = (kept & exact).sum(-1).float()
    total = exact.sum(-1).float()
    return torch.where(total > 0, hits / total.clamp_min(1), torch.full_like(hits, float("nan")))


def selector_size(pattern: Pattern, kept: Tensor) -> int:
    """The k to compare against: the pattern's ``k`` field, else the mean kept keys per query (>= 1)."""
    k = getattr(pattern, "k", None)
    if isinstance(k, int) and k >= 1:
        return k
    return max(1, round(kept.sum(-1).float().mean().item()))


def call_recall(call: AttentionCall, count: int | None = None) -> tuple[Tensor, int]:
    """Recall per query [B, H, N] of one layer call, and the k used."""
    kept, allowed = call.kept(), call.allowed()
    count = selector_size(call.module.pattern, kept) if count is None else count
    scores = ranking_scores(call.q, call.k, selector_score(call.module.pattern))
    return topk_recall(kept, exact_topk_mask(scores, allowed, count)), count


@dataclass
class RecallStatistics:
    """Collects per-layer top-k recall over hooked forward calls (use as a ``capture_attention`` callback)."""

    count: int | None = None
    values: dict[str, list[np.ndarray]] = field(default_factory=lambda: defaultdict(list))
    sizes: dict[str, int] = field(default_factory=dict)

    def __call__(self, call: AttentionCall) -> None:
        recall, used = call_recall(call, self.count)
        self.values[call.layer].append(recall.reshape(-1).cpu().numpy())
        self.sizes[call.layer] = used

    def summary(self) -> dict:
        """``{"k": {layer: k}, "pooled": {"mean", "p50", ...}, "per_layer": {layer: {...}}}``."""

        def describe(array: np.ndarray) -> dict[str, float]:
            finite = array[np.isfinite(array)]
            mean = float(finite.mean()) if finite.size else float("nan")
            return {"mean": mean, **percentiles(array, RECALL_PERCENTILES)}

        per_layer = {layer: describe(np.concatenate(chunks)) for layer, chunks in self.values.items()}
        pooled = describe(np.concatenate([np.concatenate(c) for c in self.values.values()])) if self.values else {}
        return {"k": dict(self.sizes), "pooled": pooled, "per_layer": per_layer}

"""Statistics of attention scores: semantic dispersion, separation and sink counts.

Definitions follow the Semantic Focus paper's code (``was.py``, ``bounds-lhs.py``), for scores
s_ij = <q_i, k_j> * scale of one layer and the boolean mask of the keys each query keeps:

- dispersion of query i = max_j s_ij - min_j s_ij over its kept keys (the "heavy-hitter"
  dispersion delta_h for a sparse model); over every allowed key it is the full dispersion delta_s;
- separation of query i = min over kept s_ij - max over allowed-but-dropped s_ij (for TOPK the
  k-th minus the (k+1)-th score); reported percentiles are floored at 1e-9 as in the paper;
- sink count beta_j = number of queries that keep key j (a column sum of the mask); the sink
  ratio is beta / k.

Values are pooled over batch, heads, queries and layers; rows where a statistic is undefined
(no kept key, or nothing dropped) are NaN and left out of the percentiles.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

HIGH_PERCENTILES = (75, 90, 95, 100)
LOW_PERCENTILES = (25, 10, 5, 0)
SEPARATION_FLOOR = 1e-9
METRICS = ("full_dispersion", "dispersion", "separation", "sinks", "sink_ratio")


def attention_scores(q: Tensor, k: Tensor, scale: float | None = None) -> Tensor:
    """Scaled dot products in fp32: q [B, H, N, D], k [B, H, M, D] -> [B, H, N, M].

    scale defaults to 1/sqrt(D), the scale ``sparse_attention`` uses.
    """
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale  # [B, H, N, M]


def _check_mask(scores: Tensor, mask: Tensor, name: str) -> Tensor:
    if mask.dtype != torch.bool:
        raise ValueError(f"{name} must be a bool tensor, got {mask.dtype}")
    try:
        return mask.expand_as(scores)
    except RuntimeError:
        raise ValueError(f"{name} of shape {list(mask.shape)} does not fit scores {list(scores.shape)}") from None


def _row_max(scores: Tensor, mask: Tensor) -> Tensor:
    return scores.masked_fill(~mask, float("-inf")).amax(dim=-1)


def _row_min(scores: Tensor, mask: Tensor) -> Tensor:
    return scores.masked_fill(~mask, float("inf")).amin(dim=-1)


def dispersion(scores: Tensor, kept: Tensor) -> Tensor:
    """Semantic dispersion per query: max - min of the kept scores.

    Args:
        scores: [..., N, M] float. kept: bool, broadcastable to scores; True = the query keeps the key.
    Returns:
        [..., N] fp32; NaN for a query that keeps no key, 0 for one that keeps a single key.
    """
    kept = _check_mask(scores, kept, "kept")
    scores = scores.float()
    spread = _row_max(scores, kept) - _row_min(scores, kept)
    return torch.where(kept.any(dim=-1), spread, torch.full_like(spread, float("nan")))


def full_dispersion(scores: Tensor, allowed: Tensor | None = None) -> Tensor:
    """Dispersion over every allowed key (all keys when ``allowed`` is None): [..., N, M] -> [..., N]."""
    allowed = torch.ones_like(scores, dtype=torch.bool) if allowed is None else allowed
    return dispersion(scores, allowed)


def separation(scores: Tensor, kept: Tensor, allowed: Tensor | None = None) -> Tensor:
    """Semantic separation per query: min kept score - max dropped score.

    Args:
        scores: [..., N, M]. kept: bool like scores. allowed: bool, the keys the query could
            have picked (causal cut, padding); default all. Kept keys outside ``allowed`` count as kept.
    Returns:
        [..., N] fp32, not floored (negative when a dropped key scores higher than a kept one,
        as for input-agnostic patterns); NaN where the query keeps nothing or drops nothing.
    """
    kept = _check_mask(scores, kept, "kept")
    allowed = kept.new_ones(()) if allowed is None else allowed
    dropped = _check_mask(scores, allowed, "allowed") & ~kept
    scores = scores.float()
    gap = _row_min(scores, kept) - _row_max(scores, dropped)
    defined = kept.any(dim=-1) & dropped.any(dim=-1)
    return torch.where(defined, gap, torch.full_like(gap, float("nan")))


def sink_counts(kept: Tensor) -> Tensor:
    """beta: for each key, how many queries keep it. kept [..., N, M] bool -> [..., M] int64."""
    if kept.dtype != torch.bool:
        raise ValueError(f"kept must be a bool tensor, got {kept.dtype}")
    return kept.sum(dim=-2)


def percentiles(values: np.ndarray | Tensor, qs: tuple[float, ...], floor: float | None = None) -> dict[str, float]:
    """Percentiles (numpy's linear interpolation) of the finite entries, keyed ``"p75"``...

    A statistic with no finite value gives NaN. ``floor`` clamps each percentile from below.
    """
    array = values.detach().cpu().numpy() if isinstance(values, Tensor) else np.asarray(values)
    array = array[np.isfinite(array)].astype(np.float64)
    out = {}
    for q in qs:
        value = float(np.percentile(array, q)) if array.size else float("nan")
        out[f"p{q:g}"] = max(value, floor) if floor is not None and np.isfinite(value) else value
    return out


def metric_percentiles(metric: str, values: np.ndarray | Tensor) -> dict[str, float]:
    """The paper's percentiles for a metric: 25/10/5/0 floored at 1e-9 for separation, else 75/90/95/100."""
    if metric == "separation":
        return percentiles(values, LOW_PERCENTILES, floor=SEPARATION_FLOOR)
    return percentiles(values, HIGH_PERCENTILES)


@dataclass
class ScoreStatistics:
    """Accumulates dispersion, separation and sink counts per layer, then summarises them.

    ``keys_per_query`` is the k of the sink ratio beta / k (the paper hard-codes its k=5); None
    uses the mean number of kept keys per query of each batch.
    """

    keys_per_query: int | None = None
    values: dict[str, dict[str, list[np.ndarray]]] = field(default_factory=lambda: defaultdict(lambda: defaultdict(list)))

    def add(
        self, layer: str, scores: Tensor, kept: Tensor, allowed: Tensor | None = None, keys_per_query: int | None = None
    ) -> None:
        """Add one layer's batch: scores [B, H, N, M], kept / allowed bool broadcastable to it;
        ``keys_per_query`` overrides the sink-ratio k for this layer."""
        kept = _check_mask(scores, kept, "kept")
        allowed = torch.ones_like(kept) if allowed is None else _check_mask(scores, allowed, "allowed")
        sinks = sink_counts(kept).float()
        # a key no query may see (padding) is not a sink of count 0: leave it out
        sinks = torch.where(allowed.any(dim=-2), sinks, torch.full_like(sinks, float("nan")))
        per_query = keys_per_query or self.keys_per_query or max(kept.sum(-1).float().mean().item(), 1e-9)
        measured = {
            "full_dispersion": full_dispersion(scores, allowed),
            "dispersion": dispersion(scores, kept),
            "separation": separation(scores, kept, allowed),
            "sinks": sinks,
            "sink_ratio": sinks / per_query,
        }
        for metric, tensor in measured.items():
            self.values[metric][layer].append(tensor.detach().reshape(-1).cpu().numpy())

    def layers(self) -> list[str]:
        """Layer names in the order they were first added."""
        return list(self.values["dispersion"])

    def pooled(self, metric: str) -> np.ndarray:
        """Every value of a metric, all layers together."""
        parts = [np.concatenate(chunks) for chunks in self.values[metric].values()]
        return np.concatenate(parts) if parts else np.zeros(0)

    def summary(self) -> dict:
        """``{"pooled": {metric: {"p75": ...}}, "per_layer": {layer: {metric: {...}}}}``.

        Besides ``METRICS`` it gives ``separation_raw``: the separation percentiles before the
        1e-9 floor (negative when dropped keys outscore kept ones)."""
        pooled = self._describe({metric: self.pooled(metric) for metric in METRICS})
        per_layer = {
            layer: self._describe({metric: np.concatenate(self.values[metric][layer]) for metric in METRICS})
            for layer in self.layers()
        }
        return {"pooled": pooled, "per_layer": per_layer}

    @staticmethod
    def _describe(arrays: dict[str, np.ndarray]) -> dict[str, dict[str, float]]:
        out = {metric: metric_percentiles(metric, values) for metric, values in arrays.items()}
        out["separation_raw"] = percentiles(arrays["separation"], LOW_PERCENTILES)
        return out

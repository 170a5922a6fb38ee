"""Log-sum-exp of each row's kept scores, returned beside the output by ``return_lse=True``.

For softmax mechanisms the output of a row is sum_j softmax(s)_j v_j over its kept keys, so
(out, lse) over two disjoint key sets merge exactly into the result over their union::

    lse = logaddexp(lse_a, lse_b)
    out = exp(lse_a - lse) * out_a + exp(lse_b - lse) * out_b

(``merge_partials``), which is how split-KV decoding and ring attention combine partial results.
The lse is defined from the same ``row_mask`` as the reference, in fp32, natural log, -inf for
rows that keep no key. Mechanisms with another normaliser (sparsemax, entmax, ZETA's Cauchy
weights, a gate) have no such quantity and are refused.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from sparsefocus.attention.common import (
    DEFAULT_ROW_CHUNK,
    apply_key_padding,
    expand_kv,
    upcast,
)
from sparsefocus.attention.patterns import IndexedPattern, Pattern


def check_lse_support(spec: Pattern) -> None:
    """Raise ValueError unless the pattern normalises with a softmax over its kept keys."""
    normaliser = getattr(spec, "normaliser", "softmax")
    if normaliser != "softmax":
        raise ValueError(
            f"return_lse needs a softmax mechanism; pattern {spec.label()} normalises with {normaliser}, which has no log-sum-exp"
        )


def masked_logsumexp(scores: Tensor, mask: Tensor) -> Tensor:
    """logsumexp over the kept entries of the last dim of scores [.., M] (mask broadcastable);
    -inf for rows with none, with zero (not NaN) gradient there."""
    mask = mask.expand_as(scores)
    row_has_key = mask.any(dim=-1)
    safe = scores.masked_fill(~mask, float("-inf")).masked_fill(~row_has_key[..., None], 0.0)
    return torch.where(row_has_key, torch.logsumexp(safe, dim=-1), torch.full_like(safe[..., 0], float("-inf")))


def rows_lse(
    spec: Pattern,
    q: Tensor,
    k: Tensor,
    rows: slice,
    *,
    causal: bool,
    scale: float,
    key_padding_mask: Tensor | None,
    params: dict[str, Tensor] | None,
) -> Tensor:
    """[B, H, len(rows)] fp32 lse of the rows ``rows`` of q [B, H, N, D] over k [B, H, M, D]."""
    mask = apply_key_padding(spec.row_mask(q, k, rows, causal, key_padding_mask, params), key_padding_mask)
    scores = torch.matmul(upcast(q[:, :, rows]), upcast(k).transpose(-1, -2)) * scale  # [B, H, C, M]
    return masked_logsumexp(scores, mask)


def attention_lse(
    spec: Pattern,
    q: Tensor,
    k: Tensor,
    *,
    causal: bool,
    scale: float,
    key_padding_mask: Tensor | None,
    params: dict[str, Tensor] | None,
    first_row: int = 0,
    chunk: int | None = DEFAULT_ROW_CHUNK,
) -> Tensor:
    """lse [B, H, N - first_row] of the rows first_row.. of q [B, H, N, D] (GQA expanded).

    ``chunk=None`` computes all rows at once (the reference); otherwise rows are chunked and
    recomputed in the backward, so memory is O(chunk M).
    """
    n_rows = q.shape[2]
    step = n_rows if chunk is None else chunk
    kwargs: dict[str, Any] = {"causal": causal, "scale": scale, "key_padding_mask": key_padding_mask, "params": params}
    parts = []
    for start in range(first_row, n_rows, max(step, 1)):
        rows = slice(start, min(start + step, n_rows))
        if chunk is not None and torch.is_grad_enabled():
            parts.append(checkpoint(lambda r: rows_lse(spec, q, k, r, **kwargs), rows, use_reentrant=False))
        else:
            parts.append(rows_lse(spec, q, k, rows, **kwargs))
    if not parts:
        return q.new_zeros(q.shape[0], q.shape[1], 0, dtype=torch.float32)
    return torch.cat(parts, dim=2).float()


def triton_with_lse(
    spec: Pattern,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    causal: bool,
    scale: float,
    key_padding_mask: Tensor | None,
    params: dict[str, Tensor] | None,
) -> tuple[Tensor, Tensor]:
    """(out, lse) from the indexed-attention kernel's ``return_lse`` for dot-product key-list
    patterns; the first g (global) rows are dense. q [B, Hq, N, D]; k, v [B, Hk, M, *]."""
    from sparsefocus.kernels.indexed import indexed_attention

    if not isinstance(spec, IndexedPattern) or spec.score != "dot":
        raise ValueError(
            f"return_lse with impl='triton' needs a dot-product key-list softmax pattern; "
            f"pattern {spec.label()} is not one: use impl='lean' or 'reference'"
        )
    k_full = expand_kv(k, q.shape[1])
    index = spec.indices(q, k_full, causal, key_padding_mask, params)
    out, lse = indexed_attention(q, k, v, index, scale=scale, score="dot", return_lse=True)
    out = spec._global_rows_dense(q, k, v, out, causal, scale, key_padding_mask)
    g = min(spec.num_global_tokens, q.shape[2])
    if g:
        kwargs: dict[str, Any] = {"causal": causal, "scale": scale, "key_padding_mask": key_padding_mask, "params": params}
        lse = torch.cat([rows_lse(spec, q, k_full, slice(0, g), **kwargs), lse[:, :, g:].float()], dim=2)
    return out, lse.float()


def merge_partials(out_a: Tensor, lse_a: Tensor, out_b: Tensor, lse_b: Tensor) -> tuple[Tensor, Tensor]:
    """Combine two partial results over disjoint key sets: outs [B, H, N, Dv], lses [B, H, N].

    Rows empty in both stay zero with lse -inf.
    """
    lse = torch.logaddexp(lse_a, lse_b)
    finite = torch.isfinite(lse)
    safe = torch.where(finite, lse, torch.zeros_like(lse))
    weight_a = torch.where(finite, torch.exp(lse_a - safe), torch.zeros_like(lse))[..., None]
    weight_b = torch.where(finite, torch.exp(lse_b - safe), torch.zeros_like(lse))[..., None]
    return weight_a * upcast(out_a) + weight_b * upcast(out_b), lse

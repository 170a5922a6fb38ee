"""Bottom-right causal alignment: N queries that are the *last* N of M positions (decoding).

With ``causal=True`` and N < M, query i (0-based among the N) sits at position i + (M - N) and
sees the keys j <= i + (M - N), as FlashAttention aligns it. Such a call is defined as the last N
rows of the square causal call over M positions whose first M - N queries are never looked at::

    keys    0 1 2 3 4 5          N = 2 queries, M = 6 keys
    query 0 x x x x x .          (position 4)
    query 1 x x x x x x          (position 5)

Every registered mechanism computes a row from its own query, the keys and positions only (no
statistic over other queries under causality), so the rows do not depend on the padding queries.
``replay`` runs the mechanism on that padded square and keeps the last N rows (exact for every
path, O(M) rows of work); ``rows`` evaluates only the N rows (softmax mechanisms on the lean
path). Within ``rows``, the cheapest form the pattern allows:

- FULL: SDPA with a bottom-right mask;
- rows that are runs of keys (``packed_runs``: BAND, BLOC without global tokens): SDPA on the
  keys of the N rows' runs only, O(N W) for a window of W keys, whatever M is;
- rows given as key lists (``row_indices``: TOPK, BOTK): the selection reads every key, the
  attention only the k listed ones (no pass over all values);
- any other: ``row_mask`` in row chunks, O(N M) time, O(chunk M) memory.

On the Triton path a pattern whose ``triton_decodes()`` computes the N rows in Triton (TOPK:
a split-key selection, then the indexed kernel); the others replay the square call.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from sparsefocus.attention.common import (
    masked_sdpa,
    DEFAULT_ROW_CHUNK,
    apply_key_padding,
    dense_masked_attention,
    expand_kv,
    indexed_attention_ref,
)
from sparsefocus.attention.full import Full
from sparsefocus.attention.patterns import Pattern

DECODING_MODES = ("rows", "replay", "none")


def is_decoding(n_queries: int, n_keys: int, causal: bool) -> bool:
    """True for a causal call with fewer queries than keys (queries are the last positions)."""
    return causal and n_queries < n_keys


def check_alignment(spec: Pattern, n_queries: int, n_keys: int, causal: bool) -> bool:
    """Validate the sizes; return True when the call is bottom-right aligned (decoding).

    Raises:
        ValueError: causal with more queries than keys, or a pattern that cannot decode.
    """
    if causal and n_queries > n_keys:
        raise ValueError(
            f"causal attention needs at most as many queries as keys (the queries are the last "
            f"positions), got {n_queries} queries and {n_keys} keys"
        )
    if not is_decoding(n_queries, n_keys, causal):
        spec.check_sizes(n_queries, n_keys, causal)
        return False
    if decoding_mode(spec) == "none":
        raise ValueError(
            f"pattern {spec.label()} does not support causal attention with fewer queries ({n_queries}) "
            f"than keys ({n_keys}); run it on the whole sequence"
        )
    spec.check_sizes(n_keys, n_keys, True)
    return True


def decoding_mode(spec: Pattern) -> str:
    """How ``spec`` decodes: its ``decoding`` class variable, or ``replay`` when it redefines the
    reference (a weighting other than softmax over ``row_mask``)."""
    mode = getattr(spec, "decoding", "rows")
    if mode not in DECODING_MODES:
        raise ValueError(f"pattern {spec.name}: decoding must be one of {', '.join(DECODING_MODES)}, got {mode!r}")
    if mode == "rows" and type(spec).reference is not Pattern.reference:
        return "replay"
    return mode


def padded_queries(q: Tensor, n_keys: int) -> Tensor:
    """q [B, H, N, D] -> [B, H, M, D] with M - N zero rows in front: the queries at positions
    M - N .. M - 1 of a square causal call."""
    pad = q.new_zeros(q.shape[0], q.shape[1], n_keys - q.shape[2], q.shape[3])
    return torch.cat([pad, q], dim=2)


def query_rows(n_queries: int, n_keys: int, chunk: int | None) -> list[slice]:
    """Row slices (positions in the padded square) covering the last ``n_queries`` rows."""
    start = n_keys - n_queries
    step = n_queries if chunk is None else chunk
    return [slice(s, min(s + step, n_keys)) for s in range(start, n_keys, step)]


def bottom_right_mask(n_queries: int, n_keys: int, device: torch.device) -> Tensor:
    """[N, M] bool: query i keeps key j iff j <= i + (M - N)."""
    query_pos = torch.arange(n_keys - n_queries, n_keys, device=device)
    return torch.arange(n_keys, device=device)[None, :] <= query_pos[:, None]


def decode_attention(
    spec: Pattern,
    impl: str,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    scale: float,
    key_padding_mask: Tensor | None,
    params: dict[str, Tensor] | None,
) -> Tensor:
    """Bottom-right causal attention of q [B, Hq, N, D] over k, v [B, Hk, M, *], N < M.

    ``impl`` is the resolved implementation. GQA: FULL (SDPA's ``enable_gqa``), a window (its
    keys only), listed rows (TOPK, BOTK) and the Triton paths read the Hk heads as they are; the
    other paths get them repeated to Hq here. Returns [B, Hq, N, Dv].
    """
    n_queries, n_keys = q.shape[2], k.shape[2]
    mode = decoding_mode(spec)
    if impl == "lean" and mode == "rows" and key_padding_mask is None:
        if isinstance(spec, Full):
            mask = None if n_queries == 1 else bottom_right_mask(n_queries, n_keys, q.device)  # one row sees every key
            if mask is None:
                return F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=k.shape[1] != q.shape[1])
            return masked_sdpa(q, k, v, mask, scale=scale, enable_gqa=k.shape[1] != q.shape[1])
        window = key_window(spec, n_queries, n_keys)
        if window is not None:
            return window_attention(spec, q, k, v, window, scale=scale)
    if impl == "lean" and mode == "rows" and hasattr(spec, "row_indices"):  # lists and their attention read kv heads as they are
        return listed_rows_attention(spec, q, k, v, scale=scale, key_padding_mask=key_padding_mask, params=params)
    if impl == "triton" and spec.triton_decodes():
        return spec.triton_decode(q, k, v, scale=scale, key_padding_mask=key_padding_mask, params=params)
    if impl != "triton" and spec.expands_kv:
        k, v = expand_kv(k, q.shape[1]), expand_kv(v, q.shape[1])
    if impl == "lean" and mode == "rows":
        return rows_attention(spec, q, k, v, scale=scale, key_padding_mask=key_padding_mask, params=params)
    run = getattr(spec, impl)
    out = run(padded_queries(q, n_keys), k, v, causal=True, scale=scale, key_padding_mask=key_padding_mask, params=params)
    return out[:, :, n_keys - n_queries :]


def _runs(spec: Pattern, n_queries: int, n_keys: int, device: torch.device) -> tuple[Tensor, Tensor] | None:
    """(first [N], end [N]) key positions of the last N rows' runs, cut at each row's position
    (causal), or None when the pattern's rows are not runs (``packed_runs``)."""
    position = torch.arange(n_keys - n_queries, n_keys, device=device)  # [N]
    runs = spec.packed_runs(position, torch.full_like(position, n_keys), True)
    if runs is None:
        return None
    first, count = runs
    return first, torch.minimum(first + count, position + 1)


class KeyWindow(NamedTuple):
    """The keys [lo, hi) that the last N rows read; ``whole``: every row keeps all of them;
    ``nonempty``: every row keeps at least one."""

    lo: int
    hi: int
    whole: bool
    nonempty: bool


def key_window(spec: Pattern, n_queries: int, n_keys: int) -> KeyWindow | None:
    """The window of keys the last N rows read, from the sizes alone (on the host, so no device
    read), or None when the pattern's rows are not runs of keys."""
    runs = _runs(spec, n_queries, n_keys, torch.device("cpu"))
    if runs is None:
        return None
    first, end = runs
    lo, hi = int(first.min()), int(end.max())
    return KeyWindow(lo, hi, bool((first == lo).all() and (end == hi).all()), bool((end > first).all()))


def window_attention(spec: Pattern, q: Tensor, k: Tensor, v: Tensor, window: KeyWindow, *, scale: float) -> Tensor:
    """The last N rows of a pattern whose rows are runs of keys, computed on the keys [lo, hi) of
    those runs only (``window``, from ``key_window``). q: [B, Hq, N, D]; k, v: [B, Hk, M, *] (only
    the window's keys are repeated for GQA) -> [B, Hq, N, Dv].

    One SDPA call on the window (with no mask when every row keeps the whole window, as one
    decoded token of BAND does), so a decoding step costs a few launches whatever M is; rows
    with no key (zero by definition, NaN in SDPA) take the fp32 masked form.
    """
    keys_k = expand_kv(k[:, :, window.lo : window.hi], q.shape[1])  # [B, Hq, W, D]
    keys_v = expand_kv(v[:, :, window.lo : window.hi], q.shape[1])
    if window.whole:
        return F.scaled_dot_product_attention(q, keys_k, keys_v, scale=scale)
    runs = _runs(spec, q.shape[2], k.shape[2], q.device)
    assert runs is not None, f"{spec.label()} has no runs of keys"
    first, end = runs
    keys = torch.arange(window.lo, window.hi, device=q.device)  # [W]
    mask = (keys[None, :] >= first[:, None]) & (keys[None, :] < end[:, None])  # [N, W]
    if window.nonempty:
        return masked_sdpa(q, keys_k, keys_v, mask, scale=scale)
    return dense_masked_attention(q, keys_k, keys_v, mask, scale)


def listed_rows_attention(
    spec: Pattern,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    scale: float,
    key_padding_mask: Tensor | None,
    params: dict[str, Tensor] | None,
    chunk: int = DEFAULT_ROW_CHUNK,
) -> Tensor:
    """The last N rows of a pattern that lists each row's keys (``row_indices``): the lists in
    row chunks (no gradient), then attention over the listed keys only (O(N k) memory).
    q: [B, Hq, N, D]; k, v: [B, Hk, M, *] (query head h reads kv head h // (Hq // Hk); nothing is
    repeated) -> [B, Hq, N, Dv] fp32."""
    full_q = padded_queries(q, k.shape[2])
    select = spec.row_indices  # type: ignore[attr-defined]  # the caller checked that the pattern has it
    parts = [select(full_q, k, rows, True, key_padding_mask, params) for rows in query_rows(q.shape[2], k.shape[2], chunk)]
    return indexed_attention_ref(q, k, v, torch.cat(parts, dim=2), scale=scale)


def rows_attention(
    spec: Pattern,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    scale: float,
    key_padding_mask: Tensor | None,
    params: dict[str, Tensor] | None,
    chunk: int = DEFAULT_ROW_CHUNK,
) -> Tensor:
    """Softmax over ``row_mask`` for the last N rows only, in row chunks recomputed in the
    backward (memory O(chunk M)). q: [B, H, N, D]; k, v: [B, H, M, *] (GQA expanded)."""
    full_q = padded_queries(q, k.shape[2])

    def one_chunk(rows: slice) -> Tensor:
        mask = apply_key_padding(spec.row_mask(full_q, k, rows, True, key_padding_mask, params), key_padding_mask)
        return dense_masked_attention(full_q[:, :, rows], k, v, mask, scale)

    outs = []
    for rows in query_rows(q.shape[2], k.shape[2], chunk):
        outs.append(checkpoint(one_chunk, rows, use_reentrant=False) if torch.is_grad_enabled() else one_chunk(rows))
    return torch.cat(outs, dim=2)

"""ZETA's decoding cache: one new query per step without re-sorting the keys.

A causal ZETA call over M keys lets query i search the Z-order-sorted keys before its chunk,
``[0, p)`` with p = floor(i / s) * s and s = ceil(M / chunks), plus a band of the ``local`` most
recent keys of its own chunk and the mean of keys 0..i (``zeta.select_keys``, ``Zeta._attend``).
Decoding defines the new token's output as the last row of that call over all M keys
(``decode.py``). For the last row p only grows with M, so ``ZetaCache`` keeps, besides the keys
and values, the sorted codes of the searchable keys ``[0, p)`` and the fp32 sums of all keys and
values. A step merges the few keys that entered the searchable prefix into the sorted codes (a
search per key, no sort), searches the query's code (O(log M)), ranks its window and band
candidates and attends over them and the running mean: the other M - 1 rows are never computed.
It still appends the new key and value to the cache tensors (one copy of the cache, as every
KV cache built with ``torch.cat``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from sparsefocus.attention.common import indexed_attention_ref, upcast
from sparsefocus.attention.zeta import Zeta, _codes, _local_band, _nearest, _window_candidates, code_bits


@dataclass
class ZetaCache:
    """A ZETA layer's KV cache after M positions; it reads as ``(k, v)`` like a plain cache.

    k: [B, Hk, M, D]; v: [B, Hk, M, Dv]; sorted_codes, order: [S, B, Hk, P] the Morton codes of
    keys 0..P-1 on each of the S curves in ascending order (equal codes by position) and their
    positions; key_sum [B, Hk, 1, D], value_sum [B, Hk, 1, Dv]: sums over all M positions in
    the compute dtype (fp32, or fp64 for fp64 inputs).
    """

    k: Tensor
    v: Tensor
    sorted_codes: Tensor
    order: Tensor
    key_sum: Tensor
    value_sum: Tensor

    def __getitem__(self, index: int) -> Tensor:
        return (self.k, self.v)[index]

    def __len__(self) -> int:
        return 2

    @property
    def prefix(self) -> int:
        """P: how many leading keys the sorted codes hold."""
        return self.sorted_codes.shape[-1]


def searchable_prefix(spec: Zeta, n_keys: int) -> int:
    """p of the last query of a causal call over ``n_keys`` keys: the start of its chunk."""
    size = spec.chunk_size(n_keys)
    return ((n_keys - 1) // size) * size


def start_cache(spec: Zeta, k: Tensor, v: Tensor) -> ZetaCache:
    """The cache after a causal call over k [B, Hk, M, D], v [B, Hk, M, Dv] (a prefill)."""
    k32 = upcast(k)
    prefix = searchable_prefix(spec, k.shape[2]) if k.shape[2] else 0
    codes = _codes(spec, k32[:, :, :prefix], code_bits(spec.bits, k.shape[-1], spec.curves))  # [S, B, Hk, P]
    sorted_codes, order = torch.sort(codes.contiguous(), dim=-1, stable=True)
    return ZetaCache(
        k, v, sorted_codes.contiguous(), order.contiguous(), k32.sum(2, keepdim=True), upcast(v).sum(2, keepdim=True)
    )


def _merge(sorted_codes: Tensor, order: Tensor, codes: Tensor, first: int) -> tuple[Tensor, Tensor]:
    """Insert the codes [S, B, H, n] of the keys first..first+n-1 into the sorted codes [S, B, H, P]
    (and their positions into ``order``): after every equal code, since their positions are larger."""
    new_codes, new_rank = torch.sort(codes.contiguous(), dim=-1, stable=True)  # [S, B, H, n]
    new_order = new_rank + first
    count = new_codes.shape[-1]
    before = torch.searchsorted(sorted_codes, new_codes, right=True)  # old codes <= each new one
    new_slot = before + torch.arange(count, device=codes.device)  # [S, B, H, n]
    old = torch.arange(sorted_codes.shape[-1], device=codes.device).expand_as(sorted_codes).contiguous()
    old_slot = old + torch.searchsorted(before, old, right=True)  # old slot + new codes placed before it
    merged_codes = sorted_codes.new_empty(*sorted_codes.shape[:-1], sorted_codes.shape[-1] + count)
    merged_order = order.new_empty(merged_codes.shape)
    merged_codes.scatter_(-1, old_slot, sorted_codes).scatter_(-1, new_slot, new_codes)
    merged_order.scatter_(-1, old_slot, order).scatter_(-1, new_slot, new_order)
    return merged_codes, merged_order


def decode_step(
    spec: Zeta,
    q: Tensor,
    k_new: Tensor,
    v_new: Tensor,
    cache: ZetaCache,
    params: dict | None = None,
    *,
    kernel: str = "auto",
) -> tuple[Tensor, ZetaCache]:
    """The output [B, Hq, 1, Dv] of the query q [B, Hq, 1, D] at position M - 1 for the new key
    and value k_new [B, Hk, 1, D], v_new [B, Hk, 1, Dv], and the updated cache.

    Equals ``sparse_attention(q, k, v, spec, causal=True)[:, :, -1:]`` over all M keys (the
    lean path's selection, then Cauchy attention over the chosen keys and the mean). No key
    padding. ``kernel``: "reference" (``indexed_attention_ref``), "triton" (the fused indexed
    kernel) or "auto" (triton on CUDA). Default: "auto"."""
    if kernel not in ("auto", "reference", "triton"):
        raise ValueError(f"zeta decode_step: kernel must be auto, reference or triton, got {kernel!r}")
    if q.shape[2] != 1 or k_new.shape[2] != 1:
        raise ValueError(f"zeta decode_step takes one new position, got {q.shape[2]} queries and {k_new.shape[2]} keys")
    k, v = torch.cat([cache.k, k_new], dim=2), torch.cat([cache.v, v_new], dim=2)  # [B, Hk, M, *]
    n_keys, heads = k.shape[2], q.shape[1]
    bits = code_bits(spec.bits, q.shape[-1], spec.curves)
    prefix = searchable_prefix(spec, n_keys)
    sorted_codes, order = cache.sorted_codes, cache.order
    if prefix > cache.prefix:
        entering = _codes(spec, upcast(k[:, :, cache.prefix : prefix]), bits)  # [S, B, Hk, n]
        sorted_codes, order = _merge(sorted_codes, order, entering, cache.prefix)
    key_sum, value_sum = cache.key_sum + upcast(k_new), cache.value_sum + upcast(v_new)
    new_cache = ZetaCache(k, v, sorted_codes, order, key_sum, value_sum)
    index = _selection(spec, q, k, sorted_codes, order, prefix, bits)  # [B, Hq, 1, K]
    mean_k, mean_v = (key_sum / n_keys).to(k.dtype), (value_sum / n_keys).to(v.dtype)  # [B, Hk, 1, *]
    present = torch.ones(q.shape[0], 1, 1, dtype=torch.bool, device=q.device)
    attend = indexed_attention_ref
    if kernel == "triton" or (kernel == "auto" and q.is_cuda):
        from sparsefocus.kernels.indexed import indexed_attention as attend  # type: ignore[assignment]
    out = attend(
        q,
        k,
        v,
        index,
        score="cauchy",
        gamma=spec.gamma_of(params),
        extra_key=mean_k,
        extra_value=mean_v,
        extra_mask=present,
        sink_key=spec.sink_of(params, heads, q.shape[-1], q.device),
    )
    return out, new_cache


def _selection(spec: Zeta, q: Tensor, k: Tensor, sorted_codes: Tensor, order: Tensor, prefix: int, bits: int) -> Tensor:
    """``select_keys``' row for the last query: window candidates of each curve around the
    query's code among the first ``prefix`` keys, the local band, the nearest ``width``."""
    batch, heads = q.shape[0], q.shape[1]
    q32 = upcast(q)
    codes_q = _codes(spec, q32, bits)  # [S, B, Hq, 1]
    searchable = torch.full((batch, 1), prefix, dtype=torch.long, device=q.device)
    group = heads // k.shape[1]
    sorted_q = sorted_codes.repeat_interleave(group, dim=2) if group > 1 else sorted_codes  # [S, B, Hq, P]
    order_q = order.repeat_interleave(group, dim=2) if group > 1 else order
    candidates = _window_candidates(sorted_q, order_q, searchable, codes_q, spec.window)  # [B, Hq, 1, S*W]
    n_keys = k.shape[2]
    if spec.local > 0:
        real = torch.ones(batch, 1, n_keys, dtype=torch.bool, device=q.device)
        band = _local_band(slice(n_keys - 1, n_keys), prefix, spec.local, real, heads)  # [B, Hq, 1, local]
        candidates = torch.cat([candidates, band], dim=-1)
    width = min(spec.k, spec.curves * spec.window + spec.local)
    return _nearest(q32, k, candidates, width, dedup=spec.curves > 1)  # gathers the candidates of the kv heads only

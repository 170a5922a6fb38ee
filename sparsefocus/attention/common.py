"""Shared pieces of every mechanism: masked dense attention, indexed (gather) attention,
causal masks, GQA expansion and query chunking. Pure PyTorch; these are the slow twins that
define what the kernels must compute."""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.checkpoint import checkpoint

SCORE_KINDS = ("dot", "neg_sqeuclid", "cauchy")
DEFAULT_ROW_CHUNK = 1024


def upcast(x: Tensor) -> Tensor:
    """Compute dtype of the references: fp32 for low precision, fp64 kept (for gradcheck)."""
    return x if x.dtype == torch.float64 else x.float()


def expand_kv(x: Tensor, num_q_heads: int) -> Tensor:
    """Repeat KV heads for grouped-query attention: [B, Hk, M, D] -> [B, Hq, M, D]."""
    group = num_q_heads // x.shape[1]
    return x if group == 1 else x.repeat_interleave(group, dim=1)


def causal_row_mask(rows: slice, n_keys: int, device: torch.device) -> Tensor:
    """[len(rows), M] bool: key j is allowed for query i iff j <= i."""
    query_pos = torch.arange(rows.start, rows.stop, device=device)
    key_pos = torch.arange(n_keys, device=device)
    return key_pos[None, :] <= query_pos[:, None]


def row_slice(n: int, start: int = 0, stop: int | None = None) -> slice:
    """A concrete slice (start and stop set) over n rows."""
    return slice(start, n if stop is None else min(stop, n))


def grouped_linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """x [B, ..., I] @ weight + bias: weight [I, O] and bias [O] shared by every batch row, or
    weight [G, I, O] and bias [G, O] with G dividing B, batch row b taking group b // (B / G)
    (G = B: one weight per row; G = the runs of a folded batch, run-major: one per run) -> [B, ..., O].

    A group's rows run as one product (``bmm`` over [G, B / G * ..., I]): per-row weights that
    repeat a run's would make B small products, which CUDA runs far slower."""
    if weight.dim() == 2:
        return torch.nn.functional.linear(x, weight.t(), bias)
    groups, batch = weight.shape[0], x.shape[0]
    if weight.dim() != 3 or x.dim() < 2 or batch % groups or x.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"grouped_linear: weight {tuple(weight.shape)} needs [I, O] or [G, I, O] with G dividing the batch "
            f"of x {tuple(x.shape)} and I its last dim"
        )
    flat = x.reshape(groups, -1, x.shape[-1])  # [G, B / G * ..., I]
    out = torch.bmm(flat, weight) if bias is None else torch.baddbmm(bias[:, None], flat, weight)
    return out.view(*x.shape[:-1], weight.shape[-1])


def run_layer_norm_ref(x: Tensor, weight: Tensor, bias: Tensor, eps: float = 1e-5) -> Tensor:
    """LayerNorm over the last dim of x [R * B, ..., d] (R runs' rows, run-major) without affine,
    then run r's weight and bias [R, d]: the slow twin of ``kernels.run_norm.run_layer_norm``."""
    runs = weight.shape[0]
    view = (runs, -1) + (1,) * (x.dim() - 2) + (x.shape[-1],)  # [R, 1.., d] against x as [R, B, ..., d]
    out = torch.nn.functional.layer_norm(x, x.shape[-1:], None, None, eps).reshape(runs, -1, *x.shape[1:])
    return (out * weight.view(view) + bias.view(view)).reshape(x.shape)


def run_bias_add_ref(out: Tensor, bias: Tensor) -> Tensor:
    """out [R, M, O] plus run r's bias [R, O] cast to out's dtype: the slow twin of
    ``kernels.run_bias.run_bias_add``."""
    return out + bias[:, None].to(out.dtype)


def rows_of_groups(value: Tensor, batch: int) -> Tensor:
    """A value [G, ...] of G groups of rows (G dividing ``batch``, as ``grouped_linear``) as one
    copy per batch row [B, ...]."""
    if batch % value.shape[0]:
        raise ValueError(f"rows_of_groups: {value.shape[0]} groups do not split a batch of {batch}")
    return value.repeat_interleave(batch // value.shape[0], dim=0)


CUDNN_MASKED_BAD_REMAINDER = 64
"""Key lengths of 64 past a multiple of 128 where cuDNN's SDPA backward, given a mask tensor, returns
non-finite dq once every logit of a row is far below 0 (its log-sum-exp under -88.7): measured on an
H100 with torch 2.11 at 576 and 704 keys, clean at 512, 599, 600 and 640
(``benchmarks/results/h100_lab_concurrent_nan_ae5581c.json``)."""
MASKED_SDPA_BACKENDS = [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]  # the backends that take a mask, less cuDNN


def cudnn_masked_unsafe(n_keys: int) -> bool:
    """Whether cuDNN's masked SDPA backward can fail over ``n_keys`` keys (``CUDNN_MASKED_BAD_REMAINDER``)."""
    return n_keys % 128 == CUDNN_MASKED_BAD_REMAINDER


def avoids_cudnn(q: Tensor, n_keys: int) -> bool:
    """Whether a masked SDPA call over ``n_keys`` keys on q's device keeps off cuDNN's backend."""
    return q.is_cuda and cudnn_masked_unsafe(n_keys)


def masked_sdpa(q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor, **kwargs) -> Tensor:
    """``F.scaled_dot_product_attention`` with a mask tensor, off cuDNN's backend at the key lengths
    where its backward can return NaN (``avoids_cudnn``; the memory-efficient backend then, which
    also takes a mask); elsewhere SDPA picks its backend as usual."""
    if avoids_cudnn(q, k.shape[-2]):
        with sdpa_kernel(MASKED_SDPA_BACKENDS):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, **kwargs)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, **kwargs)


def masked_softmax(scores: Tensor, mask: Tensor) -> Tensor:
    """Softmax over the last dim restricted to ``mask``; rows with no kept entry give zeros.

    Rows that keep nothing are filled with zeros before the softmax (so no NaN appears in the
    forward or the backward) and multiplied by zero after it.
    """
    row_has_key = mask.any(dim=-1, keepdim=True)
    scores = scores.masked_fill(~mask, float("-inf")).masked_fill(~row_has_key, 0.0)
    return torch.softmax(scores, dim=-1) * row_has_key


def dense_masked_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float) -> Tensor:
    """Softmax attention over the kept pairs, computed densely in fp32.

    Args:
        q: [B, H, N, D]; k: [B, H, M, D]; v: [B, H, M, Dv]; mask: broadcastable to [B, H, N, M].
    Returns:
        [B, H, N, Dv] fp32.
    """
    scores = torch.matmul(upcast(q), upcast(k).transpose(-1, -2)) * scale  # [B, H, N, M]
    return torch.matmul(masked_softmax(scores, mask), upcast(v))  # [B, H, N, Dv]


def apply_key_padding(mask: Tensor, key_padding_mask: Tensor | None) -> Tensor:
    """AND a [B, M] key padding mask (True = real key) into a [.., N, M] mask."""
    if key_padding_mask is None:
        return mask
    return mask & key_padding_mask[:, None, None, :]


def chunked_rows(fn: Callable[[slice], Tensor], n_rows: int, chunk: int = DEFAULT_ROW_CHUNK, recompute: bool = True) -> Tensor:
    """Concatenate ``fn(rows)`` over row chunks along dim -2.

    With autograd on, each chunk is checkpointed so that its [chunk, M] scores are recomputed in
    the backward instead of stored: memory stays O(chunk * M), never O(N * M).
    """
    outs = []
    for start in range(0, n_rows, chunk):
        rows = row_slice(n_rows, start, start + chunk)
        if recompute and torch.is_grad_enabled():
            outs.append(checkpoint(fn, rows, use_reentrant=False))
        else:
            outs.append(fn(rows))
    return torch.cat(outs, dim=-2)


def gather_keys(x: Tensor, index: Tensor) -> Tensor:
    """Gather rows of x per query: x [B, Hk, M, D], index [B, Hq, N, K] (>= 0) -> [B, Hq, N, K, D].

    Query head h reads KV head h // (Hq // Hk).
    """
    batch, kv_heads, n_keys, dim = x.shape
    _, q_heads, n_queries, width = index.shape
    group = q_heads // kv_heads
    flat = index.reshape(batch, kv_heads, group * n_queries * width)  # [B, Hk, G*N*K]
    picked = torch.gather(x, 2, flat[..., None].expand(-1, -1, -1, dim))  # [B, Hk, G*N*K, D]
    return picked.reshape(batch, q_heads, n_queries, width, dim)


def indexed_scores(q: Tensor, keys: Tensor, score: str, scale: float) -> Tensor:
    """Scores of q [B, H, N, D] against its gathered keys [B, H, N, K, D] -> [B, H, N, K]."""
    if score == "dot":
        return torch.einsum("bhnd,bhnkd->bhnk", q, keys) * scale
    sq_dist = (q[..., None, :] - keys).pow(2).sum(-1)  # [B, H, N, K]
    return -sq_dist * scale if score == "neg_sqeuclid" else sq_dist


def indexed_attention_ref(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    index: Tensor,
    *,
    scale: float | None = None,
    score: str = "dot",
    gamma: Tensor | float | None = None,
    extra_key: Tensor | None = None,
    extra_value: Tensor | None = None,
    extra_mask: Tensor | None = None,
    sink_key: Tensor | None = None,
    slot_weight: Tensor | None = None,
) -> Tensor:
    """Attention of each query over an explicit list of keys (the slow twin of the Triton kernel).

    Args:
        q: [B, Hq, N, D]; k: [B, Hk, M, D]; v: [B, Hk, M, Dv] with Hq % Hk == 0.
        index: [B, Hq, N, K] integer key positions; -1 marks an unused slot. Repeats are counted
            as many times as they appear.
        scale: multiplies dot scores / squared distances. Default: 1/sqrt(D).
        score: "dot" (softmax of scale*q.k), "neg_sqeuclid" (softmax of -scale*||q-k||^2) or
            "cauchy" (weights 1/(||q-k||^2 + gamma^2) normalised over the list; scale unused).
        gamma: Cauchy width, scalar, [Hq] or per batch row [B, Hq] tensor. Default: 1.
        extra_key, extra_value: optional one more slot per query, its own key [B, Hq or Hk, N, D]
            and value [B, Hq or Hk, N, Dv] (e.g. ZETA's cumulative mean token), scored like the
            listed keys; both or neither. Default: none.
        extra_mask: [B, 1 or Hq, N] bool, True where the extra slot counts. Default: every row.
        sink_key: optional [Hq, D] (or per batch row [B, Hq, D]) attention sink, Cauchy only: one
            more slot in every row with this key (per query head) and value 0, so it only adds its
            weight to the normaliser (ZETA's ``sink=1``). Default: none.
        slot_weight: optional [B, Hq, N, K] factor on each listed slot's normalised weight, applied
            after normalisation and outside the normaliser (attention dropout: the kept slots'
            ``1 / (1 - p)``, 0 for dropped ones); the extra slot and the sink keep their weights.
            A constant: it receives no gradient. Default: none.
    Returns:
        [B, Hq, N, Dv] in fp32; rows with no valid key are zero.
    """
    if score not in SCORE_KINDS:
        raise ValueError(f"unknown score {score!r}; valid: {', '.join(SCORE_KINDS)}")
    check_sink_key(q, sink_key, score)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    valid = index >= 0  # [B, Hq, N, K]
    safe = index.clamp_min(0).long()
    keys = gather_keys(upcast(k), safe)  # [B, Hq, N, K, D]
    values = gather_keys(upcast(v), safe)  # [B, Hq, N, K, Dv]
    if extra_key is not None or extra_value is not None:
        keys, values, valid = _append_extra_slot(keys, values, valid, extra_key, extra_value, extra_mask)
    if sink_key is not None:
        sink = sink_rows(upcast(sink_key)).expand(*keys.shape[:3], -1)  # [B, Hq, N, D]
        keys, values, valid = _append_extra_slot(keys, values, valid, sink, torch.zeros_like(values[..., 0, :]), None)
    raw = indexed_scores(upcast(q), keys, score, scale)
    if score == "cauchy":
        weights = cauchy_weights(raw, valid, gamma)
    else:
        weights = masked_softmax(raw, valid)
    if slot_weight is not None:
        check_slot_weight(q, index, slot_weight)
        listed = index.shape[-1]  # the extra slot and the sink, if any, come after the listed ones
        factor = torch.ones_like(weights)
        factor[..., :listed] = upcast(slot_weight.detach())
        weights = weights * factor
    return torch.einsum("bhnk,bhnkd->bhnd", weights, values)


def check_slot_weight(q: Tensor, index: Tensor, slot_weight: Tensor) -> None:
    """A slot weight is [B, Hq, N, K]: one factor per query row and listed slot (ValueError otherwise)."""
    want = (*q.shape[:3], index.shape[-1])
    if tuple(slot_weight.shape) != want:
        raise ValueError(f"slot_weight must be [B, Hq, N, K] = {list(want)}, got {list(slot_weight.shape)}")


def check_sink_key(q: Tensor, sink_key: Tensor | None, score: str) -> None:
    """A sink key is [Hq, D], or per batch row [B, Hq, D], and goes with Cauchy weights only
    (ValueError otherwise)."""
    if sink_key is None:
        return
    if score != "cauchy":
        raise ValueError(f"sink_key needs score='cauchy' (a zero-value key that only adds its weight), got score={score!r}")
    if tuple(sink_key.shape) not in ((q.shape[1], q.shape[-1]), (q.shape[0], q.shape[1], q.shape[-1])):
        raise ValueError(f"sink_key must be [Hq, D] = [{q.shape[1]}, {q.shape[-1]}] or [B, Hq, D], got {tuple(sink_key.shape)}")


def sink_rows(sink: Tensor) -> Tensor:
    """A sink key [Hq, D] or [B, Hq, D] as [1 or B, Hq, 1, D], to broadcast over [B, Hq, N, D]."""
    return sink[:, :, None, :] if sink.dim() == 3 else sink[None, :, None, :]


def gamma_squared(gamma: Tensor | float | None, like: Tensor) -> Tensor:
    """gamma^2 in ``like``'s dtype and device, shaped to broadcast over [B, H, N, *]: a scalar;
    [H] -> [1, H, 1, 1]; per batch row [B, H] -> [B, H, 1, 1]. None means 1."""
    gamma = torch.as_tensor(1.0 if gamma is None else gamma, dtype=like.dtype, device=like.device)
    if gamma.dim() == 2:
        return gamma[:, :, None, None].pow(2)
    return gamma.reshape(1, -1, 1, 1).pow(2) if gamma.numel() > 1 else gamma.pow(2)


def _append_extra_slot(
    keys: Tensor, values: Tensor, valid: Tensor, extra_key: Tensor, extra_value: Tensor | None, extra_mask: Tensor | None
) -> tuple[Tensor, Tensor, Tensor]:
    """Append one slot per query: keys [B, Hq, N, K, D] -> [B, Hq, N, K+1, D] (values, valid alike)."""
    if extra_key is None or extra_value is None:
        raise ValueError("extra_key and extra_value must be given together")
    q_heads = keys.shape[1]
    extra_k = expand_kv(upcast(extra_key), q_heads).expand(*keys.shape[:3], -1)  # [B, Hq, N, D]
    extra_v = expand_kv(upcast(extra_value), q_heads).expand(*values.shape[:3], -1)  # [B, Hq, N, Dv]
    mask = torch.ones_like(valid[..., 0]) if extra_mask is None else extra_mask.expand_as(valid[..., 0])
    return (
        torch.cat([keys, extra_k[..., None, :]], dim=-2),
        torch.cat([values, extra_v[..., None, :]], dim=-2),
        torch.cat([valid, mask[..., None]], dim=-1),
    )


def cauchy_weights(sq_dist: Tensor, valid: Tensor, gamma: Tensor | float | None) -> Tensor:
    """Normalised Cauchy weights (d^2 + gamma^2)^-1 over the valid entries of the last dim:
    sq_dist, valid [B, H, N, K]; gamma as ``gamma_squared`` reads it."""
    kernel = torch.where(valid, 1.0 / (sq_dist + gamma_squared(gamma, sq_dist)), torch.zeros_like(sq_dist))
    total = kernel.sum(-1, keepdim=True)
    return kernel / torch.where(total > 0, total, torch.ones_like(total))


def mask_from_indices(index: Tensor, n_keys: int) -> Tensor:
    """[B, H, N, K] key lists (-1 = unused) -> [B, H, N, M] bool mask."""
    mask = torch.zeros(*index.shape[:-1], n_keys + 1, dtype=torch.bool, device=index.device)
    slot = torch.where(index >= 0, index.long(), torch.full_like(index.long(), n_keys))
    mask.scatter_(-1, slot, True)
    return mask[..., :n_keys]


def drop_padded_keys(index: Tensor, key_padding_mask: Tensor | None) -> Tensor:
    """Set to -1 the entries of [B, H, N, K] that point at padded keys ([B, M], True = real)."""
    if key_padding_mask is None:
        return index
    batch, heads, n_queries, width = index.shape
    flat = index.clamp_min(0).long().reshape(batch, -1)  # [B, H*N*K]
    real = torch.gather(key_padding_mask, 1, flat).reshape(index.shape)
    return torch.where(real & (index >= 0), index, torch.full_like(index, -1))


def run_attention_ref(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    start: Tensor | int,
    width: int | Tensor,
    *,
    scale: float | None = None,
    causal: bool = False,
) -> Tensor:
    """Attention of each query over the contiguous run of keys [start, start + width) (the slow
    twin of ``sparsefocus.kernels.runs.run_attention``), as an index list for ``indexed_attention_ref``.

    Args:
        q: [B, Hq, N, D]; k: [B, Hk, M, D]; v: [B, Hk, M, Dv] with Hq % Hk == 0.
        start: [B or 1, Hq or 1, N] integer first key per query, or an int o: query i's run
            starts at i + o; the run is clipped to [0, M).
        width: keys per run (int >= 0) or an integer tensor [B or 1, Hq or 1, N] of lengths.
        scale: multiplies q.k. Default: 1/sqrt(D).
        causal: also drop keys j > i.
    Returns:
        [B, Hq, N, Dv] in fp32; rows with an empty run are zero.
    """
    rows = (q.shape[0], q.shape[1], q.shape[2])
    lengths = width.expand(*rows).long() if isinstance(width, Tensor) else torch.full(rows, int(width), device=q.device)
    slots = torch.arange(int(lengths.max().clamp_min(0)) if lengths.numel() else 0, device=q.device)
    if not isinstance(start, Tensor):
        start = torch.arange(q.shape[-2], device=q.device) + int(start)
    index = start.expand(*rows).long()[..., None] + slots  # [B, Hq, N, W]
    cut = (slots >= lengths[..., None]) | (index < 0) | (index >= k.shape[-2])
    if causal:
        cut |= index > torch.arange(q.shape[-2], device=q.device)[:, None]
    return indexed_attention_ref(q, k, v, torch.where(cut, -1, index), scale=scale)

"""Indexed attention on tensor cores for key lists shared by the query heads of a kv group.

DSA (DeepSeek-V3.2) picks one list of K keys per query position and every query head attends to
it; NSA's selection is shared across a GQA group the same way. With a shared list, the G = Hq / Hk
query heads of one kv head at one position read the *same* K key rows, so a program can hold them
as the rows of one tile and score a gathered [BLOCK_N, D] key tile with one ``tl.dot``:

    program (position t, batch b, kv head g):
        q tile     [BLOCK_G, D]   the G query heads of kv head g at t (padded to >= 16 rows)
        key tile   [BLOCK_N, D]   BLOCK_N listed keys of t, gathered once for all G heads
        scores     [BLOCK_G, BLOCK_N] = q tile @ key tile^T   (tensor cores)

``kernels/indexed.py`` instead gives every query row its own list and so multiplies elementwise,
gathering each key once per query head.

* forward: online softmax in fp32 (log2 units) over the list, BLOCK_N slots at a time; returns the
  output and the log-sum-exp (natural log, -inf for a row whose list holds no key).
* backward: the same programs recompute the weights from the LSE, keep dq in registers and add
  the tiles' dk = ds^T q and dv = p^T do (``tl.dot``) into fp32 buffers with atomic adds: a key
  is listed by unknown positions, and with one program per position there is no cheap key-major
  order. The summation order of dk and dv is therefore not deterministic.

Lists: int32 [B, Hi, N, K] with Hi = 1 (one list per position for every head, DSA) or Hi = Hk (one
per kv group, NSA); -1 marks an unused slot; entries index keys 0..M-1. The slow twin is
``group_indexed_attention_ref`` (every head gathers its group's list in PyTorch).

The launchers are the ``torch.library`` ops ``sparsefocus::group_indexed_fwd`` and
``group_indexed_bwd``, so ``torch.compile`` treats each as one opaque call.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from sparsefocus.attention.common import gather_keys, indexed_scores, masked_softmax, upcast
from sparsefocus.kernels import interpreter_compat  # noqa: F401  (CPU interpreter fix)
from sparsefocus.kernels._ops import lse_from_log2
from sparsefocus.kernels.row_delta import row_delta

LOG2E = 1.4426950408889634
MIN_ROWS = 16  # the fewest rows a tl.dot tile takes: groups of fewer heads are padded


@triton.jit
def _group_program(Q, N, M, KK, HK, G, IDX_HEADS, D: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr):
    """The program's position t and kv head g of batch b: flat row numbers [BG] (b, head, t) of
    g's query heads, their mask, q [BG, BD], and the offsets of t's list and of g's keys."""
    t, bg = tl.program_id(0), tl.program_id(1)
    b, g = bg // HK, bg % HK
    heads = tl.arange(0, BLOCK_G)
    row_ok = heads < G
    rows = ((b * HK + g) * G).to(tl.int64) * N + t + heads.to(tl.int64) * N  # [BG]: head stride N rows
    offs_d = tl.arange(0, BLOCK_D)
    q = tl.load(Q + rows[:, None] * D + offs_d[None, :], mask=row_ok[:, None] & (offs_d[None, :] < D), other=0.0)
    list_head = tl.where(IDX_HEADS == 1, 0, g)
    list_base = ((b * IDX_HEADS + list_head).to(tl.int64) * N + t) * KK
    return rows, row_ok, q, list_base, (b * HK + g).to(tl.int64) * M


@triton.jit
def _listed_keys(
    IDX,
    list_base,
    s0,
    K,
    V,
    KK,
    kv_base,
    M,
    D: tl.constexpr,
    DV: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    """Slots s0..s0+BN of the list: flat key rows [BN], their mask (-1 slots unused), and the
    gathered key [BN, BD] and value [BN, BDV] tiles."""
    slots = s0 + tl.arange(0, BLOCK_N)
    idx = tl.load(IDX + list_base + slots, mask=slots < KK, other=-1)
    valid = (idx >= 0) & (idx < M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    key_rows = kv_base + tl.where(valid, idx, 0).to(tl.int64)  # [BN] flat key rows
    kt = tl.load(K + key_rows[:, None] * D + offs_d[None, :], mask=valid[:, None] & (offs_d[None, :] < D), other=0.0)
    vt = tl.load(V + key_rows[:, None] * DV + offs_dv[None, :], mask=valid[:, None] & (offs_dv[None, :] < DV), other=0.0)
    return key_rows, valid, kt, vt


@triton.jit
def _fwd_kernel(
    Q,
    K,
    V,
    IDX,
    OUT,
    LSE,
    N,
    M,
    KK,
    HK,
    G,
    IDX_HEADS,
    qk_scale,
    D: tl.constexpr,
    DV: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    PRECISION: tl.constexpr,
):
    rows, row_ok, q, list_base, kv_base = _group_program(Q, N, M, KK, HK, G, IDX_HEADS, D, BLOCK_G, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_DV], dtype=tl.float32)
    for s0 in range(0, KK, BLOCK_N):
        key_rows, valid, kt, vt = _listed_keys(IDX, list_base, s0, K, V, KK, kv_base, M, D, DV, BLOCK_N, BLOCK_D, BLOCK_DV)
        s = tl.dot(q, tl.trans(kt), input_precision=PRECISION) * qk_scale  # [BG, BN] log2 units
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no key yet: no NaN from -inf - -inf
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt, input_precision=PRECISION)
        m_i = m_new
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(
        OUT + rows[:, None] * DV + offs_dv[None, :], out.to(OUT.dtype.element_ty), mask=row_ok[:, None] & (offs_dv[None, :] < DV)
    )
    lse2 = tl.where(l_i > 0, m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0)), float("inf"))  # +inf: no key (backward weight 0)
    tl.store(LSE + rows, lse2, mask=row_ok)


@triton.jit
def _bwd_kernel(
    Q,
    K,
    V,
    IDX,
    DO,
    LSE2,
    DELTA,
    DQ,
    DK,
    DVB,
    N,
    M,
    KK,
    HK,
    G,
    IDX_HEADS,
    scale,
    D: tl.constexpr,
    DV: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """dq of the group's rows (stored), dk and dv of the listed keys (fp32 atomic adds)."""
    rows, row_ok, q, list_base, kv_base = _group_program(Q, N, M, KK, HK, G, IDX_HEADS, D, BLOCK_G, BLOCK_D)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    do = tl.load(DO + rows[:, None] * DV + offs_dv[None, :], mask=row_ok[:, None] & (offs_dv[None, :] < DV), other=0.0)
    lse2 = tl.load(LSE2 + rows, mask=row_ok, other=float("inf"))  # padded rows: weights 0
    delta = tl.load(DELTA + rows, mask=row_ok, other=0.0)  # sum(do * out) - grad of the lse
    dq = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    qk_scale = scale * 1.4426950408889634
    for s0 in range(0, KK, BLOCK_N):
        key_rows, valid, kt, vt = _listed_keys(IDX, list_base, s0, K, V, KK, kv_base, M, D, DV, BLOCK_N, BLOCK_D, BLOCK_DV)
        s = tl.dot(q, tl.trans(kt), input_precision=PRECISION) * qk_scale
        p = tl.where(valid[None, :], tl.exp2(s - lse2[:, None]), 0.0)  # [BG, BN] softmax weights
        dp = tl.dot(do, tl.trans(vt), input_precision=PRECISION)  # [BG, BN]
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(kt.dtype), kt, input_precision=PRECISION)
        dk = tl.dot(tl.trans(ds.to(q.dtype)), q, input_precision=PRECISION) * scale  # [BN, BD]
        dv = tl.dot(tl.trans(p.to(do.dtype)), do, input_precision=PRECISION)  # [BN, BDV]
        # relaxed: the sums are read only after the kernel ends, so the adds need no ordering
        # (Triton's default acq_rel fences each one), as the other kernels' atomic adds
        dk_ptrs, dv_ptrs = DK + key_rows[:, None] * D + offs_d[None, :], DVB + key_rows[:, None] * DV + offs_dv[None, :]
        tl.atomic_add(dk_ptrs, dk, mask=valid[:, None] & (offs_d[None, :] < D), sem="relaxed")
        tl.atomic_add(dv_ptrs, dv, mask=valid[:, None] & (offs_dv[None, :] < DV), sem="relaxed")
    tl.store(
        DQ + rows[:, None] * D + offs_d[None, :],
        (dq * scale).to(DQ.dtype.element_ty),
        mask=row_ok[:, None] & (offs_d[None, :] < D),
    )


def _tiles(q: Tensor, group: int, dim: int, dv: int) -> dict:
    """Launch constants: rows padded to a tl.dot tile, key slots per step, the dot precision."""
    return dict(
        BLOCK_G=max(MIN_ROWS, triton.next_power_of_2(group)),
        BLOCK_N=64 if q.is_cuda else 16,  # interpreter: several slot steps at test sizes
        BLOCK_D=max(16, triton.next_power_of_2(dim)),
        BLOCK_DV=max(16, triton.next_power_of_2(dv)),
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
    )


def _sizes(q: Tensor, k: Tensor, v: Tensor, index: Tensor) -> tuple[int, ...]:
    """(N, M, K, Hk, G, Hi) of a call, as the kernels take them."""
    return q.shape[2], k.shape[2], index.shape[3], k.shape[1], q.shape[1] // k.shape[1], index.shape[1]


@torch.library.custom_op("sparsefocus::group_indexed_fwd", mutates_args=())
def group_indexed_fwd(q: Tensor, k: Tensor, v: Tensor, index: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    """Forward op: contiguous q [B, Hq, N, D], k [B, Hk, M, D], v [B, Hk, M, Dv], index int32
    [B, 1 or Hk, N, K] -> (out [B, Hq, N, Dv] in q.dtype, lse2 [B, Hq, N] fp32, base 2, +inf: no key)."""
    batch, q_heads, n, dim = q.shape
    out = torch.empty(batch, q_heads, n, v.shape[3], dtype=q.dtype, device=q.device)
    lse2 = torch.empty(batch, q_heads, n, dtype=torch.float32, device=q.device)
    grid = (n, batch * k.shape[1])
    _fwd_kernel[grid](
        q,
        k,
        v,
        index,
        out,
        lse2,
        *_sizes(q, k, v, index),
        scale * LOG2E,
        D=dim,
        DV=v.shape[3],
        **_tiles(q, q_heads // k.shape[1], dim, v.shape[3]),
    )
    return out, lse2


@group_indexed_fwd.register_fake
def _(q, k, v, index, scale):
    return q.new_empty(*q.shape[:3], v.shape[3]), q.new_empty(q.shape[:3], dtype=torch.float32)


@torch.library.custom_op("sparsefocus::group_indexed_bwd", mutates_args=())
def group_indexed_bwd(
    grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, index: Tensor, out: Tensor, lse2: Tensor, grad_lse: Tensor, scale: float
) -> tuple[Tensor, Tensor, Tensor]:
    """Backward op of ``group_indexed_fwd`` (grad_lse: the gradient of the natural-log lse)."""
    dim, dv = q.shape[3], v.shape[3]
    # d lse / d s = p, so the lse's gradient enters ds = p * (dp - delta) as -grad_lse in delta
    delta = row_delta(grad_out, out, grad_lse)  # [B, Hq, N] fp32, contiguous
    dq = torch.empty_like(q)
    dk = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
    dv_buf = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
    grid = (q.shape[2], q.shape[0] * k.shape[1])
    _bwd_kernel[grid](
        q,
        k,
        v,
        index,
        grad_out,
        lse2,
        delta,
        dq,
        dk,
        dv_buf,
        *_sizes(q, k, v, index),
        scale,
        D=dim,
        DV=dv,
        **_tiles(q, q.shape[1] // k.shape[1], dim, dv),
    )
    return dq, dk.to(k.dtype), dv_buf.to(v.dtype)


@group_indexed_bwd.register_fake
def _(grad_out, q, k, v, index, out, lse2, grad_lse, scale):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, index, scale = inputs
    ctx.save_for_backward(q, k, v, index, *output)
    ctx.scale = scale


def _backward(ctx, grad_out, grad_lse2):
    q, k, v, index, out, lse2 = ctx.saved_tensors
    grad_out = torch.zeros_like(out) if grad_out is None else grad_out.contiguous()
    # the public lse is lse2 * ln 2 where finite, so d/d lse = d/d lse2 * log2(e)
    grad_lse = torch.zeros_like(lse2) if grad_lse2 is None else (grad_lse2 * LOG2E).contiguous()
    dq, dk, dv = group_indexed_bwd(grad_out, q, k, v, index, out, lse2, grad_lse, ctx.scale)
    return dq, dk, dv, None, None


group_indexed_fwd.register_autograd(_backward, setup_context=_setup_context)


def _check(q: Tensor, k: Tensor, v: Tensor, index: Tensor) -> None:
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4 or q.shape[-1] != k.shape[-1] or k.shape[:3] != v.shape[:3]:
        raise ValueError(
            f"group_indexed_attention needs q [B, Hq, N, D], k [B, Hk, M, D], v [B, Hk, M, Dv], got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if q.shape[0] != k.shape[0] or q.shape[1] % k.shape[1]:
        raise ValueError(f"q heads ({q.shape[1]}) must be a multiple of kv heads ({k.shape[1]}) with equal batch")
    if max(q.shape[-1], v.shape[-1]) > 256:
        raise ValueError(f"group_indexed_attention supports head dims up to 256, got D={q.shape[-1]}, Dv={v.shape[-1]}")
    shared = (q.shape[0], 1, q.shape[2]), (q.shape[0], k.shape[1], q.shape[2])
    if index.dim() != 4 or index.is_floating_point() or tuple(index.shape[:3]) not in shared:
        raise ValueError(
            f"index must be an integer tensor [B, 1 or Hk, N, K] = [{q.shape[0]}, 1 or {k.shape[1]}, {q.shape[2]}, K], got {index.dtype} {tuple(index.shape)}"
        )


def group_indexed_attention(
    q: Tensor, k: Tensor, v: Tensor, index: Tensor, *, scale: Optional[float] = None
) -> tuple[Tensor, Tensor]:
    """Softmax attention of every query head over its kv group's shared key list (Triton fwd+bwd).

    ::

        position t, list [j0, j1, -1]:  the G query heads of kv head g attend to keys j0, j1 of g

    Args:
        q: [B, Hq, N, D]; k: [B, Hk, M, D]; v: [B, Hk, M, Dv]; Hq % Hk == 0; D, Dv <= 256.
            fp16, bf16 or fp32 (fp32 uses exact fp32 dots; CPU interpreter: fp16/fp32).
        index: integer [B, 1, N, K] (one list per position for every head) or [B, Hk, N, K] (one
            per kv group); -1 = unused slot; entries in [0, M).
        scale: score scale. Default: 1/sqrt(D).
    Returns:
        (out [B, Hq, N, Dv] in q.dtype, lse [B, Hq, N] fp32 natural log, -inf for a row whose list
        holds no key; its gradient is supported). Rows with no key output zero.
    """
    _check(q, k, v, index)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    k, v = k.to(q.dtype).contiguous(), v.to(q.dtype).contiguous()
    out, lse2 = group_indexed_fwd(q.contiguous(), k, v, index.to(torch.int32).contiguous(), scale)
    return out, lse_from_log2(lse2)


def group_indexed_attention_ref(
    q: Tensor, k: Tensor, v: Tensor, index: Tensor, *, scale: Optional[float] = None
) -> tuple[Tensor, Tensor]:
    """The slow twin of ``group_indexed_attention`` (same arguments): every query head gathers its
    group's list as [B, Hq, N, K, D] keys; fp32 (fp64 for fp64 inputs) -> (out, lse)."""
    _check(q, k, v, index)
    group = q.shape[1] // k.shape[1]
    lists = index.long().expand(q.shape[0], k.shape[1], -1, -1) if index.shape[1] == 1 else index.long()
    per_head = lists.repeat_interleave(group, dim=1)  # [B, Hq, N, K]: head h reads its kv head's list
    valid = (per_head >= 0) & (per_head < k.shape[2])
    safe = torch.where(valid, per_head, 0)
    keys, values = gather_keys(upcast(k), safe), gather_keys(upcast(v), safe)  # [B, Hq, N, K, *]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = indexed_scores(upcast(q), keys, "dot", scale)  # [B, Hq, N, K]
    lse = torch.logsumexp(scores.masked_fill(~valid, float("-inf")), dim=-1)  # [B, Hq, N], -inf for an empty list
    return torch.einsum("bhnk,bhnkd->bhnd", masked_softmax(scores, valid), values), lse

"""Indexed (gather) attention in Triton: each query attends to its own list of K key positions.

The slow twin that defines the result is ``sparsefocus.attention.common.indexed_attention_ref``;
this file computes the same thing without gathering [B, H, N, K, D] tensors:

* forward: one program per (BLOCK_M queries, batch x head); it loads BLOCK_K slots of the key
  lists at a time, gathers those keys and values as [BLOCK_M, BLOCK_K, D] tiles, and keeps an
  online softmax (running max and sum, fp32) over the slots. Cauchy weights need no max.
* backward: the same programs recompute the weights from the saved log-sum-exp (or Cauchy sum),
  accumulate dq in registers, and scatter dk and dv with fp32 atomic adds (the lists are
  arbitrary, so a key's contributions come from unknown programs).

Scores per slot j of query i:  dot: scale * q.k_j;  neg_sqeuclid: -scale * ||q - k_j||^2;
cauchy: weight 1 / (||q - k_j||^2 + gamma^2), normalised over the list.

An optional extra slot per query (``extra_key``/``extra_value``, e.g. ZETA's cumulative mean
token) is scored like a listed key but read from per-row tensors, so its gradients are plain
per-row stores (no atomics) and the caller need not append it to k and v. An optional sink key
per query head (``sink_key``, Cauchy; value 0) is handled the same way: its weight joins each
row's normaliser, its gradient is stored per row and summed.

``KEY_GRADS`` "inverse" and "short" move dk and dv out of this backward, into ``indexed_csr``
(per-key sums over an inverse index) or ``indexed_short`` (one-hot tiles over every query row,
for short key rows); neither uses float atomics.

The launchers are ``torch.library`` ops (``sparsefocus::indexed_fwd``, ``indexed_bwd``,
``indexed_causal_mean_fwd``; docs/kernels.md), so ``torch.compile`` treats each as one opaque
call. The forward's row statistic is also the public ``return_lse``.

Not done here: a tensor-core variant for lists made of contiguous runs (sorted keys, windows);
every list is gathered row by row.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.library import wrap_triton

from sparsefocus.attention.common import SCORE_KINDS, check_sink_key, check_slot_weight, indexed_attention_ref
from sparsefocus.kernels import interpreter_compat  # noqa: F401  (CPU interpreter fix)
from sparsefocus.kernels._ops import absent, lse_from_log2, lse_from_weight_sum, op_name, traced_setup, triton_op_chosen
from sparsefocus.kernels.scan import mean_rows, mean_rows_traced, scaled_scan_op, scaled_scan_traced

LOG2E = 1.4426950408889634
SCORE_CODES = {name: code for code, name in enumerate(SCORE_KINDS)}  # dot 0, neg_sqeuclid 1, cauchy 2


@triton.jit
def _slot_weights(q, kt, idx, gamma_sq, scale, SCORE: tl.constexpr):
    """Scores (log2 units, softmax kinds) or Cauchy weights of q [BM, BD] against kt [BM, BK, BD].

    Returns (s [BM, BK] fp32, diff [BM, BK, BD] = q - k, or kt itself for dot scores)."""
    valid = idx >= 0
    if SCORE == 0:
        s = tl.sum(q[:, None, :] * kt, axis=2) * (scale * 1.4426950408889634)
        s = tl.where(valid, s, float("-inf"))
        return s, kt
    diff = q[:, None, :] - kt  # [BM, BK, BD]
    sq_dist = tl.sum(diff * diff, axis=2)  # [BM, BK]
    if SCORE == 1:
        s = tl.where(valid, -sq_dist * (scale * 1.4426950408889634), float("-inf"))
    else:
        s = tl.where(valid, 1.0 / (sq_dist + gamma_sq), 0.0)
    return s, diff


@triton.jit
def _accumulate(m_i, l_i, acc, s, vt, a, SCORE: tl.constexpr, HAS_SW: tl.constexpr):
    """Online-softmax (or Cauchy sum) update of (max, sum, acc) with weights s [BM, BK], values vt
    [BM, BK, BDV]; with HAS_SW the values are weighted by p * a (a [BM, BK], the slot weights)
    while the sum takes p alone."""
    if SCORE == 2:
        p = s
    else:
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha
        acc = acc * alpha[:, None]
        m_i = m_new
    l_i += tl.sum(p, axis=1)
    if HAS_SW:
        p = p * a
    acc += tl.sum(p[:, :, None] * vt, axis=1)
    return m_i, l_i, acc


@triton.jit
def _slot_grads(q, s, diff, vt, do, delta, stat, inv_total, scale, a, SCORE: tl.constexpr, HAS_SW: tl.constexpr):
    """Gradients of one tile of slots: (the values' weights p (* a) [BM, BK], d gamma^2 [BM], dq
    [BM, BD], coef [BM, BK], the pairs' key coefficients: ``_key_terms`` makes them dk terms).
    With HAS_SW a slot's output weight is a * p: its dp is a * dO.v, and delta = dO.o is still
    sum_j p_j dp_j."""
    dp = tl.sum(do[:, None, :] * vt, axis=2)  # [BM, BK]
    if HAS_SW:
        dp = dp * a
    if SCORE == 2:
        p = s * inv_total[:, None]
        d_sq = -(dp - delta[:, None]) * s * p  # d loss / d squared distance = -(dp - delta) w^2 / S
        dgamma_sq = tl.sum(d_sq, axis=1)
        coef = 2.0 * d_sq  # d loss / d (q - k) = 2 d_sq (q - k)
    else:
        p = tl.exp2(s - stat[:, None])
        ds = p * (dp - delta[:, None])
        dgamma_sq = tl.sum(ds * 0.0, axis=1)
        if SCORE == 0:
            coef = ds * scale
        else:
            coef = -2.0 * scale * ds
    dq = tl.sum(coef[:, :, None] * diff, axis=1)
    if HAS_SW:
        p = p * a
    return p, dgamma_sq, dq, coef


@triton.jit
def _key_terms(coef, q, diff, SCORE: tl.constexpr):
    """The pairs' dk terms [BM, BK, BD]: coef * q (dot scores), -coef * (q - k) (distances)."""
    if SCORE == 0:
        dk = coef[:, :, None] * q[:, None, :]
    else:
        dk = -coef[:, :, None] * diff
    return dk


@triton.jit
def _slot_factors(SW, row_offs, row_ok, slots, NUM_SLOTS, HAS_SW: tl.constexpr):
    """The slot weights [BM, BK] fp32 of these rows and slots (HAS_SW), else a placeholder of the
    same shape and type (the callers do not read it)."""
    ok = row_ok[:, None] & (slots[None, :] < NUM_SLOTS)
    if HAS_SW:
        a = tl.load(SW + row_offs[:, None] * NUM_SLOTS + slots[None, :], mask=ok, other=0.0).to(tl.float32)
    else:
        a = ok.to(tl.float32)
    return a


@triton.jit
def _sink_weights(q, SINK, hq, gamma_sq, D: tl.constexpr, BLOCK_D: tl.constexpr):
    """(Cauchy weight [BM] of the query head's sink key for each query of q [BM, BD], diff
    [BM, BD] = q - sink)."""
    offs_d = tl.arange(0, BLOCK_D)
    sink = tl.load(SINK + hq * D + offs_d, mask=offs_d < D, other=0.0).to(tl.float32)  # [BD]
    diff = q - sink[None, :]
    return 1.0 / (tl.sum(diff * diff, axis=1) + gamma_sq), diff


@triton.jit
def _extra_offsets(bh, rows, HQ, EGROUP, SB, SH, SN):
    """Flat element offsets [BM] of the extra slot's rows (strided: expanded tensors are not copied)."""
    b, h = bh // HQ, (bh % HQ) // EGROUP
    return b.to(tl.int64) * SB + h.to(tl.int64) * SH + rows.to(tl.int64) * SN


@triton.jit
def _query_tile(Q, N, HQ, GROUP, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    """This program's (batch x query head bh, its kv head's flat index, rows [BM], row_ok, flat
    row numbers [BM], q tile [BM, BD] fp32): BLOCK_M consecutive queries of one head."""
    pid_m, bh = tl.program_id(0), tl.program_id(1)
    kv_bh = (bh // HQ) * (HQ // GROUP) + (bh % HQ) // GROUP
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < N
    row_offs = bh.to(tl.int64) * N + rows  # [BM] flat row number
    offs_d = tl.arange(0, BLOCK_D)
    q = tl.load(Q + row_offs[:, None] * D + offs_d[None, :], mask=row_ok[:, None] & (offs_d[None, :] < D), other=0.0).to(
        tl.float32
    )
    return bh, kv_bh, rows, row_ok, row_offs, q


@triton.jit
def _indexed_fwd_kernel(
    Q,
    K,
    V,
    IDX,
    GAMMA_SQ,
    OUT,
    STAT,
    EK,
    EV,
    EMASK,
    SINK,
    SW,
    N,
    M,
    NUM_SLOTS,
    HQ,
    GROUP,
    scale,
    EGROUP,
    EK_SB,
    EK_SH,
    EK_SN,
    EV_SB,
    EV_SH,
    EV_SN,
    G_SB,
    S_SB,
    D: tl.constexpr,
    DV: tl.constexpr,
    SCORE: tl.constexpr,
    HAS_EXTRA: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    HAS_SINK: tl.constexpr,
    HAS_SW: tl.constexpr,
):
    bh, kv_bh, rows, row_ok, row_offs, q = _query_tile(Q, N, HQ, GROUP, D, BLOCK_M, BLOCK_D)
    offs_d, offs_dv = tl.arange(0, BLOCK_D), tl.arange(0, BLOCK_DV)
    gamma_sq = tl.load(GAMMA_SQ + (bh // HQ) * G_SB + bh % HQ)  # G_SB: 0 (per head) or HQ (per batch row)
    k_base, v_base = K + kv_bh.to(tl.int64) * M * D, V + kv_bh.to(tl.int64) * M * DV
    m_i = tl.full([BLOCK_M], -1e30, tl.float32)  # finite start: all-masked tiles give exp(-inf) = 0
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    if HAS_SINK:  # Cauchy only: a zero-value key, so only the normaliser grows
        l_i += tl.where(row_ok, _sink_weights(q, SINK + (bh // HQ) * S_SB, bh % HQ, gamma_sq, D, BLOCK_D)[0], 0.0)
    if HAS_EXTRA:
        e_ok = row_ok & (tl.load(EMASK + row_offs, mask=row_ok, other=0) != 0)
        e_idx = tl.where(e_ok, 0, -1)[:, None]  # [BM, 1]
        ek_offs = _extra_offsets(bh, rows, HQ, EGROUP, EK_SB, EK_SH, EK_SN)
        ev_offs = _extra_offsets(bh, rows, HQ, EGROUP, EV_SB, EV_SH, EV_SN)
        ekt = tl.load(
            EK + ek_offs[:, None, None] + offs_d[None, None, :], mask=e_ok[:, None, None] & (offs_d[None, None, :] < D), other=0.0
        ).to(tl.float32)
        evt = tl.load(
            EV + ev_offs[:, None, None] + offs_dv[None, None, :],
            mask=e_ok[:, None, None] & (offs_dv[None, None, :] < DV),
            other=0.0,
        ).to(tl.float32)
        s_x = _slot_weights(q, ekt, e_idx, gamma_sq, scale, SCORE)[0]  # names apart from the loop's: types differ
        m_i, l_i, acc = _accumulate(m_i, l_i, acc, s_x, evt, s_x, SCORE, False)
    for start in range(0, NUM_SLOTS, BLOCK_K):
        slots = start + tl.arange(0, BLOCK_K)
        idx = tl.load(
            IDX + row_offs[:, None] * NUM_SLOTS + slots[None, :], mask=row_ok[:, None] & (slots[None, :] < NUM_SLOTS), other=-1
        )
        valid = (idx >= 0)[:, :, None]
        kt = tl.load(
            k_base + idx[:, :, None] * D + offs_d[None, None, :], mask=valid & (offs_d[None, None, :] < D), other=0.0
        ).to(tl.float32)
        vt = tl.load(
            v_base + idx[:, :, None] * DV + offs_dv[None, None, :], mask=valid & (offs_dv[None, None, :] < DV), other=0.0
        ).to(tl.float32)
        s, _ = _slot_weights(q, kt, idx, gamma_sq, scale, SCORE)
        a = _slot_factors(SW, row_offs, row_ok, slots, NUM_SLOTS, HAS_SW)
        m_i, l_i, acc = _accumulate(m_i, l_i, acc, s, vt, a, SCORE, HAS_SW)
    has_key = l_i > 0
    out = acc / tl.where(has_key, l_i, 1.0)[:, None]
    tl.store(
        OUT + row_offs[:, None] * DV + offs_dv[None, :],
        out.to(OUT.dtype.element_ty),
        mask=row_ok[:, None] & (offs_dv[None, :] < DV),
    )
    if SCORE == 2:
        stat = l_i  # Cauchy: the sum of weights (0 for empty rows)
    else:
        stat = tl.where(
            has_key, m_i + tl.log2(tl.where(has_key, l_i, 1.0)), float("inf")
        )  # log2-sum-exp; +inf zeroes empty rows in backward
    tl.store(STAT + row_offs, stat, mask=row_ok)


@triton.jit
def _indexed_bwd_kernel(
    Q,
    K,
    V,
    IDX,
    GAMMA_SQ,
    OUT,
    DOUT,
    STAT,
    DQ,
    DK,
    DV_,
    DGAMMA,
    EK,
    EV,
    EMASK,
    DEK,
    DEV,
    DELTA,
    SINK,
    DSINK,
    SW,
    PCOEF,
    PPROB,
    N,
    M,
    NUM_SLOTS,
    HQ,
    GROUP,
    scale,
    EGROUP,
    EK_SB,
    EK_SH,
    EK_SN,
    EV_SB,
    EV_SH,
    EV_SN,
    G_SB,
    S_SB,
    D: tl.constexpr,
    DV: tl.constexpr,
    SCORE: tl.constexpr,
    HAS_EXTRA: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    KEY_MODE: tl.constexpr,
    HAS_SINK: tl.constexpr,
    DK_ROW: tl.constexpr,
    HAS_SW: tl.constexpr,
):
    bh, kv_bh, rows, row_ok, row_offs, q = _query_tile(Q, N, HQ, GROUP, D, BLOCK_M, BLOCK_D)
    offs_d, offs_dv = tl.arange(0, BLOCK_D), tl.arange(0, BLOCK_DV)
    d_ok, dv_ok = offs_d < D, offs_dv < DV
    o_ptrs = row_offs[:, None] * DV + offs_dv[None, :]
    o = tl.load(OUT + o_ptrs, mask=row_ok[:, None] & dv_ok[None, :], other=0.0).to(tl.float32)
    do = tl.load(DOUT + o_ptrs, mask=row_ok[:, None] & dv_ok[None, :], other=0.0).to(tl.float32)
    delta = tl.sum(o * do, axis=1)  # [BM]: sum_j p_j dp_j
    if KEY_MODE == 1:  # indexed_csr.key_grads needs it per query
        tl.store(DELTA + row_offs, delta, mask=row_ok)
    stat = tl.load(STAT + row_offs, mask=row_ok, other=0.0)
    gamma_sq = tl.load(GAMMA_SQ + (bh // HQ) * G_SB + bh % HQ)  # G_SB: 0 (per head) or HQ (per batch row)
    inv_total = 1.0 / tl.where(stat > 0, stat, 1.0)
    k_base, v_base = kv_bh.to(tl.int64) * M * D, kv_bh.to(tl.int64) * M * DV
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    dgamma_sq = tl.zeros([BLOCK_M], tl.float32)
    if HAS_SINK:  # value 0, so dp = 0 and d loss / d squared distance = delta w^2 / S
        w_s, diff_s = _sink_weights(q, SINK + (bh // HQ) * S_SB, bh % HQ, gamma_sq, D, BLOCK_D)
        d_sq = tl.where(row_ok, delta * w_s * w_s * inv_total, 0.0)  # [BM]
        dgamma_sq += d_sq
        dq += (2.0 * d_sq)[:, None] * diff_s
        tl.store(
            DSINK + row_offs[:, None] * D + offs_d[None, :], (-2.0 * d_sq)[:, None] * diff_s, mask=row_ok[:, None] & d_ok[None, :]
        )
    if HAS_EXTRA:
        e_ok = row_ok & (tl.load(EMASK + row_offs, mask=row_ok, other=0) != 0)
        e_idx = tl.where(e_ok, 0, -1)[:, None]  # [BM, 1]
        ek_offs = _extra_offsets(bh, rows, HQ, EGROUP, EK_SB, EK_SH, EK_SN)
        ev_offs = _extra_offsets(bh, rows, HQ, EGROUP, EV_SB, EV_SH, EV_SN)
        ek_mask, ev_mask = e_ok[:, None, None] & d_ok[None, None, :], e_ok[:, None, None] & dv_ok[None, None, :]
        ekt = tl.load(EK + ek_offs[:, None, None] + offs_d[None, None, :], mask=ek_mask, other=0.0).to(tl.float32)
        evt = tl.load(EV + ev_offs[:, None, None] + offs_dv[None, None, :], mask=ev_mask, other=0.0).to(tl.float32)
        s_x, diff_x = _slot_weights(q, ekt, e_idx, gamma_sq, scale, SCORE)  # names apart from the loop's: types differ
        p_x, dg_x, dq_x, coef_x = _slot_grads(q, s_x, diff_x, evt, do, delta, stat, inv_total, scale, s_x, SCORE, False)
        dgamma_sq += dg_x
        dq += dq_x
        tl.store(
            DEK + row_offs[:, None, None] * D + offs_d[None, None, :],
            _key_terms(coef_x, q, diff_x, SCORE),
            mask=row_ok[:, None, None] & d_ok[None, None, :],
        )
        tl.store(
            DEV + row_offs[:, None, None] * DV + offs_dv[None, None, :],
            p_x[:, :, None] * do[:, None, :],
            mask=row_ok[:, None, None] & dv_ok[None, None, :],
        )
    for start in range(0, NUM_SLOTS, BLOCK_K):
        slots = start + tl.arange(0, BLOCK_K)
        idx = tl.load(
            IDX + row_offs[:, None] * NUM_SLOTS + slots[None, :], mask=row_ok[:, None] & (slots[None, :] < NUM_SLOTS), other=-1
        )
        valid = (idx >= 0)[:, :, None]
        k_offs = k_base + idx[:, :, None] * D + offs_d[None, None, :]
        v_offs = v_base + idx[:, :, None] * DV + offs_dv[None, None, :]
        k_mask, v_mask = valid & d_ok[None, None, :], valid & dv_ok[None, None, :]
        kt = tl.load(K + k_offs, mask=k_mask, other=0.0).to(tl.float32)
        vt = tl.load(V + v_offs, mask=v_mask, other=0.0).to(tl.float32)
        s, diff = _slot_weights(q, kt, idx, gamma_sq, scale, SCORE)
        a = _slot_factors(SW, row_offs, row_ok, slots, NUM_SLOTS, HAS_SW)
        p, dg, dq_tile, coef = _slot_grads(q, s, diff, vt, do, delta, stat, inv_total, scale, a, SCORE, HAS_SW)
        dgamma_sq += dg
        dq += dq_tile
        if KEY_MODE == 0:  # atomic adds per pair
            dk_offs = kv_bh.to(tl.int64) * M * DK_ROW + idx[:, :, None] * DK_ROW + offs_d[None, None, :]
            tl.atomic_add(DK + dk_offs, _key_terms(coef, q, diff, SCORE), mask=k_mask, sem="relaxed")
            tl.atomic_add(DV_ + v_offs, p[:, :, None] * do[:, None, :], mask=v_mask, sem="relaxed")
        if KEY_MODE == 2:  # the pairs' coefficients for indexed_short.short_key_grads
            pair_offs = row_offs[:, None] * NUM_SLOTS + slots[None, :]
            pair_ok = row_ok[:, None] & (slots[None, :] < NUM_SLOTS)
            tl.store(PCOEF + pair_offs, coef, mask=pair_ok)
            tl.store(PPROB + pair_offs, p, mask=pair_ok)
    tl.store(DQ + row_offs[:, None] * D + offs_d[None, :], dq.to(DQ.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    if SCORE == 2:
        tl.store(DGAMMA + row_offs, dgamma_sq, mask=row_ok)


def _blocks(d: int, dv: int, backward: bool) -> dict:
    """Tile sizes: a [BLOCK_M, BLOCK_K, D] gathered tile of at most 8K (forward) / 1K (backward) elements."""
    block_d, block_dv = triton.next_power_of_2(d), triton.next_power_of_2(dv)
    widest = max(block_d, block_dv)
    if backward and block_d <= 16:  # narrow q/k (ZETA): 16 rows x 1 slot, 2 warps: 13.5 ms at N=64K (16 x 2: 14.1)
        return dict(BLOCK_M=16, BLOCK_K=1, BLOCK_D=block_d, BLOCK_DV=block_dv, num_warps=2)
    if backward:  # smaller tiles measured faster on the H200 (atomics dominate): 16 x 4 slots
        return dict(BLOCK_M=16, BLOCK_K=max(1, min(4, 256 // widest)), BLOCK_D=block_d, BLOCK_DV=block_dv, num_warps=4)
    # narrow q/k (ZETA's 3): 2 warps, 2.9 ms at N=64K (32 rows, 4 warps: 3.1; 16 rows with 4 warps was 17% slower than that)
    warps = 2 if block_d <= 16 else 4
    return dict(BLOCK_M=16, BLOCK_K=max(1, min(16, 512 // widest)), BLOCK_D=block_d, BLOCK_DV=block_dv, num_warps=warps)


TILE_OVERRIDES: dict[str, dict] = {}
"""Benchmark hook: {"fwd": {...}, "bwd": {...}} tile sizes replacing ``_blocks``' choice."""


KEY_MODES = {"atomic": 0, "inverse": 1, "short": 2}  # the backward kernel's KEY_MODE


def _launch_args(q: Tensor, k: Tensor, v: Tensor, index: Tensor, backward: bool, scatter: bool = True) -> tuple[tuple, dict]:
    """Grid, sizes and tiles; a backward that does not scatter dk, dv (KEY_GRADS "inverse",
    "short") is a gather like the forward and starts from the forward's tiles (a guess, not tuned)."""
    batch, q_heads, n_queries, dim = q.shape
    blocks = _blocks(dim, v.shape[-1], backward and scatter) | TILE_OVERRIDES.get("bwd" if backward else "fwd", {})
    grid = (triton.cdiv(n_queries, blocks["BLOCK_M"]), batch * q_heads)
    sizes = (n_queries, k.shape[2], index.shape[-1], q_heads, q_heads // k.shape[1])
    return (grid, sizes), blocks


def _extra_args(q: Tensor, extra: "Extra | None") -> tuple[tuple, dict]:
    """Kernel arguments of the extra slot: pointers (dummies when absent), group and strides."""
    if extra is None:
        return (q, q, q), dict(sizes=(1, 0, 0, 0, 0, 0, 0), HAS_EXTRA=False)
    group = q.shape[1] // extra.key.shape[1]
    strides = (*extra.key.stride()[:3], *extra.value.stride()[:3])
    return (extra.key, extra.value, extra.mask), dict(sizes=(group, *strides), HAS_EXTRA=True)


def _row_strides(gamma_sq: Tensor, sink: Tensor | None) -> dict[str, int]:
    """The kernels' batch strides of gamma^2 (G_SB) and the sink keys (S_SB): 0 for one value per
    head ([Hq], [Hq, D]), a row's size for one per batch row and head ([B, Hq], [B, Hq, D])."""
    per_row_sink = sink is not None and sink.dim() == 3
    return dict(G_SB=gamma_sq.shape[-1] if gamma_sq.dim() == 2 else 0, S_SB=sink.shape[1] * sink.shape[2] if per_row_sink else 0)


def _indexed_forward(
    q, k, v, index, gamma_sq, scale, score_code, extra=None, sink=None, slot_weight=None, kernel=_indexed_fwd_kernel
) -> tuple[Tensor, Tensor]:
    """Launch the forward kernel (gamma_sq [Hq] or [B, Hq]; sink: [Hq, D], [B, Hq, D] or None;
    slot_weight: [B, Hq, N, K] or None; ``kernel``: ``wrap_triton`` of it in the ``triton_op`` twins).
    Returns out [B, Hq, N, Dv] (q.dtype) and stat [B, Hq, N] fp32."""
    batch, q_heads, n_queries, _ = q.shape
    out = torch.empty(batch, q_heads, n_queries, v.shape[-1], dtype=q.dtype, device=q.device)
    stat = torch.empty(batch, q_heads, n_queries, dtype=torch.float32, device=q.device)
    (grid, sizes), blocks = _launch_args(q, k, v, index, backward=False)
    pointers, extra_kw = _extra_args(q, extra)
    kernel[grid](
        q,
        k,
        v,
        index,
        gamma_sq,
        out,
        stat,
        *pointers,
        q if sink is None else sink,
        q if slot_weight is None else slot_weight,
        *sizes,
        scale,
        *extra_kw["sizes"],
        D=q.shape[-1],
        DV=v.shape[-1],
        SCORE=score_code,
        HAS_EXTRA=extra_kw["HAS_EXTRA"],
        HAS_SINK=sink is not None,
        HAS_SW=slot_weight is not None,
        **_row_strides(gamma_sq, sink),
        **blocks,
    )
    return out, stat


KEY_GRADS = "atomic"
"""How dk and dv are summed: "atomic" (fp32 atomic adds per (query, slot), the default),
"inverse" (``indexed_csr``: an inverse index, then per-key sums in registers) or "short"
(``indexed_short``: the pairs' coefficients, then one-hot tiles over every query row; O(N M K)
work, for rows of at most ``SHORT_KEY_GRADS_MAX_KEYS`` keys, atomics above; its sums run in a
fixed order, so repeated calls give identical gradients). Every mode takes every score kind,
with or without slot weights, and is tested against the reference. On the H200 at ZETA's 64K
(Cauchy) the inverse was 27% slower than the atomics, with 528 MB less memory
(``benchmarks/results/zeta_candidates_ab.json``). At the lab's ListOps shape ([250, 1, 601, 64]
bf16, 5 keys a row) "short" took 2.5 ms a call for dk and dv alone, where the atomic kernel's
whole forward and backward took 1.5 ms (``h200_lab_fast_attention_cc65061.json``,
``h200_lab_band_bloc_5580fed.json``): the atomics stay the default."""

SHORT_KEY_GRADS_MAX_KEYS = 1024
"""Longest key rows (M) that ``KEY_GRADS`` "short" sums by one-hot tiles; longer rows use the
atomics, since the one-hot work grows with N M per head."""

KEY_GRADS_MODES = ("atomic", "inverse", "short")


def key_grads_mode(n_keys: int, choice: str = "") -> str:
    """The way a call sums dk and dv: ``choice`` (the call's ``key_grads``), or ``KEY_GRADS`` when
    it is "", with "short" falling back to "atomic" for rows longer than
    ``SHORT_KEY_GRADS_MAX_KEYS``. ValueError for an unknown mode."""
    mode = choice or KEY_GRADS
    if mode not in KEY_GRADS_MODES:
        raise ValueError(f"key gradients must be one of {', '.join(KEY_GRADS_MODES)} (indexed.KEY_GRADS), got {mode!r}")
    if mode == "short" and n_keys > SHORT_KEY_GRADS_MAX_KEYS:
        return "atomic"
    return mode


class _Grads(NamedTuple):
    """Output buffers of the backward kernel (None or a (1,) placeholder for what it does not write)."""

    dq: Tensor  # [B, Hq, N, D] q.dtype
    dk: Tensor  # [B, Hk, M, dk_row(D)] fp32 (atomic key gradients; columns D.. unused)
    dv: Tensor  # [B, Hk, M, Dv] fp32 (atomic key gradients)
    dgamma_sq: Tensor  # [B, Hq, N] fp32
    d_extra_k: Tensor | None  # [B, Hq, N, D] fp32
    d_extra_v: Tensor | None  # [B, Hq, N, Dv] in the extra value's dtype
    delta: Tensor  # [B, Hq, N] fp32 sum(o * dO) (inverse key gradients)
    d_sink: Tensor | None  # [B, Hq, N, D] fp32, per row
    pair_coef: Tensor  # [B, Hq, N, K] fp32 per (query, slot): dk term coef q (dot), -coef (q - k) (distances)
    pair_prob: Tensor  # [B, Hq, N, K] fp32 the values' weights per (query, slot) (short key gradients)


def dk_row(d: int) -> int:
    """Floats per row of the atomic dk buffer: d rounded up to a multiple of 4, so that rows start
    on 16-byte boundaries and a row of 3 (ZETA's q/k width) never straddles two 32-byte sectors,
    the unit of the L2's atomics (the backward is bound by them: 12.5 ms with, 3.7 ms without
    at ZETA's 64K on the H200, benchmarks/zeta_bwd_parts.py)."""
    return -(-d // 4) * 4


def _grad_buffers(
    q: Tensor, k: Tensor, v: Tensor, index: Tensor, extra: "Extra | None", sink: Tensor | None, mode: str, cauchy: bool
) -> _Grads:
    fp32 = dict(dtype=torch.float32, device=q.device)
    rows = q.shape[:3]
    unused = torch.empty(1, **fp32)
    atomic, short = mode == "atomic", mode == "short"
    return _Grads(
        dq=torch.empty_like(q),
        dk=torch.zeros(*k.shape[:3], dk_row(k.shape[-1]), **fp32) if atomic else unused,
        dv=torch.zeros(v.shape, **fp32) if atomic else unused,
        dgamma_sq=torch.empty(rows, **fp32) if cauchy else unused,  # every row stored once (Cauchy scores only)
        d_extra_k=None if extra is None else torch.empty(*rows, q.shape[-1], **fp32),
        d_extra_v=None if extra is None else torch.empty(*rows, v.shape[-1], dtype=extra.value.dtype, device=q.device),
        delta=torch.empty(rows, **fp32) if mode == "inverse" else unused,
        d_sink=None if sink is None else torch.empty(*rows, q.shape[-1], **fp32),
        pair_coef=torch.empty(index.shape, **fp32) if short else unused,
        pair_prob=torch.empty(index.shape, **fp32) if short else unused,
    )


def _indexed_backward(
    q, k, v, index, gamma_sq, out, grad_out, stat, scale, score_code, extra, sink, cast, slot_weight, key_grads, kernel=None
):
    """Launch the backward kernel(s) (``kernel``: ``wrap_triton`` of the main one in the
    ``triton_op`` twin; default: the kernel), dk and dv summed as ``key_grads`` says ("" = ``KEY_GRADS``).
    Returns dq, dk, dv (input dtypes; with ``cast`` False dk and dv in fp32 as summed), d gamma^2
    per head [Hq] fp32, the extra slot's d key [B, Hq, N, D], d value [B, Hq, N, Dv] (None
    without extra) and the sink's d key fp32 shaped as the sink (None without sink)."""
    mode = key_grads_mode(k.shape[2], key_grads)
    cauchy = score_code == SCORE_CODES["cauchy"]  # the only score that reads gamma
    g = _grad_buffers(q, k, v, index, extra, sink, mode, cauchy)
    (grid, sizes), blocks = _launch_args(q, k, v, index, backward=True, scatter=mode == "atomic")
    pointers, extra_kw = _extra_args(q, extra)
    optional = [q if x is None else x for x in (g.d_extra_k, g.d_extra_v, g.delta, sink, g.d_sink)]  # q: a dummy pointer
    (kernel or _indexed_bwd_kernel)[grid](
        q,
        k,
        v,
        index,
        gamma_sq,
        out,
        grad_out,
        stat,
        g.dq,
        g.dk,
        g.dv,
        g.dgamma_sq,
        *pointers,
        *optional,
        q if slot_weight is None else slot_weight,
        g.pair_coef,
        g.pair_prob,
        *sizes,
        scale,
        *extra_kw["sizes"],
        D=q.shape[-1],
        DV=v.shape[-1],
        SCORE=score_code,
        HAS_EXTRA=extra_kw["HAS_EXTRA"],
        KEY_MODE=KEY_MODES[mode],
        HAS_SINK=sink is not None,
        DK_ROW=dk_row(q.shape[-1]),
        HAS_SW=slot_weight is not None,
        **_row_strides(gamma_sq, sink),
        **blocks,
    )
    dk, dv = g.dk[..., : k.shape[-1]], g.dv
    if mode == "inverse":
        from sparsefocus.kernels.indexed_csr import key_grads

        dk, dv = key_grads(q, k, v, index, gamma_sq, grad_out, stat, g.delta, scale, score_code, slot_weight)
    if mode == "short":
        from sparsefocus.kernels.indexed_short import short_key_grads

        dk, dv = short_key_grads(q, k, v, grad_out, index, g.pair_coef, g.pair_prob, score_code)
    d_sink = None if sink is None else g.d_sink.sum(dim=2 if sink.dim() == 3 else (0, 2))  # as sink: [(B,) Hq, D]
    if cast:
        dk, dv = dk.to(k.dtype), dv.to(v.dtype)
    if cauchy:
        dgamma_sq = g.dgamma_sq.sum(dim=2 if gamma_sq.dim() == 2 else (0, 2))  # as gamma_sq: [(B,) Hq]
    else:
        dgamma_sq = torch.zeros(gamma_sq.shape, dtype=torch.float32, device=q.device)
    return g.dq, dk, dv, dgamma_sq, g.d_extra_k, g.d_extra_v, d_sink


class Extra(NamedTuple):
    """The extra slot as the kernels read it: key [B, He, N, D], value [B, He, N, Dv] (strided, last
    dim contiguous, He = Hq or Hk) and mask [B, Hq, N] int8 (contiguous)."""

    key: Tensor
    value: Tensor
    mask: Tensor


def _group_sum(grad: Tensor, heads: int) -> Tensor:
    """[B, Hq, N, X] per-query-head gradient -> [B, heads, N, X], summing each head group."""
    batch, q_heads, n, width = grad.shape
    return grad if heads == q_heads else grad.view(batch, heads, q_heads // heads, n, width).sum(2)


def _op_extra(q: Tensor, extra_key: Tensor | None, extra_value: Tensor | None, extra_mask: Tensor | None) -> Extra | None:
    """The extra slot as the kernels read it (last dim dense, mask int8 [B, Hq, N], every row if
    None), or None without one."""
    if extra_key is None or extra_value is None:
        return None
    key, value = (x if x.stride(-1) == 1 else x.contiguous() for x in (extra_key, extra_value))
    mask = torch.ones(q.shape[:3], dtype=torch.int8, device=q.device) if extra_mask is None else extra_mask.contiguous()
    return Extra(key, value, mask)


def _dense(*tensors: Tensor | None) -> tuple:
    return tuple(None if x is None else x.contiguous() for x in tensors)


@torch.library.custom_op(op_name("indexed_fwd"), mutates_args=())
def indexed_fwd(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    index: Tensor,
    gamma_sq: Tensor,
    extra_key: Tensor | None,
    extra_value: Tensor | None,
    extra_mask: Tensor | None,
    sink: Tensor | None,
    scale: float,
    score_code: int,
    slot_weight: Tensor | None = None,
    key_grads: str = "",
) -> tuple[Tensor, Tensor]:
    """``sparsefocus::indexed_fwd``: out [B, Hq, N, Dv] (q.dtype) and the row statistic stat
    [B, Hq, N] fp32 (softmax kinds: base-2 log-sum-exp, +inf for a row with no key; Cauchy: the
    sum of the weights). q, k, v in one dtype, index int32 [B, Hq, N, K], gamma_sq [Hq] or
    [B, Hq] fp32, extra key/value [B, He, N, *] (any strides), extra_mask int8 [B, Hq, N], sink
    [Hq, D] or [B, Hq, D] fp32,
    slot_weight fp32 [B, Hq, N, K] (factors on the listed slots' normalised weights), key_grads:
    how the backward sums dk and dv ("" = ``KEY_GRADS``). Differentiable in q, k, v, gamma_sq,
    extra key/value and sink (backward: ``indexed_bwd``); stat and slot_weight get no gradient."""
    return _fwd_body(q, k, v, index, gamma_sq, extra_key, extra_value, extra_mask, sink, scale, score_code, slot_weight)


def _fwd_body(
    q, k, v, index, gamma_sq, extra_key, extra_value, extra_mask, sink, scale, score_code, slot_weight, kernel=_indexed_fwd_kernel
) -> tuple[Tensor, Tensor]:
    q, k, v, index, gamma_sq, sink, slot_weight = _dense(q, k, v, index, gamma_sq, sink, slot_weight)
    extra = _op_extra(q, extra_key, extra_value, extra_mask)
    return _indexed_forward(q, k, v, index, gamma_sq, scale, score_code, extra, sink, slot_weight, kernel)


@indexed_fwd.register_fake
def _indexed_fwd_fake(
    q, k, v, index, gamma_sq, extra_key, extra_value, extra_mask, sink, scale, score_code, slot_weight=None, key_grads=""
):
    return q.new_empty(*q.shape[:3], v.shape[-1]), q.new_empty(q.shape[:3], dtype=torch.float32)


@torch.library.custom_op(op_name("indexed_bwd"), mutates_args=())
def indexed_bwd(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    index: Tensor,
    gamma_sq: Tensor,
    out: Tensor,
    grad_out: Tensor,
    stat: Tensor,
    extra_key: Tensor | None,
    extra_value: Tensor | None,
    extra_mask: Tensor | None,
    sink: Tensor | None,
    scale: float,
    score_code: int,
    cast: bool,
    slot_weight: Tensor | None = None,
    key_grads: str = "",
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``sparsefocus::indexed_bwd``: (dq, dk, dv, d gamma_sq fp32 shaped as gamma_sq, d extra_key,
    d extra_value, d sink fp32 shaped as sink), extra and sink gradients [0] when absent. With ``cast`` dk, dv and d
    extra_key come in their inputs' dtypes, else fp32 as summed (for a caller that adds more
    into them); d extra_value is always in its input's dtype. ``key_grads``: how dk and dv are
    summed ("" = the module setting ``KEY_GRADS``)."""
    args = (q, k, v, index, gamma_sq, out, grad_out, stat, extra_key, extra_value, extra_mask, sink, scale, score_code, cast)
    return _bwd_body(*args, slot_weight, key_grads)


def _bwd_body(
    q,
    k,
    v,
    index,
    gamma_sq,
    out,
    grad_out,
    stat,
    extra_key,
    extra_value,
    extra_mask,
    sink,
    scale,
    score_code,
    cast,
    slot_weight,
    key_grads,
    kernel=None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    q, k, v, index, gamma_sq, out, grad_out, stat, sink, slot_weight = _dense(
        q, k, v, index, gamma_sq, out, grad_out, stat, sink, slot_weight
    )
    extra = _op_extra(q, extra_key, extra_value, extra_mask)
    dq, dk, dv, dgamma_sq, d_extra_k, d_extra_v, d_sink = _indexed_backward(
        q, k, v, index, gamma_sq, out, grad_out, stat, scale, score_code, extra, sink, cast, slot_weight, key_grads, kernel
    )
    key_dtypes = (k.dtype, v.dtype) if cast else (torch.float32, torch.float32)
    dk, dv = dk.to(key_dtypes[0]).contiguous(), dv.to(key_dtypes[1]).contiguous()
    if extra is None:
        d_extra_k, d_extra_v = absent(q), absent(q)
    else:
        d_extra_k = _group_sum(d_extra_k, extra.key.shape[1]).to(extra.key.dtype if cast else torch.float32)
        d_extra_v = _group_sum(d_extra_v, extra.value.shape[1]).to(extra.value.dtype)
    return dq, dk, dv, dgamma_sq, d_extra_k, d_extra_v, absent(q) if d_sink is None else d_sink


@indexed_bwd.register_fake
def _indexed_bwd_fake(
    q,
    k,
    v,
    index,
    gamma_sq,
    out,
    grad_out,
    stat,
    extra_key,
    extra_value,
    extra_mask,
    sink,
    scale,
    score_code,
    cast,
    slot_weight=None,
    key_grads="",
):
    key_dtypes = (k.dtype, v.dtype) if cast else (torch.float32, torch.float32)
    grads = [q.new_empty(q.shape), k.new_empty(k.shape, dtype=key_dtypes[0]), v.new_empty(v.shape, dtype=key_dtypes[1])]
    grads.append(q.new_empty(gamma_sq.shape, dtype=torch.float32))
    if extra_key is None or extra_value is None:
        grads += [q.new_empty(0), q.new_empty(0)]
    else:
        grads.append(q.new_empty(extra_key.shape, dtype=extra_key.dtype if cast else torch.float32))
        grads.append(q.new_empty(extra_value.shape, dtype=extra_value.dtype))
    grads.append(q.new_empty(0) if sink is None else q.new_empty(sink.shape, dtype=torch.float32))
    return tuple(grads)


def _indexed_setup(ctx, inputs, output) -> None:
    q, k, v, index, gamma_sq, extra_key, extra_value, extra_mask, sink, scale, score_code, slot_weight, key_grads = inputs
    out, stat = output
    ctx.save_for_backward(q, k, v, index, gamma_sq, out, stat, extra_key, extra_value, extra_mask, sink, slot_weight)
    ctx.scale, ctx.score_code, ctx.key_grads = scale, score_code, key_grads
    ctx.set_materialize_grads(False)  # no zero gradient for stat


def _indexed_grads(ctx, grad_out: Tensor, grad_stat: Tensor | None):
    """Gradients of every differentiable input; stat is not differentiated (``grad_stat`` unused)."""
    q, k, v, index, gamma_sq, out, stat, extra_key, extra_value, extra_mask, sink, slot_weight = ctx.saved_tensors
    grad_out = torch.zeros_like(out) if grad_out is None else grad_out
    dq, dk, dv, dgamma_sq, d_extra_k, d_extra_v, d_sink = (indexed_bwd_traced if ctx.traced else indexed_bwd)(
        q,
        k,
        v,
        index,
        gamma_sq,
        out,
        grad_out,
        stat,
        extra_key,
        extra_value,
        extra_mask,
        sink,
        ctx.scale,
        ctx.score_code,
        True,
        slot_weight,
        ctx.key_grads,
    )
    has_extra = extra_key is not None
    extra_grads = (d_extra_k, d_extra_v) if has_extra else (None, None)
    return dq, dk, dv, None, dgamma_sq, *extra_grads, None, None if sink is None else d_sink, None, None, None, None


indexed_fwd.register_autograd(_indexed_grads, setup_context=traced_setup(_indexed_setup, False))


@torch.library.custom_op(op_name("indexed_causal_mean_fwd"), mutates_args=())
def indexed_causal_mean_fwd(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    index: Tensor,
    gamma_sq: Tensor,
    real: Tensor | None,
    sink: Tensor | None,
    scale: float,
    score_code: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``sparsefocus::indexed_causal_mean_fwd``: ``indexed_fwd`` whose extra slot is the causal
    mean of the real keys and values (``scan.scaled_scan``; real [B, N] bool, None: every key).
    Returns (out, stat, mean_k
    [B, Hk, N, D], mean_v [B, Hk, N, Dv], and the means' row scales real fp32 [B, N], 1 / count
    fp32 [B, N] and the extra slot's mask int8 [B, Hq, N]); the means and the scales are saved
    for the backward (so it need not recompute the scales) and get no gradient of their own.
    Differentiable in q, k, v, gamma_sq and sink.

    The backward adds the means' gradient scan straight into the fp32 dk, dv of the atomics and
    stores k's and v's dtype once, instead of a separate mean gradient, a cast and an add (a
    separate mean would cost 3.5 GB of traffic for dv at 64K x 64 heads x 64 columns in bf16;
    this, 1.5 GB)."""
    return _causal_mean_body(q, k, v, index, gamma_sq, real, sink, scale, score_code, False)


def _causal_mean_body(q, k, v, index, gamma_sq, real, sink, scale, score_code, traced: bool, kernel=_indexed_fwd_kernel):
    """The causal mean's forward; ``traced``: through the ``triton_op`` twins of the scan ops."""
    q, k, v, index, gamma_sq, sink = _dense(q, k, v, index, gamma_sq, sink)
    rows, scan = (mean_rows_traced, scaled_scan_traced) if traced else (mean_rows, scaled_scan_op)
    realf, inverse, mask = rows(k, real, q.shape[1])  # a row has a mean once a real key has been seen
    # [B, Hk, N, D], [B, Hk, N, Dv]
    mean_k, mean_v = scan(k, realf, inverse, None, False, k.dtype), scan(v, realf, inverse, None, False, v.dtype)
    extra = Extra(mean_k, mean_v, mask)
    out, stat = _indexed_forward(q, k, v, index, gamma_sq, scale, score_code, extra, sink, None, kernel)
    return out, stat, mean_k, mean_v, realf, inverse, mask


@indexed_causal_mean_fwd.register_fake
def _causal_mean_fake(q, k, v, index, gamma_sq, real, sink, scale, score_code):
    out, stat = _indexed_fwd_fake(q, k, v, index, gamma_sq, None, None, None, sink, scale, score_code)
    scales = [q.new_empty(k.shape[0], k.shape[2], dtype=torch.float32) for _ in range(2)]
    return out, stat, k.new_empty(k.shape), v.new_empty(v.shape), *scales, q.new_empty(q.shape[:3], dtype=torch.int8)


def _causal_mean_setup(ctx, inputs, output) -> None:
    q, k, v, index, gamma_sq, real, sink, scale, score_code = inputs
    ctx.save_for_backward(q, k, v, index, gamma_sq, *output, sink)
    ctx.set_materialize_grads(False)  # no zero gradients for stat, the means and their scales
    ctx.scale, ctx.score_code = scale, score_code


def _causal_mean_grads(ctx, grad_out: Tensor, *unused_grads):
    """Gradients of q, k, v, gamma_sq and sink; stat, the means and their scales are not differentiated."""
    q, k, v, index, gamma_sq, out, stat, mean_k, mean_v, realf, inverse, mask, sink = ctx.saved_tensors
    grad_out = torch.zeros_like(out) if grad_out is None else grad_out
    backward, scan = (indexed_bwd_traced, scaled_scan_traced) if ctx.traced else (indexed_bwd, scaled_scan_op)
    dq, dk, dv, dgamma_sq, d_mean_k, d_mean_v, d_sink = backward(
        q, k, v, index, gamma_sq, out, grad_out, stat, mean_k, mean_v, mask, sink, ctx.scale, ctx.score_code, False
    )
    # dx_j = real_j sum_{i >= j} g_i / count_i, on top of the listed keys' gradients
    dk = scan(d_mean_k, inverse, realf, dk, True, k.dtype)
    dv = scan(d_mean_v, inverse, realf, dv, True, v.dtype)
    return dq, dk, dv, None, dgamma_sq, None, None if sink is None else d_sink, None, None


indexed_causal_mean_fwd.register_autograd(_causal_mean_grads, setup_context=traced_setup(_causal_mean_setup, False))


@torch.library.triton_op(op_name("indexed_fwd_traced"), mutates_args=())
def indexed_fwd_traced(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    index: Tensor,
    gamma_sq: Tensor,
    extra_key: Tensor | None,
    extra_value: Tensor | None,
    extra_mask: Tensor | None,
    sink: Tensor | None,
    scale: float,
    score_code: int,
    slot_weight: Tensor | None = None,
    key_grads: str = "",
) -> tuple[Tensor, Tensor]:
    """``sparsefocus::indexed_fwd_traced``: ``indexed_fwd``'s ``triton_op`` twin (``_ops.TRITON_OPS``)."""
    kernel = wrap_triton(_indexed_fwd_kernel)
    return _fwd_body(q, k, v, index, gamma_sq, extra_key, extra_value, extra_mask, sink, scale, score_code, slot_weight, kernel)


@torch.library.triton_op(op_name("indexed_bwd_traced"), mutates_args=())
def indexed_bwd_traced(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    index: Tensor,
    gamma_sq: Tensor,
    out: Tensor,
    grad_out: Tensor,
    stat: Tensor,
    extra_key: Tensor | None,
    extra_value: Tensor | None,
    extra_mask: Tensor | None,
    sink: Tensor | None,
    scale: float,
    score_code: int,
    cast: bool,
    slot_weight: Tensor | None = None,
    key_grads: str = "",
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``sparsefocus::indexed_bwd_traced``: ``indexed_bwd``'s ``triton_op`` twin. Its "inverse" and
    "short" key gradients still call their own ``custom_op``s."""
    args = (q, k, v, index, gamma_sq, out, grad_out, stat, extra_key, extra_value, extra_mask, sink, scale, score_code, cast)
    return _bwd_body(*args, slot_weight, key_grads, wrap_triton(_indexed_bwd_kernel))


@torch.library.triton_op(op_name("indexed_causal_mean_fwd_traced"), mutates_args=())
def indexed_causal_mean_fwd_traced(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    index: Tensor,
    gamma_sq: Tensor,
    real: Tensor | None,
    sink: Tensor | None,
    scale: float,
    score_code: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``sparsefocus::indexed_causal_mean_fwd_traced``: ``indexed_causal_mean_fwd``'s ``triton_op``
    twin; its means through the scan ops' twins."""
    kernel = wrap_triton(_indexed_fwd_kernel)
    return _causal_mean_body(q, k, v, index, gamma_sq, real, sink, scale, score_code, True, kernel)


indexed_fwd_traced.register_autograd(_indexed_grads, setup_context=traced_setup(_indexed_setup, True))
indexed_causal_mean_fwd_traced.register_autograd(_causal_mean_grads, setup_context=traced_setup(_causal_mean_setup, True))


def _natural_lse(stat: Tensor, score: str) -> Tensor:
    """The public log-sum-exp [B, Hq, N] fp32 (natural log, -inf for empty rows), detached."""
    stat = stat.detach()
    return lse_from_weight_sum(stat) if score == "cauchy" else lse_from_log2(stat)


def indexed_attention_causal_mean(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    index: Tensor,
    *,
    score: str = "cauchy",
    gamma: Tensor | float | None = None,
    key_padding_mask: Tensor | None = None,
    sink_key: Tensor | None = None,
    scale: float | None = None,
    return_lse: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """``indexed_attention`` with one extra slot per query: the mean key and value of the real
    keys 0..i (ZETA's causal mean token), fused (op ``sparsefocus::indexed_causal_mean_fwd``).

    The same result as ``indexed_attention_ref(q, k, v, index, extra_key=mean_k,
    extra_value=mean_v, extra_mask=present, ...)`` with ``mean_k, mean_v, present =
    mean_tokens(k, v, True, key_padding_mask)`` (``sparsefocus.attention.zeta``), the slow twin
    the tests compare it with.

    Args:
        q: [B, Hq, N, D]; k: [B, Hk, N, D]; v: [B, Hk, N, Dv] (as many keys as queries, N >= 1).
        index: [B, Hq, N, K] key positions, -1 unused; K >= 1.
        score, gamma, sink_key, scale, return_lse: as ``indexed_attention``.
        key_padding_mask: [B, N] bool, True = real key; padded keys are left out of the means.
            Default: every key is real.
    Returns:
        [B, Hq, N, Dv] in q.dtype; with ``return_lse`` (out, lse [B, Hq, N] fp32), the mean
        token counted in lse like a listed key.
    """
    index = _checked_index(q, k, v, index, score, sink_key)
    if k.shape[2] != q.shape[2] or q.shape[2] == 0 or index.shape[-1] == 0:
        raise ValueError(
            f"indexed_attention_causal_mean needs N = M >= 1 and K >= 1, got q {tuple(q.shape)}, k {tuple(k.shape)}, index {tuple(index.shape)}"
        )
    real = key_padding_mask  # None: every key is real
    if real is not None and tuple(real.shape) != (k.shape[0], k.shape[2]):
        raise ValueError(f"key_padding_mask must be [B, M] = [{k.shape[0]}, {k.shape[2]}], got {tuple(real.shape)}")
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    gamma_sq = _gamma_squared(gamma, q.shape[0], q.shape[1], q.device, score)  # [Hq] or [B, Hq]
    q, k, v, index, sink = _kernel_tensors(q, k, v, index, sink_key)
    op = indexed_causal_mean_fwd_traced if triton_op_chosen(q) else indexed_causal_mean_fwd
    out, stat, *_ = op(q, k, v, index, gamma_sq, real, sink, scale, SCORE_CODES[score])
    return (out, _natural_lse(stat, score)) if return_lse else out


def _gamma_squared(gamma: Tensor | float | None, batch: int, num_heads: int, device: torch.device, score: str) -> Tensor:
    """gamma^2 fp32 as the kernels take it, [Hq] or [B, Hq]. A number is squared on the host (in
    double, rounded to fp32 once: within an ulp of squaring its fp32 value) and filled in one launch;
    no gamma for a score that does not read it (dot, neg_sqeuclid) is an unfilled buffer."""
    if gamma is None and score != "cauchy":
        return torch.empty(num_heads, dtype=torch.float32, device=device)
    if isinstance(gamma, Tensor):
        return _gamma_per_head(gamma, batch, num_heads, device).float().pow(2)
    value = 1.0 if gamma is None else float(gamma)
    return torch.full((num_heads,), value * value, dtype=torch.float32, device=device)


def _gamma_per_head(gamma: Tensor | float | None, batch: int, num_heads: int, device: torch.device) -> Tensor:
    """Gamma as an [Hq] tensor for the kernel, or [B, Hq] when given per batch row (a view of a
    trainable tensor, so gradients flow back)."""
    if isinstance(gamma, Tensor):
        if gamma.dim() == 2 and tuple(gamma.shape) == (batch, num_heads):
            return gamma
        if gamma.numel() not in (1, num_heads):
            raise ValueError(
                f"gamma must be a scalar, one value per query head ({num_heads}) or [B, Hq] = [{batch}, {num_heads}], "
                f"got {tuple(gamma.shape)}"
            )
        return gamma.reshape(-1).expand(num_heads)
    value = 1.0 if gamma is None else float(gamma)
    return torch.full((num_heads,), value, dtype=torch.float32, device=device)


def _check_index(q: Tensor, k: Tensor, v: Tensor, index: Tensor, score: str) -> None:
    if score not in SCORE_KINDS:
        raise ValueError(f"unknown score {score!r}; valid: {', '.join(SCORE_KINDS)}")
    if index.dim() != 4 or index.shape[2] != q.shape[2] or index.is_floating_point():
        raise ValueError(
            f"index must be an integer tensor [B, Hq, N, K] with N = {q.shape[2]}, got {index.dtype} {tuple(index.shape)}"
        )
    if q.shape[1] % k.shape[1] != 0 or k.shape[:3] != v.shape[:3] or q.shape[-1] != k.shape[-1]:
        raise ValueError(f"incompatible shapes q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")


def indexed_attention(
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
    return_lse: bool = False,
    key_grads: str | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """Attention of each query over an explicit list of keys, fused in Triton (forward and backward).

    Same signature and result as ``indexed_attention_ref`` (fp32 accumulation inside)::

        query i, slots j = 0..K-1:  key index[b, h, i, j]  (-1 = unused slot)
        out[i] = sum_j w_ij v[index_ij] / sum_j w_ij   (softmax or Cauchy weights)

    Args:
        q: [B, Hq, N, D]; k: [B, Hk, M, D]; v: [B, Hk, M, Dv]; Hq % Hk == 0 (query head h reads
            kv head h // (Hq // Hk)). fp16, bf16 or fp32 (the interpreter on CPU: fp16/fp32).
        index: [B or 1, Hq or 1, N, K] integer key positions in [0, M), -1 for unused slots.
            Repeated positions count as many times as they appear.
        scale: multiplies dot scores / squared distances. Default: 1/sqrt(D).
        score: "dot", "neg_sqeuclid" or "cauchy" (weights 1/(||q-k||^2 + gamma^2); scale unused).
        gamma: Cauchy width, float or tensor with 1 or Hq values, or [B, Hq] (one per batch row
            and head); a tensor that requires grad receives its gradient. Default: 1.
        extra_key, extra_value: optional one more slot per query with its own key
            [B, Hq or Hk, N, D] and value [B, Hq or Hk, N, Dv] (expanded views are read in
            place, not copied); scored like the listed keys; both receive gradients. Default: none.
        extra_mask: [B, 1 or Hq, N] bool, True where the extra slot counts. Default: every row.
        sink_key: optional [Hq, D] (or [B, Hq, D]) attention sink (Cauchy only): a key per query
            head (and batch row) with value 0 in every row, adding only its weight to the
            normaliser; receives a gradient. Computed per row in the kernels, so k, v and index
            are not extended. Default: none.
        slot_weight: optional [B, Hq, N, K] factor on each listed slot's normalised weight,
            outside the normaliser (attention dropout: ``F.dropout`` of ones); the extra slot and
            the sink keep theirs; no gradient. The lse is unchanged by it. Default: none.
        return_lse: also return each row's log-sum-exp. Default: False.
        key_grads: how the backward sums dk and dv: "atomic", "inverse" or "short" (see
            ``KEY_GRADS``). Default: None, the module setting ``KEY_GRADS``.
    Returns:
        out [B, Hq, N, Dv] in q.dtype; rows with no valid key are zero. With ``return_lse``,
        (out, lse): lse [B, Hq, N] fp32 = log sum_j exp(s_ij) over the row's valid slots (the
        extra slot and the sink included), natural log, -inf for a row with no key; s_ij is the
        scaled score (dot: scale * q.k; neg_sqeuclid: -scale * ||q - k||^2; cauchy: log w_ij, so
        lse = log sum_j w_ij). Detached: no gradient flows through lse.
    """
    index = _checked_index(q, k, v, index, score, sink_key)
    _check_extra(q, v, extra_key, extra_value, extra_mask)
    if key_grads is not None and key_grads not in KEY_GRADS_MODES:
        raise ValueError(f"key_grads must be one of {', '.join(KEY_GRADS_MODES)}, got {key_grads!r}")
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    gamma_sq = _gamma_squared(gamma, q.shape[0], q.shape[1], q.device, score)  # [Hq] or [B, Hq]
    if q.shape[2] == 0:  # no query: nothing to launch
        out = indexed_attention_ref(
            q,
            k,
            v,
            index,
            scale=scale,
            score=score,
            gamma=gamma,
            extra_key=extra_key,
            extra_value=extra_value,
            extra_mask=extra_mask,
            sink_key=sink_key,
            slot_weight=slot_weight,
        ).to(q.dtype)
        return (out, q.new_zeros(q.shape[:3], dtype=torch.float32)) if return_lse else out
    if slot_weight is not None:
        check_slot_weight(q, index, slot_weight)
        slot_weight = slot_weight.detach().float().contiguous() if index.shape[-1] > 0 else None
    k, v, index = _nonempty_lists(k, v, index)
    extras = _kernel_extras(q, extra_key, extra_value, extra_mask)
    q, k, v, index, sink = _kernel_tensors(q, k, v, index, sink_key)
    op = indexed_fwd_traced if triton_op_chosen(q) else indexed_fwd
    out, stat = op(q, k, v, index, gamma_sq, *extras, sink, scale, SCORE_CODES[score], slot_weight, key_grads or "")
    return (out, _natural_lse(stat, score)) if return_lse else out


def _nonempty_lists(k: Tensor, v: Tensor, index: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Without slots (K = 0) or without keys (M = 0): one unused slot per query, and one zero key
    and value row appended when M = 0, so that the kernels run (the extra slot and the sink still
    count) and give the same result; otherwise the inputs unchanged."""
    if index.shape[-1] > 0 and k.shape[2] > 0:
        return k, v, index
    index = index.new_full((*index.shape[:3], 1), -1)
    if k.shape[2] == 0:
        k = torch.cat([k, k.new_zeros(*k.shape[:2], 1, k.shape[-1])], dim=2)
        v = torch.cat([v, v.new_zeros(*v.shape[:2], 1, v.shape[-1])], dim=2)
    return k, v, index


def _checked_index(q: Tensor, k: Tensor, v: Tensor, index: Tensor, score: str, sink_key: Tensor | None) -> Tensor:
    """index broadcast to [B, Hq, N, K], after the checks shared by the public functions."""
    index = index.expand(q.shape[0], q.shape[1], *index.shape[2:]) if index.dim() == 4 else index
    _check_index(q, k, v, index, score)
    check_sink_key(q, sink_key, score)
    return index


def _kernel_tensors(q: Tensor, k: Tensor, v: Tensor, index: Tensor, sink_key: Tensor | None) -> tuple:
    """What the kernels read: q, k, v contiguous in q's dtype, index int32, the sink ([Hq, D] or [B, Hq, D]) in
    fp32 (the kernels compute in fp32) or None."""
    sink = None if sink_key is None else sink_key.float().contiguous()
    return q.contiguous(), k.to(q.dtype).contiguous(), v.to(q.dtype).contiguous(), index.to(torch.int32).contiguous(), sink


def _check_extra(q: Tensor, v: Tensor, extra_key: Tensor | None, extra_value: Tensor | None, extra_mask: Tensor | None) -> None:
    if extra_key is None and extra_value is None:
        return
    if extra_key is None or extra_value is None:
        raise ValueError("extra_key and extra_value must be given together")
    for name, x, width in (("extra_key", extra_key, q.shape[-1]), ("extra_value", extra_value, v.shape[-1])):
        heads = x.shape[1] if x.dim() == 4 else -1
        if x.dim() != 4 or x.shape[0] != q.shape[0] or x.shape[2] != q.shape[2] or x.shape[3] != width or q.shape[1] % heads:
            raise ValueError(
                f"{name} must be [B, Hq or Hk, N, {width}] = [{q.shape[0]}, ., {q.shape[2]}, {width}], got {tuple(x.shape)}"
            )
    if extra_mask is not None and (
        extra_mask.dim() != 3 or extra_mask.shape[0] != q.shape[0] or extra_mask.shape[2] != q.shape[2]
    ):
        raise ValueError(f"extra_mask must be [B, 1 or Hq, N] bool, got {tuple(extra_mask.shape)}")


def _kernel_extras(q: Tensor, extra_key: Tensor | None, extra_value: Tensor | None, extra_mask: Tensor | None) -> tuple:
    """(key, value, int8 mask [B, Hq, N]) for the kernels, or (None, None, None) without an extra
    slot. Key and value keep their strides (an expanded mean is not copied) as long as the last
    dim is dense."""
    if extra_key is None:
        return None, None, None
    key, value = extra_key.to(q.dtype), extra_value.to(q.dtype)
    key, value = (x if x.stride(-1) == 1 else x.contiguous() for x in (key, value))
    if extra_mask is None:
        mask = torch.ones(q.shape[:3], dtype=torch.int8, device=q.device)
    else:
        mask = extra_mask.expand(*q.shape[:3]).to(torch.int8).contiguous()
    return key, value, mask

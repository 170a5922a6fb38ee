"""Key gradients of indexed attention without float atomics: an inverse index, then one program
per block of keys that sums over the (query, slot) pairs that listed them.

The atomic backward (``indexed._indexed_bwd_kernel``) adds p * dO (Dv floats) into dv once per
(query, slot): at N=64K with 32 slots that is 8.6 G fp32 reductions through L2, and on the H200
its time followed the number of pairs whatever the lists' structure
(``benchmarks/zeta_bwd_probe.py``). Here the reductions happen in registers instead:

1. ``build_inverse``: for each key, the flat (query row, slot) pairs that list it (CSR: offsets
   [L + 1] and entries row * K + slot, L = B * Hk * M keys), by a counting pass and a filling
   pass with int32 atomics (one per pair, 4 bytes instead of Dv floats). A query that lists a
   key twice appears twice.
2. ``key_grads``: one program per (BLOCK_N keys, batch x kv head) walks each key's entries
   BLOCK_E at a time, gathers q, dO, the row statistic and delta = sum(o * dO) of those queries
   (and the pair's slot weight), recomputes the weights and accumulates dk [BN, D] and dv
   [BN, Dv] in fp32 registers; every key row is stored once, in the input dtype (no fp32
   [B, Hk, M, Dv] buffer, no cast pass).

The query side (dq, d gamma, the extra slot) stays in the indexed backward kernel with its
scatter switched off. Every score kind (dot, neg_sqeuclid, Cauchy). The order of a key's entries depends
on the atomics' order on a GPU, so its fp32 sums may differ in the last bits between runs, as
the atomic backward's do. Both steps are ``torch.library`` ops (``sparsefocus::build_inverse``,
``sparsefocus::key_grads``), called from inside ``sparsefocus::indexed_bwd``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from sparsefocus.kernels import interpreter_compat  # noqa: F401  (CPU interpreter fix)
from sparsefocus.kernels._ops import op_name

TILES = {"BLOCK_N": 16, "BLOCK_E": 8, "num_warps": 4}
"""Tile of ``_key_grads_kernel``: BLOCK_N keys, BLOCK_E of their entries at a time ([BN, BE, Dv]
fp32 gathered dO). A first guess, not tuned; benchmarks/zeta_tiles_ab.py --key-grads tries others."""


@triton.jit
def _listed_keys(IDX, N, M, NUM_SLOTS, HQ, GROUP, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, start):
    """(flat key [BM, BK] int64 = kv_bh * M + idx, valid [BM, BK], flat query row [BM] int32) of
    slots start .. start + BLOCK_K of this program's BLOCK_M queries."""
    pid_m, bh = tl.program_id(0), tl.program_id(1)
    kv_bh = (bh // HQ) * (HQ // GROUP) + (bh % HQ) // GROUP
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    slots = start + tl.arange(0, BLOCK_K)
    row_offs = bh.to(tl.int64) * N + rows  # [BM]
    ok = (rows < N)[:, None] & (slots[None, :] < NUM_SLOTS)
    idx = tl.load(IDX + row_offs[:, None] * NUM_SLOTS + slots[None, :], mask=ok, other=-1)  # [BM, BK]
    valid = ok & (idx >= 0)
    return kv_bh.to(tl.int64) * M + idx, valid, row_offs.to(tl.int32)


@triton.jit
def _count_kernel(IDX, COUNT, N, M, NUM_SLOTS, HQ, GROUP, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """COUNT[kv_bh * M + key] += 1 for every listed (query, slot)."""
    for start in range(0, NUM_SLOTS, BLOCK_K):
        key, valid, _ = _listed_keys(IDX, N, M, NUM_SLOTS, HQ, GROUP, BLOCK_M, BLOCK_K, start)
        tl.atomic_add(COUNT + key, tl.full(key.shape, 1, tl.int32), mask=valid, sem="relaxed")


@triton.jit
def _fill_kernel(IDX, CURSOR, ENTRIES, N, M, NUM_SLOTS, HQ, GROUP, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """Write each listing (query row, slot) pair, row * K + slot, at its key's next free entry
    (CURSOR starts at the offsets)."""
    for start in range(0, NUM_SLOTS, BLOCK_K):
        key, valid, row = _listed_keys(IDX, N, M, NUM_SLOTS, HQ, GROUP, BLOCK_M, BLOCK_K, start)
        at = tl.atomic_add(CURSOR + key, tl.full(key.shape, 1, tl.int32), mask=valid, sem="relaxed")  # [BM, BK] old values
        pair = row[:, None] * NUM_SLOTS + start + tl.arange(0, BLOCK_K)[None, :]  # [BM, BK]
        tl.store(ENTRIES + at, pair, mask=valid)


def build_inverse(index: Tensor, n_keys: int, kv_heads: int) -> tuple[Tensor, Tensor]:
    """The queries listing each key (op ``sparsefocus::build_inverse``).

    Args:
        index: [B, Hq, N, K] int32 key positions (-1 unused); n_keys: M; kv_heads: Hk
            (query head h lists keys of kv head h // (Hq // Hk)).
    Returns:
        offsets [B * Hk * M + 1] int32 and entries [B * Hq * N * K] int32 (those past
        offsets[-1] unused): the pairs ((b * Hq + h) * N + i) * K + slot of the query rows and
        slots listing key (b, kv head, j) are entries[offsets[l] : offsets[l + 1]] with
        l = (b * Hk + kv head) * M + j. On a GPU the order of a key's entries follows the
        atomics' order, so it may change between runs.
    """
    batch, q_heads, n_queries, slots = index.shape
    if batch * q_heads * n_queries * slots >= 2**31:
        raise ValueError(
            f"the inverse index holds at most 2**31 - 1 (query, slot) pairs; got {batch * q_heads * n_queries * slots}"
        )
    if q_heads % kv_heads:
        raise ValueError(f"kv_heads must divide the query heads {q_heads}, got {kv_heads}")
    return build_inverse_op(index, n_keys, kv_heads)


@torch.library.custom_op(op_name("build_inverse"), mutates_args=())
def build_inverse_op(index: Tensor, n_keys: int, kv_heads: int) -> tuple[Tensor, Tensor]:
    """``sparsefocus::build_inverse``: ``build_inverse`` without its argument checks."""
    index = index.to(torch.int32).contiguous()
    batch, q_heads, n_queries, slots = index.shape
    count = torch.zeros(batch * kv_heads * n_keys, dtype=torch.int32, device=index.device)
    grid = (triton.cdiv(n_queries, 16), batch * q_heads)
    sizes = (n_queries, n_keys, slots, q_heads, q_heads // kv_heads)
    block_k = min(32, triton.next_power_of_2(max(slots, 1)))
    _count_kernel[grid](index, count, *sizes, BLOCK_M=16, BLOCK_K=block_k)
    offsets = torch.zeros(count.numel() + 1, dtype=torch.int32, device=index.device)
    offsets[1:] = torch.cumsum(count, 0, dtype=torch.int32)
    # sized for every slot used (the exact total, offsets[-1], would cost a device-to-host sync)
    entries = torch.empty(batch * q_heads * n_queries * slots, dtype=torch.int32, device=index.device)
    cursor = offsets[:-1].clone()
    _fill_kernel[grid](index, cursor, entries, *sizes, BLOCK_M=16, BLOCK_K=block_k)
    return offsets, entries


@build_inverse_op.register_fake
def _build_inverse_fake(index, n_keys, kv_heads):
    batch, q_heads, n_queries, slots = index.shape
    offsets = index.new_empty(batch * kv_heads * n_keys + 1, dtype=torch.int32)
    return offsets, index.new_empty(batch * q_heads * n_queries * slots, dtype=torch.int32)


@triton.jit
def _pair_grads(qt, kj, vj, dot, stat, delta, gamma_sq, a, ok, scale, SCORE: tl.constexpr, HAS_SW: tl.constexpr):
    """One key's contributions from its listing pairs [BN, BE]: (dk terms [BN, BE, BD], dv weights
    [BN, BE]), as ``indexed._slot_grads`` computes them query-side. stat: log2-sum-exp (softmax
    kinds) or the Cauchy sum of the pair's row; a: the pair's slot weight (HAS_SW)."""
    dp = tl.sum(dot * vj[:, None, :], axis=2)  # [BN, BE]
    if HAS_SW:
        dp = dp * a
    if SCORE == 2:
        diff = qt - kj[:, None, :]  # [BN, BE, BD]: q - k
        w = tl.where(ok, 1.0 / (tl.sum(diff * diff, axis=2) + gamma_sq), 0.0)
        p = w / tl.where(stat > 0, stat, 1.0)
        d_sq = -(dp - delta) * w * p  # d loss / d squared distance
        dk = (-2.0 * d_sq)[:, :, None] * diff
    else:
        if SCORE == 0:
            s = tl.sum(qt * kj[:, None, :], axis=2) * (scale * 1.4426950408889634)
        else:
            diff = qt - kj[:, None, :]
            s = -tl.sum(diff * diff, axis=2) * (scale * 1.4426950408889634)
        p = tl.where(ok, tl.exp2(s - stat), 0.0)  # stat = +inf for a row with no key: p = 0
        ds = p * (dp - delta)
        if SCORE == 0:
            dk = (ds * scale)[:, :, None] * qt
        else:
            dk = (2.0 * scale * ds)[:, :, None] * diff
    if HAS_SW:
        p = p * a
    return dk, p


@triton.jit
def _key_grads_kernel(
    Q,
    K,
    V,
    DOUT,
    STAT,
    DELTA,
    GAMMA_SQ,
    OFFSETS,
    ENTRIES,
    DK,
    DV_,
    SW,
    N,
    M,
    HQ,
    NUM_SLOTS,
    scale,
    G_SB,
    D: tl.constexpr,
    DV: tl.constexpr,
    SCORE: tl.constexpr,
    HAS_SW: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    pid_n, kv_bh = tl.program_id(0), tl.program_id(1)
    keys = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    key_ok = keys < M
    flat = kv_bh.to(tl.int64) * M + keys  # [BN]
    offs_d, offs_dv = tl.arange(0, BLOCK_D), tl.arange(0, BLOCK_DV)
    d_ok, dv_ok = offs_d < D, offs_dv < DV
    kj = tl.load(K + flat[:, None] * D + offs_d[None, :], mask=key_ok[:, None] & d_ok[None, :], other=0.0).to(
        tl.float32
    )  # [BN, BD]
    vj = tl.load(V + flat[:, None] * DV + offs_dv[None, :], mask=key_ok[:, None] & dv_ok[None, :], other=0.0).to(
        tl.float32
    )  # [BN, BDV]
    first = tl.load(OFFSETS + flat, mask=key_ok, other=0)
    count = tl.load(OFFSETS + flat + 1, mask=key_ok, other=0) - first  # [BN]
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], tl.float32)
    for t in range(0, tl.max(count, axis=0), BLOCK_E):
        e = t + tl.arange(0, BLOCK_E)
        e_ok = e[None, :] < count[:, None]  # [BN, BE]
        pair = tl.load(ENTRIES + first[:, None] + e[None, :], mask=e_ok, other=0).to(tl.int64)  # [BN, BE]
        row = pair // NUM_SLOTS  # flat query rows
        bh = row // N
        gamma_sq = tl.load(GAMMA_SQ + (bh // HQ) * G_SB + bh % HQ, mask=e_ok, other=1.0)  # G_SB: 0 per head, HQ per row
        stat = tl.load(STAT + row, mask=e_ok, other=1.0)
        delta = tl.load(DELTA + row, mask=e_ok, other=0.0)
        if HAS_SW:
            a = tl.load(SW + pair, mask=e_ok, other=0.0)
        else:
            a = delta  # unread
        qt = tl.load(Q + row[:, :, None] * D + offs_d[None, None, :], mask=e_ok[:, :, None] & d_ok[None, None, :], other=0.0).to(
            tl.float32
        )
        dot = tl.load(
            DOUT + row[:, :, None] * DV + offs_dv[None, None, :], mask=e_ok[:, :, None] & dv_ok[None, None, :], other=0.0
        ).to(tl.float32)
        dk_terms, p = _pair_grads(qt, kj, vj, dot, stat, delta, gamma_sq, a, e_ok, scale, SCORE, HAS_SW)
        dv += tl.sum(p[:, :, None] * dot, axis=1)
        dk += tl.sum(dk_terms, axis=1)
    tl.store(DK + flat[:, None] * D + offs_d[None, :], dk.to(DK.dtype.element_ty), mask=key_ok[:, None] & d_ok[None, :])
    tl.store(DV_ + flat[:, None] * DV + offs_dv[None, :], dv.to(DV_.dtype.element_ty), mask=key_ok[:, None] & dv_ok[None, :])


@torch.library.custom_op(op_name("key_grads"), mutates_args=())
def key_grads_op(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    index: Tensor,
    gamma_sq: Tensor,
    grad_out: Tensor,
    stat: Tensor,
    delta: Tensor,
    scale: float = 1.0,
    score_code: int = 2,
    slot_weight: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """dk [B, Hk, M, D] and dv [B, Hk, M, Dv] (input dtypes) of indexed attention (op
    ``sparsefocus::key_grads``, not differentiable).

    Args: q [B, Hq, N, D], k [B, Hk, M, D], v [B, Hk, M, Dv], index [B, Hq, N, K] int32 and
    grad_out [B, Hq, N, Dv]; gamma_sq [Hq] or [B, Hq] fp32 (Cauchy); stat [B, Hq, N] fp32, the forward's
    row statistic (Cauchy: the sum of weights, extra slot included; dot and neg_sqeuclid: the
    base-2 log-sum-exp of the scaled scores, +inf for a row with no key); delta [B, Hq, N] fp32
    = sum(out * grad_out) per query (stored by the query pass, so no fp32 copy of out is made);
    scale (dot, neg_sqeuclid; default 1); score_code 0 dot, 1 neg_sqeuclid, 2 Cauchy (default);
    slot_weight optional fp32 [B, Hq, N, K] (``indexed_attention``'s slot weights).
    """
    q, k, v, index, gamma_sq, grad_out, stat, delta = (x.contiguous() for x in (q, k, v, index, gamma_sq, grad_out, stat, delta))
    slot_weight = None if slot_weight is None else slot_weight.float().contiguous()
    offsets, entries = build_inverse_op(index, k.shape[2], k.shape[1])
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    batch, kv_heads, n_keys, dim = k.shape
    block_d, block_dv = triton.next_power_of_2(dim), triton.next_power_of_2(v.shape[-1])
    grid = (triton.cdiv(n_keys, TILES["BLOCK_N"]), batch * kv_heads)
    _key_grads_kernel[grid](
        q,
        k,
        v,
        grad_out,
        stat,
        delta,
        gamma_sq,
        offsets,
        entries,
        dk,
        dv,
        q if slot_weight is None else slot_weight,
        q.shape[2],
        n_keys,
        q.shape[1],
        index.shape[-1],
        scale,
        gamma_sq.shape[-1] if gamma_sq.dim() == 2 else 0,
        D=dim,
        DV=v.shape[-1],
        SCORE=score_code,
        HAS_SW=slot_weight is not None,
        BLOCK_D=block_d,
        BLOCK_DV=block_dv,
        **TILES,
    )
    return dk, dv


key_grads = key_grads_op
"""The public name of ``key_grads_op``."""


@key_grads_op.register_fake
def _key_grads_fake(q, k, v, index, gamma_sq, grad_out, stat, delta, scale=1.0, score_code=2, slot_weight=None):
    return k.new_empty(k.shape), v.new_empty(v.shape)

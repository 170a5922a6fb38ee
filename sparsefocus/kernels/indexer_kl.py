"""DSA's indexer KL loss and its gradients in Triton, one program per query row.

The indexer learns from KL(t || softmax(logits)) over each row's K listed keys, where t is the
main attention's distribution on those keys averaged over the query heads (no gradient) and
logit_j = sum_h w_h ReLU(iq_h . ik_j). The PyTorch computation (``attention.dsa._kl_chunk``,
the slow twin) gathers every listed key and indexer key into [rows, K, D] fp32 copies, chunk by
chunk, with some 25 launches a chunk. Here a program reads its row's list in tiles of BLOCK_K
slots and gathers the keys straight into ``tl.dot`` tiles, three times:

1. the main scores of every query head (the heads as the rows of one tile, as the group kernel
   holds them) for each head's log-sum-exp over the list;
2. the target t_j = mean_h exp(s_hj - lse_h) and the indexer logits, folded into the KL as it
   goes: KL = sum t log t - sum t (logit - m) + T log sum exp(logit - m), with m the running
   maximum of the logits and T = sum t (the terms stay small, so nothing cancels at large logits);
3. with gradients wanted: d logit_j = p_j T - t_j, then d w_h = sum_j d logit_j ReLU_hj,
   d iq_h = sum_j d pre_hj ik_j in registers and d ik_j += sum_h d pre_hj iq_h by atomic adds
   (other rows list the same keys), d pre = d logit w where the pre-activation is positive.

Small rows (one query head and lists of 5, as the laboratory's: ``SMALL_PRODUCT``) multiply in
registers instead of ``tl.dot``, whose operand tiles are padded to 16 rows and staged in shared
memory, which limits how many of these one-row programs an SM holds.

Outputs per row: the KL (0 for a row without a key), whether it has a key, and the unnormalised
gradients; ``attention.dsa`` takes the means over rows. ``sparsefocus::indexer_kl`` is a custom op
(fixed shapes, no host synchronisation). The sums of d ik run in no fixed order.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from sparsefocus.kernels import interpreter_compat  # noqa: F401  (CPU interpreter fix)

LOG2E = tl.constexpr(1.4426950408889634)  # scores in log2 units for exp2
SMALL_PRODUCT = 2048
"""Rows whose tiles' largest product (padded heads x list slots x head width) holds at most this
many elements take the register path (``DOT=False``): products summed in registers instead of
``tl.dot``, whose operand tiles, padded to 16 rows and staged in shared memory, limit how many
programs of one row each an SM holds (the laboratory's ListOps DSA: one query head, lists of 5)."""


@triton.jit
def _dot_t(a, b, DOT: tl.constexpr, PRECISION: tl.constexpr):
    """a [M, K] @ b [N, K]^T -> [M, N] fp32: ``tl.dot``, or (DOT=False) products summed in registers."""
    if DOT:
        return tl.dot(a, tl.trans(b), input_precision=PRECISION)
    return tl.sum(a.to(tl.float32)[:, None, :] * b.to(tl.float32)[None, :, :], axis=2)


@triton.jit
def _dot_nn(a, b, DOT: tl.constexpr, PRECISION: tl.constexpr):
    """a [M, K] @ b [K, N] -> [M, N] fp32, as ``_dot_t``."""
    if DOT:
        return tl.dot(a, b, input_precision=PRECISION)
    return tl.sum(a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :], axis=1)


@triton.jit
def _dot_tn(a, b, DOT: tl.constexpr, PRECISION: tl.constexpr):
    """a [K, M]^T @ b [K, N] -> [M, N] fp32, as ``_dot_t``."""
    if DOT:
        return tl.dot(tl.trans(a), b, input_precision=PRECISION)
    return tl.sum(a.to(tl.float32)[:, :, None] * b.to(tl.float32)[:, None, :], axis=0)


@triton.jit
def _main_scores(
    q,
    K,
    b,
    pos,
    valid,
    heads,
    HK,
    G,
    M,
    scale,
    D: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
    DOT: tl.constexpr,
):
    """[BH, BK] scores of the query heads (rows) on the listed keys ``pos`` [BK], in log2 units;
    -inf at unused slots. Head h reads kv head h // G."""
    offs_d = tl.arange(0, BLOCK_D)
    scores = tl.zeros([BLOCK_H, BLOCK_K], tl.float32)
    for g in range(HK):
        rows = ((b * HK + g).to(tl.int64) * M + tl.where(valid, pos, 0)) * D  # [BK]
        keys = tl.load(K + rows[:, None] + offs_d[None, :], mask=valid[:, None] & (offs_d[None, :] < D), other=0.0)
        part = _dot_t(q, keys, DOT, PRECISION)  # [BH, BK]
        scores += tl.where((heads // G == g)[:, None], part, 0.0)
    return tl.where(valid[None, :], scores * (scale * LOG2E), float("-inf"))


@triton.jit
def _slots(IDX, row, s0, KK, BLOCK_K: tl.constexpr):
    """Positions [BK] of the list slots s0 .. s0 + BK of a row and whether each holds a key."""
    slot = s0 + tl.arange(0, BLOCK_K)
    pos = tl.load(IDX + row * KK + slot, mask=slot < KK, other=-1)
    return pos, pos >= 0


@triton.jit
def _indexer_logits(
    IK, iq, w, b, pos, valid, M, DI: tl.constexpr, BLOCK_DI: tl.constexpr, PRECISION: tl.constexpr, DOT: tl.constexpr
):
    """(indexer keys [BK, BDI], pre-activations [BI, BK], logits [BK], -inf at unused slots)."""
    offs_e = tl.arange(0, BLOCK_DI)
    rows = (b.to(tl.int64) * M + tl.where(valid, pos, 0)) * DI
    ikt = tl.load(IK + rows[:, None] + offs_e[None, :], mask=valid[:, None] & (offs_e[None, :] < DI), other=0.0)
    pre = _dot_t(iq, ikt, DOT, PRECISION)  # [BI, BK]
    logits = tl.sum(w[:, None] * tl.maximum(pre, 0.0), axis=0)
    return ikt, pre, tl.where(valid, logits, float("-inf"))


@triton.jit
def _kl_kernel(
    Q,
    K,
    IDX,
    IQ,
    IK,
    W,
    KL,
    HAS,
    DIQ,
    DW,
    DIK,
    HQ,
    HK,
    NR,
    M,
    KK,
    HI,
    scale,
    D: tl.constexpr,
    DI: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_I: tl.constexpr,
    BLOCK_DI: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GRADS: tl.constexpr,
    PRECISION: tl.constexpr,
    PRECISION_I: tl.constexpr,
    DOT: tl.constexpr,
):
    t, b = tl.program_id(0), tl.program_id(1)
    row = b.to(tl.int64) * NR + t  # this row in [B, NR]
    G = HQ // HK
    heads, offs_d = tl.arange(0, BLOCK_H), tl.arange(0, BLOCK_D)
    head_ok = heads < HQ
    q = tl.load(
        Q + ((b * HQ + heads).to(tl.int64) * NR + t)[:, None] * D + offs_d[None, :],
        mask=head_ok[:, None] & (offs_d[None, :] < D),
        other=0.0,
    )  # [BH, BD]
    ih, offs_e = tl.arange(0, BLOCK_I), tl.arange(0, BLOCK_DI)
    ih_ok = ih < HI
    iq_rows = ((b * HI + ih).to(tl.int64) * NR + t)[:, None] * DI + offs_e[None, :]
    iq_mask = ih_ok[:, None] & (offs_e[None, :] < DI)
    iq = tl.load(IQ + iq_rows, mask=iq_mask, other=0.0)  # [BI, BDI] fp32
    w = tl.load(W + row * HI + ih, mask=ih_ok, other=0.0)  # [BI]

    # 1. each query head's log-sum-exp (log2 units) over the listed keys
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    total = tl.zeros([BLOCK_H], tl.float32)
    for s0 in range(0, KK, BLOCK_K):
        pos, valid = _slots(IDX, row, s0, KK, BLOCK_K)
        s = _main_scores(q, K, b, pos, valid, heads, HK, G, M, scale, D, BLOCK_H, BLOCK_D, BLOCK_K, PRECISION, DOT)
        m_new = tl.maximum(m, tl.max(s, axis=1))
        m_safe = tl.where(m_new > float("-inf"), m_new, 0.0)
        total = total * tl.exp2(m - m_safe) + tl.sum(tl.exp2(s - m_safe[:, None]), axis=1)
        m = m_new
    lse = tl.where(total > 0, tl.where(m > float("-inf"), m, 0.0) + tl.log2(tl.where(total > 0, total, 1.0)), 0.0)  # [BH]

    # 2. target, indexer logits and the KL, online
    lm = tl.full([], float("-inf"), tl.float32)  # running maximum of the logits
    lsum = tl.zeros([], tl.float32)  # sum exp(logit - lm)
    t_log_t = tl.zeros([], tl.float32)
    t_logit = tl.zeros([], tl.float32)  # sum t (logit - lm)
    t_sum = tl.zeros([], tl.float32)
    for s0 in range(0, KK, BLOCK_K):
        pos, valid = _slots(IDX, row, s0, KK, BLOCK_K)
        s = _main_scores(q, K, b, pos, valid, heads, HK, G, M, scale, D, BLOCK_H, BLOCK_D, BLOCK_K, PRECISION, DOT)
        p = tl.where(head_ok[:, None] & valid[None, :], tl.exp2(s - lse[:, None]), 0.0)
        target = tl.sum(p, axis=0) / HQ  # [BK]
        _, _, logits = _indexer_logits(IK, iq, w, b, pos, valid, M, DI, BLOCK_DI, PRECISION_I, DOT)
        lm_new = tl.maximum(lm, tl.max(logits, axis=0))
        lm_safe = tl.where(lm_new > float("-inf"), lm_new, 0.0)
        lm_old = tl.where(lm > float("-inf"), lm, lm_safe)
        centred = tl.where(valid, logits - lm_safe, 0.0)  # unused slots: 0, not -inf (no 0 * inf)
        t_logit += t_sum * (lm_old - lm_safe) + tl.sum(target * centred, axis=0)
        lsum = lsum * tl.exp(lm_old - lm_safe) + tl.sum(tl.where(valid, tl.exp(centred), 0.0), axis=0)
        t_log_t += tl.sum(tl.where(target > 0, target * tl.log(tl.where(target > 0, target, 1.0)), 0.0), axis=0)
        t_sum += tl.sum(target, axis=0)
        lm = lm_new
    has_key = lsum > 0
    log_sum = tl.log(tl.where(has_key, lsum, 1.0))
    tl.store(KL + row, tl.where(has_key, t_log_t - t_logit + t_sum * log_sum, 0.0))
    tl.store(HAS + row, has_key.to(tl.float32))

    # 3. gradients of the row's KL in w, iq (here) and ik (atomic adds)
    if GRADS:
        lse_i = tl.where(lm > float("-inf"), lm, 0.0) + log_sum  # natural log-sum-exp of the logits
        d_w = tl.zeros([BLOCK_I], tl.float32)
        d_iq = tl.zeros([BLOCK_I, BLOCK_DI], tl.float32)
        for s0 in range(0, KK, BLOCK_K):
            pos, valid = _slots(IDX, row, s0, KK, BLOCK_K)
            s = _main_scores(q, K, b, pos, valid, heads, HK, G, M, scale, D, BLOCK_H, BLOCK_D, BLOCK_K, PRECISION, DOT)
            p = tl.where(head_ok[:, None] & valid[None, :], tl.exp2(s - lse[:, None]), 0.0)
            target = tl.sum(p, axis=0) / HQ
            ikt, pre, logits = _indexer_logits(IK, iq, w, b, pos, valid, M, DI, BLOCK_DI, PRECISION_I, DOT)
            d_logits = tl.where(valid, tl.exp(tl.where(valid, logits - lse_i, 0.0)) * t_sum - target, 0.0)  # [BK]
            d_w += tl.sum(d_logits[None, :] * tl.maximum(pre, 0.0), axis=1)
            d_pre = tl.where(pre > 0, d_logits[None, :] * w[:, None], 0.0)  # [BI, BK]
            d_iq += _dot_nn(d_pre, ikt, DOT, PRECISION_I)
            d_ik = _dot_tn(d_pre, iq, DOT, PRECISION_I)  # [BK, BDI]
            rows = (b.to(tl.int64) * M + tl.where(valid, pos, 0)) * DI
            tl.atomic_add(
                DIK + rows[:, None] + offs_e[None, :], d_ik, mask=valid[:, None] & (offs_e[None, :] < DI), sem="relaxed"
            )
        tl.store(DW + row * HI + ih, d_w, mask=ih_ok)
        tl.store(DIQ + iq_rows, d_iq, mask=iq_mask)


def _pow2(x: int) -> int:
    return max(16, triton.next_power_of_2(x))


def slots_per_tile(q_heads: int, dim: int, heads: int, idim: int) -> int | None:
    """List slots a CUDA program takes at a time, or None where the row's tiles would not fit in
    shared memory. Sized on sm_90 builds: up to 4096 (padded) query-head x dim and indexer-head x
    dim elements, 64 slots (at most 104 KiB); up to 128 x 128 and 64 x 128, 16 slots (at most
    176 KiB, the limit being 227 KiB)."""
    main, indexer = _pow2(q_heads) * _pow2(dim), _pow2(heads) * _pow2(idim)
    if main <= 4096 and indexer <= 4096:
        return 64
    if main <= 128 * 128 and indexer <= 64 * 128:
        return 16
    return None


def launch_shape(q_heads: int, dim: int, heads: int, idim: int, list_length: int) -> tuple[int, int, bool]:
    """(list slots a CUDA program takes at a time, warps, whether it multiplies with ``tl.dot``)
    for lists of ``list_length`` slots. Rows whose products hold at most ``SMALL_PRODUCT``
    elements take the register path, as many slots as the padded list, one warp. Otherwise the
    ``slots_per_tile`` limit, but no wider than the padded list (lists of 40 read 64 slots), and
    one warp where both tiles hold at most 512 elements. A ValueError where the tiles do not fit
    a program at all."""
    width = triton.next_power_of_2(max(1, list_length))
    biggest = max(
        triton.next_power_of_2(q_heads) * triton.next_power_of_2(dim),
        triton.next_power_of_2(heads) * triton.next_power_of_2(idim),
    )
    if biggest * width <= SMALL_PRODUCT:
        return width, 1, False
    slots = slots_per_tile(q_heads, dim, heads, idim)
    if slots is None:
        raise ValueError(
            f"indexer_kl: {q_heads} query heads of {dim} and {heads} indexer heads of {idim} do not fit one program's tiles"
        )
    slots = min(slots, _pow2(list_length))
    small = _pow2(q_heads) * slots <= 512 and _pow2(heads) * slots <= 512
    return slots, 1 if small else 4, True


@torch.library.custom_op("sparsefocus::indexer_kl", mutates_args=())
def _indexer_kl_op(
    q: Tensor, k: Tensor, index: Tensor, iq: Tensor, ik: Tensor, w: Tensor, scale: float, grads: bool
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """q [B, Hq, R, D], k [B, Hk, M, D], index [B, R, K] int32, iq [B, h, R, d], ik [B, M, d],
    w [B, R, h] fp32 -> (KL [B, R], has a key [B, R], d iq, d ik, d w; the gradients zeros without ``grads``)."""
    batch, q_heads, n_rows, dim = q.shape
    kv_heads, n_keys = k.shape[1], k.shape[2]
    heads, idim = iq.shape[1], iq.shape[3]
    kl = torch.empty(batch, n_rows, dtype=torch.float32, device=q.device)
    has = torch.empty_like(kl)
    d_iq, d_w = (torch.zeros_like(iq), torch.zeros_like(w)) if not grads else (torch.empty_like(iq), torch.empty_like(w))
    d_ik = torch.zeros_like(ik)
    if n_rows == 0:
        return kl, has, d_iq, d_ik, d_w
    slots, warps, dot = launch_shape(q_heads, dim, heads, idim, index.shape[-1])
    if not q.is_cuda:  # the interpreter: at most 16 slots, so that test-sized lists span several tiles
        slots, warps = min(slots, 16), 1
    pad = _pow2 if dot else triton.next_power_of_2  # tl.dot needs 16 rows and columns
    _kl_kernel[(n_rows, batch)](
        q, k, index, iq, ik, w, kl, has, d_iq, d_w, d_ik,
        q_heads, kv_heads, n_rows, n_keys, index.shape[-1], heads, scale,
        D=dim, DI=idim, BLOCK_H=pad(q_heads), BLOCK_D=pad(dim), BLOCK_I=pad(heads), BLOCK_DI=pad(idim),
        BLOCK_K=slots, GRADS=grads,
        PRECISION="tf32x3" if q.dtype == torch.float32 else "tf32", PRECISION_I="tf32x3", DOT=dot,
        num_warps=warps,
    )  # fmt: skip
    return kl, has, d_iq, d_ik, d_w


@_indexer_kl_op.register_fake
def _indexer_kl_fake(q, k, index, iq, ik, w, scale, grads):
    rows = q.new_empty(q.shape[0], q.shape[2], dtype=torch.float32)
    return rows, torch.empty_like(rows), torch.empty_like(iq), torch.empty_like(ik), torch.empty_like(w)


def indexer_kl(
    q: Tensor, k: Tensor, index: Tensor, iq: Tensor, ik: Tensor, w: Tensor, scale: float, grads: bool = True
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """DSA's indexer KL per row and its gradients, fused (see the module docstring).

    Args:
        q: [B, Hq, R, D] the rows' queries; k: [B, Hk, M, D], Hq a multiple of Hk; 16-bit or fp32.
        index: [B, R, K] the rows' key lists (shared by every head), -1 = unused slot.
        iq: [B, h, R, d], ik: [B, M, d], w: [B, R, h] the indexer's queries, keys and head weights.
        scale: the main attention's score scale. grads: also compute the gradients. Default: True.
    Returns:
        (KL [B, R] fp32, 0 where a row lists no key; has a key [B, R] as 1.0 / 0.0; d iq, d ik,
        d w of the sum of the rows' KL, zeros without ``grads``). No autograd: the caller applies them.
    """
    if q.dim() != 4 or k.dim() != 4 or q.shape[1] % k.shape[1] or index.shape[:2] != (q.shape[0], q.shape[2]):
        raise ValueError(f"indexer_kl: incompatible q {tuple(q.shape)}, k {tuple(k.shape)} and index {tuple(index.shape)}")
    if iq.shape[2] != q.shape[2] or ik.shape[:2] != (q.shape[0], k.shape[2]) or w.shape != (q.shape[0], q.shape[2], iq.shape[1]):
        raise ValueError(f"indexer_kl: incompatible iq {tuple(iq.shape)}, ik {tuple(ik.shape)} and w {tuple(w.shape)}")
    k = k.detach().to(q.dtype).contiguous()
    tensors = (iq.detach().float().contiguous(), ik.detach().float().contiguous(), w.detach().float().contiguous())
    out = torch.ops.sparsefocus.indexer_kl(
        q.detach().contiguous(), k, index.to(torch.int32).contiguous(), *tensors, float(scale), grads
    )
    return tuple(out)  # type: ignore[return-value]

"""Key gradients of indexed attention over short key rows, without atomics: one-hot tiles on
tensor cores.

The atomic backward (``indexed._indexed_bwd_kernel``) adds each (query, slot) pair's dk and dv
terms into fp32 buffers. When many queries list the same key (a sink, which the Semantic Focus
paper finds chosen by up to every query of a ListOps row), those adds serialise on one address.
The inverse index (``indexed_csr``) removes the atomics but gives the program that owns such a key
all of its pairs, so one program does the row's work. For rows of few keys there is a third way,
which neither serialises nor unbalances:

1. The query-side backward stores each pair's two coefficients, ``coef`` (the pair's dk term is
   ``coef * q`` for dot scores, coef = scale * d loss / d score, and ``-coef * (q - k)`` for the
   distance scores) and ``prob`` (the value's weight, slot weight included), as [B, Hq, N, K]
   fp32.
2. ``short_key_grads``: one program per (BLOCK_N keys, batch x kv head) walks every query row of
   the kv head's group BLOCK_M at a time, builds W [BM, BN] = sum over slots s of coef[:, s] where
   index[:, s] equals the key (K compares per element), and adds W^T @ q into dk and the same with
   prob and dO into dv (``tl.dot``). Distance scores add k_j * sum(coef) at the end.

Work is O(N M K) per head instead of O(N K), so it serves rows of at most a few thousand keys;
the indexed backward's key-gradient mode picks it. The sums are fp32; for 16-bit inputs each
coefficient goes to the 16-bit tensor cores as two parts (about 16 bits for bf16, 22 for fp16:
far below the rounding of the 16-bit gradients they make), for fp32 inputs the products are
fp32. Unlike the atomics they run in a fixed order, so repeated calls give identical gradients.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from sparsefocus.kernels import interpreter_compat  # noqa: F401  (CPU interpreter fix)
from sparsefocus.kernels._ops import op_name

TILES = {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 8}
"""Tile of ``_short_key_grads_kernel``: BLOCK_M query rows against BLOCK_N keys. Not timed: 8 warps
because ptxas (sm_90a, D = Dv = 64, bf16 and fp32) spills registers with 4 and not with 8."""


@triton.jit
def _one_hot_weights(IDX, WEIGHT, rows, ok, keys, NUM_SLOTS, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """W [BM, BN] fp32: the sums of the pairs' weights (``WEIGHT``: coef or prob) over the slots
    of the rows [BM] (flat, int64) that list each key of ``keys`` [BN] (a key listed twice
    counts twice). One tile at a time: two would double the registers live in the loop."""
    w = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for s in range(NUM_SLOTS):
        pair = rows * NUM_SLOTS + s  # [BM]
        idx = tl.load(IDX + pair, mask=ok, other=-1)
        weight = tl.load(WEIGHT + pair, mask=ok, other=0.0)
        w += tl.where(idx[:, None] == keys[None, :], weight[:, None], 0.0)  # -1 (unused slot) lists no key
    return w


@triton.jit
def _one_hot_dot(w, x, SPLIT: tl.constexpr):
    """w^T @ x, [BN, BX] fp32, for one-hot weights w [BM, BN] fp32 and x [BM, BX]: with SPLIT (x
    in a 16-bit dtype) w is split into two parts in x's dtype, w_hi + w_lo, which keeps about
    16 (bf16) or 22 (fp16) bits of each weight on 16-bit tensor cores; else x and w are fp32 and
    the product is exact fp32."""
    if SPLIT:
        w_hi = w.to(x.dtype)
        w_lo = (w - w_hi.to(tl.float32)).to(x.dtype)
        out = tl.dot(tl.trans(w_hi), x)
        out = tl.dot(tl.trans(w_lo), x, out)
    else:
        out = tl.dot(tl.trans(w), x, input_precision="ieee")
    return out


@triton.jit
def _short_key_grads_kernel(
    Q,
    K,
    DOUT,
    IDX,
    COEF,
    PROB,
    DK,
    DV_,
    N,
    M,
    NUM_SLOTS,
    HQ,
    GROUP,
    D: tl.constexpr,
    DV: tl.constexpr,
    DISTANCE: tl.constexpr,
    SPLIT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    pid_n, kv_bh = tl.program_id(0), tl.program_id(1)
    kv_heads = HQ // GROUP
    first_row = ((kv_bh // kv_heads) * HQ + (kv_bh % kv_heads) * GROUP).to(tl.int64) * N  # the group's rows are contiguous
    keys = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d, offs_dv = tl.arange(0, BLOCK_D), tl.arange(0, BLOCK_DV)
    d_ok, dv_ok = offs_d < D, offs_dv < DV
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], tl.float32)
    coef_sum = tl.zeros([BLOCK_N], tl.float32)
    for start in range(0, GROUP * N, BLOCK_M):
        t = start + tl.arange(0, BLOCK_M)
        ok = t < GROUP * N
        rows = first_row + t  # [BM] flat query rows
        q = tl.load(Q + rows[:, None] * D + offs_d[None, :], mask=ok[:, None] & d_ok[None, :], other=0.0)  # input dtype
        do = tl.load(DOUT + rows[:, None] * DV + offs_dv[None, :], mask=ok[:, None] & dv_ok[None, :], other=0.0)
        w_coef = _one_hot_weights(IDX, COEF, rows, ok, keys, NUM_SLOTS, BLOCK_M, BLOCK_N)
        dk += _one_hot_dot(w_coef, q, SPLIT)  # [BN, BD]
        if DISTANCE:
            coef_sum += tl.sum(w_coef, axis=0)
        w_prob = _one_hot_weights(IDX, PROB, rows, ok, keys, NUM_SLOTS, BLOCK_M, BLOCK_N)
        dv += _one_hot_dot(w_prob, do, SPLIT)  # [BN, BDV]
    key_ok = keys < M
    flat = kv_bh.to(tl.int64) * M + keys  # [BN]
    if DISTANCE:  # the pair's term is -coef * (q - k_j)
        kt = tl.load(K + flat[:, None] * D + offs_d[None, :], mask=key_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
        dk = kt * coef_sum[:, None] - dk
    tl.store(DK + flat[:, None] * D + offs_d[None, :], dk, mask=key_ok[:, None] & d_ok[None, :])
    tl.store(DV_ + flat[:, None] * DV + offs_dv[None, :], dv, mask=key_ok[:, None] & dv_ok[None, :])


@torch.library.custom_op(op_name("short_key_grads"), mutates_args=())
def short_key_grads(
    q: Tensor, k: Tensor, v: Tensor, grad_out: Tensor, index: Tensor, coef: Tensor, prob: Tensor, score_code: int
) -> tuple[Tensor, Tensor]:
    """dk [B, Hk, M, D] and dv [B, Hk, M, Dv], fp32, of indexed attention from its pairs'
    coefficients (op ``sparsefocus::short_key_grads``, not differentiable).

    Args: q [B, Hq, N, D], k [B, Hk, M, D] (read only for the distance scores), v [B, Hk, M, Dv]
    (shape only), grad_out [B, Hq, N, Dv], index [B, Hq, N, K] int32 (-1 unused), coef and prob
    fp32 [B, Hq, N, K] as the query-side backward stores them; score_code 0 dot, 1 neg_sqeuclid,
    2 Cauchy.
    """
    q, k, grad_out, index, coef, prob = (x.contiguous() for x in (q, k, grad_out, index, coef, prob))
    batch, kv_heads, n_keys, dim = k.shape
    dk = torch.empty(k.shape, dtype=torch.float32, device=k.device)
    dv = torch.empty(*k.shape[:3], v.shape[-1], dtype=torch.float32, device=k.device)
    grid = (triton.cdiv(n_keys, TILES["BLOCK_N"]), batch * kv_heads)
    _short_key_grads_kernel[grid](
        q,
        k,
        grad_out,
        index,
        coef,
        prob,
        dk,
        dv,
        q.shape[2],
        n_keys,
        index.shape[-1],
        q.shape[1],
        q.shape[1] // kv_heads,
        D=dim,
        DV=v.shape[-1],
        DISTANCE=score_code != 0,
        SPLIT=q.dtype != torch.float32,
        BLOCK_D=max(16, triton.next_power_of_2(dim)),  # tl.dot takes tiles of at least 16
        BLOCK_DV=max(16, triton.next_power_of_2(v.shape[-1])),
        **TILES,
    )
    return dk, dv


@short_key_grads.register_fake
def _short_key_grads_fake(q, k, v, grad_out, index, coef, prob, score_code):
    return k.new_empty(k.shape, dtype=torch.float32), k.new_empty(*k.shape[:3], v.shape[-1], dtype=torch.float32)

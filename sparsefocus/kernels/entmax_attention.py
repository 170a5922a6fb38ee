"""Attention with 1.5-entmax or sparsemax weights, fused in Triton: forward and backward.

The unfused form (``attention.adaptive``, and its slow twin ``entmax_attention_ref``) builds every
fp32 score [B, H, N, M], masks it, normalises it (``kernels.entmax_rows``) and multiplies the
weights by V; its backward is PyTorch over the saved [B, H, N, M] weights: some twenty passes
over that tensor a layer. Here no [N, M] tensor reaches memory:

* forward, two launches (``SPLIT_FORWARD``). First one program per tile of BLOCK_R query rows: the
  rows' scores [BLOCK_R, BLOCK_A + BLOCK_B] sit in registers (two powers of two covering M <=
  ``MAX_KEYS``, ``row_blocks``), summed over BLOCK_DS-wide slices of the head
  dimension so that no operand tile of the whole row is staged. Each row's threshold tau comes
  from ``NEWTON_STEPS`` Newton steps on the mass sum_j phi(y_j - tau) - 1 (convex and decreasing
  in tau, so from tau = max - 1, where it is >= 0, the steps stay at or below the root), then the
  row kernel's exact formula for the support they give, applied twice
  (``entmax_rows._support_sums``, ``_tau_of``); it stores tau. Then programs of BLOCK_Q rows loop
  over key tiles, recompute the scores, turn them into weights
  p = [y - tau]_+^2 (1.5-entmax, y = scale * q.k / 2) or [y - tau]_+ (sparsemax, y = scale * q.k),
  accumulate p V and g V with g = dp/dy's diagonal factor ([y - tau]_+ or the support's
  indicator), and store the output and, for a call that will need gradients, vbar = g V / sum g
  [B, H, N, Dv] fp32 (tau is absolute, +inf for a row with no allowed key).
* the gradient of the scores z = scale * q.k is g * (dP - shift), dP = dO v^T, with the row
  constant shift = sum_j g_j dP_j / sum_j g_j = dO . vbar (``attention.adaptive._Entmax``'s
  backward): no pass over the whole row is needed, so the backward is FlashAttention-2's: a
  query-major kernel (dq, and each row's shift) and a key-major one (dk, dv, the GQA group's
  query heads summed in the program: no atomics).

Allowed keys: key_mask[b, j] (True = real) and, when causal, j <= i + M - N. The launchers are
the ops ``sparsefocus::entmax_attention`` (differentiable in q, k, v) and
``sparsefocus::entmax_attention_bwd`` (docs/kernels.md).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from sparsefocus.kernels import interpreter_compat  # noqa: F401  (CPU interpreter fix)
from sparsefocus.kernels._ops import absent, op_name
from sparsefocus.kernels.entmax_rows import _support_sums, _tau_of

MAX_KEYS = 2048
"""Longest key rows the forward holds in registers; longer ones take the lean path."""
MAX_PART_KEYS = 1024
"""Widest part of a forward row: the score loop stages a [part, BLOCK_DS] key slice per pipeline
stage in shared memory, and 2048 fp32 keys need 264 KB of it, more than an H100 has (232 KB)."""
TILE = 16384  # fp32 scores of one forward program: BLOCK_R = TILE // columns, 16 to 64 rows
BLOCK_DS = 16  # head-dimension slice of the forward's whole-row scores
BLOCK_N = 64  # key tile of the loops over keys
BLOCK_Q = 64  # query tile of the backward
SPLIT_FORWARD = True
"""True: the forward is two launches, the rows' thresholds (BLOCK_R rows a program, the whole row
in registers), then the outputs from the stored thresholds in tiles of BLOCK_Q rows, which read
each key tile once for 64 rows instead of 16; False: one launch does both for its BLOCK_R rows."""
FWD_WARPS: int | None = None
"""Warps of a thresholds program; None: one per 4096 scores of its tile (4 for 16 rows of up to
1024 keys), 4 to 16."""
NEWTON_STEPS = 12
"""Newton steps on each row's mass before the exact support formula (applied twice)."""


def fits(n_keys: int, alpha: float) -> bool:
    """Whether rows of ``n_keys`` keys take the kernel at this alpha (1.5 or 2)."""
    return 0 < n_keys <= MAX_KEYS and alpha in (1.5, 2.0)


@triton.jit
def _allowed(rows, cols, km, N, M, CAUSAL: tl.constexpr):
    """Whether query row i may read key j: a real key, and j <= i + M - N when causal (rows, cols
    and km broadcastable 2-D: [R, 1] and [1, C], or [1, R] and [C, 1])."""
    ok = (rows < N) & (cols < M) & km
    if CAUSAL:
        ok = ok & (cols <= rows + (M - N))
    return ok


@triton.jit
def _weights(y, tau, ok, SQUARE: tl.constexpr):
    """(p, g): the weights [y - tau]_+^2 or [y - tau]_+, and their factor [y - tau]_+ or 1 on the support."""
    gap = tl.where(ok, tl.maximum(y - tau, 0.0), 0.0)
    if SQUARE:
        return gap * gap, gap
    return gap, tl.where(gap > 0.0, 1.0, 0.0)


@triton.jit
def _row_part(
    q_ptr, k_ptr, KM, b, rows, cols, N, M, D, ys,
    CAUSAL: tl.constexpr, PRECISION: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_DS: tl.constexpr,
):  # fmt: skip
    """[BR, BC] y = ys * q.k of the rows against the keys ``cols``, -inf where not allowed; summed
    over BLOCK_DS-wide slices of the head dimension (no operand tile of the whole row staged)."""
    s = tl.zeros([BLOCK_R, BLOCK_C], tl.float32)
    for d0 in range(0, D, BLOCK_DS):
        ds = d0 + tl.arange(0, BLOCK_DS)
        qs = tl.load(q_ptr + rows[:, None] * D + ds[None, :], mask=(rows < N)[:, None] & (ds < D)[None, :], other=0.0)
        ks = tl.load(k_ptr + cols[:, None] * D + ds[None, :], mask=(cols < M)[:, None] & (ds < D)[None, :], other=0.0)
        s += tl.dot(qs, tl.trans(ks), input_precision=PRECISION)
    km = tl.load(KM + b * M + cols, mask=cols < M, other=0) != 0
    return tl.where(_allowed(rows[:, None], cols[None, :], km[None, :], N, M, CAUSAL), s * ys, float("-inf"))


@triton.jit
def _newton_sums(y, tau, SQUARE: tl.constexpr):
    """[BR] each: the mass sum phi(y - tau) over the entries above tau, and minus its slope."""
    gap = tl.where(y > tau[:, None], y - tau[:, None], 0.0)
    if SQUARE:
        return tl.sum(gap * gap, axis=1), 2.0 * tl.sum(gap, axis=1)
    return tl.sum(gap, axis=1), tl.sum(tl.where(gap > 0.0, 1.0, 0.0), axis=1)


@triton.jit
def _row_thresholds(
    q_ptr, k_ptr, KM, b, rows, N, M, D, ys,
    CAUSAL: tl.constexpr, SQUARE: tl.constexpr, STEPS_: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_A: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_DS: tl.constexpr,
):  # fmt: skip
    """[BR] each row's absolute threshold tau (weights [ys * q.k - tau]_+, squared for entmax;
    +inf for a row with no allowed key). The row is held as keys [0, BLOCK_A) and, when BLOCK_B >
    0, [BLOCK_A, BLOCK_A + BLOCK_B): 640 columns instead of 1024 for a row of 601 keys."""
    y_a = _row_part(q_ptr, k_ptr, KM, b, rows, tl.arange(0, BLOCK_A), N, M, D, ys, CAUSAL, PRECISION, BLOCK_R, BLOCK_A, BLOCK_DS)
    top = tl.max(y_a, axis=1)  # [BR]
    if BLOCK_B > 0:
        cols_b = BLOCK_A + tl.arange(0, BLOCK_B)
        y_b = _row_part(q_ptr, k_ptr, KM, b, rows, cols_b, N, M, D, ys, CAUSAL, PRECISION, BLOCK_R, BLOCK_B, BLOCK_DS)
        top = tl.maximum(top, tl.max(y_b, axis=1))
    finite = top > float("-inf")
    shift = tl.where(finite, top, 0.0)
    y_a = y_a - shift[:, None]  # max 0 over the row; -inf stays
    if BLOCK_B > 0:
        y_b = y_b - shift[:, None]
    tau = tl.full([BLOCK_R], -1.0, tl.float32)  # mass - 1 >= 0 here (the top entry alone gives 1)
    for _ in range(STEPS_):  # Newton on the convex, decreasing mass: from the left it stays left
        mass, slope = _newton_sums(y_a, tau, SQUARE)
        if BLOCK_B > 0:
            mass_b, slope_b = _newton_sums(y_b, tau, SQUARE)
            mass, slope = mass + mass_b, slope + slope_b
        tau += (mass - 1.0) / tl.maximum(slope, 1e-30)
    for _ in tl.static_range(2):  # the exact threshold of the support found, twice
        count, total, total_square = _support_sums(y_a, tau)
        if BLOCK_B > 0:
            count_b, total_b, square_b = _support_sums(y_b, tau)
            count, total, total_square = count + count_b, total + total_b, total_square + square_b
        tau = _tau_of(count, total, total_square, SQUARE)
    return tl.where(finite, top + tau, float("inf"))


@triton.jit
def _key_tile(
    q, k_ptr, v_ptr, KM, b, rows, tau, j0, N, M, D, DV, ys,
    CAUSAL: tl.constexpr, SQUARE: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
):  # fmt: skip
    """Keys j0 .. j0 + BLOCK_N for the query rows q [BR, BD] with thresholds tau [BR]: (keys
    [BN, BD], values [BN, BDV], the weights p and their factors g [BR, BN])."""
    dd, dv = tl.arange(0, BLOCK_D), tl.arange(0, BLOCK_DV)
    kc = j0 + tl.arange(0, BLOCK_N)
    kt = tl.load(k_ptr + kc[:, None] * D + dd[None, :], mask=(kc < M)[:, None] & (dd < D)[None, :], other=0.0)
    vt = tl.load(v_ptr + kc[:, None] * DV + dv[None, :], mask=(kc < M)[:, None] & (dv < DV)[None, :], other=0.0)
    kmt = tl.load(KM + b * M + kc, mask=kc < M, other=0) != 0
    yt = tl.dot(q, tl.trans(kt), input_precision=PRECISION) * ys  # [BR, BN]
    p, g = _weights(yt, tau[:, None], _allowed(rows[:, None], kc[None, :], kmt[None, :], N, M, CAUSAL), SQUARE)
    return kt, vt, p, g


@triton.jit
def _attend_rows(
    q_ptr, k_ptr, v_ptr, KM, OUT, VBAR, b, bh, rows, tau, N, M, D, DV, ys,
    CAUSAL: tl.constexpr, SQUARE: tl.constexpr, VBAR_: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
):  # fmt: skip
    """Store the rows' outputs p V and, with VBAR_, vbar = g V / sum g, one key tile at a time."""
    dd, dv = tl.arange(0, BLOCK_D), tl.arange(0, BLOCK_DV)
    q = tl.load(q_ptr + rows[:, None] * D + dd[None, :], mask=(rows < N)[:, None] & (dd < D)[None, :], other=0.0)
    acc = tl.zeros([BLOCK_R, BLOCK_DV], tl.float32)
    acc_g = tl.zeros([BLOCK_R, BLOCK_DV], tl.float32)
    g_sum = tl.zeros([BLOCK_R], tl.float32)
    for j0 in range(0, M, BLOCK_N):
        kt, vt, p, g = _key_tile(
            q, k_ptr, v_ptr, KM, b, rows, tau, j0, N, M, D, DV, ys, CAUSAL, SQUARE, PRECISION, BLOCK_N, BLOCK_D, BLOCK_DV
        )
        acc += tl.dot(p.to(vt.dtype), vt, input_precision=PRECISION)
        if VBAR_:
            acc_g += tl.dot(g.to(vt.dtype), vt, input_precision=PRECISION)
            g_sum += tl.sum(g, axis=1)
    out_ok = (rows < N)[:, None] & (dv < DV)[None, :]
    out_offs = (bh.to(tl.int64) * N + rows[:, None]) * DV + dv[None, :]
    tl.store(OUT + out_offs, acc.to(OUT.dtype.element_ty), mask=out_ok)
    if VBAR_:
        tl.store(VBAR + out_offs, acc_g / tl.maximum(g_sum, 1e-30)[:, None], mask=out_ok)


@triton.jit
def _query_tile(HQ, GROUP, BLOCK: tl.constexpr):
    """This program's (batch-head bh, batch b, kv head row b * HK + hk, query rows [BLOCK]) on a
    grid (query tiles, B * HQ)."""
    pid, bh = tl.program_id(0), tl.program_id(1)
    b, h = bh // HQ, bh % HQ
    return bh, b, b * (HQ // GROUP) + h // GROUP, pid * BLOCK + tl.arange(0, BLOCK)


@triton.jit
def _fwd_kernel(
    Q, K, V, KM, OUT, TAU, VBAR, N, M, D, DV, HQ, GROUP, ys,
    CAUSAL: tl.constexpr, SQUARE: tl.constexpr, STEPS_: tl.constexpr, PRECISION: tl.constexpr, VBAR_: tl.constexpr,
    ATTEND: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_A: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_DS: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
):  # fmt: skip
    """Grid (query tiles, B * HQ): the rows' thresholds, and with ATTEND their outputs too. ys =
    scale, halved for entmax: y = ys * q.k."""
    bh, b, kv, rows = _query_tile(HQ, GROUP, BLOCK_R)  # rows [BR]
    q_ptr = Q + bh.to(tl.int64) * N * D
    k_ptr = K + kv.to(tl.int64) * M * D
    tau = _row_thresholds(
        q_ptr, k_ptr, KM, b, rows, N, M, D, ys, CAUSAL, SQUARE, STEPS_, PRECISION, BLOCK_R, BLOCK_A, BLOCK_B, BLOCK_DS
    )
    tl.store(TAU + bh.to(tl.int64) * N + rows, tau, mask=rows < N)
    if ATTEND:
        v_ptr = V + kv.to(tl.int64) * M * DV
        _attend_rows(
            q_ptr, k_ptr, v_ptr, KM, OUT, VBAR, b, bh, rows, tau, N, M, D, DV, ys,
            CAUSAL, SQUARE, VBAR_, PRECISION, BLOCK_R, BLOCK_N, BLOCK_D, BLOCK_DV,
        )  # fmt: skip


@triton.jit
def _attend_kernel(
    Q, K, V, KM, OUT, TAU, VBAR, N, M, D, DV, HQ, GROUP, ys,
    CAUSAL: tl.constexpr, SQUARE: tl.constexpr, PRECISION: tl.constexpr, VBAR_: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
):  # fmt: skip
    """Grid (query tiles, B * HQ): outputs (and vbar) of BLOCK_R rows from their stored thresholds."""
    bh, b, kv, rows = _query_tile(HQ, GROUP, BLOCK_R)
    tau = tl.load(TAU + bh.to(tl.int64) * N + rows, mask=rows < N, other=float("inf"))
    _attend_rows(
        Q + bh.to(tl.int64) * N * D, K + kv.to(tl.int64) * M * D, V + kv.to(tl.int64) * M * DV, KM, OUT, VBAR, b, bh,
        rows, tau, N, M, D, DV, ys, CAUSAL, SQUARE, VBAR_, PRECISION, BLOCK_R, BLOCK_N, BLOCK_D, BLOCK_DV,
    )  # fmt: skip


@triton.jit
def _bwd_dq_kernel(
    Q, K, V, KM, TAU, VBAR, DO, DQ, SHIFT, N, M, D, DV, HQ, GROUP, ys, scale,
    CAUSAL: tl.constexpr, SQUARE: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
):  # fmt: skip
    """Grid (query tiles, B * HQ): dq, and each row's shift = dO . vbar for the key-major kernel."""
    bh, b, kv, rows = _query_tile(HQ, GROUP, BLOCK_Q)
    dd, dv = tl.arange(0, BLOCK_D), tl.arange(0, BLOCK_DV)
    row_ok = rows < N
    q_offs = (bh.to(tl.int64) * N + rows[:, None]) * D + dd[None, :]
    o_offs = (bh.to(tl.int64) * N + rows[:, None]) * DV + dv[None, :]
    q = tl.load(Q + q_offs, mask=row_ok[:, None] & (dd < D)[None, :], other=0.0)  # [BQ, BD]
    do = tl.load(DO + o_offs, mask=row_ok[:, None] & (dv < DV)[None, :], other=0.0)  # [BQ, BDV]
    vbar = tl.load(VBAR + o_offs, mask=row_ok[:, None] & (dv < DV)[None, :], other=0.0)
    shift = tl.sum(do.to(tl.float32) * vbar, axis=1)  # [BQ]
    tau = tl.load(TAU + bh.to(tl.int64) * N + rows, mask=row_ok, other=float("inf"))
    tl.store(SHIFT + bh.to(tl.int64) * N + rows, shift, mask=row_ok)
    k_ptr = K + kv.to(tl.int64) * M * D
    v_ptr = V + kv.to(tl.int64) * M * DV
    dq = tl.zeros([BLOCK_Q, BLOCK_D], tl.float32)
    end = M
    if CAUSAL:  # the tile's last row reads keys up to its position + M - N
        end = tl.minimum(M, tl.program_id(0) * BLOCK_Q + BLOCK_Q + M - N)
    for j0 in range(0, end, BLOCK_N):
        kt, vt, _, g = _key_tile(
            q, k_ptr, v_ptr, KM, b, rows, tau, j0, N, M, D, DV, ys, CAUSAL, SQUARE, PRECISION, BLOCK_N, BLOCK_D, BLOCK_DV
        )
        dp = tl.dot(do, tl.trans(vt), input_precision=PRECISION)  # [BQ, BN]
        dz = g * (dp - shift[:, None])  # the scores' gradient
        dq += tl.dot(dz.to(kt.dtype), kt, input_precision=PRECISION)
    tl.store(DQ + q_offs, (dq * scale).to(DQ.dtype.element_ty), mask=row_ok[:, None] & (dd < D)[None, :])


@triton.jit
def _bwd_dkdv_kernel(
    Q, K, V, KM, TAU, DO, SHIFT, DK, DV_, N, M, D, DV, HQ, GROUP, ys, scale,
    CAUSAL: tl.constexpr, SQUARE: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
):  # fmt: skip
    """Grid (key tiles, B * HK): dk and dv of BLOCK_N keys, summed over the GROUP query heads that
    read them and every query tile that may."""
    pid, bkv = tl.program_id(0), tl.program_id(1)
    hk_count = HQ // GROUP
    b, hk = bkv // hk_count, bkv % hk_count
    kc = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    dd, dv = tl.arange(0, BLOCK_D), tl.arange(0, BLOCK_DV)
    key_ok = kc < M
    k_offs = (bkv.to(tl.int64) * M + kc[:, None]) * D + dd[None, :]
    v_offs = (bkv.to(tl.int64) * M + kc[:, None]) * DV + dv[None, :]
    kt = tl.load(K + k_offs, mask=key_ok[:, None] & (dd < D)[None, :], other=0.0)  # [BN, BD]
    vt = tl.load(V + v_offs, mask=key_ok[:, None] & (dv < DV)[None, :], other=0.0)  # [BN, BDV]
    kmt = tl.load(KM + b * M + kc, mask=key_ok, other=0) != 0
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dvv = tl.zeros([BLOCK_N, BLOCK_DV], tl.float32)
    start = 0
    if CAUSAL:  # rows before (first key - (M - N)) read none of these keys
        start = tl.maximum(0, pid * BLOCK_N - (M - N)) // BLOCK_Q * BLOCK_Q
    for g_i in range(0, GROUP):
        bh = b * HQ + hk * GROUP + g_i
        for i0 in range(start, N, BLOCK_Q):
            rows = i0 + tl.arange(0, BLOCK_Q)
            row_ok = rows < N
            q = tl.load(
                Q + (bh.to(tl.int64) * N + rows[:, None]) * D + dd[None, :], mask=row_ok[:, None] & (dd < D)[None, :], other=0.0
            )
            do = tl.load(
                DO + (bh.to(tl.int64) * N + rows[:, None]) * DV + dv[None, :],
                mask=row_ok[:, None] & (dv < DV)[None, :],
                other=0.0,
            )
            tau = tl.load(TAU + bh.to(tl.int64) * N + rows, mask=row_ok, other=float("inf"))
            shift = tl.load(SHIFT + bh.to(tl.int64) * N + rows, mask=row_ok, other=0.0)
            yt = tl.dot(kt, tl.trans(q), input_precision=PRECISION) * ys  # [BN, BQ]
            ok = _allowed(rows[None, :], kc[:, None], kmt[:, None], N, M, CAUSAL)  # [BN, BQ]
            p, g = _weights(yt, tau[None, :], ok, SQUARE)
            dvv += tl.dot(p.to(do.dtype), do, input_precision=PRECISION)
            dp = tl.dot(vt, tl.trans(do), input_precision=PRECISION)  # [BN, BQ]
            dz = g * (dp - shift[None, :])
            dk += tl.dot(dz.to(q.dtype), q, input_precision=PRECISION)
    tl.store(DK + k_offs, (dk * scale).to(DK.dtype.element_ty), mask=key_ok[:, None] & (dd < D)[None, :])
    tl.store(DV_ + v_offs, dvv.to(DV_.dtype.element_ty), mask=key_ok[:, None] & (dv < DV)[None, :])


def row_blocks(n_keys: int) -> tuple[int, int]:
    """(BLOCK_A, BLOCK_B): the forward's row as one power of two, or as two when that holds fewer
    columns (601 keys: 512 + 128 instead of 1024) or when one would be wider than
    ``MAX_PART_KEYS`` (2048 keys: 1024 + 1024); BLOCK_B = 0 for one."""
    whole = max(16, triton.next_power_of_2(n_keys))
    half = whole // 2
    rest = max(16, triton.next_power_of_2(max(1, n_keys - half)))
    return (half, rest) if half >= 16 and (half + rest < whole or whole > MAX_PART_KEYS) else (whole, 0)


def _sizes(q: Tensor, k: Tensor, v: Tensor) -> dict:
    """The launch's sizes and the tiles' powers of two."""
    batch, heads, n_queries, width = q.shape
    return {
        "N": n_queries,
        "M": k.shape[2],
        "D": width,
        "DV": v.shape[3],
        "HQ": heads,
        "GROUP": heads // k.shape[1],
        "BLOCK_D": max(16, triton.next_power_of_2(width)),
        "BLOCK_DV": max(16, triton.next_power_of_2(v.shape[3])),
    }


def _common(q: Tensor, alpha: float, scale: float) -> dict:
    return {
        "ys": scale * (0.5 if alpha == 1.5 else 1.0),
        "SQUARE": alpha == 1.5,
        "PRECISION": "ieee" if q.dtype == torch.float32 else "tf32",
    }


@torch.library.custom_op(op_name("entmax_attention"), mutates_args=())
def entmax_attention_op(
    q: Tensor, k: Tensor, v: Tensor, key_mask: Tensor, alpha: float, scale: float, causal: bool, vbar: bool
) -> tuple[Tensor, Tensor, Tensor]:
    """``sparsefocus::entmax_attention``: (out [B, Hq, N, Dv] in q's dtype, tau [B, Hq, N] fp32,
    vbar [B, Hq, N, Dv] fp32, or [0] when ``vbar`` is False: a call without gradients) for
    contiguous q [B, Hq, N, D], k [B, Hk, M, D], v [B, Hk, M, Dv] and key_mask [B, M] bool (True =
    real key)."""
    out, tau, vbar_out = _fwd_outputs(q, v, vbar)
    sizes = _sizes(q, k, v)
    if out.numel() == 0:
        return out, tau, vbar_out
    block_a, block_b = row_blocks(sizes["M"])
    block_r = min(64, max(16, 1 << (TILE // (block_a + block_b)).bit_length() - 1))  # a power of two
    batch_heads = q.shape[0] * q.shape[1]
    common = {**sizes, **_common(q, alpha, scale), "CAUSAL": causal, "VBAR_": vbar}
    blocks = {"BLOCK_N": BLOCK_N}
    _fwd_kernel[(triton.cdiv(sizes["N"], block_r), batch_heads)](
        q, k, v, key_mask.view(torch.uint8), out, tau, vbar_out, **common, **blocks, STEPS_=NEWTON_STEPS,
        ATTEND=not SPLIT_FORWARD, BLOCK_R=block_r, BLOCK_A=block_a, BLOCK_B=block_b, BLOCK_DS=BLOCK_DS,
        num_warps=(FWD_WARPS or max(4, min(16, block_r * (block_a + block_b) // 4096))) if q.is_cuda else 1,
    )  # fmt: skip
    if SPLIT_FORWARD:
        _attend_kernel[(triton.cdiv(sizes["N"], BLOCK_Q), batch_heads)](
            q, k, v, key_mask.view(torch.uint8), out, tau, vbar_out, **common, **blocks, BLOCK_R=BLOCK_Q,
            num_warps=4 if q.is_cuda else 1,
        )  # fmt: skip
    return out, tau, vbar_out


def _fwd_outputs(q: Tensor, v: Tensor, vbar: bool) -> tuple[Tensor, Tensor, Tensor]:
    batch, heads, n_queries, _ = q.shape
    out = q.new_empty(batch, heads, n_queries, v.shape[3])
    tau = q.new_empty(batch, heads, n_queries, dtype=torch.float32)
    vbar_out = q.new_empty(batch, heads, n_queries, v.shape[3], dtype=torch.float32) if vbar else absent(tau)
    return out, tau, vbar_out


@entmax_attention_op.register_fake
def _entmax_attention_fake(q, k, v, key_mask, alpha, scale, causal, vbar):
    return _fwd_outputs(q, v, vbar)


@torch.library.custom_op(op_name("entmax_attention_bwd"), mutates_args=())
def entmax_attention_bwd(
    grad: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    key_mask: Tensor,
    tau: Tensor,
    vbar: Tensor,
    alpha: float,
    scale: float,
    causal: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """``sparsefocus::entmax_attention_bwd``: (dq, dk, dv) like q, k, v from the output's gradient
    and the forward's tau and vbar."""
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    sizes, common = _sizes(q, k, v), _common(q, alpha, scale)
    if q.numel() == 0 or k.numel() == 0:
        return dq.zero_(), dk.zero_(), dv.zero_()
    grad = grad.contiguous()
    shift = torch.empty_like(tau)
    warps = 4 if q.is_cuda else 1
    key_mask = key_mask.view(torch.uint8)
    grid_q = (triton.cdiv(sizes["N"], BLOCK_Q), q.shape[0] * q.shape[1])
    _bwd_dq_kernel[grid_q](
        q, k, v, key_mask, tau, vbar, grad, dq, shift, **sizes, **common, scale=scale,
        CAUSAL=causal, BLOCK_Q=BLOCK_Q, BLOCK_N=BLOCK_N, num_warps=warps,
    )  # fmt: skip
    grid_k = (triton.cdiv(sizes["M"], BLOCK_N), k.shape[0] * k.shape[1])
    _bwd_dkdv_kernel[grid_k](
        q, k, v, key_mask, tau, grad, shift, dk, dv, **sizes, **common, scale=scale,
        CAUSAL=causal, BLOCK_Q=BLOCK_Q, BLOCK_N=BLOCK_N, num_warps=warps,
    )  # fmt: skip
    return dq, dk, dv


@entmax_attention_bwd.register_fake
def _entmax_attention_bwd_fake(grad, q, k, v, key_mask, tau, vbar, alpha, scale, causal):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup(ctx, inputs, output) -> None:
    q, k, v, key_mask, alpha, scale, causal, _ = inputs
    _, tau, vbar = output
    ctx.save_for_backward(q, k, v, key_mask, tau, vbar)
    ctx.alpha, ctx.scale, ctx.causal = alpha, scale, causal
    ctx.mark_non_differentiable(tau, vbar)


def _backward(ctx, grad: Tensor, _grad_tau: Tensor, _grad_vbar: Tensor):
    q, k, v, key_mask, tau, vbar = ctx.saved_tensors
    dq, dk, dv = entmax_attention_bwd(grad, q, k, v, key_mask, tau, vbar, ctx.alpha, ctx.scale, ctx.causal)
    return dq, dk, dv, None, None, None, None, None


entmax_attention_op.register_autograd(_backward, setup_context=_setup)


def _check(q: Tensor, k: Tensor, v: Tensor, alpha: float, key_padding_mask: Tensor | None) -> None:
    """One-line ValueErrors for what the kernel cannot take."""
    if alpha not in (1.5, 2.0):
        raise ValueError(f"entmax_attention: alpha must be 1.5 (1.5-entmax) or 2 (sparsemax), got {alpha}")
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"entmax_attention: q, k, v must be [B, H, N, D], got {list(q.shape)}, {list(k.shape)}, {list(v.shape)}")
    if not q.dtype == k.dtype == v.dtype or q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"entmax_attention: q, k, v must share one of fp16, bf16, fp32, got {q.dtype}, {k.dtype}, {v.dtype}")
    batch, heads, _, width = q.shape
    if k.shape[0] != batch or v.shape[:3] != k.shape[:3] or k.shape[3] != width or heads % max(1, k.shape[1]):
        raise ValueError(
            f"entmax_attention: needs q [B, Hq, N, D], k [B, Hk, M, D], v [B, Hk, M, Dv] with Hk dividing Hq, got "
            f"{list(q.shape)}, {list(k.shape)}, {list(v.shape)}"
        )
    if not fits(k.shape[2], alpha):
        raise ValueError(f"entmax_attention: rows of {k.shape[2]} keys, more than MAX_KEYS = {MAX_KEYS}")
    if key_padding_mask is not None and (
        key_padding_mask.dtype != torch.bool or tuple(key_padding_mask.shape) != (batch, k.shape[2])
    ):
        raise ValueError(
            f"entmax_attention: key_padding_mask must be bool [B, M] = {[batch, k.shape[2]]}, got "
            f"{key_padding_mask.dtype} {list(key_padding_mask.shape)}"
        )


def entmax_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    alpha: float,
    scale: float,
    causal: bool = False,
    key_padding_mask: Tensor | None = None,
) -> Tensor:
    """Attention whose weights are alpha-entmax of the scaled scores over the allowed keys.

    Args:
        q: [B, Hq, N, D]; k: [B, Hk, M, D]; v: [B, Hk, M, Dv], Hk dividing Hq (query head h reads
            kv head h // (Hq // Hk)); M at most ``MAX_KEYS``.
        alpha: 1.5 (1.5-entmax) or 2.0 (sparsemax).
        scale: the scores are scale * q.k.
        causal: key j is allowed for query i only if j <= i + M - N. Default: False.
        key_padding_mask: [B, M] bool, True = real key. Default: every key real.
    Returns:
        [B, Hq, N, Dv] in q's dtype, differentiable in q, k and v (op ``sparsefocus::entmax_attention``);
        0 for a row with no allowed key. Equals ``attention.adaptive.entmax_attention_ref`` up to rounding.
    """
    _check(q, k, v, alpha, key_padding_mask)
    if key_padding_mask is None:
        key_padding_mask = torch.ones(k.shape[0], k.shape[2], dtype=torch.bool, device=k.device)
    grads = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    out, _, _ = entmax_attention_op(
        q.contiguous(),
        k.contiguous(),
        v.contiguous(),
        key_padding_mask.contiguous(),
        float(alpha),
        float(scale),
        bool(causal),
        grads,
    )
    return out

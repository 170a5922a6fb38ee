"""ZETA's dv for window keys in sorted order: one pass per tile of sorted key slots, no per-query atomics.

The indexed kernel's backward adds p_ij * dO_i into dv_j with one fp32 atomic per (query, listed
key, column); at 64K that traffic is most of ZETA's backward. Window keys have structure: the
queries of chunk p + 1 search prefix p's keys in sorted order, and their windows start at slots
that grow with the query's code. So, with the queries of each chunk sorted by window start, the
queries whose windows touch a tile of BLOCK_R consecutive sorted slots are one contiguous run.
``_window_dv_kernel`` walks that run in blocks of BLOCK_Q queries, rebuilds their Cauchy weights
on the tile (kept or not from the selection kernel's bit mask), and adds dv_tile = P^T dO once per
key and prefix (a key of chunk c is in prefixes c .. P-1, so at most P atomic rows per key).

It plugs into ``indexed_attention`` as a ``DvPass`` (the kernel leaves those keys' dv out). The
slow twin is ``indexed_attention_ref``; the tests compare ``zeta_window_attention`` with it,
outputs and every gradient. Causal, one curve, Cauchy only.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from sparsefocus.kernels import interpreter_compat  # noqa: F401  (CPU interpreter fix)
from sparsefocus.kernels.indexed import indexed_attention
from sparsefocus.kernels.zeta_select import WindowSelection

BLOCK_R = 32  # sorted key slots per program
BLOCK_Q = 32  # queries per inner step


@triton.jit
def _first_at_least(SORTED, lo, hi, value, STEPS):
    """Index of the first entry >= value in the sorted int32 run SORTED[lo:hi] (hi if none)."""
    for _ in range(STEPS):
        mid = (lo + hi) // 2
        below = tl.load(SORTED + mid, mask=lo < hi, other=0) < value
        lo = tl.where((lo < hi) & below, mid + 1, lo)
        hi = tl.where((lo < hi) & (~below), mid, hi)
    return lo


@triton.jit
def _window_dv_kernel(
    Q, K, DOUT, STAT, GAMMA_SQ, SPOS, COUNT, ORDER, SSTART, KEPT, DV,
    N, M, B, HQ, HK, GROUP, CHUNK, STEPS,
    D: tl.constexpr, DVW: tl.constexpr, WINDOW: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    tile, p, bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    b, hq = bh // HQ, bh % HQ
    kv = b * HK + hq // GROUP
    count = tl.load(COUNT + p * B + b)
    slots = tile * BLOCK_R + tl.arange(0, BLOCK_R)  # [BR] sorted slots of prefix p
    slot_ok = slots < count
    offs_d, offs_dv = tl.arange(0, BLOCK_D), tl.arange(0, BLOCK_DV)
    pos = tl.load(SPOS + ((p * B + b) * HK + hq // GROUP).to(tl.int64) * M + slots, mask=slot_ok, other=0)
    kt = tl.load(K + (kv.to(tl.int64) * M + pos[:, None]) * D + offs_d[None, :], mask=slot_ok[:, None] & (offs_d[None, :] < D), other=0.0).to(tl.float32)
    gamma_sq = tl.load(GAMMA_SQ + hq)
    row_base = bh.to(tl.int64) * N
    first = (p + 1) * CHUNK  # the queries of chunk p + 1, in order of window start
    last = tl.minimum(first + CHUNK, N)
    lo = _first_at_least(SSTART + row_base, first, last, tile * BLOCK_R - WINDOW + 1, STEPS)
    hi = _first_at_least(SSTART + row_base, first, last, tile * BLOCK_R + BLOCK_R, STEPS)
    acc = tl.zeros([BLOCK_R, BLOCK_DV], tl.float32)
    for at in range(lo, hi, BLOCK_Q):
        visit = at + tl.arange(0, BLOCK_Q)
        q_ok = visit < hi
        row = tl.load(ORDER + row_base + visit, mask=q_ok, other=0)  # [BQ] query positions
        start = tl.load(SSTART + row_base + visit, mask=q_ok, other=-1)
        kept = tl.load(KEPT + row_base + row, mask=q_ok, other=0)
        total = tl.load(STAT + row_base + row, mask=q_ok, other=1.0)
        qt = tl.load(Q + (row_base + row[:, None]) * D + offs_d[None, :], mask=q_ok[:, None] & (offs_d[None, :] < D), other=0.0).to(tl.float32)
        do = tl.load(DOUT + (row_base + row[:, None]) * DVW + offs_dv[None, :], mask=q_ok[:, None] & (offs_dv[None, :] < DVW), other=0.0).to(tl.float32)
        rel = slots[None, :] - start[:, None]  # [BQ, BR] column of the slot in the query's window
        inside = q_ok[:, None] & slot_ok[None, :] & (rel >= 0) & (rel < WINDOW)
        chosen = inside & (((kept[:, None] >> tl.minimum(tl.maximum(rel, 0), 63).to(tl.int64)) & 1) != 0)
        diff = qt[:, None, :] - kt[None, :, :]  # [BQ, BR, BD]
        weight = 1.0 / (tl.sum(diff * diff, axis=2) + gamma_sq)
        prob = tl.where(chosen, weight / tl.where(total > 0, total, 1.0)[:, None], 0.0)  # [BQ, BR]
        acc += tl.dot(tl.trans(prob), do, input_precision="ieee")  # [BR, BDV]
    dv_ptrs = DV + (kv.to(tl.int64) * M + pos[:, None]) * DVW + offs_dv[None, :]
    tl.atomic_add(dv_ptrs, acc, mask=slot_ok[:, None] & (offs_dv[None, :] < DVW), sem="relaxed")


def window_order(window: WindowSelection, n_queries: int) -> tuple[Tensor, Tensor]:
    """Queries sorted by (chunk, window start): order [B, Hq, N] int32 and the starts in that order."""
    chunk_of = torch.arange(n_queries, device=window.start.device) // window.chunk  # [N]
    key = chunk_of.to(torch.int64) * (1 << 32) + (window.start.to(torch.int64) + 1)  # [B, Hq, N]
    sorted_key, order = torch.sort(key, dim=-1, stable=True)
    return order.to(torch.int32).contiguous(), ((sorted_key & 0xFFFFFFFF) - 1).to(torch.int32).contiguous()


def add_window_dv(dv: Tensor, q: Tensor, k: Tensor, grad_out: Tensor, stat: Tensor, gamma_sq: Tensor, window: WindowSelection) -> None:
    """dv [B, Hk, M, Dv] fp32 += the window keys' share: sum_i p_ij dO_i over the queries whose
    window kept key j. q [B, Hq, N, D], k [B, Hk, M, D], grad_out [B, Hq, N, Dv], stat [B, Hq, N]
    the forward's Cauchy totals, gamma_sq [Hq]."""
    batch, q_heads, n_queries, dim = q.shape
    kv_heads, n_keys, width = k.shape[1], k.shape[2], grad_out.shape[-1]
    order, starts = window_order(window, n_queries)
    prefixes = window.positions.shape[0]
    grid = (triton.cdiv(n_keys, BLOCK_R), prefixes, batch * q_heads)
    _window_dv_kernel[grid](
        q, k, grad_out, stat, gamma_sq, window.positions, window.count, order, starts, window.kept, dv,
        n_queries, n_keys, batch, q_heads, kv_heads, q_heads // kv_heads, window.chunk, max(1, n_queries.bit_length() + 1),
        D=dim, DVW=width, WINDOW=window.window, BLOCK_R=BLOCK_R, BLOCK_Q=BLOCK_Q,
        BLOCK_D=triton.next_power_of_2(dim), BLOCK_DV=max(16, triton.next_power_of_2(width)),
    )


class WindowDvPass:
    """The ``DvPass`` of ``indexed_attention`` for ZETA: the kernel leaves out the dv of keys
    before each query's chunk (its window keys) and ``add_window_dv`` adds them."""

    def __init__(self, window: WindowSelection) -> None:
        self.window = window

    def split(self, q: Tensor, k: Tensor, grad_out: Tensor, stat: Tensor, gamma_sq: Tensor):
        chunk = self.window.chunk
        bound = (torch.arange(q.shape[2], device=q.device, dtype=torch.int32) // chunk) * chunk  # [N] chunk starts
        add = lambda dv: add_window_dv(dv, q, k, grad_out, stat, gamma_sq, self.window)
        return bound.expand(q.shape[:3]).contiguous(), add


def zeta_window_attention(
    q: Tensor, k: Tensor, v: Tensor, index: Tensor, window: WindowSelection, *, gamma: Tensor | float | None,
    extra_key: Tensor, extra_value: Tensor, extra_mask: Tensor | None = None, score: str = "cauchy",
) -> Tensor:
    """``indexed_attention(q, k, v, index, score="cauchy", gamma=..., extra_*=...)`` for ZETA's
    causal one-curve selection, with the window keys' dv computed in sorted order.

    Args:
        q: [B, Hq, N, D]; k: [B, Hk, M, D]; v: [B, Hk, M, Dv]; index: [B, Hq, N, K] from
        ``zeta_select(..., windows=True)`` with its ``window``; gamma, extra_*: as
        ``indexed_attention``; score: must be "cauchy".
    Returns:
        [B, Hq, N, Dv] in q.dtype.
    """
    if score != "cauchy":
        raise ValueError(f"zeta_window_attention computes Cauchy weights only, got score={score!r}")
    return indexed_attention(
        q, k, v, index, score="cauchy", gamma=gamma, extra_key=extra_key, extra_value=extra_value, extra_mask=extra_mask,
        dv_pass=WindowDvPass(window),
    )

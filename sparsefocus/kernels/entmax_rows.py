"""Sparsemax and 1.5-entmax of short rows in Triton, a row in registers.

The PyTorch forms (``attention.adaptive``, the slow twins) sort each row and take cumulative sums:
about fifteen passes over a [rows, M] fp32 tensor. Here a program holds BLOCK_R rows of at most
BLOCK scores and finds each row's threshold tau in registers, reading the scores once and
writing the weights once:

* with the row's maximum subtracted (sparsemax: y = z; 1.5-entmax: y = z / 2, both shifted so
  that max y = 0), tau lies in [-1, 0); ``STEPS`` bisection rounds on the mass
  sum_i phi(y_i - tau) (phi(x) = x, or x^2, on x > 0) narrow it to the support {y > tau};
* the exact tau of that support follows from its sums (sparsemax: (sum y - 1) / k; 1.5-entmax:
  the smaller root of sum (y - tau)^2 = 1, mean - sqrt((1 - k var) / k)), recomputed twice with
  the support it gives, as the sorted forms compute it from the k largest.

-inf entries get weight 0; a row of -inf gets zeros. ``sparsefocus::entmax_rows`` is a custom op
(fixed shapes, no host synchronisation); the backward is the PyTorch one, from the weights.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from sparsefocus.kernels import interpreter_compat  # noqa: F401  (CPU interpreter fix)

MAX_KEYS = 4096
"""Longest rows the kernel holds in registers."""
TILE = 4096  # scores of one program: rows per program = this // padded row length
STEPS = 30  # bisection rounds: the bracket of width 1 falls below fp32 resolution near tau


@triton.jit
def _mass(y, tau, SQUARE: tl.constexpr):
    """[BR] sum over the row of phi(y - tau) on the entries above tau."""
    gap = tl.where(y > tau[:, None], y - tau[:, None], 0.0)
    return tl.sum(gap * gap if SQUARE else gap, axis=1)


@triton.jit
def _support_sums(y, tau):
    """[BR] each: the count, sum and sum of squares of the entries above tau."""
    inside = y > tau[:, None]
    count = tl.sum(inside.to(tl.float32), axis=1)
    return count, tl.sum(tl.where(inside, y, 0.0), axis=1), tl.sum(tl.where(inside, y * y, 0.0), axis=1)


@triton.jit
def _tau_of(count, total, total_square, SQUARE: tl.constexpr):
    """[BR] the exact threshold of a support from its count, sum and sum of squares."""
    count = tl.maximum(count, 1.0)
    if SQUARE:
        mean = total / count
        spread = (1.0 - count * (total_square / count - mean * mean)) / count
        return mean - tl.sqrt(tl.maximum(spread, 0.0))
    return (total - 1.0) / count


@triton.jit
def _support_tau(y, tau, SQUARE: tl.constexpr):
    """[BR] the exact threshold of the support {y > tau}."""
    count, total, total_square = _support_sums(y, tau)
    return _tau_of(count, total, total_square, SQUARE)


@triton.jit
def _entmax_rows_kernel(S, P, R, M, SQUARE: tl.constexpr, STEPS_: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)  # [BR]
    cols = tl.arange(0, BLOCK)
    inside = (rows < R)[:, None] & (cols < M)[None, :]  # [BR, BLOCK]
    offsets = rows[:, None].to(tl.int64) * M + cols[None, :]
    z = tl.load(S + offsets, mask=inside, other=float("-inf"))
    top = tl.max(z, axis=1)  # [BR]
    finite = top > float("-inf")
    scale = 0.5 if SQUARE else 1.0
    y = tl.where(z > float("-inf"), (z - tl.where(finite, top, 0.0)[:, None]) * scale, float("-inf"))  # max 0
    low = tl.full([BLOCK_R], -1.0, tl.float32)  # mass >= 1 here (the top entry alone gives 1)
    high = tl.zeros([BLOCK_R], tl.float32)  # mass 0 here
    for _ in range(STEPS_):
        mid = (low + high) * 0.5
        heavy = _mass(y, mid, SQUARE) >= 1.0
        low = tl.where(heavy, mid, low)
        high = tl.where(heavy, high, mid)
    tau = _support_tau(y, low, SQUARE)
    tau = _support_tau(y, tau, SQUARE)
    gap = tl.where(y > tau[:, None], y - tau[:, None], 0.0)
    weight = gap * gap if SQUARE else gap
    tl.store(P + offsets, tl.where(finite[:, None], weight, 0.0), mask=inside)


@torch.library.custom_op("sparsefocus::entmax_rows", mutates_args=())
def _entmax_rows_op(scores: Tensor, alpha: float) -> Tensor:
    """scores [R, M] fp32 (-inf = excluded), alpha 1.5 or 2 -> weights [R, M] fp32."""
    n_rows, n_keys = scores.shape
    out = torch.empty_like(scores)
    if n_rows == 0 or n_keys == 0:
        return out
    block = max(16, triton.next_power_of_2(n_keys))
    block_r = max(1, min(64, TILE // block))
    _entmax_rows_kernel[(triton.cdiv(n_rows, block_r),)](
        scores, out, n_rows, n_keys, SQUARE=alpha == 1.5, STEPS_=STEPS, BLOCK_R=block_r, BLOCK=block,
        num_warps=4 if scores.is_cuda else 1,
    )  # fmt: skip
    return out


@_entmax_rows_op.register_fake
def _entmax_rows_fake(scores: Tensor, alpha: float) -> Tensor:
    return torch.empty_like(scores)


def fits(n_keys: int, alpha: float) -> bool:
    """Whether rows of ``n_keys`` scores take the kernel at this alpha (1.5 or 2)."""
    return 0 < n_keys <= MAX_KEYS and alpha in (1.5, 2.0)


def entmax_rows(scores: Tensor, alpha: float) -> Tensor:
    """Sparsemax (alpha = 2) or 1.5-entmax (alpha = 1.5) over the last dim of ``scores`` [..., M]
    (M <= ``MAX_KEYS``; -inf entries get 0) -> fp32 weights of the same shape. No autograd."""
    if not fits(scores.shape[-1], alpha):
        raise ValueError(f"entmax_rows: alpha {alpha} over rows of {scores.shape[-1]} (alpha 1.5 or 2, at most {MAX_KEYS})")
    flat = scores.detach().float().reshape(-1, scores.shape[-1]).contiguous()  # [R, M]
    return torch.ops.sparsefocus.entmax_rows(flat, float(alpha)).view(scores.shape)

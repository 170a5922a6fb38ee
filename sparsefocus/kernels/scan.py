"""Scaled cumulative sums along the sequence in Triton: ZETA's causal mean token and its gradient.

The slow twin that defines the result is ``sparsefocus.attention.zeta.CausalMean`` (torch, row
blocks with a carried fp32 sum). Here the sum is two-level and every level is parallel:

* ``_tile_sums_kernel``: one program per (tile of BLOCK_N rows, batch x head, BLOCK_X columns)
  writes the fp32 sum of ``pre[row] * x[row]`` over its tile;
* torch turns those tile sums [BH, X, T] into the carry of every tile (a scan over T tiles,
  innermost dim, so it is one fast pass);
* ``_tile_scan_kernel``: each tile scans its rows in registers, adds its carry and writes
  ``post[row] * total`` in x's dtype.

Forward of the mean: pre = real key (0/1), post = 1 / count, scan forward. Backward: pre = 1 /
count, post = real key, scan reversed (dx_j = real_j * sum_{i >= j} g_i / count_i). Causal by
construction: a forward scan's row i reads rows <= i only.

The launcher is the ``torch.library`` op ``sparsefocus::scaled_scan``, differentiable in x (its
gradient is the reversed scan with pre and post swapped).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from sparsefocus.kernels import interpreter_compat  # noqa: F401  (CPU interpreter fix)
from sparsefocus.kernels._ops import op_name

TILE_OVERRIDES: dict = {}
"""Benchmark hook: {"BLOCK_N": rows per tile, "num_warps": ...} replacing ``_tiles``' choice."""


def _tiles(width: int) -> dict:
    """Rows per tile and warps (H200, 64K rows, B x H = 64, ``benchmarks/zeta_scan_probe.py``):
    64 rows and 1 warp for wide rows (v, 64 columns: 0.54 / 0.79 ms forward / reversed, against
    0.69 / 1.02 with 4 warps); 128 rows and 2 warps for narrow ones (k, 3 columns: 0.14 / 0.16
    against 0.19 / 0.24 at 64 rows and 4 warps). The tile totals' scan then has N / BLOCK_N steps."""
    tiles = dict(BLOCK_N=64, num_warps=1) if width >= 16 else dict(BLOCK_N=128, num_warps=2)
    return tiles | TILE_OVERRIDES


@triton.jit
def _tile_sums_kernel(X, PRE, SUMS, N, XW, T, H, BLOCK_N: tl.constexpr, BLOCK_X: tl.constexpr):
    tile, bh, pid_x = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rows = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = pid_x * BLOCK_X + tl.arange(0, BLOCK_X)
    ok = (rows < N)[:, None] & (cols < XW)[None, :]
    x = tl.load(X + (bh.to(tl.int64) * N + rows[:, None]) * XW + cols[None, :], mask=ok, other=0.0).to(tl.float32)
    pre = tl.load(PRE + (bh // H).to(tl.int64) * N + rows, mask=rows < N, other=0.0)  # [BN]
    total = tl.sum(x * pre[:, None], axis=0)  # [BX]
    tl.store(SUMS + (bh.to(tl.int64) * XW + cols) * T + tile, total, mask=cols < XW)


@triton.jit
def _tile_scan_kernel(
    X,
    PRE,
    POST,
    CARRY,
    BASE,
    OUT,
    N,
    XW,
    T,
    H,
    REVERSE: tl.constexpr,
    HAS_BASE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_X: tl.constexpr,
):
    tile, bh, pid_x = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rows = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = pid_x * BLOCK_X + tl.arange(0, BLOCK_X)
    ok = (rows < N)[:, None] & (cols < XW)[None, :]
    offsets = (bh.to(tl.int64) * N + rows[:, None]) * XW + cols[None, :]  # [BN, BX]
    x = tl.load(X + offsets, mask=ok, other=0.0).to(tl.float32)
    row_base = (bh // H).to(tl.int64) * N + rows
    pre = tl.load(PRE + row_base, mask=rows < N, other=0.0)
    post = tl.load(POST + row_base, mask=rows < N, other=0.0)
    carry = tl.load(CARRY + (bh.to(tl.int64) * XW + cols) * T + tile, mask=cols < XW, other=0.0)  # [BX]
    total = tl.cumsum(x * pre[:, None], axis=0, reverse=REVERSE) + carry[None, :]
    result = total * post[:, None]
    if HAS_BASE:  # a gradient summed elsewhere (fp32 atomics): added here, stored once in OUT's dtype
        result += tl.load(BASE + offsets, mask=ok, other=0.0).to(tl.float32)
    tl.store(OUT + offsets, result.to(OUT.dtype.element_ty), mask=ok)


def _launch_scan(x: Tensor, pre: Tensor, post: Tensor, reverse: bool, base: Tensor | None, dtype: torch.dtype) -> Tensor:
    """Tile sums, their carries, then the tile scans (see the module docstring)."""
    batch, heads, n, width = x.shape
    x = x.contiguous()
    pre, post = pre.to(torch.float32).contiguous(), post.to(torch.float32).contiguous()
    blocks = _tiles(width)
    tiles = triton.cdiv(n, blocks["BLOCK_N"])
    blocks["BLOCK_X"] = min(64, triton.next_power_of_2(width))
    grid = (tiles, batch * heads, triton.cdiv(width, blocks["BLOCK_X"]))
    sums = torch.empty(batch * heads, width, tiles, dtype=torch.float32, device=x.device)  # [BH, X, T]
    _tile_sums_kernel[grid](x, pre, sums, n, width, tiles, heads, **blocks)
    carry = exclusive_cumsum(sums, reverse)  # [BH, X, T]
    out = torch.empty(x.shape, dtype=dtype, device=x.device)
    base_ptr = x if base is None else base.contiguous()  # x: a dummy pointer
    _tile_scan_kernel[grid](
        x, pre, post, carry, base_ptr, out, n, width, tiles, heads, REVERSE=reverse, HAS_BASE=base is not None, **blocks
    )
    return out


@torch.library.custom_op(op_name("scaled_scan"), mutates_args=())
def scaled_scan_op(x: Tensor, pre: Tensor, post: Tensor, base: Tensor | None, reverse: bool, dtype: torch.dtype) -> Tensor:
    """``sparsefocus::scaled_scan``: ``scaled_scan`` with every argument given (the public
    function fills in the defaults). Differentiable in x and base; pre and post get no gradient."""
    return _launch_scan(x, pre, post, reverse, base, dtype)


@scaled_scan_op.register_fake
def _scaled_scan_fake(x, pre, post, base, reverse, dtype):
    return x.new_empty(x.shape, dtype=dtype)


def _scan_setup(ctx, inputs, output) -> None:
    x, pre, post, base, reverse, _ = inputs
    ctx.save_for_backward(pre, post)
    ctx.reverse, ctx.x_dtype = reverse, x.dtype
    ctx.base_dtype = None if base is None else base.dtype


def _scan_backward(ctx, grad: Tensor):
    """d x_j = pre_j * sum over the rows i that summed j of post_i g_i: the same scan with pre and
    post swapped, in the other direction. d base = g."""
    pre, post = ctx.saved_tensors
    dx = scaled_scan_op(grad, post, pre, None, not ctx.reverse, ctx.x_dtype)
    dbase = None if ctx.base_dtype is None else grad.to(ctx.base_dtype)
    return dx, None, None, dbase, None, None


scaled_scan_op.register_autograd(_scan_backward, setup_context=_scan_setup)


def scaled_scan(
    x: Tensor, pre: Tensor, post: Tensor, reverse: bool = False, base: Tensor | None = None, dtype: torch.dtype | None = None
) -> Tensor:
    """out[b, h, i] = post[b, i] * sum_{j <= i} pre[b, j] * x[b, h, j] (j >= i when ``reverse``),
    plus base[b, h, i] when given.

    Args:
        x: [B, H, N, X] any float dtype; pre, post: [B, N] fp32 row scales (no gradient).
        reverse: sum over the rows at and after i instead of at and before.
        base: optional [B, H, N, X] tensor (any float dtype) added in fp32 before the one store.
            Default: none.
        dtype: the output's dtype. Default: x's.
    Returns:
        [B, H, N, X]; sums are fp32 (tile sums, then a scan of the T = N / BLOCK_N tile totals).
        Differentiable in x and base (op ``sparsefocus::scaled_scan``).
    """
    if base is not None and base.shape != x.shape:
        raise ValueError(f"base must have x's shape {tuple(x.shape)}, got {tuple(base.shape)}")
    if x.dim() != 4 or tuple(pre.shape) != (x.shape[0], x.shape[2]) or pre.shape != post.shape:
        raise ValueError(
            f"scaled_scan needs x [B, H, N, X] and pre, post [B, N], got {tuple(x.shape)}, {tuple(pre.shape)}, {tuple(post.shape)}"
        )
    return scaled_scan_op(x, pre, post, base, reverse, dtype or x.dtype)


def exclusive_cumsum(x: Tensor, reverse: bool = False) -> Tensor:
    """Sum of the entries strictly before (``reverse``: after) each one along the last dim.

    Shift-then-sum, not ``cumsum(x) - x``: that would round with the entry's own value in it, so a
    later tile's sum could change an earlier tile's carry in the last bit."""
    if reverse:
        return exclusive_cumsum(x.flip(-1)).flip(-1)
    return torch.nn.functional.pad(x[..., :-1], (1, 0)).cumsum(-1)


def mean_scales(real: Tensor, count: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """The causal mean's row scales: real [B, M] as fp32 (pre of the forward scan) and
    1 / max(count, 1) (post), count the real keys 0..i [B, M] (cumulated from real if None)."""
    realf = real.to(torch.float32).contiguous()
    count = realf.cumsum(-1) if count is None else count.to(torch.float32)
    return realf, (1.0 / count.clamp_min(1.0)).contiguous()


def causal_mean_scan(x: Tensor, real: Tensor, count: Tensor) -> Tensor:
    """``CausalMean`` (sparsefocus.attention.zeta) through ``scaled_scan``: x [B, H, M, X], real
    [B, M] bool, count [B, M] the real keys in 0..i; returns the mean of the real x_0..x_i
    [B, H, M, X] in x's dtype. Its gradient is the op's (the reversed scan)."""
    realf, inverse = mean_scales(real, count)
    return scaled_scan(x, realf, inverse)


class CausalMeanScan:
    """``causal_mean_scan`` under ``CausalMean``'s calling convention (``.apply(x, real, count)``),
    so that the torch twin and this one are interchangeable. Autograd is the op's, not a
    ``torch.autograd.Function``'s."""

    apply = staticmethod(causal_mean_scan)

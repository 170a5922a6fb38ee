"""Scaled cumulative sums along the sequence in Triton: ZETA's causal mean token and its gradient.

The slow twin that defines the result is ``sparsefocus.attention.zeta.CausalMean`` (torch, row
blocks with a carried fp32 sum). Here the sum is two-level and every level is parallel:

* ``_tile_sums_kernel``: one program per (tile of BLOCK_N rows, batch x head, BLOCK_X columns)
  writes the fp32 sum of ``pre[row] * x[row]`` over its tile;
* ``_carry_kernel``: one program per (batch x head, column) turns its T tile sums into the carry
  of every tile, the sum of the tiles strictly before it (after it, reversed): chunks of
  BLOCK_T tiles scanned in registers on top of a running total (one launch, where torch's
  shift-and-cumsum took three, five reversed);
* ``_tile_scan_kernel``: each tile scans its rows in registers, adds its carry and writes
  ``post[row] * total`` in x's dtype.

Rows of at most ``ONE_PASS_MAX_N`` rows take one launch instead of three:
``_one_pass_scan_kernel`` walks the tiles of its (batch x head, BLOCK_X columns) in order (reversed:
from the last) with the running fp32 total of the tiles before in registers, in tiles of
``ONE_PASS_TILE`` rows (few of them: each waits on the one before). Short rows leave little parallel
work for the two-level form, whose cost there is the host's three launches.

Forward of the mean: pre = real key (0/1), post = 1 / count, scan forward. Backward: pre = 1 /
count, post = real key, scan reversed (dx_j = real_j * sum_{i >= j} g_i / count_i). Causal by
construction: a forward scan's row i reads rows <= i only.

The launcher is the ``torch.library`` op ``sparsefocus::scaled_scan``, differentiable in x (its
gradient is the reversed scan with pre and post swapped).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.library import wrap_triton

from sparsefocus.kernels import interpreter_compat  # noqa: F401  (CPU interpreter fix)
from sparsefocus.kernels._ops import op_name, traced_setup, triton_op_chosen

CARRY_BLOCK = 256  # tile sums per chunk of ``_carry_kernel``: 4 chunks for 64K rows of 64-row tiles
ONE_PASS_MAX_N = 4096
"""Rows of at most this many rows are scanned by ``_one_pass_scan_kernel`` in one launch; longer
ones by the two-level form. 0: never."""
ONE_PASS_TILE = {"BLOCK_N": 256, "num_warps": 4}
"""The one pass's tile: 256 rows, so a 4,096-row scan is a chain of 16 tiles per program."""
ONE_PASS_COLUMNS = 16  # columns per one-pass program: 4 programs per (batch x head) row of v's 64
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
def _carry_kernel(SUMS, CARRY, T, REVERSE: tl.constexpr, BLOCK_T: tl.constexpr):
    """CARRY[row, t] = sum of SUMS[row, s] over s < t (REVERSE: s > t), SUMS and CARRY [rows, T].

    Walks the row in order r = 0, 1, ... (t = r, or T - 1 - r reversed): the carry of position r
    is a running total of the chunks before plus a scan of this chunk's entries r' = r - 1, r - 2,
    ... inside it, so it sums earlier entries only (``cumsum(x) - x`` would round with the
    entry's own value in it, and a later tile could move an earlier carry in the last bit)."""
    base = tl.program_id(0).to(tl.int64) * T
    running = tl.zeros([1], tl.float32)
    for start in range(0, T, BLOCK_T):
        r = start + tl.arange(0, BLOCK_T)  # walk positions
        prev = r - 1  # the entry each carry adds last
        source = T - 1 - prev if REVERSE else prev
        value = tl.load(SUMS + base + source, mask=(prev >= 0) & (prev < T), other=0.0)  # [BT]
        carry = running + tl.cumsum(value, axis=0)
        target = T - 1 - r if REVERSE else r
        tl.store(CARRY + base + target, carry, mask=r < T)
        running += tl.sum(value, axis=0)


@triton.jit
def _scan_tile(
    X, PRE, POST, BASE, OUT, carry, tile, bh, cols, N, XW, H, REVERSE: tl.constexpr, HAS_BASE: tl.constexpr, BLOCK_N: tl.constexpr
):
    """Scan one tile of BLOCK_N rows x the columns ``cols`` on top of ``carry`` [BX] (the sum of
    the tiles before it; after it, reversed), store ``post * total`` (+ base) in OUT's dtype, and
    return the tile's own fp32 sum of ``pre * x`` [BX]."""
    rows = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    ok = (rows < N)[:, None] & (cols < XW)[None, :]
    offsets = (bh.to(tl.int64) * N + rows[:, None]) * XW + cols[None, :]  # [BN, BX]
    row_base = (bh // H).to(tl.int64) * N + rows
    pre = tl.load(PRE + row_base, mask=rows < N, other=0.0)
    post = tl.load(POST + row_base, mask=rows < N, other=0.0)
    scaled = tl.load(X + offsets, mask=ok, other=0.0).to(tl.float32) * pre[:, None]  # [BN, BX]
    result = (tl.cumsum(scaled, axis=0, reverse=REVERSE) + carry[None, :]) * post[:, None]
    if HAS_BASE:  # a gradient summed elsewhere (fp32 atomics): added here, stored once in OUT's dtype
        result += tl.load(BASE + offsets, mask=ok, other=0.0).to(tl.float32)
    tl.store(OUT + offsets, result.to(OUT.dtype.element_ty), mask=ok)
    return tl.sum(scaled, axis=0)


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
    cols = pid_x * BLOCK_X + tl.arange(0, BLOCK_X)
    carry = tl.load(CARRY + (bh.to(tl.int64) * XW + cols) * T + tile, mask=cols < XW, other=0.0)  # [BX]
    _scan_tile(X, PRE, POST, BASE, OUT, carry, tile, bh, cols, N, XW, H, REVERSE, HAS_BASE, BLOCK_N)


@triton.jit
def _one_pass_scan_kernel(
    X,
    PRE,
    POST,
    BASE,
    OUT,
    N,
    XW,
    H,
    REVERSE: tl.constexpr,
    HAS_BASE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_X: tl.constexpr,
):
    """One program per (batch x head, BLOCK_X columns): the tiles of BLOCK_N rows in order (from
    the last when REVERSE), each scanned in registers on top of the running total of the tiles
    before it, which only ever holds earlier tiles (later ones, reversed)."""
    bh, pid_x = tl.program_id(0), tl.program_id(1)
    cols = pid_x * BLOCK_X + tl.arange(0, BLOCK_X)
    running = tl.zeros([BLOCK_X], tl.float32)
    tiles = tl.cdiv(N, BLOCK_N)
    for step in range(0, tiles):
        tile = tiles - 1 - step if REVERSE else step
        running += _scan_tile(X, PRE, POST, BASE, OUT, running, tile, bh, cols, N, XW, H, REVERSE, HAS_BASE, BLOCK_N)


def _launch_scan(
    x: Tensor, pre: Tensor, post: Tensor, reverse: bool, base: Tensor | None, dtype: torch.dtype, kernels: tuple | None = None
) -> Tensor:
    """One pass over short rows; otherwise tile sums, their carries, then the tile scans (see the
    module docstring). ``kernels``: (one pass, tile sums, carry, tile scan), ``wrap_triton`` of
    each in the ``triton_op`` twin; default: the kernels themselves."""
    one_pass, tile_sums, carry_scan, tile_scan = kernels or (
        _one_pass_scan_kernel,
        _tile_sums_kernel,
        _carry_kernel,
        _tile_scan_kernel,
    )
    batch, heads, n, width = x.shape
    x = x.contiguous()
    pre, post = pre.to(torch.float32).contiguous(), post.to(torch.float32).contiguous()
    out = torch.empty(x.shape, dtype=dtype, device=x.device)
    base_ptr = x if base is None else base.contiguous()  # x: a dummy pointer
    if n <= ONE_PASS_MAX_N:
        blocks = dict(ONE_PASS_TILE, BLOCK_X=min(ONE_PASS_COLUMNS, triton.next_power_of_2(width)))
        grid = (batch * heads, triton.cdiv(width, blocks["BLOCK_X"]))
        one_pass[grid](x, pre, post, base_ptr, out, n, width, heads, REVERSE=reverse, HAS_BASE=base is not None, **blocks)
        return out
    blocks = _tiles(width)
    tiles = triton.cdiv(n, blocks["BLOCK_N"])
    blocks["BLOCK_X"] = min(64, triton.next_power_of_2(width))
    grid = (tiles, batch * heads, triton.cdiv(width, blocks["BLOCK_X"]))
    sums = torch.empty(batch * heads, width, tiles, dtype=torch.float32, device=x.device)  # [BH, X, T]
    tile_sums[grid](x, pre, sums, n, width, tiles, heads, **blocks)
    carry = torch.empty_like(sums)  # [BH, X, T]
    carry_scan[(batch * heads * width,)](sums, carry, tiles, REVERSE=reverse, BLOCK_T=CARRY_BLOCK, num_warps=1)
    tile_scan[grid](
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
    op = scaled_scan_traced if ctx.traced else scaled_scan_op
    dx = op(grad, post, pre, None, not ctx.reverse, ctx.x_dtype)
    dbase = None if ctx.base_dtype is None else grad.to(ctx.base_dtype)
    return dx, None, None, dbase, None, None


scaled_scan_op.register_autograd(_scan_backward, setup_context=traced_setup(_scan_setup, False))


@torch.library.triton_op(op_name("scaled_scan_traced"), mutates_args=())
def scaled_scan_traced(x: Tensor, pre: Tensor, post: Tensor, base: Tensor | None, reverse: bool, dtype: torch.dtype) -> Tensor:
    """``sparsefocus::scaled_scan_traced``: ``scaled_scan_op``'s ``triton_op`` twin (``_ops.TRITON_OPS``)."""
    kernels = (
        wrap_triton(_one_pass_scan_kernel),
        wrap_triton(_tile_sums_kernel),
        wrap_triton(_carry_kernel),
        wrap_triton(_tile_scan_kernel),
    )
    return _launch_scan(x, pre, post, reverse, base, dtype, kernels)


scaled_scan_traced.register_autograd(_scan_backward, setup_context=traced_setup(_scan_setup, True))


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
    op = scaled_scan_traced if triton_op_chosen(x) else scaled_scan_op
    return op(x, pre, post, base, reverse, dtype or x.dtype)


@triton.jit
def _mean_rows_kernel(REAL, REALF, INVERSE, MASK, M, HQ, BLOCK: tl.constexpr, PADDED: tl.constexpr):
    """Batch row b = program 0: REALF[b, i] = real_i, INVERSE[b, i] = 1 / max(count_i, 1) (count_i
    the real keys 0..i, exact in int32, the division rounded as torch's) and MASK[b, h, i] =
    count_i > 0 for each of the HQ heads. Without PADDED every key is real (REAL is not read)."""
    b = tl.program_id(0).to(tl.int64)
    running = tl.zeros([1], tl.int32)
    for start in range(0, M, BLOCK):
        i = start + tl.arange(0, BLOCK)
        ok = i < M
        if PADDED:
            real = tl.load(REAL + b * M + i, mask=ok, other=0).to(tl.int32)
        else:
            real = ok.to(tl.int32)
        count = running + tl.cumsum(real, axis=0)
        inverse = tl.math.div_rn(tl.full([BLOCK], 1.0, tl.float32), tl.maximum(count, 1).to(tl.float32))
        tl.store(REALF + b * M + i, real.to(tl.float32), mask=ok)
        tl.store(INVERSE + b * M + i, inverse, mask=ok)
        for h in range(HQ):
            tl.store(MASK + (b * HQ + h) * M + i, (count > 0).to(tl.int8), mask=ok)
        running += tl.sum(real, axis=0)


@torch.library.custom_op(op_name("mean_rows"), mutates_args=())
def mean_rows(keys: Tensor, real: Optional[Tensor], heads: int) -> tuple[Tensor, Tensor, Tensor]:
    """``sparsefocus::mean_rows``: the causal mean's row scales and mask in one launch: keys
    [B, Hk, M, *] (shape and device only), real [B, M] bool or None (every key real) -> (real
    fp32 [B, M], 1 / max(count, 1) fp32 [B, M], count > 0 int8 [B, heads, M]); count the real
    keys 0..i. The same values as ``mean_scales`` (and the mask from its count). Not
    differentiable."""
    return _mean_rows(keys, real, heads, _mean_rows_kernel)


def _mean_rows(keys: Tensor, real: Optional[Tensor], heads: int, kernel) -> tuple[Tensor, Tensor, Tensor]:
    """Launch the row-scales kernel (``wrap_triton`` of it in the ``triton_op`` twin)."""
    if real is not None and tuple(real.shape) != (keys.shape[0], keys.shape[2]):
        raise ValueError(f"mean_rows: real must be [B, M] = [{keys.shape[0]}, {keys.shape[2]}], got {tuple(real.shape)}")
    realf, inverse, mask = _mean_rows_outputs(keys, heads)
    if keys.shape[2] > 0:
        kernel[(keys.shape[0],)](
            realf if real is None else real.contiguous(),  # realf: a dummy pointer, not read
            realf,
            inverse,
            mask,
            keys.shape[2],
            heads,
            BLOCK=1024,
            PADDED=real is not None,
            num_warps=4,
        )
    return realf, inverse, mask


@torch.library.triton_op(op_name("mean_rows_traced"), mutates_args=())
def mean_rows_traced(keys: Tensor, real: Optional[Tensor], heads: int) -> tuple[Tensor, Tensor, Tensor]:
    """``sparsefocus::mean_rows_traced``: ``mean_rows``' ``triton_op`` twin (``_ops.TRITON_OPS``)."""
    return _mean_rows(keys, real, heads, wrap_triton(_mean_rows_kernel))


@mean_rows.register_fake
def _mean_rows_fake(keys: Tensor, real: Optional[Tensor], heads: int) -> tuple[Tensor, Tensor, Tensor]:
    return _mean_rows_outputs(keys, heads)


def _mean_rows_outputs(keys: Tensor, heads: int) -> tuple[Tensor, Tensor, Tensor]:
    batch, n_keys = keys.shape[0], keys.shape[2]
    realf = keys.new_empty(batch, n_keys, dtype=torch.float32)
    return realf, torch.empty_like(realf), keys.new_empty(batch, heads, n_keys, dtype=torch.int8)


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

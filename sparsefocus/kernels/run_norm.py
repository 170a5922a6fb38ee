"""LayerNorm of narrow rows with one affine per run, in Triton (the folded models' norms).

A folded batch stacks R runs run-major: x [R * B, ..., d], rows of run r the r-th R-th of them,
each run with its own weight and bias [R, d]. The slow twin that defines the result is
``sparsefocus.attention.common.run_layer_norm_ref`` (``F.layer_norm`` without affine, then each
run's weight and bias). On rows of d = 64 PyTorch's LayerNorm kernel ran far below the memory
bandwidth (0.31 ms forward for [250, 601, 64] fp32 on an H100, which the bandwidth allows in about
0.03), and the affine and its gradients are more passes with reductions; at the laboratory's
ListOps shape the norms were a quarter of an uncompiled training step. Here a program holds
BLOCK_M rows of one run in registers ([BLOCK_M, BLOCK_O] tiles of ``run_bias.run_tile``,
statistics in fp32):

* forward: mean and 1 / std per row (two-pass in registers: mean, then the centred squares),
  y = x_hat * w + b, stored once; mean and 1 / std are kept for the backward.
* backward: dx = (g - mean(g) - x_hat mean(g x_hat)) / std with g = dy * w; each program walks
  several tiles and writes their sums of dy * x_hat and dy ([R, parts, d] fp32), summed per run
  by PyTorch afterwards: deterministic, no atomics.

The launchers are the ops ``sparsefocus::run_layer_norm`` (differentiable in x, weight and bias)
and ``sparsefocus::run_layer_norm_bwd`` (docs/kernels.md).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from sparsefocus.kernels import interpreter_compat  # noqa: F401  (CPU interpreter fix)
from sparsefocus.kernels._ops import op_name
from sparsefocus.kernels.run_bias import row_blocks, run_tile, sum_plan

MAX_WIDTH = 8192
"""Widest rows (d) a program holds in registers; wider ones take the twin."""
TILE = 4096  # elements of a program's [BLOCK_M, BLOCK_O] tile


def fits(width: int) -> bool:
    """Whether rows of ``width`` take the kernel."""
    return 0 < width <= MAX_WIDTH


@triton.jit
def _fwd_kernel(X, W, B, Y, MEAN, RSTD, ROWS, D, eps, BLOCK_M: tl.constexpr, BLOCK_O: tl.constexpr):
    """Grid (tiles of ROWS, runs): Y = (X - mean) * rstd * W[run] + B[run] on BLOCK_M rows."""
    pid, run = tl.program_id(0), tl.program_id(1)
    offs, rows, row_ok, cols, ok = run_tile(run, pid, ROWS, D, BLOCK_M, BLOCK_O)
    x = tl.load(X + offs, mask=ok, other=0.0).to(tl.float32)  # [BR, BD]
    mean = tl.sum(x, axis=1) / D
    centred = tl.where(ok, x - mean[:, None], 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(centred * centred, axis=1) / D + eps)
    w = tl.load(W + run * D + cols, mask=cols < D, other=0.0).to(tl.float32)
    b = tl.load(B + run * D + cols, mask=cols < D, other=0.0).to(tl.float32)
    y = centred * rstd[:, None] * w[None, :] + b[None, :]
    tl.store(Y + offs, y.to(Y.dtype.element_ty), mask=ok)
    tl.store(MEAN + rows, mean, mask=row_ok)
    tl.store(RSTD + rows, rstd, mask=row_ok)


@triton.jit
def _bwd_kernel(
    X, W, DY, MEAN, RSTD, DX, DW_PART, DB_PART, ROWS, D, PARTS, STEPS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_O: tl.constexpr
):
    """Grid (PARTS, runs): DX of STEPS tiles of BLOCK_M rows, and their sums of DY * x_hat and DY
    into DW_PART, DB_PART [runs, PARTS, D] at this part."""
    pid, run = tl.program_id(0), tl.program_id(1)
    cols = tl.arange(0, BLOCK_O)
    w = tl.load(W + run * D + cols, mask=cols < D, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK_O], tl.float32)
    db = tl.zeros([BLOCK_O], tl.float32)
    for step in range(STEPS):
        offs, rows, row_ok, _, ok = run_tile(run, pid * STEPS + step, ROWS, D, BLOCK_M, BLOCK_O)
        x = tl.load(X + offs, mask=ok, other=0.0).to(tl.float32)
        dy = tl.load(DY + offs, mask=ok, other=0.0).to(tl.float32)
        mean = tl.load(MEAN + rows, mask=row_ok, other=0.0)
        rstd = tl.load(RSTD + rows, mask=row_ok, other=0.0)
        x_hat = tl.where(ok, (x - mean[:, None]) * rstd[:, None], 0.0)
        g = dy * w[None, :]
        c_hat = tl.sum(g * x_hat, axis=1) / D  # [BR]
        c_one = tl.sum(g, axis=1) / D
        dx = (g - c_one[:, None] - x_hat * c_hat[:, None]) * rstd[:, None]
        tl.store(DX + offs, dx.to(DX.dtype.element_ty), mask=ok)
        dw += tl.sum(dy * x_hat, axis=0)
        db += tl.sum(dy, axis=0)
    part = (run.to(tl.int64) * PARTS + pid) * D + cols
    tl.store(DW_PART + part, dw, mask=cols < D)
    tl.store(DB_PART + part, db, mask=cols < D)


def _shape(x: Tensor, weight: Tensor) -> tuple[int, int, int]:
    """(runs, rows per run, width) of x [R * B, ..., d] and weight [R, d]."""
    runs, width = weight.shape
    return runs, x.numel() // (runs * width), width


def _stats(x: Tensor, weight: Tensor) -> tuple[Tensor, Tensor]:
    runs, rows, _ = _shape(x, weight)
    mean = x.new_empty(runs * rows, dtype=torch.float32)
    return mean, torch.empty_like(mean)


@torch.library.custom_op(op_name("run_layer_norm"), mutates_args=())
def run_layer_norm_op(x: Tensor, weight: Tensor, bias: Tensor, eps: float) -> tuple[Tensor, Tensor, Tensor]:
    """``sparsefocus::run_layer_norm``: (y [like x, dtype of x and weight promoted], mean, 1 / std
    [rows] fp32) for x [R * B, ..., d] contiguous and weight, bias [R, d]."""
    runs, rows, width = _shape(x, weight)
    y = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    mean, rstd = _stats(x, weight)
    if rows > 0:
        blocks = row_blocks(width, TILE)
        grid = (triton.cdiv(rows, blocks["BLOCK_M"]), runs)
        _fwd_kernel[grid](x, weight.contiguous(), bias.contiguous(), y, mean, rstd, rows, width, eps, **blocks)
    return y, mean, rstd


@run_layer_norm_op.register_fake
def _run_layer_norm_fake(x: Tensor, weight: Tensor, bias: Tensor, eps: float) -> tuple[Tensor, Tensor, Tensor]:
    mean, rstd = _stats(x, weight)
    return x.new_empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype)), mean, rstd


@torch.library.custom_op(op_name("run_layer_norm_bwd"), mutates_args=())
def run_layer_norm_bwd(grad: Tensor, x: Tensor, weight: Tensor, mean: Tensor, rstd: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``sparsefocus::run_layer_norm_bwd``: (dx like x, d weight and d bias like weight) from the
    output's gradient and the forward's mean and 1 / std."""
    runs, rows, width = _shape(x, weight)
    dx = torch.empty_like(x)
    blocks = row_blocks(width, TILE)
    steps, count = sum_plan(rows, blocks["BLOCK_M"])
    parts = torch.empty(2, runs, count, width, dtype=torch.float32, device=x.device)  # [dw, db] per part, all written
    if rows > 0:
        _bwd_kernel[(count, runs)](
            x,
            weight.contiguous(),
            grad.contiguous(),
            mean,
            rstd,
            dx,
            parts[0],
            parts[1],
            rows,
            width,
            count,
            STEPS=steps,
            **blocks,
        )
    return dx, parts[0].sum(dim=1).to(weight.dtype), parts[1].sum(dim=1).to(weight.dtype)  # [R, d] each


@run_layer_norm_bwd.register_fake
def _run_layer_norm_bwd_fake(grad, x, weight, mean, rstd):
    return torch.empty_like(x), torch.empty_like(weight), torch.empty_like(weight)


def _setup(ctx, inputs, output) -> None:
    x, weight, _, _ = inputs
    _, mean, rstd = output
    ctx.save_for_backward(x, weight, mean, rstd)
    ctx.mark_non_differentiable(mean, rstd)


def _backward(ctx, grad: Tensor, _grad_mean: Tensor, _grad_rstd: Tensor):
    x, weight, mean, rstd = ctx.saved_tensors
    dx, dw, db = run_layer_norm_bwd(grad, x, weight, mean, rstd)
    return dx, dw, db, None


run_layer_norm_op.register_autograd(_backward, setup_context=_setup)


def run_layer_norm(x: Tensor, weight: Tensor, bias: Tensor, eps: float = 1e-5) -> Tensor:
    """LayerNorm over the last dim with one affine per run.

    Args:
        x: [R * B, ..., d], the R runs' rows run-major; any float dtype.
        weight, bias: [R, d], one affine per run.
        eps: added to the variance. Default: 1e-5.
    Returns:
        [R * B, ..., d] in the promoted dtype of x and weight (fp32 statistics); differentiable in
        x, weight and bias (op ``sparsefocus::run_layer_norm``). Equals
        ``attention.common.run_layer_norm_ref`` up to rounding.
    """
    if weight.dim() != 2 or bias.shape != weight.shape or x.shape[-1] != weight.shape[1] or x.shape[0] % weight.shape[0]:
        raise ValueError(
            f"run_layer_norm needs x [R * B, ..., d] and weight, bias [R, d], got {tuple(x.shape)}, "
            f"{tuple(weight.shape)}, {tuple(bias.shape)}"
        )
    return run_layer_norm_op(x.contiguous(), weight, bias, eps)[0]

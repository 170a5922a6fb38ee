"""One bias per run added to a folded batch's matmul output, in Triton (the folded models' linears).

A folded linear multiplies R runs' rows at once (``torch.bmm``: out [R, M, O]) and then adds each
run's bias [R, O]. PyTorch adds the broadcast bias with its generic strided kernel and sums the
bias gradient with a reduction per call; in an uncompiled whole-set evaluation of the
laboratory's ListOps model these adds were the largest kernels after attention (31.6 of 131 ms
per chunk on an H100, ``benchmarks/results/h100_lab_layernorm_d5e2ced.json``). The slow twin
is ``out + bias[:, None]`` (``sparsefocus.attention.common.run_bias_add_ref``). Here a program
adds the bias to a [BLOCK_M, BLOCK_O] tile of one run (an fp32 sum stored in out's dtype, as
PyTorch rounds it), and the backward passes the gradient through and sums it per run, a program
over several tiles ([R, parts, O] fp32 partial sums, summed by PyTorch: deterministic, no
atomics).

The launchers are the ops ``sparsefocus::run_bias_add`` (differentiable in out and bias) and
``sparsefocus::run_bias_grad`` (docs/kernels.md).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from sparsefocus.kernels import interpreter_compat  # noqa: F401  (CPU interpreter fix)
from sparsefocus.kernels._ops import op_name

TILE = 8192  # elements of a program's [BLOCK_M, BLOCK_O] tile
MAX_SUM_STEPS = 16
"""Most tiles one program of a per-run sum walks (``sum_plan``; 1: a program per tile)."""


def row_blocks(width: int, tile: int = TILE) -> dict:
    """[BLOCK_M, BLOCK_O] tile of ``tile`` elements (at least one row) over rows of ``width``, 4 warps."""
    block_o = triton.next_power_of_2(width)
    return dict(BLOCK_M=max(1, tile // block_o), BLOCK_O=block_o, num_warps=4)


@triton.jit
def run_tile(run, pid, M, WIDTH, BLOCK_M: tl.constexpr, BLOCK_O: tl.constexpr):
    """Tile ``pid`` of run ``run``'s M rows in [R, M, WIDTH]: element offsets [BM, BO] (int64),
    flat row numbers [BM] (int64), real rows [BM], columns [BO] and real elements [BM, BO]."""
    local = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = local < M
    rows = run.to(tl.int64) * M + local
    cols = tl.arange(0, BLOCK_O)
    ok = row_ok[:, None] & (cols < WIDTH)[None, :]
    return rows[:, None] * WIDTH + cols[None, :], rows, row_ok, cols, ok


@triton.jit
def _add_kernel(X, BIAS, Y, M, WIDTH, BLOCK_M: tl.constexpr, BLOCK_O: tl.constexpr):
    """Grid (tiles of M, runs): Y = X + BIAS[run] on a tile, summed in fp32."""
    pid, run = tl.program_id(0), tl.program_id(1)
    offs, _, _, cols, ok = run_tile(run, pid, M, WIDTH, BLOCK_M, BLOCK_O)
    b = tl.load(BIAS + run * WIDTH + cols, mask=cols < WIDTH, other=0.0).to(tl.float32)
    x = tl.load(X + offs, mask=ok, other=0.0).to(tl.float32)
    tl.store(Y + offs, (x + b[None, :]).to(Y.dtype.element_ty), mask=ok)


@triton.jit
def _sum_kernel(G, PART, M, WIDTH, PARTS, STEPS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_O: tl.constexpr):
    """Grid (PARTS, runs): PART[run, part] = the column sums of G over the part's STEPS tiles (fp32)."""
    pid, run = tl.program_id(0), tl.program_id(1)
    acc = tl.zeros([BLOCK_O], tl.float32)
    for step in range(STEPS):
        offs, _, _, _, ok = run_tile(run, pid * STEPS + step, M, WIDTH, BLOCK_M, BLOCK_O)
        acc += tl.sum(tl.load(G + offs, mask=ok, other=0.0).to(tl.float32), axis=0)
    cols = tl.arange(0, BLOCK_O)
    tl.store(PART + (run.to(tl.int64) * PARTS + pid) * WIDTH + cols, acc, mask=cols < WIDTH)


def sum_plan(rows: int, block_m: int) -> tuple[int, int]:
    """(tiles a program sums, programs per run) for per-run sums over ``rows`` rows in tiles of
    ``block_m``: a power of two of tiles up to ``MAX_SUM_STEPS``, as many as keep at least 32
    programs per run, so that the partial sums left for PyTorch stay few without idling the GPU."""
    tiles, steps = triton.cdiv(rows, block_m), 1
    while 2 * steps <= MAX_SUM_STEPS and tiles // (2 * steps) >= 32:
        steps *= 2
    return steps, triton.cdiv(rows, block_m * steps)


@torch.library.custom_op(op_name("run_bias_add"), mutates_args=())
def run_bias_add_op(out: Tensor, bias: Tensor) -> Tensor:
    """``sparsefocus::run_bias_add``: out [R, M, O] (contiguous) + bias [R, O] per run, in out's dtype."""
    runs, rows, width = out.shape
    y = torch.empty_like(out)
    if rows > 0:
        blocks = row_blocks(width)
        _add_kernel[(triton.cdiv(rows, blocks["BLOCK_M"]), runs)](out, bias.contiguous(), y, rows, width, **blocks)
    return y


@run_bias_add_op.register_fake
def _run_bias_add_fake(out: Tensor, bias: Tensor) -> Tensor:
    return torch.empty_like(out)


@torch.library.custom_op(op_name("run_bias_grad"), mutates_args=())
def run_bias_grad(grad: Tensor, dtype: torch.dtype) -> Tensor:
    """``sparsefocus::run_bias_grad``: grad [R, M, O] summed over M per run -> [R, O] in ``dtype``
    (fp32 sums of tiles, then of the tiles' sums)."""
    runs, rows, width = grad.shape
    blocks = row_blocks(width)
    steps, count = sum_plan(rows, blocks["BLOCK_M"])
    parts = torch.empty(runs, count, width, dtype=torch.float32, device=grad.device)  # [R, parts, O], all written
    if rows > 0:
        _sum_kernel[(count, runs)](grad.contiguous(), parts, rows, width, count, STEPS=steps, **blocks)
    return parts.sum(dim=1).to(dtype)


@run_bias_grad.register_fake
def _run_bias_grad_fake(grad: Tensor, dtype: torch.dtype) -> Tensor:
    return grad.new_empty(grad.shape[0], grad.shape[2], dtype=dtype)


def _setup(ctx, inputs, output) -> None:
    ctx.bias_dtype = inputs[1].dtype


def _backward(ctx, grad: Tensor):
    return grad, run_bias_grad(grad, ctx.bias_dtype)


run_bias_add_op.register_autograd(_backward, setup_context=_setup)


def run_bias_add(out: Tensor, bias: Tensor) -> Tensor:
    """out + each run's bias.

    Args:
        out: [R, M, O], the R runs' rows of a folded linear's output; any float dtype.
        bias: [R, O], cast to out's dtype first (as ``out + bias.to(out.dtype)``).
    Returns:
        [R, M, O] in out's dtype, each element summed in fp32 and rounded once; differentiable in
        out and bias (op ``sparsefocus::run_bias_add``; the bias gradient summed in fp32). Equals
        ``attention.common.run_bias_add_ref`` up to the bias gradient's rounding.
    """
    if out.dim() != 3 or bias.dim() != 2 or bias.shape != (out.shape[0], out.shape[2]):
        raise ValueError(f"run_bias_add needs out [R, M, O] and bias [R, O], got {tuple(out.shape)}, {tuple(bias.shape)}")
    return run_bias_add_op(out.contiguous(), bias.to(out.dtype))

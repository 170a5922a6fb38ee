"""A backward's delta in one launch: delta = rowsum(out * grad_out) - grad_lse, in fp32.

The attention backwards need, per query row, the sum of out * grad_out less the gradient of the
row's log-sum-exp (d lse / d s = p, so that gradient enters ds = p * (dp - delta) there). In
PyTorch (``row_delta_torch``, the slow twin) that is fp32 copies of both [rows, D] tensors, their
product, a row sum and a subtraction: about six launches and two fp32 temporaries a call. The
block-sparse backward makes one call per branch, so NSA's three branches in each of a small
model's ten layers made some 180 such launches a training step. Here a program reads BLOCK_R
rows of both tensors once in their own dtype and writes the rows' deltas
(``sparsefocus::row_delta``, a custom op: no host synchronisation, fixed shapes).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from sparsefocus.kernels import interpreter_compat  # noqa: F401  (CPU interpreter fix)

TILE_ELEMENTS = 4096  # elements of one program's [BLOCK_R, BLOCK_D] tile
TORCH_CHUNK_ELEMENTS = 2**24  # largest chunk of fp32 products the PyTorch twin makes at once (64 MiB)


@triton.jit
def _row_delta_kernel(A, B, G, OUT, R, D, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    """OUT[r] = sum_d A[r, d] B[r, d] - G[r] in fp32 for BLOCK_R rows of A, B [R, D] (contiguous)."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)  # [BR]
    cols = tl.arange(0, BLOCK_D)  # [BD]
    row_ok = rows < R
    inside = row_ok[:, None] & (cols < D)[None, :]  # [BR, BD]
    offsets = rows[:, None].to(tl.int64) * D + cols[None, :]
    a = tl.load(A + offsets, mask=inside, other=0.0).to(tl.float32)
    b = tl.load(B + offsets, mask=inside, other=0.0).to(tl.float32)
    lse_grad = tl.load(G + rows, mask=row_ok, other=0.0).to(tl.float32)
    tl.store(OUT + rows, tl.sum(a * b, axis=1) - lse_grad, mask=row_ok)


@torch.library.custom_op("sparsefocus::row_delta", mutates_args=())
def _row_delta_op(a: Tensor, b: Tensor, grad_lse: Tensor) -> Tensor:
    """a, b [R, D] contiguous (same shape, any float dtypes), grad_lse [R] contiguous -> [R] fp32."""
    n_rows, width = a.shape
    out = torch.empty(n_rows, dtype=torch.float32, device=a.device)
    if n_rows == 0:
        return out
    block_d = max(16, triton.next_power_of_2(width))
    block_r = max(1, TILE_ELEMENTS // block_d)
    _row_delta_kernel[(triton.cdiv(n_rows, block_r),)](
        a, b, grad_lse, out, n_rows, width, BLOCK_R=block_r, BLOCK_D=block_d, num_warps=4 if a.is_cuda else 1
    )
    return out


@_row_delta_op.register_fake
def _row_delta_fake(a: Tensor, b: Tensor, grad_lse: Tensor) -> Tensor:
    return a.new_empty(a.shape[0], dtype=torch.float32)


def row_delta(a: Tensor, b: Tensor, grad_lse: Tensor) -> Tensor:
    """sum(a * b, -1) - grad_lse in fp32: a, b [..., D] of one shape, grad_lse [...] (any float
    dtype) -> [...] fp32. The same numbers as ``row_delta_torch`` up to the order of the fp32 sum."""
    if a.shape != b.shape or grad_lse.shape != a.shape[:-1]:
        raise ValueError(
            f"row_delta: a {tuple(a.shape)} and b {tuple(b.shape)} must match, grad_lse {tuple(grad_lse.shape)} "
            "must be their shape without the last dimension"
        )
    width = a.shape[-1]
    flat_a, flat_b = a.reshape(-1, width).contiguous(), b.reshape(-1, width).contiguous()  # [R, D]
    flat_g = grad_lse.reshape(-1).contiguous()  # [R]
    return torch.ops.sparsefocus.row_delta(flat_a, flat_b, flat_g).view(a.shape[:-1])


def row_delta_torch(a: Tensor, b: Tensor, grad_lse: Tensor) -> Tensor:
    """``row_delta`` in PyTorch (its slow twin), in chunks of rows: whole fp32 copies of both
    tensors and their product (3 GiB at B=4, H=16, N=64K, D=64) would set a backward's peak memory."""
    width = a.shape[-1]
    flat_a, flat_b = a.reshape(-1, width), b.reshape(-1, width)  # [R, D]
    out = torch.empty(flat_a.shape[0], dtype=torch.float32, device=a.device)
    step = max(1, TORCH_CHUNK_ELEMENTS // max(1, width))
    for start in range(0, flat_a.shape[0], step):
        out[start : start + step] = (flat_a[start : start + step].float() * flat_b[start : start + step].float()).sum(-1)
    return out.view(a.shape[:-1]) - grad_lse.float()

"""Morton (Z-order) codes of squashed points in one Triton kernel: shift, quantise, interleave.

The slow twin that defines the result is ``sparsefocus.attention.zeta.curve_codes`` after its
sigmoid (torch: about 35 elementwise int64 passes over the points per curve). Here one program
reads BLOCK points [BLOCK, D] in fp32, computes grid = clamp(floor((unit + shift) * levels), 0,
top) with the same fp32 operations as torch (so the same cells), and interleaves the bits of
the D coordinates, most significant first, coordinate 0 leading each group. The launcher is the
``torch.library`` op ``sparsefocus::morton_codes``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.library import wrap_triton

from sparsefocus.kernels import interpreter_compat  # noqa: F401  (CPU interpreter fix)
from sparsefocus.kernels._ops import op_name, triton_op_chosen

BLOCK = 256


@triton.jit
def _morton_kernel(
    UNIT,
    OUT,
    P,
    shift,
    levels,
    top,
    row_len,
    first_row,
    D: tl.constexpr,
    BITS: tl.constexpr,
    BLOCK: tl.constexpr,
    TAG: tl.constexpr,
):
    points = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = points < P
    code = tl.zeros([BLOCK], tl.int64)
    for d in tl.static_range(D):
        unit = tl.load(UNIT + points.to(tl.int64) * D + d, mask=ok, other=0.0)
        cell = tl.floor((unit + shift) * levels).to(tl.int64)
        cell = tl.minimum(tl.maximum(cell, 0), top)
        for bit in tl.static_range(BITS):
            code |= ((cell >> bit) & 1) << (bit * D + D - 1 - d)
    if TAG:  # the point's row above the code's D * BITS bits: one flat sort then keeps the rows apart
        code |= (first_row + points // row_len).to(tl.int64) << (D * BITS)
    tl.store(OUT + points, code, mask=ok)


def morton_codes_triton(
    unit: Tensor, bits: int, shift: float, levels: int, top: int, tag_rows: tuple[int, int] | None = None
) -> Tensor:
    """Codes of points ``unit`` [..., D] fp32 in [0, 1]: cell = clamp(floor((unit + shift) * levels),
    0, top) per coordinate, then ``bits`` bits of each interleaved. Returns [...] int64 (op
    ``sparsefocus::morton_codes``, not differentiable).

    tag_rows: (row length L, first row r0): point p's code gets r0 + p // L (p the flat index
    over ``unit``'s leading dims) in the bits from D * bits up, so that one flat sort of several
    rows' codes keeps each row's keys together and in order. The caller keeps the tagged codes
    below 2**63. Default: no tag."""
    if unit.dtype != torch.float32:
        raise ValueError(f"morton_codes_triton: unit must be float32, got {unit.dtype}")
    row_len, first_row = tag_rows or (1, 0)
    flat = unit.reshape(-1, unit.shape[-1])  # [P, D]
    op = morton_codes_traced if triton_op_chosen(flat) else morton_codes_op
    return op(flat, bits, float(shift), levels, top, row_len, first_row, tag_rows is not None).view(unit.shape[:-1])


@torch.library.custom_op(op_name("morton_codes"), mutates_args=())
def morton_codes_op(
    unit: Tensor, bits: int, shift: float, levels: int, top: int, row_len: int, first_row: int, tag: bool
) -> Tensor:
    """``sparsefocus::morton_codes``: codes [P] int64 of points unit [P, D] fp32 (see
    ``morton_codes_triton``; row_len and first_row are read only when ``tag``)."""
    return _morton_codes(unit, bits, shift, levels, top, row_len, first_row, tag, _morton_kernel)


def _morton_codes(unit, bits, shift, levels, top, row_len, first_row, tag, kernel) -> Tensor:
    """Launch the codes kernel (``wrap_triton`` of it in the ``triton_op`` twin)."""
    flat = unit.contiguous()
    out = torch.empty(flat.shape[0], dtype=torch.int64, device=unit.device)
    grid = (triton.cdiv(flat.shape[0], BLOCK),)
    kernel[grid](
        flat, out, flat.shape[0], shift, float(levels), top, row_len, first_row, D=flat.shape[-1], BITS=bits, BLOCK=BLOCK, TAG=tag
    )
    return out


@morton_codes_op.register_fake
def _morton_codes_fake(unit, bits, shift, levels, top, row_len, first_row, tag):
    return unit.new_empty(unit.shape[0], dtype=torch.int64)


@torch.library.triton_op(op_name("morton_codes_traced"), mutates_args=())
def morton_codes_traced(
    unit: Tensor, bits: int, shift: float, levels: int, top: int, row_len: int, first_row: int, tag: bool
) -> Tensor:
    """``sparsefocus::morton_codes_traced``: ``morton_codes_op``'s ``triton_op`` twin (``_ops.TRITON_OPS``)."""
    return _morton_codes(unit, bits, shift, levels, top, row_len, first_row, tag, wrap_triton(_morton_kernel))

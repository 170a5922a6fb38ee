"""The few best entries of many short score rows in Triton: ``top_positions`` on CUDA.

``torch.topk`` over many short rows is slow on CUDA: NSA's block choice in the laboratory (150,000
rows of 120 block scores, top 3) took 0.84 ms a call on the H200, about 170 GB/s, and
``top_positions`` first spends five int64 passes packing each (score, position) pair. Here a
program holds BLOCK_R rows of at most BLOCK keys in registers, packs each fp32 score with its
position into one int64 key (the float's order in the high word, 0x7FFFFFFF - position in the low
one, as ``top_positions`` does, so equal scores go to the smaller position), and takes KK rounds
of row maxima, writing each round's pick: the best first, -1 once a row's allowed keys are used
up. One read of the scores and the mask, no host synchronisation, fixed shapes
(``sparsefocus::row_top_positions`` is a custom op).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from sparsefocus.kernels import interpreter_compat  # noqa: F401  (CPU interpreter fix)
from sparsefocus.kernels.topk_select import INT32_MAX, INT64_MIN, _pack

MAX_KEYS = 1024
"""Longest rows the kernel takes (a row's keys live in registers)."""
MAX_PICKS = 16
"""Most picks per row (one row reduction each)."""
TILE_KEYS = 1024
"""Packed keys of one program: rows per program = this // keys per row (at least 1, at most 64)."""
ROW_WARPS = 1
"""Warps of a program. One: Triton lays a row of up to 1024 keys over the 32 threads of a warp, so
each round's row maximum is a warp reduction (``redux.sync``); with 4 warps a row of 128 keys was
spread over all four and every round's maximum went through shared memory and barriers (53
``bar.sync`` in the 4-warp program's PTX for 32 rows of 128 keys, 2 in the 1-warp one's)."""


@triton.jit
def _row_top_kernel(S, A, OUT, R, M, KK: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK: tl.constexpr):
    """The KK best allowed keys of BLOCK_R rows of S [R, M] fp32 (A [R, M] int8: allowed), best
    first, into OUT [R, KK] int64; -1 where a row has no allowed key left."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)  # [BR]
    pos = tl.arange(0, BLOCK)  # [BLOCK]
    inside = (rows < R)[:, None] & (pos < M)[None, :]  # [BR, BLOCK]
    offsets = rows[:, None].to(tl.int64) * M + pos[None, :]
    score = tl.load(S + offsets, mask=inside, other=0.0)
    allowed = inside & (tl.load(A + offsets, mask=inside, other=0) != 0)
    score = tl.where(score != 0.0, score, 0.0)  # -0.0 ties with 0.0, as in top_positions
    key = tl.where(allowed, _pack(score, pos[None, :]), INT64_MIN)  # [BR, BLOCK] int64
    out = OUT + rows.to(tl.int64) * KK
    for r in tl.static_range(KK):
        best = tl.max(key, axis=1)  # [BR]
        position = tl.where(best == INT64_MIN, -1, INT32_MAX - (best & 0xFFFFFFFF).to(tl.int32))
        tl.store(out + r, position.to(tl.int64), mask=rows < R)
        key = tl.where(key == best[:, None], INT64_MIN, key)  # positions are unique: one key per row


@torch.library.custom_op("sparsefocus::row_top_positions", mutates_args=())
def _row_top_positions_op(scores: Tensor, allowed: Tensor, count: int) -> Tensor:
    """scores [R, M] fp32, allowed [R, M] int8 -> [R, count] int64 positions, best first, -1 past the allowed keys."""
    n_rows, n_keys = scores.shape
    out = torch.empty(n_rows, count, dtype=torch.int64, device=scores.device)
    if n_rows == 0 or count == 0:
        return out
    block = max(16, triton.next_power_of_2(n_keys))
    block_r = max(1, min(64, TILE_KEYS // block))
    _row_top_kernel[(triton.cdiv(n_rows, block_r),)](
        scores, allowed, out, n_rows, n_keys, KK=count, BLOCK_R=block_r, BLOCK=block, num_warps=ROW_WARPS
    )
    return out


@_row_top_positions_op.register_fake
def _row_top_positions_fake(scores: Tensor, allowed: Tensor, count: int) -> Tensor:
    return scores.new_empty(scores.shape[0], count, dtype=torch.int64)


def fits(n_keys: int, count: int) -> bool:
    """Whether rows of ``n_keys`` scores choosing ``count`` take the kernel."""
    return 0 < n_keys <= MAX_KEYS and min(count, n_keys) <= MAX_PICKS


def row_top_positions(scores: Tensor, count: int, allowed: Tensor) -> Tensor:
    """``top_positions`` by the kernel: positions [..., min(count, M)] int64 of the largest scores
    [..., M] among ``allowed`` (bool, broadcastable to the scores), best first, ties to the smaller
    position, -1 past a row's allowed keys. Rows of at most ``MAX_KEYS`` keys, at most
    ``MAX_PICKS`` picks (``fits``)."""
    n_keys = scores.shape[-1]
    picks = min(count, n_keys)
    if not fits(n_keys, count):
        raise ValueError(
            f"row_top_positions: rows of {n_keys} keys choosing {count} do not fit (at most {MAX_KEYS}, {MAX_PICKS})"
        )
    flat = scores.detach().float().reshape(-1, n_keys).contiguous()  # [R, M]
    mask = torch.broadcast_to(allowed, scores.shape).reshape(-1, n_keys).to(torch.int8).contiguous()  # [R, M]
    return torch.ops.sparsefocus.row_top_positions(flat, mask, picks).view(*scores.shape[:-1], picks)

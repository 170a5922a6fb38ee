"""Exact top-k key selection for a few query rows over a long key sequence (decoding).

``topk_select`` gives each program a tile of query rows and sweeps all keys, which suits N x M
training calls; a decoding step has one query per head (or a few), so one program per row would
sweep millions of keys alone. Here the keys are split instead (split-K, as FlashDecoding does
for dense attention):

1. block top (one program per query row and key block of BLOCK_N keys): the block's scores in
   fp32, allowed keys only (bottom-right causal: query i of N sees keys j <= M - N + i; key
   padding), and the block's kk best as packed (score, position) int64 keys, best first;
2. merge: ``torch.topk`` over the [rows, blocks * kk] candidates.

Every key of the global top kk is among its block's top kk, so the merge is exact, with the
same tie rule as ``topk_select`` (equal scores: smaller position first). Scores are summed in
fp32 from the inputs' values (16-bit products are exact in fp32). Memory: rows * ceil(M /
BLOCK_N) * kk int64 candidates, at most ``MAX_CANDIDATES`` per kernel call (more rows go in
chunks), so the selection is meant for few rows. No host synchronisation; the custom op
``sparsefocus::topk_decode_select``.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from sparsefocus.kernels import interpreter_compat  # noqa: F401  (CPU interpreter fix)
from sparsefocus.kernels._ops import op_name, unpacked_positions
from sparsefocus.kernels.topk_select import INT64_MIN, _pack

MAX_K = 64
"""Largest kk: the block kernel keeps kk rounds of maxima unrolled."""
MAX_CANDIDATES = 2**25
"""Most int64 candidates (256 MiB) one kernel call holds; more query rows go in chunks."""


@triton.jit
def _block_top_kernel(
    Q,
    K,
    PAD,
    OUT,
    N,
    M,
    HQ,
    GROUP,
    NUM_BLOCKS,
    SKB,
    SKH,
    D: tl.constexpr,
    KK: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_DC: tl.constexpr,
    CAUSAL: tl.constexpr,
    HAS_PAD: tl.constexpr,
):
    """Program (row, block): the packed keys [KK] of the block's best allowed scores, best first,
    int64 min where the block has fewer allowed keys; written to OUT[row, block, :]. K's batch
    and head strides are SKB, SKH (a prefix of a longer cache is read in place); its rows are
    dense [M, D]."""
    pid = tl.program_id(0)  # one grid axis: CUDA caps the second at 65535 programs
    row, block = pid // NUM_BLOCKS, pid % NUM_BLOCKS
    bh, query = row // N, row % N
    batch, head = bh // HQ, bh % HQ
    k_base = K + batch.to(tl.int64) * SKB + (head // GROUP).to(tl.int64) * SKH
    cols = block * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN] key positions
    key_ok = cols < M
    scores = tl.zeros([BLOCK_N], dtype=tl.float32)
    for d0 in tl.static_range(0, D, BLOCK_DC):  # [BN, BLOCK_DC] slices keep the registers small
        offs_d = d0 + tl.arange(0, BLOCK_DC)
        q = tl.load(Q + row.to(tl.int64) * D + offs_d, mask=offs_d < D, other=0.0).to(tl.float32)
        k_ptr = k_base + cols[:, None] * D + offs_d[None, :]
        k = tl.load(k_ptr, mask=key_ok[:, None] & (offs_d[None, :] < D), other=0.0).to(tl.float32)
        scores += tl.sum(k * q[None, :], axis=1)
    allowed = key_ok
    if CAUSAL:  # bottom-right: query i of N sits at position M - N + i
        allowed = allowed & (cols <= M - N + query)
    if HAS_PAD:
        allowed = allowed & (tl.load(PAD + batch.to(tl.int64) * M + cols, mask=key_ok, other=0) != 0)
    packed = tl.where(allowed, _pack(scores, cols), INT64_MIN)
    out = OUT + (row.to(tl.int64) * NUM_BLOCKS + block) * KK
    for rank in tl.static_range(KK):
        top = tl.max(packed, axis=0)
        tl.store(out + rank, top)
        packed = tl.where(packed == top, INT64_MIN, packed)


def _block_n(q: Tensor) -> int:
    """Keys per block: 256 on CUDA (a [256, 32] fp32 slice per 4 warps), 32 in the interpreter so
    that test sizes cross several blocks."""
    return 256 if q.is_cuda else 32


@torch.library.custom_op(op_name("topk_decode_select"), mutates_args=())
def _topk_decode_select_op(q: Tensor, k: Tensor, kk: int, causal: bool, key_padding_mask: Optional[Tensor]) -> Tensor:
    batch, q_heads, n_queries, dim = q.shape
    n_keys = k.shape[2]
    rows = batch * q_heads * n_queries
    block_n = _block_n(q)
    num_blocks = triton.cdiv(n_keys, block_n)
    candidates = torch.empty(rows, num_blocks, kk, dtype=torch.int64, device=q.device)
    pad = key_padding_mask.to(torch.int8).contiguous() if key_padding_mask is not None else candidates
    if k.stride(-1) != 1 or k.stride(-2) != dim:  # rows of k must be dense; its batch and head strides are free
        k = k.contiguous()
    _block_top_kernel[(rows * num_blocks,)](
        q.contiguous(),
        k,
        pad,
        candidates,
        n_queries,
        n_keys,
        q_heads,
        q_heads // k.shape[1],
        num_blocks,
        k.stride(0),
        k.stride(1),
        D=dim,
        KK=kk,
        BLOCK_N=block_n,
        BLOCK_DC=min(32, triton.next_power_of_2(dim)),
        CAUSAL=causal,
        HAS_PAD=key_padding_mask is not None,
        **(dict(num_warps=4) if q.is_cuda else {}),
    )
    top = candidates.view(rows, num_blocks * kk).topk(min(kk, num_blocks * kk), dim=-1).values  # [rows, kk]
    return unpacked_positions(top).to(torch.int32).view(batch, q_heads, n_queries, kk)


@_topk_decode_select_op.register_fake
def _topk_decode_select_fake(q: Tensor, k: Tensor, kk: int, causal: bool, key_padding_mask: Optional[Tensor]) -> Tensor:
    return q.new_empty(*q.shape[:3], kk, dtype=torch.int32)


def topk_decode_select(q: Tensor, k: Tensor, kk: int, *, causal: bool = True, key_padding_mask: Tensor | None = None) -> Tensor:
    """Positions of each query's ``kk`` largest scores q.k, for a few query rows over many keys.

    Args:
        q: [B, Hq, N, D] (few rows: the candidates take B * Hq * N * ceil(M / 256) * kk int64,
            in query chunks of at most ``MAX_CANDIDATES``);
            k: [B, Hk, M, D] with Hq % Hk == 0 (query head h reads key head h // (Hq // Hk)).
        kk: keys per query, 1 <= kk <= ``MAX_K`` (rows with fewer allowed keys fill -1).
        causal: bottom-right alignment, query i of N sees keys j <= M - N + i (decoding).
            Default: True.
        key_padding_mask: [B, M] bool, True = real key; padded keys are never chosen. Default: None.
    Returns:
        [B, Hq, N, kk] int32 key positions, best first (ties: smaller position first), -1 where a
        row has fewer than kk allowed keys; the same as ``topk_select_torch`` on the bottom-right
        rows up to the summation order of the scores. No gradient, no host synchronisation.
    """
    if not 1 <= kk <= MAX_K:
        raise ValueError(f"topk_decode_select: kk must be in [1, {MAX_K}], got {kk}")
    if q.shape[-1] != k.shape[-1] or q.shape[1] % k.shape[1] != 0 or q.shape[0] != k.shape[0]:
        raise ValueError(f"topk_decode_select: incompatible q {tuple(q.shape)} and k {tuple(k.shape)}")
    if causal and q.shape[2] > k.shape[2]:
        raise ValueError(f"topk_decode_select: {q.shape[2]} queries are more than the {k.shape[2]} keys")
    batch, heads, n_queries, _ = q.shape
    n_keys = k.shape[2]
    q, k = q.detach(), k.detach().to(q.dtype)
    chunk = max(1, MAX_CANDIDATES // (batch * heads * triton.cdiv(n_keys, _block_n(q)) * kk))
    parts = []
    for a in range(0, n_queries, chunk):
        # bottom-right: a chunk's queries see the keys up to its last position, a call of its own
        seen = n_keys - n_queries + min(a + chunk, n_queries) if causal else n_keys
        mask = None if key_padding_mask is None else key_padding_mask[:, :seen]
        parts.append(torch.ops.sparsefocus.topk_decode_select(q[:, :, a : a + chunk], k[:, :, :seen], kk, causal, mask))
    return torch.cat(parts, dim=2)

"""Exact top-k key selection in Triton without an N x M score tensor.

For each query row the kernel returns the positions of its ``kk`` largest scores q.k among the
allowed keys (causal cut, key padding). One program handles BLOCK_M query rows of one head and
sweeps the keys twice in tiles of BLOCK_N, computing score tiles with ``tl.dot`` each time:

1. bound pass: column c of a tile holds the keys j = c (mod BLOCK_N); the kernel keeps the two
   largest scores of each column class (3 min/max per score). The kk-th largest of those
   2 * BLOCK_N values (found by kk rounds of row maxima, no sort) belongs to kk distinct keys, so it is a lower bound t of the true kk-th
   largest score, and in practice only a few more than kk keys score >= t.
2. collect pass: scores >= t are appended (score, position) to a per-row scratch list of
   CAP = 2 * next_pow2(kk) slots; at the end kk rounds of row maxima over the packed
   (score, position) keys write the kk best positions, best first.

A row whose list overflows (more than CAP keys tie or crowd at the bound, e.g. constant
inputs) is recomputed exactly by a chunked PyTorch selection. Memory: O(N kk) scratch.

Ties: equal scores are ordered by smaller key position first, in the kernel and in the fallback.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from sparsefocus.kernels import interpreter_compat  # noqa: F401  (CPU interpreter fix)

MAX_KERNEL_K = 128
FALLBACK_ROW_CHUNK = 1024
TILE_OVERRIDES: dict = {}
"""Benchmark hook: BLOCK_M / BLOCK_N / num_warps replacing the launcher's choice."""


@triton.jit
def _score_tile(q, k_ptr, pad_ptr, rows, start, M, scale,
                D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                CAUSAL: tl.constexpr, HAS_PAD: tl.constexpr, PRECISION: tl.constexpr):
    """Scores [BM, BN] of the query tile against keys start..start+BN; -inf where not allowed."""
    cols = start + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    kt = tl.load(k_ptr + cols[None, :] * D + offs_d[:, None], mask=(cols[None, :] < M) & (offs_d[:, None] < D), other=0.0)  # [BD, BN]
    s = tl.dot(q, kt, input_precision=PRECISION) * scale
    allowed = cols[None, :] < M
    if CAUSAL:
        allowed = allowed & (cols[None, :] <= rows[:, None])
    if HAS_PAD:
        allowed = allowed & (tl.load(pad_ptr + cols, mask=cols < M, other=0) != 0)[None, :]
    return tl.where(allowed, s, float("-inf")), allowed, cols


@triton.jit
def _pack(score, index):
    """int64 keys ordered like (score, -index): high word order-preserving score bits."""
    bits = score.to(tl.int32, bitcast=True)
    ordered = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
    return (ordered.to(tl.int64) << 32) + (0x7FFFFFFF - index).to(tl.int64)


@triton.jit
def _kth_largest(values, KK: tl.constexpr):
    """The KK-th largest entry (counting repeats) of each row of values [BM, L]; -inf if none.

    KK rounds of "take the row maximum, count and remove its copies": no sort, so it is cheap
    in Triton's interpreter too."""
    need = tl.full([values.shape[0]], KK, tl.int32)
    kth = tl.full([values.shape[0]], float("-inf"), tl.float32)
    for _ in tl.static_range(KK):
        top = tl.max(values, axis=1)
        copies = tl.sum((values == top[:, None]).to(tl.int32), axis=1)
        kth = tl.where((need > 0) & (copies >= need), top, kth)
        need -= copies
        values = tl.where(values == top[:, None], float("-inf"), values)
    return kth


@triton.jit
def _topk_select_kernel(
    Q, K, PAD, OUT, COUNT, BUF_S, BUF_I,
    N, M, HQ, GROUP, scale,
    D: tl.constexpr, KK: tl.constexpr, KKP: tl.constexpr, CAUSAL: tl.constexpr, HAS_PAD: tl.constexpr,
    PRECISION: tl.constexpr, PREFIX_DOT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    pid_m, bh = tl.program_id(0), tl.program_id(1)
    kv_bh = (bh // HQ) * (HQ // GROUP) + (bh % HQ) // GROUP
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_offs = bh.to(tl.int64) * N + rows  # [BM] flat row number
    offs_d = tl.arange(0, BLOCK_D)
    q = tl.load(Q + row_offs[:, None] * D + offs_d[None, :], mask=(rows[:, None] < N) & (offs_d[None, :] < D), other=0.0)
    k_ptr = K + kv_bh.to(tl.int64) * M * D
    pad_ptr = PAD + (bh // HQ).to(tl.int64) * M
    hi = M
    if CAUSAL:
        hi = tl.minimum(M, (pid_m + 1) * BLOCK_M)

    best = tl.full([BLOCK_M, BLOCK_N], float("-inf"), tl.float32)
    second = tl.full([BLOCK_M, BLOCK_N], float("-inf"), tl.float32)
    for start in range(0, hi, BLOCK_N):
        s, _, _ = _score_tile(q, k_ptr, pad_ptr, rows, start, M, scale, D, BLOCK_N, BLOCK_D, CAUSAL, HAS_PAD, PRECISION)
        second = tl.maximum(second, tl.minimum(best, s))
        best = tl.maximum(best, s)
    bound = _kth_largest(tl.reshape(tl.join(best, second), [BLOCK_M, 2 * BLOCK_N]), KK)  # [BM]
    bound = bound - tl.abs(bound) * 1e-6  # margin: the collect pass must not lose a key to rounding

    CAP: tl.constexpr = 2 * KKP
    count = tl.zeros([BLOCK_M], tl.int32)
    tile_cols = tl.arange(0, BLOCK_N)
    upper = (tile_cols[:, None] <= tile_cols[None, :]).to(tl.float16)  # [BN, BN]
    for start in range(0, hi, BLOCK_N):
        s, allowed, cols = _score_tile(q, k_ptr, pad_ptr, rows, start, M, scale, D, BLOCK_N, BLOCK_D, CAUSAL, HAS_PAD, PRECISION)
        hit = (allowed & (s >= bound[:, None]) & (rows[:, None] < N)).to(tl.int32)
        hits = tl.sum(hit, axis=1)
        if tl.sum(hits) > 0:
            if PREFIX_DOT:  # inclusive prefix count on the tensor cores: hit @ upper-triangular ones
                prefix = tl.dot(hit.to(tl.float16), upper, out_dtype=tl.float32).to(tl.int32)
            else:
                prefix = tl.cumsum(hit, axis=1)
            slot = count[:, None] + prefix - 1
            keep = (hit != 0) & (slot < CAP)
            tl.store(BUF_S + row_offs[:, None] * CAP + slot, s, mask=keep)
            tl.store(BUF_I + row_offs[:, None] * CAP + slot, cols[None, :] + 0 * slot, mask=keep)
            count += hits
    tl.store(COUNT + row_offs, count, mask=rows < N)
    tl.debug_barrier()

    slots = tl.arange(0, CAP)
    filled = (slots[None, :] < count[:, None]) & (rows[:, None] < N)
    scores = tl.load(BUF_S + row_offs[:, None] * CAP + slots[None, :], mask=filled, other=0.0)
    index = tl.load(BUF_I + row_offs[:, None] * CAP + slots[None, :], mask=filled, other=0)
    packed = tl.where(filled, _pack(scores, index), -9223372036854775807 - 1)  # [BM, CAP], distinct
    for rank in tl.static_range(KK):
        top = tl.max(packed, axis=1)  # [BM]: the rank-th best key of each row
        packed = tl.where(packed == top[:, None], -9223372036854775807 - 1, packed)
        chosen = tl.where(top == -9223372036854775807 - 1, -1, 0x7FFFFFFF - (top & 0xFFFFFFFF).to(tl.int32))
        tl.store(OUT + row_offs * KK + rank, chosen, mask=rows < N)

def _launch(q: Tensor, k: Tensor, kk: int, causal: bool, key_padding_mask: Tensor | None, scale: float):
    """Run the kernel; returns out [B, Hq, N, kk] int32 and candidate counts [B, Hq, N] int32."""
    batch, q_heads, n_queries, dim = q.shape
    kk_pow2 = triton.next_power_of_2(kk)
    out = torch.empty(batch, q_heads, n_queries, kk, dtype=torch.int32, device=q.device)
    count = torch.empty(batch, q_heads, n_queries, dtype=torch.int32, device=q.device)
    buf_s = torch.empty(batch * q_heads * n_queries, 2 * kk_pow2, dtype=torch.float32, device=q.device)
    buf_i = torch.empty(batch * q_heads * n_queries, 2 * kk_pow2, dtype=torch.int32, device=q.device)
    pad = key_padding_mask.to(torch.int8).contiguous() if key_padding_mask is not None else count
    block_n = max(32 if q.is_cuda else 16, kk_pow2 // 2)  # 2 * BLOCK_N bound candidates >= kk
    tiles = dict(BLOCK_M=64, BLOCK_N=block_n, PREFIX_DOT=True, num_warps=4) | TILE_OVERRIDES
    grid = (triton.cdiv(n_queries, tiles["BLOCK_M"]), batch * q_heads)
    _topk_select_kernel[grid](
        q, k, pad, out, count, buf_s, buf_i, n_queries, k.shape[2], q_heads, q_heads // k.shape[1], scale,
        D=dim, KK=kk, KKP=kk_pow2, CAUSAL=causal, HAS_PAD=key_padding_mask is not None,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        BLOCK_D=max(16, triton.next_power_of_2(dim)), **tiles,
    )
    return out, count


def _packed_scores(scores: Tensor) -> Tensor:
    """int64 keys ordered like (score, -position) along the last dim of fp32 scores [..., M]."""
    bits = scores.contiguous().view(torch.int32).long()
    ordered = torch.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
    position = torch.arange(scores.shape[-1], device=scores.device)
    return ordered * (1 << 32) + (0x7FFFFFFF - position)


def _select_rows(scores: Tensor, allowed: Tensor, kk: int) -> Tensor:
    """Top-kk positions [R, kk] int32 of fp32 scores [R, M] among ``allowed``, ties to smaller positions."""
    packed = _packed_scores(scores).masked_fill(~allowed, torch.iinfo(torch.int64).min)
    top = packed.topk(min(kk, scores.shape[-1]), dim=-1).values
    index = (0x7FFFFFFF - (top & 0xFFFFFFFF)).to(torch.int32)
    index = torch.where(top == torch.iinfo(torch.int64).min, torch.full_like(index, -1), index)
    return torch.nn.functional.pad(index, (0, kk - index.shape[-1]), value=-1)


def topk_select_torch(
    q: Tensor, k: Tensor, kk: int, *, causal: bool = False, key_padding_mask: Tensor | None = None,
    rows: Tensor | None = None,
) -> Tensor:
    """Exact top-kk selection in PyTorch with the kernel's tie rule (smaller position first).

    q: [B, Hq, N, D]; k: [B, Hk, M, D]. ``rows`` optionally limits the work to the flat row
    numbers (b * Hq + h) * N + n listed. Returns [B, Hq, N, kk] int32 (-1 unused), or [R, kk]
    for the listed rows. Memory O(chunk * M): one head and a chunk of rows at a time.
    """
    batch, q_heads, n_queries, _ = q.shape
    flat_rows = torch.arange(batch * q_heads * n_queries, device=q.device) if rows is None else rows
    out = torch.full((flat_rows.numel(), kk), -1, dtype=torch.int32, device=q.device)
    head_of_row = flat_rows // n_queries  # b * Hq + h
    key_pos = torch.arange(k.shape[2], device=q.device)
    chunk = max(1, min(FALLBACK_ROW_CHUNK, 2**24 // max(1, k.shape[2])))
    for head in torch.unique(head_of_row).tolist():
        b, h = divmod(head, q_heads)
        keys = k[b, h // (q_heads // k.shape[1])].float()  # [M, D]
        where = torch.nonzero(head_of_row == head).flatten()
        for part in where.split(chunk):
            n = flat_rows[part] % n_queries
            scores = q[b, h, n].float() @ keys.T  # [R, M]
            allowed = torch.ones_like(scores, dtype=torch.bool)
            if causal:
                allowed &= key_pos[None, :] <= n[:, None]
            if key_padding_mask is not None:
                allowed &= key_padding_mask[b][None, :]
            out[part] = _select_rows(scores, allowed, kk)
    return out if rows is not None else out.reshape(batch, q_heads, n_queries, kk)


def topk_select(
    q: Tensor,
    k: Tensor,
    kk: int,
    *,
    causal: bool = False,
    key_padding_mask: Tensor | None = None,
    scale: float | None = None,
) -> Tensor:
    """Positions of each query's ``kk`` largest scores q.k among the allowed keys, without N x M memory.

    Args:
        q: [B, Hq, N, D]; k: [B, Hk, M, D] with Hq % Hk == 0 (query head h reads key head h // (Hq // Hk)).
        kk: keys per query, 1 <= kk; above 128 the chunked PyTorch selection is used.
        causal: query i only selects keys j <= i. Default: False.
        key_padding_mask: [B, M] bool, True = real key; padded keys are never selected. Default: None.
        scale: positive factor on the scores; it does not change the choice. Default: 1.
    Returns:
        [B, Hq, N, kk] int32 key positions, best first (ties: smaller position first); -1 where a
        row has fewer than kk allowed keys.
    """
    if kk < 1:
        raise ValueError(f"topk_select: kk must be >= 1, got {kk}")
    if scale is not None and scale <= 0:
        raise ValueError(f"topk_select: scale must be positive, got {scale}")
    if q.shape[-1] != k.shape[-1] or q.shape[1] % k.shape[1] != 0:
        raise ValueError(f"topk_select: incompatible q {tuple(q.shape)} and k {tuple(k.shape)}")
    if kk > MAX_KERNEL_K or q.shape[2] == 0 or k.shape[2] == 0:
        return topk_select_torch(q, k, kk, causal=causal, key_padding_mask=key_padding_mask)
    q, k = q.detach().contiguous(), k.detach().to(q.dtype).contiguous()
    out, count = _launch(q, k, kk, causal, key_padding_mask, 1.0 if scale is None else float(scale))
    overflow = torch.nonzero(count.reshape(-1) > 2 * triton.next_power_of_2(kk)).flatten()
    if overflow.numel() > 0:
        exact = topk_select_torch(q, k, kk, causal=causal, key_padding_mask=key_padding_mask, rows=overflow)
        out.view(-1, kk)[overflow] = exact
    return out

"""DSA's lightning-indexer selection in Triton: exact top-k keys per query by radix select.

The indexer scores key s for query t as I(t, s) = sum_h w[t, h] ReLU(iq[t, h] . ik[s]) and keeps
the ``kk`` best keys (2048 in DeepSeek-V3.2), far more than the per-row register selection of
``topk_select`` can hold. Rows are taken in chunks of R queries; per chunk two launches:

1. scores (tiles of BLOCK_M queries x BLOCK_N keys): the fused indexer, one ``tl.dot`` per
   indexer head, ReLU and the weighted sum in registers, written as fp32 [B, R, M] (the
   [B, h, R, M] per-head scores never reach memory; causal tiles past the diagonal are skipped).
2. select (one program per query row): the exact kk-th largest score by a 4-pass radix select
   over the order-preserving bits of the fp32 scores (8 bits a pass, a 256-bin histogram of the
   row's keys that match the bits found so far), then one pass that writes the positions of the
   keys above it and of the first ties at it, in position order (ties go to the smaller
   position, as in ``top_positions``). Short rows choosing few keys (M <= ``SHORT_MAX_M``,
   kk <= ``SHORT_MAX_K``: a small model's indexer, as in the laboratory) take
   ``_short_select_kernel`` instead: a program holds BLOCK_R rows' scores in registers as packed
   (score, position) keys and takes kk rounds of row maxima, one read of the scores per row.

Short rows skip the score chunk altogether when ``FUSED_SHORT`` is on (the default): one launch,
``_fused_short_kernel``, computes each [BLOCK_M, BLOCK_N] tile of indexer scores as the scores
kernel does and merges it into every row's kk best (score, position) entries in registers
(``topk_select._merge_tile``, ties to the smaller position), so the [B, N, M] fp32 scores are
neither written nor read back.

Long rows choosing many keys skip most of the radix select's passes when ``SAMPLED`` is on (the
default): per scores chunk, a cut per row from a strided sample of its keys (their scores by the
same kernel, ``KEY_STRIDE``, and the radix select of ``_sample_cut_kernel``); the select kernel
then compacts the row's keys at or above the cut, in position order, into a per-row buffer of a
few kk entries (one pass over the row) and radix-selects over the buffer when it holds them all;
a row whose buffer overflowed or fell short of kk takes the radix select over its whole row in
the same program, so the result is the same exact set.

Output: [B, N, kk] int32 key positions in increasing position order, -1 past the row's allowed
keys; no host synchronisation, fixed shapes (``sparsefocus::indexer_topk`` is a custom op).
Scores on CUDA use 3xTF32 dots (fp32 accuracy on tensor cores); a key whose score is within
rounding of the kk-th may be chosen differently from the fp32 reference, as between any two
summation orders. Memory: the [B, R, M] fp32 chunk (about ``CHUNK_ELEMENTS``).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from sparsefocus.kernels import interpreter_compat  # noqa: F401  (CPU interpreter fix)
from sparsefocus.kernels.topk_select import INT32_MAX, INT32_MIN, INT64_MIN, _merge_tile, _ordered_bits, _pack

CHUNK_ELEMENTS = 2**28  # largest [B, R, M] fp32 score chunk, with the sampled path's [B, R, 2 CAP] buffers (1 GiB)
TILE_OVERRIDES: dict = {}
"""Benchmark hook: {BLOCK_M, BLOCK_N, num_warps, SELECT_BLOCK, select_warps} replacing the launcher's choice."""
SHORT_MAX_M = 1024
SHORT_MAX_K = 16
"""Rows of at most SHORT_MAX_M keys choosing at most SHORT_MAX_K take ``_short_select_kernel``:
the row's scores held in registers once and kk rounds of row maxima, instead of the radix
select's five sweeps and four histograms per row."""
SHORT_TILE_KEYS = 4096  # packed keys of one short-select program: rows per program = this // keys per row
FUSED_SHORT = True
"""Short rows: True, scores and selection in one launch (``_fused_short_kernel``); False, the
scores chunk, then ``_short_select_kernel``."""
SAMPLED = True
"""Long rows choosing many keys (kk >= ``SAMPLED_MIN_K``, rows of more than ``SAMPLED_CAP_FACTOR``
x kk keys): True, each row's cut from a strided sample of its keys (every ``SAMPLE_STRIDE``-th:
the SAMPLE_FACTOR x kk / stride-th largest sampled score), the row's keys at or above it compacted
into a buffer of SAMPLED_CAP_FACTOR x kk entries and the radix select over that buffer alone; a
row whose buffer overflows or holds fewer than kk keys takes the radix select over its whole row.
False: the radix select over the whole row for every row. On an H200 (B=4, 4 heads of 64, kk=2048,
causal) the op took 0.56x the exact path's time at 64K and 0.74x at 16K, with the same positions
(docs/block_sparse.md)."""
SAMPLE_STRIDE = 16
SAMPLE_FACTOR = 1.35
SAMPLED_CAP_FACTOR = 4.0
SAMPLED_MIN_K = 256


@triton.jit
def _score_tile(
    IQ, IK, W, b, rows, row_ok, cols, N, M,
    H: tl.constexpr, D: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """[BM, BN] indexer scores sum_h W[b, row, h] relu(IQ[b, h, row] . IK[b, col]) of the rows
    ``rows`` (zero where not ``row_ok``) against the keys ``cols`` (zero past M)."""
    offs_d = tl.arange(0, BLOCK_D)
    key_ptrs = IK + (b * M + cols[:, None]).to(tl.int64) * D + offs_d[None, :]
    keys = tl.load(key_ptrs, mask=(cols[:, None] < M) & (offs_d[None, :] < D), other=0.0)  # [BN, BD]
    total = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for h in tl.static_range(H):
        q_ptrs = IQ + ((b * H + h) * N + rows[:, None]).to(tl.int64) * D + offs_d[None, :]
        q = tl.load(q_ptrs, mask=row_ok[:, None] & (offs_d[None, :] < D), other=0.0)  # [BM, BD]
        weight = tl.load(W + (b * N + rows).to(tl.int64) * H + h, mask=row_ok, other=0.0)  # [BM]
        total += weight[:, None] * tl.maximum(tl.dot(q, tl.trans(keys), input_precision=PRECISION), 0.0)
    return total


@triton.jit
def _allowed_keys(PAD, b, rows, row_ok, cols, M, CAUSAL: tl.constexpr, HAS_PAD: tl.constexpr):
    """[BM, BN] True where key ``cols`` exists and may be chosen by query ``rows`` (causal, padding)."""
    allowed = row_ok[:, None] & (cols < M)[None, :]
    if CAUSAL:
        allowed = allowed & (cols[None, :] <= rows[:, None])
    if HAS_PAD:
        allowed = allowed & (tl.load(PAD + b.to(tl.int64) * M + cols, mask=cols < M, other=0) != 0)[None, :]
    return allowed


@triton.jit
def _scores_kernel(
    IQ,
    IK,
    W,
    S,
    row0,
    R,
    N,
    M,
    H: tl.constexpr,
    D: tl.constexpr,
    CAUSAL: tl.constexpr,
    PRECISION: tl.constexpr,
    KEY_STRIDE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """S[b, r, s] = sum_h W[b, row0 + r, h] relu(IQ[b, h, row0 + r] . IK[b, s]) for one tile. Key s
    is position s * KEY_STRIDE (the sampled keys), which decides the causal tiles never read."""
    pid_m, pid_n, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    local = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM] rows of the chunk
    rows = row0 + local
    row_ok = (local < R) & (rows < N)
    live = tl.max(row_ok.to(tl.int32)) > 0
    if CAUSAL:  # a tile whose keys are all in every row's future is never read, so never written
        live = live & (pid_n * BLOCK_N * KEY_STRIDE <= row0 + pid_m * BLOCK_M + BLOCK_M - 1)
    if live:
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN] keys
        total = _score_tile(IQ, IK, W, b, rows, row_ok, cols, N, M, H, D, PRECISION, BLOCK_M, BLOCK_N, BLOCK_D)
        out = S + (b * R + local[:, None]).to(tl.int64) * M + cols[None, :]
        tl.store(out, total, mask=row_ok[:, None] & (cols[None, :] < M))


@triton.jit
def _row_keys(S_row, PAD_row, start, limit, M, HAS_PAD: tl.constexpr, BLOCK: tl.constexpr):
    """(positions [BLOCK], order-preserving int32 keys of their scores, allowed mask).

    The loads are masked by the row's end M, not by ``limit`` (the causal cut, which differs per
    row): a mask that is constant over 16 entries when M is a multiple of 16 lets the compiler
    issue 16-byte loads. Entries past ``limit`` are read (never-written causal tiles included)
    and left out by ``valid``."""
    pos, score, valid = _row_scores(S_row, PAD_row, start, limit, M, HAS_PAD, BLOCK)
    return pos, _ordered_bits(score), valid


@triton.jit
def _row_scores(S_row, PAD_row, start, limit, M, HAS_PAD: tl.constexpr, BLOCK: tl.constexpr):
    """(positions [BLOCK], their scores, allowed mask): the loads of ``_row_keys``."""
    pos = start + tl.arange(0, BLOCK)
    in_row = pos < M
    valid = pos < limit
    if HAS_PAD:
        valid = valid & (tl.load(PAD_row + pos, mask=in_row, other=0) != 0)
    score = tl.load(S_row + pos, mask=in_row, other=0.0)
    score = tl.where(valid & (score != 0.0), score, 0.0)  # -0.0 ties with 0.0; unread or unallowed: 0
    return pos, score, valid


@triton.jit
def _radix_pass(S_row, PAD_row, limit, M, prefix, remaining, SHIFT: tl.constexpr, HAS_PAD: tl.constexpr, BLOCK: tl.constexpr):
    """One 8-bit digit of the kk-th key: (prefix with the digit set, keys still to find at or
    below it, number of keys matching the old prefix). Digits are of the key with its sign bit
    flipped (unsigned order); arithmetic shifts give the same low 8 bits as logical ones."""
    hist = tl.zeros([256], tl.int32)
    for start in range(0, limit, BLOCK):
        _, ordered, valid = _row_keys(S_row, PAD_row, start, limit, M, HAS_PAD, BLOCK)
        flipped = ordered ^ INT32_MIN
        if SHIFT < 24:
            valid = valid & (((flipped ^ prefix) >> (SHIFT + 8)) == 0)
        hist += tl.histogram((flipped >> SHIFT) & 255, 256, mask=valid)
    digits = tl.arange(0, 256)
    at_or_above = tl.sum(hist) - tl.cumsum(hist, axis=0) + hist  # [256]: keys with digit >= d
    digit = tl.max(tl.where(at_or_above >= remaining, digits, 0))
    above = tl.sum(tl.where(digits > digit, hist, 0))
    return prefix | (digit << SHIFT), remaining - above, tl.sum(hist)


@triton.jit
def _kth_key(S_row, PAD_row, limit, M, KK, HAS_PAD: tl.constexpr, BLOCK: tl.constexpr):
    """(order-preserving int32 key of the row's KK-th largest allowed score, how many keys equal to
    it are wanted, the row's allowed keys) by four 8-bit radix passes."""
    prefix = tl.zeros([], tl.int32)
    remaining = tl.zeros([], tl.int32) + KK
    prefix, remaining, allowed = _radix_pass(S_row, PAD_row, limit, M, prefix, remaining, 24, HAS_PAD, BLOCK)
    prefix, remaining, _ = _radix_pass(S_row, PAD_row, limit, M, prefix, remaining, 16, HAS_PAD, BLOCK)
    prefix, remaining, _ = _radix_pass(S_row, PAD_row, limit, M, prefix, remaining, 8, HAS_PAD, BLOCK)
    prefix, remaining, _ = _radix_pass(S_row, PAD_row, limit, M, prefix, remaining, 0, HAS_PAD, BLOCK)
    return prefix ^ INT32_MIN, remaining, allowed


@triton.jit
def _select_kernel(
    S,
    PAD,
    OUT,
    T,
    BUF_S,
    BUF_P,
    row0,
    R,
    N,
    M,
    CAP,
    KK: tl.constexpr,
    CAUSAL: tl.constexpr,
    HAS_PAD: tl.constexpr,
    PRECUT: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """The row's kk best keys from its scores chunk [B, R, M]. PRECUT: the row's keys at or above
    its cut T [B, R] first go to its buffers BUF_S, BUF_P [B, R, CAP], and the radix select runs
    over the buffer when it holds them all (no overflow, and kk keys or the whole row: T = INT32_MIN),
    else over the whole row."""
    local, b = tl.program_id(0), tl.program_id(1)
    row = row0 + local
    if row < N:
        limit = tl.minimum(M, row + 1) if CAUSAL else M
        S_row = S + (b * R + local).to(tl.int64) * M
        PAD_row = PAD + b.to(tl.int64) * M
        out = OUT + (b * N + row).to(tl.int64) * KK
        if PRECUT:
            i = b * R + local
            row_cut = tl.load(T + i)
            buf_s = BUF_S + i.to(tl.int64) * CAP
            buf_p = BUF_P + i.to(tl.int64) * CAP
            count = _compact_row(S_row, PAD_row, buf_s, buf_p, limit, M, row_cut, CAP, HAS_PAD, BLOCK)
            if (count <= CAP) & ((count >= KK) | (row_cut == INT32_MIN)):
                cut, ties, held = _kth_key(buf_s, buf_s, count, CAP, KK, False, BLOCK)
                _collect_row(buf_s, buf_s, buf_p, out, count, CAP, cut, ties, held <= KK, KK, False, True, BLOCK)
            else:
                _select_row(S_row, PAD_row, out, limit, M, KK, HAS_PAD, BLOCK)
        else:
            _select_row(S_row, PAD_row, out, limit, M, KK, HAS_PAD, BLOCK)


@triton.jit
def _select_row(S_row, PAD_row, out, limit, M, KK: tl.constexpr, HAS_PAD: tl.constexpr, BLOCK: tl.constexpr):
    """The radix select over the row's ``limit`` entries, its kk best positions into ``out``."""
    cut, ties, allowed = _kth_key(S_row, PAD_row, limit, M, KK, HAS_PAD, BLOCK)
    _collect_row(S_row, PAD_row, S_row, out, limit, M, cut, ties, allowed <= KK, KK, HAS_PAD, False, BLOCK)


@triton.jit
def _compact_row(S_row, PAD_row, buf_s, buf_p, limit, M, row_cut, CAP, HAS_PAD: tl.constexpr, BLOCK: tl.constexpr):
    """The row's allowed keys whose order-preserving key is at least ``row_cut``: their scores and
    positions into the buffers [CAP] in position order (the first CAP of them); returns how many
    there are, also past CAP."""
    count = tl.zeros([], tl.int32)
    for start in range(0, limit, BLOCK):
        pos, score, valid = _row_scores(S_row, PAD_row, start, limit, M, HAS_PAD, BLOCK)
        hit = valid & (_ordered_bits(score) >= row_cut)
        slot = count + tl.cumsum(hit.to(tl.int32), axis=0) - 1
        keep = hit & (slot < CAP)
        tl.store(buf_s + slot, score, mask=keep)
        tl.store(buf_p + slot, pos, mask=keep)
        count += tl.sum(hit.to(tl.int32))
    return count


@triton.jit
def _collect_row(
    S_row,
    PAD_row,
    P_row,
    out,
    limit,
    M,
    cut,
    ties_wanted,
    take_all,
    KK: tl.constexpr,
    HAS_PAD: tl.constexpr,
    MAPPED: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Write the keys scoring above ``cut`` and the first ``ties_wanted`` at it (every allowed key
    when ``take_all``) in position order; -1 in the slots left. MAPPED: entry i of the row is key
    P_row[i] (a buffer of kept keys in position order), else key i."""
    taken = tl.zeros([], tl.int32)
    ties = tl.zeros([], tl.int32)
    for start in range(0, limit, BLOCK):
        pos, ordered, valid = _row_keys(S_row, PAD_row, start, limit, M, HAS_PAD, BLOCK)
        tie = valid & (ordered == cut)
        tie_rank = ties + tl.cumsum(tie.to(tl.int32), axis=0) - 1
        take = valid & (take_all | (ordered > cut) | (tie & (tie_rank < ties_wanted)))
        slot = taken + tl.cumsum(take.to(tl.int32), axis=0) - 1
        if MAPPED:
            tl.store(out + slot, tl.load(P_row + pos, mask=take, other=0), mask=take)
        else:
            tl.store(out + slot, pos, mask=take)
        taken += tl.sum(take.to(tl.int32))
        ties += tl.sum(tie.to(tl.int32))
    for start in range(0, KK, BLOCK):
        slot = start + tl.arange(0, BLOCK)
        tl.store(out + slot, tl.full([BLOCK], -1, tl.int32), mask=(slot >= taken) & (slot < KK))


@triton.jit
def _sample_cut_kernel(
    S, PAD, T, row0, R, N, M, Q, STRIDE: tl.constexpr, CAUSAL: tl.constexpr, HAS_PAD: tl.constexpr, BLOCK: tl.constexpr
):  # fmt: skip
    """T[b, r]: the order-preserving key of the Q-th largest allowed score among row row0 + r's
    sampled keys (sample j is key j * STRIDE; S holds their scores), or INT32_MIN (keep every key)
    when the row has fewer than Q of them."""
    local, b = tl.program_id(0), tl.program_id(1)
    row = row0 + local
    if row < N:
        limit = tl.minimum(M, row // STRIDE + 1) if CAUSAL else M
        S_row = S + (b * R + local).to(tl.int64) * M
        cut, _, allowed = _kth_key(S_row, PAD + b.to(tl.int64) * M, limit, M, Q, HAS_PAD, BLOCK)
        tl.store(T + b * R + local, tl.where(allowed >= Q, cut, INT32_MIN))


@triton.jit
def _short_select_kernel(
    S,
    PAD,
    OUT,
    row0,
    R,
    N,
    M,
    KK: tl.constexpr,
    KP: tl.constexpr,
    CAUSAL: tl.constexpr,
    HAS_PAD: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """The kk best keys of BLOCK_R rows of one batch whose M <= BLOCK keys fit in registers: each
    score packed with its position (ties to the smaller position, as the radix select), kk rounds
    of row maxima, then each pick written at its rank by position. -1 past the allowed keys."""
    pid, b = tl.program_id(0), tl.program_id(1)
    local = pid * BLOCK_R + tl.arange(0, BLOCK_R)  # [BR] rows of the chunk
    row = row0 + local
    live = (local < R) & (row < N)
    pos = tl.arange(0, BLOCK)  # [BLOCK] keys
    limit = tl.minimum(M, row + 1) if CAUSAL else tl.zeros([BLOCK_R], tl.int32) + M
    valid = live[:, None] & (pos[None, :] < limit[:, None])  # [BR, BLOCK]
    if HAS_PAD:
        valid = valid & (tl.load(PAD + b.to(tl.int64) * M + pos, mask=pos < M, other=0) != 0)[None, :]
    ptrs = S + (b * R + local[:, None]).to(tl.int64) * M + pos[None, :]
    score = tl.load(ptrs, mask=live[:, None] & (pos[None, :] < M), other=0.0)
    score = tl.where(valid & (score != 0.0), score, 0.0)  # -0.0 ties with 0.0, as the radix select
    key = tl.where(valid, _pack(score, pos[None, :]), INT64_MIN)  # [BR, BLOCK] int64
    slots = tl.arange(0, KP)
    picked = tl.full([BLOCK_R, KP], INT32_MAX, tl.int32)  # [BR, KP] positions; INT32_MAX = none
    for r in tl.static_range(KK):
        best = tl.max(key, axis=1)  # [BR]
        position = INT32_MAX - (best & 0xFFFFFFFF).to(tl.int32)
        picked = tl.where((slots[None, :] == r) & (best != INT64_MIN)[:, None], position[:, None], picked)
        key = tl.where(key == best[:, None], INT64_MIN, key)  # positions are unique: one key per row
    _store_by_position(picked, slots, OUT + (b * N + row[:, None]).to(tl.int64) * KK, live, KK)


@triton.jit
def _store_by_position(picked, slots, out_rows, live, KK: tl.constexpr):
    """Store each row's picks [BR, KP] (INT32_MAX = none) in increasing position order at
    ``out_rows`` [BR, 1], -1 for the empty ones, which go last."""
    # rank by position (slot breaks the ties of the empty picks): [BR, KP, KP] -> [BR, KP]
    before = (picked[:, None, :] < picked[:, :, None]) | (
        (picked[:, None, :] == picked[:, :, None]) & (slots[None, None, :] < slots[None, :, None])
    )
    rank = tl.sum(before.to(tl.int32), axis=2)
    tl.store(out_rows + rank, tl.where(picked == INT32_MAX, -1, picked), mask=live[:, None] & (slots[None, :] < KK))


@triton.jit
def _fused_short_kernel(
    IQ, IK, W, PAD, OUT, N, M,
    H: tl.constexpr, D: tl.constexpr, KK: tl.constexpr, KP: tl.constexpr, CAUSAL: tl.constexpr, HAS_PAD: tl.constexpr,
    PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """The kk best keys of BLOCK_M rows of one batch in one sweep over their keys: each [BM, BN]
    tile of indexer scores (-inf where not allowed) merged into the rows' kept (score, position)
    entries [BM, KP] (padding slots +inf, never the worst); then written by position, -1 where a
    row has fewer than kk allowed keys. The same scores and tie rule as the two-launch path."""
    pid, b = tl.program_id(0), tl.program_id(1)
    rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM]
    row_ok = rows < N
    slots = tl.arange(0, KP)  # [KP]
    best_s = tl.where(slots[None, :] < KK, float("-inf"), float("inf")) + tl.zeros([BLOCK_M, KP], tl.float32)
    best_p = (INT32_MAX - slots[None, :]) + tl.zeros([BLOCK_M, KP], tl.int32)  # distinct: the worst is unique
    hi = tl.minimum(M, pid * BLOCK_M + BLOCK_M) if CAUSAL else M  # causal: no tile past the last row's key
    for start in range(0, hi, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)  # [BN]
        total = _score_tile(IQ, IK, W, b, rows, row_ok, cols, N, M, H, D, PRECISION, BLOCK_M, BLOCK_N, BLOCK_D)
        allowed = _allowed_keys(PAD, b, rows, row_ok, cols, M, CAUSAL, HAS_PAD)
        best_s, best_p = _merge_tile(best_s, best_p, tl.where(allowed, total, float("-inf")), cols)
    picked = tl.where((best_s > float("-inf")) & (slots[None, :] < KK), best_p, INT32_MAX)
    _store_by_position(picked, slots, OUT + (b * N + rows[:, None]).to(tl.int64) * KK, row_ok, KK)


def _tiles(iq: Tensor) -> dict:
    """Launch tiles; ``FUSED_M``, ``FUSED_N``, ``fused_warps``: the one-launch short path's (the
    TOPK short kernel's choice, not tuned for the indexer)."""
    if iq.is_cuda:
        tiles = dict(
            BLOCK_M=64, BLOCK_N=64, num_warps=4, SELECT_BLOCK=512, select_warps=4, FUSED_M=64, FUSED_N=128, fused_warps=4
        )
    else:  # interpreter: several tiles and select blocks at test sizes
        tiles = dict(BLOCK_M=16, BLOCK_N=16, num_warps=1, SELECT_BLOCK=64, select_warps=1, FUSED_M=16, FUSED_N=16, fused_warps=1)
    return tiles | TILE_OVERRIDES


def _takes_sampled_path(kk: int, n_keys: int, cap: int) -> bool:
    """Whether ``SAMPLED`` applies: many keys chosen from rows longer than the buffer, not short rows."""
    return SAMPLED and kk >= SAMPLED_MIN_K and n_keys > cap and not (n_keys <= SHORT_MAX_M and kk <= SHORT_MAX_K)


@torch.library.custom_op("sparsefocus::indexer_topk", mutates_args=())
def _indexer_topk_op(iq: Tensor, ik: Tensor, w: Tensor, kk: int, causal: bool, key_padding_mask: Optional[Tensor]) -> Tensor:
    """iq [B, h, N, d], ik [B, M, d], w [B, N, h] fp32 -> [B, N, kk] int32 (position order, -1 unused)."""
    batch, heads, n_queries, dim = iq.shape
    n_keys = ik.shape[1]
    out = torch.empty(batch, n_queries, kk, dtype=torch.int32, device=iq.device)
    if n_queries == 0:
        return out
    tiles = _tiles(iq)
    pad = key_padding_mask.to(torch.int8).contiguous() if key_padding_mask is not None else out
    iq, ik, w = iq.contiguous(), ik.contiguous(), w.contiguous()
    if FUSED_SHORT and n_keys <= SHORT_MAX_M and kk <= SHORT_MAX_K:
        _fused_short_kernel[(triton.cdiv(n_queries, tiles["FUSED_M"]), batch)](
            iq, ik, w, pad, out, n_queries, n_keys,
            H=heads, D=dim, KK=kk, KP=max(2, triton.next_power_of_2(kk)), CAUSAL=causal, HAS_PAD=key_padding_mask is not None,
            PRECISION="tf32x3", BLOCK_M=tiles["FUSED_M"], BLOCK_N=tiles["FUSED_N"], BLOCK_D=max(16, triton.next_power_of_2(dim)),
            num_warps=tiles["fused_warps"],
        )  # fmt: skip
        return out
    cap = int(SAMPLED_CAP_FACTOR * kk)
    sampled = _takes_sampled_path(kk, n_keys, cap)
    row_elements = n_keys + 2 * cap if sampled else n_keys  # a row's scores, and its buffers when sampled
    chunk = max(1, min(n_queries, CHUNK_ELEMENTS // max(1, batch * row_elements)))
    scores = torch.empty(batch, chunk, max(1, n_keys), dtype=torch.float32, device=iq.device)
    has_pad = key_padding_mask is not None
    sample = _Sample(iq, ik, pad, has_pad, kk, cap, chunk) if sampled else None
    for row0 in range(0, n_queries, chunk):
        rows = min(chunk, n_queries - row0)
        if sample is not None:
            sample.cut_rows(iq, w, row0, rows, causal, tiles)
        _scores(iq, ik, w, scores, row0, rows, causal, 1, tiles)
        _select(scores, pad, out, sample, row0, rows, kk, causal, has_pad, tiles)
    return out


def _scores(
    iq: Tensor, ik: Tensor, w: Tensor, scores: Tensor, row0: int, rows: int, causal: bool, key_stride: int, tiles: dict
) -> None:
    """Rows row0 .. row0 + rows of the [B, chunk, M] fp32 indexer scores; ik's key s is position
    s * key_stride."""
    batch, heads, n_queries, dim = iq.shape
    chunk, n_keys = scores.shape[1], ik.shape[1]
    grid = (triton.cdiv(rows, tiles["BLOCK_M"]), triton.cdiv(max(1, n_keys), tiles["BLOCK_N"]), batch)
    _scores_kernel[grid](
        iq, ik, w, scores, row0, chunk, n_queries, n_keys,
        H=heads, D=dim, CAUSAL=causal, PRECISION="tf32x3", KEY_STRIDE=key_stride,
        BLOCK_M=tiles["BLOCK_M"], BLOCK_N=tiles["BLOCK_N"], BLOCK_D=max(16, triton.next_power_of_2(dim)), num_warps=tiles["num_warps"],
    )  # fmt: skip


class _Sample:
    """The sampled path's buffers for one call (``SAMPLED``): the sampled keys and their padding;
    per row of the scores chunk, the sampled keys' scores, the cut [B, chunk] and the kept scores
    and positions [B, chunk, CAP]."""

    def __init__(self, iq: Tensor, ik: Tensor, pad: Tensor, has_pad: bool, kk: int, cap: int, chunk: int) -> None:
        batch, device = iq.shape[0], iq.device
        self.ik = ik[:, ::SAMPLE_STRIDE].contiguous()  # [B, ceil(M / stride), d]: key j * stride
        self.pad = pad[:, ::SAMPLE_STRIDE].contiguous() if has_pad else pad  # the sampled keys'
        self.has_pad, self.cap = has_pad, cap
        self.wanted = max(1, math.ceil(kk * SAMPLE_FACTOR / SAMPLE_STRIDE))
        self.scores = torch.empty(batch, chunk, self.ik.shape[1], dtype=torch.float32, device=device)
        self.cut = torch.empty(batch, chunk, dtype=torch.int32, device=device)
        self.kept_scores = torch.empty(batch, chunk, cap, dtype=torch.float32, device=device)
        self.kept_positions = torch.empty(batch, chunk, cap, dtype=torch.int32, device=device)

    def cut_rows(self, iq: Tensor, w: Tensor, row0: int, rows: int, causal: bool, tiles: dict) -> None:
        """Rows row0 .. row0 + rows: their sampled keys' scores, then each row's cut."""
        batch, n_queries = iq.shape[0], iq.shape[2]
        chunk, n_sampled = self.scores.shape[1], self.ik.shape[1]
        _scores(iq, self.ik, w, self.scores, row0, rows, causal, SAMPLE_STRIDE, tiles)
        _sample_cut_kernel[(rows, batch)](
            self.scores, self.pad, self.cut, row0, chunk, n_queries, n_sampled, self.wanted,
            STRIDE=SAMPLE_STRIDE, CAUSAL=causal, HAS_PAD=self.has_pad, BLOCK=tiles["SELECT_BLOCK"], num_warps=tiles["select_warps"],
        )  # fmt: skip


def _select(
    scores: Tensor,
    pad: Tensor,
    out: Tensor,
    sample: Optional[_Sample],
    row0: int,
    rows: int,
    kk: int,
    causal: bool,
    has_pad: bool,
    tiles: dict,
) -> None:
    """The kk best of each of ``rows`` score rows of the [B, chunk, M] fp32 chunk into ``out`` [B, N, kk]
    (through each row's buffer first when ``sample`` holds the rows' cuts)."""
    batch, chunk, n_keys = scores.shape
    n_queries = out.shape[1]
    if n_keys <= SHORT_MAX_M and kk <= SHORT_MAX_K:
        block = max(16, triton.next_power_of_2(n_keys))
        block_r = max(1, min(32, SHORT_TILE_KEYS // block))
        _short_select_kernel[(triton.cdiv(rows, block_r), batch)](
            scores, pad, out, row0, chunk, n_queries, n_keys,
            KK=kk, KP=max(2, triton.next_power_of_2(kk)), CAUSAL=causal, HAS_PAD=has_pad, BLOCK_R=block_r, BLOCK=block,
            num_warps=4 if scores.is_cuda else 1,
        )  # fmt: skip
        return
    cut, kept_scores, kept_positions, cap = (
        (sample.cut, sample.kept_scores, sample.kept_positions, sample.cap) if sample is not None else (out, scores, out, 1)
    )  # without a sample: placeholders never read
    _select_kernel[(rows, batch)](
        scores, pad, out, cut, kept_scores, kept_positions, row0, chunk, n_queries, n_keys, cap,
        KK=kk, CAUSAL=causal, HAS_PAD=has_pad, PRECUT=sample is not None, BLOCK=tiles["SELECT_BLOCK"],
        num_warps=tiles["select_warps"],
    )  # fmt: skip


@_indexer_topk_op.register_fake
def _indexer_topk_fake(iq: Tensor, ik: Tensor, w: Tensor, kk: int, causal: bool, key_padding_mask: Optional[Tensor]) -> Tensor:
    return iq.new_empty(iq.shape[0], iq.shape[2], kk, dtype=torch.int32)


def indexer_topk(
    iq: Tensor, ik: Tensor, w: Tensor, kk: int, *, causal: bool = False, key_padding_mask: Tensor | None = None
) -> Tensor:
    """The ``kk`` keys of largest lightning-indexer score per query, exactly, without N x M memory.

    Args:
        iq: [B, h, N, d] indexer queries; ik: [B, M, d] indexer keys; w: [B, N, h] head weights; fp32.
        kk: keys per query, >= 1.
        causal: query i only selects keys j <= i. Default: False.
        key_padding_mask: [B, M] bool, True = real key. Default: None.
    Returns:
        [B, N, kk] int32 positions in increasing order (the set of ``top_positions`` on the
        scores sum_h w_h ReLU(iq_h . ik): ties to the smaller position), -1 where a row has
        fewer than kk allowed keys. No gradient.
    """
    if kk < 1:
        raise ValueError(f"indexer_topk: kk must be >= 1, got {kk}")
    if iq.dim() != 4 or ik.dim() != 3 or w.shape != (iq.shape[0], iq.shape[2], iq.shape[1]) or ik.shape[-1] != iq.shape[-1]:
        raise ValueError(f"indexer_topk: incompatible iq {tuple(iq.shape)}, ik {tuple(ik.shape)} and w {tuple(w.shape)}")
    return torch.ops.sparsefocus.indexer_topk(
        iq.detach().float(), ik.detach().float(), w.detach().float(), kk, causal, key_padding_mask
    )

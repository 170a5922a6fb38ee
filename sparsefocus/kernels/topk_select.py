"""Exact top-k key selection in Triton without an N x M score tensor.

For each query row the kernels return the positions of its ``kk`` largest scores q.k among the
allowed keys (causal cut, key padding). Three launches; the first two sweep the keys of a tile of
BLOCK_M query rows with ``tl.dot`` score tiles, and only the tiles that touch the causal
diagonal, the end of the keys or a padding mask pay for masks:

1. bound (key tiles of BLOCK_N): column c of a tile holds the keys j = c (mod BLOCK_N); the
   kernel keeps the TOP (1 or 2) largest scores of each column class (1 or 3 min/max per score).
   A value t with at least kk of those TOP * BLOCK_N values >= t is a lower bound of the true
   kk-th largest score (they belong to distinct keys); 16 bisection steps on the count find
   one within 2^-16 of the range of the values. On random data about 1.15 kk keys score >= t.
2. collect (key tiles of 32): the keys scoring >= t become one 32-bit mask per row and tile
   (compare, select, a row sum); non-empty masks are appended to a per-row list of
   (word number, bits) with CAP = 2 * next_pow2(kk) entries. On CUDA the append is an inline
   PTX store in the reduction's own layout (``_store_where``).
3. finish (BLOCK_M rows, few registers, many programs in flight to hide gather latency): each
   row expands its masks into at most CAP key positions, recomputes those scores in fp32 from q
   and the gathered keys, and keeps the kk best by kk rounds of row maxima over packed
   (score, position) keys, best first. With ``order="position"`` it instead drops each row's
   worst keys until kk are left (as many rounds as the tile's largest surplus, a few on random
   data) and writes the rest in the order they were listed, ascending position.

4. exact (BLOCK_M rows; a tile without an overflowing row exits at once): a row with more than
   CAP keys at or above t (ties or crowding, e.g. constant inputs) gets its exact kk-th score T
   by bisection on the order-preserving int32 bits of its fp32 scores (one sweep of the keys
   per step, a row stops when exactly kk keys score >= mid, at most 33 sweeps), then one sweep
   keeps the keys above T and the first ties at T by position. No host synchronisation: the
   rows are found and redone on the device, so the selection is capturable in a CUDA graph.

Short rows (M <= ``SHORT_MAX_M`` keys, kk <= ``SHORT_MAX_K``) take one launch instead: a program
sweeps the keys once with [BLOCK_M, BLOCK_N] score tiles and keeps each row's kk best (score,
position) entries in registers; each tile is merged by rounds of row maxima that replace a row's
worst kept entry while they beat it, so after the first tiles a round is only paid while some
row of the tile still has a better key. The bound and collect sweeps above read every score
twice; they pay off where a row's candidates no longer fit a few rounds per tile.

``topk_select`` is the custom op ``sparsefocus::topk_select`` (fixed output shape, no gradient):
torch.compile treats it as one opaque call and never traces or recompiles the kernels.
Memory: O(N kk) scratch.

Ties: equal scores are ordered by smaller key position first, in every kernel and in
``topk_select_torch``. Exactness: the ranking uses the fp32 scores recomputed in step 3; t is lowered by a
relative 2^-16 so that the tensor-core scores of steps 1-2, summed in another order, cannot drop
one of the kk best keys (keys closer than rounding to the kk-th score are ties in any case).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.library import wrap_triton

from sparsefocus.kernels import interpreter_compat  # noqa: F401  (CPU interpreter fix)
from sparsefocus.kernels._ops import top_positions, triton_op_chosen

MAX_KERNEL_K = 128
SHORT_MAX_M = 1024
SHORT_MAX_K = 32
FALLBACK_ROW_CHUNK = 1024
BISECTION_STEPS = 16
INT32_MIN = tl.constexpr(-(2**31))
INT32_MAX = tl.constexpr(2**31 - 1)
INT64_MIN = tl.constexpr(-(2**63))
INT64_MAX = tl.constexpr(2**63 - 1)
TILE_OVERRIDES: dict = {}
"""Benchmark hook: {"bound" | "collect" | "finish": {BLOCK_M, BLOCK_N, num_warps, num_stages},
"short": {BLOCK_M, BLOCK_N, num_warps}} replacing the launcher's choice for that kernel."""


@triton.jit
def _score_tile(
    q,
    k_ptr,
    pad_ptr,
    rows,
    start,
    M,
    D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    MASKED: tl.constexpr,
    CAUSAL: tl.constexpr,
    HAS_PAD: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """Scores [BM, BN] of the query tile against keys start..start+BN, and the allowed mask.

    MASKED=False: every key of the tile is allowed for every row, so no mask arithmetic at all;
    MASKED=True: -inf where the key is past M, in the future (causal) or padded."""
    cols = start + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    if MASKED or BLOCK_D != D:
        k = tl.load(k_ptr + cols[:, None] * D + offs_d[None, :], mask=(cols[:, None] < M) & (offs_d[None, :] < D), other=0.0)
    else:
        k = tl.load(k_ptr + cols[:, None] * D + offs_d[None, :])  # [BN, BD]
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION)  # [BM, BN]
    if MASKED:
        allowed = _allowed_tile(cols, rows, M, pad_ptr, CAUSAL, HAS_PAD)
        s = tl.where(allowed, s, float("-inf"))
    else:
        allowed = cols[None, :] < M
    return s, allowed


@triton.jit
def _allowed_tile(cols, rows, M, pad_ptr, CAUSAL: tl.constexpr, HAS_PAD: tl.constexpr):
    """[BM, BN] True where key ``cols`` exists and may be chosen by query ``rows`` (causal, padding)."""
    allowed = cols[None, :] < M
    if CAUSAL:
        allowed = allowed & (cols[None, :] <= rows[:, None])
    if HAS_PAD:
        allowed = allowed & (tl.load(pad_ptr + cols, mask=cols < M, other=0) != 0)[None, :]
    return allowed


@triton.jit
def _row_pointers(K, PAD, N, M, HQ, GROUP, D: tl.constexpr, BLOCK_M: tl.constexpr):
    """The program's query rows: (rows, flat row numbers, key and padding pointers)."""
    pid_m, bh = tl.program_id(0), tl.program_id(1)
    kv_bh = (bh // HQ) * (HQ // GROUP) + (bh % HQ) // GROUP
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_offs = bh.to(tl.int64) * N + rows  # [BM] flat row number
    return rows, row_offs, K + kv_bh.to(tl.int64) * M * D, PAD + (bh // HQ).to(tl.int64) * M


@triton.jit
def _row_tile(Q, K, PAD, N, M, HQ, GROUP, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    """``_row_pointers`` and the rows' q [BM, BD]: (rows, flat row numbers, q, key and padding pointers)."""
    rows, row_offs, k_ptr, pad_ptr = _row_pointers(K, PAD, N, M, HQ, GROUP, D, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    q = tl.load(Q + row_offs[:, None] * D + offs_d[None, :], mask=(rows[:, None] < N) & (offs_d[None, :] < D), other=0.0)
    return rows, row_offs, q, k_ptr, pad_ptr


@triton.jit
def _key_range(M, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, HAS_PAD: tl.constexpr):
    """(end of the unmasked key tiles, end of all key tiles) for this program's rows."""
    pid_m = tl.program_id(0)
    hi = M
    unmasked_end = M  # keys below it are allowed for every row of the tile
    if CAUSAL:
        hi = tl.minimum(M, (pid_m + 1) * BLOCK_M)
        unmasked_end = tl.minimum(M, pid_m * BLOCK_M + 1)
    if HAS_PAD:
        unmasked_end = 0
    return (unmasked_end // BLOCK_N) * BLOCK_N, hi


@triton.jit
def _fold_top(best, second, s, TOP: tl.constexpr):
    """Fold a score tile into the per-column-class top-1 (TOP=1) or top-2 (TOP=2) running values."""
    if TOP == 2:
        second = tl.maximum(second, tl.minimum(best, s))
    return tl.maximum(best, s), second


@triton.jit
def _count_at_least(best, second, t, TOP: tl.constexpr):
    count = tl.sum((best >= t[:, None]).to(tl.int32), axis=1)
    if TOP == 2:
        count += tl.sum((second >= t[:, None]).to(tl.int32), axis=1)
    return count


@triton.jit
def _lower_bound(best, second, KK: tl.constexpr, TOP: tl.constexpr, STEPS: tl.constexpr):
    """A value t [BM] with at least KK of the class values >= t (-inf if fewer are finite).

    Bisection between the smallest finite value (KK or more are >= it) and the largest keeps
    that invariant, so t never exceeds the KK-th largest value; STEPS steps bring it within
    (max - min) / 2^STEPS of it, at 2 operations per value and step."""
    lo = tl.min(tl.where(best > float("-inf"), best, float("inf")), axis=1)
    if TOP == 2:
        lo = tl.minimum(lo, tl.min(tl.where(second > float("-inf"), second, float("inf")), axis=1))
    hi = tl.max(best, axis=1)
    for _ in tl.static_range(STEPS):
        mid = lo + (hi - lo) * 0.5
        enough = _count_at_least(best, second, mid, TOP) >= KK
        lo = tl.where(enough, mid, lo)
        hi = tl.where(enough, hi, mid)
    return tl.where(_count_at_least(best, second, lo, TOP) >= KK, lo, float("-inf"))


@triton.jit
def _bound_kernel(
    Q,
    K,
    PAD,
    BOUND,
    N,
    M,
    HQ,
    GROUP,
    D: tl.constexpr,
    KK: tl.constexpr,
    TOP: tl.constexpr,
    STEPS: tl.constexpr,
    CAUSAL: tl.constexpr,
    HAS_PAD: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    rows, row_offs, q, k_ptr, pad_ptr = _row_tile(Q, K, PAD, N, M, HQ, GROUP, D, BLOCK_M, BLOCK_D)
    unmasked_end, hi = _key_range(M, BLOCK_M, BLOCK_N, CAUSAL, HAS_PAD)
    best = tl.full([BLOCK_M, BLOCK_N], float("-inf"), tl.float32)
    second = tl.full([BLOCK_M, BLOCK_N], float("-inf"), tl.float32)
    for start in range(0, unmasked_end, BLOCK_N):
        s, _ = _score_tile(q, k_ptr, pad_ptr, rows, start, M, D, BLOCK_N, BLOCK_D, False, CAUSAL, HAS_PAD, PRECISION)
        best, second = _fold_top(best, second, s, TOP)
    for start in range(unmasked_end, hi, BLOCK_N):
        s, _ = _score_tile(q, k_ptr, pad_ptr, rows, start, M, D, BLOCK_N, BLOCK_D, True, CAUSAL, HAS_PAD, PRECISION)
        best, second = _fold_top(best, second, s, TOP)
    bound = _lower_bound(best, second, KK, TOP, STEPS)
    tl.store(BOUND + row_offs, bound - tl.abs(bound) * (1.0 / 65536), mask=rows < N)


@triton.jit
def _store_where(ptr, value, pred, ASM: tl.constexpr):
    """Store int64 ``value`` [BM] at ``ptr`` [BM] where ``pred``, in the operands' own layout.

    ASM=True (NVIDIA CUDA) stores through inline PTX: a ``tl.store`` of a row-reduced value makes the
    compiler move value, pointer and mask into a store layout through shared memory, with
    barriers, once per key tile. The quad of threads holding a row stores the same 8 bytes to
    the same address. ASM=False is ``tl.store`` (the interpreter cannot run PTX)."""
    if ASM:
        tl.inline_asm_elementwise(
            asm="{ .reg .pred p; setp.ne.b32 p, $3, 0; @p st.global.b64 [$1], $2; mov.u32 $0, 0; }",
            constraints="=r,l,l,r",
            args=[ptr, value, pred.to(tl.int32)],
            dtype=tl.int32,
            is_pure=False,
            pack=1,
        )
    else:
        tl.store(ptr, value, mask=pred)


@triton.jit
def _collect_tile(
    s,
    allowed,
    bound,
    start,
    nent,
    ent,
    row_ok,
    CAP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr,
    ASM: tl.constexpr,
):
    """Append the tile's 32-key hit mask to each row's list when it is not empty; returns the list
    lengths. An entry is (word number << 32) | bits.

    Tiles of 32 keys make the mask a plain row reduction of the score tile; wider tiles needed a
    reshape to [BM, words, 32], a layout round trip through shared memory per tile (on the H200,
    N=64K, kk=32: 104.8 ms for the selection with 32-key tiles against 107.6 with 64)."""
    tl.static_assert(BLOCK_N == 32)
    bits = (1 << tl.arange(0, BLOCK_N)).to(tl.int32)  # bit 31 wraps to the sign bit
    hit = s >= bound[:, None]
    if MASKED:
        hit = hit & allowed
    word = tl.sum(tl.where(hit, bits[None, :], 0), axis=1)  # [BM]: distinct bits, so the sum is their OR
    word_no = tl.full([BLOCK_M], start // 32, tl.int64)
    entry = (word_no << 32) | word.to(tl.uint32, bitcast=True).to(tl.int64)
    _store_where(ent + nent, entry, (word != 0) & (nent < CAP) & row_ok, ASM)
    return nent + (word != 0).to(tl.int32)


@triton.jit
def _collect_kernel(
    Q,
    K,
    PAD,
    BOUND,
    NENT,
    ENT,
    N,
    M,
    HQ,
    GROUP,
    D: tl.constexpr,
    CAP: tl.constexpr,
    CAUSAL: tl.constexpr,
    HAS_PAD: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    ASM: tl.constexpr,
):
    rows, row_offs, q, k_ptr, pad_ptr = _row_tile(Q, K, PAD, N, M, HQ, GROUP, D, BLOCK_M, BLOCK_D)
    unmasked_end, hi = _key_range(M, BLOCK_M, BLOCK_N, CAUSAL, HAS_PAD)
    row_ok = rows < N
    bound = tl.load(BOUND + row_offs, mask=row_ok, other=float("inf"))
    ent = ENT + row_offs * CAP
    nent = tl.zeros([BLOCK_M], tl.int32)
    for start in range(0, unmasked_end, BLOCK_N):
        s, allowed = _score_tile(q, k_ptr, pad_ptr, rows, start, M, D, BLOCK_N, BLOCK_D, False, CAUSAL, HAS_PAD, PRECISION)
        nent = _collect_tile(s, allowed, bound, start, nent, ent, row_ok, CAP, BLOCK_M, BLOCK_N, False, ASM)
    for start in range(unmasked_end, hi, BLOCK_N):
        s, allowed = _score_tile(q, k_ptr, pad_ptr, rows, start, M, D, BLOCK_N, BLOCK_D, True, CAUSAL, HAS_PAD, PRECISION)
        nent = _collect_tile(s, allowed, bound, start, nent, ent, row_ok, CAP, BLOCK_M, BLOCK_N, True, ASM)
    tl.store(NENT + row_offs, nent, mask=row_ok)


@triton.jit
def _popcount(words):
    """Number of set bits of each int32 entry (SWAR bit counting, as int32)."""
    x = words.to(tl.uint32, bitcast=True)
    x = x - ((x >> 1) & 0x55555555)
    x = (x & 0x33333333) + ((x >> 2) & 0x33333333)
    x = (x + (x >> 4)) & 0x0F0F0F0F
    return ((x * 0x01010101) >> 24).to(tl.int32)


@triton.jit
def _ordered_bits(score):
    """int32 keys of fp32 scores in the scores' order (a negative float's magnitude bits flipped)."""
    bits = score.to(tl.int32, bitcast=True)
    return tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)


@triton.jit
def _pack(score, index):
    """int64 keys ordered like (score, -index): high word order-preserving score bits."""
    return (_ordered_bits(score).to(tl.int64) << 32) + (0x7FFFFFFF - index).to(tl.int64)


@triton.jit
def _lowest_bit_position(low):
    """Bit number of int32 powers of two (the sign bit gives 31), read off the float exponent."""
    return ((low.to(tl.float32).to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127


@triton.jit
def _expand(q, k_ptr, ent, nent, rounds, D: tl.constexpr, CAP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    """Packed (fp32 score, position) keys [BM, CAP] of the listed hits, in list order; int64 min
    in unused slots. One hit per row and round: the lowest set bit of the current mask."""
    offs_d = tl.arange(0, BLOCK_D)
    q32 = q.to(tl.float32)
    slots = tl.arange(0, CAP)
    packed = tl.full([BLOCK_M, CAP], -9223372036854775807 - 1, tl.int64)
    entry = tl.zeros([BLOCK_M], tl.int32)
    word = tl.zeros([BLOCK_M], tl.int32)
    bits = tl.zeros([BLOCK_M], tl.int32)
    for slot in range(0, rounds):
        need = (bits == 0) & (entry < nent)
        listed = tl.load(ent + entry, mask=need, other=0)
        word = tl.where(need, (listed >> 32).to(tl.int32), word)
        bits = tl.where(need, listed.to(tl.int32), bits)
        entry += need.to(tl.int32)
        low = bits & (0 - bits)
        bits = bits ^ low
        key = word * 32 + _lowest_bit_position(low)
        found = low != 0
        k = tl.load(k_ptr + key[:, None] * D + offs_d[None, :], mask=found[:, None] & (offs_d[None, :] < D), other=0.0)
        score = tl.sum(q32 * k.to(tl.float32), axis=1)  # [BM]
        new = tl.where(found, _pack(score, key), -9223372036854775807 - 1)
        packed = tl.where(slots[None, :] == slot, new[:, None], packed)
    return packed


@triton.jit
def _finish_kernel(
    Q,
    K,
    PAD,
    NENT,
    ENT,
    OUT,
    COUNT,
    N,
    M,
    HQ,
    GROUP,
    D: tl.constexpr,
    KK: tl.constexpr,
    CAP: tl.constexpr,
    BY_POSITION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    rows, row_offs, q, k_ptr, _ = _row_tile(Q, K, PAD, N, M, HQ, GROUP, D, BLOCK_M, BLOCK_D)
    row_ok = rows < N
    ent = ENT + row_offs * CAP
    nent = tl.load(NENT + row_offs, mask=row_ok, other=0)
    slots = tl.arange(0, CAP)
    listed = tl.load(ent[:, None] + slots[None, :], mask=slots[None, :] < nent[:, None], other=0)  # [BM, CAP]
    count = tl.sum(_popcount(listed.to(tl.int32)), axis=1)
    count = tl.where(nent > CAP, CAP + 1, count)  # the list itself overflowed
    tl.store(COUNT + row_offs, count, mask=row_ok)
    packed = _expand(q, k_ptr, ent, tl.minimum(nent, CAP), tl.max(tl.minimum(count, CAP)), D, CAP, BLOCK_M, BLOCK_D)
    _store_best(packed, OUT, row_offs, row_ok, KK, CAP, BY_POSITION)


@triton.jit
def _store_best(packed, OUT, row_offs, store_ok, KK: tl.constexpr, C: tl.constexpr, BY_POSITION: tl.constexpr):
    """Store each row's KK largest packed keys [BM, C] (listed in ascending key position): best
    first, or (BY_POSITION) in position order; -1 where a row has fewer."""
    if BY_POSITION:
        _store_kept_in_order(packed, OUT, row_offs, store_ok, KK, C)
    else:
        _store_ranked(packed, OUT, row_offs, store_ok, KK)


@triton.jit
def _store_kept_in_order(packed, OUT, row_offs, store_ok, KK: tl.constexpr, C: tl.constexpr):
    """Drop each row's smallest packed keys [BM, C] until KK are left, then store the kept
    positions in slot order (the slots list keys by ascending position), -1 after them.

    Rounds: the most surplus keys of any row in the tile (about 0.15 KK on random data: the
    bound leaves few candidates beyond the KK best), against KK rounds of maxima to rank them."""
    valid = packed != INT64_MIN
    listed = tl.sum(valid.to(tl.int32), axis=1)  # [BM]
    kept = tl.minimum(listed, KK)[:, None]
    surplus = listed - KK
    while tl.max(surplus, axis=0) > 0:
        worst = tl.min(tl.where(valid, packed, INT64_MAX), axis=1)  # [BM]
        valid = valid & ~((packed == worst[:, None]) & (surplus > 0)[:, None])
        surplus -= 1
    rank = tl.cumsum(valid.to(tl.int32), axis=1) - 1  # [BM, C]
    position = 0x7FFFFFFF - (packed & 0xFFFFFFFF).to(tl.int32)
    out = OUT + row_offs[:, None] * KK
    tl.store(out + rank, position, mask=valid & store_ok[:, None])
    slots = tl.arange(0, C)[None, :]
    tl.store(out + slots, tl.full([1, C], -1, tl.int32), mask=(slots >= kept) & (slots < KK) & store_ok[:, None])


@triton.jit
def _store_ranked(packed, OUT, row_offs, store_ok, KK: tl.constexpr):
    """Store the positions of each row's KK largest packed keys [BM, C], best first; -1 where a
    row has fewer. KK rounds of row maxima (keys are distinct: they carry the position)."""
    for rank in tl.static_range(KK):
        top = tl.max(packed, axis=1)  # [BM]: the rank-th best key of each row
        packed = tl.where(packed == top[:, None], INT64_MIN, packed)
        chosen = tl.where(top == INT64_MIN, -1, 0x7FFFFFFF - (top & 0xFFFFFFFF).to(tl.int32))
        tl.store(OUT + row_offs * KK + rank, chosen, mask=store_ok)


@triton.jit
def _worst_kept(best_s, best_p):
    """Each row's worst kept entry [BM]: the smallest value, ties to the larger position."""
    worst = tl.min(best_s, axis=1)
    return worst, tl.max(tl.where(best_s == worst[:, None], best_p, -1), axis=1)


@triton.jit
def _merge_tile(best_s, best_p, s, cols):
    """Merge a score tile [BM, BN] (keys ``cols``, after every key already kept) into each row's
    kept entries [BM, KKP]: rounds of the tile's row maxima (ties to the smaller position), each
    replacing the row's worst entry while it beats it, until no row has a better score left.
    A round inserts at most one key per row, and a row stops after KK insertions per tile at the
    latest (the tile's maxima come out in descending order). A tile key equal to the worst kept
    score loses: every kept key has a smaller position (earlier tile, or earlier in this one)."""
    worst, worst_p = _worst_kept(best_s, best_p)
    top = tl.max(s, axis=1)
    while tl.max((top > worst).to(tl.int32), axis=0) > 0:
        position = tl.min(tl.where(s == top[:, None], cols[None, :], INT32_MAX), axis=1)
        slot = (best_s == worst[:, None]) & (best_p == worst_p[:, None]) & (top > worst)[:, None]
        best_s = tl.where(slot, top[:, None], best_s)
        best_p = tl.where(slot, position[:, None], best_p)
        s = tl.where(cols[None, :] == position[:, None], float("-inf"), s)
        worst, worst_p = _worst_kept(best_s, best_p)
        top = tl.max(s, axis=1)
    return best_s, best_p


@triton.jit
def _short_kernel(
    Q,
    K,
    PAD,
    OUT,
    N,
    M,
    HQ,
    GROUP,
    D: tl.constexpr,
    KK: tl.constexpr,
    KKP: tl.constexpr,
    BY_POSITION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    CAUSAL: tl.constexpr,
    HAS_PAD: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """Rows of few keys in one sweep: each row keeps its KK best (score, position) entries in
    registers ([BM, KKP], KKP = next_pow2(KK); the padding slots hold +inf and are never the
    worst) and merges every [BM, BN] score tile into them (``_merge_tile``); then KK rounds of
    row maxima write them best first (BY_POSITION: KK rounds of row minima of the kept positions
    write them in position order), -1 for slots a row could not fill. Only the tiles that
    touch the causal diagonal, the end of the keys or a padding mask pay for masks."""
    rows, row_offs, q, k_ptr, pad_ptr = _row_tile(Q, K, PAD, N, M, HQ, GROUP, D, BLOCK_M, BLOCK_D)
    unmasked_end, hi = _key_range(M, BLOCK_M, BLOCK_N, CAUSAL, HAS_PAD)
    slots = tl.arange(0, KKP)[None, :]  # [1, KKP]
    best_s = tl.where(slots < KK, float("-inf"), float("inf")) + tl.zeros([BLOCK_M, KKP], tl.float32)
    best_p = (INT32_MAX - slots) + tl.zeros([BLOCK_M, KKP], tl.int32)  # distinct: the worst is unique
    for start in range(0, unmasked_end, BLOCK_N):
        s, _ = _score_tile(q, k_ptr, pad_ptr, rows, start, M, D, BLOCK_N, BLOCK_D, False, CAUSAL, HAS_PAD, PRECISION)
        best_s, best_p = _merge_tile(best_s, best_p, s, start + tl.arange(0, BLOCK_N))
    for start in range(unmasked_end, hi, BLOCK_N):
        s, _ = _score_tile(q, k_ptr, pad_ptr, rows, start, M, D, BLOCK_N, BLOCK_D, True, CAUSAL, HAS_PAD, PRECISION)
        best_s, best_p = _merge_tile(best_s, best_p, s, start + tl.arange(0, BLOCK_N))
    best_s = tl.where(slots < KK, best_s, float("-inf"))
    row_ok = rows < N
    if BY_POSITION:  # KK rounds of the smallest kept position
        best_p = tl.where(best_s == float("-inf"), INT32_MAX, best_p)
        for rank in tl.static_range(KK):
            position = tl.min(best_p, axis=1)  # [BM]
            tl.store(OUT + row_offs * KK + rank, tl.where(position == INT32_MAX, -1, position), mask=row_ok)
            best_p = tl.where(best_p == position[:, None], INT32_MAX, best_p)
    else:
        for rank in tl.static_range(KK):
            top = tl.max(best_s, axis=1)  # [BM]
            position = tl.min(tl.where(best_s == top[:, None], best_p, INT32_MAX), axis=1)
            tl.store(OUT + row_offs * KK + rank, tl.where(top == float("-inf"), -1, position), mask=row_ok)
            best_s = tl.where(best_p == position[:, None], float("-inf"), best_s)


@triton.jit
def _ordered_tile(
    q,
    k_ptr,
    pad_ptr,
    rows,
    start,
    M,
    D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    CAUSAL: tl.constexpr,
    HAS_PAD: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """(fp32 scores [BM, BN], int32 keys ordered like them, INT32_MIN where the key is not allowed)."""
    s, allowed = _score_tile(q, k_ptr, pad_ptr, rows, start, M, D, BLOCK_N, BLOCK_D, True, CAUSAL, HAS_PAD, PRECISION)
    return s, tl.where(allowed, _ordered_bits(s), INT32_MIN)


@triton.jit
def _count_above(
    q,
    k_ptr,
    pad_ptr,
    rows,
    hi,
    M,
    cut,
    D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    CAUSAL: tl.constexpr,
    HAS_PAD: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """For cut [BM]: the number of allowed keys with ordered score >= cut, the smallest such score
    and the largest allowed score below cut (INT32_MAX / INT32_MIN where there is none)."""
    count = tl.zeros([q.shape[0]], tl.int32)
    at_or_above = tl.full([q.shape[0]], INT32_MAX, tl.int32)
    below = tl.full([q.shape[0]], INT32_MIN, tl.int32)
    for start in range(0, hi, BLOCK_N):
        _, ordered = _ordered_tile(q, k_ptr, pad_ptr, rows, start, M, D, BLOCK_N, BLOCK_D, CAUSAL, HAS_PAD, PRECISION)
        over = ordered >= cut[:, None]
        count += tl.sum(over.to(tl.int32), axis=1)
        at_or_above = tl.minimum(at_or_above, tl.min(tl.where(over, ordered, INT32_MAX), axis=1))
        below = tl.maximum(below, tl.max(tl.where(over, INT32_MIN, ordered), axis=1))
    return count, at_or_above, below


@triton.jit
def _kth_score(
    q,
    k_ptr,
    pad_ptr,
    rows,
    redo,
    hi,
    M,
    KK: tl.constexpr,
    D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    CAUSAL: tl.constexpr,
    HAS_PAD: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """[BM] ordered cut T of the rows in ``redo`` (each has more than KK allowed keys): the
    largest value with at least KK keys >= T, or a smaller value with exactly KK keys >= it (the
    same kept set). Bisection on [lo, top] keeping count(>= lo) >= KK > count(> top); each
    sweep also moves the ends onto the nearest scores at or above / below mid, so rows whose
    scores take few values (ties) converge in a few sweeps. At most 33 sweeps."""
    _, lo, _ = _count_above(
        q,
        k_ptr,
        pad_ptr,
        rows,
        hi,
        M,
        tl.full([q.shape[0]], INT32_MIN + 1, tl.int32),
        D,
        BLOCK_N,
        BLOCK_D,
        CAUSAL,
        HAS_PAD,
        PRECISION,
    )  # the smallest allowed score
    _, _, top = _count_above(
        q,
        k_ptr,
        pad_ptr,
        rows,
        hi,
        M,
        tl.full([q.shape[0]], INT32_MAX, tl.int32),
        D,
        BLOCK_N,
        BLOCK_D,
        CAUSAL,
        HAS_PAD,
        PRECISION,
    )  # the largest (below INT32_MAX: NaN bits only)
    lo = tl.where(redo, lo, 0)  # rows not redone start converged
    top = tl.where(redo, top, 0)
    while tl.max((lo < top).to(tl.int32), axis=0) > 0:
        mid = (lo.to(tl.int64) + ((top.to(tl.int64) - lo.to(tl.int64) + 1) >> 1)).to(tl.int32)  # lo < mid <= top
        count, at_or_above, below = _count_above(
            q, k_ptr, pad_ptr, rows, hi, M, mid, D, BLOCK_N, BLOCK_D, CAUSAL, HAS_PAD, PRECISION
        )
        active = lo < top
        new_lo = tl.where(active & (count >= KK), at_or_above, lo)
        top = tl.where(active, tl.where(count == KK, at_or_above, tl.where(count >= KK, top, below)), top)
        lo = new_lo
    return lo


@triton.jit
def _exact_kernel(
    Q,
    K,
    PAD,
    COUNT,
    ENT,
    OUT,
    N,
    M,
    HQ,
    GROUP,
    D: tl.constexpr,
    KK: tl.constexpr,
    CAP: tl.constexpr,
    BY_POSITION: tl.constexpr,
    CAUSAL: tl.constexpr,
    HAS_PAD: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Redo the rows whose candidate list overflowed (COUNT > CAP) exactly; others untouched."""
    rows, row_offs, q, k_ptr, pad_ptr = _row_tile(Q, K, PAD, N, M, HQ, GROUP, D, BLOCK_M, BLOCK_D)
    redo = (rows < N) & (tl.load(COUNT + row_offs, mask=rows < N, other=0) > CAP)
    if tl.max(redo.to(tl.int32), axis=0) > 0:
        _, hi = _key_range(M, BLOCK_M, BLOCK_N, CAUSAL, HAS_PAD)
        cut = _kth_score(q, k_ptr, pad_ptr, rows, redo, hi, M, KK, D, BLOCK_N, BLOCK_D, CAUSAL, HAS_PAD, PRECISION)
        above, _, _ = _count_above(
            q, k_ptr, pad_ptr, rows, hi, M, cut + 1, D, BLOCK_N, BLOCK_D, CAUSAL, HAS_PAD, PRECISION
        )  # > cut
        ent = ENT + row_offs * CAP
        ties = tl.zeros([BLOCK_M], tl.int32)
        taken = tl.zeros([BLOCK_M], tl.int32)
        for start in range(0, hi, BLOCK_N):  # keys above the cut, then ties at it by position: KK in all
            s, ordered = _ordered_tile(q, k_ptr, pad_ptr, rows, start, M, D, BLOCK_N, BLOCK_D, CAUSAL, HAS_PAD, PRECISION)
            tie = ordered == cut[:, None]
            tie_rank = ties[:, None] + tl.cumsum(tie.to(tl.int32), axis=1) - 1
            take = redo[:, None] & ((ordered > cut[:, None]) | (tie & (tie_rank < (KK - above)[:, None])))
            slot = taken[:, None] + tl.cumsum(take.to(tl.int32), axis=1) - 1
            cols = start + tl.arange(0, BLOCK_N)
            tl.store(ent[:, None] + slot, _pack(s, cols[None, :]), mask=take)
            ties += tl.sum(tie.to(tl.int32), axis=1)
            taken += tl.sum(take.to(tl.int32), axis=1)
        slots = tl.arange(0, CAP)
        packed = tl.load(ent[:, None] + slots[None, :], mask=redo[:, None] & (slots[None, :] < taken[:, None]), other=INT64_MIN)
        _store_best(packed, OUT, row_offs, redo, KK, CAP, BY_POSITION)


def _tiles(q: Tensor, kk_pow2: int) -> dict:
    """Per-kernel launch tiles; the bound's column classes are widened to give a tight bound."""
    if q.is_cuda:
        # the fastest of three tile choices per kernel on the H200 (N=16K, kk=32, causal; benchmarks/topk_probe.py);
        # collect: 64 rows with the PTX store (3.27 ms at N=16K against 3.40 with 128 rows)
        tiles = {
            "bound": dict(BLOCK_M=64, BLOCK_N=128, num_warps=4, num_stages=3),
            "collect": dict(BLOCK_M=64, BLOCK_N=32, num_warps=4, num_stages=3),
            "finish": dict(BLOCK_M=8, num_warps=2),
            "exact": dict(BLOCK_M=16, BLOCK_N=64, num_warps=4),
        }  # rare rows: not tuned
    else:  # interpreter: small tiles so that tiny test sizes still cross several tiles
        tiles = {
            "bound": dict(BLOCK_M=32, BLOCK_N=16),
            "collect": dict(BLOCK_M=32, BLOCK_N=32),
            "finish": dict(BLOCK_M=32),
            "exact": dict(BLOCK_M=32, BLOCK_N=64),
        }  # up to 33 sweeps per tile: few, wide tiles
    tiles = {name: tiles[name] | TILE_OVERRIDES.get(name, {}) for name in tiles}
    bound = tiles["bound"]
    bound["BLOCK_N"] = max(bound["BLOCK_N"], kk_pow2)
    bound["TOP"] = 1 if bound["BLOCK_N"] >= 4 * kk_pow2 else 2  # enough class values for a tight bound
    return tiles


def _launch(
    q: Tensor, k: Tensor, kk: int, causal: bool, key_padding_mask: Tensor | None, by_position: bool = False, kernels=None
):
    """Run the four kernels; returns out [B, Hq, N, kk] int32 (exact on every row; best first, or
    in position order) and the candidate counts [B, Hq, N] int32 (CAP + 1 or more: the row was
    redone by the exact kernel). ``kernels``: (bound, collect, finish, exact), ``wrap_triton`` of
    each in the ``triton_op`` twin; default: the kernels themselves."""
    bound_kernel, collect_kernel, finish_kernel, exact_kernel = kernels or (
        _bound_kernel,
        _collect_kernel,
        _finish_kernel,
        _exact_kernel,
    )
    batch, q_heads, n_queries, dim = q.shape
    rows = batch * q_heads * n_queries
    cap = 2 * triton.next_power_of_2(kk)

    def scratch(*shape: int, dtype: torch.dtype = torch.int32) -> Tensor:
        return torch.empty(*shape, dtype=dtype, device=q.device)

    def grid(kernel: str) -> tuple[int, int]:
        return triton.cdiv(n_queries, tiles[kernel]["BLOCK_M"]), batch * q_heads

    out, count = scratch(batch, q_heads, n_queries, kk), scratch(batch, q_heads, n_queries)
    bound, nent, ent = scratch(rows, dtype=torch.float32), scratch(rows), scratch(rows, cap, dtype=torch.int64)
    pad = key_padding_mask.to(torch.int8).contiguous() if key_padding_mask is not None else nent
    tiles = _tiles(q, cap // 2)
    sizes = (n_queries, k.shape[2], q_heads, q_heads // k.shape[1])
    common = dict(D=dim, BLOCK_D=max(16, triton.next_power_of_2(dim)))
    masks = dict(CAUSAL=causal, HAS_PAD=key_padding_mask is not None, PRECISION="ieee" if q.dtype == torch.float32 else "tf32")
    bound_kernel[grid("bound")](q, k, pad, bound, *sizes, KK=kk, STEPS=BISECTION_STEPS, **common, **masks, **tiles["bound"])
    collect_kernel[grid("collect")](
        q,
        k,
        pad,
        bound,
        nent,
        ent,
        *sizes,
        CAP=cap,
        ASM=q.is_cuda and torch.version.hip is None,
        **common,
        **masks,
        **tiles["collect"],
    )
    order = dict(KK=kk, CAP=cap, BY_POSITION=by_position)
    finish_kernel[grid("finish")](q, k, pad, nent, ent, out, count, *sizes, **order, **common, **tiles["finish"])
    exact_kernel[grid("exact")](q, k, pad, count, ent, out, *sizes, **order, **common, **masks, **tiles["exact"])
    return out, count


def _short_tiles(q: Tensor) -> dict:
    """Tiles of the short kernel: BLOCK_M rows, key tiles of BLOCK_N, warps.

    On the H200 (bf16, D=64; 27 tiles of 16-64 rows, 32-128 keys and 2-8 warps), 64 x 128 with
    4 warps was fastest or within 12% of the fastest at 250 and 5000 rows of 600 keys with kk=5
    (0.31 and 5.31 ms), causal rows of 600 (0.26) and rows of 1024 keys with kk=32 (0.75 causal,
    1.02 not). The interpreter takes 16 x 16 so that test sizes cross tiles."""
    if not q.is_cuda:
        return dict(BLOCK_M=16, BLOCK_N=16)
    return dict(BLOCK_M=64, BLOCK_N=128, num_warps=4)


def _launch_short(
    q: Tensor, k: Tensor, kk: int, causal: bool, key_padding_mask: Tensor | None, by_position: bool = False, kernel=None
) -> Tensor:
    """The one-sweep selection of rows of at most ``SHORT_MAX_M`` keys -> [B, Hq, N, kk] int32
    (``kernel``: ``wrap_triton`` of it in the ``triton_op`` twin; default: the kernel)."""
    batch, q_heads, n_queries, dim = q.shape
    out = torch.empty(batch, q_heads, n_queries, kk, dtype=torch.int32, device=q.device)
    pad = key_padding_mask.to(torch.int8).contiguous() if key_padding_mask is not None else out
    tiles = _short_tiles(q) | TILE_OVERRIDES.get("short", {})
    grid = (triton.cdiv(n_queries, tiles["BLOCK_M"]), batch * q_heads)
    (kernel or _short_kernel)[grid](
        q,
        k,
        pad,
        out,
        n_queries,
        k.shape[2],
        q_heads,
        q_heads // k.shape[1],
        D=dim,
        KK=kk,
        KKP=triton.next_power_of_2(kk),
        BY_POSITION=by_position,
        BLOCK_D=max(16, triton.next_power_of_2(dim)),
        CAUSAL=causal,
        HAS_PAD=key_padding_mask is not None,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        **tiles,
    )
    return out


def _select_rows(scores: Tensor, allowed: Tensor, kk: int) -> Tensor:
    """Top-kk positions [R, kk] int32 of fp32 scores [R, M] among ``allowed``, ties to smaller positions."""
    index = top_positions(scores, kk, allowed).to(torch.int32)
    return torch.nn.functional.pad(index, (0, kk - index.shape[-1]), value=-1)


def topk_select_torch(
    q: Tensor,
    k: Tensor,
    kk: int,
    *,
    causal: bool = False,
    key_padding_mask: Tensor | None = None,
    rows: Tensor | None = None,
    order: str = "score",
) -> Tensor:
    """Exact top-kk selection in PyTorch with the kernel's tie rule (smaller position first).

    q: [B, Hq, N, D]; k: [B, Hk, M, D]. ``rows`` optionally limits the work to the flat row
    numbers (b * Hq + h) * N + n listed. Returns [B, Hq, N, kk] int32 (-1 unused, last), or
    [R, kk] for the listed rows, in ``order``: "score" (best first, the default) or "position"
    (ascending). Memory O(chunk * M): one head and a chunk of rows at a time. Without ``rows``
    the loops run over shapes only (no host synchronisation); with them the listed rows are
    grouped by head on the host.
    """
    _check_order(order)
    if rows is not None:
        return _in_order(_select_listed_rows(q, k, kk, causal, key_padding_mask, rows), order)
    batch, q_heads, n_queries, _ = q.shape
    out = torch.full((batch, q_heads, n_queries, kk), -1, dtype=torch.int32, device=q.device)
    key_pos = torch.arange(k.shape[2], device=q.device)
    chunk = max(1, min(FALLBACK_ROW_CHUNK, 2**24 // max(1, k.shape[2])))
    for b in range(batch):
        for h in range(q_heads):
            keys = k[b, h // (q_heads // k.shape[1])].float()  # [M, D]
            for start in range(0, n_queries, chunk):
                n = torch.arange(start, min(start + chunk, n_queries), device=q.device)
                out[b, h, start : start + chunk] = _select_rows(
                    q[b, h, n].float() @ keys.T, _allowed(n, key_pos, b, causal, key_padding_mask), kk
                )
    return _in_order(out, order)


def _check_order(order: str) -> None:
    if order not in ("score", "position"):
        raise ValueError(f"topk_select: order must be 'score' or 'position', got {order!r}")


def _in_order(index: Tensor, order: str) -> Tensor:
    """Best-first positions [..., kk] (-1 last) in the requested order: as they are, or ascending."""
    if order == "score":
        return index
    unused = torch.iinfo(index.dtype).max
    ascending = torch.where(index < 0, unused, index).sort(-1).values
    return torch.where(ascending == unused, -1, ascending)


def _allowed(n: Tensor, key_pos: Tensor, b: int, causal: bool, key_padding_mask: Tensor | None) -> Tensor:
    """[R, M] bool: the keys query positions n [R] of batch b may select."""
    allowed = torch.ones(n.shape[0], key_pos.shape[0], dtype=torch.bool, device=n.device)
    if causal:
        allowed &= key_pos[None, :] <= n[:, None]
    if key_padding_mask is not None:
        allowed &= key_padding_mask[b][None, :]
    return allowed


def _select_listed_rows(q: Tensor, k: Tensor, kk: int, causal: bool, key_padding_mask: Tensor | None, rows: Tensor) -> Tensor:
    """``topk_select_torch`` for the flat rows listed in ``rows`` [R] -> [R, kk] int32."""
    batch, q_heads, n_queries, _ = q.shape
    out = torch.full((rows.numel(), kk), -1, dtype=torch.int32, device=q.device)
    head_of_row = rows // n_queries  # b * Hq + h
    key_pos = torch.arange(k.shape[2], device=q.device)
    chunk = max(1, min(FALLBACK_ROW_CHUNK, 2**24 // max(1, k.shape[2])))
    for head in torch.unique(head_of_row).tolist():
        b, h = divmod(head, q_heads)
        keys = k[b, h // (q_heads // k.shape[1])].float()  # [M, D]
        for part in torch.nonzero(head_of_row == head).flatten().split(chunk):
            n = rows[part] % n_queries
            out[part] = _select_rows(q[b, h, n].float() @ keys.T, _allowed(n, key_pos, b, causal, key_padding_mask), kk)
    return out


@torch.library.custom_op("sparsefocus::topk_select", mutates_args=())
def _topk_select_op(
    q: Tensor, k: Tensor, kk: int, causal: bool, key_padding_mask: Optional[Tensor], by_position: bool = False
) -> Tensor:
    """The selection as one opaque op: the four kernels, or the PyTorch selection above
    ``MAX_KERNEL_K`` and for empty inputs. q: [B, Hq, N, D]; k: [B, Hk, M, D] in q's dtype."""
    if kk > MAX_KERNEL_K or q.shape[2] == 0 or k.shape[2] == 0:
        order = "position" if by_position else "score"
        return topk_select_torch(q, k, kk, causal=causal, key_padding_mask=key_padding_mask, order=order)
    if k.shape[2] <= SHORT_MAX_M and kk <= SHORT_MAX_K:
        return _launch_short(q.contiguous(), k.contiguous(), kk, causal, key_padding_mask, by_position)
    return _launch(q.contiguous(), k.contiguous(), kk, causal, key_padding_mask, by_position)[0]


@_topk_select_op.register_fake
def _topk_select_fake(
    q: Tensor, k: Tensor, kk: int, causal: bool, key_padding_mask: Optional[Tensor], by_position: bool = False
) -> Tensor:
    return q.new_empty(q.shape[0], q.shape[1], q.shape[2], kk, dtype=torch.int32)


@torch.library.triton_op("sparsefocus::topk_select_traced", mutates_args=())
def _topk_select_traced(
    q: Tensor, k: Tensor, kk: int, causal: bool, key_padding_mask: Optional[Tensor], by_position: bool = False
) -> Tensor:
    """``sparsefocus::topk_select``'s ``triton_op`` twin (``_ops.TRITON_OPS``); the PyTorch selection
    (above ``MAX_KERNEL_K``, empty inputs) stays the op's."""
    if kk > MAX_KERNEL_K or q.shape[2] == 0 or k.shape[2] == 0:
        return _topk_select_op(q, k, kk, causal, key_padding_mask, by_position)
    q, k = q.contiguous(), k.contiguous()
    if k.shape[2] <= SHORT_MAX_M and kk <= SHORT_MAX_K:
        return _launch_short(q, k, kk, causal, key_padding_mask, by_position, wrap_triton(_short_kernel))
    kernels = (wrap_triton(_bound_kernel), wrap_triton(_collect_kernel), wrap_triton(_finish_kernel), wrap_triton(_exact_kernel))
    return _launch(q, k, kk, causal, key_padding_mask, by_position, kernels)[0]


def topk_select(
    q: Tensor,
    k: Tensor,
    kk: int,
    *,
    causal: bool = False,
    key_padding_mask: Tensor | None = None,
    scale: float | None = None,
    order: str = "score",
) -> Tensor:
    """Positions of each query's ``kk`` largest scores q.k among the allowed keys, without N x M memory.

    Args:
        q: [B, Hq, N, D]; k: [B, Hk, M, D] with Hq % Hk == 0 (query head h reads key head h // (Hq // Hk)).
        kk: keys per query, 1 <= kk; above 128 the chunked PyTorch selection is used.
        causal: query i only selects keys j <= i. Default: False.
        key_padding_mask: [B, M] bool, True = real key; padded keys are never selected. Default: None.
        scale: positive factor on the scores; it does not change the choice (the kernel ignores it). Default: 1.
        order: "score" (best first) or "position" (the same keys in ascending position, which
            spares the kernels the ranking: attention over the keys needs no order). Default: "score".
    Returns:
        [B, Hq, N, kk] int32 key positions in ``order`` (ties: smaller position first); -1 (last)
        where a row has fewer than kk allowed keys. No gradient. The op ``sparsefocus::topk_select``:
        no host synchronisation, fixed output shape (torch.compile and CUDA graphs take it whole).
    """
    if kk < 1:
        raise ValueError(f"topk_select: kk must be >= 1, got {kk}")
    if scale is not None and scale <= 0:
        raise ValueError(f"topk_select: scale must be positive, got {scale}")
    if q.shape[-1] != k.shape[-1] or q.shape[1] % k.shape[1] != 0:
        raise ValueError(f"topk_select: incompatible q {tuple(q.shape)} and k {tuple(k.shape)}")
    _check_order(order)
    op = _topk_select_traced if triton_op_chosen(q) else _topk_select_op
    return op(q.detach(), k.detach().to(q.dtype), kk, causal, key_padding_mask, order == "position")

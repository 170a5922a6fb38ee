"""ZETA's key selection: a sort and a search in torch, then one Triton kernel for the candidate
window, local band, exact squared distances and the k nearest, without [N, candidates] tensors
in memory.

The slow twin that defines the result is ``sparsefocus.attention.zeta.select_keys`` (torch sort,
searchsorted, gathers and topk over row blocks). Here:

* torch sorts the keys' Morton codes once per curve (stable, padded keys last), and for every
  causal prefix (the keys of chunks < m) keeps the sorted keys inside it by a cumulative count.
  The keys of a prefix in sorted order are the global order filtered, so one sort serves all
  prefixes.
* ``torch.searchsorted`` finds each query's place in its prefix (one thread per query).
* one program per (BLOCK_M queries, batch x query head) loads the ``window`` sorted positions
  around that place on each curve and the ``local`` most recent keys of its own chunk, computes exact squared distances in
  fp32 and keeps the ``width`` nearest. A candidate is packed as (distance bits << 32 | position)
  in an int64, so ties go to the smaller position and a key proposed by two curves is one value.
  With one curve every candidate is distinct (the window searches earlier chunks, the band the
  own chunk): the ``width`` nearest are found by a search on the distance bits for the cut
  (counting passes on int32, the first ones interpolating, then halving; a tile stops once
  every row has a cut with exactly ``width`` keys below it), and stored in candidate order. With several curves a key can be
  proposed twice, so they are taken by ``width`` rounds of "smallest value above the last
  one", nearest first, which also drops repeats. (A bitonic ``tl.topk`` on the packed values
  measured 4x slower than the rounds on the H200.)

The two kernels are the custom ops ``sparsefocus::zeta_prefix_filter`` and
``sparsefocus::zeta_select`` (fixed output shapes, no gradient): torch.compile keeps each as one
opaque call and never traces the kernels; neither synchronises with the host.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.library import wrap_triton

from sparsefocus.kernels import interpreter_compat  # noqa: F401  (CPU interpreter fix)
from sparsefocus.kernels._ops import triton_op_chosen

PACKED_NONE = tl.constexpr(0x7FFFFFFFFFFFFFFF)  # packed value of an empty candidate slot
SELECT_OVERRIDES: dict = {}  # tile and variant overrides for tuning runs (benchmarks/zeta_profile.py)


@triton.jit
def _nearest_rounds(packed, WIDTH: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_W: tl.constexpr):
    """[BM, BW] positions of the WIDTH smallest distinct packed values [BM, BC], nearest first:
    WIDTH rounds of "smallest value above the last one", which also drops repeats."""
    out_cols = tl.arange(0, BLOCK_W)
    out = tl.full([BLOCK_M, BLOCK_W], -1, tl.int32)
    last = tl.full([BLOCK_M], -1, tl.int64)
    for r in range(WIDTH):  # a loop, not unrolled: compile time stays short
        last = tl.min(tl.where(packed > last[:, None], packed, PACKED_NONE), axis=1)
        picked = tl.where(last == PACKED_NONE, -1, last.to(tl.int32))  # the low 32 bits: the position
        out = tl.where(out_cols[None, :] == r, picked[:, None], out)
    return out


@triton.jit
def _sum2(x, x_b, TWO: tl.constexpr):
    """[BM] row sums of int32 x [BM, BC] plus, when TWO, of x_b [BM, BB] (without TWO the second
    tile is a placeholder and costs no reduction)."""
    total = tl.sum(x, axis=1)
    if TWO:
        total += tl.sum(x_b, axis=1)
    return total


@triton.jit
def _threshold(
    values, valid, values_b, valid_b, want, top, STEPS, EXACT_STOP: tl.constexpr, TWO: tl.constexpr, GUESSES: tl.constexpr
):
    """[BM] a cut t: the valid entries <= t among values [BM, BC] and, when TWO, values_b
    [BM, BB] (int32 in [0, top]; two tiles, so that 64 window and 32 band candidates need not be
    padded to 128) are the ``want`` [BM] smallest, plus any that tie with the last of them; top
    when a row has fewer.

    Bisection with counting passes. Plain (EXACT_STOP off): STEPS >= log2(top + 1) passes from
    [0, top] to the smallest t with at least ``want`` entries <= t. EXACT_STOP: the interval
    starts at the row's smallest and largest valid entry, and a row stops at the first mid with
    exactly ``want`` entries <= mid (the same kept set: nothing lies between the answer and that
    mid); the tile stops when every row has. Random distances leave a gap between the k-th and
    the next one, which the bisection hits long before the interval shrinks to one value. The
    first GUESSES passes interpolate instead of halving: mid where the counts at lo and hi put
    the ``want``-th entry if the entries were spread evenly between them (a 4-row tile's slowest
    row needed 9.8 passes by halving, 7.3 with 8 guesses, on ZETA's candidates at 16K; CPU
    simulation); then plain halving, so at most GUESSES + 31 passes."""
    # invalid entries sit at top: every mid below top leaves them out, and mid = top only once
    # lo = hi = top, where the answer is top anyway; one select here saves an AND per pass
    masked = tl.where(valid, values, top)
    masked_b = tl.where(valid_b, values_b, top)
    if EXACT_STOP:
        n_valid = _sum2(valid.to(tl.int32), valid_b.to(tl.int32), TWO)
        short = n_valid < want  # keeps every valid entry: cut = top
        smallest = tl.min(masked, axis=1)
        largest = tl.max(tl.where(valid, values, 0), axis=1)
        if TWO:
            smallest = tl.minimum(smallest, tl.min(masked_b, axis=1))
            largest = tl.maximum(largest, tl.max(tl.where(valid_b, values_b, 0), axis=1))
        lo = tl.where(short, top, smallest)
        hi = tl.where(short, top, largest)
        below_lo = tl.zeros_like(lo)  # entries < lo, < want
        upto_hi = n_valid  # entries <= hi, >= want
        passes = 0
        while tl.max((lo < hi).to(tl.int32), axis=0) > 0:  # each pass shrinks hi - lo or closes it
            mid = lo + (hi - lo) // 2
            if passes < GUESSES:
                share = (want - below_lo).to(tl.float32) / tl.maximum(upto_hi - below_lo, 1).to(tl.float32)
                guess = lo + ((hi - lo).to(tl.float32) * share).to(tl.int32)
                mid = tl.where(lo < hi, tl.minimum(tl.maximum(guess, lo), hi - 1), lo)  # converged rows stay put
            count = _sum2((masked <= mid[:, None]).to(tl.int32), (masked_b <= mid[:, None]).to(tl.int32), TWO)
            hi = tl.where(count >= want, mid, hi)
            lo = tl.where(count == want, mid, tl.where(count >= want, lo, mid + 1))
            upto_hi = tl.where(count >= want, count, upto_hi)
            below_lo = tl.where(count < want, count, below_lo)
            passes += 1
        return hi
    else:
        lo = tl.zeros([values.shape[0]], tl.int32)
        hi = tl.zeros([values.shape[0]], tl.int32) + top
        for _ in range(STEPS):
            mid = lo + (hi - lo) // 2
            enough = _sum2((masked <= mid[:, None]).to(tl.int32), (masked_b <= mid[:, None]).to(tl.int32), TWO) >= want
            hi = tl.where(enough, mid, hi)
            lo = tl.where(enough, lo, mid + 1)
        return lo


@triton.jit
def _kept(bits, cand, valid, cut, last):
    """[BM, BC] the candidates strictly below the cut, and those at it up to position ``last``."""
    return valid & ((bits < cut[:, None]) | ((bits == cut[:, None]) & (cand <= last[:, None])))


@triton.jit
def _store_nearest_distinct(
    distance,
    cand,
    valid,
    distance_b,
    cand_b,
    valid_b,
    out_rows,
    row_ok,
    M,
    STEPS,
    WIDTH: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_W: tl.constexpr,
    EXACT_STOP: tl.constexpr,
    TWO: tl.constexpr,
    GUESSES: tl.constexpr,
):
    """Store the WIDTH nearest of distinct candidates (positions cand [BM, BC] and, when TWO,
    cand_b [BM, BB]; distances fp32 >= 0) at the row pointers out_rows [BM], in candidate order
    (the first tile's, then the second's), then -1s; ties at the cut go to the smaller positions.
    A cut on the distance bits (counting passes on int32, ``_threshold``) replaces WIDTH rounds
    of int64 minima."""
    bits, bits_b = distance.to(tl.int32, bitcast=True), distance_b.to(tl.int32, bitcast=True)  # monotone in a non-negative float
    cut = _threshold(bits, valid, bits_b, valid_b, WIDTH, 0x7FFFFFFF, 31, EXACT_STOP, TWO, GUESSES)
    below = _sum2((valid & (bits < cut[:, None])).to(tl.int32), (valid_b & (bits_b < cut[:, None])).to(tl.int32), TWO)
    tie, tie_b = valid & (bits == cut[:, None]), valid_b & (bits_b == cut[:, None])
    need = WIDTH - below
    last = tl.full([BLOCK_M], M, tl.int32)  # every tie kept ...
    if tl.max(_sum2(tie.to(tl.int32), tie_b.to(tl.int32), TWO) - need) > 0:  # ... unless more tie than fit: rare
        last = _threshold(cand, tie, cand_b, tie_b, need, M, STEPS, EXACT_STOP, TWO, 0)
    keep = _kept(bits, cand, valid, cut, last)
    kept = tl.sum(keep.to(tl.int32), axis=1)  # [BM] kept in the first tile
    slot = tl.cumsum(keep.to(tl.int32), axis=1) - 1  # [BM, BC] output slot of each kept candidate
    tl.store(out_rows[:, None] + slot, cand, mask=keep & row_ok[:, None])
    if TWO:
        keep_b = _kept(bits_b, cand_b, valid_b, cut, last)
        slot_b = kept[:, None] + tl.cumsum(keep_b.to(tl.int32), axis=1) - 1  # [BM, BB] after the first tile's
        tl.store(out_rows[:, None] + slot_b, cand_b, mask=keep_b & row_ok[:, None])
        kept += tl.sum(keep_b.to(tl.int32), axis=1)
    cols = tl.arange(0, BLOCK_W)
    unused = row_ok[:, None] & (cols[None, :] >= kept[:, None]) & (cols[None, :] < WIDTH)
    tl.store(out_rows[:, None] + cols[None, :], tl.full([BLOCK_M, BLOCK_W], -1, tl.int32), mask=unused)


@triton.jit
def _band(cand, cols, AT: tl.constexpr, LOCAL: tl.constexpr, rows, row_ok, chunk_start, REAL, b, M, PADDED: tl.constexpr):
    """cand [BM, BC] with columns AT .. AT + LOCAL - 1 set to the band: column AT + l holds
    position i - l when it lies in the own chunk and is a real key (every key without PADDED), else -1."""
    back = cols - AT  # band slot l: position i - l
    mine = (back >= 0) & (back < LOCAL)
    position = rows[:, None] - back[None, :]
    ok = mine[None, :] & row_ok[:, None] & (position >= chunk_start[:, None]) & (position < M)
    if PADDED:
        ok = ok & (tl.load(REAL + b.to(tl.int64) * M + position, mask=ok, other=0) != 0)
    return tl.where(mine[None, :], tl.where(ok, position, -1), cand)


@triton.jit
def _half_to_float(bits, BF16: tl.constexpr):
    """fp32 values of 16-bit floats given by their bits (int32 in [0, 2**16)): bf16 is the upper
    half of an fp32, so a shift decodes it exactly with integer operations alone."""
    if BF16:
        return (bits << 16).to(tl.float32, bitcast=True)
    return bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _key_component(word, d: tl.constexpr, BF16: tl.constexpr):
    """fp32 component d of keys packed by ``packed_keys`` (int64 words of any shape)."""
    return _half_to_float(((word >> (16 * d)) & 0xFFFF).to(tl.int32), BF16)


@triton.jit
def _distances(q_base, k_base, cand, row_ok, D: tl.constexpr, PACKED: tl.constexpr, BF16: tl.constexpr):
    """[BM, BC] fp32 squared distances of each row's query to its candidate keys (a key at 0
    where cand < 0: callers mask those entries). PACKED: k_base points at int64 words, one per
    key, holding its D <= 4 16-bit components from the low bits up (``packed_keys``): one
    8-byte load per candidate instead of D scattered 2-byte ones."""
    valid = cand >= 0
    distance = tl.zeros(cand.shape, tl.float32)
    if PACKED:
        word = tl.load(k_base + cand.to(tl.int64), mask=valid, other=0)  # [BM, BC] int64
    for d in tl.static_range(D):
        q_d = tl.load(q_base + d, mask=row_ok, other=0.0).to(tl.float32)
        if PACKED:
            k_d = _key_component(word, d, BF16)
        else:
            k_d = tl.load(k_base + cand.to(tl.int64) * D + d, mask=valid, other=0.0).to(tl.float32)
        diff = q_d[:, None] - k_d
        distance += diff * diff
    return distance


@triton.jit
def _zeta_select_kernel(
    Q,
    K,
    INSERT,
    SPOS,
    NVALID,
    REAL,
    OUT,
    N,
    M,
    B,
    HQ,
    HK,
    GROUP,
    CHUNK,
    STEPS,
    D: tl.constexpr,
    CURVES: tl.constexpr,
    WINDOW: tl.constexpr,
    LOCAL: tl.constexpr,
    WIDTH: tl.constexpr,
    CAUSAL: tl.constexpr,
    DISTINCT: tl.constexpr,
    EXACT_STOP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_W: tl.constexpr,
    SPLIT: tl.constexpr,
    BLOCK_B: tl.constexpr,
    GUESSES: tl.constexpr,
    PADDED: tl.constexpr,
    PACKED_KEYS: tl.constexpr,
    BF16: tl.constexpr,
):
    """SPLIT (distinct only): the window candidates in [BM, BLOCK_C] and the band in its own
    [BM, BLOCK_B] tile instead of both in one padded tile. PACKED_KEYS: K holds one int64 word
    per key (``packed_keys``); BF16 says how to decode its halves."""
    pid_m, bh = tl.program_id(0), tl.program_id(1)
    b, hq = bh // HQ, bh % HQ
    hk = hq // GROUP
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < N
    cols = tl.arange(0, BLOCK_C)
    if CAUSAL:
        chunk_start = (rows // CHUNK) * CHUNK
        prefix = rows // CHUNK - 1  # queries of chunk 0 search nothing
        span = CHUNK  # the queries of chunk p + 1 searched prefix p together
        at = rows - chunk_start
    else:
        chunk_start = rows * 0
        prefix = rows * 0
        span = N
        at = rows
    searching = row_ok & (prefix >= 0)
    prefix = tl.maximum(prefix, 0)
    count = tl.load(NVALID + prefix * B + b, mask=searching, other=0)  # [BM] searchable keys
    cand = tl.full([BLOCK_M, BLOCK_C], -1, tl.int32)
    for s in tl.static_range(CURVES):
        run = ((prefix * CURVES + s) * B + b) * HK + hk  # [BM] the sorted run each row searched
        insert = tl.load(INSERT + run.to(tl.int64) * (GROUP * span) + (hq % GROUP) * span + at, mask=searching, other=0)
        base = run.to(tl.int64) * M  # [BM]
        start = tl.minimum(tl.maximum(insert - WINDOW // 2, 0), tl.maximum(count - WINDOW, 0))
        slot = start[:, None] + cols[None, :] - s * WINDOW  # [BM, BC]
        mine = (cols[None, :] >= s * WINDOW) & (cols[None, :] < (s + 1) * WINDOW)
        ok = mine & searching[:, None] & (slot < count[:, None])
        found = tl.load(SPOS + base[:, None] + slot, mask=ok, other=-1)
        cand = tl.where(mine, found, cand)
    cand_b = tl.full([BLOCK_M, BLOCK_B], -1, tl.int32)  # the band's own tile (SPLIT), else unused
    if CAUSAL and LOCAL > 0:
        if SPLIT:
            cand_b = _band(cand_b, tl.arange(0, BLOCK_B), 0, LOCAL, rows, row_ok, chunk_start, REAL, b, M, PADDED)
        else:
            cand = _band(cand, cols, CURVES * WINDOW, LOCAL, rows, row_ok, chunk_start, REAL, b, M, PADDED)
    valid = cand >= 0
    k_base = K + (b * HK + hk).to(tl.int64) * M * (1 if PACKED_KEYS else D)
    q_base = Q + (bh.to(tl.int64) * N + rows) * D
    distance = _distances(q_base, k_base, cand, row_ok, D, PACKED_KEYS, BF16)
    out_rows = OUT + (bh.to(tl.int64) * N + rows) * WIDTH  # [BM] row pointers
    if DISTINCT:
        # a [BM, 1] placeholder without SPLIT: all masked
        distance_b = _distances(q_base, k_base, cand_b, row_ok, D, PACKED_KEYS, BF16)
        _store_nearest_distinct(
            distance,
            cand,
            valid,
            distance_b,
            cand_b,
            cand_b >= 0,
            out_rows,
            row_ok,
            M,
            STEPS,
            WIDTH,
            BLOCK_M,
            BLOCK_W,
            EXACT_STOP,
            SPLIT,
            GUESSES,
        )
    else:
        packed = (distance.to(tl.int32, bitcast=True).to(tl.int64) << 32) | cand.to(tl.int64)
        packed = tl.where(valid, packed, PACKED_NONE)
        out = _nearest_rounds(packed, WIDTH, BLOCK_M, BLOCK_W)
        out_cols = tl.arange(0, BLOCK_W)
        tl.store(out_rows[:, None] + out_cols[None, :], out, mask=row_ok[:, None] & (out_cols[None, :] < WIDTH))


@triton.jit
def _prefix_filter_kernel(
    SCODES, ORDER, OUT_CODES, OUT_POS, COUNT, M, ROWS, B, HK, step, sentinel, code_mask, BLOCK: tl.constexpr, TAGGED: tl.constexpr
):
    """One program per (prefix p, sorted row): keep the entries with position < min((p + 1) * step,
    M) and a real code, compacted in order (a running count carried over BLOCK-wide tiles), then
    fill the tail with sentinel / -1. TAGGED: the codes carry their row number above code_mask and
    ORDER holds flat indices (one flat sort), both taken off here."""
    pid = tl.program_id(0)
    p, row = pid // ROWS, pid % ROWS  # row = (curve * B + b) * HK + head
    limit = tl.minimum((p + 1) * step, M)
    src, dst = row.to(tl.int64) * M, pid.to(tl.int64) * M
    kept = 0
    for start in range(0, M, BLOCK):
        at = start + tl.arange(0, BLOCK)
        code = tl.load(SCODES + src + at, mask=at < M, other=sentinel)
        position = tl.load(ORDER + src + at, mask=at < M, other=M)
        if TAGGED:
            code, position = code & code_mask, position - src
        keep = (at < M) & (position < limit) & (code < sentinel)
        dest = kept + tl.cumsum(keep.to(tl.int32), axis=0) - 1
        tl.store(OUT_CODES + dst + dest, code, mask=keep)
        tl.store(OUT_POS + dst + dest, position.to(tl.int32), mask=keep)
        kept += tl.sum(keep.to(tl.int32), axis=0)
    for start in range((kept // BLOCK) * BLOCK, M, BLOCK):
        at = start + tl.arange(0, BLOCK)
        tail = (at >= kept) & (at < M)
        tl.store(OUT_CODES + dst + at, tl.full([BLOCK], sentinel, tl.int64), mask=tail)
        tl.store(OUT_POS + dst + at, tl.full([BLOCK], -1, tl.int32), mask=tail)
    if row < B * HK and row % HK == 0:  # curve 0, head 0: the count is the same for every curve and head
        tl.store(COUNT + p * B + row // HK, kept)


@triton.jit
def _sort_prefix_kernel(
    CODES,
    REAL,
    OUT_CODES,
    OUT_POS,
    COUNT,
    M,
    ROWS,
    B,
    HK,
    step,
    prefixes,
    sentinel,
    code_mask,
    BLOCK_M: tl.constexpr,
    POS_BITS: tl.constexpr,
    PADDED: tl.constexpr,
):
    """One program per row (curve, b, head) of at most BLOCK_M keys: sort the row's real keys by
    (code, position) packed into one int64 (code above POS_BITS position bits, padded keys as the
    int64 maximum, last), then for each prefix p keep the entries with position < min((p + 1) *
    step, M), compacted in order, and fill the tail with sentinel / -1: ``torch.sort`` (stable)
    and ``_prefix_filter_kernel`` in one launch, with their outputs. code_mask takes off the
    row tags of tagged codes."""
    row = tl.program_id(0)  # (curve * B + b) * HK + head
    b = (row // HK) % B
    at = tl.arange(0, BLOCK_M)
    in_row = at < M
    code = tl.load(CODES + row.to(tl.int64) * M + at, mask=in_row, other=0) & code_mask
    real = in_row
    if PADDED:
        real = real & (tl.load(REAL + b.to(tl.int64) * M + at, mask=in_row, other=0) != 0)
    last = 9223372036854775807  # int64 maximum: padded keys and the block's tail sort after every real key
    packed = tl.sort(tl.where(real, (code << POS_BITS) | at.to(tl.int64), last))  # [BM]
    listed = packed != last
    position = (packed & ((1 << POS_BITS) - 1)).to(tl.int32)
    code = packed >> POS_BITS
    for p in range(0, prefixes):
        keep = listed & (position < tl.minimum((p + 1) * step, M))
        dest = tl.cumsum(keep.to(tl.int32), axis=0) - 1
        kept = tl.sum(keep.to(tl.int32), axis=0)
        dst = (p * ROWS + row).to(tl.int64) * M
        tail = (at >= kept) & in_row
        tl.store(OUT_CODES + dst + dest, code, mask=keep)
        tl.store(OUT_POS + dst + dest, position, mask=keep)
        tl.store(OUT_CODES + dst + at, tl.full([BLOCK_M], sentinel, tl.int64), mask=tail)
        tl.store(OUT_POS + dst + at, tl.full([BLOCK_M], -1, tl.int32), mask=tail)
        if row < B * HK and row % HK == 0:  # curve 0, head 0: the count is the same for every curve and head
            tl.store(COUNT + p * B + row // HK, kept)


SORT_MAX_M = 4096
"""Rows of at most this many keys, whose codes leave room for the position bits below bit 62, are
sorted and filtered in one launch (``_sort_prefix_kernel``) instead of torch's sort (several
launches) and ``_prefix_filter_kernel``. 0: never."""
CODE_BITS_PACKED = 62  # packed (code, position) keys stay below 2**62, far from the int64 maximum of padded keys

PACKED_KEYS = True
"""Whether ZETA's selection reads 16-bit keys of at most 4 components as one packed 8-byte word
each (``packed_keys``; the same keys bit for bit) instead of one 2-byte load per component."""

FUSED_PREFIXES = True  # filter the prefixes in one Triton kernel: same outputs; H200, 64K fwd+bwd 31.7 -> 30.3 ms


def sorted_prefixes(
    codes_k: Tensor,
    real: Tensor | None,
    step: int,
    prefixes: int,
    sentinel: int,
    tag_shift: int | None = None,
    code_width: int | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Sorted codes and positions of the real keys below each limit min((p + 1) * step, M),
    p < ``prefixes``.

    Args:
        codes_k: [S, B, Hk, M] int64 codes per curve; real: [B, M] bool, or None when every key
        is real (no masking pass: each op costs the CPU tens of us to issue); step, prefixes: the
        P = ``prefixes`` key counts; sentinel: a code above every real code (given to padded
        keys and unused tail slots); tag_shift: the codes carry their row number (the flat index
        of (curve, b, head)) from this bit up (``morton_codes_triton``'s tag, only without
        padding): one flat stable sort then orders every row at once (H200, 64K: 0.56 against
        0.64 ms for the rows' sort, benchmarks/results/zeta_sort_probe.json). Default: untagged.
        code_width: every code (without its tag) is below 2**code_width; rows of at most
        ``SORT_MAX_M`` keys are then sorted and filtered in one launch where the positions fit
        below bit 62 beside the codes (``_sort_prefix_kernel``). Default: unknown (torch's sort).
    Returns:
        codes [P, S, B, Hk, M] int64 (sentinel after the valid ones), positions [P, S, B, Hk, M]
        int32 (-1 there) and the number of valid keys [P, B] int32. Stable: equal codes keep
        position order, as one stable sort of the prefix alone would.
    """
    if tag_shift is not None and real is not None:
        raise ValueError("sorted_prefixes: tagged codes need every key real (no padding mask)")
    if _sorts_in_kernel(codes_k.shape[-1], code_width):
        op = _sorted_prefixes_traced if triton_op_chosen(codes_k) else _sorted_prefixes_op
        return op(codes_k, real, step, prefixes, sentinel, code_width)
    if tag_shift is None:
        codes = codes_k if real is None else codes_k.masked_fill(~real[None, :, None, :], sentinel)
        sorted_codes, order = torch.sort(codes, dim=-1, stable=True)  # [S, B, Hk, M]
    else:  # each row's keys stay a contiguous block of the flat order, in the row's own order
        sorted_codes, order = (x.view(codes_k.shape) for x in torch.sort(codes_k.reshape(-1), stable=True))
    if FUSED_PREFIXES:
        return _filter_prefixes_fused(sorted_codes, order, step, prefixes, sentinel, tag_shift)
    if tag_shift is not None:
        rows = torch.arange(order[..., 0].numel(), device=order.device).view(*order.shape[:-1], 1)  # [S, B, Hk, 1]
        sorted_codes, order = sorted_codes & ((1 << tag_shift) - 1), order - rows * order.shape[-1]
    n_keys = codes_k.shape[-1]
    # built on the device: a host list copied in would synchronise the stream once per call
    limit = (
        (torch.arange(1, prefixes + 1, device=codes_k.device) * step).clamp_max(n_keys).view(-1, 1, 1, 1, 1)
    )  # [P, 1, 1, 1, 1]
    keep = (order[None] < limit) & (sorted_codes[None] < sentinel)  # [P, S, B, Hk, M]
    dest = torch.where(keep, keep.cumsum(-1) - 1, n_keys)  # [P, S, B, Hk, M]; M = dropped
    shape = (*keep.shape[:-1], n_keys + 1)
    out_codes = torch.full(shape, sentinel, dtype=torch.int64, device=codes_k.device)
    out_codes.scatter_(-1, dest, sorted_codes[None].expand_as(keep))
    out_pos = torch.full(shape, -1, dtype=torch.int32, device=codes_k.device)
    out_pos.scatter_(-1, dest, order[None].expand_as(keep).to(torch.int32))
    count = keep[:, 0, :, 0].sum(-1).to(torch.int32)  # [P, B]: the same for every curve and head
    return out_codes[..., :n_keys].contiguous(), out_pos[..., :n_keys].contiguous(), count.contiguous()


def _sort_block(n_keys: int) -> int:
    """``_sort_prefix_kernel``'s row block: a power of two, at least 16."""
    return max(16, triton.next_power_of_2(n_keys))


def _position_bits(n_keys: int) -> int:
    """Bits of a position in ``_sort_prefix_kernel``'s block for rows of ``n_keys`` keys."""
    return (_sort_block(n_keys) - 1).bit_length()


def _sorts_in_kernel(n_keys: int, code_width: int | None) -> bool:
    """Whether ``sorted_prefixes`` takes ``_sort_prefix_kernel``: fused filtering on, a short row,
    and room below bit 62 for the packed (code, position)."""
    return (
        FUSED_PREFIXES
        and code_width is not None
        and 0 < n_keys <= SORT_MAX_M
        and code_width + _position_bits(n_keys) <= CODE_BITS_PACKED
    )


@torch.library.custom_op("sparsefocus::zeta_sorted_prefixes", mutates_args=())
def _sorted_prefixes_op(
    codes_k: Tensor, real: Optional[Tensor], step: int, prefixes: int, sentinel: int, code_width: int
) -> tuple[Tensor, Tensor, Tensor]:
    """codes_k [S, B, Hk, M] int64 (tagged above ``code_width`` or not), real [B, M] bool or None
    -> ``sorted_prefixes``' outputs, by ``_sort_prefix_kernel`` (M <= SORT_MAX_M)."""
    return _sorted_prefixes(codes_k, real, step, prefixes, sentinel, code_width, _sort_prefix_kernel)


def _sorted_prefixes(codes_k, real, step, prefixes, sentinel, code_width, kernel) -> tuple[Tensor, Tensor, Tensor]:
    """Launch the sort-and-filter kernel (``wrap_triton`` of it in the ``triton_op`` twin)."""
    curves, batch, kv_heads, n_keys = codes_k.shape
    out_codes, out_pos, count = _prefix_filter_outputs(codes_k, prefixes)
    block = _sort_block(n_keys)
    kernel[(curves * batch * kv_heads,)](
        codes_k.contiguous(),
        codes_k if real is None else real.contiguous(),  # codes_k: a dummy pointer
        out_codes,
        out_pos,
        count,
        n_keys,
        curves * batch * kv_heads,
        batch,
        kv_heads,
        step,
        prefixes,
        sentinel,
        (1 << code_width) - 1,
        BLOCK_M=block,
        POS_BITS=_position_bits(n_keys),
        PADDED=real is not None,
        num_warps=8 if block >= 2048 else 4,
    )
    return out_codes, out_pos, count


@_sorted_prefixes_op.register_fake
def _sorted_prefixes_fake(codes_k, real, step, prefixes, sentinel, code_width):
    return _prefix_filter_outputs(codes_k, prefixes)


@torch.library.triton_op("sparsefocus::zeta_sorted_prefixes_traced", mutates_args=())
def _sorted_prefixes_traced(
    codes_k: Tensor, real: Optional[Tensor], step: int, prefixes: int, sentinel: int, code_width: int
) -> tuple[Tensor, Tensor, Tensor]:
    """``sparsefocus::zeta_sorted_prefixes``' ``triton_op`` twin (``_ops.TRITON_OPS``)."""
    return _sorted_prefixes(codes_k, real, step, prefixes, sentinel, code_width, wrap_triton(_sort_prefix_kernel))


def _filter_prefixes_fused(
    sorted_codes: Tensor, order: Tensor, step: int, prefixes: int, sentinel: int, tag_shift: int | None = None
) -> tuple[Tensor, Tensor, Tensor]:
    """``sorted_prefixes``' filtering step in ``_prefix_filter_kernel``: same outputs."""
    code_mask = (1 << (tag_shift or 0)) - 1
    op = _prefix_filter_traced if triton_op_chosen(sorted_codes) else _prefix_filter_op
    return op(sorted_codes, order, step, prefixes, sentinel, code_mask, tag_shift is not None)


@torch.library.custom_op("sparsefocus::zeta_prefix_filter", mutates_args=())
def _prefix_filter_op(
    sorted_codes: Tensor, order: Tensor, step: int, prefixes: int, sentinel: int, code_mask: int, tagged: bool
) -> tuple[Tensor, Tensor, Tensor]:
    """sorted_codes [S, B, Hk, M] int64, order [S, B, Hk, M] int64 -> codes [P, S, B, Hk, M] int64,
    positions [P, S, B, Hk, M] int32, counts [P, B] int32 (``sorted_prefixes``' outputs)."""
    return _prefix_filter(sorted_codes, order, step, prefixes, sentinel, code_mask, tagged, _prefix_filter_kernel)


def _prefix_filter(sorted_codes, order, step, prefixes, sentinel, code_mask, tagged, kernel) -> tuple[Tensor, Tensor, Tensor]:
    """Launch the filter kernel (``wrap_triton`` of it in the ``triton_op`` twin)."""
    curves, batch, kv_heads, n_keys = sorted_codes.shape
    rows = curves * batch * kv_heads
    out_codes, out_pos, count = _prefix_filter_outputs(sorted_codes, prefixes)
    kernel[(prefixes * rows,)](
        sorted_codes.contiguous(),
        order.contiguous(),
        out_codes,
        out_pos,
        count,
        n_keys,
        rows,
        batch,
        kv_heads,
        step,
        sentinel,
        code_mask,
        BLOCK=1024,
        TAGGED=tagged,
    )
    return out_codes, out_pos, count


@_prefix_filter_op.register_fake
def _prefix_filter_fake(sorted_codes, order, step, prefixes, sentinel, code_mask, tagged):
    return _prefix_filter_outputs(sorted_codes, prefixes)


@torch.library.triton_op("sparsefocus::zeta_prefix_filter_traced", mutates_args=())
def _prefix_filter_traced(
    sorted_codes: Tensor, order: Tensor, step: int, prefixes: int, sentinel: int, code_mask: int, tagged: bool
) -> tuple[Tensor, Tensor, Tensor]:
    """``sparsefocus::zeta_prefix_filter``'s ``triton_op`` twin (``_ops.TRITON_OPS``)."""
    kernel = wrap_triton(_prefix_filter_kernel)
    return _prefix_filter(sorted_codes, order, step, prefixes, sentinel, code_mask, tagged, kernel)


def _prefix_filter_outputs(sorted_codes: Tensor, prefixes: int) -> tuple[Tensor, Tensor, Tensor]:
    curves, batch, kv_heads, n_keys = sorted_codes.shape
    shape = (prefixes, curves, batch, kv_heads, n_keys)
    return (
        sorted_codes.new_empty(shape, dtype=torch.int64),
        sorted_codes.new_empty(shape, dtype=torch.int32),
        sorted_codes.new_empty((prefixes, batch), dtype=torch.int32),
    )


def key_prefixes(
    codes_k: Tensor,
    key_padding_mask: Tensor | None,
    n_queries: int,
    chunk: int | None,
    sentinel: int,
    tag_shift: int | None = None,
    code_width: int | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """The sorted keys every query may search: all real keys (``chunk`` None, not causal) or, per
    causal chunk boundary p * chunk, the real keys before it (``sorted_prefixes``).

    Args:
        codes_k: [S, B, Hk, M] int64 Morton codes per curve; key_padding_mask: [B, M] bool, True
        = real key, or None; n_queries: N; chunk: causal chunk length or None; sentinel: a code
        above every real code; tag_shift, code_width: as ``sorted_prefixes``' (rows tagged above
        bit tag_shift; codes below 2**code_width).
    Returns:
        ``sorted_prefixes``' (codes [P, S, B, Hk, M], positions [P, S, B, Hk, M], counts [P, B]).
    """
    n_keys = codes_k.shape[-1]
    if chunk is None:
        return sorted_prefixes(codes_k, key_padding_mask, n_keys, 1, sentinel, tag_shift, code_width)
    prefixes = max(1, math.ceil(n_queries / chunk) - 1)
    return sorted_prefixes(codes_k, key_padding_mask, chunk, prefixes, sentinel, tag_shift, code_width)


def _insertion_points(codes_q: Tensor, scodes: Tensor, chunk: int | None, kv_heads: int) -> Tensor:
    """How many keys of its sorted run code below each query's code, by ``torch.searchsorted``
    (one thread per query: inside the selection kernel the same binary search kept 4 of a warp's
    32 lanes busy, 0.96 of its 3.65 ms at 64K on the H200, benchmarks/zeta_select_probe.py).

    Args:
        codes_q: [S, B, Hq, N] int64; scodes: [P, S, B, Hk, M] int64 sorted runs (sentinels last);
        chunk: causal chunk length (the queries of chunk p + 1 search run p) or None (one run,
        searched by every query).
    Returns:
        [P, S, B, Hk, G * span] int32, span = chunk or N: run p's queries, query head hk * G + g
        at g * span + (position within its chunk); G = Hq // Hk.
    """
    curves, batch, q_heads, n_queries = codes_q.shape
    prefixes, group = scodes.shape[0], q_heads // kv_heads
    span = n_queries if chunk is None else chunk
    if chunk is not None and (prefixes + 1) * chunk != n_queries:  # the last chunk is short (or absent): pad, unused
        codes_q = torch.nn.functional.pad(codes_q, (0, (prefixes + 1) * chunk - n_queries))
    first = 0 if chunk is None else 1  # causal: chunk 0 searches nothing
    values = codes_q.view(curves, batch, kv_heads, group, prefixes + first, span)[:, :, :, :, first:]  # [S, B, Hk, G, P, span]
    values = values.permute(4, 0, 1, 2, 3, 5).reshape(prefixes, curves, batch, kv_heads, group * span).contiguous()
    return torch.searchsorted(scodes, values, out_int32=True)


def zeta_select(
    q: Tensor,
    k: Tensor,
    codes_q: Tensor,
    prefixes: tuple[Tensor, Tensor, Tensor],
    key_padding_mask: Tensor | None,
    *,
    width: int,
    window: int,
    local: int,
    chunk: int | None,
) -> Tensor:
    """The ``width`` nearest candidates of every query (ZETA's selection), fused.

    Args:
        q: [B, Hq, N, D]; k: [B, Hk, M, D] (distances are exact, in fp32, on these).
        codes_q: [S, B, Hq, N] int64 Morton codes per curve.
        prefixes: ``key_prefixes(codes_k, key_padding_mask, N, chunk, sentinel)`` of the keys'
            codes (a separate step so that callers can issue the sort first).
        key_padding_mask: [B, M] bool, True = real key, or None.
        width: keys kept per query; window: sorted neighbours per curve; local: recent keys of
        the own chunk (causal only); chunk: causal chunk length, or None for non-causal
        (one search over every real key).
    Returns:
        [B, Hq, N, width] int32 key positions, -1 for unused slots after them: in candidate
        order with one curve, nearest first with several. Ties at the cut go to the smaller
        positions.
    """
    scodes, spos, count = prefixes
    op = _zeta_select_traced if triton_op_chosen(q) else _zeta_select_op
    return op(q, k, codes_q, scodes, spos, count, key_padding_mask, width, window, local, chunk)


@torch.library.custom_op("sparsefocus::zeta_select", mutates_args=())
def _zeta_select_op(
    q: Tensor,
    k: Tensor,
    codes_q: Tensor,
    scodes: Tensor,
    spos: Tensor,
    count: Tensor,
    key_padding_mask: Optional[Tensor],
    width: int,
    window: int,
    local: int,
    chunk: Optional[int],
) -> Tensor:
    """``zeta_select`` as one op: the queries' search (``_insertion_points``, inside the op so that
    its layout is the one searchsorted wants under Inductor too) and the kernel. codes_q [S, B,
    Hq, N] int64; scodes [P, S, B, Hk, M] int64, spos [P, S, B, Hk, M] int32 and count [P, B]
    int32 from ``key_prefixes`` -> [B, Hq, N, width] int32."""
    return _select(q, k, codes_q, scodes, spos, count, key_padding_mask, width, window, local, chunk, _zeta_select_kernel)


def _select(q, k, codes_q, scodes, spos, count, key_padding_mask, width, window, local, chunk, kernel) -> Tensor:
    """The search and the selection kernel (``wrap_triton`` of it in the ``triton_op`` twin)."""
    curves, batch, q_heads, n_queries = codes_q.shape
    kv_heads, n_keys, dim = k.shape[1], k.shape[2], k.shape[3]
    insert = _insertion_points(codes_q.contiguous(), scodes.contiguous(), chunk, kv_heads)
    out = torch.empty(batch, q_heads, n_queries, width, dtype=torch.int32, device=q.device)
    band = local if chunk is not None else 0
    block_c = triton.next_power_of_2(curves * window + band)
    block_w = triton.next_power_of_2(width)
    distinct = SELECT_OVERRIDES.get("distinct", curves == 1)
    # the band in its own tile where that is narrower (64 + 32 columns instead of 128 at the
    # defaults): 25% less counting work, the same keys (tested; H200, 64K: whole forward+backward
    # 23.6-23.9 ms against 24.7 with the padded tile, benchmarks/results/zeta_candidates_ab.json);
    # SELECT_OVERRIDES["split"] = False restores the padded tile
    split = distinct and band > 0 and triton.next_power_of_2(curves * window) + triton.next_power_of_2(band) < block_c
    split = split and SELECT_OVERRIDES.get("split", True)
    block_c, block_b = (triton.next_power_of_2(curves * window), triton.next_power_of_2(band)) if split else (block_c, 1)
    # the distinct cut stops a tile once all its rows have converged: small tiles stop sooner
    # (H200, 64K: 4 rows and 1 warp 6.5 ms for the whole selection; 32 rows and 4 warps 9.4)
    block_m = SELECT_OVERRIDES.get("BLOCK_M", 4 if distinct else max(1, min(32, 4096 // block_c)))
    grid = (triton.cdiv(n_queries, block_m), batch * q_heads)
    packed = packable(k)
    kernel[grid](
        q.contiguous(),
        packed_keys(k) if packed else k.contiguous(),
        insert,
        spos.contiguous(),
        count.contiguous(),
        out if key_padding_mask is None else key_padding_mask.to(torch.int8).contiguous(),
        out,  # out: a dummy pointer without a mask
        n_queries,
        n_keys,
        batch,
        q_heads,
        kv_heads,
        q_heads // kv_heads,
        chunk or 1,
        max(1, n_keys.bit_length() + 1),
        D=dim,
        CURVES=curves,
        WINDOW=window,
        LOCAL=local,
        WIDTH=width,
        CAUSAL=chunk is not None,
        DISTINCT=distinct,
        EXACT_STOP=SELECT_OVERRIDES.get("exact_stop", True),
        BLOCK_M=block_m,
        BLOCK_C=block_c,
        BLOCK_W=block_w,
        SPLIT=split,
        BLOCK_B=block_b,
        GUESSES=SELECT_OVERRIDES.get("guesses", 8),
        PADDED=key_padding_mask is not None,
        PACKED_KEYS=packed,
        BF16=k.dtype == torch.bfloat16,
        num_warps=SELECT_OVERRIDES.get("num_warps", 1 if distinct else 4),
    )
    return out


def packable(k: Tensor) -> bool:
    """Whether the selection reads the keys [B, Hk, M, D] as packed words: 16-bit, D <= 4, and not
    switched off (``PACKED_KEYS``)."""
    return k.dtype in (torch.float16, torch.bfloat16) and k.shape[-1] <= 4 and PACKED_KEYS


def packed_keys(k: Tensor) -> Tensor:
    """[B, Hk, M, D] 16-bit keys, D <= 4 -> [B, Hk, M, 1] int64: each key's components in one
    aligned 8-byte word, zero-padded, first component in the low bits (little-endian bytes), so
    that the selection gathers each candidate key with one load instead of D 2-byte ones."""
    return torch.nn.functional.pad(k, (0, 4 - k.shape[-1])).contiguous().view(torch.int64)


@_zeta_select_op.register_fake
def _zeta_select_fake(q, k, codes_q, scodes, spos, count, key_padding_mask, width, window, local, chunk):
    return q.new_empty(q.shape[0], q.shape[1], q.shape[2], width, dtype=torch.int32)


@torch.library.triton_op("sparsefocus::zeta_select_traced", mutates_args=())
def _zeta_select_traced(
    q: Tensor,
    k: Tensor,
    codes_q: Tensor,
    scodes: Tensor,
    spos: Tensor,
    count: Tensor,
    key_padding_mask: Optional[Tensor],
    width: int,
    window: int,
    local: int,
    chunk: Optional[int],
) -> Tensor:
    """``sparsefocus::zeta_select``'s ``triton_op`` twin (``_ops.TRITON_OPS``)."""
    kernel = wrap_triton(_zeta_select_kernel)
    return _select(q, k, codes_q, scodes, spos, count, key_padding_mask, width, window, local, chunk, kernel)

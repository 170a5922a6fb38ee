import triton
import triton.language as tl
from sparsefocus.kernels.topk_select import _row_tile, _key_range, _score_tile


@triton.jit
def _store_if(ptr, value, pred):
    """st.global.b64 of ``value`` at ``ptr`` where ``pred`` != 0, in the operands' own layout (no conversion)."""
    return tl.inline_asm_elementwise(
        asm="{ .reg .pred p; setp.ne.b32 p, $3, 0; @p st.global.b64 [$1], $2; mov.u32 $0, 0; }",
        constraints="=r,l,l,r",
        args=[ptr, value, pred.to(tl.int32)],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )


@triton.jit
def _tile_a(s, allowed, bound, start, nent, ent, row_ok, CAP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr):
    bits = (1 << tl.arange(0, BLOCK_N)).to(tl.int32)
    hit = s >= bound[:, None]
    if MASKED:
        hit = hit & allowed
    word = tl.sum(tl.where(hit, bits[None, :], 0), axis=1)
    entry = ((start // 32).to(tl.int64) << 32) | word.to(tl.uint32, bitcast=True).to(tl.int64)
    entry = tl.where(word != 0, entry, 0)
    tl.store(ent + nent, entry, mask=(entry != 0) & (nent < CAP) & row_ok)
    return nent + (entry != 0).to(tl.int32)


@triton.jit
def _tile_b(s, allowed, bound, start, nent, ent, row_ok, CAP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr):
    bits = (1 << tl.arange(0, BLOCK_N)).to(tl.int32)
    hit = s >= bound[:, None]
    if MASKED:
        hit = hit & allowed
    word = tl.sum(tl.where(hit, bits[None, :], 0), axis=1)
    entry = ((start // 32).to(tl.int64) << 32) | word.to(tl.uint32, bitcast=True).to(tl.int64)
    _store_if(ent + nent, entry, (word != 0) & (nent < CAP) & row_ok)
    return nent + (word != 0).to(tl.int32)


@triton.jit
def _collect_v(Q, K, PAD, BOUND, NENT, ENT, N, M, HQ, GROUP, D: tl.constexpr, CAP: tl.constexpr, CAUSAL: tl.constexpr, HAS_PAD: tl.constexpr,
               PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, VARIANT: tl.constexpr):
    rows, row_offs, q, k_ptr, pad_ptr = _row_tile(Q, K, PAD, N, M, HQ, GROUP, D, BLOCK_M, BLOCK_D)
    unmasked_end, hi = _key_range(M, BLOCK_M, BLOCK_N, CAUSAL, HAS_PAD)
    row_ok = rows < N
    bound = tl.load(BOUND + row_offs, mask=row_ok, other=float("inf"))
    ent = ENT + row_offs * CAP
    nent = tl.zeros([BLOCK_M], tl.int32)
    for start in range(0, unmasked_end, BLOCK_N):
        s, allowed = _score_tile(q, k_ptr, pad_ptr, rows, start, M, D, BLOCK_N, BLOCK_D, False, CAUSAL, HAS_PAD, PRECISION)
        if VARIANT == 1:
            nent = _tile_a(s, allowed, bound, start, nent, ent, row_ok, CAP, BLOCK_M, BLOCK_N, False)
        else:
            nent = _tile_b(s, allowed, bound, start, nent, ent, row_ok, CAP, BLOCK_M, BLOCK_N, False)
    for start in range(unmasked_end, hi, BLOCK_N):
        s, allowed = _score_tile(q, k_ptr, pad_ptr, rows, start, M, D, BLOCK_N, BLOCK_D, True, CAUSAL, HAS_PAD, PRECISION)
        if VARIANT == 1:
            nent = _tile_a(s, allowed, bound, start, nent, ent, row_ok, CAP, BLOCK_M, BLOCK_N, True)
        else:
            nent = _tile_b(s, allowed, bound, start, nent, ent, row_ok, CAP, BLOCK_M, BLOCK_N, True)
    tl.store(NENT + row_offs, nent, mask=row_ok)


@triton.jit
def _collect_v3(Q, K, PAD, BOUND, NENT, ENT, N, M, HQ, GROUP, D: tl.constexpr, CAP: tl.constexpr, CAUSAL: tl.constexpr, HAS_PAD: tl.constexpr,
                PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, VARIANT: tl.constexpr):
    rows, row_offs, q, k_ptr, pad_ptr = _row_tile(Q, K, PAD, N, M, HQ, GROUP, D, BLOCK_M, BLOCK_D)
    unmasked_end, hi = _key_range(M, BLOCK_M, 2 * BLOCK_N, CAUSAL, HAS_PAD)
    row_ok = rows < N
    bound = tl.load(BOUND + row_offs, mask=row_ok, other=float("inf"))
    ent = ENT + row_offs * CAP
    nent = tl.zeros([BLOCK_M], tl.int32)
    for start in range(0, unmasked_end, 2 * BLOCK_N):
        s, allowed = _score_tile(q, k_ptr, pad_ptr, rows, start, M, D, BLOCK_N, BLOCK_D, False, CAUSAL, HAS_PAD, PRECISION)
        s2, allowed2 = _score_tile(q, k_ptr, pad_ptr, rows, start + BLOCK_N, M, D, BLOCK_N, BLOCK_D, False, CAUSAL, HAS_PAD, PRECISION)
        nent = _tile_b(s, allowed, bound, start, nent, ent, row_ok, CAP, BLOCK_M, BLOCK_N, False)
        nent = _tile_b(s2, allowed2, bound, start + BLOCK_N, nent, ent, row_ok, CAP, BLOCK_M, BLOCK_N, False)
    for start in range(unmasked_end, hi, BLOCK_N):
        s, allowed = _score_tile(q, k_ptr, pad_ptr, rows, start, M, D, BLOCK_N, BLOCK_D, True, CAUSAL, HAS_PAD, PRECISION)
        nent = _tile_b(s, allowed, bound, start, nent, ent, row_ok, CAP, BLOCK_M, BLOCK_N, True)
    tl.store(NENT + row_offs, nent, mask=row_ok)


@triton.jit
def _collect_v4(Q, K, PAD, BOUND, NENT, ENT, N, M, HQ, GROUP, D: tl.constexpr, CAP: tl.constexpr, CAUSAL: tl.constexpr, HAS_PAD: tl.constexpr,
                PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, VARIANT: tl.constexpr):
    """Software-pipelined: the next tile's product is issued before the current tile's compare."""
    rows, row_offs, q, k_ptr, pad_ptr = _row_tile(Q, K, PAD, N, M, HQ, GROUP, D, BLOCK_M, BLOCK_D)
    unmasked_end, hi = _key_range(M, BLOCK_M, BLOCK_N, CAUSAL, HAS_PAD)
    row_ok = rows < N
    bound = tl.load(BOUND + row_offs, mask=row_ok, other=float("inf"))
    ent = ENT + row_offs * CAP
    nent = tl.zeros([BLOCK_M], tl.int32)
    if unmasked_end > 0:
        s, allowed = _score_tile(q, k_ptr, pad_ptr, rows, 0, M, D, BLOCK_N, BLOCK_D, False, CAUSAL, HAS_PAD, PRECISION)
        for start in range(BLOCK_N, unmasked_end, BLOCK_N):
            s_next, allowed = _score_tile(q, k_ptr, pad_ptr, rows, start, M, D, BLOCK_N, BLOCK_D, False, CAUSAL, HAS_PAD, PRECISION)
            nent = _tile_b(s, allowed, bound, start - BLOCK_N, nent, ent, row_ok, CAP, BLOCK_M, BLOCK_N, False)
            s = s_next
        nent = _tile_b(s, allowed, bound, unmasked_end - BLOCK_N, nent, ent, row_ok, CAP, BLOCK_M, BLOCK_N, False)
    for start in range(unmasked_end, hi, BLOCK_N):
        s, allowed = _score_tile(q, k_ptr, pad_ptr, rows, start, M, D, BLOCK_N, BLOCK_D, True, CAUSAL, HAS_PAD, PRECISION)
        nent = _tile_b(s, allowed, bound, start, nent, ent, row_ok, CAP, BLOCK_M, BLOCK_N, True)
    tl.store(NENT + row_offs, nent, mask=row_ok)

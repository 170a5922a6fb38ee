"""Block-sparse attention in Triton: a tile of queries attends to a list of key blocks.

Keys are cut into blocks of ``block_size`` consecutive positions (block j holds keys
[j * block_size, (j + 1) * block_size)). Every query tile has a list of block ids; the tile's
rows attend, through ``tl.dot``, to the keys of those blocks only. Two kinds of tile:

* ``tile = T > 0``: T consecutive queries of one query head (T a power of 2, >= 16);
  the lists are ``blocks [B, Hq, ceil(N / T), S]``.
* ``tile = GROUP_TILE`` (0): the G = Hq / Hk query heads of one kv head at one position, as NSA
  shares a selection across a GQA group; the lists are ``blocks [B, Hk, N, S]`` and the tile is
  padded to 16 rows when G < 16.

With ``tile`` 16 or 32, optional ``row_bits`` (int32, shaped like ``blocks``) mask the list per
row: bit r of entry [.., t, s] set = row t * tile + r keeps block blocks[.., t, s]; the list is the
union of the rows' blocks (NSA's per-position selection on query tiles).

Inside the kept blocks the usual masks still apply per (query, key): causal (key position <=
query position), a sliding window (key position > query position - window), key padding. The
position of key j is ``j * key_stride + key_offset`` (1 and 0 for ordinary keys; NSA's
compressed keys sit at the last position they summarise). Entries of one list must be distinct;
-1 marks an unused slot.

* forward: one program per tile, reading its list up to the last used slot (a query-tile union
  of NSA's selection is mostly -1 tail); online softmax in fp32 over the listed blocks; returns the
  output and the log-sum-exp (natural log, -inf for a row with no key).
* backward: dq by the same tiles (recomputing p from the LSE); dk and dv key-block-major: the
  (block, tile) pairs are sorted by block on device (fixed capacity, no host sync), each block's
  list is cut into items of at most ``ENTRY_ROWS`` query rows; a block of one item stores its dk,
  dv itself, and the items of a busier block write partial sums that a reduction program per
  block adds in a fixed order (deterministic, no atomics).

The slow twin is ``block_sparse_attention_ref`` (dense masked attention in fp32).
"""

from typing import (
    Optional,  # not `X | None`: torch.library reads the op schemas from these annotations
)

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor

from sparsefocus.kernels import interpreter_compat  # noqa: F401  (CPU interpreter fix)
from sparsefocus.kernels.row_delta import row_delta

GROUP_TILE = 0
LOG2E = 1.4426950408889634
ENTRY_ROWS = 8192
LIST_END_SLOTS = 1024  # slots of a list a kernel reads at once to find its last used one
IMPORTANCE_ROWS = 64
"""Query rows of an NSA importance tile on CUDA when a kv group has fewer than 16 query heads:
64 / G consecutive positions of the group's heads (one head: 64 positions), where one position a
tile (as for wider groups) left 15 of the 16 tensor-core rows empty; 150,000 one-position tiles
of the laboratory's one-head model took 0.5 ms a call on the H200."""


def block_sparse_attention_ref(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    blocks: Tensor,
    *,
    block_size: int,
    tile: int = GROUP_TILE,
    causal: bool = False,
    scale: Optional[float] = None,
    key_padding_mask: Optional[Tensor] = None,
    window: int = 0,
    key_stride: int = 1,
    key_offset: int = 0,
    row_bits: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor]:
    """Dense fp32 definition of ``block_sparse_attention`` (same arguments); returns (out, lse) fp32."""
    mask = block_sparse_mask(q, k, blocks, block_size, tile, causal, key_padding_mask, window, key_stride, key_offset, row_bits)
    group = q.shape[1] // k.shape[1]
    kf, vf = (x.double() if q.dtype == torch.float64 else x.float() for x in (k, v))
    qf = q.double() if q.dtype == torch.float64 else q.float()
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = torch.matmul(qf, kf.repeat_interleave(group, 1).transpose(-1, -2)) * scale  # [B, Hq, N, M]
    scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [B, Hq, N]
    has_key = mask.any(-1, keepdim=True)
    weights = torch.softmax(scores.masked_fill(~has_key, 0.0), dim=-1) * has_key
    return torch.matmul(weights, vf.repeat_interleave(group, 1)), lse


def block_sparse_mask(
    q: Tensor,
    k: Tensor,
    blocks: Tensor,
    block_size: int,
    tile: int,
    causal: bool,
    key_padding_mask: Optional[Tensor],
    window: int,
    key_stride: int,
    key_offset: int,
    row_bits: Optional[Tensor] = None,
) -> Tensor:
    """[B, Hq, N, M] bool: the (query, key) pairs ``block_sparse_attention`` keeps."""
    q_heads, n_queries = q.shape[1], q.shape[2]
    n_keys = k.shape[2]
    n_blocks = -(-n_keys // block_size)
    slot = torch.where(blocks >= 0, blocks.long(), torch.full_like(blocks.long(), n_blocks))
    if row_bits is not None:  # tile mode, per row: block of slot s kept where bit r of row_bits is set
        rows = ((row_bits.long()[..., None] >> torch.arange(tile, device=q.device)) & 1).float()  # [B, Hq, T, S, tile]
        chosen = F.one_hot(slot, n_blocks + 1).float()  # [B, Hq, T, S, nb + 1]; float: CUDA has no integer einsum
        kept = torch.einsum("bhtsr,bhtsj->bhtrj", rows, chosen) > 0  # [B, Hq, T, tile, nb + 1]
        kept = kept.flatten(2, 3)[:, :, :n_queries, :n_blocks]  # [B, Hq, N, nb]
    else:
        kept = torch.zeros(*blocks.shape[:-1], n_blocks + 1, dtype=torch.bool, device=q.device)
        kept = kept.scatter(-1, slot, True)[..., :n_blocks]  # [B, Hsel, T, nb]
        if tile == GROUP_TILE:
            kept = kept.repeat_interleave(q_heads // k.shape[1], dim=1)  # [B, Hq, N, nb]
        else:
            kept = kept.repeat_interleave(tile, dim=2)[:, :, :n_queries]  # [B, Hq, N, nb]
    key_pos = torch.arange(n_keys, device=q.device)
    mask = kept[..., key_pos // block_size]  # [B, Hq, N, M]
    query_pos = torch.arange(n_queries, device=q.device)[:, None]
    key_pos = key_pos * key_stride + key_offset
    if causal:
        mask = mask & (key_pos[None, :] <= query_pos)
    if window > 0:
        mask = mask & (key_pos[None, :] > query_pos - window)
        if not causal:
            mask = mask & (key_pos[None, :] < query_pos + window)
    if key_padding_mask is not None:
        mask = mask & key_padding_mask[:, None, None, :]
    return mask


@triton.jit
def _slot_rows(bits_ptr, row_ok, BLOCK_M: tl.constexpr, HAS_BITS: tl.constexpr):
    """[BM] bool: the rows of a query tile that keep a listed block (bit r of its int32 row
    mask, or every valid row without masks)."""
    if HAS_BITS:
        bits = tl.load(bits_ptr)
        keep = row_ok & (((bits >> tl.arange(0, BLOCK_M)) & 1) != 0)
    else:
        keep = row_ok
    return keep


@triton.jit
def _tile_rows(t, h, N, G, BLOCK_M: tl.constexpr, GROUP: tl.constexpr):
    """Query head [BM], position [BM] and validity [BM] of the rows of tile t of list head h."""
    r = tl.arange(0, BLOCK_M)
    if GROUP:
        head = h * G + r
        pos = t + r * 0
        ok = r < G
    else:
        head = h + r * 0
        pos = t * BLOCK_M + r
        ok = pos < N
    return head, pos, ok


@triton.jit
def _score_mask(
    kidx,
    kin,
    pos,
    b,
    REAL,
    M,
    key_stride,
    key_offset,
    window,
    CAUSAL: tl.constexpr,
    HAS_REAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
):
    """[BM, BN] bool: which (row, key) pairs of a loaded key tile count."""
    ok = kin & (kidx < M)  # [BN]
    if HAS_REAL:
        ok = ok & (tl.load(REAL + b * M + kidx, mask=ok, other=0) != 0)
    kpos = kidx * key_stride + key_offset
    mask = ok[None, :] & (pos[:, None] >= 0)
    if CAUSAL:
        mask = mask & (kpos[None, :] <= pos[:, None])
    if HAS_WINDOW:
        mask = mask & (kpos[None, :] > pos[:, None] - window)
        if not CAUSAL:
            mask = mask & (kpos[None, :] < pos[:, None] + window)
    return mask


@triton.jit
def _list_end(list_ptr, S, BLOCK_S: tl.constexpr):
    """One past the last used slot of a list of S block ids (0 for an empty list), so a kernel
    stops there instead of reading a tail of -1 slots (query-tile unions are mostly tail)."""
    end = 0
    for s0 in range(0, S, BLOCK_S):  # BLOCK_S slots at a time (one pass for most lists)
        slot = s0 + tl.arange(0, BLOCK_S)
        ids = tl.load(list_ptr + slot, mask=slot < S, other=-1)
        end = tl.maximum(end, tl.max(tl.where(ids >= 0, slot + 1, 0), 0))
    return end


@triton.jit
def _fwd_kernel(
    Q,
    K,
    V,
    BLOCKS,
    BITS,
    REAL,
    OUT,
    LSE,
    sqb,
    sqh,
    sqn,
    skb,
    skh,
    skn,
    svb,
    svh,
    svn,
    sob,
    soh,
    son,
    H_SEL,
    HQ,
    N,
    M,
    S,
    G,
    T,
    scale,
    window,
    key_stride,
    key_offset,
    block_size,
    GROUP: tl.constexpr,
    CAUSAL: tl.constexpr,
    HAS_REAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_BITS: tl.constexpr,
    D: tl.constexpr,
    DV: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    N_SUB: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    t, bh = tl.program_id(0), tl.program_id(1)
    b, h = bh // H_SEL, bh % H_SEL
    kv = h if GROUP else h // G
    head, pos, row_ok = _tile_rows(t, h, N, G, BLOCK_M, GROUP)
    offs_d, offs_dv, offs_n = tl.arange(0, BLOCK_D), tl.arange(0, BLOCK_DV), tl.arange(0, BLOCK_N)
    q_rows = Q + b * sqb + head * sqh + pos * sqn  # [BM] row pointers
    q = tl.load(q_rows[:, None] + offs_d[None, :], mask=row_ok[:, None] & (offs_d[None, :] < D), other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    qk_scale = scale * 1.4426950408889634
    list_ptr = BLOCKS + (bh * T + t) * S
    for s in range(_list_end(list_ptr, S, BLOCK_S)):  # the slots up to the list's last used one
        blk = tl.load(list_ptr + s)
        if blk >= 0:
            row_in = _slot_rows(BITS + (bh * T + t) * S + s, row_ok, BLOCK_M, HAS_BITS)
            for sub in tl.static_range(N_SUB):
                inner = sub * BLOCK_N + offs_n
                kidx = blk * block_size + inner  # [BN]
                kin = (inner < block_size) & (kidx < M)
                kt = tl.load(
                    K + b * skb + kv * skh + kidx[:, None] * skn + offs_d[None, :],
                    mask=kin[:, None] & (offs_d[None, :] < D),
                    other=0.0,
                )  # [BN, BD]
                vt = tl.load(
                    V + b * svb + kv * svh + kidx[:, None] * svn + offs_dv[None, :],
                    mask=kin[:, None] & (offs_dv[None, :] < DV),
                    other=0.0,
                )  # [BN, BDV]
                sc = tl.dot(q, tl.trans(kt), input_precision=PRECISION) * qk_scale  # [BM, BN]
                mask = _score_mask(kidx, kin, pos, b, REAL, M, key_stride, key_offset, window, CAUSAL, HAS_REAL, HAS_WINDOW)
                sc = tl.where(mask & row_in[:, None], sc, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(sc, axis=1))
                m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
                alpha = tl.exp2(m_i - m_safe)
                p = tl.exp2(sc - m_safe[:, None])
                l_i = l_i * alpha + tl.sum(p, axis=1)
                acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt, input_precision=PRECISION)
                m_i = m_new
    has_key = l_i > 0
    out = acc / tl.where(has_key, l_i, 1.0)[:, None]
    o_rows = OUT + b * sob + head * soh + pos * son
    tl.store(o_rows[:, None] + offs_dv[None, :], out.to(OUT.dtype.element_ty), mask=row_ok[:, None] & (offs_dv[None, :] < DV))
    lse = tl.where(has_key, (m_i + tl.log2(tl.where(has_key, l_i, 1.0))) * 0.6931471805599453, float("-inf"))
    tl.store(LSE + (b * HQ + head) * N + pos, lse, mask=row_ok)


@triton.jit
def _tile_grads(q, do, lse2, delta, kt, vt, mask, qk_scale, PRECISION: tl.constexpr):
    """p [BM, BN] and ds [BM, BN] (d loss / d score, before the scale) of one key tile."""
    sc = tl.dot(q, tl.trans(kt), input_precision=PRECISION) * qk_scale
    p = tl.exp2(tl.where(mask, sc - lse2[:, None], float("-inf")))  # masked before exp2: no overflow
    dp = tl.dot(do, tl.trans(vt), input_precision=PRECISION)  # [BM, BN]
    return p, p * (dp - delta[:, None])


@triton.jit
def _bwd_dq_kernel(
    Q,
    K,
    V,
    DO,
    LSE,
    DELTA,
    BLOCKS,
    BITS,
    REAL,
    DQ,
    sqb,
    sqh,
    sqn,
    skb,
    skh,
    skn,
    svb,
    svh,
    svn,
    sdb,
    sdh,
    sdn,
    H_SEL,
    HQ,
    N,
    M,
    S,
    G,
    T,
    scale,
    window,
    key_stride,
    key_offset,
    block_size,
    GROUP: tl.constexpr,
    CAUSAL: tl.constexpr,
    HAS_REAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_BITS: tl.constexpr,
    D: tl.constexpr,
    DV: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    N_SUB: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    t, bh = tl.program_id(0), tl.program_id(1)
    b, h = bh // H_SEL, bh % H_SEL
    kv = h if GROUP else h // G
    head, pos, row_ok = _tile_rows(t, h, N, G, BLOCK_M, GROUP)
    offs_d, offs_dv, offs_n = tl.arange(0, BLOCK_D), tl.arange(0, BLOCK_DV), tl.arange(0, BLOCK_N)
    q = tl.load(
        (Q + b * sqb + head * sqh + pos * sqn)[:, None] + offs_d[None, :], mask=row_ok[:, None] & (offs_d[None, :] < D), other=0.0
    )
    do = tl.load(
        (DO + b * sdb + head * sdh + pos * sdn)[:, None] + offs_dv[None, :],
        mask=row_ok[:, None] & (offs_dv[None, :] < DV),
        other=0.0,
    )
    stat = (b * HQ + head) * N + pos
    lse2 = tl.load(LSE + stat, mask=row_ok, other=0.0) * 1.4426950408889634
    lse2 = tl.where(lse2 == float("-inf"), 0.0, lse2)
    delta = tl.load(DELTA + stat, mask=row_ok, other=0.0)
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    qk_scale = scale * 1.4426950408889634
    list_ptr = BLOCKS + (bh * T + t) * S
    for s in range(_list_end(list_ptr, S, BLOCK_S)):  # the slots up to the list's last used one
        blk = tl.load(list_ptr + s)
        if blk >= 0:
            row_in = _slot_rows(BITS + (bh * T + t) * S + s, row_ok, BLOCK_M, HAS_BITS)
            for sub in tl.static_range(N_SUB):
                inner = sub * BLOCK_N + offs_n
                kidx = blk * block_size + inner
                kin = (inner < block_size) & (kidx < M)
                kt = tl.load(
                    K + b * skb + kv * skh + kidx[:, None] * skn + offs_d[None, :],
                    mask=kin[:, None] & (offs_d[None, :] < D),
                    other=0.0,
                )
                vt = tl.load(
                    V + b * svb + kv * svh + kidx[:, None] * svn + offs_dv[None, :],
                    mask=kin[:, None] & (offs_dv[None, :] < DV),
                    other=0.0,
                )
                mask = _score_mask(kidx, kin, pos, b, REAL, M, key_stride, key_offset, window, CAUSAL, HAS_REAL, HAS_WINDOW)
                mask = mask & row_in[:, None]
                _, ds = _tile_grads(q, do, lse2, delta, kt, vt, mask, qk_scale, PRECISION)
                dq += tl.dot(ds.to(kt.dtype), kt, input_precision=PRECISION)
    tl.store(
        (DQ + b * sqb + head * sqh + pos * sqn)[:, None] + offs_d[None, :],
        (dq * scale).to(DQ.dtype.element_ty),
        mask=row_ok[:, None] & (offs_d[None, :] < D),
    )


@triton.jit
def _bwd_dkdv_kernel(
    Q,
    K,
    V,
    DO,
    LSE,
    DELTA,
    CODES,
    ENTRY_BITS,
    ITEM_BLOCK,
    ITEM_START,
    ITEM_END,
    XOFF,
    REAL,
    PART_K,
    PART_V,
    DK,
    DV_OUT,
    sqb,
    sqh,
    sqn,
    skb,
    skh,
    skn,
    svb,
    svh,
    svn,
    sdb,
    sdh,
    sdn,
    HK,
    N,
    M,
    G,
    T,
    L,
    NB,
    W,
    scale,
    window,
    key_stride,
    key_offset,
    block_size,
    GROUP: tl.constexpr,
    CAUSAL: tl.constexpr,
    HAS_REAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_BITS: tl.constexpr,
    D: tl.constexpr,
    DV: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    N_SUB: tl.constexpr,
    PRECISION: tl.constexpr,
):
    w, bhk, sub = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    b, kv = bhk // HK, bhk % HK
    blk = tl.load(ITEM_BLOCK + bhk * W + w)
    start, end = tl.load(ITEM_START + bhk * W + w), tl.load(ITEM_END + bhk * W + w)
    offs_d, offs_dv, offs_n = tl.arange(0, BLOCK_D), tl.arange(0, BLOCK_DV), tl.arange(0, BLOCK_N)
    inner = sub * BLOCK_N + offs_n
    kidx = blk * block_size + inner
    kin = (inner < block_size) & (kidx < M)
    kt = tl.load(
        K + b * skb + kv * skh + kidx[:, None] * skn + offs_d[None, :], mask=kin[:, None] & (offs_d[None, :] < D), other=0.0
    )
    vt = tl.load(
        V + b * svb + kv * svh + kidx[:, None] * svn + offs_dv[None, :], mask=kin[:, None] & (offs_dv[None, :] < DV), other=0.0
    )
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], tl.float32)
    qk_scale = scale * 1.4426950408889634
    for e in range(start, end):
        code = tl.load(CODES + bhk * L + e)
        if GROUP:
            t, h = code, kv
        else:
            t, h = code % T, kv * G + code // T
        head, pos, row_ok = _tile_rows(t, h, N, G, BLOCK_M, GROUP)
        q = tl.load(
            (Q + b * sqb + head * sqh + pos * sqn)[:, None] + offs_d[None, :],
            mask=row_ok[:, None] & (offs_d[None, :] < D),
            other=0.0,
        )
        do = tl.load(
            (DO + b * sdb + head * sdh + pos * sdn)[:, None] + offs_dv[None, :],
            mask=row_ok[:, None] & (offs_dv[None, :] < DV),
            other=0.0,
        )
        stat = (b * HK * G + head) * N + pos
        lse2 = tl.load(LSE + stat, mask=row_ok, other=0.0) * 1.4426950408889634
        lse2 = tl.where(lse2 == float("-inf"), 0.0, lse2)
        delta = tl.load(DELTA + stat, mask=row_ok, other=0.0)
        mask = _score_mask(kidx, kin, pos, b, REAL, M, key_stride, key_offset, window, CAUSAL, HAS_REAL, HAS_WINDOW)
        mask = mask & _slot_rows(ENTRY_BITS + bhk * L + e, row_ok, BLOCK_M, HAS_BITS)[:, None]
        p, ds = _tile_grads(q, do, lse2, delta, kt, vt, mask, qk_scale, PRECISION)
        dv += tl.dot(tl.trans(p.to(do.dtype)), do, input_precision=PRECISION)
        dk += tl.dot(tl.trans(ds.to(q.dtype)), q, input_precision=PRECISION)
    alone = False  # a block whose one item is its whole list: its sums are final, stored here
    if w < NB:
        alone = tl.load(XOFF + bhk * (NB + 1) + w + 1) == tl.load(XOFF + bhk * (NB + 1) + w)
    if alone:
        _store_key_rows(DK + b * skb + kv * skh, kidx, kin, offs_d, D, skn, dk * scale)
        _store_key_rows(DV_OUT + b * svb + kv * svh, kidx, kin, offs_dv, DV, svn, dv)
    else:
        rows = (bhk * W + w) * (N_SUB * BLOCK_N) + inner
        tl.store(PART_K + rows[:, None] * BLOCK_D + offs_d[None, :], dk * scale)
        tl.store(PART_V + rows[:, None] * BLOCK_DV + offs_dv[None, :], dv)


@triton.jit
def _store_key_rows(base, kidx, kin, offs, WIDTH, stride, x):
    """x [BN, BLOCK] fp32 into the key rows kidx (kin: inside the block and the keys) of one
    [M, WIDTH] matrix at ``base`` (row stride ``stride``), in the matrix's dtype."""
    mask = kin[:, None] & (offs[None, :] < WIDTH)
    tl.store(base + kidx[:, None] * stride + offs[None, :], x.to(base.dtype.element_ty), mask=mask)


@triton.jit
def _reduce_kernel(
    PART_K,
    PART_V,
    XOFF,
    DK,
    DV_OUT,
    skb,
    skh,
    skn,
    svb,
    svh,
    svn,
    HK,
    M,
    NB,
    W,
    block_size,
    D: tl.constexpr,
    DV: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    N_SUB: tl.constexpr,
):
    j, bhk, sub = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    b, kv = bhk // HK, bhk % HK
    offs_d, offs_dv, offs_n = tl.arange(0, BLOCK_D), tl.arange(0, BLOCK_DV), tl.arange(0, BLOCK_N)
    inner = sub * BLOCK_N + offs_n
    width = N_SUB * BLOCK_N
    first, last = tl.load(XOFF + bhk * (NB + 1) + j), tl.load(XOFF + bhk * (NB + 1) + j + 1)
    if last > first:  # blocks of one item were stored by the dk/dv pass
        rows = (bhk * W + j) * width + inner
        dk = tl.load(PART_K + rows[:, None] * BLOCK_D + offs_d[None, :])
        dv = tl.load(PART_V + rows[:, None] * BLOCK_DV + offs_dv[None, :])
        for x in range(first, last):
            rows = (bhk * W + NB + x) * width + inner
            dk += tl.load(PART_K + rows[:, None] * BLOCK_D + offs_d[None, :])
            dv += tl.load(PART_V + rows[:, None] * BLOCK_DV + offs_dv[None, :])
        kidx = j * block_size + inner
        kin = (inner < block_size) & (kidx < M)
        _store_key_rows(DK + b * skb + kv * skh, kidx, kin, offs_d, D, skn, dk)
        _store_key_rows(DV_OUT + b * svb + kv * svh, kidx, kin, offs_dv, DV, svn, dv)


class _Launch:
    """Tile sizes and grid facts shared by the launchers, derived from the shapes alone."""

    def __init__(self, q: Tensor, k: Tensor, v: Tensor, blocks: Tensor, block_size: int, tile: int) -> None:
        self.batch, self.q_heads, self.n, self.d = q.shape
        self.kv_heads, self.m, self.dv = k.shape[1], k.shape[2], v.shape[3]
        self.group = self.q_heads // self.kv_heads
        self.grouped = tile == GROUP_TILE
        self.block_m = max(16, triton.next_power_of_2(self.group)) if self.grouped else tile
        self.h_sel = self.kv_heads if self.grouped else self.q_heads
        self.tiles = self.n if self.grouped else -(-self.n // tile)
        self.slots = blocks.shape[-1]
        self.block_s = min(LIST_END_SLOTS, max(16, triton.next_power_of_2(self.slots)))  # slots read at once for a list's end
        self.block_n = min(64, max(16, triton.next_power_of_2(block_size)))
        self.n_sub = -(-block_size // self.block_n)
        self.n_blocks = -(-self.m // block_size)
        self.block_d, self.block_dv = max(16, triton.next_power_of_2(self.d)), max(16, triton.next_power_of_2(self.dv))
        self.precision = "ieee" if q.dtype == torch.float32 else "tf32"
        self.num_warps = 4 if self.block_m * max(self.block_d, self.block_dv) <= 64 * 128 else 8

    def constexprs(self, causal: bool, has_real: bool, window: int, has_bits: bool = False) -> dict:
        return dict(
            GROUP=self.grouped,
            CAUSAL=causal,
            HAS_REAL=has_real,
            HAS_WINDOW=window > 0,
            HAS_BITS=has_bits,
            D=self.d,
            DV=self.dv,
            BLOCK_M=self.block_m,
            BLOCK_N=self.block_n,
            BLOCK_D=self.block_d,
            BLOCK_DV=self.block_dv,
            N_SUB=self.n_sub,
            PRECISION=self.precision,
            num_warps=self.num_warps,
        )


def _strides(*tensors: Tensor) -> list[int]:
    """(batch, head, position) strides of each [B, H, N, X] tensor (the last dim is contiguous)."""
    return [s for x in tensors for s in x.stride()[:3]]


def _real_arg(key_real: Optional[Tensor], q: Tensor) -> Tensor:
    return q.new_zeros(1, dtype=torch.int8) if key_real is None else key_real.to(torch.int8).contiguous()


def _bits_arg(row_bits: Optional[Tensor], q: Tensor) -> Tensor:
    return q.new_zeros(1, dtype=torch.int32) if row_bits is None else row_bits


@torch.library.custom_op("sparsefocus::block_sparse_fwd", mutates_args=())
def block_sparse_fwd(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    blocks: Tensor,
    key_real: Optional[Tensor],
    row_bits: Optional[Tensor],
    block_size: int,
    tile: int,
    causal: bool,
    scale: float,
    window: int,
    key_stride: int,
    key_offset: int,
) -> tuple[Tensor, Tensor]:
    """Forward op: contiguous q [B, Hq, N, D], k [B, Hk, M, D], v [B, Hk, M, Dv], blocks int32
    (see the module docstring), key_real [B, M] bool or None, row_bits int32 like blocks or None
    -> (out [B, Hq, N, Dv], lse [B, Hq, N] fp32)."""
    run = _Launch(q, k, v, blocks, block_size, tile)
    out = torch.empty(run.batch, run.q_heads, run.n, run.dv, dtype=q.dtype, device=q.device)
    lse = torch.empty(run.batch, run.q_heads, run.n, dtype=torch.float32, device=q.device)
    grid = (run.tiles, run.batch * run.h_sel)
    _fwd_kernel[grid](
        q,
        k,
        v,
        blocks,
        _bits_arg(row_bits, q),
        _real_arg(key_real, q),
        out,
        lse,
        *_strides(q, k, v, out),
        run.h_sel,
        run.q_heads,
        run.n,
        run.m,
        run.slots,
        run.group,
        run.tiles,
        scale,
        window,
        key_stride,
        key_offset,
        block_size,
        **run.constexprs(causal, key_real is not None, window, row_bits is not None),
        BLOCK_S=run.block_s,
    )
    return out, lse


@block_sparse_fwd.register_fake
def _(q, k, v, blocks, key_real, row_bits, block_size, tile, causal, scale, window, key_stride, key_offset):
    out = q.new_empty(q.shape[0], q.shape[1], q.shape[2], v.shape[3])
    return out, q.new_empty(q.shape[:3], dtype=torch.float32)


def _entry_bits(row_bits: Optional[Tensor], order: Tensor) -> Tensor:
    """[BHk, L] int32 row mask of each inverse-list entry (``order``: the list slot each sorted
    entry came from), or a placeholder without row masks."""
    if row_bits is None:
        return order.new_zeros(1, dtype=torch.int32)
    return torch.gather(row_bits.reshape(order.shape[0], -1), 1, order).contiguous()


@triton.jit
def _inverse_kernel(
    FLAT,
    ROW_BITS,
    CODES,
    ENTRY_BITS,
    ITEM_BLOCK,
    ITEM_START,
    ITEM_END,
    XOFF,
    L,
    NB,
    W,
    SLOTS,
    E,
    HAS_BITS: tl.constexpr,
    BLOCK_L: tl.constexpr,
    BLOCK_B: tl.constexpr,
    BLOCK_X: tl.constexpr,
):
    """``inverse_lists`` of one row FLAT[bhk] [L] in one program (see ``_inverse_lists_torch``).

    The stable sort by block is one sort of keys block * BLOCK_L + slot (unused slots as block NB,
    padding lanes NB + 1, so both come last); block offsets are an exclusive scan of a histogram."""
    bhk = tl.program_id(0).to(tl.int64)
    lane = tl.arange(0, BLOCK_L)  # [BL]
    inside = lane < L
    blk = tl.load(FLAT + bhk * L + lane, mask=inside, other=-1)
    keyed = tl.where(inside, tl.where(blk >= 0, blk, NB), NB + 1)  # [BL] in [0, NB + 1]
    ordered = tl.sort(keyed * BLOCK_L + lane)  # stable: equal blocks keep their slot order
    order = ordered % BLOCK_L  # [BL] the slot each sorted entry came from (the first L are real)
    tl.store(CODES + bhk * L + lane, order // SLOTS, mask=inside)
    if HAS_BITS:
        tl.store(ENTRY_BITS + bhk * L + lane, tl.load(ROW_BITS + bhk * L + order, mask=inside, other=0), mask=inside)
    counts = tl.histogram(keyed, BLOCK_B)  # [BB] entries per block (bins NB, NB + 1: unused, padding)
    ids = tl.arange(0, BLOCK_B)
    counts = tl.where(ids < NB, counts, 0)
    ends = tl.cumsum(counts, 0)  # [BB] offsets[b + 1]
    starts = ends - counts  # [BB] offsets[b]; offsets[NB] = the used entries
    extra = tl.where(ids < NB, tl.maximum((counts + E - 1) // E - 1, 0), 0)  # further items of a busy block
    xoff = tl.cumsum(extra, 0) - extra  # [BB] exclusive: xoff[b]
    tl.store(XOFF + bhk * (NB + 1) + ids, xoff, mask=ids <= NB)
    first = ids < NB  # item b < NB: block b's first run of at most E entries
    tl.store(ITEM_BLOCK + bhk * W + ids, ids, mask=first)
    tl.store(ITEM_START + bhk * W + ids, starts, mask=first)
    tl.store(ITEM_END + bhk * W + ids, tl.minimum(starts + E, ends), mask=first)
    x = tl.arange(0, BLOCK_X)  # [BX] further item x: run part of block x_block
    seen = (xoff[None, :] <= x[:, None]) & (ids[None, :] <= NB)  # [BX, BB]
    x_block = tl.minimum(tl.maximum(tl.sum(seen.to(tl.int32), 1) - 1, 0), NB - 1)  # [BX]
    at = ids[None, :] == x_block[:, None]  # [BX, BB] one-hot gathers of the block's facts
    part = x - tl.sum(tl.where(at, xoff[None, :], 0), 1) + 1
    block_end = tl.sum(tl.where(at, ends[None, :], 0), 1)
    start = tl.minimum(tl.sum(tl.where(at, starts[None, :], 0), 1) + part * E, block_end)
    further = NB + x < W
    tl.store(ITEM_BLOCK + bhk * W + NB + x, x_block, mask=further)
    tl.store(ITEM_START + bhk * W + NB + x, start, mask=further)
    tl.store(ITEM_END + bhk * W + NB + x, tl.minimum(start + E, block_end), mask=further)


INVERSE_KERNEL_ENTRIES = 4096
"""Longest flattened lists (entries per kv row) whose inverse lists one Triton program builds
(``_inverse_kernel``: the row's entries, sorted, in registers); longer ones, and more than
``INVERSE_KERNEL_BLOCKS`` key blocks, take the PyTorch sort. 0 turns the kernel off."""
INVERSE_KERNEL_BLOCKS = 510


def inverse_lists(
    blocks: Tensor, run: _Launch, row_bits: Optional[Tensor] = None
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, int, Tensor]:
    """The (block -> query tiles) lists the dk/dv pass reads, built on device with fixed sizes.

    Returns (codes [BHk, L] tile codes sorted by block, item_block, item_start, item_end [BHk, W]
    int32, xoff [BHk, nb + 1] int32 offsets of each block's extra items, W, entry_bits [BHk, L]
    int32 row masks of the sorted entries, or a placeholder without ``row_bits``). A tile code is
    the position (group tiles) or g * T + t (query head kv * G + g, tile t). Item j < nb is block
    j's first run of at most E entries; items nb + x are the further runs of the busy blocks.
    Short lists (``INVERSE_KERNEL_ENTRIES``) take one Triton launch, longer ones some twenty
    PyTorch ops (``_inverse_lists_torch``, the same tensors)."""
    bhk, nb = run.batch * run.kv_heads, run.n_blocks
    length = blocks.numel() // bhk if bhk else 0  # L: entries of one kv row's lists
    if not (0 < length <= INVERSE_KERNEL_ENTRIES and 0 < nb <= INVERSE_KERNEL_BLOCKS):
        return _inverse_lists_torch(blocks, run, row_bits)
    entries = max(1, ENTRY_ROWS // run.block_m)
    n_extra = -(-length // entries)
    width = nb + n_extra
    flat = blocks.reshape(bhk, length)  # [BHk, L]
    codes = torch.empty(bhk, length, dtype=torch.int32, device=blocks.device)
    entry_bits = codes.new_zeros(1) if row_bits is None else torch.empty_like(codes)
    item_block, item_start, item_end = (torch.empty(bhk, width, dtype=torch.int32, device=blocks.device) for _ in range(3))
    xoff = torch.empty(bhk, nb + 1, dtype=torch.int32, device=blocks.device)
    _inverse_kernel[(bhk,)](
        flat,
        entry_bits if row_bits is None else row_bits.reshape(bhk, length).contiguous(),
        codes,
        entry_bits,
        item_block,
        item_start,
        item_end,
        xoff,
        length,
        nb,
        width,
        run.slots,
        entries,
        HAS_BITS=row_bits is not None,
        BLOCK_L=max(16, triton.next_power_of_2(length)),
        BLOCK_B=max(16, triton.next_power_of_2(nb + 2)),
        BLOCK_X=max(16, triton.next_power_of_2(n_extra)),
        num_warps=4 if blocks.is_cuda else 1,
    )
    return codes, item_block, item_start, item_end, xoff, width, entry_bits


def _inverse_lists_torch(
    blocks: Tensor, run: _Launch, row_bits: Optional[Tensor] = None
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, int, Tensor]:
    """``inverse_lists`` by a stable PyTorch sort, searchsorted and gathers (any length)."""
    bhk, nb = run.batch * run.kv_heads, run.n_blocks
    flat = blocks.reshape(bhk, -1)  # [BHk, L] (G heads x T tiles x S slots, or N positions x S slots)
    keyed = torch.where(flat >= 0, flat, torch.full_like(flat, nb))
    sorted_block, order = torch.sort(keyed, dim=-1, stable=True)
    codes = (order // run.slots).to(torch.int32)
    bounds = torch.arange(nb + 1, device=blocks.device, dtype=sorted_block.dtype).expand(bhk, nb + 1).contiguous()
    offsets = torch.searchsorted(sorted_block, bounds)  # [BHk, nb + 1] int64
    entries = max(1, ENTRY_ROWS // run.block_m)
    counts = offsets[:, 1:] - offsets[:, :-1]
    extra = (counts + entries - 1).div(entries, rounding_mode="floor").sub(1).clamp_min(0)  # [BHk, nb]
    xoff = torch.cat([torch.zeros_like(extra[:, :1]), extra.cumsum(-1)], dim=-1)  # [BHk, nb + 1]
    n_extra = -(-flat.shape[1] // entries)
    x = torch.arange(n_extra, device=blocks.device).expand(bhk, n_extra).contiguous()
    x_block = (torch.searchsorted(xoff, x, right=True) - 1).clamp(0, nb - 1)  # [BHk, X]
    x_part = x - torch.gather(xoff, 1, x_block) + 1
    item_block = torch.cat([torch.arange(nb, device=blocks.device).expand(bhk, nb), x_block], dim=-1)  # [BHk, W]
    part = torch.cat([torch.zeros(bhk, nb, dtype=torch.long, device=blocks.device), x_part], dim=-1)
    block_start, block_end = torch.gather(offsets, 1, item_block), torch.gather(offsets, 1, item_block + 1)
    item_start = (block_start + part * entries).clamp(max=block_end)
    item_end = torch.minimum(item_start + entries, block_end)
    item_block, item_start, item_end, xoff = (t.to(torch.int32).contiguous() for t in (item_block, item_start, item_end, xoff))
    return codes.contiguous(), item_block, item_start, item_end, xoff, nb + n_extra, _entry_bits(row_bits, order)


@torch.library.custom_op("sparsefocus::block_sparse_bwd", mutates_args=())
def block_sparse_bwd(
    grad_out: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    grad_lse: Tensor,
    blocks: Tensor,
    key_real: Optional[Tensor],
    row_bits: Optional[Tensor],
    block_size: int,
    tile: int,
    causal: bool,
    scale: float,
    window: int,
    key_stride: int,
    key_offset: int,
) -> tuple[Tensor, Tensor, Tensor]:
    """Backward op of ``block_sparse_fwd``: (dq, dk, dv) in the inputs' dtypes."""
    run = _Launch(q, k, v, blocks, block_size, tile)
    delta = row_delta(out, grad_out, grad_lse)  # [B, Hq, N] fp32
    real = _real_arg(key_real, q)
    flags = run.constexprs(causal, key_real is not None, window, row_bits is not None)
    sizes = (run.n, run.m)
    dq = torch.empty_like(q)
    _bwd_dq_kernel[(run.tiles, run.batch * run.h_sel)](
        q,
        k,
        v,
        grad_out,
        lse,
        delta,
        blocks,
        _bits_arg(row_bits, q),
        real,
        dq,
        *_strides(q, k, v, grad_out),
        run.h_sel,
        run.q_heads,
        *sizes,
        run.slots,
        run.group,
        run.tiles,
        scale,
        window,
        key_stride,
        key_offset,
        block_size,
        **flags,
        BLOCK_S=run.block_s,
    )
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    if run.m == 0:
        return dq, dk, dv
    codes, item_block, item_start, item_end, xoff, width, entry_bits = inverse_lists(blocks, run, row_bits)
    bhk, span = run.batch * run.kv_heads, run.n_sub * run.block_n
    part_k = torch.empty(bhk, width, span, run.block_d, dtype=torch.float32, device=q.device)
    part_v = torch.empty(bhk, width, span, run.block_dv, dtype=torch.float32, device=q.device)
    _bwd_dkdv_kernel[(width, bhk, run.n_sub)](
        q,
        k,
        v,
        grad_out,
        lse,
        delta,
        codes,
        entry_bits,
        item_block,
        item_start,
        item_end,
        xoff,
        real,
        part_k,
        part_v,
        dk,
        dv,
        *_strides(q, k, v, grad_out),
        run.kv_heads,
        *sizes,
        run.group,
        run.tiles,
        codes.shape[1],
        run.n_blocks,
        width,
        scale,
        window,
        key_stride,
        key_offset,
        block_size,
        **flags,
    )
    _reduce_kernel[(run.n_blocks, bhk, run.n_sub)](
        part_k,
        part_v,
        xoff,
        dk,
        dv,
        *_strides(k, v),
        run.kv_heads,
        run.m,
        run.n_blocks,
        width,
        block_size,
        D=run.d,
        DV=run.dv,
        BLOCK_N=run.block_n,
        BLOCK_D=run.block_d,
        BLOCK_DV=run.block_dv,
        N_SUB=run.n_sub,
    )
    return dq, dk, dv


@block_sparse_bwd.register_fake
def _(grad_out, q, k, v, *_):  # (dq, dk, dv) shaped like the inputs
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


_STATIC_ARGS = ("block_size", "tile", "causal", "scale", "window", "key_stride", "key_offset")


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, blocks, key_real, row_bits, *static = inputs
    ctx.save_for_backward(q, k, v, blocks, key_real, row_bits, *output)
    ctx.static = static


def _backward(ctx, grad_out, grad_lse):
    q, k, v, blocks, key_real, row_bits, out, lse = ctx.saved_tensors
    grad_out = torch.zeros_like(out) if grad_out is None else grad_out.contiguous()
    grad_lse = torch.zeros_like(lse) if grad_lse is None else grad_lse.contiguous()
    dq, dk, dv = block_sparse_bwd(grad_out, q, k, v, out, lse, grad_lse, blocks, key_real, row_bits, *ctx.static)
    return dq, dk, dv, None, None, None, *([None] * len(_STATIC_ARGS))


block_sparse_fwd.register_autograd(_backward, setup_context=_setup_context)


def _check(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    blocks: Tensor,
    block_size: int,
    tile: int,
    key_padding_mask: Optional[Tensor],
    row_bits: Optional[Tensor] = None,
) -> None:
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4 or q.shape[-1] != k.shape[-1] or k.shape[:3] != v.shape[:3]:
        raise ValueError(
            f"block_sparse_attention needs q [B, Hq, N, D], k [B, Hk, M, D], v [B, Hk, M, Dv], got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if q.shape[0] != k.shape[0] or q.shape[1] % k.shape[1]:
        raise ValueError(f"q heads ({q.shape[1]}) must be a multiple of kv heads ({k.shape[1]}) with equal batch")
    if max(q.shape[-1], v.shape[-1]) > 256:
        raise ValueError(f"block_sparse_attention supports head dims up to 256, got D={q.shape[-1]}, Dv={v.shape[-1]}")
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    if tile != GROUP_TILE and (tile < 16 or tile & (tile - 1)):
        raise ValueError(f"tile must be GROUP_TILE (0) or a power of 2 >= 16, got {tile}")
    heads, tiles = (k.shape[1], q.shape[2]) if tile == GROUP_TILE else (q.shape[1], -(-q.shape[2] // tile))
    if blocks.dim() != 4 or blocks.is_floating_point() or tuple(blocks.shape[:3]) != (q.shape[0], heads, tiles):
        raise ValueError(
            f"blocks must be an integer tensor [B, {heads}, {tiles}, S] for tile={tile}, got {blocks.dtype} {tuple(blocks.shape)}"
        )
    if row_bits is not None and (tile not in (16, 32) or row_bits.dtype != torch.int32 or row_bits.shape != blocks.shape):
        raise ValueError(
            f"row_bits must be int32 shaped like blocks {tuple(blocks.shape)} with tile 16 or 32, got {row_bits.dtype} {tuple(row_bits.shape)}, tile={tile}"
        )
    if key_padding_mask is not None and (
        key_padding_mask.dtype != torch.bool or tuple(key_padding_mask.shape) != (k.shape[0], k.shape[2])
    ):
        raise ValueError(
            f"key_padding_mask must be bool [B, M] = [{k.shape[0]}, {k.shape[2]}], got {key_padding_mask.dtype} {tuple(key_padding_mask.shape)}"
        )


def block_sparse_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    blocks: Tensor,
    *,
    block_size: int,
    tile: int = GROUP_TILE,
    causal: bool = False,
    scale: Optional[float] = None,
    key_padding_mask: Optional[Tensor] = None,
    window: int = 0,
    key_stride: int = 1,
    key_offset: int = 0,
    row_bits: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor]:
    """Attention of query tiles over lists of key blocks (Triton forward and backward).

    ::

        tile t, list [j0, j1, -1]:   rows of t attend to keys of blocks j0 and j1 only
        keys:   | j0 ....... | .......... | j1 ....... |   (each block_size wide)

    Args:
        q: [B, Hq, N, D]; k: [B, Hk, M, D]; v: [B, Hk, M, Dv]; Hq % Hk == 0; D, Dv <= 256.
            fp16, bf16 or fp32 (fp32 uses exact fp32 dots; CPU interpreter: fp16/fp32).
        blocks: integer lists of block ids, -1 = unused, distinct within a list:
            [B, Hk, N, S] for ``tile=GROUP_TILE``, [B, Hq, ceil(N / tile), S] for ``tile > 0``.
        block_size: keys per block. tile: GROUP_TILE (0) or queries per tile (power of 2 >= 16).
            Default: GROUP_TILE.
        causal: drop keys whose position exceeds the query's. Default: False.
        scale: score scale. Default: 1/sqrt(D).
        key_padding_mask: [B, M] bool, True = real key. Default: None.
        window: > 0 also drops keys at position <= query position - window (and, not causal,
            >= query position + window). Default: 0 (none).
        key_stride, key_offset: the position of key j is j * key_stride + key_offset (for
            ``causal`` and ``window``). Default: 1, 0.
        row_bits: int32 [B, Hq, ceil(N / tile), S] (``tile`` 16 or 32): bit r of entry [.., t, s]
            set = row t * tile + r keeps block blocks[.., t, s]; a tile then lists the union of
            its rows' blocks, each row attending to its own (NSA's per-position selection on
            query tiles). Default: None (every row of a tile keeps every listed block).
    Returns:
        (out [B, Hq, N, Dv] in q.dtype, lse [B, Hq, N] fp32 natural-log normaliser, -inf where a
        row keeps no key; its gradient is supported). Rows with no key output zero.
    """
    _check(q, k, v, blocks, block_size, tile, key_padding_mask, row_bits)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    k, v = k.to(q.dtype).contiguous(), v.to(q.dtype).contiguous()
    return block_sparse_fwd(
        q.contiguous(),
        k,
        v,
        blocks.to(torch.int32).contiguous(),
        key_padding_mask,
        None if row_bits is None else row_bits.contiguous(),
        block_size,
        tile,
        causal,
        scale,
        int(window),
        int(key_stride),
        int(key_offset),
    )


@triton.jit
def _visible_compressed(t, cmp, stride, NC):
    """Compressed keys a causal query at position t sees: key j ends at j * stride + cmp - 1, so
    (t - cmp + 1) // stride + 1 of them, none before position cmp - 1."""
    return tl.where(t - cmp + 1 >= 0, tl.minimum((t - cmp + 1) // stride + 1, NC), 0)


@triton.jit
def _importance_kernel(
    Q,
    C,
    LSE,
    REAL,
    OUT,
    sqb,
    sqh,
    sqn,
    scb,
    sch,
    scn,
    HK,
    HQ,
    N,
    NC,
    G,
    row_start,
    n_rows,
    scale,
    stride,
    cmp,
    CAUSAL: tl.constexpr,
    HAS_REAL: tl.constexpr,
    D: tl.constexpr,
    GP: tl.constexpr,
    PM: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """A tile of PM consecutive positions x GP (the group's G heads, padded) query rows, row
    r = (position r // GP, head r % GP), against the compressed keys in blocks of BLOCK_C; each
    position's probabilities summed over its group's heads. PM = 1 for wide groups (the heads fill
    the tile); small groups tile positions so that the tensor-core rows are not mostly padding."""
    tile, bhk = tl.program_id(0), tl.program_id(1)
    b, kv = bhk // HK, bhk % HK
    first = row_start + tile * PM  # first position of the tile
    r = tl.arange(0, PM * GP)
    pos = first + r // GP  # [PM GP]
    head = kv * G + r % GP
    row_ok = (r % GP < G) & (pos < row_start + n_rows) & (pos < N)
    offs_d, offs_c = tl.arange(0, BLOCK_D), tl.arange(0, BLOCK_C)
    q = tl.load(
        (Q + b * sqb + head * sqh + pos * sqn)[:, None] + offs_d[None, :], mask=row_ok[:, None] & (offs_d[None, :] < D), other=0.0
    )
    lse = tl.load(LSE + (b * HQ + head) * N + pos, mask=row_ok, other=float("-inf"))
    row_ok = row_ok & (lse > float("-inf"))
    lse2 = tl.where(row_ok, lse * 1.4426950408889634, 0.0)
    n_visible = tl.zeros([PM * GP], tl.int32) + NC  # compressed keys each row sees
    last = tl.minimum(first + PM - 1, tl.minimum(row_start + n_rows, N) - 1)  # the tile's last position
    tile_visible = NC
    if CAUSAL:
        n_visible = _visible_compressed(pos, cmp, stride, NC)
        tile_visible = _visible_compressed(last, cmp, stride, NC)
    places = first - row_start + tl.arange(0, PM)  # [PM] output rows
    out_rows = OUT + (bhk * n_rows + places).to(tl.int64) * NC
    for c0 in range(0, NC, BLOCK_C):
        cidx = c0 + offs_c
        col_ok = cidx[None, :] < n_visible[:, None]  # [PM GP, BC]
        if HAS_REAL:
            col_ok = col_ok & (tl.load(REAL + b * NC + cidx, mask=cidx < NC, other=0) != 0)[None, :]
        if c0 < tile_visible:
            ct = tl.load(
                C + b * scb + kv * sch + cidx[:, None] * scn + offs_d[None, :],
                mask=(cidx[:, None] < NC) & (offs_d[None, :] < D),
                other=0.0,
            )
            s = tl.dot(q, tl.trans(ct), input_precision=PRECISION) * (scale * 1.4426950408889634)
            p = tl.exp2(tl.where(row_ok[:, None] & col_ok, s - lse2[:, None], float("-inf")))
            total = tl.sum(tl.reshape(p, [PM, GP, BLOCK_C]), axis=1)  # [PM, BC] summed over the heads
        else:
            total = tl.zeros([PM, BLOCK_C], tl.float32)
        keep = (places < n_rows)[:, None] & (cidx < NC)[None, :]
        tl.store(out_rows[:, None] + cidx[None, :], total, mask=keep)


def compressed_importance(
    q: Tensor,
    ck: Tensor,
    lse: Tensor,
    cmp_real: Optional[Tensor],
    rows: slice,
    *,
    scale: float,
    stride: int,
    cmp: int,
    causal: bool,
) -> Tensor:
    """NSA's compressed attention probabilities summed over each GQA group, for the query rows
    ``rows``: q [B, Hq, N, D], compressed keys ck [B, Hk, Nc, D] (key j at position
    j * stride + cmp - 1), lse [B, Hq, N] of the compressed attention -> [B, Hk, R, Nc] fp32.
    Entry (i, j) is sum_h exp(scale q_h(i) . ck_j - lse_h(i)) over the group's heads where i sees j.
    No gradient (it feeds a discrete selection)."""
    q, ck = q.detach().contiguous(), ck.detach().to(q.dtype).contiguous()
    real = None if cmp_real is None else cmp_real.contiguous()
    return nsa_importance(
        q, ck, lse.detach().float().contiguous(), real, rows.start, rows.stop - rows.start, scale, stride, cmp, causal
    )


@torch.library.custom_op("sparsefocus::nsa_importance", mutates_args=())
def nsa_importance(
    q: Tensor,
    ck: Tensor,
    lse: Tensor,
    cmp_real: Optional[Tensor],
    row_start: int,
    n_rows: int,
    scale: float,
    stride: int,
    cmp: int,
    causal: bool,
) -> Tensor:
    """Op behind ``compressed_importance`` (contiguous inputs, rows [row_start, row_start + n_rows))."""
    batch, q_heads, n, d = q.shape
    kv_heads, n_cmp = ck.shape[1], ck.shape[2]
    out = torch.empty(batch, kv_heads, n_rows, n_cmp, dtype=torch.float32, device=q.device)
    group = q_heads // kv_heads
    padded = triton.next_power_of_2(group)
    rows_wanted = IMPORTANCE_ROWS if q.is_cuda else 16  # the interpreter: several tiles at test sizes
    positions = 1 if padded >= 16 else rows_wanted // padded  # groups of 16 or more heads fill a tile alone
    _importance_kernel[(triton.cdiv(n_rows, positions), batch * kv_heads)](
        q,
        ck,
        lse,
        _real_arg(cmp_real, q),
        out,
        *_strides(q, ck),
        kv_heads,
        q_heads,
        n,
        n_cmp,
        group,
        row_start,
        n_rows,
        scale,
        stride,
        cmp,
        CAUSAL=causal,
        HAS_REAL=cmp_real is not None,
        D=d,
        GP=padded,
        PM=positions,
        BLOCK_C=64,
        BLOCK_D=max(16, triton.next_power_of_2(d)),
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
    )
    return out


@nsa_importance.register_fake
def _(q, ck, lse, cmp_real, row_start, n_rows, scale, stride, cmp, causal):
    return q.new_empty(q.shape[0], ck.shape[1], n_rows, ck.shape[2], dtype=torch.float32)

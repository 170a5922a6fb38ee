"""Run (window) attention in Triton: each query attends to a contiguous run of keys, on tensor cores.

Query i of head h reads the keys ``start[b, h, i] .. start[b, h, i] + W - 1`` (W = ``width``, or a
per-query length), clipped to [0, M) and, when causal, to keys <= i. BAND, BLOC and windows in a
sorted order (ZETA's neighbours after the sort) all have this shape. The slow twin that defines the
result is ``sparsefocus.attention.common.run_attention_ref``.

Unlike ``indexed.py``, which gathers K rows per query, a program here owns BLOCK_M consecutive
queries, takes the union [lo, hi) of their runs and walks it in [BLOCK_N, D] key tiles with
``tl.dot`` (tensor cores), masking each score to its own row's run:

* forward: online softmax (fp32 max and sum, log2 units); saves out and the log2-sum-exp.
* backward: the same query tiles recompute the weights, keep dq in registers (``tl.dot``) and add
  their dk, dv tiles (``tl.dot`` of the transposed weights) with fp32 atomics. Chosen over a
  key-tile pass because the queries touching a key tile are only cheap to find when the starts
  are sorted, and GQA adds several query heads into one kv head anyway. Cost: the summation order
  of dk, dv is not deterministic.

Work per tile is the union of its runs: W + BLOCK_M keys when starts grow by one per row (a band),
up to all M keys when consecutive queries have unrelated starts (still correct, just slow).

The launchers are the ``torch.library`` ops ``sparsefocus::runs_fwd`` and ``runs_bwd``
(docs/kernels.md), with ``triton_op`` twins ``runs_fwd_traced`` and ``runs_bwd_traced`` that a
compiled graph can launch without a Python call (``_ops.TRITON_OPS``).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.library import wrap_triton

from sparsefocus.attention.common import run_attention_ref
from sparsefocus.kernels import interpreter_compat  # noqa: F401  (CPU interpreter fix)
from sparsefocus.kernels._ops import lse_from_log2, op_name, traced_setup, triton_op_chosen


@triton.jit
def _row_runs(
    START,
    LENGTH,
    bh,
    rows,
    row_ok,
    M,
    HQ,
    runs_b,
    runs_h,
    offset,
    width,
    CAUSAL: tl.constexpr,
    HAS_START: tl.constexpr,
    HAS_LENGTH: tl.constexpr,
):
    """Per-row key run [lo, hi) (empty: lo >= hi) and the tile's union bounds (empty: lo > hi).
    START and LENGTH are [B or 1, Hq or 1, N] int32 with batch / head strides runs_b / runs_h (0
    where broadcast); without START a row's run starts at row + offset, without LENGTH it is
    ``width`` keys long."""
    run_offs = (bh // HQ).to(tl.int64) * runs_b + (bh % HQ).to(tl.int64) * runs_h + rows  # [BM]
    if HAS_START:
        start = tl.load(START + run_offs, mask=row_ok, other=0)
    else:
        start = rows + offset
    if HAS_LENGTH:
        length = tl.load(LENGTH + run_offs, mask=row_ok, other=0)
    else:
        length = tl.zeros_like(rows) + width
    lo = tl.maximum(start, 0)
    hi = tl.minimum(start + length, M)
    if CAUSAL:
        hi = tl.minimum(hi, rows + 1)
    hi = tl.where(row_ok, hi, 0)
    filled = lo < hi
    tile_lo = tl.min(tl.where(filled, lo, 2147483647), axis=0)
    tile_hi = tl.max(tl.where(filled, hi, 0), axis=0)
    return lo, hi, tile_lo, tile_hi


@triton.jit
def _tile_scores(q, k_base, keys, lo, hi, offs_d, M, qk_scale, D: tl.constexpr, PRECISION: tl.constexpr):
    """Scores (log2 units) [BM, BN] of q [BM, BD] against keys [BN], -inf outside each row's run;
    also returns the key tile [BN, BD] (input dtype)."""
    kt = tl.load(k_base + keys[:, None] * D + offs_d[None, :], mask=(keys[:, None] < M) & (offs_d[None, :] < D), other=0.0)
    s = tl.dot(q, tl.trans(kt), input_precision=PRECISION) * qk_scale
    in_run = (keys[None, :] >= lo[:, None]) & (keys[None, :] < hi[:, None])
    return tl.where(in_run, s, float("-inf")), kt


@triton.jit
def _runs_fwd_kernel(
    Q,
    K,
    V,
    START,
    LENGTH,
    OUT,
    LSE,
    N,
    M,
    HQ,
    GROUP,
    qk_scale,
    runs_b,
    runs_h,
    offset,
    width,
    D: tl.constexpr,
    DV: tl.constexpr,
    CAUSAL: tl.constexpr,
    HAS_START: tl.constexpr,
    HAS_LENGTH: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    pid_m, bh = tl.program_id(0), tl.program_id(1)
    kv_bh = (bh // HQ) * (HQ // GROUP) + (bh % HQ) // GROUP
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d, offs_dv, offs_n = tl.arange(0, BLOCK_D), tl.arange(0, BLOCK_DV), tl.arange(0, BLOCK_N)
    row_ok = rows < N
    row_offs = bh.to(tl.int64) * N + rows  # [BM] flat row number
    lo, hi, tile_lo, tile_hi = _row_runs(
        START, LENGTH, bh, rows, row_ok, M, HQ, runs_b, runs_h, offset, width, CAUSAL, HAS_START, HAS_LENGTH
    )
    q = tl.load(Q + row_offs[:, None] * D + offs_d[None, :], mask=row_ok[:, None] & (offs_d[None, :] < D), other=0.0)
    k_base, v_base = K + kv_bh.to(tl.int64) * M * D, V + kv_bh.to(tl.int64) * M * DV
    m_i = tl.full([BLOCK_M], -1e30, tl.float32)  # finite start: fully masked rows give exp2(-inf) = 0
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    for key_start in range(tile_lo, tile_hi, BLOCK_N):
        keys = key_start + offs_n
        s, _ = _tile_scores(q, k_base, keys, lo, hi, offs_d, M, qk_scale, D, PRECISION)
        vt = tl.load(
            v_base + keys[:, None] * DV + offs_dv[None, :], mask=(keys[:, None] < M) & (offs_dv[None, :] < DV), other=0.0
        )
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt, input_precision=PRECISION)
        m_i = m_new
    has_key = l_i > 0
    out = acc / tl.where(has_key, l_i, 1.0)[:, None]
    tl.store(
        OUT + row_offs[:, None] * DV + offs_dv[None, :],
        out.to(OUT.dtype.element_ty),
        mask=row_ok[:, None] & (offs_dv[None, :] < DV),
    )
    lse = tl.where(has_key, m_i + tl.log2(tl.where(has_key, l_i, 1.0)), float("inf"))  # +inf zeroes empty rows in backward
    tl.store(LSE + row_offs, lse, mask=row_ok)


@triton.jit
def _runs_bwd_kernel(
    Q,
    K,
    V,
    START,
    LENGTH,
    OUT,
    DOUT,
    LSE,
    DQ,
    DK,
    DV_,
    N,
    M,
    HQ,
    GROUP,
    scale,
    qk_scale,
    runs_b,
    runs_h,
    offset,
    width,
    D: tl.constexpr,
    DV: tl.constexpr,
    CAUSAL: tl.constexpr,
    HAS_START: tl.constexpr,
    HAS_LENGTH: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    pid_m, bh = tl.program_id(0), tl.program_id(1)
    kv_bh = (bh // HQ) * (HQ // GROUP) + (bh % HQ) // GROUP
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d, offs_dv, offs_n = tl.arange(0, BLOCK_D), tl.arange(0, BLOCK_DV), tl.arange(0, BLOCK_N)
    row_ok = rows < N
    d_ok, dv_ok = offs_d < D, offs_dv < DV
    row_offs = bh.to(tl.int64) * N + rows  # [BM] flat row number
    lo, hi, tile_lo, tile_hi = _row_runs(
        START, LENGTH, bh, rows, row_ok, M, HQ, runs_b, runs_h, offset, width, CAUSAL, HAS_START, HAS_LENGTH
    )
    q = tl.load(Q + row_offs[:, None] * D + offs_d[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    o_ptrs = row_offs[:, None] * DV + offs_dv[None, :]
    o = tl.load(OUT + o_ptrs, mask=row_ok[:, None] & dv_ok[None, :], other=0.0).to(tl.float32)
    do = tl.load(DOUT + o_ptrs, mask=row_ok[:, None] & dv_ok[None, :], other=0.0)
    delta = tl.sum(o * do.to(tl.float32), axis=1)  # [BM]: sum_j p_j dp_j
    lse = tl.load(LSE + row_offs, mask=row_ok, other=float("inf"))
    k_base, v_base = kv_bh.to(tl.int64) * M * D, kv_bh.to(tl.int64) * M * DV
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for key_start in range(tile_lo, tile_hi, BLOCK_N):
        keys = key_start + offs_n
        key_ok = keys < M
        s, kt = _tile_scores(q, K + k_base, keys, lo, hi, offs_d, M, qk_scale, D, PRECISION)
        v_offs = v_base + keys[:, None] * DV + offs_dv[None, :]
        vt = tl.load(V + v_offs, mask=key_ok[:, None] & dv_ok[None, :], other=0.0)
        p = tl.exp2(s - lse[:, None])  # [BM, BN]
        dp = tl.dot(do, tl.trans(vt), input_precision=PRECISION)
        ds = (p * (dp - delta[:, None])).to(q.dtype)
        dq += tl.dot(ds, kt, input_precision=PRECISION)
        dk_tile = tl.dot(tl.trans(ds), q, input_precision=PRECISION) * scale  # [BN, BD]
        dv_tile = tl.dot(tl.trans(p.to(do.dtype)), do, input_precision=PRECISION)  # [BN, BDV]
        k_offs = k_base + keys[:, None] * D + offs_d[None, :]
        tl.atomic_add(DK + k_offs, dk_tile, mask=key_ok[:, None] & d_ok[None, :], sem="relaxed")
        tl.atomic_add(DV_ + v_offs, dv_tile, mask=key_ok[:, None] & dv_ok[None, :], sem="relaxed")
    dq = dq * scale
    tl.store(DQ + row_offs[:, None] * D + offs_d[None, :], dq.to(DQ.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


LOG2E = 1.4426950408889634


def _blocks(q: Tensor, dim_v: int, backward: bool) -> dict:
    """Tile sizes (tl.dot needs every side >= 16). Not tuned on a GPU: FlashAttention-like guesses;
    the interpreter (CPU) gets 16 x 16 tiles, which are fast there and exercise the tile loops."""
    block_d = max(16, triton.next_power_of_2(q.shape[-1]))
    block_dv = max(16, triton.next_power_of_2(dim_v))
    if q.device.type == "cpu":
        block_m = block_n = 16
    elif q.dtype == torch.float32 and max(block_d, block_dv) > 128:  # 64-wide fp32 tiles overflow shared memory (sm_90)
        block_m = block_n = 32
    else:
        block_m, block_n = (64, 32) if backward else (64, 64)
    precision = "ieee" if q.dtype == torch.float32 else "tf32"  # fp32 stays exact; 16-bit ignores it
    return dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d, BLOCK_DV=block_dv, PRECISION=precision, num_warps=4)


def _run_args(q: Tensor, start: Tensor | None, length: Tensor | None, offset: int, width: int) -> tuple[list, dict]:
    """The kernels' run arguments: START, LENGTH (q as a dummy pointer where absent), the batch and
    head strides of the given ones (0 where broadcast), offset and width, and the constexpr flags."""
    given = [x for x in (start, length) if x is not None]
    strides = (0, 0)
    if given:
        shape = torch.broadcast_shapes(*(x.shape for x in given))  # [B or 1, Hq or 1, N]
        if len(shape) != 3 or shape[0] not in (1, q.shape[0]) or shape[1] not in (1, q.shape[1]) or shape[2] != q.shape[2]:
            raise ValueError(f"runs must be [B or 1, Hq or 1, N] for q {tuple(q.shape)}, got {tuple(shape)}")
        strides = (shape[1] * shape[2] if shape[0] > 1 else 0, shape[2] if shape[1] > 1 else 0)
        start, length = (None if x is None else x.expand(shape).contiguous() for x in (start, length))
    pointers = [q if x is None else x for x in (start, length)]
    flags = dict(HAS_START=start is not None, HAS_LENGTH=length is not None)
    return [*pointers, *strides, offset, width], flags


def _runs_forward(q, k, v, start, length, offset, width, scale, causal, kernel=_runs_fwd_kernel) -> tuple[Tensor, Tensor]:
    """Launch the forward kernel (``wrap_triton`` of it in the ``triton_op`` twin). Returns out
    [B, Hq, N, Dv] (q.dtype) and lse [B, Hq, N] fp32 (log2)."""
    batch, q_heads, n_queries, dim = q.shape
    out = torch.empty(batch, q_heads, n_queries, v.shape[-1], dtype=q.dtype, device=q.device)
    lse = torch.empty(batch, q_heads, n_queries, dtype=torch.float32, device=q.device)
    blocks = _blocks(q, v.shape[-1], backward=False)
    grid = (triton.cdiv(n_queries, blocks["BLOCK_M"]), batch * q_heads)
    (start, length, *run_sizes), flags = _run_args(q, start, length, offset, width)
    kernel[grid](
        q,
        k,
        v,
        start,
        length,
        out,
        lse,
        n_queries,
        k.shape[2],
        q_heads,
        q_heads // k.shape[1],
        scale * LOG2E,
        *run_sizes,
        D=dim,
        DV=v.shape[-1],
        CAUSAL=causal,
        **flags,
        **blocks,
    )
    return out, lse


def _runs_backward(
    q, k, v, start, length, offset, width, out, grad_out, lse, scale, causal, kernel=_runs_bwd_kernel
) -> tuple[Tensor, Tensor, Tensor]:
    """Launch the backward kernel (``wrap_triton`` of it in the ``triton_op`` twin). Returns dq,
    dk, dv in the input dtypes (dk, dv summed in fp32)."""
    batch, q_heads, n_queries, dim = q.shape
    dq = torch.empty_like(q)
    dk = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
    dv = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
    blocks = _blocks(q, v.shape[-1], backward=True)
    grid = (triton.cdiv(n_queries, blocks["BLOCK_M"]), batch * q_heads)
    (start, length, *run_sizes), flags = _run_args(q, start, length, offset, width)
    kernel[grid](
        q,
        k,
        v,
        start,
        length,
        out,
        grad_out,
        lse,
        dq,
        dk,
        dv,
        n_queries,
        k.shape[2],
        q_heads,
        q_heads // k.shape[1],
        scale,
        scale * LOG2E,
        *run_sizes,
        D=dim,
        DV=v.shape[-1],
        CAUSAL=causal,
        **flags,
        **blocks,
    )
    return dq, dk.to(k.dtype), dv.to(v.dtype)


@torch.library.custom_op(op_name("runs_fwd"), mutates_args=())
def runs_fwd(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    start: Optional[Tensor],
    length: Optional[Tensor],
    offset: int,
    width: int,
    scale: float,
    causal: bool,
) -> tuple[Tensor, Tensor]:
    """``sparsefocus::runs_fwd``: out [B, Hq, N, Dv] (q.dtype) and the base-2 log-sum-exp
    [B, Hq, N] fp32 (+inf for an empty run). q, k, v in one dtype; start, length int32
    [B or 1, Hq or 1, N], or None: query i's run starts at i + offset, or is width keys long.
    Differentiable in q, k, v (backward: ``runs_bwd``); the log-sum-exp output gets no gradient."""
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    return _runs_forward(q, k, v, start, length, offset, width, scale, causal)


@runs_fwd.register_fake
def _runs_fwd_fake(q, k, v, start, length, offset, width, scale, causal):
    return q.new_empty(*q.shape[:3], v.shape[-1]), q.new_empty(q.shape[:3], dtype=torch.float32)


@torch.library.custom_op(op_name("runs_bwd"), mutates_args=())
def runs_bwd(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    start: Optional[Tensor],
    length: Optional[Tensor],
    offset: int,
    width: int,
    out: Tensor,
    grad_out: Tensor,
    lse: Tensor,
    scale: float,
    causal: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """``sparsefocus::runs_bwd``: dq, dk, dv (input dtypes) from ``runs_fwd``'s out and log-sum-exp."""
    q, k, v, out, grad_out, lse = (x.contiguous() for x in (q, k, v, out, grad_out, lse))
    return _runs_backward(q, k, v, start, length, offset, width, out, grad_out, lse, scale, causal)


@runs_bwd.register_fake
def _runs_bwd_fake(q, k, v, start, length, offset, width, out, grad_out, lse, scale, causal):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _runs_setup(ctx, inputs, output) -> None:
    q, k, v, start, length, offset, width, scale, causal = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, start, length, out, lse)
    ctx.offset, ctx.width, ctx.scale, ctx.causal = offset, width, scale, causal
    ctx.set_materialize_grads(False)  # the log-sum-exp's gradient is never read: no zeros for it


def _runs_grads(ctx, grad_out: Tensor | None, grad_lse: Tensor | None):
    """Gradients of q, k, v (through ``runs_bwd``, or its twin after a twin's forward); the
    log-sum-exp output is not differentiated (``grad_lse`` unused)."""
    q, k, v, start, length, out, lse = ctx.saved_tensors
    grad_out = torch.zeros_like(out) if grad_out is None else grad_out
    backward = runs_bwd_traced if ctx.traced else runs_bwd
    dq, dk, dv = backward(q, k, v, start, length, ctx.offset, ctx.width, out, grad_out, lse, ctx.scale, ctx.causal)
    return dq, dk, dv, None, None, None, None, None, None


runs_fwd.register_autograd(_runs_grads, setup_context=traced_setup(_runs_setup, False))


@torch.library.triton_op(op_name("runs_fwd_traced"), mutates_args=())
def runs_fwd_traced(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    start: Optional[Tensor],
    length: Optional[Tensor],
    offset: int,
    width: int,
    scale: float,
    causal: bool,
) -> tuple[Tensor, Tensor]:
    """``sparsefocus::runs_fwd_traced``: ``runs_fwd``'s ``triton_op`` twin (same arguments and
    results; ``_ops.TRITON_OPS``). Compiled on CUDA, Inductor traces this body and launches the
    kernel itself. On the CPU it runs eagerly only (Triton's interpreter cannot be traced)."""
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    # wrap_triton named here, on the kernel itself: PyTorch finds a triton_op's kernels in its source
    # (their code enters the compile cache's key)
    return _runs_forward(q, k, v, start, length, offset, width, scale, causal, kernel=wrap_triton(_runs_fwd_kernel))


@torch.library.triton_op(op_name("runs_bwd_traced"), mutates_args=())
def runs_bwd_traced(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    start: Optional[Tensor],
    length: Optional[Tensor],
    offset: int,
    width: int,
    out: Tensor,
    grad_out: Tensor,
    lse: Tensor,
    scale: float,
    causal: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """``sparsefocus::runs_bwd_traced``: ``runs_bwd``'s ``triton_op`` twin."""
    q, k, v, out, grad_out, lse = (x.contiguous() for x in (q, k, v, out, grad_out, lse))
    kernel = wrap_triton(_runs_bwd_kernel)
    return _runs_backward(q, k, v, start, length, offset, width, out, grad_out, lse, scale, causal, kernel=kernel)


runs_fwd_traced.register_autograd(_runs_grads, setup_context=traced_setup(_runs_setup, True))


def _broadcasts(runs: Tensor, q: Tensor) -> bool:
    """Whether [B', H', N] runs broadcast over q's batch and heads (B' in (1, B), H' in (1, Hq))."""
    return runs.shape[0] in (1, q.shape[0]) and runs.shape[1] in (1, q.shape[1])


def _check_runs(q: Tensor, k: Tensor, v: Tensor, start: Tensor | int, width: int | Tensor) -> None:
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"q, k, v must be [B, H, N, D], got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if q.shape[1] % k.shape[1] != 0 or k.shape[:3] != v.shape[:3] or q.shape[-1] != k.shape[-1] or q.shape[0] != k.shape[0]:
        raise ValueError(f"incompatible shapes q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if not isinstance(start, Tensor):
        if not isinstance(start, int):
            raise ValueError(f"start must be an integer tensor or an int offset, got {type(start).__name__}")
    elif start.dim() != 3 or start.shape[-1] != q.shape[2] or start.is_floating_point() or not _broadcasts(start, q):
        raise ValueError(
            f"start must be an integer tensor [B or 1, Hq or 1, N] with N = {q.shape[2]}, got {start.dtype} {tuple(start.shape)}"
        )
    if isinstance(width, Tensor):
        if width.dim() != 3 or width.shape[-1] != q.shape[2] or width.is_floating_point() or not _broadcasts(width, q):
            raise ValueError(f"width as a tensor must be integer [B or 1, Hq or 1, N], got {width.dtype} {tuple(width.shape)}")
    elif int(width) < 0:
        raise ValueError(f"width must be >= 0, got {width}")


def run_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    start: Tensor | int,
    width: int | Tensor,
    *,
    scale: float | None = None,
    causal: bool = False,
    return_lse: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """Softmax attention of each query over a contiguous run of keys, fused in Triton (fwd and bwd).

    Same signature and result as ``run_attention_ref``::

        query i: keys j in [start_i, start_i + width_i) with 0 <= j < M (and j <= i if causal)
        out[i] = softmax_j(scale * q_i . k_j) @ v_j

    Args:
        q: [B, Hq, N, D]; k: [B, Hk, M, D]; v: [B, Hk, M, Dv]; Hq % Hk == 0 (query head h reads
            kv head h // (Hq // Hk)). fp16, bf16 or fp32 (the interpreter on CPU: fp16/fp32).
        start: [B or 1, Hq or 1, N] integer first key of each run (may be negative or >= M; the
            run is clipped), or an int o: query i's run starts at i + o (a band; no tensor to build
            or read). Starts may overlap and need not be sorted, but a tile of consecutive
            queries costs the union of their runs, so sorted or banded starts are the fast case.
        width: W >= 0 keys per run, or an integer tensor [B or 1, Hq or 1, N] of per-query lengths.
        scale: multiplies q.k. Default: 1/sqrt(D).
        causal: also drop keys j > i.
        return_lse: also return each row's log-sum-exp. Default: False.
    Returns:
        out [B, Hq, N, Dv] in q.dtype; rows whose run is empty are zero. With ``return_lse``,
        (out, lse): lse [B, Hq, N] fp32 = log sum_j exp(scale * q_i . k_j) over the row's keys
        (natural log, -inf for an empty run), detached: no gradient flows through it.
    """
    _check_runs(q, k, v, start, width)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    rows = (q.shape[0], q.shape[1], q.shape[2])
    if q.shape[2] == 0:  # no query: nothing to launch
        out = run_attention_ref(q, k, v, start, width, scale=scale, causal=causal).to(q.dtype)
        return (out, q.new_zeros(rows, dtype=torch.float32)) if return_lse else out
    # broadcast [B or 1, Hq or 1, N] int32 runs, read through strides; none for an offset or a width
    start32 = start.to(torch.int32) if isinstance(start, Tensor) else None
    length = width.to(torch.int32) if isinstance(width, Tensor) else None
    offset = 0 if isinstance(start, Tensor) else int(start)
    fixed = 0 if isinstance(width, Tensor) else int(width)
    if k.shape[2] == 0:  # no key: one zero key row that no run reaches, so every row is empty
        k = torch.cat([k, k.new_zeros(*k.shape[:2], 1, k.shape[-1])], dim=2)
        v = torch.cat([v, v.new_zeros(*v.shape[:2], 1, v.shape[-1])], dim=2)
        length, fixed = None, 0
    forward = runs_fwd_traced if triton_op_chosen(q) else runs_fwd
    out, lse = forward(q, k.to(q.dtype), v.to(q.dtype), start32, length, offset, fixed, scale, causal)
    return (out, lse_from_log2(lse.detach())) if return_lse else out

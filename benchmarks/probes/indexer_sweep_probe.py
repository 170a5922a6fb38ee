"""DSA indexer top-k on one GPU: where the sampled path's sweep spends its time, and what might
replace it. Same inputs for every variant; each variant's positions are checked against the
exact path's. B=4, h=4, d=64, kk=2048, causal.

Variants: the exact path (two select tilings), the sampled path (tile sweep, a larger sample
chunk), and a prototype that keeps the scores chunk and compacts each row's keys at or above the
sampled cut in a row-wise pass (``_compact_kernel``) instead of the fused sweep. Components on the
last 8,192-row chunk: the sweep, the sweep counting only, the scores chunk, the compaction.
Writes indexer_sweep_probe.json to the folder given, after every measurement."""

from __future__ import annotations

import json
import os
import sys
import time

import torch
import triton
import triton.language as tl

import sparsefocus.kernels.indexer_topk as it
from sparsefocus.kernels.indexer_topk import _allowed_keys, _collect_row, _kth_key, _score_tile, _scores
from sparsefocus.kernels.topk_select import _ordered_bits


@triton.jit
def _count_sweep_kernel(
    IQ, IK, W, PAD, T, COUNT, row0, R, N, M,
    H: tl.constexpr, D: tl.constexpr, CAUSAL: tl.constexpr, HAS_PAD: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """The sweep without its compaction: scores and the count of keys at or above the cut."""
    pid, b = tl.program_id(0), tl.program_id(1)
    local = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    rows = row0 + local
    row_ok = (local < R) & (rows < N)
    cut = tl.load(T + b * R + local, mask=row_ok, other=2147483647)
    count = tl.zeros([BLOCK_M], tl.int32)
    hi = tl.minimum(M, row0 + pid * BLOCK_M + BLOCK_M) if CAUSAL else M
    for start in range(0, hi, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        total = _score_tile(IQ, IK, W, b, rows, row_ok, cols, N, M, H, D, PRECISION, BLOCK_M, BLOCK_N, BLOCK_D)
        valid = _allowed_keys(PAD, b, rows, row_ok, cols, M, CAUSAL, HAS_PAD)
        score = tl.where(valid & (total != 0.0), total, 0.0)
        count += tl.sum((valid & (_ordered_bits(score) >= cut[:, None])).to(tl.int32), axis=1)
    tl.store(COUNT + b * R + local, count, mask=row_ok)


@triton.jit
def _query_rows(IQ, b, h, rows, row_ok, N, D: tl.constexpr, H: tl.constexpr, BLOCK_D: tl.constexpr):
    offs_d = tl.arange(0, BLOCK_D)
    ptrs = IQ + ((b * H + h) * N + rows[:, None]).to(tl.int64) * D + offs_d[None, :]
    return tl.load(ptrs, mask=row_ok[:, None] & (offs_d[None, :] < D), other=0.0)


@triton.jit
def _sweep_h4_kernel(
    IQ, IK, W, PAD, T, BUF_S, BUF_P, COUNT, row0, R, N, M, CAP,
    H: tl.constexpr, D: tl.constexpr, CAUSAL: tl.constexpr, HAS_PAD: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """The sweep with its four heads' query rows and weights loaded once, before the key loop."""
    pid, b = tl.program_id(0), tl.program_id(1)
    local = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    rows = row0 + local
    row_ok = (local < R) & (rows < N)
    cut = tl.load(T + b * R + local, mask=row_ok, other=2147483647)
    buffer = (b * R + local).to(tl.int64) * CAP
    q0 = _query_rows(IQ, b, 0, rows, row_ok, N, D, H, BLOCK_D)
    q1 = _query_rows(IQ, b, 1, rows, row_ok, N, D, H, BLOCK_D)
    q2 = _query_rows(IQ, b, 2, rows, row_ok, N, D, H, BLOCK_D)
    q3 = _query_rows(IQ, b, 3, rows, row_ok, N, D, H, BLOCK_D)
    wp = W + (b * N + rows).to(tl.int64) * H
    w0 = tl.load(wp, mask=row_ok, other=0.0)[:, None]
    w1 = tl.load(wp + 1, mask=row_ok, other=0.0)[:, None]
    w2 = tl.load(wp + 2, mask=row_ok, other=0.0)[:, None]
    w3 = tl.load(wp + 3, mask=row_ok, other=0.0)[:, None]
    offs_d = tl.arange(0, BLOCK_D)
    count = tl.zeros([BLOCK_M], tl.int32)
    hi = tl.minimum(M, row0 + pid * BLOCK_M + BLOCK_M) if CAUSAL else M
    for start in range(0, hi, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        key_ptrs = IK + (b * M + cols[:, None]).to(tl.int64) * D + offs_d[None, :]
        keys = tl.trans(tl.load(key_ptrs, mask=(cols[:, None] < M) & (offs_d[None, :] < D), other=0.0))
        total = w0 * tl.maximum(tl.dot(q0, keys, input_precision=PRECISION), 0.0)
        total += w1 * tl.maximum(tl.dot(q1, keys, input_precision=PRECISION), 0.0)
        total += w2 * tl.maximum(tl.dot(q2, keys, input_precision=PRECISION), 0.0)
        total += w3 * tl.maximum(tl.dot(q3, keys, input_precision=PRECISION), 0.0)
        valid = _allowed_keys(PAD, b, rows, row_ok, cols, M, CAUSAL, HAS_PAD)
        score = tl.where(valid & (total != 0.0), total, 0.0)
        hit = valid & (_ordered_bits(score) >= cut[:, None])
        slot = count[:, None] + tl.cumsum(hit.to(tl.int32), axis=1) - 1
        keep = hit & (slot < CAP)
        tl.store(BUF_S + buffer[:, None] + slot, score, mask=keep)
        tl.store(BUF_P + buffer[:, None] + slot, cols[None, :] + tl.zeros([BLOCK_M, BLOCK_N], tl.int32), mask=keep)
        count += tl.sum(hit.to(tl.int32), axis=1)
    tl.store(COUNT + b * R + local, count, mask=row_ok)


@triton.jit
def _compact_kernel(
    S, T, BUF_S, BUF_P, COUNT, row_start, buf0, R, RB, N, M, CAP, CAUSAL: tl.constexpr, BLOCK: tl.constexpr
):  # fmt: skip
    """One row of the scores chunk [B, R, M]: its keys at or above the row's cut T into its buffer
    row buf0 + r of [B, RB, CAP], in position order; COUNT gets how many (also past CAP)."""
    local, b = tl.program_id(0), tl.program_id(1)
    row = row_start + local
    if row < N:
        limit = tl.minimum(M, row + 1) if CAUSAL else M
        S_row = S + (b * R + local).to(tl.int64) * M
        i = b * RB + buf0 + local
        cut = tl.load(T + i)
        buf_s = BUF_S + i.to(tl.int64) * CAP
        buf_p = BUF_P + i.to(tl.int64) * CAP
        count = tl.zeros([], tl.int32)
        for start in range(0, limit, BLOCK):
            pos = start + tl.arange(0, BLOCK)
            score = tl.load(S_row + pos, mask=pos < M, other=0.0)
            valid = pos < limit
            score = tl.where(valid & (score != 0.0), score, 0.0)
            hit = valid & (_ordered_bits(score) >= cut)
            slot = count + tl.cumsum(hit.to(tl.int32), axis=0) - 1
            keep = hit & (slot < CAP)
            tl.store(buf_s + slot, score, mask=keep)
            tl.store(buf_p + slot, pos, mask=keep)
            count += tl.sum(hit.to(tl.int32))
        tl.store(COUNT + i, count)


@triton.jit
def _cut_select_kernel(
    S, T, BUF_S, BUF_P, OUT, row0, R, N, M, CAP, KK: tl.constexpr, CAUSAL: tl.constexpr, BLOCK: tl.constexpr
):  # fmt: skip
    """One row of the scores chunk [B, R, M]: its keys at or above the sampled cut T compacted into
    the row's buffer [CAP]; the kk best by radix select over the buffer when it holds them all,
    else over the whole row (the exact select), so no row needs a second pass."""
    local, b = tl.program_id(0), tl.program_id(1)
    row = row0 + local
    if row < N:
        limit = tl.minimum(M, row + 1) if CAUSAL else M
        S_row = S + (b * R + local).to(tl.int64) * M
        i = b * R + local
        cut0 = tl.load(T + i)
        buf_s = BUF_S + i.to(tl.int64) * CAP
        buf_p = BUF_P + i.to(tl.int64) * CAP
        count = tl.zeros([], tl.int32)
        for start in range(0, limit, BLOCK):
            pos = start + tl.arange(0, BLOCK)
            score = tl.load(S_row + pos, mask=pos < M, other=0.0)
            valid = pos < limit
            score = tl.where(valid & (score != 0.0), score, 0.0)
            hit = valid & (_ordered_bits(score) >= cut0)
            slot = count + tl.cumsum(hit.to(tl.int32), axis=0) - 1
            keep = hit & (slot < CAP)
            tl.store(buf_s + slot, score, mask=keep)
            tl.store(buf_p + slot, pos, mask=keep)
            count += tl.sum(hit.to(tl.int32))
        out = OUT + (b * N + row).to(tl.int64) * KK
        if (count <= CAP) & ((count >= KK) | (cut0 == -2147483648)):
            cut, ties, held = _kth_key(buf_s, buf_s, count, CAP, KK, False, BLOCK)
            _collect_row(buf_s, buf_s, buf_p, out, count, CAP, cut, ties, held <= KK, KK, False, True, BLOCK)
        else:
            cut, ties, allowed = _kth_key(S_row, S_row, limit, M, KK, False, BLOCK)
            _collect_row(S_row, S_row, S_row, out, limit, M, cut, ties, allowed <= KK, KK, False, False, BLOCK)


def _cuts(sample, iq, w, flag, row0, rows, causal, tiles):
    """The sampled path's first two launches: sampled scores and each row's cut."""
    batch, _, n_queries, _ = iq.shape
    chunk, n_sampled = sample.scores.shape[1], sample.ik.shape[1]
    _scores(iq, sample.ik, w, sample.scores, flag, row0, rows, causal, False, it.SAMPLE_STRIDE, tiles)
    it._sample_cut_kernel[(rows, batch)](
        sample.scores, sample.pad, sample.cut, row0, chunk, n_queries, n_sampled, sample.wanted,
        STRIDE=it.SAMPLE_STRIDE, CAUSAL=causal, HAS_PAD=False, BLOCK=tiles["SELECT_BLOCK"], num_warps=tiles["select_warps"],
    )  # fmt: skip


def _buffer_select(sample, flag, out, row0, rows, n_queries, tiles):
    it._buffer_select_kernel[(rows, out.shape[0])](
        sample.kept_scores, sample.kept_positions, sample.count, sample.cut, flag, out, row0,
        sample.scores.shape[1], n_queries, sample.cap, KK=sample.kk, BLOCK=tiles["SELECT_BLOCK"], num_warps=tiles["select_warps"],
    )  # fmt: skip


def _compact_rows(sample, scores, iq, ik, w, row0, rows, causal, tiles, compact_block):
    """The prototype's middle: the scores chunk of each block of rows, then the row-wise compaction."""
    batch, _, n_queries, _ = iq.shape
    chunk, n_keys = scores.shape[1], ik.shape[1]
    dummy = torch.zeros(batch, 1, dtype=torch.int8, device=iq.device)
    for r0 in range(row0, row0 + rows, chunk):
        n = min(chunk, row0 + rows - r0)
        _scores(iq, ik, w, scores, dummy, r0, n, causal, False, 1, tiles)
        _compact_kernel[(n, batch)](
            scores, sample.cut, sample.kept_scores, sample.kept_positions, sample.count, r0, r0 - row0,
            chunk, sample.scores.shape[1], n_queries, n_keys, sample.cap, CAUSAL=causal, BLOCK=compact_block,
            num_warps=tiles["select_warps"],
        )  # fmt: skip


def compact_topk(iq, ik, w, kk, causal, compact_block=1024):
    """The sampled path with the prototype's scores chunk + compaction in place of the sweep."""
    batch, _, n_queries, _ = iq.shape
    n_keys = ik.shape[1]
    tiles = it._tiles(iq)
    out = torch.empty(batch, n_queries, kk, dtype=torch.int32, device=iq.device)
    pad = out
    chunk = max(1, min(n_queries, it.CHUNK_ELEMENTS // (batch * n_keys)))
    scores = torch.empty(batch, chunk, n_keys, dtype=torch.float32, device=iq.device)
    cap = int(it.SAMPLED_CAP_FACTOR * kk)
    sample_chunk = max(1, min(n_queries, it.SAMPLED_BUFFER_BYTES // (8 * batch * cap)))
    sample = it._Sample(iq, ik, pad, False, kk, cap, sample_chunk)
    flag = torch.zeros(batch, sample_chunk, dtype=torch.int8, device=iq.device)
    for s0 in range(0, n_queries, sample_chunk):
        srows = min(sample_chunk, n_queries - s0)
        _cuts(sample, iq, w, flag, s0, srows, causal, tiles)
        _compact_rows(sample, scores, iq, ik, w, s0, srows, causal, tiles, compact_block)
        _buffer_select(sample, flag, out, s0, srows, n_queries, tiles)
        for r0 in range(s0, s0 + srows, chunk):
            rows = min(chunk, s0 + srows - r0)
            marks = flag[:, r0 - s0 :]
            _scores(iq, ik, w, scores, marks, r0, rows, causal, True, 1, tiles)
            it._select(scores, pad, out, marks, r0, rows, chunk, kk, causal, False, True, tiles)
    return out


def cut_select_topk(iq, ik, w, kk, causal, block=1024):
    """Per scores chunk: sampled scores, each row's cut, the scores chunk, ``_cut_select_kernel``."""
    batch, _, n_queries, _ = iq.shape
    n_keys = ik.shape[1]
    tiles = it._tiles(iq)
    out = torch.empty(batch, n_queries, kk, dtype=torch.int32, device=iq.device)
    chunk = max(1, min(n_queries, it.CHUNK_ELEMENTS // (batch * n_keys)))
    scores = torch.empty(batch, chunk, n_keys, dtype=torch.float32, device=iq.device)
    cap = int(it.SAMPLED_CAP_FACTOR * kk)
    sample = it._Sample(iq, ik, out, False, kk, cap, chunk)
    dummy = torch.zeros(batch, 1, dtype=torch.int8, device=iq.device)
    for row0 in range(0, n_queries, chunk):
        rows = min(chunk, n_queries - row0)
        _cuts(sample, iq, w, dummy, row0, rows, causal, tiles)
        _scores(iq, ik, w, scores, dummy, row0, rows, causal, False, 1, tiles)
        _cut_select_kernel[(rows, batch)](
            scores, sample.cut, sample.kept_scores, sample.kept_positions, out, row0, chunk, n_queries, n_keys, cap,
            KK=kk, CAUSAL=causal, BLOCK=block, num_warps=tiles["select_warps"],
        )  # fmt: skip
    return out


def _bench(fn) -> float:
    return triton.testing.do_bench(fn, warmup=1, rep=800)


def _record(path, res):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(res, f, indent=1)
    os.replace(tmp, path)


def _set(sampled=False, buffer_bytes=2**31, tiles=None):
    it.SAMPLED, it.SAMPLED_BUFFER_BYTES = sampled, buffer_bytes
    it.TILE_OVERRIDES.clear()
    it.TILE_OVERRIDES.update(tiles or {})


SWEEP_TILES = {
    "m64n64w4": dict(BLOCK_M=64, BLOCK_N=64, num_warps=4),
    "m128n64w8": dict(BLOCK_M=128, BLOCK_N=64, num_warps=8),
    "m64n128w4": dict(BLOCK_M=64, BLOCK_N=128, num_warps=4),
    "m64n128w8": dict(BLOCK_M=64, BLOCK_N=128, num_warps=8),
    "m32n64w2": dict(BLOCK_M=32, BLOCK_N=64, num_warps=2),
    "m128n128w8": dict(BLOCK_M=128, BLOCK_N=128, num_warps=8),
}


def _variants(n):
    yield "exact", lambda: _set()
    yield "sampled_m64n64w4", lambda: _set(True, tiles=SWEEP_TILES["m64n64w4"])
    yield "cutselect", lambda: _set()
    yield "cutselect_w8", lambda: _set(tiles=dict(select_warps=8))
    yield "compact", lambda: _set(True)
    if n > 20000:
        yield "compact_block2048", lambda: _set(True)
        yield "exact_sel2048w8", lambda: _set(tiles=dict(SELECT_BLOCK=2048, select_warps=8))
        for name, t in SWEEP_TILES.items():
            if name != "m64n64w4":
                yield f"sampled_{name}", (lambda t=t: _set(True, tiles=t))
        yield "sampled_buffer4g", lambda: _set(True, 2**32)


def _components(iq, ik, w, kk, res, key, path):
    """The last 8,192-row chunk's launches, each timed alone."""
    _set(True)
    batch, heads, n, dim = iq.shape
    tiles = it._tiles(iq)
    cap = int(it.SAMPLED_CAP_FACTOR * kk)
    rc = 8192
    row0 = n - rc
    sample = it._Sample(iq, ik, iq, False, kk, cap, rc)
    flag = torch.zeros(batch, rc, dtype=torch.int8, device=iq.device)
    out = torch.empty(batch, n, kk, dtype=torch.int32, device=iq.device)
    _cuts(sample, iq, w, flag, row0, rc, True, tiles)
    bd = max(16, triton.next_power_of_2(dim))
    common = dict(H=heads, D=dim, CAUSAL=True, HAS_PAD=False, PRECISION="tf32x3", BLOCK_D=bd)

    def sweep(t):
        it._sweep_kernel[(triton.cdiv(rc, t["BLOCK_M"]), batch)](
            iq, ik, w, iq, sample.cut, sample.kept_scores, sample.kept_positions, sample.count, row0, rc, n, n, cap,
            BLOCK_M=t["BLOCK_M"], BLOCK_N=t["BLOCK_N"], num_warps=t["num_warps"], **common,
        )  # fmt: skip

    def hoisted(t):
        _sweep_h4_kernel[(triton.cdiv(rc, t["BLOCK_M"]), batch)](
            iq, ik, w, iq, sample.cut, sample.kept_scores, sample.kept_positions, sample.count, row0, rc, n, n, cap,
            BLOCK_M=t["BLOCK_M"], BLOCK_N=t["BLOCK_N"], num_warps=t["num_warps"], **common,
        )  # fmt: skip

    def count_only(t):
        _count_sweep_kernel[(triton.cdiv(rc, t["BLOCK_M"]), batch)](
            iq, ik, w, iq, sample.cut, sample.count, row0, rc, n, n,
            BLOCK_M=t["BLOCK_M"], BLOCK_N=t["BLOCK_N"], num_warps=t["num_warps"], **common,
        )  # fmt: skip

    chunk = it.CHUNK_ELEMENTS // (batch * n)
    scores = torch.empty(batch, chunk, n, dtype=torch.float32, device=iq.device)
    dummy = torch.zeros(batch, 1, dtype=torch.int8, device=iq.device)
    t0 = dict(BLOCK_M=64, BLOCK_N=64, num_warps=4)
    parts = {
        "sweep_m64n64w4": lambda: sweep(t0),
        "count_only_m64n64w4": lambda: count_only(t0),
        "sweep_hoisted_m64n64w4": lambda: hoisted(t0),
        "sweep_hoisted_m64n128w8": lambda: hoisted(dict(BLOCK_M=64, BLOCK_N=128, num_warps=8)),
        "sweep_hoisted_m128n64w8": lambda: hoisted(dict(BLOCK_M=128, BLOCK_N=64, num_warps=8)),
        "scores_chunks": lambda: [
            _scores(iq, ik, w, scores, dummy, r, chunk, True, False, 1, tiles) for r in range(row0, n, chunk)
        ],
        "scores_then_compact": lambda: _compact_rows(sample, scores, iq, ik, w, row0, rc, True, tiles, 1024),
        "buffer_select": lambda: _buffer_select(sample, flag, out, row0, rc, n, tiles),
        "sampled_scores_and_cut": lambda: _cuts(sample, iq, w, flag, row0, rc, True, tiles),
    }
    sweep(t0)
    expected = (sample.count.clone(), sample.kept_positions.clone())
    hoisted(t0)
    held = torch.arange(cap, device=iq.device) < expected[0].clamp(max=cap)[..., None]  # [B, rc, CAP]
    res[f"{key}_hoisted_same_buffers"] = bool(
        torch.equal(expected[0], sample.count) and torch.equal(expected[1][held], sample.kept_positions[held])
    )
    for name, fn in parts.items():
        if f"{key}_part_{name}" in res:
            continue
        fn()
        torch.cuda.synchronize()
        res[f"{key}_part_{name}"] = _bench(fn)
        print(name, res[f"{key}_part_{name}"], flush=True)
        _record(path, res)


def main() -> None:
    out_dir = sys.argv[1]
    lengths = [int(x) for x in sys.argv[2:]] or [65536, 16384]
    path = os.path.join(out_dir, "indexer_sweep_probe_" + "_".join(map(str, lengths)) + ".json")
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__}
    start = time.time()
    for n in lengths:
        torch.manual_seed(0)
        b, h, d, kk = 4, 4, 64, 2048
        iq = torch.randn(b, h, n, d, device="cuda")
        ik = torch.randn(b, n, d, device="cuda")
        w = torch.randn(b, n, h, device="cuda")
        reference = None
        for name, setup in _variants(n):
            key = f"n{n}_{name}"
            setup()
            if name.startswith("cutselect"):
                fn = lambda: cut_select_topk(iq, ik, w, kk, True)  # noqa: E731
            elif name.startswith("compact"):
                block = 2048 if name.endswith("2048") else 1024
                fn = lambda block=block: compact_topk(iq, ik, w, kk, True, block)  # noqa: E731
            else:
                fn = lambda: it.indexer_topk(iq, ik, w, kk, causal=True)  # noqa: E731
            got = fn()
            torch.cuda.synchronize()
            if reference is None:
                reference = got
            res[f"{key}_identical"] = bool(torch.equal(reference, got))
            res[f"{key}_ms"] = _bench(fn)
            print(key, res[f"{key}_ms"], res[f"{key}_identical"], f"{time.time() - start:.0f}s", flush=True)
            _record(path, res)
        if n > 20000:
            _components(iq, ik, w, kk, res, f"n{n}", path)
        del iq, ik, w, reference
        torch.cuda.empty_cache()
    _set()


if __name__ == "__main__":
    main()

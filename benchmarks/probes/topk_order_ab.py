"""Probe: the top-k selection with keys in position order (surplus dropped, no ranking) against
best first (kk rounds of maxima): same keys, and the time of the selection alone and of TOPK:32
attention forward+backward, cuDNN in the same process. B=4, H=16, D=64, bf16, causal."""

import json
import os
import sys

import torch
import torch.nn.functional as F

from sparsefocus.attention.topk import TopK
from sparsefocus.kernels import topk_select as ts

out_dir = sys.argv[1]
lengths = [int(x) for x in sys.argv[2:]] or [4096, 8192, 16384, 65536]
record = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, shape="B=4,H=16,D=64,bf16,causal,kk=32")


def timed(fn, reps=10):
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times)[len(times) // 2]


def save():
    with open(os.path.join(out_dir, "topk_order_ab.json"), "w") as f:
        json.dump(record, f, indent=1)


short = {}  # rows of at most SHORT_MAX_M keys take the one-launch kernel: its position order
for n, kk in ((1000, 32), (600, 5)):
    q, k = (torch.randn(2, 4, n, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    for causal in (True, False):
        best = ts.topk_select(q, k, kk, causal=causal)
        ordered = ts.topk_select(q, k, kk, causal=causal, order="position")
        ascending = torch.where(best < 0, 2**31 - 1, best).sort(-1).values
        short[f"{n}_{kk}_{causal}"] = bool(torch.equal(torch.where(ascending == 2**31 - 1, -1, ascending), ordered))
record["short_rows_same_keys"] = short
print(short, flush=True)
for n in lengths:
    g = torch.Generator(device="cuda").manual_seed(n)
    q, k, v = (torch.randn(4, 16, n, 64, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
    best = ts.topk_select(q, k, 32, causal=True)
    ordered = ts.topk_select(q, k, 32, causal=True, order="position")
    same = torch.equal(torch.where(best < 0, 2**31 - 1, best).sort(-1).values, torch.where(ordered < 0, 2**31 - 1, ordered))  # fmt: skip
    entry = dict(same_keys=bool(same))
    entry["select_score_ms"] = timed(lambda: ts.topk_select(q, k, 32, causal=True))
    entry["select_position_ms"] = timed(lambda: ts.topk_select(q, k, 32, causal=True, order="position"))
    entry["select_score_ms_again"] = timed(lambda: ts.topk_select(q, k, 32, causal=True))
    if n in (8192, 65536):  # finish tiles in position order: (rows, warps)
        sweep = {}
        for rows, warps in [(8, 2), (8, 1), (4, 1), (16, 2), (16, 4), (32, 4)]:
            ts.TILE_OVERRIDES = {"finish": dict(BLOCK_M=rows, num_warps=warps)}
            got = ts.topk_select(q, k, 32, causal=True, order="position")
            ms = timed(lambda: ts.topk_select(q, k, 32, causal=True, order="position"))
            sweep[f"{rows}x{warps}"] = dict(ms=ms, same=bool(torch.equal(got, ordered)))
        ts.TILE_OVERRIDES = {}
        entry["finish_tiles_position"] = sweep
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    grad = torch.randn_like(q)
    pattern = TopK(32)

    def attention(order):
        original = ts.topk_select

        def chosen(*args, **kwargs):
            kwargs["order"] = order
            return original(*args, **kwargs)

        def run():
            ts.topk_select = chosen
            try:
                o = pattern.triton(qg, kg, vg, causal=True, scale=0.125, key_padding_mask=None, params=None)
            finally:
                ts.topk_select = original
            torch.autograd.grad(o, (qg, kg, vg), grad)

        return run

    def cudnn():
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.CUDNN_ATTENTION):
            o = F.scaled_dot_product_attention(qg, kg, vg, is_causal=True)
        torch.autograd.grad(o, (qg, kg, vg), grad)

    entry["topk32_fwd_bwd_score_ms"] = timed(attention("score"))
    entry["topk32_fwd_bwd_position_ms"] = timed(attention("position"))
    entry["cudnn_fwd_bwd_ms"] = timed(cudnn)
    record[str(n)] = entry
    print(n, entry, flush=True)
    save()
    del q, k, v, qg, kg, vg, grad
    torch.cuda.empty_cache()

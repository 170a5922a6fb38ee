"""TOPK:32 fwd+bwd split: selection alone, attention with KEY_GRADS atomic / inverse, cuDNN; ZETA too."""
import json, sys, time, torch
import torch.nn.functional as F
from torch.nn.attention import sdpa_kernel, SDPBackend
from sparsefocus.attention import parse_pattern, sparse_attention
from sparsefocus.kernels import indexed
from sparsefocus.kernels.topk_select import topk_select

out = sys.argv[1]
B, H, D = 4, 16, 64
res = {}
def timeit(fn, reps=10):
    for _ in range(3): fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); fn(); b.record(); torch.cuda.synchronize(); ts.append(a.elapsed_time(b))
    ts.sort(); return ts[len(ts)//2]
for n in (8192, 16384, 65536):
    q, k, v = (torch.randn(B, H, n, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    r = {}
    def dense():
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()
    r["cudnn"] = timeit(dense, 5 if n == 65536 else 10)
    r["select"] = timeit(lambda: topk_select(q.detach(), k.detach(), 32, causal=True))
    idx = topk_select(q.detach(), k.detach(), 32, causal=True)
    for mode in ("atomic", "inverse"):
        def att():
            indexed.indexed_attention(q, k, v, idx, scale=D**-0.5, score="dot", key_grads=mode).sum().backward()
        def fwd():
            with torch.no_grad(): indexed.indexed_attention(q, k, v, idx, scale=D**-0.5, score="dot", key_grads=mode)
        r[f"attn_{mode}"] = timeit(att)
        r[f"attn_fwd_{mode}"] = timeit(fwd)
    def topk():
        sparse_attention(q, k, v, parse_pattern("TOPK:32"), causal=True).sum().backward()
    r["topk_total"] = timeit(topk)
    p = parse_pattern("zeta")
    def zeta():
        sparse_attention(q[..., :p.dk], k[..., :p.dk], v, p, causal=True).sum().backward()
    r["zeta_total"] = timeit(zeta)
    res[n] = r
    print(n, {a: round(b, 3) for a, b in r.items()}, flush=True)
    del q, k, v, idx
    torch.cuda.empty_cache()
json.dump(res, open(out, "w"), indent=1)
from sparsefocus.kernels import indexed_csr
sweep = {}
for n in (16384, 65536):
    q, k, v = (torch.randn(B, H, n, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    idx = topk_select(q.detach(), k.detach(), 32, causal=True)
    for bn, be, w in ((16, 8, 4), (32, 8, 4), (16, 16, 4), (32, 16, 8), (64, 8, 8), (8, 8, 2), (32, 32, 8), (64, 16, 8)):
        indexed_csr.TILES.update(BLOCK_N=bn, BLOCK_E=be, num_warps=w)
        def att():
            indexed.indexed_attention(q, k, v, idx, scale=D**-0.5, score="dot", key_grads="inverse").sum().backward()
        try:
            t = timeit(att, 5)
        except Exception as e:
            t = repr(e)[:100]
        sweep[f"{n}:{bn},{be},{w}"] = t
        print(n, bn, be, w, t, flush=True)
        json.dump({"main": res, "tiles": sweep}, open(out, "w"), indent=1)
    del q, k, v, idx
    torch.cuda.empty_cache()

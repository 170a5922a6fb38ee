"""Probe: attention alternatives at the ListOps folded shape [250, 1, 600, 64] bf16, fwd+bwd."""
import json, os, sys, time
import torch, torch.nn.functional as F
sys.path.insert(0, ".")
from sparsefocus.kernels.topk_select import topk_select
from sparsefocus.kernels.indexed import indexed_attention
from sparsefocus.train.batched import gathered_attention

out = os.environ.get("OUT", "/tmp")
dev = "cuda"
B, H, N, D, K, P = 250, 1, 600, 64, 5, 0.01
torch.manual_seed(0)
q = torch.randn(B, H, N, D, device=dev, dtype=torch.bfloat16, requires_grad=True)
k = torch.randn(B, H, N, D, device=dev, dtype=torch.bfloat16, requires_grad=True)
v = torch.randn(B, H, N, D, device=dev, dtype=torch.bfloat16, requires_grad=True)
go = torch.randn(B, H, N, D, device=dev, dtype=torch.bfloat16)
scale = D ** -0.5

def timeit(fn, reps=30, warm=5):
    for _ in range(warm): fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); fn(); b.record(); torch.cuda.synchronize(); ts.append(a.elapsed_time(b))
    ts.sort(); return ts[len(ts)//2]

def fb(f):
    def run():
        o = f(); o.backward(go)
        q.grad = k.grad = v.grad = None
    return run

with torch.no_grad():
    idx = topk_select(q, k, K).long()
# skewed: two "sink" keys per sequence appear in most rows
skew = idx.clone(); skew[..., 3] = 0; skew[..., 4] = 1
keep = torch.zeros(B, H, N, N, dtype=torch.bool, device=dev).scatter_(-1, idx, True)
res = {}
res["dense_cudnn_dropout"] = timeit(fb(lambda: F.scaled_dot_product_attention(q, k, v, dropout_p=P, scale=scale)))
res["dense_cudnn_nodrop"] = timeit(fb(lambda: F.scaled_dot_product_attention(q, k, v, scale=scale)))
res["masked_sdpa_dropout"] = timeit(fb(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=keep, dropout_p=P, scale=scale)))
res["mask_build"] = timeit(lambda: torch.zeros(B, H, N, N, dtype=torch.bool, device=dev).scatter_(-1, idx, True))
with torch.no_grad():
    res["select_triton"] = timeit(lambda: topk_select(q, k, K))
    res["select_torch_fp32"] = timeit(lambda: torch.matmul(q.float(), k.float().transpose(-1, -2)).topk(K, dim=-1).indices)
res["indexed_triton_random"] = timeit(fb(lambda: indexed_attention(q, k, v, idx, scale=scale)))
res["indexed_triton_skewed"] = timeit(fb(lambda: indexed_attention(q, k, v, skew, scale=scale)))
with torch.no_grad():
    res["indexed_fwd_only"] = timeit(lambda: indexed_attention(q, k, v, idx, scale=scale))
res["gathered_torch_dropout"] = timeit(fb(lambda: gathered_attention(q, k, v, idx, scale, P)))
res["gathered_torch_skewed"] = timeit(fb(lambda: gathered_attention(q, k, v, skew, scale, P)))
# eval chunk shape: 5000 sequences (10 seeds x 500), forward only
qe = torch.randn(5000, 1, N, D, device=dev, dtype=torch.bfloat16); ke = torch.randn_like(qe); ve = torch.randn_like(qe)
with torch.no_grad():
    ie = topk_select(qe, ke, K)
    res["eval5000_select_triton"] = timeit(lambda: topk_select(qe, ke, K), reps=10)
    res["eval5000_dense_dropout_fwd"] = timeit(lambda: F.scaled_dot_product_attention(qe, ke, ve, dropout_p=P, scale=scale), reps=10)
    kp = torch.zeros(5000, 1, N, N, dtype=torch.bool, device=dev).scatter_(-1, ie.long(), True)
    res["eval5000_masked_fwd"] = timeit(lambda: F.scaled_dot_product_attention(qe, ke, ve, attn_mask=kp, dropout_p=P, scale=scale), reps=10)
    res["eval5000_indexed_fwd"] = timeit(lambda: indexed_attention(qe, ke, ve, ie, scale=scale), reps=10)
res = {k2: round(v2, 4) for k2, v2 in res.items()}
print(json.dumps(res, indent=1))
json.dump(res, open(os.path.join(out, "listops_attn_probe.json"), "w"), indent=1)

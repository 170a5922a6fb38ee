"""Attention pieces at the batched ListOps shape (10 seeds x 25 rows, L=600, 1 head, D=64, bf16) on one GPU: SDPA per backend with and without dropout, TOPK:5 selection, masked SDPA and the indexed kernel, one batched linear."""
import json, os, sys, time
sys.path.insert(0, os.getcwd())
import torch, torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench

out = {}
dev = "cuda"
B, H, L, D = 250, 1, 600, 64
def mk(dtype=torch.bfloat16, req=True):
    return [torch.randn(B, H, L, D, device=dev, dtype=dtype, requires_grad=req) for _ in range(3)]
q, k, v = mk()
g = torch.randn(B, H, L, D, device=dev, dtype=torch.bfloat16)
def fb(fn):
    def run():
        o = fn()
        o.backward(g)
    return run
for name, be in [("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION), ("efficient", SDPBackend.EFFICIENT_ATTENTION), ("math", SDPBackend.MATH)]:
    for p in (0.0, 0.01):
        try:
            with sdpa_kernel([be]):
                f = lambda: F.scaled_dot_product_attention(q, k, v, dropout_p=p)
                out[f"sdpa_{name}_p{p}_fwd"] = do_bench(f)
                out[f"sdpa_{name}_p{p}_fwdbwd"] = do_bench(fb(f))
        except Exception as e:
            out[f"sdpa_{name}_p{p}"] = repr(e)[:200]
        print(name, p, {kk: vv for kk, vv in out.items() if name in kk}, flush=True)
# TOPK:5 masked path
from sparsefocus.kernels.topk_select import topk_select
qf, kf = q.detach().float(), k.detach().float()
out["topk_select_fp32"] = do_bench(lambda: topk_select(qf, kf, 5))
out["topk_select_bf16"] = do_bench(lambda: topk_select(q.detach(), k.detach(), 5))
idx = topk_select(qf, kf, 5).long()
def masked():
    keep = torch.zeros(B, H, L, L, dtype=torch.bool, device=dev).scatter_(-1, idx, True)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=keep, dropout_p=0.01)
out["masked_sdpa_fwd"] = do_bench(masked)
out["masked_sdpa_fwdbwd"] = do_bench(fb(masked))
from sparsefocus.kernels.indexed import indexed_attention
ind = lambda: indexed_attention(q, k, v, idx)
out["indexed_k5_fwd"] = do_bench(ind)
out["indexed_k5_fwdbwd"] = do_bench(fb(ind))
# linear layers: baddbmm [10, 15000, 64] x [10, 64, 64]
x = torch.randn(10, 25 * L, 64, device=dev, dtype=torch.bfloat16, requires_grad=True)
w = torch.randn(10, 64, 64, device=dev, dtype=torch.bfloat16, requires_grad=True)
gx = torch.randn(10, 25 * L, 64, device=dev, dtype=torch.bfloat16)
out["bmm_fwdbwd"] = do_bench(lambda: torch.bmm(x, w).backward(gx))
print(json.dumps(out, indent=1))
os.makedirs(os.environ.get("OUT", "."), exist_ok=True)
json.dump(out, open(os.path.join(os.environ.get("OUT", "."), "probe_lab.json"), "w"), indent=1)

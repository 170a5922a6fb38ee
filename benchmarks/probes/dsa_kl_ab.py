"""A/B of DSA's indexer KL at the laboratory's ListOps shape: the Triton kernel against the chunked
PyTorch form, forward with gradients, CUDA events; and their agreement."""
import json, sys
import torch
from sparsefocus.attention import dsa

dev = "cuda"
torch.manual_seed(0)
B, HQ, N, D, H, DI, K = 250, 1, 600, 64, 4, 16, 5
q = torch.randn(B, HQ, N, D, device=dev, dtype=torch.bfloat16)
k = torch.randn(B, 1, N, D, device=dev, dtype=torch.bfloat16)
pos = torch.arange(N, device=dev)
index = (torch.rand(B, 1, N, K, device=dev) * (pos[None, None, :, None] + 1)).long()
index = torch.where(torch.rand(B, 1, N, K, device=dev) < 0.05, -1, index)
iq = torch.randn(B, H, N, DI, device=dev, requires_grad=True)
ik = torch.randn(B, N, DI, device=dev, requires_grad=True)
w = torch.randn(B, N, H, device=dev, requires_grad=True)
res = {}
for choice in ("auto", "torch"):
    dsa.KL_KERNEL = choice
    def step():
        loss = dsa.chunked_indexer_kl(q, k, index, (iq, ik, w), 0.125)
        return [loss, *torch.autograd.grad(loss, (iq, ik, w))]
    for _ in range(3):
        out = step()
    torch.cuda.synchronize()
    times = []
    for _ in range(20):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); step(); b.record(); torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    times.sort()
    res[choice] = {"median_ms": times[len(times) // 2], "min_ms": times[0]}
    res[choice + "_out"] = out
rel = [((x - y).norm() / y.norm()).item() for x, y in zip(res.pop("auto_out"), res.pop("torch_out"))]
res["rel_err_loss_diq_dik_dw"] = rel
res["shape"] = dict(B=B, HQ=HQ, N=N, D=D, H=H, DI=DI, K=K)
res["device"] = torch.cuda.get_device_name()
print(json.dumps(res))
json.dump(res, open(sys.argv[1], "w"), indent=1)

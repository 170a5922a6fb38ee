"""Kernel-by-kernel device time of a fwd+bwd (eager, profiler) for ZETA at 4K and TOPK:32 at 8K, with cuDNN beside."""
import json, sys, torch
from torch.profiler import profile, ProfilerActivity
from torch.nn.attention import sdpa_kernel, SDPBackend
import torch.nn.functional as F
from sparsefocus.attention import parse_pattern, sparse_attention

dev = "cuda" if torch.cuda.is_available() else "cpu"
dt = torch.bfloat16 if dev == "cuda" else torch.float32
out = sys.argv[1] if len(sys.argv) > 1 else "profile.json"
cases = [("zeta", 4096), ("zeta", 16384), ("zeta", 65536), ("TOPK:32", 8192), ("TOPK:32", 65536), ("sdpa", 4096), ("sdpa", 8192), ("sdpa", 65536)] if dev == "cuda" else [("zeta", 256), ("TOPK:32", 256)]
B, H, D = (4, 16, 64) if dev == "cuda" else (1, 2, 16)
record = {}
for name, n in cases:
    q, k, v = (torch.randn(B, H, n, D, device=dev, dtype=dt, requires_grad=True) for _ in range(3))
    def run():
        if name == "sdpa":
            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        elif name == "zeta":
            p = parse_pattern("zeta")
            o = sparse_attention(q[..., :p.dk].contiguous(), k[..., :p.dk].contiguous(), v, p, causal=True)
        else:
            o = sparse_attention(q, k, v, parse_pattern(name), causal=True)
        o.sum().backward()
    for _ in range(3):
        run()
    if dev == "cuda":
        torch.cuda.synchronize()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev == "cuda" else [])
    with profile(activities=acts) as prof:
        for _ in range(5):
            run()
        if dev == "cuda":
            torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", 0) or getattr(e, "cuda_time_total", 0)
        if dev == "cpu":
            t = e.self_cpu_time_total
        if t > 0 and (dev == "cpu" or e.device_type.name == "CUDA"):
            rows.append({"name": e.key[:110], "ms_per_call": t / 5 / 1000, "calls": e.count // 5})
    rows.sort(key=lambda r: -r["ms_per_call"])
    record[f"{name}@{n}"] = {"total_ms": sum(r["ms_per_call"] for r in rows), "kernels": rows[:40]}
    print(name, n, round(record[f"{name}@{n}"]["total_ms"], 3))
    for r in rows[:15]:
        print(f"   {r['ms_per_call']:.4f} x{r['calls']}  {r['name']}")
json.dump(record, open(out, "w"), indent=1)

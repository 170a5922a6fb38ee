"""Probe: where an eager forward+backward spends its host time at 4K (ZETA, TOPK:32, BAND:64;
B=4, H=16, D=64, bf16, causal): wall time per call, device time, the launches, and the CPU
time of the costliest host-side entries of the profiler."""

import json
import os
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from sparsefocus.attention import sparse_attention

out_dir = sys.argv[1]
record = dict(device=torch.cuda.get_device_name(), torch=torch.__version__)
q, k, v = (torch.randn(4, 16, 4096, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
grad = torch.randn_like(q)
for pattern in ("zeta", "TOPK:32", "BAND:64"):

    def step():
        width = 3 if pattern == "zeta" else 64  # ZETA selects on a few channels (the bench's default)
        out = sparse_attention(q[..., :width], k[..., :width], v, pattern, causal=True, impl="triton")
        torch.autograd.grad(out, (q, k, v), grad)

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(20):
        step()
    torch.cuda.synchronize()
    wall = (time.perf_counter() - start) / 20 * 1e3
    start = time.perf_counter()
    for _ in range(20):
        step()
    host = (time.perf_counter() - start) / 20 * 1e3  # without the final sync: the host's own pace when it runs ahead
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            step()
        torch.cuda.synchronize()
    events = prof.key_averages()
    launches = sum(e.count for e in events if e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx"))
    device_ms = sum(e.self_device_time_total for e in events if e.device_type.name == "CUDA") / 5e3
    top = sorted(events, key=lambda e: -e.self_cpu_time_total)[:20]
    record[pattern] = dict(
        wall_ms=wall,
        host_issue_ms=host,
        device_ms=device_ms,
        launches_per_call=launches / 5,
        top_host=[dict(name=e.key[:90], count=e.count // 5, self_cpu_us=e.self_cpu_time_total / 5) for e in top],
    )
    print(pattern, {key: value for key, value in record[pattern].items() if key != "top_host"}, flush=True)
with open(os.path.join(out_dir, "eager_host_profile.json"), "w") as f:
    json.dump(record, f, indent=1)

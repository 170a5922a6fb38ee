import sys, json, os, torch, triton
sys.path.insert(0, ".")
from sparsefocus.kernels import topk_select as ts
mode = sys.argv[1] if len(sys.argv) > 1 else "ncu"
torch.manual_seed(0)
def mk(n, b=4, h=16):
    return [torch.randn(b, h, n, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
if mode == "ncu":
    q, k = mk(16384)
    for _ in range(2):
        ts.topk_select(q, k, 32, causal=True)
    torch.cuda.synchronize()
else:
    res = {}
    for n in (16384, 65536):
        q, k = mk(n)
        # time each kernel via the profiler
        from torch.profiler import profile, ProfilerActivity
        ts.topk_select(q, k, 32, causal=True); torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                ts.topk_select(q, k, 32, causal=True)
            torch.cuda.synchronize()
        per = {}
        for e in prof.key_averages():
            if e.device_type.name == "CUDA" or getattr(e, "self_device_time_total", 0) > 0:
                per[e.key[:60]] = round(getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0)) / 3 / 1000, 3)
        res[n] = per
        print(n, per, flush=True)
    json.dump(res, open(os.path.join(os.environ["OUT"], "topk_kernels.json"), "w"), indent=1)

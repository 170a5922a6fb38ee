import sys, json, os, torch, triton
sys.path.insert(0, "."); sys.path.insert(0, ".ab")
from sparsefocus.kernels import topk_select as ts
import collect_variants as cv
from torch.profiler import profile, ProfilerActivity
orig = ts._collect_kernel

class Variant:
    def __init__(self, kern, v, **over): self.kern, self.v, self.over = kern, v, over
    def __getitem__(self, grid):
        def launch(*a, **kw):
            kw = kw | self.over
            g = (triton.cdiv(a[6], kw["BLOCK_M"]), grid[1])
            return self.kern[g](*a, VARIANT=self.v, **kw)
        return launch

def kernel_ms(fn):
    fn(); torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5): fn()
        torch.cuda.synchronize()
    return {e.key[:30]: round(e.self_device_time_total / 5 / 1000, 3) for e in prof.key_averages() if e.self_device_time_total > 0 and "collect" in e.key}

variants = {
    "v2": Variant(cv._collect_v, 2),
    "v2_bm64": Variant(cv._collect_v, 2, BLOCK_M=64),
    "v2_bm64_w4s2": Variant(cv._collect_v, 2, BLOCK_M=64, num_stages=2),
    "v3": Variant(cv._collect_v3, 3),
    "v4": Variant(cv._collect_v4, 4),
    "v4_bm64": Variant(cv._collect_v4, 4, BLOCK_M=64),
}
res = {}
torch.manual_seed(0)
for n in (16384, 65536):
    q, k = (torch.randn(4, 16, n, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    ts._collect_kernel = orig
    ref = ts.topk_select(q, k, 32, causal=True)
    row = {"orig": kernel_ms(lambda: ts.topk_select(q, k, 32, causal=True))}
    for name, var in variants.items():
        try:
            ts._collect_kernel = var
            out = ts.topk_select(q, k, 32, causal=True)
            row[name + "_equal"] = bool(torch.equal(out, ref))
            row[name] = kernel_ms(lambda: ts.topk_select(q, k, 32, causal=True))
        except Exception as e:
            row[name] = repr(e)[:200]
        print(n, name, row[name], row.get(name + "_equal"), flush=True)
    ts._collect_kernel = orig
    res[n] = row
    del q, k
json.dump(res, open(os.path.join(os.environ.get("OUT", "."), "collect_ab.json"), "w"), indent=1)

import sys, json, os, torch, triton
sys.path.insert(0, "."); sys.path.insert(0, ".ab")
from sparsefocus.kernels import topk_select as new
import topk_select_old as old
from torch.profiler import profile, ProfilerActivity

def kernel_ms(fn):
    fn(); torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5): fn()
        torch.cuda.synchronize()
    return {e.key[:20]: round(e.self_device_time_total / 5 / 1000, 3) for e in prof.key_averages() if e.self_device_time_total > 0 and "_kernel" in e.key}

tiles = {"bm8w4": dict(BLOCK_M=8, num_warps=4), "bm4w2": dict(BLOCK_M=4, num_warps=2), "bm16w4": dict(BLOCK_M=16, num_warps=4),
         "bm8w2": dict(BLOCK_M=8, num_warps=2), "bm16w8": dict(BLOCK_M=16, num_warps=8), "bm8w4dc32": dict(BLOCK_M=8, num_warps=4, BLOCK_DC=32)}
res = {}
torch.manual_seed(0)
for n in (8192, 16384, 65536):
    q, k = (torch.randn(4, 16, n, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    ref, _ = old._launch(q, k, 32, True, None)
    row = {"old": kernel_ms(lambda: old._launch(q, k, 32, True, None))}
    for name, t in tiles.items():
        new.TILE_OVERRIDES["finish"] = t
        try:
            out, _ = new._launch(q, k, 32, True, None)
            row[name + "_equal"] = bool(torch.equal(out, ref))
            if not row[name + "_equal"]:
                row[name + "_rows_differ"] = int((out != ref).any(-1).sum())
            row[name] = kernel_ms(lambda: new._launch(q, k, 32, True, None))
        except Exception as e:
            row[name] = repr(e)[:300]
        print(n, name, row[name], row.get(name + "_equal"), flush=True)
    new.TILE_OVERRIDES.clear()
    print(n, "old", row["old"], flush=True)
    res[n] = row
    del q, k
json.dump(res, open(os.path.join(os.environ.get("OUT", "."), "finish_ab.json"), "w"), indent=1)

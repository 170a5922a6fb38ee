"""A/B: one-sweep short selection vs the previous one-launch kernel; tile sweep."""
import json, os, sys
import torch
sys.path.insert(0, "."); sys.path.insert(0, ".ab")
import topk_select_old as old
from sparsefocus.kernels import topk_select as new
out = os.environ.get("OUT", "/tmp")

def timeit(fn, reps=20, warm=3):
    for _ in range(warm): fn()
    torch.cuda.synchronize(); ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); fn(); b.record(); torch.cuda.synchronize(); ts.append(a.elapsed_time(b))
    ts.sort(); return round(ts[len(ts)//2], 4)

res = {}
torch.manual_seed(0)
cases = [(250, 600, 5, False), (5000, 600, 5, False), (250, 600, 5, True), (64, 1024, 32, True), (64, 1024, 32, False), (250, 45, 5, False)]
for B, M, kk, causal in cases:
    q = torch.randn(B, 1, M, 64, device="cuda", dtype=torch.bfloat16); k = torch.randn_like(q)
    name = f"B{B}_M{M}_k{kk}_{'causal' if causal else 'full'}"
    ref = old._launch_short(q, k, kk, causal, None)
    got = new._launch_short(q, k, kk, causal, None)
    sc = torch.matmul(q.float(), k.float().transpose(-1, -2))
    if causal: sc = sc.masked_fill(~torch.ones(M, M, dtype=torch.bool, device="cuda").tril(), float("-inf"))
    def vals(i): return sc.gather(-1, i.long().clamp_min(0)).masked_fill(i < 0, float("-inf"))
    r = {"same_positions": bool(torch.equal(ref, got)), "max_score_diff": float((vals(ref) - vals(got)).nan_to_num(0).abs().max()),
         "old_ms": timeit(lambda: old._launch_short(q, k, kk, causal, None))}
    for bm in (16, 32, 64):
        for bn in (32, 64, 128):
            for w in (2, 4, 8):
                new.TILE_OVERRIDES["short"] = dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=w)
                try:
                    r[f"new_{bm}x{bn}_w{w}"] = timeit(lambda: new._launch_short(q, k, kk, causal, None))
                except Exception as e:
                    r[f"new_{bm}x{bn}_w{w}"] = str(e)[:80]
    new.TILE_OVERRIDES.pop("short")
    best = min((v, kx) for kx, v in r.items() if kx.startswith("new_") and isinstance(v, float))
    r["best"] = best
    res[name] = r
    print(name, r["same_positions"], r["max_score_diff"], "old", r["old_ms"], "best", best, flush=True)
    json.dump(res, open(os.path.join(out, "short_probe.json"), "w"), indent=1)

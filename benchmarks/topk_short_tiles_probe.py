"""Tile choices of topk_select's short kernel at the ListOps shapes (250 and 5000 rows of 600 keys, kk=5, bf16), each checked against the default tiles."""
import json, os, sys, itertools
sys.path.insert(0, os.getcwd())
import torch
from triton.testing import do_bench
from sparsefocus.kernels import topk_select as ts
res = {}
path = os.path.join(os.environ.get("OUT", "."), "probe_short.json")
for rows in (250, 5000):
    q = torch.randn(rows, 1, 600, 64, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(rows, 1, 600, 64, device="cuda", dtype=torch.bfloat16)
    ts.TILE_OVERRIDES.clear()
    ref = ts.topk_select(q, k, 5)
    res[f"{rows}/default"] = do_bench(lambda: ts.topk_select(q, k, 5))
    res[f"{rows}/fp32"] = do_bench(lambda: ts.topk_select(q.float(), k.float(), 5))
    for bm, dc, w in [(16, 64, 8), (16, 32, 8), (16, 16, 4), (32, 16, 8), (32, 64, 8), (32, 16, 16), (64, 16, 16)]:
        ts.TILE_OVERRIDES["short"] = dict(BLOCK_M=bm, BLOCK_DC=dc, num_warps=w)
        try:
            got = ts.topk_select(q, k, 5)
            ok = bool((got == ref).all())
            res[f"{rows}/{bm}/{dc}/{w}"] = (do_bench(lambda: ts.topk_select(q, k, 5)), ok)
        except Exception as e:
            res[f"{rows}/{bm}/{dc}/{w}"] = repr(e)[:100]
        json.dump(res, open(path, "w"), indent=1)
    print(rows, {kk: v for kk, v in res.items() if kk.startswith(f"{rows}/")}, flush=True)

import sys, json, os, torch
sys.path.insert(0, "."); sys.path.insert(0, "benchmarks")
import gpu_block_sparse as gbs
from sparsefocus.bench.profiling import profile_events, top_kernels, device_ms
dev = torch.device("cuda")
res = {}
for name, pattern, kvh in (("dsa g16", gbs.DSA, 1), ("nsa g16", gbs.NSA, 1)):
    spec = gbs.sf.parse_pattern(pattern)
    import sparsefocus as sf
    from sparsefocus.attention.patterns import AUX_KEY, HIDDEN_KEY
    b, h, n, d = 4, 16, 16384, 64
    params = None
    if spec.name == "dsa":
        weights = spec.make_layer_parameters(h * d, h, kvh, d, d)
        params = {key: w.to("cuda") for key, w in weights.items()}
        params[HIDDEN_KEY] = torch.randn(b, n, h * d, device="cuda", dtype=torch.bfloat16)
    leaves = gbs.inputs(b, h, kvh, n, d)
    def fn(q, k, v):
        call = None if params is None else {**params, AUX_KEY: {}}
        out = sf.sparse_attention(q, k, v, spec, causal=True, params=call)
        return out if call is None else out + 0 * sum(call[AUX_KEY].values())
    g = torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16)
    def step():
        out = fn(*leaves); torch.autograd.grad(out, leaves, g)
    def fwd():
        with torch.no_grad(): fn(*leaves)
    step(); fwd(); torch.cuda.synchronize()
    ev = profile_events(step, dev)
    evf = profile_events(fwd, dev)
    res[name] = {"n": n, "fwd_bwd_device_ms": device_ms(ev, dev), "fwd_bwd_top": top_kernels(ev, dev, 14),
                 "fwd_device_ms": device_ms(evf, dev), "fwd_top": top_kernels(evf, dev, 8)}
    print(name, res[name]["fwd_bwd_device_ms"], res[name]["fwd_device_ms"], flush=True)
    for t in res[name]["fwd_bwd_top"]: print("  ", round(t["ms"], 2), t["calls"], t["name"][:90], flush=True)
    json.dump(res, open(os.path.join(os.environ.get("OUT", "."), "block_sparse_profile_16k.json"), "w"), indent=1)

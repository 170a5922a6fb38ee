"""Forward tile choices of the fused entmax attention at the laboratory's ListOps shape ([250, 1, 601, 64] bf16, keys
padded to lengths 500-600): the default against one-launch forward, 8 warps, 8 Newton steps and 32-row tiles; forward without
gradients and forward+backward, CUDA events, one process. Usage: PYTHONPATH=. python benchmarks/probes/entmax_forward/sweep.py OUT"""

import json
import sys

import torch

import sparsefocus.kernels.entmax_attention as ea

out = sys.argv[1]
torch.manual_seed(0)
R, N, D = 250, 601, 64
q, k, v = (torch.randn(R, 1, N, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
lengths = torch.randint(500, 601, (R,), device="cuda")
mask = torch.arange(N, device="cuda")[None, :] < lengths[:, None]
grad = torch.randn(R, 1, N, D, device="cuda", dtype=torch.bfloat16)
with torch.no_grad():
    ref = ea.entmax_attention(q, k, v, 1.5, D**-0.5, False, mask).float()


def timed(fn, reps=20):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(reps):
        fn()
    e.record()
    torch.cuda.synchronize()
    return s.elapsed_time(e) / reps


def fwd():
    with torch.no_grad():
        return ea.entmax_attention(q, k, v, 1.5, D**-0.5, False, mask)


qg, kg, vg = (t.clone().requires_grad_(True) for t in (q, k, v))


def fwd_bwd():
    o = ea.entmax_attention(qg, kg, vg, 1.5, D**-0.5, False, mask)
    return torch.autograd.grad(o, (qg, kg, vg), grad)


base = dict(TILE=ea.TILE, FWD_WARPS=ea.FWD_WARPS, NEWTON_STEPS=ea.NEWTON_STEPS, SPLIT_FORWARD=ea.SPLIT_FORWARD)
configs = [dict(), dict(SPLIT_FORWARD=False), dict(FWD_WARPS=8), dict(NEWTON_STEPS=8), dict(TILE=32768)]
rows = []
for cfg in configs:
    for name, val in {**base, **cfg}.items():
        setattr(ea, name, val)
    try:
        err = ((fwd().float() - ref).norm() / ref.norm()).item()
        rows.append(dict(cfg=cfg, fwd_nograd_ms=timed(fwd), fwd_bwd_ms=timed(fwd_bwd), rel_to_default=err))
    except Exception as exc:
        rows.append(dict(cfg=cfg, error=str(exc)[:300]))
    print(rows[-1], flush=True)
json.dump(
    dict(device=torch.cuda.get_device_name(), shape=[R, 1, N, D], dtype="bf16", padded_keys="lengths 500-600", rows=rows),
    open(f"{out}/entmax_sweep.json", "w"),
    indent=1,
)

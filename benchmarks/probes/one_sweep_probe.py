"""Probe: the exact top-k selection alone, two sweeps against the one sweep (fold limits), on CUDA.

Positions must equal the two-sweep selection's; times are CUDA-event medians of 10 calls.
Writes OUT/one_sweep_probe.json."""

import json
import os
import sys

import torch
import triton

from sparsefocus.kernels import topk_select as ts

out_dir = sys.argv[1]
variants = {
    "two sweeps": dict(ONE_SWEEP=False),
    "one sweep, fold <= 2048 keys": dict(ONE_SWEEP=True, SWEEP_FOLD_KEYS=2048),
    "one sweep, fold <= 1024 keys": dict(ONE_SWEEP=True, SWEEP_FOLD_KEYS=1024),
    "one sweep, fold <= 4096 keys": dict(ONE_SWEEP=True, SWEEP_FOLD_KEYS=4096),
    "one sweep, fold always": dict(ONE_SWEEP=True, SWEEP_FOLD_KEYS=1 << 30),
    "one sweep, fold <= 2048, prescan 8": dict(ONE_SWEEP=True, SWEEP_FOLD_KEYS=2048, SWEEP_PRESCAN=8),
    "one sweep, fold <= 2048, room 1": dict(ONE_SWEEP=True, SWEEP_FOLD_KEYS=2048, SWEEP_ROOM=1),
    "two sweeps, finish from registers": dict(ONE_SWEEP=False, FINISH_REGISTERS=True),
    "one sweep, fold <= 2048, finish from registers": dict(ONE_SWEEP=True, SWEEP_FOLD_KEYS=2048, FINISH_REGISTERS=True),
}
defaults = {
    name: getattr(ts, name) for name in ("ONE_SWEEP", "SWEEP_FOLD_KEYS", "SWEEP_PRESCAN", "SWEEP_ROOM", "FINISH_REGISTERS")
}
kk, results = 32, []
for n in (4096, 8192, 16384, 65536):
    g = torch.Generator(device="cuda").manual_seed(n)
    q = torch.randn(4, 16, n, 64, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(4, 16, n, 64, device="cuda", dtype=torch.bfloat16, generator=g)
    reference = None
    for name, consts in variants.items():
        for key, value in (defaults | consts).items():
            setattr(ts, key, value)
        got, count = ts._launch(q, k, kk, True, None)
        if reference is None:
            reference = got
        cap = 2 * triton.next_power_of_2(kk)
        times = []
        for _ in range(13):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            ts._launch(q, k, kk, True, None)
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        row = dict(
            n=n,
            variant=name,
            ms=sorted(times[3:])[5],
            equal=bool(torch.equal(got, reference)),
            overflow_rows=int((count > cap).sum()),
            mean_candidates=float(count.clamp(max=cap).float().mean()),
        )
        print(row, flush=True)
        results.append(row)
record = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__, results=results)
tmp = os.path.join(out_dir, "one_sweep_probe.json.tmp")
with open(tmp, "w") as f:
    json.dump(record, f, indent=1)
os.replace(tmp, os.path.join(out_dir, "one_sweep_probe.json"))

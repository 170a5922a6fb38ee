"""Where a folded ListOps step goes (10 seeds, bf16 autocast, fast mode, compiled default): one
uncaptured compiled step profiled by kernel; FULL then TOPK:5."""

import json
import os
import sys
import time
from pathlib import Path
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_lab as g
from sparsefocus.bench.profiling import count_kernels, device_ms, profile_events, top_kernels


def main():
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g.DEVICE = dev
    out = Path(os.environ.get("OUT", "/tmp/labprof"))
    seeds = g.PAPER_SEEDS if dev == "cuda" else g.PAPER_SEEDS[:2]
    res = {}
    for mech in sys.argv[1:] or ["FULL", "TOPK:5"]:
        t = time.time()
        cfg = g.listops(
            out,
            "prof",
            [mech],
            seeds,
            ("high", "bf16" if dev == "cuda" else "none"),
            [],
            "train.compile=" + ("default" if dev == "cuda" else "eager"),
            f"out_dir={os.environ.get('LABCACHE', '/tmp/labcache')}",
        )
        trainer = g.trainer_for(cfg, mech, seeds)
        built = time.time() - t
        params = list(trainer.model.parameters())
        order = torch.stack([torch.randperm(trainer.train_inputs.shape[1], device=dev) for _ in range(trainer.runs)])
        step = lambda i: g.train_step(trainer, order[:, i * 25 : (i + 1) * 25], params)
        trainer.model.train()
        t = time.time()
        step(0)
        step(1)
        g.synchronize()
        compiled = time.time() - t
        ev = profile_events(lambda: step(2), torch.device(dev))
        t = time.time()
        for i in range(3, 13):
            step(i)
        g.synchronize()
        res[mech] = {
            "build_s": built,
            "compile_s": compiled,
            "step_ms_default_mode": (time.time() - t) * 100,
            "device_ms": device_ms(ev, torch.device(dev)),
            "kernels": count_kernels(ev),
            "top": top_kernels(ev, torch.device(dev), 25),
        }
        print(mech, json.dumps(res[mech], indent=0)[:3000], flush=True)
        json.dump(res, open(out / "lab_prof.json", "w"), indent=1)


if __name__ == "__main__":
    main()

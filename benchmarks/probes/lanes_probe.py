"""Probe: which runs of two concurrent 10-run CUDA lanes differ from the groups alone, under which switches."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, os.getcwd())
import torch
from tests.train.test_batched import CUDA_LAB, config, metrics_of
from sparsefocus.train import driver
from sparsefocus.train.experiment import run_experiment

out = Path(sys.argv[1])
tmp = Path("/tmp/lanes_probe")
record = {
    "device": torch.cuda.get_device_name(),
    "torch": torch.__version__,
    "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip(),
    "variants": {},
}
# name: (extra overrides, lane streams, cudnn sdpa)
variants = {
    "streams_cudnn_nodrop": (["model.dropout=0.0"], True, True),
    "streams_nocudnn_nodrop": (["model.dropout=0.0"], True, False),
    "streams_cudnn_nodrop_eager": (["model.dropout=0.0", "train.compile=eager"], True, True),
    "streams_cudnn_nodrop_fullfull": (
        [
            "model.dropout=0.0",
            "mechanisms=[FULL]",
            "seeds=[1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17,18,19,20]",
            "train.batched_max_runs=10",
        ],
        True,
        True,
    ),
    "streams_nocudnn_nodrop_eager": (["model.dropout=0.0", "train.compile=eager"], True, False),
}
for name, (extra, streams, cudnn) in variants.items():
    began = time.time()
    driver.LANE_STREAMS = streams
    torch.backends.cuda.enable_cudnn_sdp(cudnn)
    try:
        lab = (*CUDA_LAB, *extra)
        alone = metrics_of(run_experiment(config(tmp / name / "alone", *lab), quiet=True))
        together = metrics_of(run_experiment(config(tmp / name / "together", *lab, "train.concurrent_groups=2"), quiet=True))
        diffs = {run: max(abs(a["train_loss"] - b["train_loss"]) for a, b in zip(alone[run], together[run])) for run in alone}
        record["variants"][name] = {
            "seconds": round(time.time() - began, 1),
            "max_train_loss_diff": diffs,
            "alone_epoch1": {r: lines[0]["train_loss"] for r, lines in alone.items()},
            "together_epoch1": {r: lines[0]["train_loss"] for r, lines in together.items()},
        }
    except Exception as error:
        record["variants"][name] = {"error": repr(error)[:2000]}
    finally:
        torch.backends.cuda.enable_cudnn_sdp(True)
    (out / "lanes_probe.json").write_text(json.dumps(record, indent=1))
    v = record["variants"][name]
    print(
        name,
        v.get("seconds"),
        {r.split("/", 1)[1]: f"{d:.1e}" for r, d in v.get("max_train_loss_diff", {}).items()} or v,
        flush=True,
    )

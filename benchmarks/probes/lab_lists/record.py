"""Record the masks-vs-lists ListOps throughput (two gpu_lab.py calls) as one JSON and a PNG."""

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

masks, lists, out = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
common = (
    "python3 benchmarks/gpu_lab.py --out OUT --only-throughput --no-reference --precision high --autocast bf16"
    " --compile step-graph --topk-select triton"
)
record = {
    "what": "ListOps Figure-1a training step (10 seeds folded, batch 25, bf16 autocast, TF32, step-graph):"
    " train.fast_attention=masks (SDPA with masks) against lists (indexed kernel over key lists, key"
    " gradients 'auto' = the one-hot short_key_grads kernel at these rows)",
    "commit": "cc65061",
    "device": "NVIDIA H200, torch 2.11.0+cu130, Triton 3.6",
    "runs": {
        "masks": {
            "command": common + " --budget 230 --min-stage 60 --throughput-mechanism TOPK:5 --throughput-mechanism BAND:5"
            ' --throughput-mechanism "BAND:5(1)" --throughput-mechanism "BLOC:5(1)" --set train.fast_attention=masks',
            **json.loads(masks.read_text()),
        },
        "lists": {
            "command": common + " --budget 190 --min-stage 30 --throughput-mechanism BAND:5 --throughput-mechanism TOPK:5"
            " --set train.fast_attention=lists",
            **json.loads(lists.read_text()),
        },
    },
    "note": "two processes on one machine, one after the other; the short_key_grads kernel's share is from each"
    " step's profile",
}
tmp = out.with_suffix(".json.tmp")
tmp.write_text(json.dumps(record, indent=1))
tmp.replace(out.with_suffix(".json"))

cases = ["BAND:5/bf16", "TOPK:5/bf16"]
fig, ax = plt.subplots(figsize=(6, 3.5))
for i, mode in enumerate(("masks", "lists")):
    rows = record["runs"][mode]["throughput"]
    steps = [rows[c]["step_ms"] for c in cases]
    short = [
        sum(k["ms"] for k in rows[c]["step_profile"]["top_kernels"] if k["name"] == "_short_key_grads_kernel")
        for c in cases
    ]
    xs = [j + 0.38 * i for j in range(len(cases))]
    ax.bar(xs, steps, 0.36, label=f"{mode}: step")
    if any(short):
        ax.bar(xs, short, 0.36, hatch="//", fill=False, label=f"{mode}: short_key_grads share")
ax.set_xticks([j + 0.19 for j in range(len(cases))], [c.split("/")[0] for c in cases])
ax.set_ylabel("ms per training step")
ax.set_title("ListOps step, 10 seeds, H200 (cc65061)")
ax.legend(fontsize=8)
fig.tight_layout()
fig.savefig(out.with_suffix(".png"), dpi=120)

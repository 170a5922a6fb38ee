"""Record the fixed-lists timing and the study calls' first epochs as JSON + PNG (one-off)."""

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

forms, study_concurrent, study_alone, out, timing_concurrent, timing_alone = sys.argv[1:7]
lab = json.load(open(forms))
calls = {"two groups at once (BLOC:5, BAND:5(1))": json.load(open(study_concurrent)), "BLOC:5 alone": json.load(open(study_alone))}
record = {
    "what": "ListOps Figure-1a step of BLOC:5 (10 folded seeds, bf16 autocast, TF32, step-graph) with train.fast_attention=masks and fixed-lists in one process; then two study calls resuming BLOC:5 and BAND:5(1) at epoch 25 with fixed-lists, the first compiled with that form",
    "device": lab["device"],
    "torch": lab["torch"],
    "date": "2026-12-03",
    "commit": "b424c70",
    "commands": {
        "forms": "python benchmarks/gpu_lab.py --out OUT/forms --budget 190 --min-stage 30 --only-throughput --no-reference --precision high --autocast bf16 --compile step-graph --topk-select triton --throughput-form masks --throughput-form fixed-lists --throughput-mechanism BLOC:5",
        "two groups at once (BLOC:5, BAND:5(1))": "python benchmarks/gpu_studies.py --study listops_fig1a --precision high --autocast bf16 --concurrent 2 --fast-attention fixed-lists --slim --start-from docs/studies/listops_fig1a/experiment --mechanism BLOC:5 --mechanism 'BAND:5(1)' --out OUT --inbox DIR --budget 420",
        "BLOC:5 alone": "python benchmarks/gpu_studies.py --study listops_fig1a --precision high --autocast bf16 --concurrent 1 --fast-attention fixed-lists --slim --start-from docs/studies/listops_fig1a/experiment --mechanism BLOC:5 --out OUT --inbox DIR --work /tmp/sf-diag --budget 150",
    },
    "forms": lab["throughput"],
    "study_calls": {
        name: {key: call[key] for key in ("progress", "seconds", "compile_cache", "compile_phases_s", "settings")}
        for name, call in calls.items()
    },
    "first_epoch_of_call": {
        name: json.load(open(path))[-1] for name, path in zip(calls, (timing_concurrent, timing_alone))
    },
}
with open(out + ".json", "w") as f:
    json.dump(record, f, indent=1)
cases = list(lab["throughput"])
fig, axes = plt.subplots(1, 2, figsize=(9, 3.2))
axes[0].bar(cases, [lab["throughput"][c]["step_ms"] for c in cases], color=["tab:gray", "tab:blue"])
axes[0].set_ylabel("ms per training step")
axes[1].bar(cases, [lab["throughput"][c]["study_min_200_epochs"] for c in cases], color=["tab:gray", "tab:blue"])
axes[1].set_ylabel("minutes per 200 epochs (with evaluation)")
for ax in axes:
    ax.tick_params(axis="x", labelsize=8)
fig.suptitle(f"ListOps BLOC:5, 10 seeds, bf16, step-graph; {lab['device']}, commit b424c70", fontsize=9)
fig.tight_layout()
fig.savefig(out + ".png", dpi=120)

"""One-off: assemble h200_lab_forms_f808f25.{json,png} from three device outputs.

Usage: python record.py FORMS_JSON GLOBALS_LOG EARLIER_FORMS_JSON OUT_STEM
(FORMS_JSON: gpu_lab.json of the BLOC:5 masks/lists run; GLOBALS_LOG: the printed table of the
BAND:5(1) lists run; EARLIER_FORMS_JSON: gpu_lab.json of the earlier BAND:5(1) masks run)."""

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

forms, globals_log, earlier, stem = sys.argv[1:5]
c2 = json.load(open(forms))
c1 = json.load(open(earlier))
line = [row for row in open(globals_log) if row.startswith("BAND:5(1)/bf16/lists")][0].split()
keys = ("step_ms", "eval_s", "epoch_s", "study_min_200_epochs", "compile_s", "peak_gib")
band_lists = dict(zip(keys, map(float, line[1:7])))
common = "--only-throughput --no-reference --precision high --autocast bf16 --compile step-graph --topk-select triton"
record = {
    "what": "ListOps Figure-1a training step (10 folded seeds, the paper's model, bf16 autocast, TF32, step-graph) "
    "with train.fast_attention=masks (SDPA with the pattern's mask) and lists (indexed kernel over each query's key "
    "list, atomic key gradients; global rows through SDPA)",
    "device": c2["device"],
    "torch": c2["torch"],
    "date": "2026-12-02",
    "chosen": c2["chosen"],
    "commit": "f808f25",
    "commit_note": "measured on a tree that differs from f808f25 only in the docstring of pattern_key_lists; the "
    "BAND:5(1) masks case ran on 5af3bd1, whose masks path is the same code",
    "one_process": {
        "command": f"python benchmarks/gpu_lab.py --out OUT --budget 160 --min-stage 30 {common} "
        "--throughput-form masks --throughput-form lists --throughput-mechanism BLOC:5",
        "throughput": c2["throughput"],
    },
    "band_5_1_lists": {
        "command": f"python benchmarks/gpu_lab.py --out OUT --budget 100 --min-stage 30 {common} "
        "--throughput-form lists --throughput-mechanism 'BAND:5(1)'",
        "note": "a second process on the same machine, right after the first; its gpu_lab.json did not come back, "
        "the numbers are its printed table",
        "throughput": {"BAND:5(1)/bf16/lists": band_lists},
    },
    "band_5_1_masks_earlier_process": {
        "command": f"python benchmarks/gpu_lab.py --out OUT --budget 190 --min-stage 30 {common} "
        "--throughput-form masks --throughput-form lists --throughput-mechanism 'BAND:5(1)'",
        "commit": "5af3bd1",
        "note": "an earlier machine the same day; the lists case of this run failed to compile (InductorError while "
        "merging loops), the failure f808f25 fixes",
        "throughput": c1["throughput"],
    },
    "concurrent_groups": {
        "command": "python benchmarks/gpu_studies.py --study listops_fig1a --precision high --autocast bf16 "
        "--concurrent 2 --slim --start-from docs/studies/listops_fig1a/experiment --mechanism BLOC:5 "
        "--mechanism 'BAND:5(1)' --out OUT --inbox DIR --work W --budget 288",
        "masks": True,
        "training_epoch_s_both_groups": 5.46,
        "note": "seconds of one training epoch (evaluation excluded) of BLOC:5 and BAND:5(1) trained in lock step, "
        "from the runs' metrics (epochs 2-19); one group at a time the same epochs take 200 x (14.24 + 16.10) ms "
        "= 6.07 s by the step times above",
        "first_epoch_s_with_compiles": 78.15,
        "epochs_per_group": 20,
        "call_seconds": 277.1,
    },
}
Path(stem + ".json").write_text(json.dumps(record, indent=1) + "\n")
cases = [
    ("BLOC:5\nmasks", c2["throughput"]["BLOC:5/bf16/masks"]),
    ("BLOC:5\nlists", c2["throughput"]["BLOC:5/bf16/lists"]),
    ("BAND:5(1)\nmasks*", c1["throughput"]["BAND:5(1)/bf16/masks"]),
    ("BAND:5(1)\nlists*", band_lists),
]
fig, axes = plt.subplots(1, 2, figsize=(9, 3.6))
for ax, key, label in zip(axes, ("step_ms", "eval_s"), ("ms per training step", "s per whole-set evaluation")):
    bars = ax.bar([c[0] for c in cases], [c[1][key] for c in cases], color=["tab:blue", "tab:orange"] * 2)
    ax.bar_label(bars, fmt="%.2f")
    ax.set_ylabel(label)
fig.suptitle("ListOps step, 10 folded seeds, H200, bf16, step-graph (* separate processes)", fontsize=10)
fig.tight_layout()
fig.savefig(stem + ".png", dpi=110)

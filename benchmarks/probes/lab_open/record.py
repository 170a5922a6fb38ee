"""Collect the ListOps open-question throughput cases (``gpu_lab.json`` of each call) into one
result JSON with commands, commits and device, and a bar chart of seconds per epoch.

    python benchmarks/probes/lab_open/record.py EAGER_OLD.json EAGER_NEW.json COMPILED.json OUT_STEM
"""

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

GPU_LAB = (
    "python benchmarks/gpu_lab.py --out OUT/{sub} --budget {budget} --min-stage 20 --only-throughput --no-reference"
    " --precision high --autocast bf16 --compile {compile}{extra} --throughput-config"
    " experiments/listops_open_question.yaml --throughput-mechanism MECHANISM --steps 10"
)
KEEP = ("step_ms", "eval_s", "epoch_s", "study_min", "compile_s", "peak_gib")


def cases(path: str, commit: str, command: str) -> dict:
    data = json.loads(Path(path).read_text())
    out = {}
    for case, value in data["throughput"].items():
        row = {key: value.get(key) for key in KEEP}
        profile = value.get("step_profile", {})
        row["kernels_per_step"] = profile.get("kernels")
        row["top_kernels"] = [
            {"name": k["name"][:120], "ms": round(k["ms"], 3), "calls": k["calls"]} for k in profile.get("top_kernels", [])[:5]
        ]
        out[case.removesuffix("/bf16")] = {**row, "commit": commit, "command": command}
    return {"device": data["device"], "torch": data["torch"], "cases": out}


def main() -> None:
    eager_old, eager_new, compiled, stem = sys.argv[1:5]
    eager_cmd = GPU_LAB.format(sub="lab", budget=50, compile="eager-graph", extra="")
    compiled_cmd = GPU_LAB.format(sub="lab_sg", budget=105, compile="step-graph", extra=" --set train.compile_scope=blocks")
    old = cases(eager_old, "ecde52c", eager_cmd)
    new = cases(eager_new, "3dd3de5", eager_cmd)
    comp = cases(compiled, "3dd3de5", compiled_cmd)
    eager = {**old["cases"], **{f"{case} (padded SDPA)": row for case, row in new["cases"].items()}}
    eager["entmax"] = {
        "error": "not timed: one process of 60 s (timeout, Python stack dumped) was still in the timed whole-set"
        " evaluation (entmax's 50-step bisection over [rows, 600] fp32 scores) after its 10 timed steps",
        "commit": "ecde52c",
        "command": eager_cmd,
    }
    result = {
        "what": "ms per training step and seconds per epoch (200 steps + whole-set evaluation of 5000 + 2000"
        " examples per seed) of experiments/listops_open_question.yaml, 10 seeds folded, bf16 autocast, matmul"
        " precision high; each mechanism its own process (MECHANISM in the command); study_min = 200 epochs",
        "device": comp["device"],
        "torch": comp["torch"],
        "eager_graph": eager,
        "step_graph_blocks": comp["cases"],
    }
    Path(f"{stem}.json").write_text(json.dumps(result, indent=1) + "\n")
    plot(eager, comp["cases"], f"{stem}.png")


def plot(eager: dict, compiled: dict, path: str) -> None:
    names = [name for name, row in eager.items() if "epoch_s" in row]
    fig, ax = plt.subplots(figsize=(10, 4.5))
    ax.barh(range(len(names)), [eager[n]["epoch_s"] for n in names], color="tab:gray", label="eager-graph")
    for i, name in enumerate(names):
        base = name.removesuffix(" (padded SDPA)")
        if base in compiled and (name.endswith("(padded SDPA)") or base != "FULL"):
            ax.plot(compiled[base]["epoch_s"], i, "o", color="tab:blue", label="step-graph, blocks" if i < 3 else None)
    labels = [n.split(":")[0] if ":" in n else n for n in names]
    ax.set_yticks(range(len(names)), [f"{n} (chunked scores)" if n == "FULL" else n for n in labels])
    ax.invert_yaxis()
    ax.set_xlabel("seconds per epoch, 10 seeds folded (H200, bf16)")
    ax.set_title("ListOps open question: one epoch per mechanism")
    handles, labels = ax.get_legend_handles_labels()
    ax.legend(dict(zip(labels, handles)).values(), dict(zip(labels, handles)).keys())
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()

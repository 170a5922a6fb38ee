"""One-off: cpu_compile_scope.py's lines (cold and warm Inductor cache) as JSON + PNG."""

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

cold, warm, out = sys.argv[1:4]
rows = {"cold cache": [json.loads(x) for x in open(cold)], "warm cache": [json.loads(x) for x in open(warm)]}
record = {
    "what": "first epoch of ListOps BLOC:5 (two folded seeds, the paper's model, fp32, 50 training and 25 held-out sequences) with train.compile=default, compiled whole (compile_scope=step) or block by block (blocks): Dynamo's compile seconds and the wall time",
    "device": "2-core CPU (the development machine), Inductor's C++ backend",
    "commit": "ccb0ad7",
    "date": "2026-12-03",
    "commands": {
        "cold cache": "for s in step blocks; do TORCHINDUCTOR_CACHE_DIR=/tmp/ind-$s TRITON_CACHE_DIR=/tmp/ind-$s/triton python benchmarks/probes/compile_scope/cpu_compile_scope.py $s /tmp/cs-$s; done (empty cache folders)",
        "warm cache": "the same with the default cache folder, warm from earlier runs of both",
    },
    "results": rows,
}
json.dump(record, open(out + ".json", "w"), indent=1)
fig, ax = plt.subplots(figsize=(6, 3.2))
labels = [f"{cache}\n{row['compile_scope']}" for cache, lines in rows.items() for row in lines]
ax.bar(labels, [row["compile_s"] for lines in rows.values() for row in lines], color=["tab:gray", "tab:blue"] * 2)
ax.set_ylabel("seconds compiling (Dynamo)")
ax.set_title(f"ListOps BLOC:5, 2 folded seeds, first epoch; 2-core CPU, commit ccb0ad7", fontsize=9)
fig.tight_layout()
fig.savefig(out + ".png", dpi=120)

"""Per seed: a study's runs as first trained (groups at once, graphs on one stream) against the
retraining (groups at once, each lane's graph on its own stream, after the concurrency check):
epoch of first held-out accuracy >= 0.95, final losses and accuracies, for every mechanism group
of the first summary (or those named after the stem).
Usage: OLD_SUMMARY_JSON NEW_EXPERIMENT_FOLDER OUT_STEM [MECHANISM ...]."""

import json
import statistics
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

old = json.load(open(sys.argv[1]))["settings"]["default"]["mechanisms"]
root, out = sys.argv[2], sys.argv[3]
names = sys.argv[4:] or list(old)


def first(acc, reach=0.95):
    return next((i + 1 for i, a in enumerate(acc) if a >= reach), None)


res = {}
cols = min(3, len(names))
rows_ = -(-len(names) // cols)
fig, axes = plt.subplots(rows_, cols, figsize=(4.3 * cols, 3.6 * rows_), squeeze=False)
for ax, name in zip(axes.flat, names):
    folder = name.replace(":", "-").replace("(", "-").replace(")", "")
    rows = {}
    for seed, o in old[name]["runs"].items():
        new = [json.loads(line) for line in open(f"{root}/default/{folder}/seed-{seed}/metrics.jsonl")]
        n = {k: [r[k] for r in new] for k in ("train_loss", "train_acc", "valid_loss", "valid_acc")}
        rows[seed] = {
            "epochs": [len(o["valid_acc"]), len(n["valid_acc"])],
            "first_epoch_valid_acc_ge_0.95": [first(o["valid_acc"]), first(n["valid_acc"])],
            "epoch1_train_loss": [o["train_loss"][0], n["train_loss"][0]],
            "final_train_loss": [o["train_loss"][-1], n["train_loss"][-1]],
            "final_valid_acc": [o["valid_acc"][-1], n["valid_acc"][-1]],
            "best_valid_acc": [max(o["valid_acc"]), max(n["valid_acc"])],
        }
        ax.plot(o["valid_acc"], color="C0", lw=0.7, alpha=0.7)
        ax.plot(n["valid_acc"], color="C1", lw=0.7, alpha=0.7)
    firsts = [r["first_epoch_valid_acc_ge_0.95"] for r in rows.values()]
    summary = {}
    for i, which in enumerate(("first", "retrained")):
        vals = [f[i] for f in firsts if f[i] is not None]
        summary[which] = {
            "seeds_reaching_0.95": len(vals),
            "mean_epoch": statistics.mean(vals) if vals else None,
            "std_epoch": statistics.pstdev(vals) if len(vals) > 1 else None,
            "median_final_train_loss": statistics.median(r["final_train_loss"][i] for r in rows.values()),
        }
    res[name] = {"summary": summary, "seeds": rows}
    ax.set_title(f"{name[:40]}: held-out acc. (blue first, orange again)", fontsize=7)
    ax.set_xlabel("epoch")
fig.suptitle(f"{root}: first training against the retraining", fontsize=9)
fig.tight_layout()
fig.savefig(out + ".png", dpi=100)
json.dump(res, open(out + ".json", "w"), indent=1)
for name, r in res.items():
    print(name, r["summary"])
    for seed, x in r["seeds"].items():
        print(
            "  ",
            seed,
            x["first_epoch_valid_acc_ge_0.95"],
            [round(v, 4) for v in x["epoch1_train_loss"]],
            [f"{v:.2e}" for v in x["final_train_loss"]],
            x["final_valid_acc"],
        )

"""Probe: the --check grid of gpu_studies (even pairs, 10 seeds, FULL/TOPK:5/BAND:5(1), dropout,
step-graph, fp32, 3 epochs) trained one group at a time twice and three groups at once: per
mechanism and seed, the largest train/valid loss change, so the concurrent change sits beside
the run-to-run change of the groups alone."""

import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from gpu_studies import study_config  # noqa: E402

from sparsefocus.train.experiment import run_experiment  # noqa: E402

TINY = [
    "task.num_train=500",
    "task.num_valid=200",
    "model.blocks=2",
    "train.epochs=3",
    "seeds=[1,2,3,4,5,6,7,8,9,10]",
    'mechanisms=["FULL", "TOPK:5", "BAND:5(1)"]',
]


def metrics(root: Path) -> dict:
    return {
        str(p.parent.relative_to(root)): [json.loads(x) for x in p.read_text().splitlines()]
        for p in sorted(root.glob("*/*/seed-*/metrics.jsonl"))
    }


def per_run(a: dict, b: dict) -> dict:
    return {
        run: round(max(max(abs(x[k] - y[k]) for k in ("train_loss", "valid_loss")) for x, y in zip(a[run], b[run])), 6)
        for run in a
    }


def main() -> None:
    out, work = Path(sys.argv[1]), Path("/tmp/check_noise")
    record = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "commit": sys.argv[2], "seconds": {}}
    runs = {}
    for tag, width in (("alone1", 1), ("alone2", 1), ("together", 3)):
        began = time.time()
        runs[tag] = metrics(
            run_experiment(
                study_config("even_pairs", work / tag, "highest", "none", "step-graph", width, (f"name={tag}", *TINY)), quiet=True
            )
        )
        record["seconds"][tag] = round(time.time() - began, 1)
        if tag != "alone1":
            record[f"{tag}_vs_alone1"] = per_run(runs["alone1"], runs[tag])
            print(tag, "max", max(record[f"{tag}_vs_alone1"].values()), flush=True)
        (out / "check_noise.json").write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()

"""One-off: the first epoch of ListOps BLOC:5 (two folded seeds, the paper's model, fp32, a
small data set) on this machine's CPU with train.compile=default, compiled whole or block by
block; prints a JSON line with Dynamo's compile seconds and the wall time."""

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import gpu_studies  # noqa: E402
import torch  # noqa: E402

from sparsefocus.train import driver  # noqa: E402
from sparsefocus.train.experiment import run_experiment  # noqa: E402

scope, work = sys.argv[1], Path(sys.argv[2])
extra = (
    "train.device=cpu",
    "train.epochs=1",
    'mechanisms=["BLOC:5"]',
    "seeds=[1, 2]",
    "task.num_train=50",
    "task.num_valid=25",
    "train.task_cache=false",
    "train.topk_select=torch",
    "train.eval_batch_size=25",
)
config = gpu_studies.study_config("listops_fig1a", work, "highest", "none", "default", 1, extra, "masks", scope)
began = time.time()
run_experiment(config, quiet=True)
print(json.dumps({"compile_scope": scope, "wall_s": round(time.time() - began, 1), "compile_s": round(driver.compile_seconds(), 1), "torch": torch.__version__}))

"""Probe: CUDA profile of three training steps of the folded ListOps TOPK:5 model (10 seeds,
bf16 autocast, train.compile=default, topk_select=triton). Prints the kernels by GPU time."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import gpu_lab  # noqa: E402
import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from sparsefocus.train.config import PAPER_SEEDS  # noqa: E402
from sparsefocus.train.loop import matmul_precision  # noqa: E402

if __name__ == "__main__":
    gpu_lab.TOPK_SELECT = "triton"
    cfg = gpu_lab.listops(Path("/tmp/prof"), "p", ["TOPK:5"], PAPER_SEEDS, ("high", "bf16"), ["train.compile=default"])
    with matmul_precision("high"):
        trainer = gpu_lab.trainer_for(cfg, "TOPK:5", PAPER_SEEDS)
        params = list(trainer.model.parameters())
        order = torch.stack([torch.randperm(5000, device="cuda") for _ in range(trainer.runs)])
        trainer.model.train()
        for i in range(3):
            gpu_lab.train_step(trainer, order[:, i * 25 : (i + 1) * 25], params)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for i in range(3, 6):
                gpu_lab.train_step(trainer, order[:, i * 25 : (i + 1) * 25], params)
            torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=90))

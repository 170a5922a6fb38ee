"""Fine-tune a trained MQAR ZETA checkpoint on fresh sequences (CPU, lean) and report the
held-out accuracy of the groups that ``mqar_zeta_diagnose.py`` separates.

Usage:  PYTHONPATH=. python benchmarks/mqar_zeta_finetune.py CHECKPOINT PATTERN [--steps 300] [--lr 3e-4]

PATTERN may add parameters the checkpoint lacks (e.g. ``sink=1``: its sink keys start at their
default). The fresh sequences come from another seed of the same preset, so the model has not
memorised them (it has memorised its own training set: loss near 0 there).
"""

from __future__ import annotations

import argparse
import time

import torch

from benchmarks.mqar_zeta_diagnose import CONFIG, correct, query_layout
from sparsefocus.models import Decoder
from sparsefocus.tasks.base import build_task
from sparsefocus.train.config import load_config

FRESH_SEED = 99


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("checkpoint")
    parser.add_argument("pattern")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--batch", type=int, default=64)
    args = parser.parse_args()
    torch.manual_seed(0)
    config = load_config(CONFIG)
    config.model.impl = "lean"
    task = build_task("mqar", config.seeds[0], preset="fig2_256")
    fresh = build_task("mqar", FRESH_SEED, preset="fig2_256", num_train=20000, num_valid=10)
    model = Decoder(config.model, args.pattern, vocab_size=task.vocab_size, max_len=task.seq_len)
    loaded = model.load_state_dict(torch.load(args.checkpoint, map_location="cpu", weights_only=True)["model"], strict=False)
    print("new parameters:", loaded.missing_keys)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    draw, started = torch.Generator().manual_seed(1), time.time()
    for step in range(args.steps):
        rows = torch.randint(0, fresh.train_inputs.shape[0], (args.batch,), generator=draw)
        x, y = fresh.train_inputs[rows], fresh.train_targets[rows]
        scored = y != -100
        loss = torch.nn.functional.cross_entropy(model(x, scored), y[scored])
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if step % 25 == 0:
            print(f"step {step} loss {loss.item():.4f} {time.time() - started:.0f}s", flush=True)
    hits = correct(model.state_dict(), args.pattern, task, 500)
    position, pair = query_layout(task, 500)
    early_query, early_pair = position < 36, pair < 2
    print(
        f"{args.pattern} after {args.steps} steps: all {hits.mean():.4f}, queries at 32-35 {hits[early_query].mean():.3f}, "
        f"pairs 0-1 {hits[early_pair & ~early_query].mean():.3f}, the rest {hits[~early_query & ~early_pair].mean():.4f}"
    )


if __name__ == "__main__":
    main()

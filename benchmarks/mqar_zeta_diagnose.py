"""Where a trained MQAR ZETA model fails: held-out accuracy split by the query's chunk, by its
position and by the key's pair index, with the candidate window widened, and the learned gamma.

Usage:  python benchmarks/mqar_zeta_diagnose.py CHECKPOINT [--count 1000] [--pattern PATTERN] [--wide PATTERN ...]

CHECKPOINT is a ``checkpoint.pt`` of experiments/mqar_zeta.yaml (fig2_256) as
benchmarks/mqar_zeta_session.py copies back. The model is rebuilt with impl "lean" (CPU) and
evaluated on the first ``count`` held-out sequences; each ``--wide`` pattern loads the same
weights under another selection (e.g. window=224: every earlier key is a candidate), which tells
whether the window or the attention itself misses.
"""

from __future__ import annotations

import argparse
import re

import torch
from torch import Tensor

from sparsefocus.models import Decoder
from sparsefocus.tasks.base import TaskData, build_task
from sparsefocus.train.config import load_config

CONFIG = "experiments/mqar_zeta.yaml"
PATTERN = "zeta:k=32,dk=3,window=64,chunks=8,local=32,gamma=0.02,sink=1"  # experiments/mqar_zeta.yaml
CONTEXT = 32  # fig2_256: 16 key-value pairs fill positions 0..31
CHUNK = 32  # chunks=8 at L=256


def correct(state: dict, pattern: str, task: TaskData, count: int, batch: int = 100) -> Tensor:
    """[Q] 1.0 where the model's prediction at each scored query is right (held-out rows < count)."""
    config = load_config(CONFIG)
    config.model.impl = "lean"
    model = Decoder(config.model, pattern, vocab_size=task.vocab_size, max_len=task.seq_len)
    model.load_state_dict(state)
    model.eval()
    inputs, targets = task.valid_inputs[:count], task.valid_targets[:count]
    hits = []
    with torch.no_grad():
        for start in range(0, count, batch):
            x, y = inputs[start : start + batch], targets[start : start + batch]
            scored = y != -100
            hits.append((model(x, scored).argmax(-1) == y[scored]).float())
    return torch.cat(hits)


def query_layout(task: TaskData, count: int) -> tuple[Tensor, Tensor]:
    """Per scored query [Q]: its position and the pair index of its key in the context."""
    inputs, targets = task.valid_inputs[:count], task.valid_targets[:count]
    scored = targets != -100
    position = torch.arange(inputs.shape[1]).expand_as(inputs)[scored]
    rows = torch.arange(count)[:, None].expand_as(inputs)[scored]
    key_position = (inputs[rows, :CONTEXT] == inputs[scored][:, None]).float().argmax(-1)
    return position, key_position // 2


def report(hits: Tensor, position: Tensor, pair: Tensor) -> None:
    chunk = position // CHUNK
    print(f"  all {hits.mean():.4f}; by chunk:", " ".join(f"{c}:{hits[chunk == c].mean():.3f}" for c in range(1, 8)))
    print(
        "  by query position (bins of 4):",
        " ".join(f"{p}:{hits[(position >= p) & (position < p + 4)].mean():.2f}" for p in range(32, 80, 4)),
    )
    print("  by key pair:", " ".join(f"{j}:{hits[pair == j].mean():.2f}" for j in range(CONTEXT // 2)))
    early_query, early_pair = position < CONTEXT + 4, pair < 2
    for name, rows in (
        ("query at 32-35", early_query),
        ("key pair 0 or 1", early_pair & ~early_query),
        ("everything else", ~early_query & ~early_pair),
    ):
        print(f"  {name}: {hits[rows].mean():.4f} of {int(rows.sum())}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("checkpoint")
    parser.add_argument("--count", type=int, default=1000)
    parser.add_argument("--pattern", default=PATTERN)
    parser.add_argument("--wide", nargs="*", default=None, help="default: --pattern with window=224")
    args = parser.parse_args()
    args.wide = [re.sub(r"window=\d+", "window=224", args.pattern)] if args.wide is None else args.wide
    state = torch.load(args.checkpoint, map_location="cpu", weights_only=True)["model"]
    print(
        "learned gamma:", {name: [f"{g:.2e}" for g in value.tolist()] for name, value in state.items() if name.endswith("gamma")}
    )
    task = build_task("mqar", load_config(CONFIG).seeds[0], preset="fig2_256")
    position, pair = query_layout(task, args.count)
    for pattern in [args.pattern, *args.wide]:
        print(pattern)
        report(correct(state, pattern, task, args.count), position, pair)


if __name__ == "__main__":
    main()

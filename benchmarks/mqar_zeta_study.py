"""Small-scale MQAR study of ZETA's generalisation (docs/mqar/cpu_study.md).

Trains one mechanism of an experiment config for a fixed number of optimiser steps (the library's
model, data, optimiser and lr schedule) and every ``--eval-every`` steps prints and appends to
``--out`` (JSON lines): train accuracy on a fixed train subset and held-out accuracy (both in
eval mode, over the queried positions only), each ZETA block's learned gamma per head, and for
the last block, if it is ZETA, how the queried value position is treated on the held-out set:
``sel`` the fraction of (query, head) pairs whose selection holds it, ``share`` its mean share of
the Cauchy weight (mean token included), ``mean_share`` the mean token's share, ``top`` the
fraction where it has the largest weight, ``nearest`` the fraction where it is the nearest of
all earlier keys (what exact top-1 would pick), ``d2_right`` / ``d2_other`` the median squared
q-k distance to it / to every earlier key.

    python benchmarks/mqar_zeta_study.py experiments/mqar_zeta_cpu.yaml --mechanism FULL \
        --steps 3000 --out runs/mqar_zeta_cpu_study/full.jsonl [key=value overrides]

``--recall`` instead measures, without training, how often the Z-order window misses a query's
nearest key when the query is a noisy copy of one of 224 Gaussian keys in 3-D (the number of
keys a query in ZETA's last chunk searches at fig2_256), for several window/curves settings.

``causal_recall`` does the same for the causal chunked selection at fig2_256, per chunk.

    python benchmarks/mqar_zeta_study.py --recall
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from sparsefocus.attention import selection_mask
from sparsefocus.attention.zeta import Zeta, squared_distances
from sparsefocus.train.config import load_config
from sparsefocus.train.loop import build_data, build_model, evaluate, loss_and_counts, lr_factor, make_optimizer, scored_logits


def value_positions(inputs: Tensor, targets: Tensor, pairs: int) -> tuple[Tensor, Tensor, Tensor]:
    """(batch rows, query positions, context positions of the queried value), one entry per query."""
    rows, cols = (targets != -100).nonzero(as_tuple=True)  # [S], [S]
    keys = inputs[:, 0 : 2 * pairs : 2]  # [B, D]
    slot = (keys[rows] == inputs[rows, cols][:, None]).float().argmax(-1)  # [S]
    return rows, cols, 2 * slot + 1


@torch.no_grad()
def selection_stats(model: nn.Module, inputs: Tensor, targets: Tensor, pairs: int) -> dict[str, float]:
    """How the last block's ZETA attention treats the queried value position (see module docstring)."""
    attn = model.blocks[-1].attn
    captured: dict[str, Tensor] = {}
    handle = attn.register_forward_pre_hook(lambda module, args: captured.setdefault("x", args[0]))
    model.eval()
    model(inputs, targets != -100)
    handle.remove()
    q, k, _ = attn.project(captured["x"])  # [B, H, N, 3] each
    params = dict(attn.mechanism)
    mask = selection_mask(attn.pattern, q, k, causal=True, params=params)  # [B, H, N, N]
    gamma_sq = params["gamma"].reshape(1, -1, 1, 1).pow(2)
    weight = mask.float() / (squared_distances(q, k) + gamma_sq)  # [B, H, N, N]
    mean_k = k.cumsum(2) / torch.arange(1, k.shape[2] + 1).reshape(1, 1, -1, 1)  # [B, H, N, 3]
    mean_w = 1 / ((q - mean_k).pow(2).sum(-1) + gamma_sq[..., 0])  # [B, H, N]
    rows, cols, target = value_positions(inputs, targets, pairs)
    w = weight[rows, :, cols]  # [S, H, N]
    total = w.sum(-1) + mean_w[rows, :, cols]  # [S, H]
    right = w.gather(-1, target[:, None, None].expand(-1, w.shape[1], 1))[..., 0]  # [S, H]
    dist = squared_distances(q, k)[rows, :, cols]  # [S, H, N]
    causal_keys = torch.arange(dist.shape[-1])[None, None, :] <= cols[:, None, None]  # [S, 1, N]
    right_dist = dist.gather(-1, target[:, None, None].expand(-1, w.shape[1], 1))[..., 0]  # [S, H]
    return {
        "sel": float(mask[rows, :, cols].gather(-1, target[:, None, None].expand(-1, w.shape[1], 1)).float().mean()),
        "share": float((right / total).mean()),
        "mean_share": float((mean_w[rows, :, cols] / total).mean()),
        "top": float((w.argmax(-1) == target[:, None]).float().mean()),
        "nearest": float((dist.masked_fill(~causal_keys, float("inf")).argmin(-1) == target[:, None]).float().mean()),
        "d2_right": float(right_dist.median()),
        "d2_other": float(dist.masked_select(causal_keys.expand_as(dist)).median()),
    }


def gammas(model: nn.Module) -> list[list[float]]:
    """Learned |gamma| per ZETA block and head (the kernel uses gamma^2)."""
    return [[round(abs(g), 4) for g in b.attn.mechanism["gamma"].tolist()] for b in model.blocks if "gamma" in b.attn.mechanism]


def record(step: int, model: nn.Module, data: Any, pairs: int, subset: int, start: float) -> dict[str, Any]:
    rows = slice(0, subset)
    train = evaluate(model, data.train_inputs[rows], data.train_targets[rows], 500)
    valid = evaluate(model, data.valid_inputs, data.valid_targets, 500)
    out = {"step": step, "train_loss": train[0], "train_acc": train[1], "valid_loss": valid[0], "valid_acc": valid[1]}
    out["gamma"] = gammas(model)
    if isinstance(model.blocks[-1].attn.pattern, Zeta):
        out["valid_sel"] = selection_stats(model, data.valid_inputs[:500], data.valid_targets[:500], pairs)
        out["train_sel"] = selection_stats(model, data.train_inputs[:500], data.train_targets[:500], pairs)
    out["seconds"] = round(time.time() - start, 1)
    return out


RECALL_SPECS = ("window=64", "window=64,curves=2", "window=32,curves=2", "window=64,curves=3", "window=32,curves=3", "window=16")


@torch.no_grad()
def window_recall(keys: int = 224, batch: int = 64, seed: int = 0) -> None:
    """Print the fraction of queries whose nearest key the window misses, per noise level and spec.

    Keys ~ N(0, sigma^2 I) in 3-D; each query = its key + N(0, (eps * s)^2 I), s the median
    nearest-neighbour distance between keys, so eps is the q-k mismatch relative to key spacing.
    Non-causal selection (one sort over all keys), k=32 kept: the nearest is kept if it is a candidate.
    """
    generator = torch.Generator().manual_seed(seed)
    print("sigma eps " + " ".join(f"{spec:>18}" for spec in RECALL_SPECS))
    for sigma in (0.3, 1.0):
        for eps in (0.03, 0.1, 0.3):
            k = torch.randn(batch, 1, keys, 3, generator=generator) * sigma  # [B, 1, M, 3]
            spacing = torch.cdist(k, k).add(torch.eye(keys) * 1e9).min(-1).values.median()
            q = k + torch.randn(k.shape, generator=generator) * eps * spacing  # [B, 1, M, 3]
            nearest = torch.cdist(q, k).argmin(-1) == torch.arange(keys)  # [B, 1, M]
            misses = []
            for spec in RECALL_SPECS:
                mask = selection_mask(f"zeta:k=32,dk=3,{spec}", q, k, causal=False)  # [B, 1, M, M]
                misses.append(1 - float(mask.diagonal(dim1=-2, dim2=-1)[nearest].float().mean()))
            print(f"{sigma:5} {eps:4} " + " ".join(f"{m:18.4f}" for m in misses), flush=True)


CHUNK_SPECS = ("window=64", "window=64,curves=2", "window=32,curves=3", "window=64,curves=3")


@torch.no_grad()
def causal_recall(batch: int = 64, seed: int = 1) -> None:
    """Per chunk, the fraction of fig2_256 queries whose queried value position ZETA does not select.

    Causal, N=256, chunks=8, local=32, k=32, as in experiments/mqar_zeta.yaml. Worst case for the
    window: every position's key is drawn from one N(0, I) cloud in 3-D. The query at each
    position >= 32 copies the key of a random value position 2i+1 < 32 plus N(0, (eps * s)^2 I),
    s the median nearest-neighbour distance among the 32 context keys.
    """
    generator = torch.Generator().manual_seed(seed)
    length = 256
    k = torch.randn(batch, 1, length, 3, generator=generator)  # [B, 1, N, 3]
    context = k[:, :, :32]
    spacing = torch.cdist(context, context).add(torch.eye(32) * 1e9).min(-1).values.median()
    chunk = torch.arange(32, length) // 32  # [224] chunk of each query
    source = torch.randint(0, 16, (batch, length - 32), generator=generator) * 2 + 1  # [B, 224]
    print("eps spec: miss rate in chunks 1..7")
    for eps in (0.1, 0.3):
        q = torch.randn(batch, 1, length, 3, generator=generator)
        noise = torch.randn(batch, length - 32, 3, generator=generator) * eps * spacing
        q[:, 0, 32:] = k[torch.arange(batch)[:, None], 0, source] + noise
        for spec in CHUNK_SPECS:
            mask = selection_mask(f"zeta:k=32,dk=3,chunks=8,local=32,{spec}", q, k, causal=True)[:, 0, 32:]  # [B, 224, N]
            hit = mask.gather(-1, source[..., None])[..., 0].float()  # [B, 224]
            misses = [1 - float(hit[:, chunk == c].mean()) for c in range(1, 8)]
            print(f"{eps} {spec}: " + " ".join(f"{m:.3f}" for m in misses), flush=True)


def main() -> None:
    if "--recall" in os.sys.argv:
        window_recall()
        causal_recall()
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("config")
    parser.add_argument("overrides", nargs="*")
    parser.add_argument("--mechanism", required=True, help="pattern string, or several joined by '|' (one per block)")
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--eval-every", type=int, default=250)
    parser.add_argument("--train-subset", type=int, default=2000)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ.get("THREADS", "1")))
    config = load_config(args.config, args.overrides)
    mechanism: Any = args.mechanism.split("|") if "|" in args.mechanism else args.mechanism
    seed = config.seeds[0]
    torch.manual_seed(seed)
    data = build_data(config, seed, torch.device("cpu"))
    model = build_model(config.model, mechanism, data)
    optimizer = make_optimizer(config.optim, model)
    per_epoch = -(-data.train_inputs.shape[0] // config.train.batch_size)
    epochs = -(-args.steps // per_epoch)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(config.optim, s, per_epoch, epochs))
    pairs = data.info["config"]["num_kv_pairs"]
    generator = torch.Generator().manual_seed(seed)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("")
    start, step = time.time(), 0
    while step < args.steps:
        order = torch.randperm(data.train_inputs.shape[0], generator=generator)
        for begin in range(0, order.shape[0], config.train.batch_size):
            if step >= args.steps:
                break
            model.train()
            batch = order[begin : begin + config.train.batch_size]
            loss, _, _ = loss_and_counts(*scored_logits(model, data.train_inputs[batch], data.train_targets[batch]))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), config.optim.grad_clip)
            optimizer.step()
            schedule.step()
            step += 1
            if step % args.eval_every == 0 or step == args.steps:
                line = record(step, model, data, pairs, args.train_subset, start)
                print(json.dumps(line), flush=True)
                with args.out.open("a") as handle:
                    handle.write(json.dumps(line) + "\n")


if __name__ == "__main__":
    main()

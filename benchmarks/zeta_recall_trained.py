"""Recall of ZETA's candidate windows on the q/k of a trained model, against random q/k (issue 5).

For every run folder given (or found below a folder) whose model has ZETA layers, the held-out
examples are fed through the model; each ZETA layer's projected q/k (the d_K-wide vectors the
selection sees) are captured with ``sparsefocus.analysis.hooks``. On those q/k,
``candidate_recall`` (the fraction of each query's exact top-k by squared distance, among the keys
it may see, that the selection finds) is measured for a sweep of window, curves and bits around the
model's own pattern, at several prefix lengths N. The same is measured on two random inputs of the
same shape: standard Gaussian q/k, and Gaussian q/k with the trained q's and k's mean and std per
(head, dimension). Causal models give the same q/k on a prefix as on the whole block, so a prefix
of N positions is what the model would see at length N.

Usage (from the repo root):
    python benchmarks/zeta_recall_trained.py runs/zeta_recall_trained --out benchmarks/results/zeta_recall_trained.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from sparsefocus.analysis.hooks import AttentionCall, capture_attention
from sparsefocus.analysis.runs import LoadedRun, find_runs, load_run
from sparsefocus.attention.zeta import Zeta, candidate_recall, squash
from sparsefocus.train.checkpoint import write_text_atomic

WINDOWS = (32, 64, 128, 160)
SHIFTED_WINDOWS = (32, 40, 64, 128, 160)  # three curves: the 3x40 point as well
BITS = (12, 6)
SOURCES = ("trained", "matched", "gaussian")


@dataclasses.dataclass
class LayerInputs:
    """One ZETA layer's q [B, H, N, D] and k [B, H, N, D] (GQA expanded) on the held-out batches."""

    pattern: Zeta
    causal: bool
    q: Tensor
    k: Tensor


def sweep_patterns(own: Zeta, seq_len: int) -> list[Zeta]:
    """The model's own pattern first, then curves x window x bits with its k, dk, chunks and local,
    then the ceiling: one window of ``seq_len`` holds every earlier-chunk key, so only the own-chunk
    keys older than ``local`` (which no window reaches) are missed; and a window of one key, which
    shows how much of the recall the causal ``local`` band alone gives."""
    grid = [(1, window) for window in WINDOWS] + [(3, window) for window in SHIFTED_WINDOWS]
    swept = [dataclasses.replace(own, curves=c, window=w, bits=b) for c, w in grid for b in BITS]
    ceiling = dataclasses.replace(own, curves=1, window=seq_len)
    band = dataclasses.replace(own, curves=1, window=1)
    return list(dict.fromkeys([own, *swept, ceiling, band]))  # the own pattern may also be a grid point


def held_out_inputs(run: LoadedRun, examples: int) -> Tensor:
    """The first ``examples`` validation inputs (test if the task has no validation split)."""
    inputs = run.data.valid_inputs if run.data.valid_inputs is not None else run.data.test_inputs
    if inputs is None:
        raise ValueError(f"{run.run_dir}: the task has no validation or test split to measure on")
    return inputs[:examples]


def collect_qk(run: LoadedRun, examples: int, batch_size: int) -> dict[str, LayerInputs]:
    """Each ZETA layer's q/k on the first ``examples`` held-out inputs, batches concatenated.

    Raises ValueError if the model has no ZETA layer or the task pads its inputs (padded keys
    would need their mask carried into the recall; the tasks measured here have none).
    """
    captured: dict[str, list[AttentionCall]] = {}

    def on_call(call: AttentionCall) -> None:
        if isinstance(call.module.pattern, Zeta):
            if call.key_padding_mask is not None and not bool(call.key_padding_mask.all()):
                raise ValueError(f"{run.run_dir}: padded inputs are not supported by this measurement")
            captured.setdefault(call.layer, []).append(call)

    inputs = held_out_inputs(run, examples)
    run.model.eval()
    with torch.no_grad(), capture_attention(run.model, on_call):
        for start in range(0, inputs.shape[0], batch_size):
            run.model(inputs[start : start + batch_size])
    if not captured:
        raise ValueError(f"{run.run_dir}: the model has no zeta attention layer")
    return {
        name: LayerInputs(
            calls[0].module.pattern, calls[0].module.causal, torch.cat([c.q for c in calls]), torch.cat([c.k for c in calls])
        )
        for name, calls in captured.items()
    }


def matched_gaussian(x: Tensor, generator: torch.Generator) -> Tensor:
    """Gaussian noise shaped like x [B, H, N, D] with x's mean and std per (head, dimension)."""
    mean = x.mean(dim=(0, 2), keepdim=True)  # [1, H, 1, D]
    std = x.std(dim=(0, 2), keepdim=True)
    return mean + std * torch.randn(x.shape, generator=generator, dtype=x.dtype)


def sources(layer: LayerInputs, seed: int) -> dict[str, tuple[Tensor, Tensor]]:
    """q/k of the three sources compared: trained, matched (per-dim mean/std), standard Gaussian."""
    generator = torch.Generator().manual_seed(seed)
    shape = layer.q.shape
    return {
        "trained": (layer.q, layer.k),
        "matched": (matched_gaussian(layer.q, generator), matched_gaussian(layer.k, generator)),
        "gaussian": (torch.randn(shape, generator=generator), torch.randn(shape, generator=generator)),
    }


def describe_qk(layer: LayerInputs, module_gamma: Tensor | None) -> dict[str, Any]:
    """How the trained q/k sit in the code space: std per dimension, share of sigmoid outputs
    within 1/64 of 0 or 1 (where 6-bit grids put everything in the edge cell), learnt gamma."""
    stats: dict[str, Any] = {}
    for name, x in (("q", layer.q), ("k", layer.k)):
        unit = squash(x)
        stats[f"{name}_std_per_dim"] = [round(v, 4) for v in x.std(dim=(0, 1, 2)).tolist()]
        stats[f"{name}_mean_per_dim"] = [round(v, 4) for v in x.mean(dim=(0, 1, 2)).tolist()]
        stats[f"{name}_saturated"] = ((unit < 1 / 64) | (unit > 1 - 1 / 64)).float().mean().item()
    if module_gamma is not None:
        stats["gamma"] = [round(v, 4) for v in module_gamma.detach().abs().tolist()]
    return stats


def layer_recalls(layer: LayerInputs, patterns: list[Zeta], lengths: list[int], seed: int) -> list[dict[str, Any]]:
    """Mean recall (nanmean over batch, heads and queries) per pattern, prefix length and source."""
    rows = []
    for source, (q, k) in sources(layer, seed).items():
        for n in lengths:
            for pattern in patterns:
                recall = candidate_recall(q[:, :, :n], k[:, :, :n], pattern, causal=layer.causal)  # [B, H, n]
                per_head = recall.transpose(0, 1).reshape(recall.shape[1], -1).nanmean(-1)  # [H]
                rows.append(
                    {
                        "source": source,
                        "n": n,
                        "pattern": pattern_string(pattern),
                        "curves": pattern.curves,
                        "window": pattern.window,
                        "bits": pattern.bits,
                        "own": pattern == layer.pattern,
                        "recall": recall.nanmean().item(),
                        "recall_per_head": [round(v, 4) for v in per_head.tolist()],
                    }
                )
    return rows


def pattern_string(pattern: Zeta) -> str:
    fields = ("k", "dk", "bits", "chunks", "window", "local", "curves")
    return "zeta:" + ",".join(f"{name}={getattr(pattern, name)}" for name in fields)


def last_metrics(run_dir: Path) -> dict[str, Any]:
    """The last line of the run's metrics.jsonl (valid_ppl etc.), or {} if there is none."""
    path = run_dir / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return json.loads(lines[-1]) if lines else {}


def measure_run(run: LoadedRun, examples: int, batch_size: int, lengths: list[int], seed: int) -> dict[str, Any]:
    """Recall rows and q/k statistics of every ZETA layer of one loaded run."""
    layers = collect_qk(run, examples, batch_size)
    modules = dict(run.model.named_modules())
    result: dict[str, Any] = {"run_dir": str(run.run_dir), "label": run.label, "seed": run.seed, "record": run.record}
    result["final_metrics"] = last_metrics(run.run_dir)
    result["layers"] = {}
    for name, layer in layers.items():
        seq_len = layer.q.shape[2]
        sizes = sorted({n for n in lengths if n < seq_len} | {seq_len})
        gamma = dict(modules[name].mechanism).get("gamma")
        result["layers"][name] = {
            "pattern": pattern_string(layer.pattern),
            "causal": layer.causal,
            "shape": list(layer.q.shape),
            "qk": describe_qk(layer, gamma),
            "rows": layer_recalls(layer, sweep_patterns(layer.pattern, seq_len), sizes, seed),
        }
    return result


def _cell(rows: list[dict[str, Any]], n: int, pattern: str) -> str:
    found = {r["source"]: r["recall"] for r in rows if r["n"] == n and r["pattern"] == pattern}
    return " / ".join("-" if math.isnan(found.get(s, math.nan)) else f"{found[s]:.2f}" for s in SOURCES)


def row_tag(row: dict[str, Any], seq_len: int) -> str:
    if row["own"]:
        return " (own)"
    return {seq_len: " (ceiling)", 1: " (band only)"}.get(row["window"], "")


def markdown_tables(results: list[dict[str, Any]]) -> str:
    """One table per run: a row per pattern at the training length, a column per layer with
    trained / matched / gaussian recall; then the own pattern at every measured length."""
    out = []
    for result in results:
        layers = result["layers"]
        names = list(layers)
        first = layers[names[0]]
        n_max = first["shape"][2]
        ppl = result["final_metrics"].get("valid_ppl")
        out.append(
            f"**{result['label']}** (valid perplexity {ppl:.1f}), N = {n_max}, recall trained / matched / gaussian:\n"
            if ppl
            else f"**{result['label']}**, N = {n_max}:\n"
        )
        out.append("| curves × window | bits | " + " | ".join(names) + " |")
        out.append("|---|---|" + "---|" * len(names))
        patterns = list(dict.fromkeys(r["pattern"] for r in first["rows"]))
        for pattern in patterns:
            row = next(r for r in first["rows"] if r["pattern"] == pattern)
            tag = row_tag(row, n_max)
            cells = [_cell(layers[name]["rows"], n_max, pattern) for name in names]
            out.append(f"| {row['curves']}×{row['window']}{tag} | {row['bits']} | " + " | ".join(cells) + " |")
        own = first["pattern"]
        sizes = sorted({r["n"] for r in first["rows"]})
        out.append(f"\nOwn pattern by length N ({own}):\n")
        out.append("| N | " + " | ".join(names) + " |")
        out.append("|---|" + "---|" * len(names))
        for n in sizes:
            out.append(f"| {n} | " + " | ".join(_cell(layers[name]["rows"], n, own) for name in names) + " |")
        out.append("")
    return "\n".join(out)


def git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", help="run folders, or folders holding run folders")
    parser.add_argument("--out", default="benchmarks/results/zeta_recall_trained.json", help="JSON written atomically")
    parser.add_argument("--examples", type=int, default=32, help="held-out examples fed per run (default 32)")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--lengths", type=int, nargs="*", default=[64, 128], help="prefix lengths besides the full one")
    parser.add_argument("--seed", type=int, default=0, help="seeds the random q/k")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    run_dirs = [path for folder in args.runs for path in find_runs(folder)]
    results = [measure_run(load_run(path), args.examples, args.batch_size, args.lengths, args.seed) for path in run_dirs]
    report = {
        "command": " ".join(["python", "benchmarks/zeta_recall_trained.py", *(sys.argv[1:] if argv is None else argv)]),
        "commit": git_commit(),
        "options": vars(args),
        "runs": results,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(args.out, json.dumps(report, indent=1, default=str))
    print(markdown_tables(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Pictures of patterns: selection masks as a grid of heatmaps, and attention maps of a trained run.

``sparsefocus patterns TOPK:5 BAND:5(1) BLOC:8 --n 64 [--causal] [--out patterns.png]`` draws the
masks; input-dependent patterns are drawn on random queries and keys (``--seed``), or on the
queries and keys of a trained run's first layer for one training example (``--run RUN_DIR``).
``--attention --run RUN_DIR [--example I] [--layer L]`` draws the attention weights of every
model of the run on that example instead.
"""

from __future__ import annotations

import argparse
import math
import textwrap
from pathlib import Path

import numpy as np
import torch
from torch import Tensor, nn

from sparsefocus.analysis.files import save_figure
from sparsefocus.analysis.hooks import AttentionCall, capture_attention
from sparsefocus.attention import parse_pattern, selection_mask, sparse_attention
from sparsefocus.attention.patterns import Pattern
from sparsefocus.clitools import HelpFormatter, fail


def pattern_params(pattern: Pattern) -> dict[str, Tensor] | None:
    """The pattern's freshly initialised trainable parameters for one head, or None."""
    params = {name: p.detach() for name, p in pattern.make_parameters(1).items()}
    return params or None


def random_queries_keys(pattern: Pattern, n: int, head_dim: int = 16, seed: int = 0) -> tuple[Tensor, Tensor]:
    """Random q, k [1, 1, n, pattern.qk_dim(head_dim)] for drawing input-dependent masks."""
    generator = torch.Generator().manual_seed(seed)
    width = pattern.qk_dim(head_dim)
    q = torch.randn(1, 1, n, width, generator=generator)
    k = torch.randn(1, 1, n, width, generator=generator)
    return q, k


def pattern_mask(
    pattern: str | Pattern,
    n: int,
    *,
    causal: bool = False,
    q: Tensor | None = None,
    k: Tensor | None = None,
    seed: int = 0,
) -> np.ndarray:
    """[n, n] bool mask of a pattern (head 0), on the given q, k [1, H, n, D] or random ones."""
    spec = parse_pattern(pattern)
    if q is None or k is None:
        q, k = random_queries_keys(spec, n, seed=seed)
    mask = selection_mask(spec, q, k, causal=causal, params=pattern_params(spec))
    return mask[0, 0].cpu().numpy()


def _grid(count: int, width: float = 3.0):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = min(4, count)
    rows = math.ceil(count / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(width * cols, width * rows + 0.3), squeeze=False)
    for axis in axes.flat[count:]:
        axis.axis("off")
    return plt, fig, list(axes.flat[:count])


def draw_masks(masks: dict[str, np.ndarray], path: str, title: str = "") -> None:
    """One heatmap per mask (black = kept), titled with its label and the share of pairs kept."""
    if not masks:
        raise ValueError("draw_masks needs at least one pattern")
    plt, fig, axes = _grid(len(masks))
    for axis, (label, mask) in zip(axes, masks.items()):
        axis.imshow(mask, cmap="Greys", vmin=0, vmax=1, interpolation="nearest")  # black = kept, white = dropped
        axis.set_title(f"{textwrap.fill(label, 32)}\n{100 * mask.mean():.1f}% kept", fontsize=9)
        axis.set_xlabel("key", fontsize=8)
        axis.set_ylabel("query", fontsize=8)
        axis.tick_params(labelsize=7)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    save_figure(fig, path)
    plt.close(fig)


def draw_maps(maps: dict[str, np.ndarray], path: str, title: str = "") -> None:
    """One heatmap of attention weights per entry, each with its own colour bar."""
    if not maps:
        raise ValueError("draw_maps needs at least one attention map")
    plt, fig, axes = _grid(len(maps), width=3.4)
    for axis, (label, weights) in zip(axes, maps.items()):
        shown = axis.imshow(weights, cmap="viridis", interpolation="nearest")
        axis.set_title(textwrap.fill(label, 32), fontsize=9)
        axis.set_xlabel("key", fontsize=8)
        axis.set_ylabel("query", fontsize=8)
        axis.tick_params(labelsize=7)
        fig.colorbar(shown, ax=axis, fraction=0.046).set_label("attention weight", fontsize=8)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    save_figure(fig, path)
    plt.close(fig)


def call_weights(call: AttentionCall) -> Tensor:
    """Attention weights [B, H, N, M] of a hooked layer call, for any mechanism: attention applied
    to identity values (v = I_M) returns the weight rows themselves."""
    batch, heads, n_keys = call.k.shape[0], call.k.shape[1], call.k.shape[2]
    eye = torch.eye(n_keys, dtype=torch.float32, device=call.k.device).expand(batch, heads, n_keys, n_keys)
    with torch.no_grad():
        return sparse_attention(
            call.q.float(),
            call.k.float(),
            eye,
            call.module.pattern,
            causal=call.module.causal,
            key_padding_mask=call.key_padding_mask,
            impl="reference",
            params=call.params,
        )


def layer_calls(model: nn.Module, idx: Tensor) -> list[AttentionCall]:
    """Run ``model(idx)`` in eval mode without gradients and return every attention call, in order."""
    calls: list[AttentionCall] = []
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), capture_attention(model, calls.append):
            model(idx)
    finally:
        model.train(was_training)
    return calls


def pick_layer(calls: list[AttentionCall], layer: int) -> AttentionCall:
    if not -len(calls) <= layer < len(calls):
        raise ValueError(f"--layer {layer} is out of range: the model has {len(calls)} attention layers")
    return calls[layer]


def run_queries_keys(run_dir: str, example: int, layer: int) -> tuple[Tensor, Tensor, str]:
    """q, k [1, H, N, D] of one layer of the first model of a run folder on training example
    ``example``, and a description of where they come from."""
    from sparsefocus.analysis.runs import find_runs, load_run

    run = load_run(find_runs(run_dir)[0])
    call = pick_layer(layer_calls(run.model, _example(run, example)), layer)
    return call.q, call.k, f"q, k of {run.label} (seed {run.seed}) layer {layer}, train example {example}"


def _example(run, example: int) -> Tensor:
    inputs = run.data.train_inputs
    if not 0 <= example < inputs.shape[0]:
        raise ValueError(f"--example {example} is out of range: the task has {inputs.shape[0]} training examples")
    return inputs[example : example + 1]


def run_attention_maps(run_dir: str, example: int, layer: int, head: int = 0) -> dict[str, np.ndarray]:
    """Attention weights [N, M] of layer ``layer``, head ``head`` on one training example, for the
    first seed of every mechanism of a run folder, keyed by mechanism label."""
    from sparsefocus.analysis.runs import find_runs, group_runs, load_run

    maps = {}
    for (setting, label), paths in group_runs(find_runs(run_dir)).items():
        run = load_run(paths[0])
        call = pick_layer(layer_calls(run.model, _example(run, example)), layer)
        if not 0 <= head < call.q.shape[1]:
            raise ValueError(f"--head {head} is out of range: {label} has {call.q.shape[1]} heads")
        name = label if setting == "default" else f"{label} [{setting}]"
        maps[name] = call_weights(call)[0, head].cpu().numpy()
    return maps


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="sparsefocus patterns",
        description="Draw the selection masks of patterns, or the attention maps of a trained run.",
        epilog='example: sparsefocus patterns TOPK:5 "BAND:5(1)" zeta:k=8 --n 48 --out masks.png',
        formatter_class=HelpFormatter,
    )
    parser.add_argument("patterns", nargs="*", help='pattern specs, e.g. TOPK:5 "BAND:5(1)" zeta:k=8')
    parser.add_argument("--n", type=int, default=64, help="sequence length")
    parser.add_argument("--causal", action="store_true", help="draw causal masks")
    parser.add_argument("--out", default=None, help="PNG path (default: patterns.png, or attention.png with --attention)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random q, k")
    parser.add_argument("--run", default=None, help="run folder: draw on its model's q, k instead of random ones")
    parser.add_argument("--attention", action="store_true", help="draw the run's attention maps (needs --run)")
    parser.add_argument("--example", type=int, default=0, help="training example of the run")
    parser.add_argument("--layer", type=int, default=0, help="attention layer of the run")
    parser.add_argument("--head", type=int, default=0, help="head of the attention maps")
    args = parser.parse_args(argv)
    if args.attention and args.run is None:
        parser.error("--attention needs --run RUN_DIR")
    if not args.attention and not args.patterns:
        parser.error("give at least one pattern (or --attention --run RUN_DIR)")
    if args.n < 1:
        parser.error(f"--n must be >= 1, got {args.n}")
    if args.out is not None and not Path(args.out).resolve().parent.is_dir():
        parser.error(f"--out {args.out}: the folder {Path(args.out).parent} does not exist")
    return args


def masks_for(args: argparse.Namespace) -> tuple[dict[str, np.ndarray], str]:
    """The masks to draw and a figure title."""
    q = k = None
    where = f"N={args.n}, random q, k (seed {args.seed})"
    if args.run is not None:
        q, k, where = run_queries_keys(args.run, args.example, args.layer)
    masks = {}
    for spec in args.patterns:
        pattern = parse_pattern(spec)
        fits = q is not None and pattern.qk_dim(q.shape[-1]) == q.shape[-1]
        n = q.shape[-2] if q is not None else args.n
        masks[pattern.label()] = pattern_mask(
            pattern, n, causal=args.causal, q=q if fits else None, k=k if fits else None, seed=args.seed
        )
    return masks, where + (", causal" if args.causal else "")


def main(argv: list[str] | None = None) -> int:
    """``sparsefocus patterns``: see the module docstring."""
    args = parse_args([] if argv is None else argv)
    try:
        if args.attention:
            out = args.out or "attention.png"
            title = f"attention weights, layer {args.layer}, head {args.head}, train example {args.example}"
            draw_maps(run_attention_maps(args.run, args.example, args.layer, args.head), out, title)
        else:
            out = args.out or "patterns.png"
            masks, title = masks_for(args)
            draw_masks(masks, out, title)
    except ValueError as error:
        return fail("sparsefocus patterns", error)
    print(f"wrote {out}")
    return 0

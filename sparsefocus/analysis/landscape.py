"""Loss landscapes around trained weights and the Lipschitz estimates read off them.

As in the Semantic Focus paper's code (``ll-test.py``, ``lgrads.py``): draw two Gaussian
directions, rescale each parameter tensor's slice of a direction to that tensor's Frobenius norm
(tensor-wise, after Li et al. 2018), evaluate the loss at theta + a d1 + b d2 on a square grid
a, b in linspace(-radius, radius, steps), and estimate the local Lipschitz constant as
|L(neighbour) - L(point)| / grid step over neighbouring grid points on both axes, restricted to
[-r, r]^2, reported as percentiles 50/75/95/99 against r.

The window [-r, r]^2 is the closed, centred one by default (``window="centred"``: every grid point
with |a| <= r). ``window="paper"`` takes ``lgrads.py``'s index slice
[int((-r - a_0) / step), int((r - a_0) / step)): half-open, so it ends one grid point before +r,
and where the truncation rounds -r down it starts one point below -r: the window shifted by one
step (the paper's 200-point grid at r = 0.01 keeps a = -0.015, -0.005 instead of -0.005, 0.005).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from sparsefocus.analysis.files import save_figure

LIPSCHITZ_PERCENTILES = (50, 75, 95, 99)
LIPSCHITZ_WINDOWS = ("centred", "paper")


@dataclass
class Landscape:
    """Loss values ``loss[i, j]`` at theta + alphas[i] d1 + alphas[j] d2."""

    alphas: np.ndarray
    loss: np.ndarray

    @property
    def step(self) -> float:
        return float(self.alphas[1] - self.alphas[0])


def random_directions(model: nn.Module, seed: int = 11111) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Two directions, each a list with one tensor per parameter of ``model`` (in
    ``model.parameters()`` order), every tensor rescaled to the Frobenius norm of its parameter."""
    generator = torch.Generator().manual_seed(seed)
    directions: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])
    for param in model.parameters():
        norm = param.detach().float().norm()
        for direction in directions:
            noise = torch.randn(param.shape, generator=generator, dtype=torch.float32)
            direction.append((noise * (norm / noise.norm().clamp_min(1e-12))).to(param.device, param.dtype))
    return directions


@contextlib.contextmanager
def perturbed(model: nn.Module) -> Iterator[Callable[[float, float, list, list], None]]:
    """Context giving ``move(a, b, d1, d2)`` that sets the weights to theta + a d1 + b d2; the
    original weights are restored on exit, also after an error."""
    params = list(model.parameters())
    origin = [p.detach().clone() for p in params]

    def move(a: float, b: float, d1: list, d2: list) -> None:
        with torch.no_grad():
            for param, base, x, y in zip(params, origin, d1, d2):
                param.copy_(base + a * x + b * y)

    try:
        yield move
    finally:
        with torch.no_grad():
            for param, base in zip(params, origin):
                param.copy_(base)


def loss_grid(
    model: nn.Module,
    loss_fn: Callable[[nn.Module], float],
    *,
    steps: int = 11,
    radius: float = 1.0,
    seed: int = 11111,
    progress: bool = False,
) -> Landscape:
    """Evaluate ``loss_fn(model)`` on a steps x steps grid of perturbed weights.

    Args:
        model: the trained model; its weights are restored afterwards.
        loss_fn: model -> scalar loss (e.g. cross-entropy over training batches, in eval mode).
        steps: points per axis (the paper: 200). Default 11, small enough for a CPU.
        radius: grid half-width in units of the per-tensor-normalised directions (paper: 1). Default 1.
        seed: seed of the two directions (paper: 11111).
    Returns:
        ``Landscape`` with alphas [steps] and loss [steps, steps].
    """
    if steps < 2:
        raise ValueError(f"landscape steps must be >= 2, got {steps}")
    if radius <= 0:
        raise ValueError(f"landscape radius must be > 0, got {radius}")
    d1, d2 = random_directions(model, seed)
    alphas = np.linspace(-radius, radius, steps)
    loss = np.zeros((steps, steps))
    points = [(i, j) for i in range(steps) for j in range(steps)]
    if progress:
        from tqdm import tqdm

        points = tqdm(points, desc="landscape", leave=False)
    with perturbed(model) as move, torch.no_grad():
        for i, j in points:
            move(float(alphas[i]), float(alphas[j]), d1, d2)
            loss[i, j] = float(loss_fn(model))
    return Landscape(alphas, loss)


def window_indices(alphas: np.ndarray, radius: float, window: str = "centred") -> np.ndarray:
    """Grid indices of the window [-radius, radius] on one axis (see the module docstring)."""
    if window not in LIPSCHITZ_WINDOWS:
        raise ValueError(f"Lipschitz window must be one of {', '.join(LIPSCHITZ_WINDOWS)}, got {window!r}")
    step = float(alphas[1] - alphas[0])
    if window == "paper":
        lower, upper = int((-radius - alphas[0]) / step), int((radius - alphas[0]) / step)
        return np.arange(len(alphas))[lower:upper]
    return np.nonzero(np.abs(alphas) <= radius + 1e-9 * step)[0]


def neighbour_slopes(landscape: Landscape, radius: float, window: str = "centred") -> np.ndarray:
    """|L difference| / step between neighbouring grid points inside [-radius, radius]^2, both axes."""
    inside = window_indices(landscape.alphas, radius, window)
    grid = landscape.loss[np.ix_(inside, inside)]
    along_a = np.abs(np.diff(grid, axis=0)).reshape(-1)
    along_b = np.abs(np.diff(grid, axis=1)).reshape(-1)
    return np.concatenate([along_a, along_b]) / landscape.step


def lipschitz_profile(
    landscape: Landscape, percentiles: tuple[int, ...] = LIPSCHITZ_PERCENTILES, window: str = "centred"
) -> dict[str, list[float]]:
    """Lipschitz estimates against the distance r from the optimum.

    r runs over the grid's positive coordinates that give the window (``"centred"`` or
    ``"paper"``, see the module docstring) at least one pair of neighbours.
    Returns ``{"r": [...], "p50": [...], ...}``.
    """
    profile: dict[str, list[float]] = {"r": [], **{f"p{q}": [] for q in percentiles}}
    for radius in (float(a) for a in landscape.alphas if a >= landscape.step / 2):
        slopes = neighbour_slopes(landscape, radius, window)
        if slopes.size == 0:
            continue
        profile["r"].append(radius)
        for q in percentiles:
            profile[f"p{q}"].append(float(np.percentile(slopes, q)))
    return profile


def plot_landscapes(landscapes: dict[str, Landscape], path: str, levels: int = 30) -> None:
    """Contour plots of each mechanism's landscape side by side on one log colour scale, one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib import colors

    if not landscapes:
        raise ValueError("plot_landscapes needs at least one landscape")
    fig, axes = plt.subplots(1, len(landscapes), figsize=(4 * len(landscapes), 3.6), squeeze=False)
    # one log scale for every panel, so that equal colours mean equal losses across mechanisms
    low = max(min(float(land.loss.min()) for land in landscapes.values()), 1e-6)
    high = max(max(float(land.loss.max()) for land in landscapes.values()), 2 * low)
    bounds = np.geomspace(low, high * (1 + 1e-9), levels)
    for axis, (label, land) in zip(axes[0], landscapes.items()):
        shown = axis.contourf(land.alphas, land.alphas, land.loss.T, levels=bounds, norm=colors.LogNorm(low, high))
        axis.plot([0], [0], "w+", markersize=10)
        axis.set_title(label)
        axis.set_xlabel("direction 1")
        axis.set_ylabel("direction 2")
        fig.colorbar(shown, ax=axis, format="%.3g")
    fig.tight_layout()
    save_figure(fig, path)
    plt.close(fig)


def plot_lipschitz(profiles: dict[str, dict[str, list[float]]], path: str) -> None:
    """Lipschitz percentiles against r, every mechanism on one axis (one colour each)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not profiles:
        raise ValueError("plot_lipschitz needs at least one profile")
    styles = {"p50": ":", "p75": "-.", "p95": "--", "p99": "-"}
    fig, axis = plt.subplots(figsize=(5.5, 4))
    for index, (label, profile) in enumerate(profiles.items()):
        colour = f"C{index}"
        for key, values in profile.items():
            if key != "r":
                axis.plot(profile["r"], values, styles.get(key, "-"), color=colour, label=f"{label} {key}")
    axis.set_xlabel("grid radius r around the trained weights")
    axis.set_ylabel("|L(a) - L(b)| / |a - b| between neighbours")
    axis.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    save_figure(fig, path)
    plt.close(fig)

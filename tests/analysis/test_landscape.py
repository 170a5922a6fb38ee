import numpy as np
import pytest
import torch
from torch import nn

from sparsefocus.analysis.landscape import (
    Landscape,
    lipschitz_profile,
    loss_grid,
    neighbour_slopes,
    plot_landscapes,
    plot_lipschitz,
    random_directions,
)


class Quadratic(nn.Module):
    """Loss sum_t ||w_t - c_t||^2 over two parameter tensors of different shapes and norms."""

    def __init__(self):
        super().__init__()
        self.w1 = nn.Parameter(torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64))
        self.w2 = nn.Parameter(torch.tensor([[3.0, 0.0], [1.0, 4.0]], dtype=torch.float64))
        self.centres = [torch.tensor([0.5, -1.0, 0.0], dtype=torch.float64), torch.ones(2, 2, dtype=torch.float64)]

    def loss(self) -> float:
        return float(sum(((w - c) ** 2).sum() for w, c in zip(self.parameters(), self.centres)))


def analytic_loss(model, d1, d2, a, b):
    """L(a, b) = C + 2a<e,d1> + 2b<e,d2> + a^2|d1|^2 + b^2|d2|^2 + 2ab<d1,d2>, e = theta - c."""
    e = [w.detach() - c for w, c in zip(model.parameters(), model.centres)]

    def dot(xs, ys):
        return float(sum((x * y).sum() for x, y in zip(xs, ys)))

    return (
        dot(e, e) + 2 * a * dot(e, d1) + 2 * b * dot(e, d2) + a * a * dot(d1, d1) + b * b * dot(d2, d2) + 2 * a * b * dot(d1, d2)
    )


def test_directions_have_the_norm_of_each_parameter_tensor():
    model = Quadratic()
    d1, d2 = random_directions(model, seed=3)
    for param, x, y in zip(model.parameters(), d1, d2):
        assert x.shape == param.shape
        assert float(x.norm()) == pytest.approx(float(param.detach().norm()))
        assert float(y.norm()) == pytest.approx(float(param.detach().norm()))
        assert not torch.allclose(x, y)


def test_grid_matches_the_analytic_quadratic_and_restores_the_weights():
    model = Quadratic()
    before = [p.detach().clone() for p in model.parameters()]
    land = loss_grid(model, Quadratic.loss, steps=7, radius=0.6, seed=3)
    d1, d2 = random_directions(model, seed=3)
    for i, a in enumerate(land.alphas):
        for j, b in enumerate(land.alphas):
            assert land.loss[i, j] == pytest.approx(analytic_loss(model, d1, d2, a, b), rel=1e-10)
    assert land.alphas[0] == -0.6 and land.alphas[-1] == 0.6 and land.loss.shape == (7, 7)
    for param, original in zip(model.parameters(), before):
        assert torch.equal(param.detach(), original)


def test_lipschitz_estimates_match_the_analytic_finite_differences():
    model = Quadratic()
    land = loss_grid(model, Quadratic.loss, steps=9, radius=1.0, seed=3)
    d1, d2 = random_directions(model, seed=3)
    h = land.step
    inside = [a for a in land.alphas if abs(a) <= 0.5 + 1e-12]
    slopes = []
    for a in inside:
        for b in inside:
            if a + h <= 0.5 + 1e-12:
                slopes.append(abs(analytic_loss(model, d1, d2, a + h, b) - analytic_loss(model, d1, d2, a, b)) / h)
            if b + h <= 0.5 + 1e-12:
                slopes.append(abs(analytic_loss(model, d1, d2, a, b + h) - analytic_loss(model, d1, d2, a, b)) / h)
    profile = lipschitz_profile(land)
    assert profile["r"] == pytest.approx([0.25, 0.5, 0.75, 1.0])
    for q in (50, 75, 95, 99):
        assert profile[f"p{q}"][1] == pytest.approx(np.percentile(slopes, q), rel=1e-9)
    assert sorted(neighbour_slopes(land, 0.5)) == pytest.approx(sorted(slopes), rel=1e-9)


def test_estimates_grow_with_the_radius_on_a_quadratic_at_its_minimum():
    model = Quadratic()
    model.centres = [p.detach().clone() for p in model.parameters()]
    profile = lipschitz_profile(loss_grid(model, Quadratic.loss, steps=9, radius=1.0, seed=3))
    assert all(x < y for x, y in zip(profile["p99"], profile["p99"][1:]))


def test_bad_grid_settings_raise():
    with pytest.raises(ValueError, match="steps"):
        loss_grid(Quadratic(), Quadratic.loss, steps=1)
    with pytest.raises(ValueError, match="radius"):
        loss_grid(Quadratic(), Quadratic.loss, radius=0.0)


def test_figures_are_non_empty_pngs(tmp_path):
    alphas = np.linspace(-1, 1, 5)
    lands = {
        "FULL": Landscape(alphas, 1 + np.add.outer(alphas**2, alphas**2)),
        "TOPK:5": Landscape(alphas, 0.5 + np.add.outer(alphas**2, 2 * alphas**2)),
    }
    plot_landscapes(lands, str(tmp_path / "contours.png"))
    plot_lipschitz({k: lipschitz_profile(v) for k, v in lands.items()}, str(tmp_path / "lipschitz.png"))
    for name in ("contours.png", "lipschitz.png"):
        data = (tmp_path / name).read_bytes()
        assert data.startswith(b"\x89PNG") and len(data) > 1000

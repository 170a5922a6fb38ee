"""The Triton scaled scan (ZETA's causal mean token) against torch: ``CausalMeanScan`` vs
``CausalMean`` outputs and gradients at odd lengths spanning several 64-row tiles, with padded
keys, fp32 and fp16; ``scaled_scan`` forward and reversed against an explicit cumulative sum.
Each in both forms: one pass over short rows, and the two-level form (its carries in one chunk or
in several)."""

import pytest
import torch

from sparsefocus.attention.zeta import CausalMean
from sparsefocus.kernels.scan import CausalMeanScan, scaled_scan

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


FORMS = ["one-pass", "one-pass, small tiles", "two-level", "two-level, chunked carries"]


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    return ((x.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-12)).item()


def use_form(monkeypatch, form: str) -> None:
    """One pass for every row (small tiles: 16 rows, so many tiles a program), or never
    (two-level); chunked: carries over chunks of 2 tile sums."""
    monkeypatch.setattr("sparsefocus.kernels.scan.ONE_PASS_MAX_N", 10**9 if form.startswith("one-pass") else 0)
    if "small tiles" in form:
        monkeypatch.setattr("sparsefocus.kernels.scan.ONE_PASS_TILE", {"BLOCK_N": 16, "num_warps": 1})
    monkeypatch.setattr("sparsefocus.kernels.scan.CARRY_BLOCK", 2 if "chunked" in form else 256)


@pytest.mark.parametrize("n", [1, 63, 64, 200, 300])
@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("form", FORMS)
def test_scaled_scan_matches_explicit_sum(monkeypatch, n, reverse, form):
    """Chunked carries: the tile sums' carries run over several chunks (odd tile counts included)."""
    use_form(monkeypatch, form)
    x = torch.randn(2, 3, n, 5, device=DEVICE)
    pre, post = torch.rand(2, n, device=DEVICE), torch.rand(2, n, device=DEVICE)
    scaled = x * pre[:, None, :, None]
    total = scaled.flip(2).cumsum(2).flip(2) if reverse else scaled.cumsum(2)
    want = total * post[:, None, :, None]
    assert rel_err(scaled_scan(x, pre, post, reverse=reverse), want) < 1e-5


@pytest.mark.parametrize("width", [5, 40])
@pytest.mark.parametrize("form", FORMS[:3])
def test_scaled_scan_adds_a_base_and_stores_the_asked_dtype(monkeypatch, width, form):
    """``base`` (the atomics' fp32 gradient) is added before the one store, in ``dtype``."""
    use_form(monkeypatch, form)
    x = torch.randn(2, 3, 150, width, device=DEVICE, dtype=torch.float16)
    pre, post = torch.rand(2, 150, device=DEVICE), torch.rand(2, 150, device=DEVICE)
    base = torch.randn(2, 3, 150, width, device=DEVICE)
    got = scaled_scan(x, pre, post, reverse=True, base=base, dtype=torch.float32)
    want = scaled_scan(x.float(), pre, post, reverse=True) + base
    assert got.dtype == torch.float32 and rel_err(got, want) < 1e-5
    with pytest.raises(ValueError, match="base"):
        scaled_scan(x, pre, post, base=base[:, :, :7])


@pytest.mark.parametrize("n", [1, 7, 130])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float16, 2e-3)])
@pytest.mark.parametrize("form", FORMS[:3])
def test_causal_mean_scan_matches_torch_twin(monkeypatch, n, dtype, tol, form):
    use_form(monkeypatch, form)
    x = torch.randn(2, 3, n, 67, device=DEVICE, dtype=dtype)
    real = torch.rand(2, n, device=DEVICE) > 0.3
    real[1, 0] = False  # a row before any real key: count 0, mean 0
    count = real.float().cumsum(-1)
    grad = torch.randn_like(x)
    results = []
    for fn in (CausalMean, CausalMeanScan):
        leaf = x.clone().requires_grad_()
        out = fn.apply(leaf, real, count)
        (dx,) = torch.autograd.grad(out, leaf, grad)
        results.append((out, dx))
    (want, want_dx), (got, got_dx) = results
    assert torch.isfinite(got).all() and torch.isfinite(got_dx).all()
    assert rel_err(got, want) < tol
    assert rel_err(got_dx, want_dx) < tol
    assert (got_dx[~real[:, None, :].expand(-1, 3, -1)] == 0).all()  # padded keys get no gradient


@pytest.mark.parametrize("form", FORMS)
def test_scan_is_causal(monkeypatch, form):
    """Bitwise: later rows never move an earlier row's sum, nor (reversed) earlier rows a later one."""
    use_form(monkeypatch, form)
    x = torch.randn(1, 2, 450, 4, device=DEVICE)
    ones = torch.ones(1, 450, device=DEVICE)
    changed = x.clone()
    changed[:, :, 300:] = torch.randn(1, 2, 150, 4, device=DEVICE)
    assert torch.equal(scaled_scan(x, ones, ones)[:, :, :300], scaled_scan(changed, ones, ones)[:, :, :300])
    changed = x.clone()
    changed[:, :, :150] = torch.randn(1, 2, 150, 4, device=DEVICE)
    forward, backward = (scaled_scan(y, ones, ones, reverse=True)[:, :, 150:] for y in (x, changed))
    assert torch.equal(forward, backward)


@pytest.mark.parametrize("n", [1, 5, 2500])
def test_mean_rows_equal_the_torch_scales_bitwise(n):
    """One launch for the causal mean's scales and mask, across several chunks of keys, with
    padded keys (a row before any real key included) and without a mask: bitwise torch's values."""
    from sparsefocus.kernels.scan import mean_rows, mean_scales

    real = torch.rand(2, n, device=DEVICE) > 0.3
    real[1, 0] = False
    keys = torch.empty(2, 1, n, 4, device=DEVICE)
    for given in (real, torch.ones_like(real)):
        realf, inverse, mask = mean_rows(keys, given, 3)
        count = given.float().cumsum(-1)
        want_realf, want_inverse = mean_scales(given, count)
        assert torch.equal(realf, want_realf) and torch.equal(inverse, want_inverse)
        assert mask.dtype == torch.int8 and torch.equal(mask, (count > 0)[:, None].expand(-1, 3, -1).to(torch.int8))
    assert all(torch.equal(x, y) for x, y in zip(mean_rows(keys, None, 3), mean_rows(keys, torch.ones_like(real), 3)))
    with pytest.raises(ValueError, match="real must be"):
        mean_rows(keys, real[:, :-1], 3)

"""ZETA: Morton codes, the lean selection against its dense definition, causality, the mean
token, gradients (gamma included), recall, the layer and the Triton path in the interpreter."""

import pytest
import torch

from block_sparse_checks import impl_device

import sparsefocus as sf
from sparsefocus.attention.common import mask_from_indices
from sparsefocus.attention.zeta import (
    _codes,
    _dense_window,
    code_bits,
    candidate_recall,
    curve_codes,
    dense_selection,
    mean_tokens,
    morton_codes,
    row_cumsum,
    select_keys,
    select_keys_fused,
)
from sparsefocus.layers import SparseAttention


def _slow_morton(point: list[int], bits: int) -> int:
    """Bit-by-bit interleave, most significant bit first, coordinate 0 leading each group."""
    code = 0
    for bit in reversed(range(bits)):
        for value in point:
            code = (code << 1) | ((value >> bit) & 1)
    return code


def _qkv(n, batch=2, heads=2, kv_heads=1, dim=3, dv=5, seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, n, dim, generator=gen, dtype=dtype)
    k = torch.randn(batch, kv_heads, n, dim, generator=gen, dtype=dtype)
    v = torch.randn(batch, kv_heads, n, dv, generator=gen, dtype=dtype)
    return q, k, v


TRITON_DEVICE = impl_device("triton")


def _run(q, k, v, pattern, *, impl, params=None, key_padding_mask=None, **kwargs):
    """``sparse_attention`` with the Triton path on CUDA where there is one; the output comes back
    to the CPU, and gradients flow back to the CPU tensors."""
    device = impl_device(impl)
    moved = {name: p.to(device) for name, p in (params or {}).items()}
    padding = None if key_padding_mask is None else key_padding_mask.to(device)
    q, k, v = (x.to(device) for x in (q, k, v))
    return sf.sparse_attention(q, k, v, pattern, impl=impl, params=moved, key_padding_mask=padding, **kwargs).cpu()


def _fused(spec, q, k, causal, padding):
    """``select_keys_fused`` (the Triton selection) on CUDA where there is one; lists back on the CPU."""
    padding = None if padding is None else padding.to(TRITON_DEVICE)
    return select_keys_fused(spec, q.to(TRITON_DEVICE), k.to(TRITON_DEVICE), causal, padding).cpu()


@pytest.mark.parametrize("dims,bits", [(3, 12), (3, 21), (2, 16), (1, 20), (5, 9)])
def test_morton_codes_match_bit_by_bit_interleave(dims, bits):
    gen = torch.Generator().manual_seed(dims * 100 + bits)
    grid = torch.randint(0, 1 << bits, (200, dims), generator=gen)
    fast = morton_codes(grid, bits)
    slow = torch.tensor([_slow_morton(row.tolist(), bits) for row in grid])
    assert torch.equal(fast, slow)


def test_morton_code_puts_first_coordinate_in_most_significant_bit():
    grid = torch.tensor([[1, 0, 0], [0, 1, 0], [0, 0, 1], [2, 0, 0]])
    assert morton_codes(grid, 2).tolist() == [4, 2, 1, 32]


def test_shifted_curve_zero_equals_single_curve():
    x = torch.randn(50, 3)
    assert torch.equal(curve_codes(x, 12, 0, 1), curve_codes(x, 12, 0, 3))  # the extra top bits are zero


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(
    "pattern", ["zeta:k=8,window=16,chunks=4,local=4", "zeta:k=6,window=5,curves=3,chunks=3,local=0", "zeta:k=5,window=4,bits=3"]
)
def test_lean_selection_equals_dense_definition(pattern, causal):
    q, k, _ = _qkv(150, seed=1)
    padding = torch.rand(2, 150, generator=torch.Generator().manual_seed(2)) > 0.2
    spec = sf.parse_pattern(pattern)
    lean = mask_from_indices(select_keys(spec, q, k, causal, padding), 150)
    dense = dense_selection(spec, q, k.expand(-1, 2, -1, -1), causal, padding)
    assert torch.equal(lean, dense)
    assert lean.sum(-1).max() <= spec.k and not lean[~padding[:, None, None, :].expand_as(lean)].any()


def test_selection_keeps_the_nearest_candidates_and_all_when_window_covers_everything():
    q, k, _ = _qkv(40, heads=1, seed=3)
    mask = sf.selection_mask("zeta:k=5,window=40", q, k)
    distance = torch.cdist(q, k).pow(2)
    exact = torch.zeros_like(mask).scatter_(-1, distance.topk(5, largest=False).indices, True)
    assert torch.equal(mask, exact)


def test_causal_selection_of_a_query_ignores_keys_after_it():
    spec = sf.parse_pattern("zeta:k=6,window=8,chunks=5,local=3,curves=2")
    q, k, _ = _qkv(120, seed=4)
    before = select_keys(spec, q, k, True, None)
    k2 = k.clone()
    k2[:, :, 70:] = torch.randn_like(k2[:, :, 70:]) * 5
    after = select_keys(spec, q, k2, True, None)
    assert torch.equal(before[:, :, :70], after[:, :, :70])
    position = torch.arange(120)[None, None, :, None]
    assert ((before <= position) | (before < 0)).all()


def test_causal_chunks_hide_own_chunk_beyond_the_local_band():
    spec = sf.parse_pattern("zeta:k=50,window=50,chunks=2,local=2")
    q, k, _ = _qkv(20, heads=1, seed=5)
    mask = sf.selection_mask(spec, q, k, causal=True)[0, 0]  # chunks of 10
    assert mask[13].nonzero().flatten().tolist() == list(range(10)) + [12, 13]
    assert mask[5].nonzero().flatten().tolist() == [4, 5]


def test_recall_is_one_when_the_window_covers_every_key():
    q, k, _ = _qkv(64, seed=6)
    assert torch.all(candidate_recall(q, k, "zeta:k=8,window=64") == 1)
    assert torch.all(candidate_recall(q, k, "zeta:k=8,window=64,chunks=1,local=64", causal=True) == 1)


def test_two_curves_are_not_a_dyadic_shift_of_one_another():
    q, k, _ = _qkv(300, seed=13)
    one = candidate_recall(q, k, "zeta:k=8,window=8")
    two = candidate_recall(q, k, "zeta:k=8,window=8,curves=2")
    assert two.mean() > one.mean() + 0.05


def test_more_curves_never_lower_recall_and_recall_matches_a_direct_count():
    q, k, _ = _qkv(300, seed=7)
    one = candidate_recall(q, k, "zeta:k=8,window=8")
    three = candidate_recall(q, k, "zeta:k=8,window=8,curves=3")
    assert (three >= one).all() and three.mean() > one.mean()
    found = mask_from_indices(select_keys(sf.parse_pattern("zeta:k=8,window=8"), q, k, False, None), 300)
    exact = torch.zeros_like(found).scatter_(-1, torch.cdist(q, k.expand_as(q)).topk(8, largest=False).indices, True)
    torch.testing.assert_close(one, (found & exact).sum(-1).float() / 8)


def test_recall_is_nan_on_rows_that_see_no_key():
    q, k, _ = _qkv(10, seed=8)
    padding = torch.ones(2, 10, dtype=torch.bool)
    padding[1, :4] = False
    recall = candidate_recall(q, k, "zeta:k=2,window=4", causal=True, key_padding_mask=padding)
    assert recall[1, :, :4].isnan().all() and not recall[0].isnan().any()


def test_reference_gradients_including_gamma_pass_gradcheck():
    q, k, v = (x.double().requires_grad_() for x in _qkv(7, batch=1, heads=2, kv_heads=2, dv=2, seed=9))
    gamma = torch.tensor([0.7, 1.3], dtype=torch.float64, requires_grad=True)

    def run(q, k, v, gamma):
        return sf.sparse_attention(
            q, k, v, "zeta:k=3,window=4,chunks=3,local=2", causal=True, impl="reference", params={"gamma": gamma}
        )

    assert torch.autograd.gradcheck(run, (q, k, v, gamma), fast_mode=True)


def test_lean_equals_reference_with_trained_gamma_and_mean_token_reaches_every_value():
    q, k, v = (x.requires_grad_() for x in _qkv(50, seed=10))
    results = []
    for impl in ("reference", "lean"):
        gamma = torch.tensor([0.5, 2.0], requires_grad=True)
        out = sf.sparse_attention(q, k, v, "zeta:k=3,window=4,chunks=4,local=2", causal=True, impl=impl, params={"gamma": gamma})
        grads = torch.autograd.grad(out.pow(2).sum(), (q, k, v, gamma))
        results.append((out, *grads))
    for ref, lean in zip(*results):
        torch.testing.assert_close(lean, ref, atol=2e-5, rtol=1e-4)
    assert (results[1][3].abs().sum(-1) > 0).all(), "every value gets a gradient through the mean token"


def test_mean_token_alone_when_no_key_is_selected():
    q, k, v = _qkv(6, batch=1, heads=1, kv_heads=1, seed=11)
    out = sf.sparse_attention(q, k, v, "zeta:k=1,window=1,chunks=6,local=0", causal=True, impl="lean")
    # Query 0 searches no earlier chunk and has no band: only its mean token, the value v_0.
    torch.testing.assert_close(out[0, 0, 0], v[0, 0, 0])


@pytest.mark.parametrize(
    "pattern,name",
    [
        ("zeta:k=0", "k"),
        ("zeta:bits=21", "bits"),
        ("zeta:window=0", "window"),
        ("zeta:local=-1", "local"),
        ("zeta:gamma=0", "gamma"),
        ("zeta:gamma=0.0001", "gamma"),
        ("zeta:sink=2", "sink"),
        ("zeta:curves=0", "curves"),
        ("zeta:chunks=0", "chunks"),
        ("zeta:dk=40,curves=2", "dk"),
    ],
)
def test_bad_parameters_raise_value_error_naming_them(pattern, name):
    with pytest.raises(ValueError, match=name):
        sf.parse_pattern(pattern)


@pytest.mark.parametrize("impl", ["reference", "lean", "triton"])
def test_collapsed_gamma_and_a_key_at_distance_zero_stay_finite(impl):
    q, _, v = _qkv(24, kv_heads=2, seed=18)
    v.requires_grad_(True)
    k = q.clone()  # every query sits on its own key, which its local band always lists
    gamma = torch.tensor([0.0, 1e-40], requires_grad=True)  # trained widths collapse; 1e-40 squared is 0
    out = _run(q, k, v, "zeta:k=4,window=4,chunks=3,local=2", causal=True, impl=impl, params={"gamma": gamma})
    grads = torch.autograd.grad(out.pow(2).sum(), (v, gamma), allow_unused=True)
    assert torch.isfinite(out).all() and torch.isfinite(grads[0]).all()
    assert torch.equal(grads[1], torch.zeros(2))  # below the floor gamma gets no gradient


@pytest.mark.parametrize("causal", [False, True])
def test_sink_key_matches_in_every_path_and_trains(causal):
    q, k, v = _qkv(26, seed=19)
    results = []
    for impl in ("reference", "lean", "triton"):
        gamma = torch.tensor([0.7, 1.2], requires_grad=True)
        sink = torch.tensor([[0.2, -0.1, 0.3], [1.0, 1.0, 1.0]], requires_grad=True)
        params = {"gamma": gamma, "sink_key": sink}
        out = _run(q, k, v, "zeta:k=4,window=4,chunks=3,local=2,sink=1", causal=causal, impl=impl, params=params)
        results.append((out, *torch.autograd.grad(out.pow(2).sum(), (gamma, sink))))
    for name, ref, lean, tri in zip(("out", "dgamma", "dsink"), *results):
        torch.testing.assert_close(lean, ref, atol=1e-5, rtol=1e-4, msg=name)
        torch.testing.assert_close(tri, ref, atol=1e-4, rtol=1e-3, msg=name)
    assert results[0][2].abs().min() > 0  # every sink coordinate gets a gradient


def test_sink_takes_weight_only_from_the_denominator():
    q, k, v = _qkv(20, seed=20)
    gamma = torch.full((2,), 0.05)  # narrow: a key at distance 0 outweighs every other by far
    plain = sf.sparse_attention(q, k, v, "zeta:k=4,window=4,chunks=3,local=2", causal=True, impl="lean", params={"gamma": gamma})
    far = {"gamma": gamma, "sink_key": torch.full((2, 3), 1e4)}
    near = {"gamma": gamma, "sink_key": q[0, :, 7].clone()}  # on top of query 7 of batch 0
    pattern = "zeta:k=4,window=4,chunks=3,local=2,sink=1"
    torch.testing.assert_close(sf.sparse_attention(q, k, v, pattern, causal=True, impl="lean", params=far), plain)
    shrunk = sf.sparse_attention(q, k, v, pattern, causal=True, impl="lean", params=near)
    assert shrunk[0, :, 7].norm() < 0.1 * plain[0, :, 7].norm()


def test_layer_with_sink_owns_one_sink_key_per_head():
    layer = sf.layers.SparseAttention(16, 4, "zeta:k=4,window=4,chunks=2,local=2,sink=1", causal=True)
    assert layer.mechanism["sink_key"].shape == (4, 3)
    layer(torch.randn(2, 10, 16)).sum().backward()
    assert torch.isfinite(layer.mechanism["sink_key"].grad).all()


def test_too_wide_queries_raise_value_error():
    q, k, v = _qkv(8, dim=64)
    with pytest.raises(ValueError, match="too wide"):
        sf.sparse_attention(q, k, v, "zeta:k=2")


def test_layer_projects_to_dk_and_trains_gamma_per_head():
    torch.manual_seed(0)
    layer = SparseAttention(16, 4, "zeta:k=4,window=8,chunks=2,local=4,dk=3", causal=True, impl="lean")
    assert layer.q_proj.out_features == 4 * 3 and layer.v_proj.out_features == 16
    x = torch.randn(2, 30, 16)
    layer(x).pow(2).sum().backward()
    gamma = layer.mechanism["gamma"]
    assert gamma.shape == (4,) and torch.isfinite(gamma.grad).all() and gamma.grad.abs().sum() > 0


@pytest.mark.parametrize(
    "causal,key_grads,sink", [(False, "atomic", 0), (True, "atomic", 0), (True, "inverse", 1), (False, "inverse", 0)]
)
def test_triton_path_equals_lean_in_the_interpreter(monkeypatch, causal, key_grads, sink):
    from sparsefocus.kernels import indexed

    monkeypatch.setattr(indexed, "KEY_GRADS", key_grads)  # "inverse": dk, dv summed per key over an inverse index
    q, k, v = (x.requires_grad_() for x in _qkv(24, heads=2, kv_heads=1, seed=12))
    results = []
    pattern = "zeta:k=4,window=4,chunks=3,local=2,curves=2" + (",sink=1" if sink else "")
    for impl in ("lean", "triton"):
        gamma = torch.tensor([0.8, 1.5], requires_grad=True)
        params = {"gamma": gamma} | ({"sink_key": torch.tensor([[0.2, -0.1, 0.3], [0.5, 0.4, 0.1]])} if sink else {})
        out = _run(q, k, v, pattern, causal=causal, impl=impl, params=params)
        results.append((out, *torch.autograd.grad(out.pow(2).sum(), (q, k, v, gamma))))
    for name, lean, tri in zip(("out", "dq", "dk", "dv", "dgamma"), *results):
        torch.testing.assert_close(tri, lean, atol=1e-4, rtol=1e-3, msg=name)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(
    "pattern",
    [
        "zeta:k=8,window=16,chunks=4,local=4",
        "zeta:k=6,window=5,curves=3,chunks=3,local=0",
        "zeta:k=5,window=4,bits=3",
        "zeta:k=4,window=8,curves=2,chunks=3,local=3",
    ],
)
@pytest.mark.parametrize("padded", [True, False])
def test_fused_selection_kernel_equals_lean_selection(pattern, causal, padded):
    """Without a padding mask the fused path skips every pass over one (the kernel's PADDED off)."""
    q, k, _ = _qkv(70, seed=14)
    padding = torch.rand(2, 70, generator=torch.Generator().manual_seed(15)) > 0.2 if padded else None
    spec = sf.parse_pattern(pattern)
    lean = select_keys(spec, q, k, causal, padding)
    fused = _fused(spec, q, k, causal, padding)
    assert fused.shape == lean.shape
    assert torch.equal(mask_from_indices(fused, 70), mask_from_indices(lean, 70))


def test_chunked_causal_mean_equals_cumulative_sum_with_gradients(monkeypatch):
    monkeypatch.setattr("sparsefocus.attention.zeta.MEAN_BUDGET", 7 * 2 * 2 * 5)  # blocks of 7 rows (B = H = 2, Dv = 5)
    _, k, v = _qkv(30, kv_heads=2, seed=16)
    v = v.double().requires_grad_()
    padding = torch.rand(2, 30, generator=torch.Generator().manual_seed(17)) > 0.3
    _, mean_v, present = mean_tokens(k, v, True, padding)
    weight = padding[:, None, :, None].double()
    count = weight.cumsum(2)
    want = (v * weight).cumsum(2) / count.clamp_min(1)
    torch.testing.assert_close(mean_v, want)
    assert torch.equal(present[:, 0], count[:, 0, :, 0] > 0)
    grad = torch.randn_like(want)
    torch.testing.assert_close(torch.autograd.grad(mean_v, v, grad)[0], torch.autograd.grad(want, v, grad)[0])


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sink", [0, 1])
def test_triton_path_equals_reference_with_padding(causal, sink):
    q, k, v = (x.requires_grad_() for x in _qkv(40, heads=2, kv_heads=1, seed=18))
    padding = torch.rand(2, 40, generator=torch.Generator().manual_seed(19)) > 0.25
    padding[1, :3] = False  # leading padded keys: causal rows 0..2 of batch 1 see nothing (but a sink)
    results = []
    for impl in ("reference", "triton"):
        gamma = torch.tensor([0.6, 1.7], requires_grad=True)
        params = {"gamma": gamma} | ({"sink_key": torch.tensor([[0.3, -0.2, 0.1], [-0.4, 0.2, 0.5]])} if sink else {})
        out = _run(
            q,
            k,
            v,
            "zeta:k=5,window=6,chunks=3,local=3" + (",sink=1" if sink else ""),
            causal=causal,
            impl=impl,
            key_padding_mask=padding,
            params=params,
        )
        results.append((out, *torch.autograd.grad(out.pow(2).sum(), (q, k, v, gamma))))
    for name, ref, tri in zip(("out", "dq", "dk", "dv", "dgamma"), *results):
        torch.testing.assert_close(tri, ref, atol=1e-4, rtol=1e-3, msg=name)
    if causal:
        assert (results[1][0][1, :, :3] == 0).all()


@pytest.mark.parametrize("rows,part", [(1, 4), (7, 4), (64, 8), (100, 64)])
def test_row_cumsum_equals_cumsum(rows, part):
    x = torch.randn(2, 3, rows, 5, generator=torch.Generator().manual_seed(rows), dtype=torch.float64)
    torch.testing.assert_close(row_cumsum(x, part), x.cumsum(2))


def test_row_cumsum_prefix_is_bitwise_blind_to_later_rows():
    x = torch.randn(1, 2, 300, 4)
    changed = x.clone()
    changed[:, :, 200:] = 1e6 * torch.randn(1, 2, 100, 4)
    assert torch.equal(row_cumsum(x, 64)[:, :, :200], row_cumsum(changed, 64)[:, :, :200])


@pytest.mark.parametrize("curves", [1, 3])
@pytest.mark.parametrize("dims,bits", [(3, 12), (2, 20), (5, 6)])
def test_fused_morton_codes_equal_torch(curves, dims, bits):
    # both on one device: the kernel repeats torch's fp32 steps after the sigmoid, whose last bit
    # may differ between the CPU and CUDA (and move a point across a cell boundary)
    x = 4 * torch.randn(3, 2, 77, dims)
    x[0, 0, :4] = torch.tensor([float("inf"), -float("inf"), 0.0, 40.0])[:, None]  # saturated cells
    x = x.to(TRITON_DEVICE)
    for curve in range(curves):
        want = curve_codes(x, bits, curve, curves)
        assert torch.equal(curve_codes(x, bits, curve, curves, fused=True), want)
        width = x.shape[-1] * (bits + (curves > 1))
        tagged = curve_codes(x, bits, curve, curves, fused=True, tag_rows=(x.shape[-2], 5))  # rows 5, 6, ... above the codes
        rows = 5 + torch.arange(x[..., 0].numel(), device=x.device).view(x.shape[:-1]) // x.shape[-2]
        assert torch.equal(tagged >> width, rows) and torch.equal(tagged & ((1 << width) - 1), want)


@pytest.mark.parametrize("curves", [1, 2])
def test_fused_selection_breaks_distance_ties_by_position(curves):
    spec = sf.parse_pattern(f"zeta:k=4,window=8,curves={curves}")
    q = torch.randn(1, 1, 5, 3)
    k = torch.randn(1, 1, 1, 3).expand(1, 1, 40, 3).contiguous()  # every distance ties
    fused = _fused(spec, q, k, False, None)
    candidates = torch.zeros(1, 1, 5, 40, dtype=torch.bool)
    bits = code_bits(spec.bits, 3, curves)
    for code_q, code_k in zip(_codes(spec, q, bits), _codes(spec, k, bits)):
        candidates |= _dense_window(code_q, code_k, torch.ones(1, 1, 5, 40, dtype=torch.bool), spec.window)
    first = [torch.nonzero(row).flatten()[:4].tolist() for row in candidates[0, 0]]
    assert [sorted(row.tolist()) for row in fused[0, 0]] == first


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("pattern", ["zeta:k=8,window=16,chunks=3,local=6", "zeta:k=8,window=6,curves=2,chunks=3,local=4"])
def test_equal_distances_go_to_smaller_positions_in_every_path(monkeypatch, pattern, causal):
    from sparsefocus.kernels import zeta_select

    # coordinates on a 4-step grid: many equal distances, so some rows never hit an exact count;
    # 55 positions: causal chunks of 19, so every searched prefix has more real keys than the window (16)
    gen = torch.Generator().manual_seed(17)
    q, k = (torch.randint(0, 4, (1, 1, 55, 3), generator=gen).float() / 4 for _ in range(2))
    padding = torch.rand(1, 55, generator=gen) > 0.1
    spec = sf.parse_pattern(pattern)
    got = {}
    for stop, guesses in ((False, 0), (True, 0), (True, 8)):  # halving from [0, top]; from the row's range; interpolating first
        monkeypatch.setitem(zeta_select.SELECT_OVERRIDES, "exact_stop", stop)
        monkeypatch.setitem(zeta_select.SELECT_OVERRIDES, "guesses", guesses)
        got[stop, guesses] = mask_from_indices(_fused(spec, q, k, causal, padding), 55)
    assert torch.equal(got[True, 0], got[False, 0]) and torch.equal(got[True, 8], got[False, 0])
    assert torch.equal(got[True, 8], mask_from_indices(select_keys(spec, q, k, causal, padding), 55))
    assert torch.equal(got[True, 8], dense_selection(spec, q, k, causal, padding))


@pytest.mark.parametrize("n,step,prefixes,curves", [(70, 10, 6, 1), (1100, 300, 3, 2), (5, 5, 1, 1)])
def test_fused_prefix_filter_equals_torch(monkeypatch, n, step, prefixes, curves):
    from sparsefocus.kernels import zeta_select

    codes = torch.randint(0, 50, (curves, 2, 3, n)).to(TRITON_DEVICE)  # many equal codes: order must stay stable
    real = (torch.rand(2, n) > 0.2).to(TRITON_DEVICE)
    monkeypatch.setattr(zeta_select, "FUSED_PREFIXES", False)
    want = zeta_select.sorted_prefixes(codes, real, step, prefixes, 1 << 62)
    monkeypatch.setattr(zeta_select, "FUSED_PREFIXES", True)
    got = zeta_select.sorted_prefixes(codes, real, step, prefixes, 1 << 62)
    for name, x, y in zip(("codes", "positions", "count"), got, want):
        assert torch.equal(x, y), name
    every = zeta_select.sorted_prefixes(codes, torch.ones_like(real), step, prefixes, 1 << 62)
    for name, x, y in zip(
        ("codes", "positions", "count"), zeta_select.sorted_prefixes(codes, None, step, prefixes, 1 << 62), every
    ):
        assert torch.equal(x, y), f"{name} without a mask"
    rows = torch.arange(curves * 2 * 3, device=TRITON_DEVICE).view(curves, 2, 3, 1)
    for fused in (True, False):  # rows tagged above bit 6 (codes < 50): one flat sort, the same runs
        monkeypatch.setattr(zeta_select, "FUSED_PREFIXES", fused)
        tagged = zeta_select.sorted_prefixes(codes | (rows << 6), None, step, prefixes, 1 << 62, tag_shift=6)
        for name, x, y in zip(("codes", "positions", "count"), tagged, every):
            assert torch.equal(x, y), f"{name} from tagged codes, fused filter {fused}"
    with pytest.raises(ValueError, match="tagged"):
        zeta_select.sorted_prefixes(codes, real, step, prefixes, 1 << 62, tag_shift=6)


@pytest.mark.parametrize("n,step,prefixes,curves", [(70, 10, 6, 1), (100, 40, 2, 2), (5, 5, 1, 1), (1, 1, 1, 1)])
def test_prefixes_sorted_in_the_kernel_equal_torch_sort(monkeypatch, n, step, prefixes, curves):
    """Short rows sort (code, position) packed in one int64 inside the filter's launch: the same
    codes, positions and counts as torch's stable sort and the filter kernel, with and without a
    padding mask and from tagged codes; codes too wide for the packing take torch's sort."""
    from sparsefocus.kernels import zeta_select

    codes = torch.randint(0, 50, (curves, 2, 3, n)).to(TRITON_DEVICE)  # many equal codes: order must stay stable
    real = (torch.rand(2, n) > 0.2).to(TRITON_DEVICE)
    rows = torch.arange(curves * 2 * 3, device=TRITON_DEVICE).view(curves, 2, 3, 1)
    cases = {"padded": (codes, real, None), "every key": (codes, None, None), "tagged": (codes | (rows << 6), None, 6)}
    for name, (x, mask, tag) in cases.items():
        monkeypatch.setattr(zeta_select, "SORT_MAX_M", 0)
        want = zeta_select.sorted_prefixes(x, mask, step, prefixes, 1 << 62, tag_shift=tag, code_width=6)
        monkeypatch.setattr(zeta_select, "SORT_MAX_M", 4096)
        assert zeta_select._sorts_in_kernel(n, 6)
        got = zeta_select.sorted_prefixes(x, mask, step, prefixes, 1 << 62, tag_shift=tag, code_width=6)
        for what, y, z in zip(("codes", "positions", "count"), got, want):
            assert torch.equal(y, z), f"{what}, {name}"
    assert not zeta_select._sorts_in_kernel(n, 62)  # no room for the positions: torch's sort


def test_sorted_prefixes_op_passes_opcheck():
    from sparsefocus.kernels import zeta_select  # noqa: F401  (registers the op)

    codes = torch.randint(0, 50, (1, 2, 3, 40)).to(TRITON_DEVICE)
    real = (torch.rand(2, 40) > 0.2).to(TRITON_DEVICE)
    for mask in (real, None):
        torch.library.opcheck(torch.ops.sparsefocus.zeta_sorted_prefixes.default, (codes, mask, 15, 2, 1 << 62, 6))


@pytest.mark.parametrize("data", ["gaussian", "grid"])
def test_fused_selection_band_in_its_own_tile_equals_one_padded_tile(monkeypatch, data):
    """The band's own tile (16 window + 8 band columns instead of 32) keeps the same keys in the
    same order, also when many distances tie at the cut (grid data) and with padding."""
    from sparsefocus.kernels import zeta_select

    q, k, _ = _qkv(55, batch=1, seed=21)  # chunks of 19: every searched prefix has more real keys than the window
    if data == "grid":
        q, k = (torch.round(2 * x) / 2 for x in (q, k))  # few distinct points: ties everywhere
    padding = torch.rand(1, 55, generator=torch.Generator().manual_seed(22)) > 0.15
    spec = sf.parse_pattern("zeta:k=10,window=16,chunks=3,local=8")
    split = _fused(spec, q, k, True, padding)
    monkeypatch.setitem(zeta_select.SELECT_OVERRIDES, "split", False)
    padded = _fused(spec, q, k, True, padding)
    assert torch.equal(split, padded)
    assert torch.equal(mask_from_indices(split, 55), mask_from_indices(select_keys(spec, q, k, True, padding), 55))


def test_zeta_selection_ops_pass_opcheck():
    """Schema, fake implementations and dispatch of the two selection ops (causal, padded)."""
    from sparsefocus.attention.zeta import SENTINEL, _codes, code_bits

    q, k, _ = (x.to(TRITON_DEVICE) for x in _qkv(11, batch=1, seed=5))
    padding = (torch.rand(1, 11, generator=torch.Generator().manual_seed(6)) > 0.2).to(TRITON_DEVICE)
    spec = sf.parse_pattern("zeta:k=4,window=6,chunks=3,local=3")
    bits = code_bits(spec.bits, q.shape[-1], spec.curves)
    codes_k = _codes(spec, k, bits).masked_fill(~padding[None, :, None, :], SENTINEL)
    sorted_codes, order = torch.sort(codes_k, dim=-1, stable=True)
    chunk = spec.chunk_size(11)
    filter_args = (sorted_codes, order, chunk, 2, SENTINEL, 0, False)
    torch.library.opcheck(torch.ops.sparsefocus.zeta_prefix_filter.default, filter_args)
    scodes, spos, count = torch.ops.sparsefocus.zeta_prefix_filter(*filter_args)
    select_args = (q, k, _codes(spec, q, bits), scodes, spos, count, padding, 4, 6, 3, chunk)
    torch.library.opcheck(torch.ops.sparsefocus.zeta_select.default, select_args)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("pattern", ["zeta:k=8,window=16,chunks=3,local=6", "zeta:k=6,window=6,curves=2,chunks=3,local=4"])
def test_fused_selection_reads_16bit_keys_packed_or_not_alike(monkeypatch, pattern, causal):
    """fp16 keys (bf16 has no CPU interpreter) of widths 3 and 4 read as packed words keep the
    same keys in the same order as the keys read component by component, and the reference's."""
    from sparsefocus.kernels import zeta_select

    spec = sf.parse_pattern(pattern)
    padding = torch.rand(1, 55, generator=torch.Generator().manual_seed(24)) > 0.15
    for dims in (3, 4):
        q, k, _ = _qkv(55, batch=1, dim=dims, seed=23 + dims, dtype=torch.float16)
        packed = _fused(spec, q, k, causal, padding)
        monkeypatch.setattr(zeta_select, "PACKED_KEYS", False)
        plain = _fused(spec, q, k, causal, padding)
        monkeypatch.setattr(zeta_select, "PACKED_KEYS", True)
        assert torch.equal(packed, plain), dims
        want = select_keys(spec, q.float(), k.float(), causal, padding)
        assert torch.equal(mask_from_indices(packed, 55), mask_from_indices(want, 55)), dims

"""The Triton indexed-attention kernel against ``indexed_attention_ref``: outputs and every
gradient (dq, dk, dv, d gamma), odd sizes, GQA, Dv != D, unused slots and empty rows.
On CPU the kernel runs in Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1)."""

import pytest
import torch

import sparsefocus.attention.common as common
from sparsefocus.attention.common import indexed_attention_ref
from sparsefocus.kernels.indexed import indexed_attention, indexed_attention_causal_mean

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    return ((x.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-12)).item()


def make_case(n, m, score, dtype, slots=5, q_heads=4, kv_heads=2, dim=6, dim_v=3):
    q = torch.randn(2, q_heads, n, dim, device=DEVICE)
    k = torch.randn(2, kv_heads, m, dim, device=DEVICE)
    v = torch.randn(2, kv_heads, m, dim_v, device=DEVICE)
    index = torch.randint(-1, m, (2, q_heads, n, slots), device=DEVICE)
    index[0, 0, 0] = -1  # one row with no key at all
    gamma = torch.rand(q_heads, device=DEVICE) + 0.5 if score == "cauchy" else None
    return q, k, v, index, gamma


def run(fn, q, k, v, index, gamma, score, dtype, grad_out):
    leaves = [x.to(dtype).requires_grad_() for x in (q, k, v)]
    g = None if gamma is None else gamma.clone().requires_grad_()
    scale = 0.3 if score != "dot" else None
    out = fn(*leaves, index, scale=scale, score=score, gamma=g)
    grads = torch.autograd.grad(out.float(), leaves + ([g] if g is not None else []), grad_out)
    return [out] + list(grads)


def assert_fp16_within_twice_torch_error(q, k, v, index, gamma, score, grad_out, names):
    """FlashAttention's rule on fp16 inputs: the kernel's error against fp32 is at most twice
    PyTorch's own fp16 error (the reference computed in fp16), for each of ``names``."""
    truth = run(indexed_attention_ref, q, k, v, index, gamma, score, torch.float32, grad_out)
    torch_low = run(indexed_attention_ref, q, k, v, index, gamma, score, torch.float16, grad_out)
    kernel = run(indexed_attention, q, k, v, index, gamma, score, torch.float16, grad_out)
    for name, x, y, t in zip(names, kernel, torch_low, truth):
        assert rel_err(x, t) <= 2 * rel_err(y, t) + 1e-4, f"{name}: {rel_err(x, t):.2e} vs torch {rel_err(y, t):.2e}"


@pytest.mark.parametrize("score", ["dot", "neg_sqeuclid", "cauchy"])
@pytest.mark.parametrize("n,m", [(1, 4), (7, 7), (63, 40), (100, 9)])
def test_indexed_kernel_matches_reference_fp32(score, n, m):
    q, k, v, index, gamma = make_case(n, m, score, torch.float32)
    grad_out = torch.randn(2, 4, n, 3, device=DEVICE)
    got = run(indexed_attention, q, k, v, index, gamma, score, torch.float32, grad_out)
    want = run(indexed_attention_ref, q, k, v, index, gamma, score, torch.float32, grad_out)
    names = ["out", "dq", "dk", "dv", "dgamma"]
    for name, x, y in zip(names, got, want):
        assert torch.isfinite(x).all(), f"{name} has NaN/inf (unwritten output?)"
        assert rel_err(x, y) < 1e-5, f"{score} {name}: relative error {rel_err(x, y):.2e}"
    assert (got[0][0, 0, 0] == 0).all(), "a row with no valid key must be zero"


@pytest.mark.parametrize("score", ["dot", "neg_sqeuclid", "cauchy"])
def test_indexed_kernel_fp16_within_twice_torch_error(monkeypatch, score):
    """FlashAttention's rule: on the same fp16-rounded inputs, the kernel's error against fp32 is at
    most twice PyTorch's own error computing in fp16 (the reference without its fp32 upcast)."""
    # 31 queries (two row tiles, the second short), 19 slots (two forward slot tiles, the second short)
    q, k, v, index, gamma = make_case(31, 50, score, torch.float16, slots=19, dim=16, dim_v=8)
    q, k, v = (x.half().float() for x in (q, k, v))
    grad_out = torch.randn(2, 4, 31, 8, device=DEVICE)
    truth = run(indexed_attention_ref, q, k, v, index, gamma, score, torch.float32, grad_out)
    with monkeypatch.context() as patch:
        patch.setattr(common, "upcast", lambda x: x)
        torch_low = run(indexed_attention_ref, q, k, v, index, gamma, score, torch.float16, grad_out)
    kernel = run(indexed_attention, q, k, v, index, gamma, score, torch.float16, grad_out)
    for name, x, y, t in zip(["out", "dq", "dk", "dv", "dgamma"], kernel, torch_low, truth):
        assert rel_err(x, t) <= 2 * rel_err(y, t) + 1e-5, f"{score} {name}: {rel_err(x, t):.2e} vs torch {rel_err(y, t):.2e}"


def test_indexed_kernel_scalar_gamma_gets_gradient_and_repeats_count_twice():
    q, k, v, _, _ = make_case(7, 5, "cauchy", torch.float32)
    index = torch.tensor([0, 0, 3, -1], device=DEVICE).expand(2, 4, 7, 4)  # key 0 listed twice
    results = []
    for fn in (indexed_attention, indexed_attention_ref):
        gamma = torch.tensor(0.7, device=DEVICE, requires_grad=True)
        out = fn(q, k, v, index, score="cauchy", gamma=gamma)
        results.append((out, torch.autograd.grad(out.sum(), gamma)[0]))
    assert rel_err(results[0][0], results[1][0]) < 1e-5
    assert rel_err(results[0][1], results[1][1]) < 1e-5


def test_indexed_kernel_rejects_bad_index():
    q, k, v, index, _ = make_case(7, 5, "dot", torch.float32)
    with pytest.raises(ValueError, match="index"):
        indexed_attention(q, k, v, index.float())
    with pytest.raises(ValueError, match="score"):
        indexed_attention(q, k, v, index, score="cosine")


def _extras(kind: str, n: int, heads: int, dim: int, dim_v: int):
    """Extra key/value per query: per query head, per kv head (GQA) or one expanded row (a view)."""
    if kind == "expanded":
        return (
            torch.randn(2, heads, 1, dim, device=DEVICE).expand(-1, -1, n, -1),
            torch.randn(2, heads, 1, dim_v, device=DEVICE).expand(-1, -1, n, -1),
        )
    return torch.randn(2, heads, n, dim, device=DEVICE), torch.randn(2, heads, n, dim_v, device=DEVICE)


@pytest.mark.parametrize("score", ["dot", "neg_sqeuclid", "cauchy"])
@pytest.mark.parametrize("kind,heads", [("per_query_head", 4), ("per_kv_head", 2), ("expanded", 2)])
def test_indexed_kernel_extra_slot_matches_reference(score, kind, heads):
    n, m = 19, 11
    q, k, v, index, gamma = make_case(n, m, score, torch.float32)
    index[1, 2, 3] = -1  # a row kept alive by its extra slot alone
    extra_k, extra_v = _extras(kind, n, heads, 6, 3)
    extra_mask = torch.rand(2, 1, n, device=DEVICE) > 0.3
    extra_mask[0, 0, 0] = False  # row (0, 0, 0) has no listed key and no extra slot: zero
    grad_out = torch.randn(2, 4, n, 3, device=DEVICE)
    results = []
    for fn in (indexed_attention, indexed_attention_ref):
        leaves = [x.clone().requires_grad_() for x in (q, k, v, extra_k, extra_v)]
        g = None if gamma is None else gamma.clone().requires_grad_()
        out = fn(
            *leaves[:3], index, scale=0.4, score=score, gamma=g, extra_key=leaves[3], extra_value=leaves[4], extra_mask=extra_mask
        )
        grads = torch.autograd.grad(out.float(), leaves + ([g] if g is not None else []), grad_out)
        results.append([out, *grads])
    for name, x, y in zip(["out", "dq", "dk", "dv", "d_extra_k", "d_extra_v", "dgamma"], *results):
        assert torch.isfinite(x).all(), f"{name} has NaN/inf (unwritten output?)"
        assert rel_err(x, y) < 1e-5, f"{score} {kind} {name}: relative error {rel_err(x, y):.2e}"
    assert (results[0][0][0, 0, 0] == 0).all()
    assert results[0][5].abs().sum() > 0, "the extra value gets a gradient"


def test_indexed_kernel_extra_slot_without_listed_keys_and_bad_shapes():
    q, k, v, _, _ = make_case(5, 4, "cauchy", torch.float32)
    empty = torch.empty(2, 4, 5, 0, dtype=torch.long, device=DEVICE)
    extra_k, extra_v = _extras("per_query_head", 5, 4, 6, 3)
    out = indexed_attention(q, k, v, empty, score="cauchy", extra_key=extra_k, extra_value=extra_v)
    torch.testing.assert_close(out, extra_v)  # the extra slot alone: its value, whatever the weight
    with pytest.raises(ValueError, match="together"):
        indexed_attention(q, k, v, empty, extra_key=extra_k)
    with pytest.raises(ValueError, match="extra_value"):
        indexed_attention(q, k, v, empty, extra_key=extra_k, extra_value=extra_v[..., :2])


@pytest.mark.parametrize("dim_v", [12, 64])
def test_indexed_kernel_dv_scatter_widths(dim_v):
    """dv widths other than the tile's (12 in a 16-wide tile) and the full 64, with keys listed
    many times by many queries (contended atomic adds)."""
    q, k, v, _, gamma = make_case(37, 6, "cauchy", torch.float32, slots=9, dim_v=dim_v)
    index = torch.randint(-1, 6, (2, 4, 37, 9), device=DEVICE)
    grad_out = torch.randn(2, 4, 37, dim_v, device=DEVICE)
    got = run(indexed_attention, q, k, v, index, gamma, "cauchy", torch.float32, grad_out)
    want = run(indexed_attention_ref, q, k, v, index, gamma, "cauchy", torch.float32, grad_out)
    for name, x, y in zip(["out", "dq", "dk", "dv", "dgamma"], got, want):
        assert rel_err(x, y) < 1e-5, f"dim_v {dim_v} {name}: relative error {rel_err(x, y):.2e}"


@pytest.mark.parametrize("mode", ["inverse", "short"])
@pytest.mark.parametrize("score", ["cauchy", "dot", "neg_sqeuclid"])
@pytest.mark.parametrize(
    "n,m,slots,heads", [(1, 4, 3, (4, 2)), (37, 23, 9, (4, 2)), (50, 7, 20, (4, 4)), (70, 81, 20, (4, 4)), (21, 64, 5, (3, 1))]
)
def test_key_grads_without_atomics_match_reference(monkeypatch, mode, score, n, m, slots, heads):
    """KEY_GRADS="inverse" (per-key sums over an inverse index) and "short" (one-hot tiles over
    every query row): dk and dv as the reference for every score kind, with repeated keys, unused
    slots, an empty row, a key every query of a head lists (a sink), GQA, several row and key
    tiles, and keys that no query lists (their gradients are 0)."""
    from sparsefocus.kernels import indexed, indexed_short

    monkeypatch.setattr(indexed, "KEY_GRADS", mode)
    monkeypatch.setattr(indexed_short, "TILES", {"BLOCK_M": 16, "BLOCK_N": 32, "num_warps": 4})  # several tiles
    q, k, v, _, gamma = make_case(n, m, score, torch.float32, slots=slots, q_heads=heads[0], kv_heads=heads[1], dim_v=5)
    index = torch.randint(-1, max(1, m // 2), (2, heads[0], n, slots), device=DEVICE)  # keys >= m // 2 never listed
    index[0, 0, 0] = -1  # a row with no key
    index[1, -1, :, 0] = 0  # one key listed by every query of a head (a sink)
    grad_out = torch.randn(2, heads[0], n, 5, device=DEVICE)
    got = run(indexed_attention, q, k, v, index, gamma, score, torch.float32, grad_out)
    want = run(indexed_attention_ref, q, k, v, index, gamma, score, torch.float32, grad_out)
    for name, x, y in zip(["out", "dq", "dk", "dv", "dgamma"], got, want):
        assert torch.isfinite(x).all(), f"{name} has NaN/inf (unwritten output?)"
        assert rel_err(x, y) < 1e-5, f"{name}: relative error {rel_err(x, y):.2e}"
    assert (got[2][:, :, max(1, m // 2) :] == 0).all() and (got[3][:, :, max(1, m // 2) :] == 0).all()


def test_short_key_grads_fp16_within_twice_torch_error_and_long_rows_use_atomics(monkeypatch):
    from sparsefocus.kernels import indexed

    monkeypatch.setattr(indexed, "KEY_GRADS", "short")
    q, k, v, index, gamma = make_case(63, 50, "dot", torch.float16, slots=37, dim=16, dim_v=8)
    grad_out = torch.randn(2, 4, 63, 8, device=DEVICE)
    assert_fp16_within_twice_torch_error(q, k, v, index, gamma, "dot", grad_out, ["out", "dq", "dk", "dv"])
    assert indexed.key_grads_mode(indexed.SHORT_KEY_GRADS_MAX_KEYS) == "short"
    assert indexed.key_grads_mode(indexed.SHORT_KEY_GRADS_MAX_KEYS + 1) == "atomic"


def test_a_call_chooses_its_key_gradients(monkeypatch):
    """``key_grads=`` overrides the module setting for that call (here "short" while the module
    says an unknown mode, which would fail); a bad value is refused before anything runs."""
    from sparsefocus.kernels import indexed

    monkeypatch.setattr(indexed, "KEY_GRADS", "csr")
    q, k, v, index, gamma = make_case(29, 17, "neg_sqeuclid", torch.float32, slots=6)
    grad_out = torch.randn(2, 4, 29, 3, device=DEVICE)

    def short(*args, **kw):
        return indexed_attention(*args, **kw, key_grads="short")

    got = run(short, q, k, v, index, gamma, "neg_sqeuclid", torch.float32, grad_out)
    want = run(indexed_attention_ref, q, k, v, index, gamma, "neg_sqeuclid", torch.float32, grad_out)
    for name, x, y in zip(["out", "dq", "dk", "dv"], got, want):
        assert rel_err(x, y) < 1e-5, f"{name}: relative error {rel_err(x, y):.2e}"
    with pytest.raises(ValueError, match="key_grads must be one of"):
        indexed_attention(q, k, v, index, key_grads="fast")


def test_short_key_grads_op_passes_opcheck():
    from sparsefocus.kernels.indexed_short import short_key_grads

    q, k, v, index, _ = make_case(19, 23, "dot", torch.float32, slots=4, dim=16, dim_v=8)
    grad_out = torch.randn(2, 4, 19, 8, device=DEVICE)
    coef, prob = torch.randn(index.shape, device=DEVICE), torch.rand(index.shape, device=DEVICE)
    for score_code in (0, 2):
        args = (q, k, v, grad_out, index.int(), coef, prob, score_code)
        torch.library.opcheck(short_key_grads, args, test_utils=("test_schema", "test_faketensor"))


def test_inverse_index_with_extra_slot_and_fp16_within_twice_torch_error(monkeypatch):
    from sparsefocus.kernels import indexed

    monkeypatch.setattr(indexed, "KEY_GRADS", "inverse")
    q, k, v, index, gamma = make_case(63, 50, "cauchy", torch.float16, slots=37, dim=16, dim_v=8)
    grad_out = torch.randn(2, 4, 63, 8, device=DEVICE)
    assert_fp16_within_twice_torch_error(q, k, v, index, gamma, "cauchy", grad_out, ["out", "dq", "dk", "dv", "dgamma"])
    n, extra_k, extra_v = 19, *_extras("per_kv_head", 19, 2, 6, 3)
    q, k, v, index, gamma = make_case(n, 11, "cauchy", torch.float32)
    results = []
    for fn in (indexed_attention, indexed_attention_ref):
        leaves = [x.clone().requires_grad_() for x in (q, k, v, extra_k, extra_v)]
        out = fn(*leaves[:3], index, score="cauchy", gamma=gamma, extra_key=leaves[3], extra_value=leaves[4])
        results.append([out, *torch.autograd.grad(out.sum(), leaves)])
    for name, x, y in zip(["out", "dq", "dk", "dv", "d_extra_k", "d_extra_v"], *results):
        assert rel_err(x, y) < 1e-5, f"extra slot, {name}: relative error {rel_err(x, y):.2e}"


def test_key_grads_mode_is_checked(monkeypatch):
    from sparsefocus.kernels import indexed

    monkeypatch.setattr(indexed, "KEY_GRADS", "csr")
    q, k, v, index, gamma = make_case(5, 4, "cauchy", torch.float32)
    out = indexed_attention(q.requires_grad_(), k, v, index, score="cauchy", gamma=gamma)
    with pytest.raises(ValueError, match="KEY_GRADS"):
        out.sum().backward()


@pytest.mark.parametrize("key_grads", ["atomic", "inverse", "short"])
def test_sink_key_matches_reference_with_extra_slot_and_gqa(monkeypatch, key_grads):
    """A per-query-head zero-value sink computed in the kernels (k, v, index not extended):
    output and every gradient, the sink's included, as the reference that appends it as a slot."""
    from sparsefocus.kernels import indexed

    monkeypatch.setattr(indexed, "KEY_GRADS", key_grads)
    n, m = 23, 13
    q, k, v, index, gamma = make_case(n, m, "cauchy", torch.float32)
    index[0, 1, 2] = -1  # a row with the sink alone: output 0, still a sink gradient
    extra_k, extra_v = _extras("per_kv_head", n, 2, 6, 3)
    sink = 0.5 * torch.randn(4, 6, device=DEVICE)
    grad_out = torch.randn(2, 4, n, 3, device=DEVICE)
    results = []
    for fn in (indexed_attention, indexed_attention_ref):
        leaves = [x.clone().requires_grad_() for x in (q, k, v, extra_k, extra_v, sink)]
        g = gamma.clone().requires_grad_()
        out = fn(*leaves[:3], index, score="cauchy", gamma=g, extra_key=leaves[3], extra_value=leaves[4], sink_key=leaves[5])
        results.append([out, *torch.autograd.grad(out, leaves + [g], grad_out)])
    names = ["out", "dq", "dk", "dv", "d_extra_k", "d_extra_v", "d_sink", "dgamma"]
    for name, x, y in zip(names, *results):
        assert torch.isfinite(x).all(), f"{name} has NaN/inf (unwritten output?)"
        assert rel_err(x, y) < 1e-5, f"{key_grads} {name}: relative error {rel_err(x, y):.2e}"
    assert results[0][6].abs().min() > 0, "every sink coordinate gets a gradient"


def test_sink_key_in_fp16_within_twice_torch_error_and_bad_sinks_rejected():
    q, k, v, index, gamma = make_case(31, 50, "cauchy", torch.float16, slots=19, dim=16, dim_v=8)
    sink = 0.3 * torch.randn(4, 16, device=DEVICE)
    grad_out = torch.randn(2, 4, 31, 8, device=DEVICE)

    def run_sink(fn, dtype):
        leaves = [x.to(dtype).requires_grad_() for x in (q, k, v)] + [sink.clone().requires_grad_()]
        out = fn(*leaves[:3], index, score="cauchy", gamma=gamma, sink_key=leaves[3])
        return [out, *torch.autograd.grad(out.float(), leaves, grad_out)]

    truth, torch_low, kernel = (
        run_sink(indexed_attention_ref, torch.float32),
        run_sink(indexed_attention_ref, torch.float16),
        run_sink(indexed_attention, torch.float16),
    )
    for name, x, y, t in zip(["out", "dq", "dk", "dv", "d_sink"], kernel, torch_low, truth):
        assert rel_err(x, t) <= 2 * rel_err(y, t) + 1e-4, f"{name}: {rel_err(x, t):.2e} vs torch {rel_err(y, t):.2e}"
    with pytest.raises(ValueError, match="cauchy"):
        indexed_attention(q, k, v, index, score="dot", sink_key=sink)
    with pytest.raises(ValueError, match=r"\[Hq, D\]"):
        indexed_attention(q, k, v, index, score="cauchy", sink_key=sink[:, :3])


def _causal_mean_twin(q, k, v, index, *, score, gamma, key_padding_mask, sink_key):
    """The slow twin of ``indexed_attention_causal_mean``: torch's causal mean + the reference."""
    from sparsefocus.attention.zeta import mean_tokens

    mean_k, mean_v, present = mean_tokens(k, v, True, key_padding_mask)
    return indexed_attention_ref(
        q, k, v, index, score=score, gamma=gamma, extra_key=mean_k, extra_value=mean_v, extra_mask=present, sink_key=sink_key
    )


@pytest.mark.parametrize("key_grads", ["atomic", "inverse", "short"])
@pytest.mark.parametrize("n,heads,sink", [(2, (2, 2), False), (37, (4, 2), True), (130, (3, 1), False)])
def test_causal_mean_extra_slot_fused_matches_twin(monkeypatch, key_grads, n, heads, sink):
    """The causal mean token computed inside (its gradient scan added onto the atomics' fp32 dk,
    dv): outputs and dq, dk, dv, d gamma, d sink as torch's mean + the reference; padded keys,
    leading ones included (rows with no mean), GQA, lengths spanning several scan tiles."""
    from sparsefocus.kernels import indexed

    monkeypatch.setattr(indexed, "KEY_GRADS", key_grads)
    q, k, v, index, gamma = make_case(
        n, n, "cauchy", torch.float32, slots=6, q_heads=heads[0], kv_heads=heads[1], dim=3, dim_v=20
    )
    padding = torch.rand(2, n, device=DEVICE) > 0.2
    padding[1, :2] = False
    sink_key = 0.5 * torch.randn(heads[0], 3, device=DEVICE) if sink else None
    grad_out = torch.randn(2, heads[0], n, 20, device=DEVICE)
    results = []
    for fn in (indexed_attention_causal_mean, _causal_mean_twin):
        leaves = [x.clone().requires_grad_() for x in (q, k, v)] + ([sink_key.clone().requires_grad_()] if sink else [])
        g = gamma.clone().requires_grad_()
        out = fn(*leaves[:3], index, score="cauchy", gamma=g, key_padding_mask=padding, sink_key=leaves[3] if sink else None)
        results.append([out, *torch.autograd.grad(out, leaves + [g], grad_out)])
    for name, x, y in zip(["out", "dq", "dk", "dv", *(["d_sink"] if sink else []), "dgamma"], *results):
        assert torch.isfinite(x).all(), f"{name} has NaN/inf (unwritten output?)"
        assert rel_err(x, y) < 1e-5, f"{key_grads} {name}: relative error {rel_err(x, y):.2e}"


def test_causal_mean_extra_slot_fp16_within_twice_torch_error_and_bad_shapes():
    q, k, v, index, gamma = make_case(63, 63, "cauchy", torch.float16, slots=17, dim=3, dim_v=16)
    grad_out = torch.randn(2, 4, 63, 16, device=DEVICE)

    def run_mean(fn, dtype):
        leaves = [x.to(dtype).requires_grad_() for x in (q, k, v)]
        out = fn(*leaves, index, score="cauchy", gamma=gamma, key_padding_mask=None, sink_key=None)
        return [out, *torch.autograd.grad(out.float(), leaves, grad_out)]

    truth, torch_low = run_mean(_causal_mean_twin, torch.float32), run_mean(_causal_mean_twin, torch.float16)
    kernel = run_mean(indexed_attention_causal_mean, torch.float16)
    for name, x, y, t in zip(["out", "dq", "dk", "dv"], kernel, torch_low, truth):
        assert rel_err(x, t) <= 2 * rel_err(y, t) + 1e-4, f"{name}: {rel_err(x, t):.2e} vs torch {rel_err(y, t):.2e}"
    with pytest.raises(ValueError, match="N = M"):
        indexed_attention_causal_mean(q, k[:, :, :40], v[:, :, :40], index.clamp_max(39))
    with pytest.raises(ValueError, match="key_padding_mask"):
        indexed_attention_causal_mean(q, k, v, index, key_padding_mask=torch.ones(2, 5, dtype=torch.bool, device=DEVICE))


@pytest.mark.parametrize("score", ["dot", "neg_sqeuclid", "cauchy"])
@pytest.mark.parametrize("key_grads", ["atomic", "inverse", "short"])
def test_slot_weights_match_reference_with_extra_slot_and_sink(monkeypatch, score, key_grads):
    """Slot weights (attention dropout) scale each listed slot's normalised weight outside the
    normaliser: outputs and every gradient as the reference, at odd sizes, GQA, unused slots, an
    empty row, two slot tiles, and with the extra slot (and, for Cauchy, the sink) unscaled."""
    import sparsefocus.kernels.indexed as indexed_module

    monkeypatch.setattr(indexed_module, "KEY_GRADS", key_grads)
    q, k, v, index, gamma = make_case(37, 23, score, torch.float32, slots=19)
    weight = torch.nn.functional.dropout(torch.ones(index.shape, device=DEVICE), 0.3)  # 0 or 1/0.7
    extra_k, extra_v = torch.randn(2, 2, 37, 6, device=DEVICE), torch.randn(2, 2, 37, 3, device=DEVICE)
    sink = torch.randn(4, 6, device=DEVICE) if score == "cauchy" else None
    grad_out = torch.randn(2, 4, 37, 3, device=DEVICE)
    results = []
    for fn in (indexed_attention, indexed_attention_ref):
        leaves = [x.clone().requires_grad_() for x in (q, k, v, extra_k, extra_v)]
        extras = {} if sink is None else {"sink_key": sink.clone().requires_grad_()}
        out = fn(
            *leaves[:3], index, score=score, gamma=gamma, extra_key=leaves[3], extra_value=leaves[4], slot_weight=weight, **extras
        )
        results.append([out, *torch.autograd.grad(out, leaves + list(extras.values()), grad_out)])
    for name, x, y in zip(["out", "dq", "dk", "dv", "d extra k", "d extra v", "d sink"], *results):
        assert torch.isfinite(x).all(), f"{name} has NaN/inf"
        assert rel_err(x, y) < 1e-5, f"{score} {name}: relative error {rel_err(x, y):.2e}"
    plain = indexed_attention_ref(q, k, v, index, score=score, gamma=gamma, extra_key=extra_k, extra_value=extra_v)
    assert rel_err(results[0][0], plain) > 1e-3, "the slot weights must change the output"


def test_slot_weights_fp16_within_twice_torch_error_lse_unchanged_and_checked(monkeypatch):
    q, k, v, index, _ = make_case(31, 50, "dot", torch.float16, slots=19, dim=16, dim_v=8)
    q, k, v = (x.half().float() for x in (q, k, v))
    weight = torch.nn.functional.dropout(torch.ones(index.shape, device=DEVICE), 0.2)
    grad_out = torch.randn(2, 4, 31, 8, device=DEVICE)

    def run_weighted(fn, dtype):
        leaves = [x.to(dtype).requires_grad_() for x in (q, k, v)]
        out = fn(*leaves, index, slot_weight=weight)
        return [out, *torch.autograd.grad(out.float(), leaves, grad_out)]

    truth = run_weighted(indexed_attention_ref, torch.float32)
    with monkeypatch.context() as patch:
        patch.setattr(common, "upcast", lambda x: x)
        torch_low = run_weighted(indexed_attention_ref, torch.float16)
    kernel = run_weighted(indexed_attention, torch.float16)
    for name, x, y, t in zip(["out", "dq", "dk", "dv"], kernel, torch_low, truth):
        assert rel_err(x, t) <= 2 * rel_err(y, t) + 1e-5, f"{name}: {rel_err(x, t):.2e} vs torch {rel_err(y, t):.2e}"
    _, lse = indexed_attention(q, k, v, index, slot_weight=weight, return_lse=True)
    _, plain_lse = indexed_attention(q, k, v, index, return_lse=True)
    assert torch.equal(lse, plain_lse)
    with pytest.raises(ValueError, match="slot_weight must be"):
        indexed_attention(q, k, v, index, slot_weight=weight[..., :3])


def test_slot_weights_op_passes_opcheck():
    q, k, v, index, _ = make_case(9, 7, "dot", torch.float32, slots=3)
    weight = torch.nn.functional.dropout(torch.ones(index.shape, device=DEVICE), 0.5)
    args = (q, k, v, index.to(torch.int32), torch.ones(4, device=DEVICE), None, None, None, None, 0.4, 0, weight)
    torch.library.opcheck(torch.ops.sparsefocus.indexed_fwd.default, args)


def test_causal_mean_backward_reuses_the_forward_scales_and_fills_no_zero_gradients():
    """The backward outside the ops launches nothing of its own: the row scales come saved from
    the forward (no cumsum again) and the outputs without a gradient get no zero tensors."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Calls(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(func.__name__)
            return func(*args, **(kwargs or {}))

    q, k, v, index, gamma = make_case(21, 21, "cauchy", torch.float32, slots=4, dim=3, dim_v=5)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out = indexed_attention_causal_mean(*leaves, index, gamma=gamma)
    with Calls() as calls:
        grads = torch.autograd.grad(out, leaves, torch.randn_like(out))
    assert all(torch.isfinite(g).all() for g in grads)
    recomputed = [name for name in calls.names if name.split(".")[0] in ("zeros", "zeros_like", "cumsum", "fill_", "zero_")]
    assert not recomputed, f"the backward recomputed or zero-filled: {recomputed}"

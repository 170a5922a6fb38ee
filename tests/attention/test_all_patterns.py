"""Properties every registered pattern must have, run over each pattern's ``examples``:
lean == reference (outputs and gradients) at odd sizes, causality never leaks, padded keys are
never read, empty rows give zeros, low precision works."""

import pytest
import torch

import sparsefocus as sf
from sparsefocus.attention import PATTERNS
from sparsefocus.attention.common import mask_from_indices

EXAMPLES = [example for cls in PATTERNS.values() for example in cls.examples]
SIZES = [1, 7, 63, 100]


def _inputs(n, batch=2, heads=4, kv_heads=2, dim=8, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, n, dim, generator=gen, dtype=dtype)
    k = torch.randn(batch, kv_heads, n, dim, generator=gen, dtype=dtype)
    v = torch.randn(batch, kv_heads, n, dim + 3, generator=gen, dtype=dtype)
    return q, k, v


def _fits(pattern, n):
    try:
        sf.parse_pattern(pattern).check_sizes(n, n, causal=False)
        return True
    except ValueError:
        return False


def fitting(n):
    """The examples whose check_sizes accepts length ``n`` (grid patterns need N = H x W, top-k needs
    k <= N); the refusal itself is tested in test_image.py and test_api.py. Only these are generated."""
    return [pattern for pattern in EXAMPLES if _fits(pattern, n)]


def own_size(pattern):
    """The smallest length a pattern accepts, for the grid patterns that fit none of SIZES."""
    return next(n for n in range(1, 257) if _fits(pattern, n))


LEAN_CASES = [(pattern, n) for n in SIZES for pattern in fitting(n)]
LEAN_CASES += [(pattern, own_size(pattern)) for pattern in EXAMPLES if not any(_fits(pattern, n) for n in SIZES)]


def _grads(pattern, impl, q, k, v, causal):
    q, k, v = (x.detach().clone().requires_grad_() for x in (q, k, v))
    out = sf.sparse_attention(q, k, v, pattern, causal=causal, impl=impl)
    out.backward(torch.cos(torch.arange(out.numel(), dtype=out.dtype)).reshape(out.shape))
    return out.detach(), q.grad, k.grad, v.grad


def test_every_pattern_has_examples():
    assert all(cls.examples for cls in PATTERNS.values()), [n for n, c in PATTERNS.items() if not c.examples]


def test_every_example_is_checked_at_some_size():
    covered = {pattern for pattern, _ in LEAN_CASES}
    assert covered == set(EXAMPLES), sorted(set(EXAMPLES) - covered)


@pytest.mark.parametrize("pattern,n", LEAN_CASES)
@pytest.mark.parametrize("causal", [False, True])
def test_lean_matches_reference_outputs_and_gradients(pattern, n, causal):
    q, k, v = _inputs(n)
    ref = _grads(pattern, "reference", q, k, v, causal)
    lean = _grads(pattern, "lean", q, k, v, causal)
    for name, a, b in zip(("out", "dq", "dk", "dv"), ref, lean):
        assert torch.isfinite(b).all(), name
        torch.testing.assert_close(b, a, atol=2e-5, rtol=1e-4, msg=f"{pattern} {name}")


@pytest.mark.parametrize("pattern", fitting(40))
@pytest.mark.parametrize("impl", ["reference", "lean"])
def test_causal_output_ignores_future_keys_and_values(pattern, impl):
    n, cut = 40, 23
    q, k, v = _inputs(n, seed=1)
    before = sf.sparse_attention(q, k, v, pattern, causal=True, impl=impl)
    k2, v2 = k.clone(), v.clone()
    k2[:, :, cut:] = torch.randn_like(k2[:, :, cut:]) * 10
    v2[:, :, cut:] = torch.randn_like(v2[:, :, cut:]) * 10
    after = sf.sparse_attention(q, k2, v2, pattern, causal=True, impl=impl)
    torch.testing.assert_close(after[:, :, :cut], before[:, :, :cut], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("pattern", fitting(30))
def test_padded_keys_are_never_read(pattern):
    n = 30
    q, k, v = _inputs(n, seed=2)
    padding = torch.ones(2, n, dtype=torch.bool)
    padding[1, 20:] = False
    before = sf.sparse_attention(q, k, v, pattern, key_padding_mask=padding, impl="lean")
    v2 = v.clone()
    v2[1, :, 20:] = 1e4
    after = sf.sparse_attention(q, k, v2, pattern, key_padding_mask=padding, impl="lean")
    torch.testing.assert_close(after, before)
    mask = sf.selection_mask(pattern, q, k, key_padding_mask=padding)
    assert not mask[1, :, :, 20:].any()


@pytest.mark.parametrize("pattern", fitting(12))
@pytest.mark.parametrize("impl", ["reference", "lean"])
def test_rows_without_keys_are_zero_and_finite(pattern, impl):
    n = 12
    q, k, v = (x.requires_grad_() for x in _inputs(n, seed=3))
    padding = torch.zeros(2, n, dtype=torch.bool)
    padding[0] = True
    out = sf.sparse_attention(q, k, v, pattern, key_padding_mask=padding, impl=impl)
    out.sum().backward()
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    assert all(torch.isfinite(x.grad).all() for x in (q, k, v))


@pytest.mark.parametrize("pattern", fitting(33))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_inputs_give_close_outputs_in_their_dtype(pattern, dtype):
    n = 33
    q, k, v = _inputs(n, seed=4)
    # Scale q so that low-precision rounding cannot flip an input-dependent selection tie.
    expected = sf.sparse_attention(q.to(dtype).float(), k.to(dtype).float(), v.to(dtype).float(), pattern)
    out = sf.sparse_attention(q.to(dtype), k.to(dtype), v.to(dtype), pattern)
    assert out.dtype == dtype
    close = torch.isclose(out.float(), expected, atol=2e-2, rtol=2e-2)
    assert close.float().mean() > 0.98


def test_fixed_patterns_selection_mask_matches_flex_mask_mod():
    for cls in PATTERNS.values():
        if "flex" not in cls.impls:
            continue
        for example in cls.examples:
            if not _fits(example, 29):
                continue
            q, k, _ = _inputs(29, seed=5)
            for causal in (False, True):
                spec = sf.parse_pattern(example)
                from_rule = sf.selection_mask(spec, q, k, causal=causal)
                from_lists = spec.indices(q, k, causal, None, None)
                from_lists_mask = mask_from_indices(from_lists, k.shape[-2])
                g = spec.num_global_tokens
                assert torch.equal(from_lists_mask[:, :, g:], from_rule[:, :, g:]), (example, causal)


@pytest.mark.parametrize("pattern", EXAMPLES)
def test_an_empty_batch_gives_an_empty_output_on_every_path(pattern):
    """B = 0 (a data-parallel shard or an evaluation remainder with no sequences): every
    implementation returns [0, H, N, Dv] and a backward through it, as SDPA does."""
    n = next(size for size in SIZES if _fits(pattern, size)) if any(_fits(pattern, size) for size in SIZES) else own_size(pattern)
    q, k, v = (x[:0] for x in _inputs(n))
    spec = sf.parse_pattern(pattern)
    for impl in spec.impls:
        for causal in (False, True):
            try:
                spec.check_sizes(n, n, causal=causal)
            except ValueError:
                continue  # a pattern that refuses this form (tested in test_api.py)
            q_, k_, v_ = (x.detach().clone().requires_grad_() for x in (q, k, v))
            out = sf.sparse_attention(q_, k_, v_, spec, causal=causal, impl=impl)
            assert out.shape == (0, q.shape[1], n, v.shape[-1]), (impl, causal, out.shape)
            out.sum().backward()
            assert q_.grad.shape == q.shape and k_.grad.shape == k.shape, (impl, causal)


@pytest.mark.parametrize("causal", [False, True])
def test_full_with_padded_keys_matches_reference_outputs_and_gradients(causal):
    """FULL's lean path takes SDPA with a boolean mask: odd sizes, left and right padding (causal
    left padding leaves the first rows without a key) and one sequence with no real key at all."""
    n = 37
    q, k, v = _inputs(n, batch=4, seed=5)
    padding = torch.ones(4, n, dtype=torch.bool)
    padding[1, 29:] = False
    padding[2, :5] = False
    padding[3] = False
    outs = []
    for impl in ("reference", "lean"):
        leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
        out = sf.sparse_attention(*leaves, "FULL", causal=causal, key_padding_mask=padding, impl=impl)
        out.backward(torch.cos(torch.arange(out.numel(), dtype=out.dtype)).reshape(out.shape))
        outs.append((out.detach(), *(x.grad for x in leaves)))
    for name, a, b in zip(("out", "dq", "dk", "dv"), *outs):
        assert torch.isfinite(b).all(), name
        torch.testing.assert_close(b, a, atol=2e-5, rtol=1e-4, msg=name)
    assert torch.equal(outs[1][0][3], torch.zeros_like(outs[1][0][3]))

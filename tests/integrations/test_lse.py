"""``return_lse=True``: the log-sum-exp of each row's kept scores, checked by merging partial
results over disjoint key sets into the full result."""

import pytest
import torch

import sparsefocus as sf
from sparsefocus.attention.lse import merge_partials


def _inputs(n=13, m=22, heads=4, kv_heads=2, dim=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(2, heads, n, dim, generator=gen)
    k = torch.randn(2, kv_heads, m, dim, generator=gen)
    v = torch.randn(2, kv_heads, m, dim + 3, generator=gen)
    return q, k, v


@pytest.mark.parametrize("impl", ["reference", "lean"])
def test_two_halves_merge_into_full_attention(impl):
    q, k, v = _inputs()
    half = k.shape[2] // 2
    out_a, lse_a = sf.sparse_attention(q, k[:, :, :half], v[:, :, :half], "FULL", impl=impl, return_lse=True)
    out_b, lse_b = sf.sparse_attention(q, k[:, :, half:], v[:, :, half:], "FULL", impl=impl, return_lse=True)
    out, lse = sf.sparse_attention(q, k, v, "FULL", impl=impl, return_lse=True)
    merged, merged_lse = merge_partials(out_a, lse_a, out_b, lse_b)
    torch.testing.assert_close(merged, out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(merged_lse, lse, atol=1e-5, rtol=1e-5)
    assert lse.shape == (2, 4, 13) and lse.dtype == torch.float32


def test_lse_is_the_logsumexp_of_the_kept_scaled_scores():
    q, k, v = _inputs(n=22)
    scale = 0.3
    _, lse = sf.sparse_attention(q, k, v, "TOPK:4", causal=True, scale=scale, impl="lean", return_lse=True)
    kept = sf.selection_mask("TOPK:4", q, k, causal=True)
    scores = q @ k.repeat_interleave(2, dim=1).transpose(-1, -2) * scale
    torch.testing.assert_close(lse, scores.masked_fill(~kept, float("-inf")).logsumexp(-1), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("pattern", ["BAND:5(1)", "TOPK:5", "BLOC:4", "strided:3", "lsh:buckets=4,chunk=4,rounds=2"])
@pytest.mark.parametrize("causal", [False, True])
def test_lean_lse_equals_reference_lse_with_gradients(pattern, causal):
    q, k, v = _inputs(n=22)
    padding = torch.ones(2, 22, dtype=torch.bool)
    padding[0, -5:] = False

    def run(impl):
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        out, lse = sf.sparse_attention(*leaves, pattern, causal=causal, key_padding_mask=padding, impl=impl, return_lse=True)
        (out.sum() + torch.where(torch.isfinite(lse), lse, 0.0).sum()).backward()
        return [out, lse, *(x.grad for x in leaves)]

    for name, got, want in zip(("out", "lse", "dq", "dk", "dv"), run("lean"), run("reference")):
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4, msg=f"{pattern} {name}")


def test_masked_split_merges_for_a_sparse_pattern():
    """BAND over keys cut in two by a padding mask: the two partial results merge into the whole."""
    q, k, v = _inputs(n=22)
    first = torch.zeros(2, 22, dtype=torch.bool)
    first[:, :9] = True
    parts = [sf.sparse_attention(q, k, v, "BAND:7", key_padding_mask=m, impl="lean", return_lse=True) for m in (first, ~first)]
    whole, lse = sf.sparse_attention(q, k, v, "BAND:7", impl="lean", return_lse=True)
    merged, merged_lse = merge_partials(*parts[0], *parts[1])
    torch.testing.assert_close(merged, whole, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(merged_lse, lse, atol=1e-5, rtol=1e-5)


def test_rows_with_no_key_have_minus_infinite_lse_and_zero_output():
    q, k, v = _inputs(n=4, m=6)
    padding = torch.ones(2, 6, dtype=torch.bool)
    padding[1] = False
    out, lse = sf.sparse_attention(q, k, v, "FULL", key_padding_mask=padding, impl="lean", return_lse=True)
    assert torch.isneginf(lse[1]).all() and torch.isfinite(lse[0]).all()
    assert (out[1] == 0).all()


def test_decoding_lse_equals_the_last_rows_of_the_square_call():
    q, k, v = _inputs(n=22)
    _, square = sf.sparse_attention(q, k, v, "TOPK:5", causal=True, impl="reference", return_lse=True)
    _, last = sf.sparse_attention(q[:, :, -3:], k, v, "TOPK:5", causal=True, impl="lean", return_lse=True)
    torch.testing.assert_close(last, square[:, :, -3:], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("pattern", ["sparsemax", "entmax:alpha=1.5", "zeta:k=4", "gate"])
def test_non_softmax_normalisers_are_refused(pattern):
    q, k, v = _inputs(n=22)
    with pytest.raises(ValueError, match="return_lse needs a softmax mechanism"):
        sf.sparse_attention(q, k, v, pattern, impl="lean", return_lse=True)


def test_triton_lse_uses_the_kernel():
    q, k, v = _inputs(n=22)
    device = "cuda" if torch.cuda.is_available() else "cpu"  # the interpreter on the CPU (conftest)
    on = [x.to(device) for x in (q, k, v)]
    out, lse = sf.sparse_attention(*on, "BAND:5(1)", causal=True, impl="triton", return_lse=True)
    want_out, want_lse = sf.sparse_attention(q, k, v, "BAND:5(1)", causal=True, impl="reference", return_lse=True)
    torch.testing.assert_close(out.cpu(), want_out, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(lse.cpu(), want_lse, atol=1e-4, rtol=1e-4)

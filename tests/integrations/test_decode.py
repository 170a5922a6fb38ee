"""Bottom-right causal alignment: the last N queries against all M keys equal the last N rows of
the square causal call, for every registered pattern's examples, on the reference and lean paths,
and on the Triton paths on a GPU machine (where every case runs on CUDA)."""

import pytest
import torch

import sparsefocus as sf
from sparsefocus.attention import PATTERNS

EXAMPLES = [example for cls in PATTERNS.values() for example in cls.examples]
LENGTHS = (23, 36, 64)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
IMPLS = ["reference", "lean", "triton"] if DEVICE == "cuda" else ["reference", "lean"]
GRADIENT_PATTERNS = ["FULL", "BAND:5(1)", "TOPK:5", "BLOC:9(3)", "zeta:k=4,window=6,chunks=3,local=3"]


def _cases(patterns, impls):
    """(pattern, impl) pairs of the paths each pattern has."""
    return [(p, impl) for p in patterns for impl in impls if impl in sf.parse_pattern(p).impls]


def _length(pattern):
    """The first of LENGTHS the pattern accepts as a causal square (grid patterns need H x W)."""
    spec = sf.parse_pattern(pattern)
    grid = getattr(spec, "height", 0) * getattr(spec, "width", 0)
    for m in (grid, *LENGTHS) if grid else LENGTHS:
        try:
            spec.check_sizes(m, m, causal=True)
            return m
        except ValueError:
            continue
    pytest.skip(f"{pattern} accepts none of the lengths {LENGTHS}")


def _inputs(m, heads=4, kv_heads=2, dim=8, seed=0, qk_dim=None):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(2, heads, m, qk_dim or dim, generator=gen)
    k = torch.randn(2, kv_heads, m, qk_dim or dim, generator=gen)
    v = torch.randn(2, kv_heads, m, dim + 3, generator=gen)
    return q.to(DEVICE), k.to(DEVICE), v.to(DEVICE)


def _params(pattern):
    spec = sf.parse_pattern(pattern)
    made = spec.make_parameters(4)
    return {name: p.detach().to(DEVICE) for name, p in made.items()} or None


@pytest.mark.parametrize("pattern, impl", _cases(EXAMPLES, IMPLS))
@pytest.mark.parametrize("n", [1, 5])
def test_last_queries_equal_last_rows_of_the_square_call(pattern, impl, n):
    m = _length(pattern)
    q, k, v = _inputs(m, qk_dim=sf.parse_pattern(pattern).qk_dim(8))
    params = _params(pattern)
    square = sf.sparse_attention(q, k, v, pattern, causal=True, impl="reference", params=params)
    last = sf.sparse_attention(q[:, :, -n:], k, v, pattern, causal=True, impl=impl, params=params)
    assert last.shape == (2, 4, n, 11)
    torch.testing.assert_close(last, square[:, :, -n:], atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("pattern, impl", _cases(GRADIENT_PATTERNS, IMPLS[1:]))
def test_decoding_gradients_match_the_square_call(pattern, impl):
    m, n = 23, 4
    q, k, v = _inputs(m)
    weight = torch.cos(torch.arange(2 * 4 * n * 11, dtype=torch.float32, device=DEVICE)).reshape(2, 4, n, 11)

    def grads(last_only):
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        if last_only:
            out = sf.sparse_attention(leaves[0][:, :, -n:], leaves[1], leaves[2], pattern, causal=True, impl=impl)
        else:
            out = sf.sparse_attention(*leaves, pattern, causal=True, impl="reference")[:, :, -n:]
        (out * weight).sum().backward()
        return [x.grad for x in leaves]

    for name, got, want in zip(("dq", "dk", "dv"), grads(True), grads(False)):
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4, msg=f"{pattern} {name}")


def test_decoding_respects_key_padding():
    q, k, v = _inputs(23)
    padding = torch.ones(2, 23, dtype=torch.bool, device=DEVICE)
    padding[1, :6] = False
    for pattern in ("FULL", "TOPK:5", "BAND:4"):
        square = sf.sparse_attention(q, k, v, pattern, causal=True, key_padding_mask=padding, impl="reference")
        last = sf.sparse_attention(q[:, :, -3:], k, v, pattern, causal=True, key_padding_mask=padding, impl="lean")
        torch.testing.assert_close(last, square[:, :, -3:], atol=2e-5, rtol=1e-4)


def test_bottom_right_mask_of_full_attention():
    q, k, _ = _inputs(6)
    mask = sf.selection_mask("FULL", q[:, :, -2:], k, causal=True)[0, 0]
    assert mask.tolist() == [[True] * 5 + [False], [True] * 6]


def test_more_queries_than_keys_is_refused():
    q, k, v = _inputs(6)
    with pytest.raises(ValueError, match="at most as many queries as keys"):
        sf.sparse_attention(q, k[:, :, :4], v[:, :, :4], "FULL", causal=True)


def test_a_pattern_that_cannot_decode_is_refused_by_name(monkeypatch):
    from sparsefocus.attention.fixed import Band

    monkeypatch.setattr(Band, "decoding", "none")
    q, k, v = _inputs(8)
    with pytest.raises(ValueError, match="pattern BAND:3 does not support causal attention with fewer queries"):
        sf.sparse_attention(q[:, :, -2:], k, v, "BAND:3", causal=True)


@pytest.mark.parametrize("pattern", ["BAND:7", "BLOC:4"])
@pytest.mark.parametrize("n", [1, 6])
def test_run_patterns_decode_from_their_window_of_keys(pattern, n):
    """BAND and BLOC without global tokens read only the keys of the last rows' runs: keys and
    values outside that window set to NaN leave the decoded rows finite and equal to the square's."""
    m = 40
    q, k, v = _inputs(m)
    square = sf.sparse_attention(q, k, v, pattern, causal=True, impl="reference")
    lo, hi = {"BAND:7": (m - n - 6, m), "BLOC:4": ((m - n) // 4 * 4, m)}[pattern]
    outside = torch.ones(m, dtype=torch.bool, device=DEVICE)
    outside[lo:hi] = False
    k, v = k.masked_fill(outside[:, None], float("nan")), v.masked_fill(outside[:, None], float("nan"))
    last = sf.sparse_attention(q[:, :, -n:], k, v, pattern, causal=True, impl="lean")
    torch.testing.assert_close(last, square[:, :, -n:], atol=2e-5, rtol=1e-4)


def test_topk_decoding_attends_only_to_the_listed_values():
    """TOPK's decoded rows read only the values of the keys they select: NaN in every other value
    leaves them finite and equal to the square's rows."""
    q, k, v = _inputs(36)
    square = sf.sparse_attention(q, k, v, "TOPK:5", causal=True, impl="reference")
    index = sf.parse_pattern("TOPK:5").row_indices(q, k, slice(33, 36), True)  # [2, 4, 3, 5]
    listed = torch.zeros(2, 2, 36, dtype=torch.bool, device=DEVICE)
    for head in range(4):  # query head h reads kv head h // 2
        listed[:, head // 2].scatter_(-1, index[:, head].reshape(2, -1), True)
    v = v.masked_fill(~listed[..., None], float("nan"))
    last = sf.sparse_attention(q[:, :, -3:], k, v, "TOPK:5", causal=True, impl="lean")
    torch.testing.assert_close(last, square[:, :, -3:], atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("n, chunked", [(1, False), (5, False), (5, True)])
def test_topk_triton_decoding_computes_only_the_last_rows(n, chunked, monkeypatch):
    """TOPK's Triton decoding (split-key selection, then the indexed kernel; in the interpreter on
    the CPU) equals the square call's last rows, outputs and gradients, with GQA and key padding,
    also when the rows go in chunks that each see the keys up to their last position."""
    from sparsefocus.kernels import topk_decode

    if chunked:
        monkeypatch.setattr(topk_decode, "MAX_CANDIDATES", 1)  # one query row per chunk
    q, k, v = _inputs(45)
    padding = torch.rand(2, 45, device=DEVICE) > 0.2
    weight = torch.randn(2, 4, n, 11, device=DEVICE)
    results = []
    for impl, queries in (("reference", q), ("triton", q[:, :, -n:])):
        leaves = [x.clone().requires_grad_() for x in (queries, k, v)]
        out = sf.sparse_attention(*leaves, "TOPK:5", causal=True, impl=impl, key_padding_mask=padding)
        out = out[:, :, -n:]
        results.append([out, *torch.autograd.grad(out, leaves, weight)])
    (out, dq, dk, dv), (fast, fast_dq, fast_dk, fast_dv) = results
    torch.testing.assert_close(fast, out, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(fast_dq, dq[:, :, -n:], atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(fast_dk, dk, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(fast_dv, dv, atol=2e-5, rtol=1e-4)


def test_auto_decoding_picks_the_rows_only_paths():
    q = torch.randn(1, 2, 1, 8, device="cuda" if torch.cuda.is_available() else "cpu")
    spec = sf.parse_pattern("TOPK:5")
    assert sf.attention.api.resolve_impl(spec, "auto", q, decoding=True) == ("triton" if q.is_cuda else "lean")
    assert sf.attention.api.resolve_impl(spec, "auto", q, decoding=True, lse=True) == "lean"
    assert sf.attention.api.resolve_impl(sf.parse_pattern("TOPK:65"), "auto", q, decoding=True) == "lean"
    assert sf.attention.api.resolve_impl(sf.parse_pattern("BAND:5"), "auto", q, decoding=True) == "lean"


@pytest.mark.parametrize("pattern", ["FULL", "BAND:4", "BLOC:4", "TOPK:3", "BOTK:2"])
def test_gqa_decoding_never_repeats_the_whole_cache(monkeypatch, pattern):
    """FULL (SDPA's enable_gqa), window rows and listed rows read the kv heads as they are:
    repeating a long cache for every step would copy it whole; only a window's keys may be repeated."""
    import sparsefocus.attention.common as common

    real, sizes = common.expand_kv, []

    def watched(x, heads):
        sizes.append(x.shape[2])
        return real(x, heads)

    monkeypatch.setattr(common, "expand_kv", watched)
    monkeypatch.setattr("sparsefocus.attention.api.expand_kv", watched)
    monkeypatch.setattr("sparsefocus.attention.decode.expand_kv", watched)
    q, k, v = torch.randn(2, 4, 1, 8), torch.randn(2, 2, 50, 8), torch.randn(2, 2, 50, 5)
    q_all = torch.cat([torch.randn(2, 4, 49, 8), q], dim=2)
    want = sf.sparse_attention(q_all, k, v, pattern, causal=True, impl="reference")[:, :, -1:]
    sizes.clear()  # the square reference call above repeats every key, as it must
    out = sf.sparse_attention(q, k, v, pattern, causal=True, impl="lean")
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    assert all(size < 50 for size in sizes), sizes

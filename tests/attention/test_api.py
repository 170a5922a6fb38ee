"""The functional API: parser, registry, equivalences, errors."""

import pytest
import torch

import sparsefocus as sf
from sparsefocus.attention.fixed import Band, Bloc
from sparsefocus.attention.topk import TopK


def _qkv(n=17, heads=2, dim=8, batch=2, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(batch, heads, n, dim, generator=gen) for _ in range(3)]


@pytest.mark.parametrize(
    "text, expected",
    [
        ("FULL", sf.parse_pattern("full")),
        ("TOPK:5", TopK(k=5)),
        ("BAND:5(1)", Band(k=5, g=1)),
        ("BLOC:9(3)", Bloc(k=9, g=3)),
        ("topk:k=5", TopK(k=5)),
        ("band:k=5,g=1", Band(k=5, g=1)),
        ("BAND:5", Band(k=5, g=0)),
        (" band : 5 ( 2 ) ", Band(k=5, g=2)),
    ],
)
def test_parser_accepts_paper_and_keyword_notation(text, expected):
    assert sf.parse_pattern(text) == expected


def test_parser_round_trips_through_str_and_label():
    for cls in sf.PATTERNS.values():
        for example in cls.examples:
            spec = sf.parse_pattern(example)
            assert sf.parse_pattern(str(spec)) == spec
            assert sf.parse_pattern(spec.label()) == spec


@pytest.mark.parametrize(
    "text, fragment",
    [
        ("nosuch:k=3", "valid patterns"),
        ("band:q=3", "valid parameters"),
        ("band:k=x", "parameter 'k' must be int"),
        ("topk:k=0", "k must be >= 1"),
        ("band", "required parameters"),
        ("band:5(1)(2)", "must be int"),
        ("band:5,1,2", "too many positional"),
        ("entmax:alpha=3", "alpha"),
    ],
)
def test_parser_errors_name_the_problem(text, fragment):
    with pytest.raises(ValueError, match=fragment.replace("(", r"\(").replace(")", r"\)")):
        sf.parse_pattern(text)


@pytest.mark.parametrize("pattern", ["TOPK:17", "BAND:17", "BLOC:17", "band:k=40", "bloc:k=99"])
@pytest.mark.parametrize("causal", [False, True])
def test_patterns_that_keep_every_key_equal_full(pattern, causal):
    q, k, v = _qkv()
    full = sf.sparse_attention(q, k, v, "FULL", causal=causal, impl="reference")
    for impl in ("reference", "lean"):
        out = sf.sparse_attention(q, k, v, pattern, causal=causal, impl=impl)
        torch.testing.assert_close(out, full, atol=1e-5, rtol=1e-5)


def test_full_matches_sdpa_with_gqa():
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(2, 4, 9, 8, generator=gen)
    k, v = torch.randn(2, 2, 9, 8, generator=gen), torch.randn(2, 2, 9, 5, generator=gen)
    expected = torch.nn.functional.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1))
    torch.testing.assert_close(sf.sparse_attention(q, k, v, "FULL", impl="reference"), expected, atol=1e-5, rtol=1e-5)


def test_band_keeps_exactly_k_keys_at_edges_and_its_window():
    q, k, _ = _qkv(n=12)
    mask = sf.selection_mask("BAND:5", q, k)[0, 0]
    assert (mask.sum(-1) == 5).all()
    assert mask[0, :5].all() and mask[11, 7:].all()
    assert mask[6, 4:9].all()  # floor((5-1)/2) = 2 to the left, 2 to the right
    even = sf.selection_mask("BAND:4", q, k)[0, 0]
    assert even[6, 5:9].all() and even.sum(-1).eq(4).all()  # 1 to the left, 2 to the right
    causal = sf.selection_mask("BAND:5", q, k, causal=True)[0, 0]
    assert causal[8, 4:9].all() and causal.sum(-1).tolist() == [1, 2, 3, 4] + [5] * 8


def test_bloc_and_global_tokens():
    q, k, _ = _qkv(n=10)
    mask = sf.selection_mask("BLOC:4(1)", q, k)[0, 0]
    assert mask[0].all() and mask[:, 0].all()
    assert mask[5, 4:8].all() and not mask[5, 8:].any() and not mask[5, 1:4].any()
    assert mask[9, 8:].all() and mask[9].sum() == 3


def test_topk_keeps_the_k_largest_scores_causally():
    q, k, _ = _qkv(n=15)
    mask = sf.selection_mask("TOPK:4", q, k, causal=True)
    scores = q @ k.transpose(-1, -2)
    for i in range(15):
        allowed = scores[..., i, : i + 1]
        kept = mask[..., i, : i + 1]
        assert kept.sum(-1).eq(min(4, i + 1)).all()
        assert not mask[..., i, i + 1 :].any()
        threshold = allowed.topk(min(4, i + 1), dim=-1).values[..., -1:]
        assert torch.equal(kept, allowed >= threshold)


def test_bottomk_keeps_the_smallest_scores():
    q, k, _ = _qkv(n=11)
    mask = sf.selection_mask("BOTK:3", q, k)
    scores = q @ k.transpose(-1, -2)
    assert torch.equal(mask, scores <= scores.topk(3, dim=-1, largest=False).values[..., -1:])


def test_cosine_threshold_keeps_similar_pairs():
    q, k, _ = _qkv(n=9)
    mask = sf.selection_mask("threshold:tau=0.3", q, k)
    cos = torch.nn.functional.cosine_similarity(q[..., :, None, :], k[..., None, :, :], dim=-1)
    assert torch.equal(mask, cos >= 0.3)


@pytest.mark.parametrize(
    "args, fragment",
    [
        (lambda q, k, v: (q[0], k, v), "rank 4"),
        (lambda q, k, v: (q, k[:1], v), "batch sizes"),
        (lambda q, k, v: (q, k[..., :4], v), "head dims"),
        (lambda q, k, v: (q.long(), k, v), "floating-point"),
        (lambda q, k, v: (q[:, :2], k[:, :3], v[:, :3]), "divisible"),
        (lambda q, k, v: (q, k, v[:, :, :5]), "differ in heads or length"),
    ],
)
def test_bad_tensors_get_clear_errors(args, fragment):
    q, k, v = _qkv(heads=3)
    with pytest.raises(ValueError, match=fragment):
        sf.sparse_attention(*args(q, k, v), "FULL")


def test_bad_masks_sizes_and_impls_get_clear_errors():
    q, k, v = _qkv(n=8)
    with pytest.raises(ValueError, match="key_padding_mask"):
        sf.sparse_attention(q, k, v, "FULL", key_padding_mask=torch.ones(2, 7, dtype=torch.bool))
    with pytest.raises(ValueError, match="key_padding_mask"):
        sf.sparse_attention(q, k, v, "FULL", key_padding_mask=torch.ones(2, 8))
    with pytest.raises(ValueError, match="larger than the number of keys"):
        sf.sparse_attention(q, k, v, "TOPK:9")
    with pytest.raises(ValueError, match="unknown impl"):
        sf.sparse_attention(q, k, v, "FULL", impl="fast")
    with pytest.raises(ValueError, match="no 'flex' implementation"):
        sf.sparse_attention(q, k, v, "TOPK:3", impl="flex")
    with pytest.raises(ValueError, match="as many queries as keys"):
        sf.sparse_attention(q, k[:, :, :5], v[:, :, :5], "BAND:3")
    with pytest.raises(ValueError, match="unknown pattern"):
        sf.sparse_attention(q, k, v, "nonsense")


def test_auto_uses_lean_path_on_cpu():
    q, k, v = _qkv(n=8)
    from sparsefocus.attention.api import resolve_impl

    assert resolve_impl(sf.parse_pattern("TOPK:3"), "auto", q) == "lean"


def test_lean_topk_runs_at_16k_on_cpu_without_dense_scores():
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 1, 16384, 16, generator=gen) for _ in range(3))
    with torch.no_grad():
        out = sf.sparse_attention(q, k, v, "TOPK:8", causal=True, impl="lean")
    assert out.shape == (1, 1, 16384, 16) and torch.isfinite(out).all()


def test_catalogue_lists_every_pattern_and_cli_prints_it(capsys):
    from sparsefocus.attention.catalogue import catalogue_markdown
    from sparsefocus.cli import main

    table = catalogue_markdown()
    assert all(f"| `{name}` |" in table for name in sf.PATTERNS)
    assert main(["list"]) == 0
    assert "topk" in capsys.readouterr().out
    assert main(["nosuch"]) == 2

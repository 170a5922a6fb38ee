"""Rules of the 1-D input-agnostic patterns: hand-written masks, exact key counts, seeded random
keys, BigBird/Longformer composition, the FlexAttention path and the gather path at long N."""

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

import sparsefocus as sf
from sparsefocus.attention.fixed import sample_distinct

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")


def _mask(pattern, n, causal=False):
    q = torch.zeros(1, 1, n, 4)
    return sf.selection_mask(pattern, q, q, causal=causal)[0, 0]


def _rows(*lines):
    return torch.tensor([[char == "1" for char in line] for line in lines])


def _inputs(n, seed=0, heads=2):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(2, heads, n, 8, generator=gen) for _ in range(3)]


def test_strided_matches_hand_written_mask():
    expected = _rows("1111001", "1111100", "1111110", "1111111", "0111111", "0011111", "1001111")
    assert torch.equal(_mask("strided:3", 7), expected)
    assert torch.equal(_mask("strided:stride=3", 7, causal=True), torch.tril(expected))


def test_fixed_matches_hand_written_mask():
    # blocks {0,1,2} {3,4,5} {6}; summary columns (j mod 3 == 2): 2 and 5
    expected = _rows("1110010", "1110010", "1110010", "0011110", "0011110", "0011110", "0010011")
    assert torch.equal(_mask("fixed:block=3,c=1", 7), expected)
    assert torch.equal(_mask("fixed:3,1", 7, causal=True), torch.tril(expected))


def test_fixed_keeps_last_c_of_every_block_as_summary_columns():
    mask = _mask("fixed:block=4,c=2", 16)
    summary = torch.tensor([j % 4 >= 2 for j in range(16)])
    assert mask[:, summary].all()
    assert not mask[0, 4:][~summary[4:]].any()


def test_dilated_keeps_k_keys_on_the_query_residue_class_shifted_at_edges():
    mask = _mask("dilated:k=3,dilation=2", 9)
    assert (mask.sum(-1) == 3).all()
    assert torch.equal(mask[0].nonzero().flatten(), torch.tensor([0, 2, 4]))
    assert torch.equal(mask[4].nonzero().flatten(), torch.tensor([2, 4, 6]))
    assert torch.equal(mask[8].nonzero().flatten(), torch.tensor([4, 6, 8]))
    assert torch.equal(mask[7].nonzero().flatten(), torch.tensor([3, 5, 7]))


def test_dilated_keeps_the_whole_class_when_it_is_shorter_than_k():
    mask = _mask("dilated:k=3,dilation=3", 5)
    assert torch.equal(mask[0].nonzero().flatten(), torch.tensor([0, 3]))
    assert torch.equal(mask[2].nonzero().flatten(), torch.tensor([2]))


def test_dilated_causal_keeps_the_k_most_recent_at_stride_d():
    mask = _mask("dilated:4,3", 20, causal=True)
    assert torch.equal(mask[19].nonzero().flatten(), torch.tensor([10, 13, 16, 19]))
    assert torch.equal(mask[4].nonzero().flatten(), torch.tensor([1, 4]))


def test_dilation_one_is_band():
    for causal in (False, True):
        assert torch.equal(_mask("dilated:5,1", 23, causal), _mask("BAND:5", 23, causal))


def test_random_keeps_exactly_k_allowed_keys_per_row():
    mask = _mask("random:k=5", 30)
    assert (mask.sum(-1) == 5).all()
    causal = _mask("random:k=5", 30, causal=True)
    assert torch.equal(causal.sum(-1), torch.clamp(torch.arange(1, 31), max=5))
    assert not torch.triu(causal, diagonal=1).any()


def test_random_is_deterministic_by_seed_and_differs_across_seeds():
    spec = sf.parse_pattern("random:k=4,seed=7")
    first = spec.draw_random_keys(40, 40, False)
    assert torch.equal(first, spec.draw_random_keys(40, 40, False))
    assert torch.equal(_mask("random:k=4,seed=7", 40), _mask("random:4,7", 40))
    assert not torch.equal(_mask("random:k=4,seed=7", 40), _mask("random:k=4,seed=8", 40))


def test_random_selection_ignores_query_and_key_values():
    q, k, _ = _inputs(25)
    a = sf.selection_mask("random:k=3", q, k)
    b = sf.selection_mask("random:k=3", -5 * q, k.flip(-2))
    assert torch.equal(a, b)


def test_sample_distinct_is_distinct_and_uniform():
    counts = torch.tensor([10] * 20000 + [2])
    ranks = sample_distinct(counts, 3, torch.Generator().manual_seed(0))
    assert torch.equal(ranks[-1].sort().values, torch.tensor([-1, 0, 1]))
    body = ranks[:-1]
    assert ((body >= 0) & (body < 10)).all()
    assert (body.sort(-1).values.diff(dim=-1) > 0).all()
    frequency = torch.bincount(body.flatten(), minlength=10).float() / body.shape[0]
    torch.testing.assert_close(frequency, torch.full((10,), 0.3), atol=0.015, rtol=0)


def test_bigbird_contains_window_and_global_plus_r_random_keys():
    n, window, g, r = 40, 5, 2, 3
    mask = _mask(f"bigbird:window={window},g={g},r={r}", n)
    local = _mask(f"BAND:{window}({g})", n)
    assert torch.equal(mask & local, local)
    assert torch.equal(mask[g:].sum(-1), local[g:].sum(-1) + r)
    assert (mask[window + g :].sum(-1) == window + g + r).all()  # windows clear of the globals
    assert mask[:g].all() and mask[:, :g].all()


def test_bigbird_causal_random_keys_are_past_and_rows_keep_all_when_short():
    n, window, g, r = 30, 3, 1, 4
    mask = _mask(f"bigbird:{window},{g},{r}", n, causal=True)
    assert not torch.triu(mask, diagonal=1).any()
    assert torch.equal(mask.sum(-1), torch.clamp(torch.arange(1, n + 1), max=window + g + r))
    assert mask[:, 0].all()


def test_bigbird_random_keys_change_with_seed_not_window():
    a, b = _mask("bigbird:3,1,2,seed=0", 40), _mask("bigbird:3,1,2,seed=1", 40)
    assert not torch.equal(a, b)
    assert torch.equal(a & _mask("BAND:3(1)", 40), b & _mask("BAND:3(1)", 40))


def test_longformer_is_band_with_global_tokens():
    for causal in (False, True):
        assert torch.equal(_mask("longformer:window=6,g=2", 31, causal), _mask("BAND:6(2)", 31, causal))


@pytest.mark.parametrize("pattern", ["strided:3", "fixed:4,1", "dilated:3,2", "random:k=4", "longformer:4,1", "bigbird:3,1,2"])
def test_flex_matches_reference(pattern):
    q, k, v = _inputs(24, seed=1)
    padding = torch.ones(2, 24, dtype=torch.bool)
    padding[1, 18:] = False
    for causal in (False, True):
        kwargs = dict(causal=causal, key_padding_mask=padding)
        ref = sf.sparse_attention(q, k, v, pattern, impl="reference", **kwargs)
        flex = sf.sparse_attention(q, k, v, pattern, impl="flex", **kwargs)
        torch.testing.assert_close(flex, ref, atol=1e-5, rtol=1e-5)


def test_lean_random_at_16k_never_builds_an_n_by_n_tensor():
    n = 16384
    q, k, v = (torch.randn(1, 1, n, 16, generator=torch.Generator().manual_seed(i)) for i in range(3))
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = sf.sparse_attention(q, k, v, "random:k=8,seed=1", impl="lean")
    assert out.shape == (1, 1, n, 16) and torch.isfinite(out).all()
    largest = max(event.cpu_memory_usage for event in prof.events())
    assert largest < n * n // 16, f"an op allocated {largest} bytes"


@pytest.mark.parametrize(
    "spec, parameter",
    [
        ("strided:-1", "stride"),
        ("fixed:block=0", "block"),
        ("fixed:4,c=5", "c"),
        ("fixed:4,c=0", "c"),
        ("dilated:k=0", "k"),
        ("dilated:3,dilation=0", "dilation"),
        ("random:k=0", "k"),
        ("longformer:window=0", "window"),
        ("longformer:4,g=-1", "g"),
        ("bigbird:window=0", "window"),
        ("bigbird:3,g=-1", "g"),
        ("bigbird:3,r=-2", "r"),
    ],
)
def test_bad_parameters_raise_naming_the_parameter(spec, parameter):
    with pytest.raises(ValueError, match=rf"\b{parameter} must be"):
        sf.parse_pattern(spec)


def test_positional_and_keyword_forms_agree():
    pairs = [
        ("strided:5", "strided:stride=5"),
        ("fixed:8,2", "fixed:l=8,c=2"),
        ("dilated:5,3", "dilated:k=5,d=3"),
        ("random:4,2", "random:k=4,seed=2"),
        ("longformer:6,1", "longformer:w=6,g=1"),
        ("bigbird:3,2,1,seed=4", "bigbird:window=3,g=2,r=1,seed=4"),
    ]
    for positional, keyword in pairs:
        assert sf.parse_pattern(positional) == sf.parse_pattern(keyword)


# The Semantic Focus layout: L=7 real tokens padded to 10 (a multiple of k=5), then g=1 global token
# appended (position 10). Windows and blocks run over positions 0..9 only; row and column 10 are all kept.
PAPER_BLOC_5_1 = _rows(
    "11111000001",
    "11111000001",
    "11111000001",
    "11111000001",
    "11111000001",
    "00000111111",
    "00000111111",
    "00000111111",
    "00000111111",
    "00000111111",
    "11111111111",
)
PAPER_BAND_5_1 = _rows(
    "11111000001",  # window shifted right at the start: still k=5 regular keys
    "11111000001",
    "11111000001",
    "01111100001",
    "00111110001",
    "00011111001",
    "00001111101",
    "00000111111",
    "00000111111",  # shifted left at the end of the REGULAR tokens, not of the row
    "00000111111",
    "11111111111",
)


def test_bloc_with_globals_appended_matches_the_papers_hand_written_mask():
    assert torch.equal(_mask("bloc:k=5,g=1,globals_at=end", 11), PAPER_BLOC_5_1)
    assert torch.equal(_mask("BLOC:5(1),globals_at=end", 11), PAPER_BLOC_5_1)


def test_band_with_globals_appended_matches_the_papers_hand_written_mask():
    assert torch.equal(_mask("band:k=5,g=1,globals_at=end", 11), PAPER_BAND_5_1)


def test_prepended_globals_give_different_key_sets_than_the_papers_layout():
    # globals first: the block of positions 0..4 holds the global token, so every regular block is
    # shifted by one; the first real queries of BAND lose a regular key to the global column
    prepended = _mask("BLOC:5(1)", 11)
    assert torch.equal(prepended[1], torch.tensor([c == "1" for c in "11111000000"]))
    assert int(_mask("BAND:5(1)", 11)[1].sum()) == 5  # global + 4 regular keys, not 5 + global


def test_with_globals_at_the_end_band_keeps_k_regular_keys_and_bloc_its_block():
    n, g = 23, 3  # 20 regular positions: four blocks of 5
    band, bloc = _mask("band:k=5,g=3,globals_at=end", n), _mask("bloc:k=5,g=3,globals_at=end", n)
    for mask in (band, bloc):
        assert mask[n - g :].all() and mask[:, n - g :].all()
    assert (band[: n - g, : n - g].sum(-1) == 5).all()
    blocks = torch.arange(n - g) // 5
    assert torch.equal(bloc[: n - g, : n - g], blocks[:, None] == blocks[None, :])


@pytest.mark.parametrize(
    "spec",
    ["band:k=5,g=2,globals_at=end", "bloc:k=4,g=3,globals_at=end", "global:g=2,globals_at=end", "longformer:3,1,globals_at=end"],
)
@pytest.mark.parametrize("n", [7, 26])
def test_globals_at_end_lean_matches_reference_outputs_and_gradients(spec, n):
    outputs = {}
    for impl in ("reference", "lean"):
        q, k, v = (x.clone().requires_grad_() for x in _inputs(n, seed=3))
        out = sf.sparse_attention(q, k, v, spec, impl=impl)
        out.backward(torch.cos(torch.arange(out.numel(), dtype=out.dtype)).reshape(out.shape))
        outputs[impl] = (out.detach(), q.grad, k.grad, v.grad)
    for name, a, b in zip(("out", "dq", "dk", "dv"), outputs["reference"], outputs["lean"]):
        torch.testing.assert_close(b, a, atol=2e-5, rtol=1e-4, msg=f"{spec} {name}")


def test_globals_at_end_flex_matches_reference():
    q, k, v = _inputs(13, seed=4)
    spec = "band:k=5,g=2,globals_at=end"
    torch.testing.assert_close(
        sf.sparse_attention(q, k, v, spec, impl="flex"),
        sf.sparse_attention(q, k, v, spec, impl="reference"),
        atol=1e-5,
        rtol=1e-5,
    )


def test_globals_at_end_refuses_causal_and_unknown_places():
    with pytest.raises(ValueError, match="globals_at=end cannot be causal"):
        sf.parse_pattern("band:k=5,g=1,globals_at=end").check_sizes(11, 11, causal=True)
    with pytest.raises(ValueError, match="globals_at must be one of start, end"):
        sf.parse_pattern("bloc:k=5,g=1,globals_at=middle")


def test_bare_strided_uses_a_stride_of_ceil_sqrt_n():
    for n, stride in ((7, 3), (16, 4), (17, 5)):
        for causal in (False, True):
            assert torch.equal(_mask("strided", n, causal), _mask(f"strided:stride={stride}", n, causal))


def test_bare_bigbird_is_window_3_two_globals_three_random_keys():
    assert sf.parse_pattern("bigbird") == sf.parse_pattern("bigbird:window=3,g=2,r=3,seed=0")
    mask = _mask("bigbird", 30)
    assert mask[:2].all() and mask[:, :2].all()
    assert (mask[3:].sum(-1) == 3 + 2 + 3).all()  # from row 3 on the window is clear of the globals


@pytest.mark.parametrize("spec", ["band:k=5,g=1,globals_at=end", "bloc:k=5,g=3,globals_at=end"])
def test_globals_at_end_triton_matches_reference(spec):
    device = "cuda" if torch.cuda.is_available() else "cpu"  # the interpreter on CPU (conftest)
    q, k, v = (x.to(device).requires_grad_() for x in _inputs(19, seed=5))
    grad_out = torch.randn(2, 2, 19, 8, device=device)
    outs = []
    for impl in ("triton", "reference"):
        out = sf.sparse_attention(q, k, v, spec, impl=impl)
        outs.append([out] + list(torch.autograd.grad(out, (q, k, v), grad_out)))
    for name, got, want in zip(["out", "dq", "dk", "dv"], *outs):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4, msg=f"{spec} {name}")

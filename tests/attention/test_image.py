"""Rules of the 2-D grid patterns: window2d keeps s*s keys everywhere, axial keeps row and
column, causal is raster order, N must equal H*W, flex and the gather path agree with the rule."""

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

import sparsefocus as sf
from sparsefocus.attention.common import mask_from_indices

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")


def _mask(pattern, n, causal=False):
    q = torch.zeros(1, 1, n, 4)
    return sf.selection_mask(pattern, q, q, causal=causal)[0, 0]


def _cells(mask_row, width):
    return {(int(j) // width, int(j) % width) for j in mask_row.nonzero().flatten()}


def test_window2d_keeps_exactly_s_squared_keys_at_corners_edges_and_centre():
    height, width, size = 6, 7, 3
    mask = _mask(f"window2d:{height},{width},{size}", height * width)
    assert (mask.sum(-1) == size * size).all()
    assert _cells(mask[0], width) == {(r, c) for r in range(3) for c in range(3)}
    assert _cells(mask[height * width - 1], width) == {(r, c) for r in range(3, 6) for c in range(4, 7)}
    centre = 2 * width + 3
    assert _cells(mask[centre], width) == {(r, c) for r in range(1, 4) for c in range(2, 5)}


def test_window2d_even_size_puts_the_extra_row_and_column_after_the_query():
    mask = _mask("window2d:height=5,width=5,size=2", 25)
    assert _cells(mask[2 * 5 + 2], 5) == {(2, 2), (2, 3), (3, 2), (3, 3)}


def test_window2d_causal_is_the_window_cut_to_raster_order():
    full, causal = _mask("window2d:5,6,3", 30), _mask("window2d:5,6,3", 30, causal=True)
    assert torch.equal(causal, torch.tril(full))


def test_axial_keeps_its_row_and_its_column():
    height, width = 4, 6
    mask = _mask(f"axial:{height},{width}", height * width)
    assert (mask.sum(-1) == height + width - 1).all()
    for i in range(height * width):
        row, col = divmod(i, width)
        expected = {(row, c) for c in range(width)} | {(r, col) for r in range(height)}
        assert _cells(mask[i], width) == expected


def test_axial_causal_keeps_earlier_row_and_column_keys():
    height, width = 4, 5
    mask = _mask(f"axial:{height},{width}", height * width, causal=True)
    row, col = 2, 3
    expected = {(row, c) for c in range(col + 1)} | {(r, col) for r in range(row + 1)}
    assert _cells(mask[row * width + col], width) == expected


@pytest.mark.parametrize("pattern", ["window2d:5,7,3", "window2d:4,6,4", "axial:5,7", "axial:1,9"])
def test_key_lists_match_the_rule(pattern):
    spec = sf.parse_pattern(pattern)
    n = spec.height * spec.width
    q = torch.zeros(1, 2, n, 4)
    for causal in (False, True):
        lists = mask_from_indices(spec.indices(q, q, causal, None, None), n)
        assert torch.equal(lists, sf.selection_mask(spec, q, q, causal=causal)), causal


@pytest.mark.parametrize("pattern", ["window2d:4,6,3", "axial:4,6"])
def test_flex_matches_reference(pattern):
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, 24, 8, generator=gen) for _ in range(3))
    padding = torch.ones(2, 24, dtype=torch.bool)
    padding[0, 20:] = False
    for causal in (False, True):
        kwargs = dict(causal=causal, key_padding_mask=padding)
        ref = sf.sparse_attention(q, k, v, pattern, impl="reference", **kwargs)
        flex = sf.sparse_attention(q, k, v, pattern, impl="flex", **kwargs)
        torch.testing.assert_close(flex, ref, atol=1e-5, rtol=1e-5)


def test_lean_window2d_on_a_128x128_grid_never_builds_an_n_by_n_tensor():
    n = 128 * 128
    q, k, v = (torch.randn(1, 1, n, 16, generator=torch.Generator().manual_seed(i)) for i in range(3))
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = sf.sparse_attention(q, k, v, "window2d:128,128,3", impl="lean", causal=True)
    assert out.shape == (1, 1, n, 16) and torch.isfinite(out).all()
    largest = max(event.cpu_memory_usage for event in prof.events())
    assert largest < n * n // 16, f"an op allocated {largest} bytes"


@pytest.mark.parametrize("pattern", ["window2d:4,5,3", "axial:4,5"])
def test_sequence_length_must_equal_height_times_width(pattern):
    q = torch.zeros(1, 1, 21, 4)
    with pytest.raises(ValueError, match=r"height \* width = 4 \* 5 = 20, got N=21"):
        sf.sparse_attention(q, q, q, pattern)


@pytest.mark.parametrize(
    "spec, parameter",
    [
        ("window2d:0,4,1", "height"),
        ("window2d:4,0,1", "width"),
        ("window2d:4,4,0", "size"),
        ("window2d:4,6,5", "size"),
        ("axial:height=0,width=3", "height"),
        ("axial:3,-1", "width"),
    ],
)
def test_bad_parameters_raise_naming_the_parameter(spec, parameter):
    with pytest.raises(ValueError, match=rf"\b{parameter} must be"):
        sf.parse_pattern(spec)


def test_positional_and_keyword_forms_agree():
    assert sf.parse_pattern("window2d:4,6,3") == sf.parse_pattern("window2d:h=4,w=6,s=3")
    assert sf.parse_pattern("axial:4,6") == sf.parse_pattern("axial:height=4,width=6")

"""SparseAttention with a KV cache: a prefix, then one token at a time, gives the rows of the
whole-sequence call, for FULL, BAND, TOPK, BLOC, DSA and NSA."""

import pytest
import torch

from sparsefocus import SparseAttention


@pytest.mark.parametrize("pattern", ["FULL", "BAND:3", "TOPK:3", "BLOC:4(1)"])
@pytest.mark.parametrize("impl", ["reference", "lean"])
def test_stepping_with_the_cache_equals_the_whole_sequence(pattern, impl):
    torch.manual_seed(0)
    layer = SparseAttention(24, 4, pattern, causal=True, kv_heads=2, impl=impl).eval()
    x = torch.randn(2, 11, 24)
    with torch.no_grad():
        whole = layer(x)
        out, cache = layer(x[:, :5], use_cache=True)
        steps = [out]
        for position in range(5, 11):
            out, cache = layer(x[:, position : position + 1], past_kv=cache, use_cache=True)
            steps.append(out)
    torch.testing.assert_close(torch.cat(steps, dim=1), whole, atol=1e-5, rtol=1e-5)
    kept = 2 if pattern == "BAND:3" else 11  # a causal BAND:k row reads only its k latest keys
    assert cache[0].shape == (2, 2, kept, 6) and cache[1].shape == (2, 2, kept, 6)


@pytest.mark.parametrize("pattern, kept", [("BAND:8", 7), ("BAND:8(1)", 40), ("band:k=1", 0)])
def test_a_band_cache_keeps_only_what_later_rows_read(pattern, kept):
    """BAND:k without global tokens caches the last k - 1 positions (several new positions at a
    time as well as one), and stepping still gives the whole sequence's rows; with a global token
    every position stays."""
    torch.manual_seed(0)
    layer = SparseAttention(24, 4, pattern, causal=True, kv_heads=2).eval()
    x = torch.randn(2, 40, 24)
    with torch.no_grad():
        whole = layer(x)
        out, cache = layer(x[:, :3], use_cache=True)
        steps = [out]
        for a, b in [(3, 4), (4, 13), *[(t, t + 1) for t in range(13, 40)]]:
            out, cache = layer(x[:, a:b], past_kv=cache, use_cache=True)
            steps.append(out)
            assert cache[0].shape[2] == min(kept, b)
    torch.testing.assert_close(torch.cat(steps, dim=1), whole, atol=1e-5, rtol=1e-5)


def test_cache_with_padding_equals_the_whole_sequence():
    torch.manual_seed(0)
    layer = SparseAttention(24, 4, "TOPK:3", causal=True).eval()
    x = torch.randn(2, 9, 24)
    padding = torch.ones(2, 9, dtype=torch.bool)
    padding[1, :3] = False
    with torch.no_grad():
        whole = layer(x, key_padding_mask=padding)
        first, cache = layer(x[:, :6], key_padding_mask=padding[:, :6], use_cache=True)
        rest, _ = layer(x[:, 6:], key_padding_mask=padding, past_kv=cache, use_cache=True)
    torch.testing.assert_close(torch.cat([first, rest], dim=1)[1, 3:], whole[1, 3:], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(torch.cat([first, rest], dim=1)[0], whole[0], atol=1e-5, rtol=1e-5)


def test_a_cache_needs_a_causal_layer():
    layer = SparseAttention(24, 4, "FULL")
    x = torch.randn(1, 3, 24)
    _, cache = layer(x, use_cache=True)
    with pytest.raises(ValueError, match="past_kv needs a causal SparseAttention"):
        layer(x, past_kv=cache)


@pytest.mark.parametrize("pattern", ["dsa:k=4,heads=2,dim=4", "nsa:block=4,top=2,cmp=4,stride=4,window=4,local=1"])
@pytest.mark.parametrize("impl", ["reference", "lean"])
def test_mechanisms_that_read_x_cache_it_and_step_to_the_whole_sequence(pattern, impl):
    """DSA's indexer keys and NSA's gates come from the layer input x: the cache keeps the inputs
    of the cached positions, and steps of one and of several positions give the whole rows."""
    torch.manual_seed(0)
    layer = SparseAttention(24, 4, pattern, causal=True, kv_heads=2, impl=impl).eval()
    x = torch.randn(2, 13, 24)
    with torch.no_grad():
        whole = layer(x)
        out, cache = layer(x[:, :5], use_cache=True)
        steps = [out]
        for a, b in [(5, 6), (6, 9), *[(t, t + 1) for t in range(9, 13)]]:
            out, cache = layer(x[:, a:b], past_kv=cache, use_cache=True)
            steps.append(out)
    torch.testing.assert_close(torch.cat(steps, dim=1), whole, atol=1e-5, rtol=1e-5)
    k, v = cache
    assert cache.hidden.shape == (2, 13, 24) and k.shape == (2, 2, 13, 6) and v.shape == (2, 2, 13, 6)


def test_a_plain_cache_for_a_mechanism_that_reads_x_is_refused():
    layer = SparseAttention(24, 4, "dsa:k=4,heads=2,dim=4", causal=True, kv_heads=2).eval()
    x = torch.randn(1, 6, 24)
    with torch.no_grad():
        _, cache = layer(x[:, :5], use_cache=True)
        with pytest.raises(ValueError, match="reads the layer input of every cached position"):
            layer(x[:, 5:], past_kv=(cache[0], cache[1]), use_cache=True)

"""SparseAttention with a KV cache: a prefix, then one token at a time, gives the rows of the
whole-sequence call, for FULL, BAND and TOPK."""

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
    assert cache[0].shape == (2, 2, 11, 6) and cache[1].shape == (2, 2, 11, 6)


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

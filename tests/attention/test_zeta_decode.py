"""ZETA's decoding cache: a step from the cache (sorted key codes merged, never re-sorted;
running sums for the mean token) gives the last row of the causal call over all keys, for one
and several curves, the local band, the sink, GQA and odd sizes; the layer uses it."""

import pytest
import torch

from sparsefocus import SparseAttention
from sparsefocus.attention import parse_pattern, sparse_attention
from sparsefocus.attention.zeta import _codes, code_bits
from sparsefocus.attention.zeta_decode import ZetaCache, decode_step, start_cache

SPECS = [
    "zeta:k=4,window=6,chunks=3,local=3",
    "zeta:k=3,window=4,curves=3,chunks=2,local=0",
    "zeta:k=3,window=4,chunks=3,local=2,sink=1",
    "zeta:k=5,window=8,chunks=8,local=4,bits=4",  # coarse codes: many equal codes, ties by position
]


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("heads, kv_heads", [(2, 2), (4, 2)])
def test_steps_from_the_cache_give_the_last_row_of_each_causal_call(spec, heads, kv_heads):
    pattern = parse_pattern(spec)
    q = torch.randn(2, heads, 41, 3, dtype=torch.float64)
    k = torch.randn(2, kv_heads, 41, 3, dtype=torch.float64)
    v = torch.randn(2, kv_heads, 41, 5, dtype=torch.float64)
    prefill = 6
    cache = start_cache(pattern, k[:, :, :prefill], v[:, :, :prefill])
    for t in range(prefill, 41):
        out, cache = decode_step(pattern, q[:, :, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1], cache)
        whole = sparse_attention(q[:, :, : t + 1], k[:, :, : t + 1], v[:, :, : t + 1], pattern, causal=True, impl="lean")
        torch.testing.assert_close(out, whole[:, :, -1:], rtol=1e-12, atol=1e-12, msg=f"position {t}")
    assert cache.k.shape[2] == 41 and torch.equal(cache.v, v)


def test_the_cache_keeps_the_searchable_keys_sorted_as_a_fresh_sort_would():
    pattern = parse_pattern("zeta:k=3,window=4,curves=2,chunks=4,local=1,bits=3")
    k, v = torch.randn(1, 2, 70, 3), torch.randn(1, 2, 70, 4)
    cache = start_cache(pattern, k[:, :, :1], v[:, :, :1])
    for t in range(1, 70):
        _, cache = decode_step(pattern, torch.randn(1, 2, 1, 3), k[:, :, t : t + 1], v[:, :, t : t + 1], cache)
        fresh = start_cache(pattern, k[:, :, : t + 1], v[:, :, : t + 1])
        assert torch.equal(cache.sorted_codes, fresh.sorted_codes) and torch.equal(cache.order, fresh.order), t
    codes = _codes(pattern, k[:, :, : cache.prefix], code_bits(pattern.bits, 3, pattern.curves))
    assert torch.equal(codes.gather(-1, cache.order), cache.sorted_codes)
    torch.testing.assert_close(cache.key_sum, k.sum(2, keepdim=True))


def test_a_step_through_the_triton_kernel_equals_the_reference_step():
    pattern = parse_pattern("zeta:k=4,window=6,chunks=3,local=3,sink=1")
    q, k, v = torch.randn(1, 4, 1, 3), torch.randn(1, 2, 30, 3), torch.randn(1, 2, 30, 8)
    cache = start_cache(pattern, k[:, :, :-1], v[:, :, :-1])
    steps = [decode_step(pattern, q, k[:, :, -1:], v[:, :, -1:], cache, kernel=kernel)[0] for kernel in ("reference", "triton")]
    torch.testing.assert_close(steps[1], steps[0], rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="kernel must be auto, reference or triton"):
        decode_step(pattern, q, k[:, :, -1:], v[:, :, -1:], cache, kernel="cuda")


def test_a_step_takes_one_position():
    pattern = parse_pattern("zeta:k=3")
    cache = start_cache(pattern, torch.randn(1, 1, 4, 3), torch.randn(1, 1, 4, 2))
    with pytest.raises(ValueError, match="takes one new position"):
        decode_step(pattern, torch.randn(1, 1, 2, 3), torch.randn(1, 1, 2, 3), torch.randn(1, 1, 2, 2), cache)


def test_a_zeta_layer_decodes_from_its_own_cache():
    torch.manual_seed(0)
    layer = SparseAttention(16, 4, "zeta:k=4,window=6,chunks=3,local=3,sink=1", causal=True, kv_heads=2).eval()
    x = torch.randn(2, 23, 16)
    with torch.no_grad():
        out, cache = layer(x[:, :5], use_cache=True)
        assert isinstance(cache, ZetaCache) and cache[0].shape == (2, 2, 5, 3)
        torch.testing.assert_close(out, layer(x[:, :5]))
        for t in range(5, 18):
            step, cache = layer(x[:, t : t + 1], past_kv=cache, use_cache=True)
            torch.testing.assert_close(step, layer(x[:, : t + 1])[:, -1:], rtol=1e-5, atol=1e-6, msg=f"position {t}")
        several, cache = layer(x[:, 18:], past_kv=cache, use_cache=True)  # several positions: the call, a new cache
        torch.testing.assert_close(several, layer(x)[:, 18:], rtol=1e-5, atol=1e-6)
        assert isinstance(cache, ZetaCache) and torch.equal(cache.sorted_codes, start_cache(layer.pattern, *cache).sorted_codes)

"""ZETA's decoding cache: a step from the cache (sorted runs of key codes merged, never re-sorted;
capacity buffers written in place; running sums for the mean token) gives the last row of the
causal call over all keys, for one and several curves, the local band, the sink, GQA and odd
sizes, across buffer growths and run merges; the runs give the window of one fresh sort; earlier
caches keep their positions; the layer uses it."""

import pytest
import torch

from sparsefocus import SparseAttention
from sparsefocus.attention import parse_pattern, sparse_attention
from sparsefocus.attention.zeta import _codes, _window_candidates, code_bits
from sparsefocus.attention.zeta_decode import ZetaCache, _block_runs, _run_windows, _runs_after, decode_step, start_cache

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


@pytest.mark.parametrize("spec", ["zeta:k=4,window=6,chunks=3,local=3,sink=1", "zeta:k=3,window=4,curves=3,chunks=2,local=0"])
def test_steps_through_the_triton_kernels_equal_the_reference_steps(spec):
    """kernel="triton": the Morton kernel codes the query and the keys entering the searchable
    prefix, the indexed kernel attends; step after step (the prefix grows) as the reference."""
    pattern = parse_pattern(spec)
    device = "cuda" if torch.cuda.is_available() else "cpu"  # the CPU runs the kernels in the interpreter
    q, k, v = (torch.randn(*shape, device=device) for shape in ((1, 4, 40, 3), (1, 2, 40, 3), (1, 2, 40, 8)))
    caches = {kernel: start_cache(pattern, k[:, :, :20], v[:, :, :20]) for kernel in ("reference", "triton")}
    for t in range(20, 40):
        outs = {}
        for kernel in caches:
            outs[kernel], caches[kernel] = decode_step(
                pattern, q[:, :, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1], caches[kernel], kernel=kernel
            )
        torch.testing.assert_close(outs["triton"], outs["reference"], rtol=1e-5, atol=1e-6, msg=f"position {t}")
    assert torch.equal(caches["triton"].sorted_codes, caches["reference"].sorted_codes)


def test_a_bad_kernel_name_is_refused():
    pattern = parse_pattern("zeta:k=4,window=6,chunks=3,local=3,sink=1")
    q, k, v = torch.randn(1, 4, 1, 3), torch.randn(1, 2, 30, 3), torch.randn(1, 2, 30, 8)
    cache = start_cache(pattern, k[:, :, :-1], v[:, :, :-1])
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


def _set_bits(n):
    return [1 << bit for bit in reversed(range(n.bit_length())) if n >> bit & 1]


@pytest.mark.parametrize("spec", ["zeta:k=4,window=6,chunks=16,local=3,bits=3", "zeta:k=5,window=5,curves=3,chunks=9,local=2"])
@pytest.mark.parametrize("heads, kv_heads", [(3, 3), (6, 2)])
def test_long_decoding_across_buffer_growths_and_run_merges_gives_every_last_row(spec, heads, kv_heads):
    pattern = parse_pattern(spec)
    n = 157
    q = torch.randn(2, heads, n, 3, dtype=torch.float64)
    k = torch.randn(2, kv_heads, n, 3, dtype=torch.float64)
    v = torch.randn(2, kv_heads, n, 7, dtype=torch.float64)
    cache = start_cache(pattern, k[:, :, :2], v[:, :, :2], capacity=2)
    capacities, top_runs = {cache.capacity}, set()
    for t in range(2, n):
        buffers = cache.buffers
        out, cache = decode_step(pattern, q[:, :, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1], cache)
        if cache.buffers is not buffers:  # fresh buffers: poison the unwritten positions, no step may read them
            cache.buffers.key[:, :, t + 1 :], cache.buffers.value[:, :, t + 1 :] = float("nan"), float("nan")
        whole = sparse_attention(q[:, :, : t + 1], k[:, :, : t + 1], v[:, :, : t + 1], pattern, causal=True, impl="lean")
        torch.testing.assert_close(out, whole[:, :, -1:], rtol=1e-12, atol=1e-12, msg=f"position {t}")
        assert torch.equal(cache.k, k[:, :, : t + 1]) and torch.equal(cache.v, v[:, :, : t + 1]) and len(cache) == 2
        assert [run.size for run in cache.runs] == _set_bits(cache.prefix)
        capacities.add(cache.capacity)
        top_runs.add(cache.runs[0].size if cache.runs else 0)
    assert sorted(capacities) == [2, 16, 32, 64, 128, 256]  # full buffers double (at least MIN_CAPACITY)
    assert {8, 16, 32, 64, 128} <= top_runs  # the prefix's top bit rose several times: every run merged into one


def test_a_cache_reads_as_views_of_its_buffers_and_keeps_its_positions_after_later_steps():
    pattern = parse_pattern("zeta:k=3,window=4,chunks=3,local=2")
    k, v = torch.randn(1, 2, 12, 3), torch.randn(1, 2, 12, 4)
    first = start_cache(pattern, k[:, :, :9], v[:, :, :9])
    assert first.capacity == 16 and first.k.data_ptr() == first.buffers.key.data_ptr()
    _, second = decode_step(pattern, torch.randn(1, 2, 1, 3), k[:, :, 9:10], v[:, :, 9:10], first)
    assert second.buffers is first.buffers  # written in place: no copy of the cache
    assert torch.equal(first.k, k[:, :, :9]) and torch.equal(second.k, k[:, :, :10]) and torch.equal(second.v, v[:, :, :10])
    assert torch.equal(second[0], second.k) and torch.equal(second[1], second.v)
    torch.testing.assert_close(second.key_sum, k[:, :, :10].sum(2, keepdim=True))


def test_a_step_from_an_earlier_cache_copies_while_a_later_one_is_alive_and_reuses_the_buffers_once_it_is_not():
    pattern = parse_pattern("zeta:k=3,window=4,chunks=3,local=2")
    q, k, v = torch.randn(1, 4, 1, 3), torch.randn(1, 2, 11, 3), torch.randn(1, 2, 11, 4)
    other_k, other_v = torch.randn(1, 2, 1, 3), torch.randn(1, 2, 1, 4)
    first = start_cache(pattern, k[:, :, :10], v[:, :, :10])
    _, kept = decode_step(pattern, q, k[:, :, 10:], v[:, :, 10:], first)
    out, branch = decode_step(pattern, q, other_k, other_v, first)  # a branch: ``kept`` reads position 10
    assert branch.buffers is not kept.buffers and torch.equal(kept.k, k) and torch.equal(kept.v, v)
    assert torch.equal(branch.k, torch.cat([k[:, :, :10], other_k], dim=2))
    whole = sparse_attention(q.expand(1, 4, 11, 3), branch.k, branch.v, pattern, causal=True, impl="lean")
    torch.testing.assert_close(out, whole[:, :, -1:])
    buffers = kept.buffers
    del kept
    _, again = decode_step(pattern, q, other_k, other_v, first)
    assert again.buffers is buffers and torch.equal(again.k, branch.k)


def test_a_step_refuses_a_new_key_of_another_shape_than_the_cache():
    pattern = parse_pattern("zeta:k=3")
    cache = start_cache(pattern, torch.randn(1, 2, 4, 3), torch.randn(1, 2, 4, 2))
    with pytest.raises(ValueError, match="k_new must be"):
        decode_step(pattern, torch.randn(1, 2, 1, 3), torch.randn(1, 1, 1, 3), torch.randn(1, 2, 1, 2), cache)
    with pytest.raises(ValueError, match="capacity 3 is below the 4 positions"):
        start_cache(pattern, torch.randn(1, 2, 4, 3), torch.randn(1, 2, 4, 2), capacity=3)


@pytest.mark.parametrize("window", [1, 4, 7, 64])
def test_sorted_runs_give_the_window_candidates_of_one_fresh_sort_with_many_ties(window):
    curves, batch, kv_heads, group = 2, 2, 3, 2
    generator = torch.Generator().manual_seed(window)
    codes = torch.randint(1, 7, (curves, batch, kv_heads, 211), generator=generator)  # few values: long runs of ties
    runs, prefix = _block_runs(codes[..., :0], 0), 0
    while prefix < codes.shape[-1]:
        grown = min(codes.shape[-1], prefix + int(torch.randint(1, 9, (), generator=generator)))
        runs = _runs_after(runs, codes[..., prefix:grown], prefix, grown)
        prefix = grown
        assert [run.size for run in runs] == _set_bits(prefix)
        queries = torch.randint(0, 8, (curves, batch, kv_heads, group), generator=generator)  # below, equal to and above the keys
        got = _run_windows(runs, queries, prefix, window).permute(1, 2, 3, 0, 4).reshape(batch, kv_heads * group, 1, -1)
        sorted_codes, order = torch.sort(codes[..., :prefix], dim=-1, stable=True)
        expand = lambda x: x.repeat_interleave(group, dim=2)  # [S, B, Hq, P]: query head h reads kv head h // group
        searchable = torch.full((batch, 1), prefix)
        want = _window_candidates(expand(sorted_codes), expand(order), searchable, queries.reshape(curves, batch, -1, 1), window)
        assert torch.equal(got, want), prefix

"""ZETA's sorted-order window dv (``sparsefocus/kernels/zeta_window.py``) against the slow twin
``indexed_attention_ref``: outputs and dq, dk, dv, d gamma at odd sizes with GQA, padding and
several chunk/window shapes; the selection kernel's window record against its own key lists."""

import pytest
import torch

import sparsefocus as sf
from sparsefocus.attention import zeta
from sparsefocus.attention.common import indexed_attention_ref
from sparsefocus.attention.zeta import mean_tokens, select_keys_fused
from sparsefocus.kernels.zeta_window import zeta_window_attention

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def make_case(n, q_heads=4, kv_heads=2, dv=5, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(2, q_heads, n, 3, generator=gen).to(DEVICE)
    k = torch.randn(2, kv_heads, n, 3, generator=gen).to(DEVICE)
    v = torch.randn(2, kv_heads, n, dv, generator=gen).to(DEVICE)
    padding = (torch.rand(2, n, generator=gen) > 0.15).to(DEVICE)
    return q, k, v, padding


def run(attend, q, k, v, padding, index, gamma, dtype):
    leaves = [x.to(dtype).requires_grad_() for x in (q, k, v)]
    g = gamma.clone().requires_grad_()
    mean_k, mean_v, present = mean_tokens(leaves[1], leaves[2], True, padding)
    out = attend(*leaves, index, gamma=g, extra_key=mean_k, extra_value=mean_v, extra_mask=present)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    return [out, *torch.autograd.grad(out.float(), leaves + [g], grad)]


@pytest.mark.parametrize(
    "n,pattern", [(150, "zeta:k=6,window=8,chunks=4,local=3"), (97, "zeta:k=4,window=16,chunks=3,local=0"), (64, "zeta:k=8,window=64,chunks=2,local=5")]
)
def test_window_dv_matches_reference(n, pattern):
    q, k, v, padding = make_case(n, seed=n)
    spec = sf.parse_pattern(pattern)
    index, window = select_keys_fused(spec, q, k, True, padding, windows=True)
    gamma = torch.tensor([0.7, 1.1, 1.6, 0.9], device=DEVICE)
    fast = lambda *a, **kw: zeta_window_attention(*a, window=window, **kw)
    slow = lambda *a, **kw: indexed_attention_ref(*a, score="cauchy", **kw)
    got = run(fast, q, k, v, padding, index, gamma, torch.float32)
    want = run(slow, q, k, v, padding, index.long(), gamma, torch.float32)
    for name, x, y in zip(["out", "dq", "dk", "dv", "dgamma"], got, want):
        assert torch.isfinite(x).all(), f"{name} has NaN (unwritten?)"
        torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-4, msg=name)


def test_window_record_matches_the_key_lists():
    q, k, _, padding = make_case(120, seed=5)
    spec = sf.parse_pattern("zeta:k=6,window=8,chunks=4,local=3")
    index, window = select_keys_fused(spec, q, k, True, padding, windows=True)
    chunk = window.chunk
    for b, h, i in [(0, 0, 40), (1, 3, 119), (0, 2, 5), (1, 1, 64)]:
        p = i // chunk - 1
        listed = {j for j in index[b, h, i].tolist() if 0 <= j < (i // chunk) * chunk}
        if p < 0:
            assert window.start[b, h, i] == -1 and window.kept[b, h, i] == 0 and not listed
            continue
        start, kept = int(window.start[b, h, i]), int(window.kept[b, h, i])
        found = {int(window.positions[p, 0, b, h // 2, start + c]) for c in range(spec.window) if kept >> c & 1}
        assert found == listed


def test_switch_routes_the_pattern_through_the_window_pass(monkeypatch):
    q, k, v, padding = make_case(90, seed=9)
    results = []
    for flag in (False, True):
        monkeypatch.setattr(zeta, "WINDOW_DV", flag)
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        out = sf.sparse_attention(*leaves, "zeta:k=5,window=8,chunks=3,local=4", causal=True, impl="triton", key_padding_mask=padding)
        results.append([out, *torch.autograd.grad(out.pow(2).sum(), leaves)])
    for plain, windowed in zip(*results):
        torch.testing.assert_close(windowed, plain, atol=1e-5, rtol=1e-4)


def test_window_pass_rejects_what_it_cannot_do():
    q, k, v, _ = make_case(40)
    spec = sf.parse_pattern("zeta:k=4,window=8,chunks=2,curves=2")
    with pytest.raises(ValueError, match="one curve"):
        select_keys_fused(spec, q, k, True, None, windows=True)
    index, window = select_keys_fused(sf.parse_pattern("zeta:k=4,window=8,chunks=2"), q, k, True, None, windows=True)
    with pytest.raises(ValueError, match="Cauchy"):
        zeta_window_attention(q, k, v, index, window, gamma=1.0, extra_key=k, extra_value=v, score="dot")


def test_window_dv_fp16_within_twice_torch_error():
    """FlashAttention's rule: error vs fp32 at most 2x PyTorch's own fp16 error (+ eps)."""
    q, k, v, padding = make_case(97, seed=11)
    index, window = select_keys_fused(sf.parse_pattern("zeta:k=6,window=16,chunks=3,local=4"), q, k, True, padding, windows=True)
    gamma = torch.tensor([0.7, 1.1, 1.6, 0.9], device=DEVICE)
    fast = lambda *a, **kw: zeta_window_attention(*a, window=window, **kw)
    slow = lambda *a, **kw: indexed_attention_ref(*a, score="cauchy", **kw)
    truth = run(slow, q, k, v, padding, index.long(), gamma, torch.float32)
    torch_low = run(slow, q, k, v, padding, index.long(), gamma, torch.float16)
    kernel = run(fast, q, k, v, padding, index, gamma, torch.float16)
    err = lambda x, t: ((x.double() - t.double()).norm() / t.double().norm()).item()
    for name, x, y, t in zip(["out", "dq", "dk", "dv", "dgamma"], kernel, torch_low, truth):
        assert err(x, t) <= 2 * err(y, t) + 1e-4, f"{name}: {err(x, t):.2e} vs torch {err(y, t):.2e}"

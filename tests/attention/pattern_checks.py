"""Helpers shared by the mechanism tests: seeded inputs and the "keeps every key == FULL" check."""

import torch

import sparsefocus as sf


def random_qk(n, m=None, heads=2, dim=8, seed=0):
    """Seeded q [2, heads, n, dim] and k [2, heads, m or n, dim]."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(2, heads, n, dim, generator=gen)
    k = torch.randn(2, heads, n if m is None else m, dim, generator=gen)
    return q, k


def assert_equals_full(spec, q, k, v, causal):
    """The lean path of ``spec`` equals dense FULL attention, and its mask equals FULL's."""
    torch.testing.assert_close(
        sf.sparse_attention(q, k, v, spec, causal=causal, impl="lean"),
        sf.sparse_attention(q, k, v, "FULL", causal=causal, impl="reference"),
        atol=1e-5,
        rtol=1e-5,
    )
    assert torch.equal(sf.selection_mask(spec, q, k, causal=causal), sf.selection_mask("FULL", q, k, causal=causal))

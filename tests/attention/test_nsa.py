"""NSA: the Triton path (three branches on the block-sparse kernel) against the dense reference in
the output and every gradient (q, k, v, gates, compression MLP), GQA and padding at odd sizes, with
the compressed and window branches saved or recomputed in the backward; no causal leak; the
selection keeps the forced blocks and ranks by group-summed probabilities; the layer owns and
trains the gates."""

import pytest
import torch
from block_sparse_checks import impl_device, perturbed_after, run_with_grads

import sparsefocus as sf
from sparsefocus.attention import nsa
from sparsefocus.attention.nsa import NSA, compress
from sparsefocus.layers import SparseAttention

NAMES = ["out", "aux", "dq", "dk", "dv"]


def nsa_case(spec, group, n, kv_heads=1, dim=10, head_dim=16, batch=1):
    weights = spec.make_layer_parameters(dim, kv_heads * group, kv_heads, head_dim, head_dim)
    for w in weights.values():  # leave the zero initialisation so every weight matters
        w.data.normal_(0, 0.3)
    x = torch.randn(batch, n, dim)
    q = torch.randn(batch, kv_heads * group, n, head_dim)
    k, v = torch.randn(batch, kv_heads, n, head_dim), torch.randn(batch, kv_heads, n, head_dim)
    return x, q, k, v, weights


@pytest.mark.parametrize(
    "pattern,group,padded",
    [
        ("nsa:block=16,top=3,cmp=8,stride=4,window=20,pool=mlp", 2, True),
        ("nsa:block=16,top=2,cmp=16,stride=16,window=0,local=1", 1, False),
        ("nsa:block=4,top=3,cmp=4,stride=2,window=6,tile=16", 1, True),
        ("nsa:block=8,top=4,cmp=8,stride=4,window=10,pool=mlp,tile=32", 2, True),
        ("nsa:block=5,top=3,cmp=5,stride=5,window=5,tile=16", 3, False),
    ],
)
@pytest.mark.parametrize("recompute", [False, True], ids=["saved", "recomputed"])
def test_nsa_kernel_matches_reference_in_output_and_every_gradient(pattern, group, padded, recompute, monkeypatch):
    monkeypatch.setattr(nsa, "RECOMPUTE_MIN_BYTES", 0 if recompute else 2**62)  # branches checkpointed or kept
    spec = sf.parse_pattern(pattern)
    x, q, k, v, weights = nsa_case(spec, group, n=45)
    padding = (torch.rand(1, 45) > 0.2) if padded else None
    ref = run_with_grads(spec, "reference", x, q, k, v, weights, padding)
    tri = run_with_grads(spec, "triton", x, q, k, v, weights, padding)
    for name, a, b in zip(NAMES + list(weights), ref, tri):
        assert torch.isfinite(b).all(), name
        torch.testing.assert_close(b, a, atol=2e-5, rtol=1e-4, msg=f"{pattern} {name}")


@pytest.mark.parametrize("tile", [0, 16])
def test_nsa_never_leaks_the_future_into_outputs_or_gradients(tile):
    spec = sf.parse_pattern(f"nsa:block=8,top=3,cmp=8,stride=4,window=12,pool=mlp,tile={tile}")
    x, q, k, v, weights = nsa_case(spec, group=2, n=40)
    cut = 21
    x2 = perturbed_after(cut, x, dim=1)[0]
    q2, k2, v2 = perturbed_after(cut, q, k, v)
    before = run_with_grads(spec, "triton", x, q, k, v, weights, grad_rows=cut)
    after = run_with_grads(spec, "triton", x2, q2, k2, v2, weights, grad_rows=cut)
    for name, a, b in zip(NAMES, before, after):
        if a.dim() >= 3:
            torch.testing.assert_close(b[:, :, :cut], a[:, :, :cut], atol=1e-6, rtol=1e-6, msg=name)
    for name, a, b in zip(weights, before[len(NAMES) :], after[len(NAMES) :]):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5, msg=name)


def test_selection_keeps_initial_and_local_blocks_and_ranks_by_the_group_sum():
    """Blocks of 4 keys, compression = blocks. Query 23 (block 5): forced 0 (initial) and 4, 5
    (local); head 0 prefers block 2 a little, head 1 prefers block 3 a lot: the group sum picks 3."""
    spec = NSA(block=4, top=4, cmp=4, stride=4, window=0, initial=1, local=2)
    ck = torch.zeros(1, 1, 6, 2)
    ck[0, 0, 2], ck[0, 0, 3] = torch.tensor([1.0, 0.0]), torch.tensor([0.0, 1.0])
    q = torch.zeros(1, 2, 24, 2)
    q[0, 0, 23], q[0, 1, 23] = torch.tensor([2.0, 0.0]), torch.tensor([0.0, 6.0])
    scores = torch.matmul(q, ck.transpose(-1, -2))
    visible = (torch.arange(6) * 4 + 3)[None, :] <= torch.arange(24)[:, None]
    lse = torch.logsumexp(scores.masked_fill(~visible, float("-inf")), -1)
    chosen = spec.selected_blocks(q, ck, lse, None, causal=True, scale=1.0)[0, 0, 23]
    assert sorted(chosen.tolist()) == [0, 3, 4, 5]


def test_tile_union_lists_each_tiles_blocks_once_with_the_rows_that_chose_them():
    from sparsefocus.attention.nsa import tile_union

    blocks = torch.tensor([[[[0, 2, -1], [2, 1, -1], [3, -1, -1]]]], dtype=torch.int32)  # [1, 1, N=3, top=3]
    lists, bits = tile_union(blocks, tile=16, n_blocks=4, group=2)
    assert lists.shape == (1, 2, 1, 48) and bits.shape == lists.shape
    assert lists[0, 0, 0, :4].tolist() == [0, 1, 2, 3] and (lists[0, :, 0, 4:] == -1).all()
    assert bits[0, 0, 0, :4].tolist() == [0b001, 0b010, 0b011, 0b100]  # block 2: rows 0 and 1
    assert torch.equal(lists[:, 0], lists[:, 1]) and torch.equal(bits[:, 0], bits[:, 1])  # shared by the group


def test_mean_compression_averages_real_positions_only():
    x = torch.arange(8.0).view(1, 1, 8, 1)
    real = torch.tensor([[True, False, True, True, True, True, True, True]])
    mean, cmp_real = compress(x, real, 4, 2, None)
    torch.testing.assert_close(mean[0, 0, :, 0], torch.tensor([(0 + 2 + 3) / 3, 3.5, 5.5]))
    assert cmp_real.all()


def test_layer_owns_the_gates_and_trains_them_in_a_decoder_block():
    layer = SparseAttention(12, 4, "nsa:block=8,top=3,cmp=4,stride=4,window=8", causal=True, kv_heads=2)
    x = torch.randn(2, 19, 12)
    layer(x).square().mean().backward()
    assert layer.mechanism["nsa_gate_weight"].grad.abs().sum() > 0
    assert layer.aux_loss.item() == 0.0


@pytest.mark.parametrize(
    "pattern",
    [
        "nsa:block=16,top=2,cmp=16,stride=16,window=0,local=1",
        "nsa:block=8,top=2,cmp=8,stride=8,window=0,local=1,tile=16",
        "moba:block=16,top=1,tile=16",
    ],
)
def test_triton_path_compiles_with_fullgraph(pattern):
    spec = sf.parse_pattern(pattern)  # parsed outside, as SparseAttention holds it
    device = impl_device("triton")
    q = torch.randn(1, 2, 40, 16, device=device, requires_grad=True)
    k, v = torch.randn(1, 1, 40, 16, device=device), torch.randn(1, 1, 40, 16, device=device)

    def loss(q, k, v):
        return sf.sparse_attention(q, k, v, spec, causal=True, impl="triton").sum()

    compiled = torch.compile(loss, fullgraph=True, backend="aot_eager")
    grad = torch.autograd.grad(compiled(q, k, v), q)[0]
    torch.testing.assert_close(grad, torch.autograd.grad(loss(q, k, v), q)[0])

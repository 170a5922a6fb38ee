"""DSA: the Triton path (chunked indexer + indexed kernel, per head or per kv group, + the KL
chunked in PyTorch or fused in Triton) against the dense reference in the output, the KL loss and
every gradient (q, k, v, indexer weights), GQA and padding; no causal leak; row chunking changes
nothing; the KL trains the indexer only; the layer exposes the loss as ``aux_loss``; the fused KL
op against the chunked one on lists with unused slots and rows without keys."""

import pytest
import torch
from block_sparse_checks import impl_device, perturbed_after, run_with_grads

import sparsefocus as sf
from sparsefocus.attention import dsa
from sparsefocus.layers import SparseAttention
from sparsefocus.layers.attention import total_aux_loss
from sparsefocus.models import Decoder, ModelConfig

NAMES = ["out", "kl", "dq", "dk", "dv"]
KERNEL_DEVICE = impl_device("triton")  # where the fused KL op runs: CUDA when there is one


def dsa_case(spec, n, heads=4, kv_heads=2, dim=12, head_dim=8, batch=2):
    weights = spec.make_layer_parameters(dim, heads, kv_heads, head_dim, head_dim)
    x = torch.randn(batch, n, dim)
    q = torch.randn(batch, heads, n, head_dim)
    return x, q, torch.randn(batch, kv_heads, n, head_dim), torch.randn(batch, kv_heads, n, head_dim + 3), weights


@pytest.mark.parametrize("kl_kernel", ["torch", "triton"])
@pytest.mark.parametrize("heads, kv_heads", [(4, 2), (8, 2)])  # the per-head kernel; the group kernel
def test_dsa_kernel_matches_reference_in_output_loss_and_every_gradient(heads, kv_heads, kl_kernel, monkeypatch):
    monkeypatch.setattr(dsa, "KL_KERNEL", kl_kernel)
    assert (heads // kv_heads >= dsa.GROUP_KERNEL_MIN_HEADS) == (heads == 8)
    spec = sf.parse_pattern("dsa:k=9,heads=2,dim=8")
    x, q, k, v, weights = dsa_case(spec, n=41, heads=heads, kv_heads=kv_heads)
    padding = torch.rand(2, 41) > 0.2
    ref = run_with_grads(spec, "reference", x, q, k, v, weights, padding, aux_key="dsa_indexer_kl")
    tri = run_with_grads(spec, "triton", x, q, k, v, weights, padding, aux_key="dsa_indexer_kl")
    assert ref[1] > 0
    for name, a, b in zip(NAMES + list(weights), ref, tri):
        assert torch.isfinite(b).all(), name
        torch.testing.assert_close(b, a, atol=2e-5, rtol=1e-4, msg=name)


def test_dsa_never_leaks_the_future_into_outputs_loss_or_gradients():
    spec = sf.parse_pattern("dsa:k=6,heads=2,dim=4")
    x, q, k, v, weights = dsa_case(spec, n=30, batch=1)
    cut = 17
    x2 = perturbed_after(cut, x, dim=1)[0]
    q2, k2, v2 = perturbed_after(cut, q, k, v)
    before = run_with_grads(spec, "triton", x, q, k, v, weights, grad_rows=cut)
    after = run_with_grads(spec, "triton", x2, q2, k2, v2, weights, grad_rows=cut)
    for name, a, b in zip(NAMES, before, after):
        if a.dim() >= 3:
            torch.testing.assert_close(b[:, :, :cut], a[:, :, :cut], atol=1e-6, rtol=1e-6, msg=name)


def test_row_chunks_of_the_indexer_and_the_loss_change_nothing(monkeypatch):
    spec = sf.parse_pattern("dsa:k=7,heads=3,dim=4")
    x, q, k, v, weights = dsa_case(spec, n=33)
    whole = run_with_grads(spec, "lean", x, q, k, v, weights, aux_key="dsa_indexer_kl")
    monkeypatch.setattr(dsa, "SCORE_ELEMENTS", 500)
    monkeypatch.setattr(dsa, "KL_ELEMENTS", 300)
    chunked = run_with_grads(spec, "lean", x, q, k, v, weights, aux_key="dsa_indexer_kl")
    for name, a, b in zip(NAMES + list(weights), whole, chunked):
        torch.testing.assert_close(b, a, atol=1e-6, rtol=1e-5, msg=name)


def test_indexer_keeps_the_top_scored_keys():
    spec = dsa.DSA(k=2, heads=1, dim=2)
    iq = torch.tensor([1.0, 0.0]).expand(1, 1, 5, 2)
    ik = torch.tensor([[0.0, 1.0], [3.0, 0.0], [1.0, 0.0], [-4.0, 0.0], [2.0, 0.0]])[None]
    lists = spec.select(iq, ik, torch.ones(1, 5, 1), causal=True, key_padding_mask=None)[0, 0]
    assert sorted(lists[4].tolist()) == [1, 4] and sorted(lists[2].tolist()) == [1, 2] and lists[0].tolist() == [0, -1]


def test_kl_loss_trains_the_indexer_only_and_the_layer_exposes_it():
    layer = SparseAttention(12, 4, "dsa:k=5,heads=2,dim=4", causal=True, kv_heads=2)
    x = torch.randn(2, 23, 12, requires_grad=True)
    layer(x)
    assert layer.aux_loss > 0
    grads = torch.autograd.grad(layer.aux_loss, [x, layer.q_proj.weight, layer.mechanism["dsa_wq"]], allow_unused=True)
    assert grads[0] is None and grads[1] is None and grads[2].abs().sum() > 0


def test_decoder_with_dsa_reports_the_summed_aux_loss():
    config = ModelConfig(dim=16, heads=2, blocks=2, mlp_dim=32)
    model = Decoder(config, "dsa:k=4,heads=2,dim=4", vocab_size=11, max_len=32)
    model(torch.randint(0, 11, (2, 13)))
    layers = [m for m in model.modules() if isinstance(m, SparseAttention)]
    torch.testing.assert_close(total_aux_loss(model), layers[0].aux_loss + layers[1].aux_loss)


@pytest.mark.parametrize("kl_kernel", ["torch", "triton"])
def test_kl_on_every_third_row_matches_the_dense_definition(kl_kernel, monkeypatch):
    monkeypatch.setattr(dsa, "KL_KERNEL", kl_kernel)
    spec = sf.parse_pattern("dsa:k=6,heads=2,dim=4,kl_every=3")
    x, q, k, v, weights = dsa_case(spec, n=29)
    ref = run_with_grads(spec, "reference", x, q, k, v, weights, aux_key="dsa_indexer_kl")
    # the lean attention beside the fused KL runs where the kernel does (CUDA when there is one)
    lean = run_with_grads(spec, "lean", x, q, k, v, weights, aux_key="dsa_indexer_kl", device=impl_device(kl_kernel))
    for name, a, b in zip(NAMES + list(weights), ref, lean):
        torch.testing.assert_close(b, a, atol=2e-5, rtol=1e-4, msg=name)


def test_dsa_per_group_calls_equal_one_call(monkeypatch):
    """Above the expanded-lists limit the kv groups run one kernel call each (no [B, Hq, N, K]
    copy of the shared lists): the same output and gradients as one call."""
    spec = sf.parse_pattern("dsa:k=7,heads=2,dim=8")
    x, q, k, v, weights = dsa_case(spec, n=29)
    one = run_with_grads(spec, "triton", x, q, k, v, weights, None, aux_key="dsa_indexer_kl")
    from sparsefocus.kernels import indexed

    calls = []
    real = indexed.indexed_attention

    def counting(q, k, v, index, **kwargs):
        calls.append(tuple(index.shape[:2]))
        return real(q, k, v, index, **kwargs)

    monkeypatch.setattr(dsa, "EXPANDED_INDEX_BYTES", 0)
    monkeypatch.setattr(indexed, "indexed_attention", counting)
    grouped = run_with_grads(spec, "triton", x, q, k, v, weights, None, aux_key="dsa_indexer_kl")
    monkeypatch.undo()
    assert calls == [(2, 2), (2, 2)]  # one call per kv group, lists expanded over its 2 query heads
    for name, a, b in zip(NAMES + list(weights), one, grouped):
        torch.testing.assert_close(b, a, atol=1e-6, rtol=1e-6, msg=name)


@pytest.mark.parametrize("path", ["dot", "registers"])
@pytest.mark.parametrize(
    "q_heads, kv_heads, dtype", [(4, 2, torch.float32), (16, 1, torch.float16), (3, 3, torch.float32), (1, 1, torch.float32)]
)
def test_fused_kl_op_equals_the_chunked_loss_and_gradients(q_heads, kv_heads, dtype, path, monkeypatch):
    """Both ways a program multiplies its tiles: ``tl.dot``, or products summed in registers."""
    from sparsefocus.kernels import indexer_kl as indexer_kl_module
    from sparsefocus.kernels.indexer_kl import indexer_kl

    monkeypatch.setattr(indexer_kl_module, "SMALL_PRODUCT", 0 if path == "dot" else 2**30)

    batch, n, slots, heads, idim = 2, 37, 21, 3, 8
    q, k = torch.randn(batch, q_heads, n, 16, dtype=dtype), torch.randn(batch, kv_heads, n, 16, dtype=dtype)
    iq, ik, w = torch.randn(batch, heads, n, idim), torch.randn(batch, n, idim), torch.randn(batch, n, heads)
    index = torch.full((batch, 1, n, slots), -1, dtype=torch.int32)
    for b in range(batch):
        for t in range(1, n):  # row 0 lists no key; others up to ``slots`` distinct earlier keys
            chosen = torch.randperm(t)[:slots]
            index[b, 0, t, : len(chosen)] = chosen.int()
    grads = (torch.zeros_like(iq), torch.zeros_like(ik), torch.zeros_like(w))
    total, rows = dsa._kl_chunk(q.float(), k.float(), index, iq, ik, w, slice(0, n), 0.3, grads)
    on = [t.to(KERNEL_DEVICE) for t in (q, k, index[:, 0], iq, ik, w)]
    kl, has, d_iq, d_ik, d_w = (t.cpu() for t in indexer_kl(*on, 0.3))
    assert has[:, 0].eq(0).all() and kl[:, 0].eq(0).all()
    tolerance = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=1e-3, rtol=1e-3)
    torch.testing.assert_close(kl.sum(1), total, **tolerance)
    torch.testing.assert_close(has.sum(1), rows.float())
    for name, got, want in zip(["d_iq", "d_ik", "d_w"], (d_iq, d_ik, d_w), grads):
        torch.testing.assert_close(got, want, **tolerance, msg=name)
    without = [t.cpu() for t in indexer_kl(*on, 0.3, grads=False)]
    torch.testing.assert_close(without[0], kl)
    assert all(g.eq(0).all() for g in without[2:])


def test_fused_kl_op_passes_opcheck_and_compiles():
    from sparsefocus.kernels.indexer_kl import indexer_kl

    q, k = torch.randn(1, 2, 9, 16), torch.randn(1, 1, 9, 16)
    iq, ik, w = torch.randn(1, 2, 9, 4), torch.randn(1, 9, 4), torch.randn(1, 9, 2)
    index = torch.stack([torch.arange(5) - 4 + t for t in range(9)]).clamp_min(-1).int()[None]  # [1, 9, 5]
    q, k, index, iq, ik, w = (t.to(KERNEL_DEVICE) for t in (q, k, index, iq, ik, w))
    torch.library.opcheck(torch.ops.sparsefocus.indexer_kl.default, (q, k, index, iq, ik, w, 0.5, True))
    compiled = torch.compile(lambda *a: indexer_kl(*a, 0.5)[0], fullgraph=True, backend="eager")
    torch.testing.assert_close(compiled(q, k, index, iq, ik, w), indexer_kl(q, k, index, iq, ik, w, 0.5)[0])


def test_fused_kl_tiles_shrink_with_the_heads_and_give_way_beyond_them():
    """On CUDA a row's tiles must fit one program's shared memory: 64 list slots a tile for the
    benchmark's and the laboratory's sizes, 16 for DeepSeek-V3.2's (128 heads of 128, 64 indexer
    heads of 128), and the PyTorch path beyond."""
    from sparsefocus.kernels.indexer_kl import slots_per_tile

    assert slots_per_tile(16, 64, 4, 64) == 64 and slots_per_tile(1, 64, 4, 16) == 64
    assert slots_per_tile(128, 128, 64, 128) == 16
    assert slots_per_tile(128, 192, 64, 128) is None


def test_fused_kl_launch_reads_short_lists_in_narrow_tiles_with_one_warp():
    """Small rows (the laboratory's one head and lists of 5) take the register path with tiles as
    wide as the padded list and one warp; larger ones tl.dot tiles no wider than the padded list
    (64 slots for 40 keys), one warp for small tiles, and the shared-memory limit for long lists."""
    from sparsefocus.kernels.indexer_kl import launch_shape

    assert launch_shape(1, 64, 4, 16, 5) == (8, 1, False)  # the laboratory's ListOps DSA
    assert launch_shape(1, 64, 4, 16, 40) == (64, 4, True)
    assert launch_shape(16, 64, 4, 64, 2048) == (64, 4, True)  # the benchmark's top-2048
    assert launch_shape(128, 128, 64, 128, 2048) == (16, 4, True)
    with pytest.raises(ValueError, match="do not fit one program's tiles"):
        launch_shape(128, 192, 64, 128, 5)

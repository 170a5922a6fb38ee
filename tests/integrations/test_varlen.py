"""Packed batches (``cu_seqlens``): every document gives what it gives alone, on the reference,
lean and Triton paths of TOPK, BAND, BLOC and ZETA (ZETA's key sort and causal mean stay per
document); BAND and BLOC without global tokens and FULL take the one-call run-kernel path, which
reads nothing on the host; on the CPU the Triton paths run in Triton's interpreter
(tests/conftest.py), on a GPU machine every case runs on CUDA."""

import itertools

import pytest
import torch

import sparsefocus as sf

LENGTHS = (7, 1, 12, 5)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = 1e-6 if DEVICE == "cpu" else 1e-5  # CUDA: atomic adds in the kernels' backward sum in any order
PATTERNS = ["TOPK:3", "BAND:5(1)", "BLOC:4(1)", "BAND:5", "BLOC:4", "zeta:k=3,window=4,chunks=2,local=2", "FULL"]


def _packed(dim=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    total = sum(LENGTHS)
    q = torch.randn(1, 4, total, dim, generator=gen)
    k = torch.randn(1, 2, total, dim, generator=gen)
    v = torch.randn(1, 2, total, dim + 3, generator=gen)
    cu_seqlens = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32)
    return q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), cu_seqlens.to(DEVICE)


def _fits(pattern, n, causal):
    try:
        sf.parse_pattern(pattern).check_sizes(n, n, causal)
        return True
    except ValueError:
        return False


CASES = [(p, impl) for p in PATTERNS for impl in ("reference", "lean", "triton") if impl in sf.parse_pattern(p).impls]


@pytest.mark.parametrize("pattern, impl", CASES)
@pytest.mark.parametrize("causal", [False, True])
def test_each_document_equals_the_document_alone(pattern, impl, causal):
    dim = sf.parse_pattern(pattern).qk_dim(8)
    q, k, v, cu_seqlens = _packed(dim=dim)
    if not all(_fits(pattern, n, causal) for n in LENGTHS):
        lengths = [n for n in LENGTHS if _fits(pattern, n, causal)]
        q, k, v = (x[:, :, : sum(lengths)] for x in (q, k, v))
        cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    weight = torch.cos(torch.arange(q.shape[1] * q.shape[2] * v.shape[3], device=DEVICE, dtype=q.dtype))
    weight = weight.reshape(1, q.shape[1], q.shape[2], v.shape[3])  # [1, Hq, T, Dv]
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    packed = sf.sparse_attention(*leaves, pattern, causal=causal, impl=impl, cu_seqlens=cu_seqlens)
    packed.backward(weight)
    cuts = cu_seqlens.tolist()
    for a, b in itertools.pairwise(cuts):
        alone = [x[:, :, a:b].clone().requires_grad_() for x in (q, k, v)]
        out = sf.sparse_attention(*alone, pattern, causal=causal, impl=impl)
        out.backward(weight[:, :, a:b])
        torch.testing.assert_close(packed[:, :, a:b], out, atol=TOL, rtol=TOL)
        for name, leaf, part in zip(("dq", "dk", "dv"), leaves, alone):
            torch.testing.assert_close(leaf.grad[:, :, a:b], part.grad, atol=TOL, rtol=TOL, msg=name)


def test_no_query_attends_across_a_boundary():
    q, k, v, cu_seqlens = _packed()
    out = sf.sparse_attention(q, k, v, "FULL", impl="lean", cu_seqlens=cu_seqlens)
    changed = v.clone()
    changed[:, :, 8:] += 1.0  # every document after the first two
    moved = sf.sparse_attention(q, k, changed, "FULL", impl="lean", cu_seqlens=cu_seqlens)
    assert torch.equal(out[:, :, :8], moved[:, :, :8])


def test_packed_lse_equals_each_document_alone():
    q, k, v, cu_seqlens = _packed()
    _, lse = sf.sparse_attention(q, k, v, "BAND:5(1)", causal=True, impl="lean", cu_seqlens=cu_seqlens, return_lse=True)
    _, alone = sf.sparse_attention(q[:, :, 8:20], k[:, :, 8:20], v[:, :, 8:20], "BAND:5(1)", causal=True, return_lse=True)
    torch.testing.assert_close(lse[:, :, 8:20], alone)


def test_bad_packed_calls_are_refused():
    q, k, v, cu_seqlens = _packed()
    # lean: checked on the host (the run path asserts on the device)
    with pytest.raises(ValueError, match="rise strictly from 0"):
        sf.sparse_attention(q, k, v, "FULL", impl="lean", cu_seqlens=torch.tensor([0, 5, 5, 25], device=DEVICE))
    with pytest.raises(ValueError, match="batch of size 1"):
        sf.sparse_attention(
            q.expand(2, -1, -1, -1), k.expand(2, -1, -1, -1), v.expand(2, -1, -1, -1), "FULL", cu_seqlens=cu_seqlens
        )
    with pytest.raises(ValueError, match="exclusive"):
        sf.sparse_attention(
            q, k, v, "FULL", cu_seqlens=cu_seqlens, key_padding_mask=torch.ones(1, 25, dtype=torch.bool, device=DEVICE)
        )
    with pytest.raises(ValueError, match="larger than the number of keys 1"):  # the 1-token document
        sf.sparse_attention(q, k, v, "TOPK:3", causal=False, cu_seqlens=cu_seqlens)


def _per_document(q, k, v, cuts, pattern, causal):
    parts = [
        sf.sparse_attention(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], pattern, causal=causal, impl="reference")
        for a, b in itertools.pairwise(cuts)
    ]
    return torch.cat(parts, dim=2)


@pytest.mark.parametrize("pattern", ["BAND:5", "BLOC:4", "FULL"])
@pytest.mark.parametrize("causal", [False, True])
def test_the_run_path_reads_no_cut_point_on_the_host(pattern, causal, monkeypatch):
    """One run-kernel call for the batch: the host-side check (``tolist``) is never reached, and
    the result is each document's own (FULL through the path that "auto" takes on CUDA)."""
    from sparsefocus.attention import api
    from sparsefocus.attention.varlen import packed_run_attention

    q, k, v, cu_seqlens = _packed()

    def no_host_read(*args, **kwargs):
        raise AssertionError("the run path read the cut points on the host")

    monkeypatch.setattr(api, "check_cu_seqlens", no_host_read)
    spec = sf.parse_pattern(pattern)
    if pattern == "FULL":
        out = packed_run_attention(spec, q, k, v, cu_seqlens, causal=causal, scale=q.shape[-1] ** -0.5, return_lse=False)
    else:
        out = sf.sparse_attention(q, k, v, pattern, causal=causal, impl="triton", cu_seqlens=cu_seqlens)
    want = _per_document(q, k, v, [0, *torch.tensor(LENGTHS).cumsum(0).tolist()], pattern, causal)
    torch.testing.assert_close(out, want.to(out.dtype), atol=TOL, rtol=TOL)


def test_the_run_path_checks_the_cut_points_on_the_device():
    q, k, v, _ = _packed()
    bad = torch.tensor([0, 5, 5, 25], dtype=torch.int32, device=DEVICE)
    if DEVICE == "cpu":  # on CUDA the assert fires at the next synchronisation and ends the process
        with pytest.raises(RuntimeError, match="rise strictly from 0"):
            sf.sparse_attention(q, k, v, "BAND:5", impl="triton", cu_seqlens=bad)


def test_the_run_path_compiles_fullgraph():
    q, k, v, cu_seqlens = _packed()
    backend = "inductor" if DEVICE == "cuda" else "aot_eager"
    call = lambda q, k, v: sf.sparse_attention(q, k, v, "BAND:5", causal=True, impl="triton", cu_seqlens=cu_seqlens)  # noqa: E731
    compiled = torch.compile(call, fullgraph=True, backend=backend)
    torch.testing.assert_close(compiled(q, k, v), call(q, k, v), atol=TOL, rtol=TOL)

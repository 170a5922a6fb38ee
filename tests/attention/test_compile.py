"""Every registered pattern under ``torch.compile(fullgraph=True)``: the compiled ``SparseAttention``
gives the eager outputs and gradients (input and every parameter) for the lean, reference and
(where the pattern has one) Triton paths, without a graph break and without recompiling on a
second call of the same shapes. Each pattern is compiled causal and not (the paths alternate the
setting, so the sweep stays small). The sweep uses the "aot_eager" backend (it
traces exactly what Inductor would get, forward and backward, and compiles in seconds);
"inductor" runs on FULL, BAND, TOPK, ZETA and block_topk. On CPU the Triton paths run in
Triton's interpreter (tests/conftest.py), so sizes are tiny and odd (N = 37, head dim 16, 2 heads;
N = 23 for the two sequences of the key-padding case; NSA in its GQA form, one kv head).
"""

import pytest
import torch
import torch._dynamo
from block_sparse_checks import impl_device
from torch._dynamo.testing import CompileCounterWithBackend

from sparsefocus.attention import PATTERNS, parse_pattern
from sparsefocus.layers.attention import SparseAttention

N, HEADS, HEAD_DIM = 37, 2, 16
PADDED_N = 23  # B = 2 with key padding: shorter sequences, still three ZETA chunks with the padding in the last
# NSA selects blocks per kv head and its kernel runs one interpreted program per (position, kv
# head): one kv head shared by the two query heads is its intended GQA form, at half the programs.
KV_HEADS = {"nsa": 1}
EXAMPLES = [cls.examples[0] for _, cls in sorted(PATTERNS.items())]
TRITON_EXAMPLES = [e for e in EXAMPLES if "triton" in parse_pattern(e).impls]


def _causal(example: str, impl: str) -> bool:
    """One causal setting per pattern and path, alternating over the registry so that every
    pattern is compiled causal and not: lean takes one, reference and Triton the other."""
    return (EXAMPLES.index(example) + (impl != "lean")) % 2 == 1


def _length(spec, key_padding: bool = False) -> int:
    """Grid patterns need N = height * width; the others take the odd N (PADDED_N with padding)."""
    if hasattr(spec, "height"):
        return spec.height * spec.width
    return PADDED_N if key_padding else N


def _case(example: str, impl: str, causal: bool, key_padding: bool = False):
    """A layer with random weights, its input x [B, N, dim] (B = 2 with padding, else 1) and an
    upstream gradient."""
    spec = parse_pattern(example)
    torch.manual_seed(0)
    layer = SparseAttention(HEADS * HEAD_DIM, HEADS, spec, causal=causal, kv_heads=KV_HEADS.get(spec.name, HEADS), impl=impl)
    for parameter in layer.mechanism.values():  # trained-looking values, not the constant init
        parameter.data.add_(0.1 * torch.randn_like(parameter))
    n, batch = _length(spec, key_padding), 2 if key_padding else 1
    x = torch.randn(batch, n, HEADS * HEAD_DIM)
    mask = None
    if key_padding:
        mask = torch.ones(batch, n, dtype=torch.bool)
        mask[1, n - 5 :] = False
    device = impl_device(impl)  # the Triton path on CUDA where there is one
    mask = None if mask is None else mask.to(device)
    return layer.to(device), x.to(device), mask, torch.randn(batch, n, HEADS * HEAD_DIM, device=device)


def _outputs_and_grads(fn, layer, x, mask, grad_out):
    x = x.clone().requires_grad_()
    out = fn(x, mask) if mask is not None else fn(x)
    if grad_out is None:  # forward only
        return out.detach(), ()
    params = [p for p in layer.parameters()]
    grads = torch.autograd.grad(out, [x, *params], grad_out, allow_unused=True)
    return out.detach(), grads


def assert_compiled_equals_eager(example: str, impl: str, causal: bool, backend: str, key_padding: bool = False):
    torch._dynamo.reset()
    layer, x, mask, grad_out = _case(example, impl, causal, key_padding)
    counter = CompileCounterWithBackend(backend)
    compiled = torch.compile(layer, fullgraph=True, backend=counter)
    out, grads = _outputs_and_grads(compiled, layer, x, mask, grad_out)
    ref_out, ref_grads = _outputs_and_grads(layer, layer, x, mask, grad_out)
    tol = dict(rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(out, ref_out, **tol, msg=lambda m: f"{example} {impl} causal={causal}: output {m}")
    names = ["x"] + [name for name, _ in layer.named_parameters()]
    for name, got, want in zip(names, grads, ref_grads):
        if got is None or want is None:
            # a parameter the loss does not reach (dsa's indexer trains on its aux loss only) has no
            # gradient eagerly and may get zeros compiled: both mean zero, anything else is a bug
            present = want if got is None else got
            assert present is None or not present.abs().any(), f"{example} {impl}: d{name} is nonzero in one path only"
            continue
        torch.testing.assert_close(got, want, **tol, msg=lambda m, name=name: f"{example} {impl} causal={causal}: d{name} {m}")
    frames = counter.frame_count
    _outputs_and_grads(compiled, layer, torch.randn_like(x), mask, None)  # same shapes, new values
    assert counter.frame_count == frames == 1, f"{example} {impl}: recompiled ({counter.frame_count} frames)"


@pytest.mark.parametrize("example", EXAMPLES)
def test_every_pattern_compiles_fullgraph_lean(example):
    assert_compiled_equals_eager(example, "lean", _causal(example, "lean"), "aot_eager")


@pytest.mark.parametrize("example", EXAMPLES)
def test_every_pattern_compiles_fullgraph_reference(example):
    assert_compiled_equals_eager(example, "reference", _causal(example, "reference"), "aot_eager")


@pytest.mark.parametrize("example", TRITON_EXAMPLES)
def test_every_triton_pattern_compiles_fullgraph(example):
    assert_compiled_equals_eager(example, "triton", _causal(example, "triton"), "aot_eager")


@pytest.mark.parametrize("example", ["TOPK:5", "zeta:k=4,window=6,chunks=3,local=3"])
def test_triton_selections_compile_causal_and_not(example):
    """The two selection ops, in the setting the sweep above does not take."""
    assert_compiled_equals_eager(example, "triton", not _causal(example, "triton"), "aot_eager")


@pytest.mark.parametrize("example", ["TOPK:5", "zeta:k=4,window=6,chunks=3,local=3"])
def test_triton_selections_compile_with_key_padding(example):
    assert_compiled_equals_eager(example, "triton", True, "aot_eager", key_padding=True)


@pytest.mark.parametrize(
    "example,impl,causal",
    [
        ("FULL", "lean", True),
        ("BAND:5", "triton", True),
        ("TOPK:5", "triton", False),
        ("zeta:k=4,window=6,chunks=3,local=3", "triton", True),
        ("block_topk:block=4,top=2", "triton", True),
    ],
)
def test_representative_patterns_compile_with_inductor(example, impl, causal):
    assert_compiled_equals_eager(example, impl, causal, "inductor")


@pytest.mark.parametrize("causal", [False, True])
def test_full_with_key_padding_compiles_with_inductor(causal):
    """FULL's padded keys go through SDPA with a boolean mask: one graph, eager's outputs and gradients."""
    assert_compiled_equals_eager("FULL", "lean", causal, "inductor", key_padding=True)


def test_nsa_compression_compiles_with_inductor_and_key_padding():
    """NSA's padded compression under Inductor's own code, at a batch and width where the CPU
    backward of a product of two unfolded tensors once wrote out of bounds (torch 2.13; the
    process aborted): outputs and gradients equal eager."""
    from sparsefocus.attention import sparse_attention

    torch._dynamo.reset()
    torch.manual_seed(0)
    q, k, v = (torch.randn(25, 1, 40, 64, requires_grad=True) for _ in range(3))
    mask = torch.ones(25, 40, dtype=torch.bool)
    mask[3, 30:] = False

    def attend(q, k, v):
        return sparse_attention(q, k, v, "nsa:block=8,top=3,cmp=8,stride=8,window=5", key_padding_mask=mask, impl="lean")

    compiled = torch.compile(attend, fullgraph=True, backend="inductor")
    grad_out = torch.randn(25, 1, 40, 64)
    for _ in range(2):  # the abort came from a later allocation
        got = torch.autograd.grad(compiled(q, k, v), (q, k, v), grad_out)
    want = torch.autograd.grad(attend(q, k, v), (q, k, v), grad_out)
    for name, g, w in zip("qkv", got, want):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5, msg=lambda m, name=name: f"d{name}: {m}")


@pytest.mark.parametrize("example", ["TOPK:5", "zeta:k=4,window=6,chunks=3,local=3"])
def test_triton_selections_have_no_graph_break(example):
    """``torch._dynamo.explain`` sees one graph: the selection kernels are opaque ops."""
    torch._dynamo.reset()
    layer, x, _, _ = _case(example, "triton", True)
    explanation = torch._dynamo.explain(layer)(x)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1


def _functional(example: str) -> bool:
    """Whether a pattern runs through the functional API alone (no layer parameters or hidden states)."""
    spec = parse_pattern(example)
    layer = spec.make_layer_parameters(HEADS * HEAD_DIM, HEADS, HEADS, HEAD_DIM, HEAD_DIM)
    return spec.make_parameters(HEADS) == {} and not spec.needs_hidden and not layer


@pytest.mark.parametrize("example", [e for e in EXAMPLES if _functional(e)])
def test_functional_api_compiles_with_a_pattern_string(example):
    """``sparse_attention(q, k, v, "BAND:5(1)")`` inside a fullgraph-compiled function: the string
    is parsed while tracing (no graph break) and the result equals eager."""
    from sparsefocus.attention import sparse_attention

    spec = parse_pattern(example)
    n = _length(spec)
    torch.manual_seed(1)
    q, k, v = (torch.randn(1, HEADS, n, HEAD_DIM) for _ in range(3))
    torch._dynamo.reset()
    compiled = torch.compile(
        lambda q, k, v: sparse_attention(q, k, v, example, impl="reference"), backend="eager", fullgraph=True
    )
    torch.testing.assert_close(compiled(q, k, v), sparse_attention(q, k, v, example, impl="reference"))


@pytest.mark.parametrize(
    "example, impl",
    [
        ("entmax", "lean"),
        ("sparsemax", "lean"),
        ("TOPK:5", "lean"),
        ("moba:block=4,top=2,tile=16", "triton"),
        ("nsa:block=4,top=3,cmp=4,stride=2,window=4", "triton"),
        ("dsa:k=5,heads=2,dim=4", "triton"),
    ],
)
def test_row_kernels_and_the_fused_kl_compile_fullgraph(example, impl, monkeypatch):
    """The short-row top-k, the entmax row kernel and DSA's fused KL, which run on CUDA only by
    default, forced onto Triton's interpreter: compiled equals eager, one frame, no graph break."""
    from sparsefocus.attention import adaptive, dsa
    from sparsefocus.kernels import _ops

    monkeypatch.setattr(_ops, "ROW_TOPK", "triton")
    monkeypatch.setattr(adaptive, "ROW_KERNEL", "triton")
    monkeypatch.setattr(dsa, "KL_KERNEL", "triton")
    assert_compiled_equals_eager(example, impl, True, "aot_eager")

"""The tensor-core indexed kernel for key lists shared by a kv group's query heads against its
PyTorch twin: outputs, log-sum-exp and gradients (the LSE's too) at odd sizes, lists shared by
every head or per kv group, groups of 1 to 16 heads, unused slots and empty lists; fp16 within
twice PyTorch's own fp16 error; the ops pass opcheck and compile. On CPU the kernels run in
Triton's interpreter."""

import pytest
import torch

from sparsefocus.kernels.group_indexed import (
    group_indexed_attention,
    group_indexed_attention_ref,
    group_indexed_bwd,
    group_indexed_fwd,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def rel_err(x, ref):
    return ((x.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30)).item()


def make_case(kv_heads, group, list_heads, n=13, m=29, slots=21, dim=8, dim_v=5, dtype=torch.float32, seed=0):
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    q = torch.randn(2, kv_heads * group, n, dim, generator=gen, device=DEVICE).to(dtype)
    k = torch.randn(2, kv_heads, m, dim, generator=gen, device=DEVICE).to(dtype)
    v = torch.randn(2, kv_heads, m, dim_v, generator=gen, device=DEVICE).to(dtype)
    heads = kv_heads if list_heads == "group" else 1
    # distinct keys per list (as DSA's top-k gives), then some unused slots and one empty list
    index = torch.rand(2, heads, n, m, generator=gen, device=DEVICE).argsort(-1)[..., :slots].to(torch.int32)
    index[:, :, ::3, -4:] = -1
    index[0, :, n // 2] = -1
    return q, k, v, index


def run(fn, q, k, v, index, grad_out, grad_lse):
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    out, lse = fn(*leaves, index, scale=0.3)
    finite = torch.isfinite(lse)
    loss = (out.float() * grad_out).sum() + (torch.where(finite, lse, 0.0) * grad_lse).sum()
    return [out, lse, *torch.autograd.grad(loss, leaves)]


@pytest.mark.parametrize(
    "kv_heads, group, list_heads",
    [(1, 1, "shared"), (2, 3, "shared"), (2, 3, "group"), (1, 4, "shared"), (3, 2, "group"), (1, 16, "shared")],
)
def test_kernel_equals_the_reference_with_gradients(kv_heads, group, list_heads):
    q, k, v, index = make_case(kv_heads, group, list_heads)
    grad_out = torch.randn(2, kv_heads * group, 13, 5, device=DEVICE)
    grad_lse = torch.randn(2, kv_heads * group, 13, device=DEVICE)
    got = run(group_indexed_attention, q, k, v, index, grad_out, grad_lse)
    want = run(group_indexed_attention_ref, q, k, v, index, grad_out, grad_lse)
    for name, x, y in zip(["out", "lse", "dq", "dk", "dv"], got, want):
        if name == "lse":
            assert torch.equal(torch.isinf(x), torch.isinf(y)), "empty lists must give -inf"
            x, y = x[torch.isfinite(y)], y[torch.isfinite(y)]
        assert rel_err(x, y) < 1e-5, f"{name}: relative error {rel_err(x, y):.2e}"
    assert (got[0][0, :, 6] == 0).all() and torch.isneginf(got[1][0, :, 6]).all(), "an empty list outputs zero"


def test_fp16_within_twice_torch_error():
    """FlashAttention's rule: kernel error vs fp32 <= 2 x the error of PyTorch at fp16 (+ eps)."""
    q, k, v, index = make_case(2, 4, "shared", n=37, m=50, slots=33, dim=16, dim_v=8)
    q, k, v = (x.half().float() for x in (q, k, v))  # the same rounded inputs for all three
    grad_out = torch.randn(2, 8, 37, 8, device=DEVICE)
    grad_lse = torch.zeros(2, 8, 37, device=DEVICE)
    truth = run(group_indexed_attention_ref, q, k, v, index, grad_out, grad_lse)
    half = [x.half() for x in (q, k, v)]
    torch_low = run(_torch_in_half, *half, index, grad_out, grad_lse)
    kernel = run(group_indexed_attention, *half, index, grad_out, grad_lse)
    for name, x, y, t in zip(["out", "lse", "dq", "dk", "dv"], kernel, torch_low, truth):
        keep = torch.isfinite(t)
        x, y, t = x[keep], y[keep], t[keep]
        assert rel_err(x, t) <= 2 * rel_err(y, t) + 1e-5, f"{name}: {rel_err(x, t):.2e} vs torch {rel_err(y, t):.2e}"


def _torch_in_half(q, k, v, index, *, scale):
    """The reference's arithmetic kept in the inputs' precision (PyTorch's own fp16 error)."""
    group = q.shape[1] // k.shape[1]
    per_head = index.long().expand(q.shape[0], k.shape[1], -1, -1).repeat_interleave(group, dim=1)
    valid = per_head >= 0
    safe = torch.where(valid, per_head, 0)
    expand = [(x.repeat_interleave(group, dim=1)) for x in (k, v)]
    keys, values = (
        torch.stack([x[b, :, safe[b]].diagonal(dim1=0, dim2=1).movedim(-1, 0) for b in range(x.shape[0])]) for x in expand
    )
    scores = (torch.einsum("bhnd,bhnkd->bhnk", q, keys) * scale).masked_fill(~valid, float("-inf"))
    lse = torch.logsumexp(scores.float(), dim=-1)
    weights = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    return torch.einsum("bhnk,bhnkd->bhnd", weights, values), lse


def test_ops_pass_opcheck():
    q, k, v, index = make_case(2, 2, "shared", n=5, m=9, slots=4)
    torch.library.opcheck(group_indexed_fwd, (q, k, v, index, 0.3))
    out, lse2 = group_indexed_fwd(q, k, v, index, 0.3)
    args = (torch.randn_like(out), q, k, v, index, out, lse2, torch.zeros_like(lse2), 0.3)
    torch.library.opcheck(group_indexed_bwd, args, test_utils=("test_schema", "test_faketensor"))


def test_compiles_fullgraph_and_equals_eager():
    q, k, v, index = make_case(1, 2, "shared", n=7, m=11, slots=5)

    def step(q, k, v):
        out, lse = group_indexed_attention(q, k, v, index)
        return out.sum() + lse.sum()

    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    eager_grads = torch.autograd.grad(step(*leaves), leaves)
    compiled_grads = torch.autograd.grad(compiled(*leaves), leaves)
    for x, y in zip(compiled_grads, eager_grads):
        torch.testing.assert_close(x, y)


def test_bad_calls_are_refused():
    q, k, v, index = make_case(2, 2, "shared", n=5, m=9, slots=4)
    with pytest.raises(ValueError, match="index must be an integer tensor"):
        group_indexed_attention(q, k, v, index.float())
    with pytest.raises(ValueError, match=r"index must be an integer tensor \[B, 1 or Hk, N, K\]"):
        group_indexed_attention(q, k, v, index.expand(-1, 3, -1, -1))
    with pytest.raises(ValueError, match="multiple of kv heads"):
        group_indexed_attention(q[:, :3], k, v, index)

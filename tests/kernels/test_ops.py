"""The kernels as ``torch.library`` ops: ``opcheck`` on every op (schema, fake implementation,
autograd registration, AOT dispatch), ``torch.compile(fullgraph=True)`` of the public functions
equal to eager in outputs and gradients without recompiling, and ``return_lse`` (the log-sum-exp
against torch's, and two halves' partial results merged into the whole). On CPU the kernels run
in Triton's interpreter (tests/conftest.py), so sizes are tiny and odd."""

import pytest
import torch

from sparsefocus.attention.common import expand_kv, indexed_attention_ref
from sparsefocus.kernels import indexed, indexed_csr, morton, runs, scan
from sparsefocus.kernels.entmax_attention import entmax_attention
from sparsefocus.kernels.indexed import indexed_attention, indexed_attention_causal_mean
from sparsefocus.kernels.indexed_csr import build_inverse, key_grads
from sparsefocus.kernels.morton import morton_codes_triton
from sparsefocus.kernels.runs import run_attention
from sparsefocus.kernels.scan import CausalMeanScan, scaled_scan

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
B, HQ, HK, N, D, DV, K = 1, 2, 1, 37, 16, 8, 3
ALL_CHECKS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


def randn(*shape, dtype=torch.float32, grad=False):
    return torch.randn(*shape, device=DEVICE, dtype=dtype).requires_grad_(grad)


def attention_inputs(dtype=torch.float32, grad=True):
    """q [B, Hq, N, D], k [B, Hk, N, D], v [B, Hk, N, Dv], index int32 [B, Hq, N, K] with unused slots."""
    q, k, v = (
        randn(B, HQ, N, D, dtype=dtype, grad=grad),
        randn(B, HK, N, D, dtype=dtype, grad=grad),
        randn(B, HK, N, DV, dtype=dtype, grad=grad),
    )
    index = torch.randint(-1, N, (B, HQ, N, K), device=DEVICE, dtype=torch.int32)
    index[0, 0, 0] = -1  # a row with no listed key
    return q, k, v, index


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_opcheck_indexed_ops(dtype):
    q, k, v, index = attention_inputs(dtype)
    gamma_sq = (torch.rand(HQ, device=DEVICE) + 0.5).requires_grad_()
    extra_key, extra_value = randn(B, HK, N, D, dtype=dtype, grad=True), randn(B, HK, N, DV, dtype=dtype, grad=True)
    extra_mask = (torch.rand(B, HQ, N, device=DEVICE) > 0.3).to(torch.int8)
    sink = randn(HQ, D, grad=True)
    # on a GPU the fp32 atomics' order may move an fp16 result by one ulp between two calls
    tol = {"rtol": 2e-3, "atol": 2e-3} if dtype == torch.float16 and DEVICE == "cuda" else {}
    torch.library.opcheck(
        indexed.indexed_fwd, (q, k, v, index, gamma_sq, extra_key, extra_value, extra_mask, sink, 0.3, 2), **tol
    )
    torch.library.opcheck(indexed.indexed_fwd, (q, k, v, index, gamma_sq, None, None, None, None, 0.3, 0), **tol)
    real = torch.rand(B, N, device=DEVICE) > 0.2
    torch.library.opcheck(indexed.indexed_causal_mean_fwd, (q, k, v, index, gamma_sq, real, sink, 1.0, 2), **tol)
    torch.library.opcheck(indexed.indexed_causal_mean_fwd, (q, k, v, index, gamma_sq, None, None, 1.0, 2), **tol)
    out, stat = indexed.indexed_fwd(q, k, v, index, gamma_sq, extra_key, extra_value, extra_mask, sink, 0.3, 2)
    tensors = [
        x.detach()
        for x in (q, k, v, index, gamma_sq, out, randn(*out.shape, dtype=dtype), stat, extra_key, extra_value, extra_mask, sink)
    ]
    cast = dtype == torch.float32  # fp16: the fp32 key gradients of the causal mean's backward
    torch.library.opcheck(indexed.indexed_bwd, (*tensors, 0.3, 2, cast), **tol)


def test_opcheck_indexed_ops_with_per_row_widths_and_sinks():
    """gamma^2 [B, Hq] and sink keys [B, Hq, D], one per batch row and head (folded runs)."""
    batch = 2
    q, k, v = randn(batch, HQ, N, D, grad=True), randn(batch, HK, N, D, grad=True), randn(batch, HK, N, DV, grad=True)
    index = torch.randint(-1, N, (batch, HQ, N, K), device=DEVICE, dtype=torch.int32)
    gamma_sq = (torch.rand(batch, HQ, device=DEVICE) + 0.5).requires_grad_()
    sink = randn(batch, HQ, D, grad=True)
    torch.library.opcheck(indexed.indexed_fwd, (q, k, v, index, gamma_sq, None, None, None, sink, 0.3, 2))
    real = torch.rand(batch, N, device=DEVICE) > 0.2
    torch.library.opcheck(indexed.indexed_causal_mean_fwd, (q, k, v, index, gamma_sq, real, sink, 1.0, 2))
    out, stat = indexed.indexed_fwd(q, k, v, index, gamma_sq, None, None, None, sink, 0.3, 2)
    grad_out = randn(*out.shape)
    tensors = [x.detach() for x in (q, k, v, index, gamma_sq, out, grad_out, stat)]
    torch.library.opcheck(indexed.indexed_bwd, (*tensors, None, None, None, sink.detach(), 0.3, 2, True))
    delta = (out * grad_out).sum(-1).detach()
    key_args = (*(x.detach() for x in (q, k, v)), index, gamma_sq.detach(), grad_out, stat.detach(), delta)
    torch.library.opcheck(indexed_csr.key_grads_op, key_args)


def test_opcheck_runs_ops():
    q, k, v, _ = attention_inputs()
    start = torch.randint(-3, N, (B, HQ, N), device=DEVICE, dtype=torch.int32)
    length = torch.randint(0, 9, (B, HQ, N), device=DEVICE, dtype=torch.int32)
    for causal in (False, True):
        torch.library.opcheck(runs.runs_fwd, (q, k, v, start, length, 0, 0, 0.25, causal))
    torch.library.opcheck(runs.runs_fwd, (q, k, v, None, None, -4, 5, 0.25, True))  # a band: no run tensors
    torch.library.opcheck(runs.runs_fwd, (q, k, v, start[:1, :1], None, 0, 5, 0.25, False))  # broadcast starts
    out, lse = runs.runs_fwd(q, k, v, start, length, 0, 0, 0.25, True)
    args = [x.detach() for x in (q, k, v, start, length)]
    torch.library.opcheck(runs.runs_bwd, (*args, 0, 0, out.detach(), randn(*out.shape), lse.detach(), 0.25, True))
    out, lse = runs.runs_fwd(q, k, v, None, None, -4, 5, 0.25, True)
    args = [x.detach() for x in (q, k, v)]
    torch.library.opcheck(runs.runs_bwd, (*args, None, None, -4, 5, out.detach(), randn(*out.shape), lse.detach(), 0.25, True))


def test_opcheck_scan_morton_and_inverse_ops():
    x, base = randn(B, HK, N, 5, dtype=torch.float16, grad=True), randn(B, HK, N, 5, grad=True)
    pre, post = torch.rand(B, N, device=DEVICE), torch.rand(B, N, device=DEVICE)
    torch.library.opcheck(scan.scaled_scan_op, (x, pre, post, base, True, torch.float32))
    torch.library.opcheck(scan.scaled_scan_op, (x, pre, post, None, False, torch.float16))
    keys = randn(B, HK, N, D)
    torch.library.opcheck(scan.mean_rows, (keys, torch.rand(B, N, device=DEVICE) > 0.3, HQ))
    torch.library.opcheck(scan.mean_rows, (keys, None, HQ))
    unit = torch.rand(N, 3, device=DEVICE)
    torch.library.opcheck(morton.morton_codes_op, (unit, 5, 0.25, 32, 31, 1, 0, False))
    torch.library.opcheck(morton.morton_codes_op, (unit, 5, 0.25, 32, 31, 7, 3, True))
    q, k, v, index = attention_inputs(grad=False)
    # on a GPU the order of a key's entries follows the atomics', so two calls need not agree exactly
    inverse_checks = ("test_schema", "test_faketensor") if DEVICE == "cuda" else ALL_CHECKS
    torch.library.opcheck(indexed_csr.build_inverse_op, (index, N, HK), test_utils=inverse_checks)
    gamma_sq = torch.rand(HQ, device=DEVICE) + 0.5
    stat, delta = torch.rand(B, HQ, N, device=DEVICE) + 0.5, randn(B, HQ, N)
    torch.library.opcheck(indexed_csr.key_grads_op, (q, k, v, index, gamma_sq, randn(B, HQ, N, DV), stat, delta))
    slot_weight = torch.rand(index.shape, device=DEVICE)
    dot_args = (q, k, v, index, gamma_sq, randn(B, HQ, N, DV), stat, delta, 0.3, 0, slot_weight)
    torch.library.opcheck(indexed_csr.key_grads_op, dot_args)


def every_kernel(q, k, v, index, start, gamma, extra_key, extra_value, sink, real, x, base, stat, delta):
    """One call of each public kernel function: the differentiable outputs and the others."""
    out_c, lse_c = indexed_attention(
        q, k, v, index, score="cauchy", gamma=gamma, extra_key=extra_key, extra_value=extra_value, sink_key=sink, return_lse=True
    )
    out_d = indexed_attention(q, k, v, index, scale=0.3, score="dot")
    out_m, lse_m = indexed_attention_causal_mean(q, k, v, index, gamma=gamma, key_padding_mask=real, return_lse=True)
    out_r, lse_r = run_attention(q, k, v, start, 5, causal=True, return_lse=True)
    mean = CausalMeanScan.apply(x, real, real.float().cumsum(-1))
    scanned = scaled_scan(x, real.float(), real.float(), reverse=True, base=base)
    codes = morton_codes_triton(torch.sigmoid(x[..., :3]).float(), 4, 0.1, 16, 15)
    offsets, _ = build_inverse(index, k.shape[2], k.shape[1])  # entries past offsets[-1] are unused
    dk, dv = key_grads(q.detach(), k.detach(), v.detach(), index, gamma.detach() ** 2, out_d.detach(), stat, delta)
    out_e = entmax_attention(q, k, v, 1.5, 0.3, causal=True, key_padding_mask=real)
    differentiable = (out_c, out_d, out_m, out_r, mean, scanned, out_e)
    return differentiable, (lse_c, lse_m, lse_r, codes, offsets, dk, dv)


def compile_inputs():
    q, k, v, index = attention_inputs()
    start = torch.randint(-3, N, (1, 1, N), device=DEVICE)
    gamma = (torch.rand(HQ, device=DEVICE) + 0.5).requires_grad_()
    extra_key, extra_value, sink = randn(B, HK, N, D, grad=True), randn(B, HK, N, DV, grad=True), randn(HQ, D, grad=True)
    real = torch.rand(B, N, device=DEVICE) > 0.2
    x, base = randn(B, HK, N, 5, grad=True), randn(B, HK, N, 5, grad=True)
    stat, delta = torch.rand(B, HQ, N, device=DEVICE) + 0.5, randn(B, HQ, N)
    return q, k, v, index, start, gamma, extra_key, extra_value, sink, real, x, base, stat, delta


def outputs_and_grads(fn, inputs):
    """The function's outputs and the gradients of sum(w_i * output_i) w.r.t. every leaf, w_i
    fixed random weights (seeded, so the same for every fn)."""
    differentiable, others = fn(*inputs)
    leaves = [x for x in inputs if isinstance(x, torch.Tensor) and x.requires_grad]
    weights = [
        torch.randn(out.shape, generator=torch.Generator().manual_seed(i)).to(DEVICE) for i, out in enumerate(differentiable)
    ]
    loss = sum((w * out.float()).sum() for w, out in zip(weights, differentiable))
    return [*differentiable, *others, *torch.autograd.grad(loss, leaves)]


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_kernels_equal_eager_and_do_not_recompile(backend):
    """fullgraph=True: no graph break anywhere in the public functions; the Triton launches are
    opaque ops; forward and gradients as eager; the same shapes twice compile once."""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    # config.patch rather than monkeypatch: Dynamo's config module does not survive monkeypatch's undo
    with torch._dynamo.config.patch(error_on_recompile=True):
        counter = CompileCounterWithBackend(backend)
        compiled = torch.compile(every_kernel, fullgraph=True, backend=counter)
        inputs = compile_inputs()
        want, got = outputs_and_grads(every_kernel, inputs), outputs_and_grads(compiled, inputs)
        assert len(got) == len(want)
        for i, (x, y) in enumerate(zip(got, want)):
            torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6, msg=lambda m, i=i: f"output/grad {i}: {m}")
        compiled(*compile_inputs())  # fresh values, same shapes: no recompile (error_on_recompile would raise)
    assert counter.frame_count == 1


def test_inverse_key_grads_under_compile(monkeypatch):
    """KEY_GRADS = "inverse": the backward op calls the inverse-index ops inside; compiled as eager."""
    monkeypatch.setattr(indexed, "KEY_GRADS", "inverse")
    torch._dynamo.reset()
    q, k, v, index = attention_inputs()
    gamma = (torch.rand(HQ, device=DEVICE) + 0.5).requires_grad_()

    def attend(q, k, v, gamma):
        return indexed_attention(q, k, v, index, score="cauchy", gamma=gamma)

    grad_out = randn(B, HQ, N, DV)
    results = []
    for fn in (attend, torch.compile(attend, fullgraph=True, backend="aot_eager")):
        out = fn(q, k, v, gamma)
        results.append([out, *torch.autograd.grad(out, (q, k, v, gamma), grad_out)])
    for x, y in zip(*results):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6)


def reference_scores(q, k, index, score, scale, gamma_sq):
    """Scaled scores [B, Hq, N, K] of each listed slot (Cauchy: log w), -inf for unused slots."""
    keys = expand_kv(k, q.shape[1])  # [B, Hq, M, D]
    gathered = torch.gather(
        keys[:, :, None].expand(-1, -1, q.shape[2], -1, -1),
        3,
        index.clamp_min(0).long()[..., None].expand(-1, -1, -1, -1, q.shape[-1]),
    )  # [B, Hq, N, K, D]
    s = slot_scores(q[:, :, :, None], gathered, score, scale, gamma_sq)
    return s.masked_fill(index < 0, float("-inf"))


def slot_scores(q, keys, score, scale, gamma_sq):
    """Scores of q [..., 1, D] against keys [..., S, D] (gamma_sq [Hq] for Cauchy: log w)."""
    if score == "dot":
        return scale * (q * keys).sum(-1)
    sq_dist = ((q - keys) ** 2).sum(-1)
    if score == "neg_sqeuclid":
        return -scale * sq_dist
    return -torch.log(sq_dist + gamma_sq[None, :, None, None])


@pytest.mark.parametrize("score", ["dot", "neg_sqeuclid", "cauchy"])
def test_indexed_lse_is_logsumexp_of_the_masked_scores(score):
    q, k, v, index = attention_inputs(grad=False)
    gamma = torch.rand(HQ, device=DEVICE) + 0.5
    extra_key, extra_value = randn(B, HK, N, D), randn(B, HK, N, DV)
    extra_mask = torch.rand(B, 1, N, device=DEVICE) > 0.3
    extra_mask[0, 0, 0] = False  # row (0, 0, 0): no listed key, no extra slot
    sink = 0.5 * randn(HQ, D) if score == "cauchy" else None
    out, lse = indexed_attention(
        q,
        k,
        v,
        index,
        scale=0.3,
        score=score,
        gamma=gamma,
        extra_key=extra_key,
        extra_value=extra_value,
        extra_mask=extra_mask,
        sink_key=sink,
        return_lse=True,
    )
    gamma_sq = gamma**2
    scores = [reference_scores(q, k, index, score, 0.3, gamma_sq)]
    extra = slot_scores(q[..., None, :], expand_kv(extra_key, HQ)[..., None, :], score, 0.3, gamma_sq)  # [B, Hq, N, 1]
    scores.append(extra.masked_fill(~extra_mask[..., None], float("-inf")))
    if sink is not None:
        scores.append(slot_scores(q[..., None, :], sink[None, :, None, None, :], score, 0.3, gamma_sq))
    want = torch.logsumexp(torch.cat(scores, -1), -1)
    assert lse.dtype == torch.float32 and lse.shape == (B, HQ, N) and not lse.requires_grad
    torch.testing.assert_close(lse, want, rtol=1e-5, atol=1e-5)
    assert (lse[0, 0, 0] == float("-inf")) == (sink is None)
    reference = indexed_attention_ref(
        q,
        k,
        v,
        index,
        scale=0.3,
        score=score,
        gamma=gamma,
        extra_key=extra_key,
        extra_value=extra_value,
        extra_mask=extra_mask,
        sink_key=sink,
    )
    torch.testing.assert_close(out, reference, rtol=1e-5, atol=1e-6)


def test_causal_mean_lse_counts_the_mean_token():
    from sparsefocus.attention.zeta import mean_tokens

    q, k, v, index = attention_inputs(grad=False)
    gamma = torch.rand(HQ, device=DEVICE) + 0.5
    real = torch.rand(B, N, device=DEVICE) > 0.3
    real[0, :2] = False  # the first rows have no mean
    _, lse = indexed_attention_causal_mean(q, k, v, index, gamma=gamma, key_padding_mask=real, return_lse=True)
    mean_k, _, present = mean_tokens(k, v, True, real)
    mean = slot_scores(q[..., None, :], expand_kv(mean_k, HQ)[..., None, :], "cauchy", 1.0, gamma**2)
    scores = torch.cat(
        [reference_scores(q, k, index, "cauchy", 1.0, gamma**2), mean.masked_fill(~present[..., None], float("-inf"))], -1
    )
    torch.testing.assert_close(lse, torch.logsumexp(scores, -1), rtol=1e-5, atol=1e-5)


def test_run_lse_is_logsumexp_of_the_masked_scores():
    q, k, v, _ = attention_inputs(grad=False)
    start = torch.randint(-3, N, (B, HQ, N), device=DEVICE)
    start[0, 1, :3] = N + 2  # runs past the keys: empty rows
    _, lse = run_attention(q, k, v, start, 6, scale=0.4, causal=True, return_lse=True)
    keys, rows = torch.arange(N, device=DEVICE), torch.arange(N, device=DEVICE)[:, None]
    allowed = (keys >= start[..., None]) & (keys < start[..., None] + 6) & (keys <= rows)  # [B, Hq, N, M]
    scores = 0.4 * q @ expand_kv(k, HQ).transpose(-1, -2)
    want = torch.logsumexp(scores.masked_fill(~allowed, float("-inf")), -1)
    torch.testing.assert_close(lse, want, rtol=1e-5, atol=1e-5)
    assert (lse[0, 1, :3] == float("-inf")).all()


def merge(out_a, lse_a, out_b, lse_b):
    """Attention over the union of two disjoint key sets from each set's (out, lse)."""
    lse = torch.logaddexp(lse_a, lse_b)
    finite = torch.isfinite(lse)
    safe = torch.where(finite, lse, 0.0)
    w_a = torch.where(finite, torch.exp(lse_a - safe), 0.0)[..., None]
    w_b = torch.where(finite, torch.exp(lse_b - safe), 0.0)[..., None]
    return w_a * out_a.float() + w_b * out_b.float(), lse


@pytest.mark.parametrize("score", ["dot", "cauchy"])
def test_indexed_halves_merge_into_the_whole(score):
    """Keys below and above M / 2 (disjoint), each half's (out, lse) merged: the full lists' result."""
    q, k, v, index = attention_inputs(grad=False)
    low = torch.where(index < N // 2, index, -1)
    high = torch.where(index >= N // 2, index, -1)
    kwargs = {"score": score, "scale": 0.5, "return_lse": True}
    whole, lse = indexed_attention(q, k, v, index, **kwargs)
    merged, merged_lse = merge(*indexed_attention(q, k, v, low, **kwargs), *indexed_attention(q, k, v, high, **kwargs))
    torch.testing.assert_close(merged, whole, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(merged_lse, lse, rtol=1e-5, atol=1e-5)


def test_run_halves_merge_into_the_whole():
    """The keys split at M / 2 into two tensors; each half's runs shifted into its own keys."""
    q, k, v, _ = attention_inputs(grad=False)
    half = N // 2
    start = torch.arange(N, device=DEVICE) - 4
    whole, lse = run_attention(q, k, v, start[None, None], 9, return_lse=True)
    part_a = run_attention(q, k[:, :, :half], v[:, :, :half], start[None, None], 9, return_lse=True)
    part_b = run_attention(q, k[:, :, half:], v[:, :, half:], (start - half)[None, None], 9, return_lse=True)
    merged, merged_lse = merge(*part_a, *part_b)
    torch.testing.assert_close(merged, whole, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(merged_lse, lse, rtol=1e-5, atol=1e-5)


def test_empty_inputs_give_empty_rows_and_minus_inf_lse():
    """No listed slot and no key: zero rows with lse -inf (run kernel) or the sink's log weight."""
    q, k, v, _ = attention_inputs(grad=False)
    none = torch.empty(B, HQ, N, 0, dtype=torch.int32, device=DEVICE)
    out, lse = indexed_attention(q, k, v, none, score="dot", return_lse=True)
    assert (out == 0).all() and (lse == float("-inf")).all()
    out, lse = run_attention(
        q, k[:, :, :0], v[:, :, :0], torch.zeros(1, 1, N, dtype=torch.long, device=DEVICE), 3, return_lse=True
    )
    assert (out == 0).all() and (lse == float("-inf")).all()
    sink = randn(HQ, D)
    out, lse = indexed_attention(q, k[:, :, :0], v[:, :, :0], none, score="cauchy", sink_key=sink, return_lse=True)
    want = -torch.log(((q - sink[None, :, None]) ** 2).sum(-1) + 1.0)
    assert (out == 0).all()
    torch.testing.assert_close(lse, want, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="host syncs are a CUDA matter")
def test_public_functions_make_no_host_sync():
    inputs = compile_inputs()
    every_kernel(*inputs)  # compile the Triton kernels first (their first launch may sync)
    torch.cuda.set_sync_debug_mode("error")
    try:
        every_kernel(*inputs)
    finally:
        torch.cuda.set_sync_debug_mode("default")

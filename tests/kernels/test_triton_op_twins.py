"""The ``triton_op`` twins of the kernels' ``custom_op`` launchers (``_ops.TRITON_OPS``; the run
kernels and every op of ZETA's and TOPK's paths): the same results and gradients as the
``custom_op``s they stand for, every op of a call replaced by its twin, and, on CUDA, ``opcheck``,
PyTorch finding their kernels, and a compiled graph that launches the Triton kernels from
Inductor's own code instead of calling an op. On the CPU the twins run eagerly through Triton's
interpreter, which cannot be traced."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import sparsefocus as sf
from sparsefocus.kernels import _ops, indexed, morton, runs, scan, topk_select, zeta_select
from sparsefocus.kernels.runs import run_attention

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
B, HQ, HK, N, D, DV = 2, 4, 2, 37, 16, 8
cuda_only = pytest.mark.skipif(DEVICE != "cuda", reason="tracing a triton_op's kernels needs CUDA (not the interpreter)")


def inputs(seed: int = 0):
    """q [B, Hq, N, D], k [B, Hk, N, D], v [B, Hk, N, Dv] fp32, and int32 starts and lengths [B, Hq, N]."""
    gen = torch.Generator().manual_seed(seed)

    def leaf(*shape):
        return torch.randn(*shape, generator=gen).to(DEVICE).requires_grad_()

    start = torch.randint(-3, N, (B, HQ, N), generator=gen, dtype=torch.int32).to(DEVICE)
    length = torch.randint(0, 9, (B, HQ, N), generator=gen, dtype=torch.int32).to(DEVICE)
    return leaf(B, HQ, N, D), leaf(B, HK, N, D), leaf(B, HK, N, DV), start, length


CASES = {
    "band": lambda start, length: (-4, 5),
    "runs": lambda start, length: (start, length),
    "broadcast starts": lambda start, length: (start[:1, :1], 6),
}


def attend(q, k, v, start, width, causal):
    return run_attention(q, k, v, start, width, causal=causal, return_lse=True)


def attend_and_grads(q, k, v, start, width, causal, forward=attend):
    out, lse = forward(q, k, v, start, width, causal)
    weights = torch.linspace(-1, 1, out.numel(), device=out.device).view_as(out)
    return (out, lse, *torch.autograd.grad((out * weights).sum(), (q, k, v)))


class OpsCalled(TorchDispatchMode):
    """Records the name of every op dispatched while it is active."""

    def __init__(self):
        super().__init__()
        self.names: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.add(str(func))
        return func(*args, **(kwargs or {}))


def close(got, want):
    """Equal on the CPU; on CUDA the fp32 atomic adds of dk, dv may sum in another order."""
    if DEVICE == "cpu":
        return torch.equal(got, want)
    return torch.allclose(got, want, rtol=1e-5, atol=1e-5, equal_nan=True)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("case", list(CASES))
def test_runs_twin_gives_the_custom_ops_outputs_and_gradients(monkeypatch, case, causal):
    q, k, v, start, length = inputs()
    runs_start, width = CASES[case](start, length)
    results, called = {}, {}
    for choice in ("off", "on"):
        monkeypatch.setattr(_ops, "TRITON_OPS", choice)
        with OpsCalled() as mode:
            results[choice] = attend_and_grads(q, k, v, runs_start, width, causal)
        called[choice] = {name for name in mode.names if name.startswith("sparsefocus.runs")}
    assert called["off"] == {"sparsefocus.runs_fwd.default", "sparsefocus.runs_bwd.default"}
    assert called["on"] == {"sparsefocus.runs_fwd_traced.default", "sparsefocus.runs_bwd_traced.default"}
    for name, got, want in zip(("out", "lse", "dq", "dk", "dv"), results["on"], results["off"]):
        assert close(got, want), name


def test_the_switch_refuses_an_unknown_choice(monkeypatch):
    q, k, v, _, _ = inputs()
    monkeypatch.setattr(_ops, "TRITON_OPS", "yes")
    with pytest.raises(ValueError, match="TRITON_OPS must be 'off', 'auto' or 'on', got 'yes'"):
        run_attention(q, k, v, -4, 5)


@cuda_only
def test_pytorch_finds_the_twins_kernels():
    """PyTorch reads a triton_op's kernels from its source (their code keys AOTAutograd's cache)."""
    from torch._library.triton import get_triton_kernels_for_op

    assert runs._runs_fwd_kernel in get_triton_kernels_for_op("sparsefocus::runs_fwd_traced")
    assert runs._runs_bwd_kernel in get_triton_kernels_for_op("sparsefocus::runs_bwd_traced")


@cuda_only
def test_opcheck_runs_twins():
    q, k, v, start, length = inputs()
    for causal in (False, True):
        torch.library.opcheck(runs.runs_fwd_traced, (q, k, v, start, length, 0, 0, 0.25, causal))
    torch.library.opcheck(runs.runs_fwd_traced, (q, k, v, None, None, -4, 5, 0.25, True))
    out, lse = runs.runs_fwd_traced(q, k, v, start, length, 0, 0, 0.25, True)
    args = [x.detach() for x in (q, k, v, start, length)]
    grad_out = torch.randn_like(out)
    torch.library.opcheck(runs.runs_bwd_traced, (*args, 0, 0, out.detach(), grad_out, lse.detach(), 0.25, True))


@cuda_only
def test_compiled_twin_is_launched_by_inductor_and_equals_eager(monkeypatch):
    """Compiled with the twins, the generated code launches both kernels itself: neither twin is
    called as an op (a custom_op would stay one), and outputs and gradients equal eager's."""
    from torch._inductor.utils import run_and_get_code

    monkeypatch.setattr(_ops, "TRITON_OPS", "auto")
    q, k, v, start, length = inputs()
    want = attend_and_grads(q, k, v, start, length, True)
    compiled = torch.compile(attend, fullgraph=True)
    got, code = run_and_get_code(attend_and_grads, q, k, v, start, length, True, compiled)  # the backward compiles in it
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), got, want):
        assert close(a, b), name
    source = "\n".join(code)
    assert "_runs_fwd_kernel" in source and "_runs_bwd_kernel" in source
    assert "runs_fwd_traced" not in source and "runs_bwd_traced" not in source


TWINNED = {
    "runs_fwd",
    "runs_bwd",
    "morton_codes",
    "scaled_scan",
    "mean_rows",
    "zeta_sorted_prefixes",
    "zeta_prefix_filter",
    "zeta_select",
    "indexed_fwd",
    "indexed_bwd",
    "indexed_causal_mean_fwd",
    "topk_select",
}


def package_ops(names: set[str]) -> set[str]:
    """The package's ops among dispatched op names ("sparsefocus.x.default" -> "x")."""
    return {name.split(".")[1] for name in names if name.startswith("sparsefocus.")}


def pattern_inputs(seed: int = 1):
    """q, k, v [B, Hq, N, D] fp32 leaves for a whole pattern."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, HQ, N, D, generator=gen)
    k, v = torch.randn(B, HQ, N, D, generator=gen), torch.randn(B, HQ, N, D, generator=gen)
    return tuple(x.to(DEVICE).requires_grad_() for x in (q, k, v))


@pytest.mark.parametrize("spec", ["zeta:k=5,window=8,local=4", "TOPK:5"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("long_rows", [False, True])
def test_a_patterns_ops_are_all_replaced_by_their_twins(monkeypatch, spec, causal, long_rows):
    """The whole pattern through the twins: every op of the call is a twin, with the same outputs
    and gradients. ``long_rows`` takes the paths of rows longer than these (ZETA's torch sort and
    prefix filter, the multi-level scan; TOPK's four-kernel selection)."""
    if long_rows:
        monkeypatch.setattr(zeta_select, "SORT_MAX_M", 0)
        monkeypatch.setattr(scan, "ONE_PASS_MAX_N", 0)
        monkeypatch.setattr(topk_select, "SHORT_MAX_M", 0)
    q, k, v = pattern_inputs()
    results, called = {}, {}
    for choice in ("off", "on"):
        monkeypatch.setattr(_ops, "TRITON_OPS", choice)
        with OpsCalled() as mode:
            out = sf.sparse_attention(q, k, v, spec, causal=causal, impl="triton")
            weights = torch.linspace(-1, 1, out.numel(), device=out.device).view_as(out)
            results[choice] = (out, *torch.autograd.grad((out * weights).sum(), (q, k, v)))
        called[choice] = package_ops(mode.names)
    assert called["off"] and called["off"] <= TWINNED
    assert called["on"] == {f"{name}_traced" for name in called["off"]}
    if spec.startswith("zeta") and causal:
        assert ("zeta_prefix_filter" in called["off"]) == long_rows
    for name, got, want in zip(("out", "dq", "dk", "dv"), results["on"], results["off"]):
        assert close(got, want), name


def test_the_scan_twins_give_the_ops_results_both_ways():
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(B, HK, N, 5, generator=gen).to(DEVICE).requires_grad_()
    base = torch.randn(B, HK, N, 5, generator=gen).to(DEVICE)
    pre, post = (torch.rand(B, N, generator=gen).to(DEVICE) for _ in range(2))
    for reverse in (False, True):
        want = scan.scaled_scan_op(x, pre, post, base, reverse, torch.float32)
        got = scan.scaled_scan_traced(x, pre, post, base, reverse, torch.float32)
        assert close(got, want)
        assert close(*(torch.autograd.grad(y.square().sum(), x)[0] for y in (got, want)))
    real = torch.rand(B, N, generator=gen).to(DEVICE) > 0.3
    for mask in (real, None):
        for got, want in zip(scan.mean_rows_traced(x, mask, HQ), scan.mean_rows(x, mask, HQ)):
            assert torch.equal(got, want)


@cuda_only
def test_opcheck_zeta_and_indexed_twins():
    """opcheck on the twins of ZETA's path through one causal call's own arguments."""
    q, k, v = (x.detach() for x in pattern_inputs())
    unit = torch.rand(B * HQ * N, 3, device=DEVICE)
    torch.library.opcheck(morton.morton_codes_traced, (unit, 10, 0.0, 1024, 1023, 1, 0, False))
    pre, post = torch.rand(B, N, device=DEVICE), torch.rand(B, N, device=DEVICE)
    x = torch.randn(B, HK, N, 5, device=DEVICE, requires_grad=True)
    torch.library.opcheck(scan.scaled_scan_traced, (x, pre, post, None, False, torch.float32))
    torch.library.opcheck(scan.mean_rows_traced, (k, None, HQ))
    index = torch.randint(-1, N, (B, HQ, N, 4), device=DEVICE, dtype=torch.int32)
    gamma_sq = torch.rand(HQ, device=DEVICE) + 0.5
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    torch.library.opcheck(indexed.indexed_fwd_traced, (*leaves, index, gamma_sq, None, None, None, None, 0.25, 2))
    torch.library.opcheck(indexed.indexed_causal_mean_fwd_traced, (*leaves, index, gamma_sq, None, None, 0.25, 2))
    codes = torch.randint(0, 1 << 20, (1, B, HK, N), device=DEVICE, dtype=torch.int64)
    torch.library.opcheck(zeta_select._sorted_prefixes_traced, (codes, None, 8, 4, 1 << 40, 20))


@cuda_only
def test_compiled_zeta_twins_leave_no_op_call_in_the_graph(monkeypatch):
    """ZETA compiled with the twins: the generated code launches the kernels itself and calls none
    of the package's ops; outputs and gradients as eager."""
    from torch._inductor.utils import run_and_get_code

    monkeypatch.setattr(_ops, "TRITON_OPS", "auto")
    q, k, v = (x.to(torch.bfloat16).detach().requires_grad_() for x in pattern_inputs())

    def forward(q, k, v):
        return sf.sparse_attention(q, k, v, "zeta:k=5,window=8,local=4", causal=True, impl="triton")

    def step(forward):
        out = forward(q, k, v)
        return (out, *torch.autograd.grad(out.float().square().sum(), (q, k, v)))

    want = step(forward)
    got, code = run_and_get_code(step, torch.compile(forward, fullgraph=True))
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        assert torch.allclose(a.float(), b.float(), rtol=2e-2, atol=2e-2), name
    source = "\n".join(code)
    assert "_zeta_select_kernel" in source and "_indexed_bwd_kernel" in source
    assert "torch.ops.sparsefocus" not in source

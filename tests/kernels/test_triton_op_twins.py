"""The ``triton_op`` twins of the kernels' ``custom_op`` launchers (``_ops.TRITON_OPS``): the same
results and gradients as the ``custom_op`` they stand for, and, on CUDA, ``opcheck`` and a
compiled graph that launches the Triton kernels from Inductor's own code instead of calling the op.
On the CPU the twins run eagerly through Triton's interpreter, which cannot be traced."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from sparsefocus.kernels import _ops, runs
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

"""The interpreter fixes: on the CPU, kernels run under Triton's interpreter as they compile on
the GPU (skipped where the kernels run compiled)."""

import os

import pytest
import torch
import triton
import triton.language as tl

import sparsefocus.kernels.interpreter_compat  # noqa: F401  (applies the fixes)

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="checks Triton's CPU interpreter, which runs the kernels only without CUDA"
)


@triton.jit
def _flag_or_mask_kernel(OUT, n, LIMIT: tl.constexpr, BLOCK: tl.constexpr):
    """Store positions where a scalar flag or a per-position test holds (the flag broadcast
    into the block, as a row's 'take every key' switch is)."""
    flag = (n + 1) <= LIMIT  # a scalar comparison
    offs = tl.arange(0, BLOCK)
    take = (offs < n) & (flag | (offs > 2))
    tl.store(OUT + offs, offs, mask=take)
    for start in range(0, n, BLOCK):  # a loop bound read from a scalar
        tl.store(OUT + BLOCK + start + offs, offs, mask=start + offs < n)


@pytest.mark.parametrize("n, limit, first", [(5, 6, [0, 1, 2, 3, 4, -1, -1, -1]), (5, 3, [-1, -1, -1, 3, 4, -1, -1, -1])])
def test_a_scalar_flag_broadcast_into_a_mask_stores_as_compiled_code_does(n, limit, first):
    out = torch.full((16,), -1, dtype=torch.int32)
    _flag_or_mask_kernel[(1,)](out, n, LIMIT=limit, BLOCK=8)
    assert out[:8].tolist() == first
    assert out[8:].tolist() == [0, 1, 2, 3, 4, -1, -1, -1]


def test_the_interpreter_skips_the_overflow_checks_that_outside_debug_mode_it_discards():
    from triton.runtime import interpreter

    assert not interpreter.interpreter_builder.options.debug
    assert not interpreter.interpreter_builder.options.sanitize_overflow

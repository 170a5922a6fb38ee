"""The one-launch backward delta against its PyTorch twin at odd sizes and in the inputs' float
dtypes, with non-contiguous inputs, empty rows and bad shapes; the op's registration."""

import pytest
import torch

from sparsefocus.kernels import row_delta as module
from sparsefocus.kernels.row_delta import row_delta, row_delta_torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 1, 1, 1), (2, 3, 37, 6), (1, 2, 300, 64), (3, 1, 5, 129), (2, 2, 7, 256)])
def test_row_delta_equals_the_torch_twin(shape, dtype):
    torch.manual_seed(0)
    a, b = (torch.randn(shape, device=DEVICE).to(dtype) for _ in range(2))
    grad_lse = torch.randn(shape[:-1], device=DEVICE).to(dtype)
    got = row_delta(a, b, grad_lse)
    want = row_delta_torch(a.double(), b.double(), grad_lse.double()).float()  # exact products of the rounded inputs
    assert got.shape == shape[:-1] and got.dtype == torch.float32
    # fp32 sums of at most 256 exact products: the error is the summation's alone
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * shape[-1] ** 0.5)
    torch.testing.assert_close(got, row_delta_torch(a, b, grad_lse), rtol=1e-5, atol=1e-5 * shape[-1] ** 0.5)


def test_row_delta_reads_non_contiguous_inputs_and_empty_rows():
    a = torch.randn(2, 9, 3, 16, device=DEVICE).transpose(1, 2)  # [2, 3, 9, 16], not contiguous
    b = torch.randn(2, 3, 9, 16, device=DEVICE)
    grad_lse = torch.randn(2, 9, 3, device=DEVICE).transpose(1, 2)
    torch.testing.assert_close(row_delta(a, b, grad_lse), row_delta_torch(a, b, grad_lse), rtol=1e-5, atol=1e-5)
    empty = torch.randn(2, 3, 0, 16, device=DEVICE)
    assert row_delta(empty, empty, torch.zeros(2, 3, 0, device=DEVICE)).shape == (2, 3, 0)


def test_row_delta_torch_in_chunks_equals_the_whole_product(monkeypatch):
    """The twin's fp32 products in row chunks (a bound on its memory) equal one whole product."""
    a, b = torch.randn(2, 3, 37, 6).bfloat16(), torch.randn(2, 3, 37, 6).bfloat16()
    grad_lse = torch.randn(2, 3, 37)
    whole = (a.float() * b.float()).sum(-1) - grad_lse
    monkeypatch.setattr(module, "TORCH_CHUNK_ELEMENTS", 6 * 10)  # chunks of 10 rows, the last one short
    got = row_delta_torch(a, b, grad_lse)
    assert got.shape == (2, 3, 37) and got.dtype == torch.float32
    torch.testing.assert_close(got, whole, atol=1e-6, rtol=1e-6)


def test_row_delta_refuses_mismatched_shapes():
    a = torch.randn(2, 5, 8)
    with pytest.raises(ValueError, match="row_delta: a"):
        row_delta(a, torch.randn(2, 5, 7), torch.zeros(2, 5))
    with pytest.raises(ValueError, match="grad_lse"):
        row_delta(a, a, torch.zeros(2, 4))


def test_row_delta_op_registration():
    a, b = torch.randn(11, 24, device=DEVICE), torch.randn(11, 24, device=DEVICE)
    torch.library.opcheck(torch.ops.sparsefocus.row_delta.default, (a, b, torch.randn(11, device=DEVICE)))

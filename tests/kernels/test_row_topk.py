"""The short-row top-k kernel against ``top_positions``' PyTorch path: the same positions in the same
order (ties to the smaller position, -0.0 equal to 0.0, -1 past the allowed keys) at odd sizes,
with broadcast masks, empty rows and more picks than keys; the op's registration and compilation."""

import pytest
import torch

from sparsefocus.kernels import row_topk
from sparsefocus.kernels._ops import top_positions

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def torch_path(scores, count, allowed):
    """``top_positions`` computed by PyTorch (it dispatches to the kernel on CUDA only)."""
    return top_positions(scores.cpu(), count, allowed.cpu())


@pytest.mark.parametrize(
    "shape,count,levels",
    [
        ((37,), 5, 0),  # one row
        ((3, 5, 37), 5, 4),  # heavy ties: 4 distinct values
        ((2, 7, 120), 3, 0),  # NSA's block choice in the laboratory
        ((4, 9), 16, 3),  # more picks than keys
        ((65, 1024), 16, 0),  # the longest rows, the most picks
        ((300, 17), 1, 2),  # rows over several programs
    ],
)
def test_row_top_positions_equals_the_torch_selection(shape, count, levels):
    torch.manual_seed(0)
    scores = torch.randn(shape, device=DEVICE)
    if levels:
        scores = torch.randint(-levels, levels, shape, device=DEVICE).float()
    allowed = torch.rand(shape, device=DEVICE) > 0.3
    got = row_topk.row_top_positions(scores, count, allowed)
    assert got.shape == (*shape[:-1], min(count, shape[-1])) and got.dtype == torch.int64
    assert torch.equal(got.cpu(), torch_path(scores, count, allowed))


def test_row_top_positions_takes_broadcast_masks_signed_zeros_and_rows_without_keys():
    scores = torch.tensor([[0.0, -0.0, 1.0, -0.0, 0.0], [2.0, 2.0, -1.0, 3.0, 3.0], [1.0, 2.0, 3.0, 4.0, 5.0]], device=DEVICE)
    causal = torch.tensor([[True, True, True, False, False]], device=DEVICE)  # [1, M] for every row
    got = row_topk.row_top_positions(scores, 4, causal)
    want = torch.tensor([[2, 0, 1, -1], [0, 1, 2, -1], [2, 1, 0, -1]])
    assert torch.equal(got.cpu(), want)
    assert torch.equal(got.cpu(), torch_path(scores, 4, causal))
    nothing = torch.zeros(3, 5, dtype=torch.bool, device=DEVICE)
    assert torch.equal(row_topk.row_top_positions(scores, 2, nothing).cpu(), torch.full((3, 2), -1))


def test_row_top_positions_refuses_rows_it_cannot_hold():
    scores = torch.randn(2, row_topk.MAX_KEYS + 1)
    with pytest.raises(ValueError, match="do not fit"):
        row_topk.row_top_positions(scores, 2, torch.ones_like(scores, dtype=torch.bool))
    assert not row_topk.fits(100, row_topk.MAX_PICKS + 1) and row_topk.fits(8, 100)


def test_row_top_positions_is_a_registered_op_that_compiles():
    scores = torch.randn(6, 23, device=DEVICE)
    allowed = (torch.rand(6, 23, device=DEVICE) > 0.2).to(torch.int8)
    torch.library.opcheck(torch.ops.sparsefocus.row_top_positions.default, (scores, allowed, 4))
    compiled = torch.compile(lambda s, a: row_topk.row_top_positions(s * 2.0, 4, a), fullgraph=True, backend="eager")
    assert torch.equal(compiled(scores, allowed.bool()), row_topk.row_top_positions(scores * 2.0, 4, allowed.bool()))


@pytest.mark.parametrize(
    "spec, impl",
    [
        ("TOPK:5", "lean"),
        ("moba:block=4,top=2,tile=16", "triton"),
        ("quest:block=4,top=2", "lean"),
        ("nsa:block=4,top=3,cmp=4,stride=2,window=4,tile=16", "triton"),
        ("dsa:k=5,heads=2,dim=4", "lean"),
    ],
)
def test_mechanisms_choose_the_same_keys_through_the_kernel(spec, impl, monkeypatch):
    """Every mechanism that ranks through ``top_positions`` gives the same output, bit for bit,
    with its short rows ranked by the kernel as by ``torch.topk``."""
    import sparsefocus as sf
    from sparsefocus.attention.patterns import AUX_KEY, HIDDEN_KEY
    from sparsefocus.kernels import _ops

    pattern = sf.parse_pattern(spec)
    torch.manual_seed(3)
    q, k, v = (torch.randn(2, 2, 37, 8, device=DEVICE) for _ in range(3))
    weights = {name: w.to(DEVICE) for name, w in (pattern.make_layer_parameters(12, 2, 2, 8, 8) or {}).items()}
    params = {**weights, HIDDEN_KEY: torch.randn(2, 37, 12, device=DEVICE), AUX_KEY: {}} if weights else None

    calls = []
    kernel = row_topk.row_top_positions
    monkeypatch.setattr(row_topk, "row_top_positions", lambda *args: calls.append(1) or kernel(*args))

    def output(choice: str) -> torch.Tensor:
        monkeypatch.setattr(_ops, "ROW_TOPK", choice)
        return sf.sparse_attention(q, k, v, pattern, causal=True, impl=impl, params=params)

    assert torch.equal(output("triton"), output("torch"))
    assert calls, "the kernel ranked nothing"

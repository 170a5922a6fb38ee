"""The one-sweep top-k selection (``topk_select.ONE_SWEEP``) where its lists fill: the running cut
rises and masks are dropped, and the positions stay PyTorch's. Every other sweep-kernel test runs
it too (tests/kernels/test_topk_select.py)."""

import pytest
import torch
import triton

from sparsefocus.kernels import topk_select as topk_select_module
from sparsefocus.kernels.topk_select import topk_select_torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize(
    "kk,causal,padded,fold_keys",
    [(3, True, False, 0), (3, True, False, 2048), (8, False, True, 0), (8, False, True, 2048), (32, True, True, 2048)],
)
def test_one_sweep_raises_its_cut_and_drops_masks_as_lists_fill(monkeypatch, kk, causal, padded, fold_keys):
    """A first cut from one 32-key tile and rows of up to 700 keys: lists of 2 * next_pow2(kk)
    masks fill and are compacted several times (the later keys of a row raise its cut), and the
    selection still equals PyTorch's on every row. With column classes folded over these short rows
    (``SWEEP_FOLD_KEYS`` 2048) no row overflows on random data at kk >= 8 (the finish keeps only the
    listed keys at or above the final bound); with the listed masks' bound alone (0), rows whose
    best keys share tiles may overflow and are redone exactly."""
    monkeypatch.setattr(topk_select_module, "SHORT_MAX_M", 0)
    monkeypatch.setattr(topk_select_module, "ONE_SWEEP", True)
    monkeypatch.setattr(topk_select_module, "SWEEP_PRESCAN", 1)
    monkeypatch.setattr(topk_select_module, "SWEEP_FOLD_KEYS", fold_keys)
    q, k = torch.randn(1, 2, 700, 6, device=DEVICE), torch.randn(1, 1, 700, 6, device=DEVICE)
    key_padding_mask = torch.rand(1, 700, device=DEVICE) > 0.1 if padded else None
    out, count = topk_select_module._launch(q, k, kk, causal, key_padding_mask)
    assert torch.equal(out, topk_select_torch(q, k, kk, causal=causal, key_padding_mask=key_padding_mask))
    if kk >= 8 and fold_keys:
        assert (count <= 2 * triton.next_power_of_2(kk)).all()

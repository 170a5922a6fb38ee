"""The analysis hooks hand a mechanism that reads the layer's input (DSA's indexer) its hidden
states, so its selection can be recomputed (before, DSA models could not be analysed)."""

import torch

from sparsefocus.analysis import capture_attention
from sparsefocus.models import Encoder, ModelConfig


def test_a_dsa_layers_selection_is_recomputed_from_its_input():
    torch.manual_seed(0)
    model = Encoder(ModelConfig(blocks=2, dim=16, mlp_dim=16), "dsa:k=3,heads=2,dim=4", vocab_size=5, num_classes=2, max_len=12)
    calls = []
    with torch.no_grad(), capture_attention(model, calls.append):
        model(torch.randint(0, 5, (3, 12)))
    assert len(calls) == 2
    for call in calls:
        kept = call.kept()  # [B, H, N, M]
        assert kept.shape == (3, call.q.shape[1], 12, 12)
        assert (kept.sum(-1) == 3).all()  # k keys per query
        assert call.x is not None and call.x.shape == (3, 12, 16)
        assert not torch.equal(kept[0], kept[1])  # chosen from each input, not a fixed pattern

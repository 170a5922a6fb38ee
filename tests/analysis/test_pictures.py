import torch
from torch import nn

from sparsefocus.analysis.pictures import call_weights, draw_maps, layer_calls, main, pattern_mask
from sparsefocus.layers import SparseAttention


def is_png(path) -> bool:
    data = path.read_bytes()
    return data.startswith(b"\x89PNG") and len(data) > 1000


def test_band_mask_keeps_exactly_k_keys_per_query():
    mask = pattern_mask("BAND:3", 10)
    assert mask.shape == (10, 10)
    assert (mask.sum(1) == 3).all()
    assert mask[0, :3].all() and mask[5, 4:7].all()


def test_input_dependent_masks_follow_the_seed_and_causality():
    a, b = pattern_mask("TOPK:2", 12, seed=1), pattern_mask("TOPK:2", 12, seed=2)
    assert (a.sum(1) == 2).all() and (a != b).any()
    causal = pattern_mask("TOPK:2", 12, causal=True, seed=1)
    assert not (causal & ~torch.ones(12, 12, dtype=torch.bool).tril().numpy()).any()


def test_call_weights_are_the_softmax_over_kept_keys():
    model = nn.Sequential(SparseAttention(8, 2, "TOPK:3"))
    calls = layer_calls(model, torch.randn(2, 9, 8))
    weights = call_weights(calls[0])
    assert weights.shape == (2, 2, 9, 9)
    assert torch.allclose(weights.sum(-1), torch.ones(2, 2, 9))
    kept = calls[0].kept()
    assert (weights[~kept] == 0).all() and (weights[kept] > 0).all()
    scores = calls[0].scores().masked_fill(~kept, float("-inf"))
    assert torch.allclose(weights, scores.softmax(-1), atol=1e-6)


def test_cli_writes_a_png_of_the_masks(tmp_path, capsys):
    out = tmp_path / "masks.png"
    assert main(["TOPK:4", "BAND:5(1)", "BLOC:8", "FULL", "--n", "32", "--causal", "--out", str(out)]) == 0
    assert is_png(out)
    assert main(["NOPE:3", "--out", str(tmp_path / "bad.png")]) == 2
    assert "unknown pattern" in capsys.readouterr().err


def test_attention_maps_figure(tmp_path):
    maps = {"TOPK:3": torch.rand(9, 9).numpy(), "FULL": torch.rand(9, 9).numpy()}
    draw_maps(maps, str(tmp_path / "maps.png"), "title")
    assert is_png(tmp_path / "maps.png")

"""The Semantic Focus code's sequence layout in the encoder: inputs padded to a multiple of k
(``pad_to_multiple_of_k``) and global tokens appended after the padding (``global_tokens="append_paper"``)."""

import pytest
import torch

import sparsefocus as sf
from sparsefocus.attention import parse_pattern
from sparsefocus.models import Decoder, Encoder, ModelConfig
from sparsefocus.models.blocks import padding_mask, sinusoidal_positions
from sparsefocus.models.config import padded_length, padding_multiple

PAD = 2


def paper(**fields) -> ModelConfig:
    defaults = {"blocks": 1, "dim": 8, "mlp_dim": 8, "dropout": 0.0, "paper_mode": True}
    return ModelConfig(**{**defaults, "global_tokens": "append_paper", "pad_to_multiple_of_k": True, **fields})


def block_input(model: Encoder, idx: torch.Tensor) -> torch.Tensor:
    """What the first block receives: [B, N, dim]."""
    seen = []
    handle = model.blocks[0].register_forward_pre_hook(lambda module, args: seen.append(args[0]))
    model(idx)
    handle.remove()
    return seen[0]


def test_padded_lengths_are_multiples_of_k():
    assert padded_length(40, 9) == 45 and padded_length(40, 5) == 40 and padded_length(7, 5) == 10
    assert padding_multiple([parse_pattern("TOPK:9")]) == 9
    assert padding_multiple([parse_pattern("FULL")]) == 1
    assert padding_multiple([parse_pattern("BAND:5(1)"), parse_pattern("BLOC:9")]) == 45


@pytest.mark.parametrize("mechanism,length", [("TOPK:9", 45), ("BAND:9(3)", 48), ("BLOC:5(1)", 41), ("FULL", 40)])
def test_chomsky_length_40_is_padded_to_k_then_the_globals_are_appended(mechanism, length):
    model = Encoder(paper(), mechanism, vocab_size=3, num_classes=2, max_len=40, pad_id=PAD)
    idx = torch.randint(0, 2, (3, 40))
    assert block_input(model, idx).shape == (3, length, 8)
    padded = model.pad(idx)
    assert padded.shape[1] == padded_length(40, padding_multiple(model.patterns))
    assert (padded[:, 40:] == PAD).all() and torch.equal(padded[:, :40], idx)


def test_appended_global_tokens_sit_after_the_padding_with_positions_continuing():
    model = Encoder(paper(), "BLOC:5(1)", vocab_size=3, num_classes=2, max_len=7, pad_id=PAD).eval()
    x = block_input(model, torch.zeros(2, 7, dtype=torch.long))  # 7 tokens -> 10, + 1 global = 11
    scale = 8**0.5
    positions = sinusoidal_positions(11, 8, x.device)
    expected_global = model.embedding.suffix.weight[0] * scale + positions[10]
    expected_pad = model.embedding.tokens.weight[PAD] * scale + positions[7]
    torch.testing.assert_close(x[0, 10], expected_global)
    torch.testing.assert_close(x[0, 7], expected_pad)
    assert model.embedding.prefix is None


def test_the_attention_mask_is_the_papers_bloc_5_1_layout():
    model = Encoder(paper(), "BLOC:5(1)", vocab_size=3, num_classes=2, max_len=7, pad_id=PAD)
    attention = model.blocks[0].attn
    q = torch.zeros(1, 1, 11, 4)
    mask = sf.selection_mask(attention.pattern, q, q, causal=False)[0, 0]
    rows = ["11111000001"] * 5 + ["00000111111"] * 5 + ["11111111111"]
    assert torch.equal(mask, torch.tensor([[c == "1" for c in row] for row in rows]))


def test_clean_mode_pools_over_real_tokens_only_with_the_paper_layout():
    config = paper(paper_mode=False)
    model = Encoder(config, "BAND:5(1)", vocab_size=4, num_classes=2, max_len=7, pad_id=3)
    x = torch.arange(2 * 11 * 8, dtype=torch.float32).reshape(2, 11, 8)
    idx = model.pad(torch.tensor([[0, 1, 2, 0, 1, 3, 3], [1, 1, 1, 1, 1, 1, 1]]))
    mask = padding_mask(idx, 3, model.num_prefix, model.num_suffix)
    pooled = model.pool(x, mask)
    torch.testing.assert_close(pooled[0], x[0, :5].mean(0))
    torch.testing.assert_close(pooled[1], x[1, :7].mean(0))


def test_paper_layout_is_refused_where_it_cannot_hold():
    with pytest.raises(ValueError, match="cannot put its global tokens at the end"):
        Encoder(paper(), "bigbird:3,2,1", vocab_size=3, num_classes=2, max_len=40, pad_id=PAD)
    with pytest.raises(ValueError, match="no CLS token"):
        Encoder(paper(pooling="cls"), "BAND:5(1)", vocab_size=3, num_classes=2, max_len=40, pad_id=PAD)
    with pytest.raises(ValueError, match="needs a pad id"):
        Encoder(paper(), "TOPK:9", vocab_size=3, num_classes=2, max_len=40, pad_id=None)
    with pytest.raises(ValueError, match="set model.global_tokens=append_paper"):
        Encoder(paper(global_tokens="prepend"), "band:5,1,globals_at=end", vocab_size=3, num_classes=2, max_len=40, pad_id=PAD)
    with pytest.raises(ValueError, match="encoder only"):
        Decoder(paper(paper_mode=False), "BAND:5", vocab_size=3, max_len=40)
    with pytest.raises(ValueError, match="model.global_tokens must be one of"):
        ModelConfig(global_tokens="middle").validate()


def test_default_layout_prepends_and_does_not_pad():
    model = Encoder(
        paper(global_tokens="prepend", pad_to_multiple_of_k=False),
        "BAND:9(3)",
        vocab_size=3,
        num_classes=2,
        max_len=40,
        pad_id=PAD,
    )
    assert block_input(model, torch.zeros(2, 40, dtype=torch.long)).shape == (2, 43, 8)
    assert model.patterns[0] == parse_pattern("BAND:9(3)") and model.embedding.suffix is None

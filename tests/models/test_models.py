"""Encoder / decoder: shapes for every registered pattern, padding, causality, paper_mode quirks."""

import pytest
import torch

from sparsefocus.attention import PATTERNS, parse_pattern
from sparsefocus.layers import SparseAttention
from sparsefocus.models import Decoder, Encoder, ModelConfig
from sparsefocus.models.blocks import PaperAttention

LENGTH, VOCAB, CLASSES = 24, 7, 3


def small(**fields) -> ModelConfig:
    return ModelConfig(**{"blocks": 2, "heads": 2, "dim": 16, "mlp_dim": 24, "dropout": 0.0, "impl": "reference", **fields})


def fitting_length(pattern, causal: bool) -> int | None:
    """The first candidate length that the pattern accepts (2-D patterns need height x width)."""
    for length in (LENGTH, 40, 63):
        n = length + pattern.num_global_tokens
        try:
            pattern.check_sizes(n, n, causal)
            return length
        except ValueError:
            continue
    return None


def fitting_examples(causal: bool) -> list[tuple[str, int]]:
    """(example, length) for every registered pattern's examples that fit one of the lengths."""
    out = []
    for cls in PATTERNS.values():
        for example in cls.examples:
            length = fitting_length(parse_pattern(example), causal)
            if length is not None:
                out.append((example, length))
    return out


@pytest.mark.parametrize("example,length", fitting_examples(causal=False))
def test_encoder_gives_one_logit_row_per_sequence_for_every_pattern(example, length):
    config = small(blocks=1, dim=8, mlp_dim=8)
    model = Encoder(config, example, vocab_size=VOCAB, num_classes=CLASSES, max_len=length, pad_id=0)
    idx = torch.randint(1, VOCAB, (2, length))
    idx[0, -5:] = 0
    logits = model(idx)
    assert logits.shape == (2, CLASSES)
    assert torch.isfinite(logits).all()
    logits.sum().backward()


@pytest.mark.parametrize("example,length", fitting_examples(causal=True))
def test_decoder_gives_next_token_logits_for_every_causal_pattern(example, length):
    model = Decoder(small(blocks=1, dim=8, mlp_dim=8, positions="learned"), example, vocab_size=VOCAB, max_len=length)
    logits = model(torch.randint(0, VOCAB, (2, length)))
    assert logits.shape == (2, length, VOCAB)
    assert torch.isfinite(logits).all()


def test_every_registered_pattern_has_a_fitting_example():
    names = {parse_pattern(e).name for e, _ in fitting_examples(causal=False)}
    assert names == set(PATTERNS)


@pytest.mark.parametrize("mechanism", ["FULL", "TOPK:3", "BAND:5(1)"])
def test_decoder_logits_do_not_depend_on_future_tokens(mechanism):
    model = Decoder(small(), mechanism, vocab_size=VOCAB, max_len=LENGTH).eval()
    idx = torch.randint(0, VOCAB, (2, LENGTH))
    changed = idx.clone()
    changed[:, 15:] = (changed[:, 15:] + 1) % VOCAB
    torch.testing.assert_close(model(idx)[:, :15], model(changed)[:, :15])


@pytest.mark.parametrize("mechanism", ["FULL", "TOPK:3", "BLOC:4(2)"])
def test_clean_encoder_ignores_padding(mechanism):
    """Padded keys are masked and pooling averages real tokens only, so padding changes nothing."""
    model = Encoder(small(), mechanism, vocab_size=VOCAB, num_classes=CLASSES, max_len=LENGTH, pad_id=0).eval()
    idx = torch.randint(1, VOCAB, (1, 16))
    padded = torch.cat([idx, torch.zeros(1, 8, dtype=torch.long)], dim=1)
    torch.testing.assert_close(model(idx), model(padded))


def test_paper_mode_attends_to_padding_and_pools_over_it():
    model = Encoder(small(paper_mode=True), "FULL", vocab_size=VOCAB, num_classes=CLASSES, max_len=LENGTH, pad_id=0)
    model.eval()
    idx = torch.randint(1, VOCAB, (1, 16))
    padded = torch.cat([idx, torch.zeros(1, 8, dtype=torch.long)], dim=1)
    assert not torch.allclose(model(idx), model(padded))


def test_paper_mode_structure_matches_the_papers_code():
    model = Encoder(small(paper_mode=True), "TOPK:5", vocab_size=VOCAB, num_classes=CLASSES, max_len=LENGTH)
    first, second = model.blocks
    assert isinstance(first.attn, PaperAttention)
    assert first.attn.q_proj.weight.shape == (2 * 16, 16)  # every head has the full width d
    assert first.attn_norm.eps == 0.0 and second.attn_norm.eps == 1e-5
    assert first.attn_norm.weight is None and first.mlp_norm.weight is None
    assert model.embedding.tokens.weight.abs().max() <= 0.1
    assert model.classifier.weight.abs().max() <= 0.1 and not model.classifier.bias.any()
    assert model.embedding.scale == 4.0


def test_paper_mode_attention_dropout_stays_on_in_eval():
    idx = torch.randint(0, VOCAB, (2, LENGTH))
    paper = Encoder(small(paper_mode=True, dropout=0.3), "FULL", vocab_size=VOCAB, num_classes=CLASSES, max_len=LENGTH).eval()
    clean = Encoder(small(dropout=0.3), "FULL", vocab_size=VOCAB, num_classes=CLASSES, max_len=LENGTH).eval()
    assert not torch.equal(paper(idx), paper(idx))
    assert torch.equal(clean(idx), clean(idx))


@pytest.mark.parametrize("mechanism", ["FULL", "TOPK:3", "BAND:5(1)", "BLOC:4"])
def test_paper_attention_equals_sparse_attention_without_dropout(mechanism):
    torch.manual_seed(0)
    layer = SparseAttention(16, 2, mechanism, head_dim=16, impl="reference")
    paper = PaperAttention(16, 2, mechanism, head_dim=16, attention_dropout=0.0)
    paper.load_state_dict(layer.state_dict())
    x = torch.randn(2, 13, 16)
    torch.testing.assert_close(paper(x), layer(x), rtol=1e-5, atol=1e-5)


def test_global_tokens_are_prepended_for_patterns_that_ask():
    model = Encoder(small(), ["BAND:5(2)", "BLOC:4(1)"], vocab_size=VOCAB, num_classes=CLASSES, max_len=LENGTH)
    assert model.num_global_tokens == 2 and model.embedding.prefix.weight.shape == (2, 16)
    assert [p.label() for p in model.patterns] == ["BAND:5(2)", "BLOC:4(1)"]
    assert model(torch.randint(0, VOCAB, (2, LENGTH))).shape == (2, CLASSES)


@pytest.mark.parametrize("activation", ["relu", "gelu", "mish"])
def test_cls_pooling_and_activations(activation):
    model = Encoder(
        small(pooling="cls", activation=activation), "BAND:3(1)", vocab_size=VOCAB, num_classes=CLASSES, max_len=LENGTH
    )
    assert model.num_prefix == 2
    assert model(torch.randint(0, VOCAB, (2, LENGTH))).shape == (2, CLASSES)


def test_bad_model_configs_name_the_key():
    with pytest.raises(ValueError, match="model.heads"):
        Encoder(small(heads=3), "FULL", vocab_size=VOCAB, num_classes=CLASSES, max_len=LENGTH)
    with pytest.raises(ValueError, match="model.activation"):
        Encoder(small(activation="tanh"), "FULL", vocab_size=VOCAB, num_classes=CLASSES, max_len=LENGTH)
    with pytest.raises(ValueError, match="needs 2 patterns"):
        Encoder(small(), ["FULL"], vocab_size=VOCAB, num_classes=CLASSES, max_len=LENGTH)

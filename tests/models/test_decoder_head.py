"""Decoder head options that MQAR at V=8192 needs: tied embeddings, small init, scored-only logits."""

import torch

from sparsefocus.models import Decoder, ModelConfig

VOCAB, LENGTH = 50, 12


def small(**fields) -> ModelConfig:
    return ModelConfig(**{"blocks": 2, "heads": 2, "dim": 16, "mlp_dim": 24, "dropout": 0.0, "impl": "reference", **fields})


def test_tied_head_is_the_token_embedding_and_trains_as_one_matrix():
    torch.manual_seed(0)
    tied = Decoder(small(tie_embeddings=True, init_std=0.02), "FULL", vocab_size=VOCAB, max_len=LENGTH)
    untied = Decoder(small(), "FULL", vocab_size=VOCAB, max_len=LENGTH)
    assert tied.head.weight is tied.embedding.tokens.weight
    assert untied.num_parameters() - tied.num_parameters() == VOCAB * 16
    idx = torch.randint(0, VOCAB, (3, LENGTH))
    tied(idx)[:, -1, 7].sum().backward()  # the head's row 7 gets a gradient even if id 7 is absent
    assert tied.embedding.tokens.weight.grad[7].abs().sum() > 0


def test_init_std_draws_weights_from_a_small_normal_and_leaves_pattern_parameters():
    torch.manual_seed(0)
    model = Decoder(
        small(dim=64, init_std=0.02), "zeta:k=4,window=6,chunks=3,local=3,gamma=0.3", vocab_size=VOCAB, max_len=LENGTH
    )
    assert abs(float(model.embedding.tokens.weight.detach().std()) - 0.02) < 0.003
    assert abs(float(model.blocks[0].mlp.up.weight.detach().std()) - 0.02) < 0.003
    assert float(model.blocks[0].attn.q_proj.bias.detach().abs().max()) == 0.0
    assert torch.equal(model.blocks[1].attn.mechanism["gamma"].detach(), torch.full((2,), 0.3))
    default = Decoder(small(dim=64), "FULL", vocab_size=VOCAB, max_len=LENGTH)
    assert float(default.embedding.tokens.weight.detach().std()) > 0.5  # torch's N(0, 1) when init_std is 0


def test_scored_logits_are_the_full_logits_at_the_scored_positions():
    torch.manual_seed(0)
    model = Decoder(small(tie_embeddings=True, init_std=0.02), "FULL", vocab_size=VOCAB, max_len=LENGTH).eval()
    idx = torch.randint(0, VOCAB, (3, LENGTH))
    scored = torch.rand(3, LENGTH) < 0.3  # [3, L]
    torch.testing.assert_close(model(idx, scored), model(idx)[scored])

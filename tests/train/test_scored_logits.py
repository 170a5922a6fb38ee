"""The loop scores a Decoder only where targets are set: same loss and counts as the full logits."""

import torch

from sparsefocus.models import Decoder, ModelConfig
from sparsefocus.tasks import build_task
from sparsefocus.train.loop import loss_and_counts, scored_logits


def test_scored_logits_give_the_loss_and_counts_of_the_full_logits():
    data = build_task("mqar", 0, vocab_size=64, seq_len=32, num_kv_pairs=4, num_train=6, num_valid=1)
    torch.manual_seed(0)
    config = ModelConfig(blocks=1, heads=1, dim=16, mlp_dim=16, dropout=0.0, positions="learned", impl="reference")
    model = Decoder(config, "FULL", vocab_size=64, max_len=32).eval()
    inputs, targets = data.train_inputs, data.train_targets  # [6, 32], -100 off the 4 queries
    logits, kept = scored_logits(model, inputs, targets)
    assert logits.shape == (6 * 4, 64) and bool((kept != -100).all())
    loss, correct, scored = loss_and_counts(logits, kept)
    full_loss, full_correct, full_scored = loss_and_counts(model(inputs), targets)
    torch.testing.assert_close(loss, full_loss)
    assert (correct, scored) == (full_correct, full_scored) and scored == 24

"""experiments/mqar_zeta.yaml (issue 5's MQAR target) is valid, and its held-out accuracy is the
accuracy over the query positions only."""

from pathlib import Path

import torch

from sparsefocus.tasks import build_task
from sparsefocus.train.config import load_config
from sparsefocus.train.experiment import check_experiment
from sparsefocus.train.loop import loss_and_counts

CONFIG = Path(__file__).resolve().parents[2] / "experiments" / "mqar_zeta.yaml"


def test_mqar_zeta_config_is_the_fig2_256_preset_and_passes_the_checks():
    config = load_config(CONFIG, ["task.num_train=50", "task.num_valid=10"])
    check_experiment(config)  # builds the task and checks every mechanism against L=256
    data = build_task("mqar", 0, **{k: v for k, v in config.task.items() if k != "name"})
    assert data.seq_len == 256 and data.info["config"]["num_kv_pairs"] == 16 and data.vocab_size == 8192
    assert any(str(m).startswith("zeta") for m in config.mechanisms) and "FULL" in config.mechanisms


def test_accuracy_counts_exactly_the_sixteen_query_positions_per_sequence():
    data = build_task("mqar", 0, preset="fig2_256", vocab_size=512, num_train=4, num_valid=1)
    targets = data.train_targets  # [4, 256], -100 off the queries
    logits = torch.full((*targets.shape, 512), -10.0)
    logits[..., 0] = 0.0  # predicts id 0 everywhere: wrong on every query
    query = targets != -100
    first_query_of_each_row = query.float().argmax(-1)  # [4]
    rows = torch.arange(4)
    logits[rows, first_query_of_each_row, targets[rows, first_query_of_each_row]] = 10.0  # one right per row
    _, correct, scored = loss_and_counts(logits, targets)
    assert scored == 4 * 16 and correct == 4

"""``train.tensorboard=true``: each run's metrics also go to TensorBoard event files in its folder."""

import json

import pytest

pytest.importorskip("tensorboard")

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from sparsefocus.train.config import load_config
from sparsefocus.train.experiment import run_experiment
from sparsefocus.train.tensorboard import scalar_tag

TINY = [
    "task={name: parity, length: 12, num_train: 60, num_valid: 30}",
    "model.blocks=1",
    "model.dim=16",
    "model.mlp_dim=16",
    "model.impl=reference",
    "optim.name=adamw",
    "optim.lr=0.003",
    "train.batch_size=20",
    "seeds=[1]",
    "mechanisms=[TOPK:3]",
]


def _config(tmp_path, *overrides):
    return load_config(None, [f"out_dir={tmp_path}", "name=exp", *TINY, *overrides])


def _scalars(run_dir):
    events = EventAccumulator(str(run_dir))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def _run_dir(tmp_path):
    (metrics,) = tmp_path.glob("exp/**/metrics.jsonl")
    return metrics.parent


def test_event_files_hold_every_metric_of_every_epoch(tmp_path):
    run_experiment(_config(tmp_path, "train.epochs=3", "train.tensorboard=true"), quiet=True)
    run_dir = _run_dir(tmp_path)
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    scalars = _scalars(run_dir)
    assert {"train/loss", "train/acc", "valid/loss", "valid/acc", "lr", "time/epoch_seconds"} <= set(scalars)
    for key in ("train_loss", "valid_acc", "lr", "seconds"):
        logged = scalars[scalar_tag(key)]
        assert [step for step, _ in logged] == [1, 2, 3]
        assert [value for _, value in logged] == pytest.approx([line[key] for line in lines], rel=1e-6)


def test_resumed_runs_log_each_epoch_once(tmp_path, monkeypatch):
    """Killed after epoch 3 with a checkpoint at epoch 2: the resumed run redoes epoch 3, and the
    events of the first attempt's epoch 3 are purged."""
    import sparsefocus.train.experiment as experiment_module
    from sparsefocus.train.loop import train_run

    config = _config(tmp_path, "train.epochs=4", "train.checkpoint_every=2", "train.tensorboard=true")
    epochs = []

    def interrupted(spec, on_epoch=None):
        def count():
            epochs.append(1)
            if len(epochs) == 3:
                raise KeyboardInterrupt

        return train_run(spec, on_epoch=count)

    monkeypatch.setattr(experiment_module, "train_run", interrupted)
    with pytest.raises(KeyboardInterrupt):
        run_experiment(config, quiet=True)
    assert [step for step, _ in _scalars(_run_dir(tmp_path))["valid/loss"]] == [1, 2, 3]
    monkeypatch.undo()
    run_experiment(config, quiet=True)
    lines = [json.loads(line) for line in (_run_dir(tmp_path) / "metrics.jsonl").read_text().splitlines()]
    logged = _scalars(_run_dir(tmp_path))["valid/loss"]
    assert [step for step, _ in logged] == [1, 2, 3, 4]
    assert [value for _, value in logged] == pytest.approx([line["valid_loss"] for line in lines], rel=1e-6)


def test_no_event_files_without_the_option(tmp_path):
    run_experiment(_config(tmp_path, "train.epochs=1"), quiet=True)
    assert not list(_run_dir(tmp_path).glob("events.out.tfevents.*"))


def test_tags():
    assert [scalar_tag(k) for k in ("train_loss", "valid_ppl", "test_acc", "lr", "seconds")] == [
        "train/loss",
        "valid/ppl",
        "test/acc",
        "lr",
        "time/epoch_seconds",
    ]

"""Training runs: loss decreases on every task, resume after interruption, broken checkpoints,
reports, the schedules and the paper's speed-up statistic."""

import json
import math

import numpy as np
import pytest
import torch

import sparsefocus.train.experiment as experiment_module
from sparsefocus.tasks.base import TASKS, _load_all
from sparsefocus.tasks.corpus import CorpusNotFoundError
from sparsefocus.train import commands
from sparsefocus.train.checkpoint import CheckpointError
from sparsefocus.train.config import OptimConfig, load_config
from sparsefocus.train.experiment import run_experiment
from sparsefocus.train.loop import RunSpec, build_data, build_model, evaluate, lr_factor, train_run
from sparsefocus.train.report import epochs_to_reach, paper_speedup, write_report

TINY = [
    "task={name: parity, length: 12, num_train: 60, num_valid: 30}",
    "model.blocks=1",
    "model.dim=16",
    "model.mlp_dim=16",
    "model.impl=reference",
    "optim.name=adamw",
    "optim.lr=0.003",
    "train.epochs=3",
    "train.batch_size=20",
    "seeds=[1]",
]

# Small sizes per task; the real-text tasks are skipped only when the Brown corpus is not cached.
# Their test split is capped too: every epoch scores it (test perplexity), and Brown's whole test
# split is thousands of blocks, each through the 4096-way head.
TASK_SIZES = {
    "listops": {
        "preset": "lra",
        "max_depth": 3,
        "max_args": 3,
        "min_length": 10,
        "max_length": 40,
        "num_train": 64,
        "num_valid": 16,
    },
    "lm": {"max_train": 64, "max_valid": 16, "max_test": 16, "block_size": 32},
    "lm_window": {"max_train": 64, "max_valid": 16, "max_test": 16},
    "mqar": {"vocab_size": 32, "seq_len": 16, "num_kv_pairs": 2, "num_train": 64, "num_valid": 16},
    "assoc_recall": {"num_pairs": 4, "num_keys": 8, "num_values": 8, "num_train": 64, "num_valid": 16},
}


def tiny(tmp_path, *overrides):
    return load_config(None, [f"out_dir={tmp_path}", "name=exp", *TINY, *overrides])


def task_names():
    _load_all()
    return sorted(TASKS)


@pytest.mark.parametrize("name", task_names())
def test_training_lowers_the_training_loss_on_every_task(name, tmp_path):
    fields = TASK_SIZES.get(name, {"length": 12, "num_train": 64, "num_valid": 16})
    overrides = [f"task={json.dumps({'name': name, **fields})}", "train.epochs=6", "optim.lr=0.01", "optim.grad_clip=1.0"]
    config = tiny(tmp_path, *overrides)
    try:
        data = build_data(config, 1, torch.device("cpu"))
    except CorpusNotFoundError as error:
        pytest.skip(f"{name} needs the Brown corpus, which is not cached here (.ci/run fetches it): {error}")
    torch.manual_seed(1)
    before, _ = evaluate(build_model(config.model, "TOPK:3", data), data.train_inputs, data.train_targets, 64)
    metrics = train_run(RunSpec(tmp_path / "run", config, "default", "TOPK:3", 1))
    assert len(metrics) == 6
    assert metrics[-1]["train_loss"] < 0.97 * before


def test_interrupted_experiment_resumes_without_retraining_finished_runs(tmp_path, monkeypatch):
    config = tiny(tmp_path, "mechanisms=[FULL,TOPK:3]")
    calls = []

    def interrupted(spec, on_epoch=None):
        calls.append(spec.label)
        if spec.label == "TOPK:3":

            def stop():
                raise KeyboardInterrupt

            return train_run(spec, on_epoch=stop)  # killed after its first epoch
        return train_run(spec, on_epoch)

    monkeypatch.setattr(experiment_module, "train_run", interrupted)
    with pytest.raises(KeyboardInterrupt):
        run_experiment(config, quiet=True)
    first = tmp_path / "exp/default/FULL/seed-1/checkpoint.pt"
    first_bytes = first.read_bytes()

    calls.clear()
    monkeypatch.setattr(
        experiment_module, "train_run", lambda spec, on_epoch=None: calls.append(spec.label) or train_run(spec, on_epoch)
    )
    run_experiment(config, quiet=True)
    assert calls == ["TOPK:3"]
    assert first.read_bytes() == first_bytes
    resumed = [json.loads(line) for line in (tmp_path / "exp/default/TOPK-3/seed-1/metrics.jsonl").read_text().splitlines()]

    fresh = train_run(RunSpec(tmp_path / "fresh", config, "default", "TOPK:3", 1))
    assert [m["epoch"] for m in resumed] == [1, 2, 3]
    for a, b in zip(resumed, fresh):
        assert a["train_loss"] == pytest.approx(b["train_loss"], rel=1e-5)


@pytest.mark.parametrize("damage", ["corrupt", "missing"])
def test_broken_checkpoint_is_reported_not_retrained(tmp_path, damage):
    config = tiny(tmp_path, "train.epochs=1")
    run_experiment(config, quiet=True)
    checkpoint = tmp_path / "exp/default/FULL/seed-1/checkpoint.pt"
    if damage == "corrupt":
        checkpoint.write_bytes(b"not a checkpoint")
    else:
        checkpoint.unlink()
    with pytest.raises(CheckpointError, match=f"{damage} checkpoint .*FULL/seed-1"):
        run_experiment(config, quiet=True)


def test_changed_config_for_an_existing_run_folder_is_refused(tmp_path):
    run_experiment(tiny(tmp_path, "train.epochs=1"), quiet=True)
    with pytest.raises(ValueError, match="model.dim"):
        run_experiment(tiny(tmp_path, "train.epochs=1", "model.dim=8"), quiet=True)


def test_train_command_writes_runs_report_and_curves(tmp_path, capsys):
    overrides = [f"out_dir={tmp_path}", "name=exp", *TINY, "mechanisms=[FULL,TOPK:3,BAND:3(1)]", "seeds=[1,2]", "train.epochs=2"]
    assert commands.main(["defaults", *overrides]) == 0
    out = capsys.readouterr().out
    report = tmp_path / "exp/report.md"
    assert str(report) in out and (tmp_path / "exp/curves.png").stat().st_size > 1000
    text = report.read_text()
    for label in ("FULL", "TOPK:3", "BAND:3(1)"):
        assert f"| {label} | 2 |" in text
    assert "speed-up over FULL" in text and "paper's max speed-up" in text
    metrics = (tmp_path / "exp/default/BAND-3-1/seed-2/metrics.jsonl").read_text().splitlines()
    assert len(metrics) == 2 and set(json.loads(metrics[0])) >= {"train_loss", "valid_loss", "valid_acc"}


def test_train_command_reports_a_bad_key_without_training(tmp_path, capsys):
    assert commands.main(["defaults", f"out_dir={tmp_path}", "model.widht=3"]) == 2
    captured = capsys.readouterr()
    assert "model.widht" in captured.err and captured.out == ""
    assert not any(tmp_path.iterdir())


def test_parallel_jobs_train_every_run(tmp_path):
    root = run_experiment(tiny(tmp_path, "mechanisms=[FULL,BLOC:4]", "train.jobs=2", "train.epochs=1"), quiet=True)
    report, pictures = write_report(root)
    assert "| BLOC:4 | 1 |" in report.read_text() and pictures[0].exists()


def test_step_schedule_decays_once_per_epoch_and_cosine_ends_at_the_floor():
    step = OptimConfig(schedule="step", decay=0.5)
    assert [lr_factor(step, s, 10, 3) for s in (0, 9, 10, 25)] == [1.0, 1.0, 0.5, 0.25]
    cosine = OptimConfig(schedule="cosine", warmup_epochs=1, min_lr_ratio=0.1)
    assert lr_factor(cosine, 4, 10, 3) == pytest.approx(0.5)
    assert lr_factor(cosine, 10, 10, 3) == pytest.approx(1.0)
    assert lr_factor(cosine, 30, 10, 3) == pytest.approx(0.1)


def test_paper_speedup_statistic_on_hand_made_curves():
    full = np.array([4.0, 3.0, 2.0, 1.0])
    topk = np.array([3.0, 2.0, 1.0, 0.5])
    stats = paper_speedup(full, topk)
    # epoch i=3 (0-based): v1=1.0, topk below it at j in {2}: 100*1/4; i=2: v1=2, j in {1}: 100*1/3;
    # i=1: v1=3, j in {0}: 100*1/2 -> max 50% at epoch 2.
    assert stats["max_speedup"] == pytest.approx(50.0) and stats["max_speedup_epoch"] == 2
    assert stats["max_gap"] == pytest.approx(1.0)
    assert stats["max_relative_gap"] == pytest.approx(50.0)
    assert epochs_to_reach(topk, 1.0) == 3 and epochs_to_reach(full, 0.5) is None
    assert math.isclose(paper_speedup(full, full)["max_gap"], 0.0)


def test_demo_trains_its_four_mechanisms_and_prints_the_report(tmp_path, capsys):
    from sparsefocus.train import demo

    argv = ["--out", str(tmp_path), "--seeds", "1", "--jobs", "1", "train.epochs=1", "task.num_train=50", "task.num_valid=20"]
    assert demo.main(argv) == 0
    out = capsys.readouterr().out
    report = tmp_path / "demo/report.md"
    assert f"report: {report}" in out and (tmp_path / "demo/curves.png").exists()
    text = report.read_text()
    assert "Wall-clock time measured by the trainer" in text and "in 1 invocation that trained" in text
    for label in ("FULL", "TOPK:5", "BAND:5(1)", "BLOC:5(1)"):
        assert f"| {label} | 1 |" in text


def _drop_key(record_path, section: str, key: str) -> None:
    import yaml

    record = yaml.safe_load(record_path.read_text())
    del record["config"][section][key]
    record_path.write_text(yaml.safe_dump(record, sort_keys=False))


def test_a_folder_written_before_a_key_existed_resumes_at_its_default(tmp_path):
    """A config.yaml that lacks a key added later (here train.shuffle and model.pad_to_multiple_of_k)
    is the default's behaviour: the run resumes; a non-default value for that key is refused."""
    from sparsefocus.train.loop import check_run_folder

    config = tiny(tmp_path, "mechanisms=[FULL]", "train.epochs=1")
    run_experiment(config, quiet=True)
    record = tmp_path / "exp/default/FULL/seed-1/config.yaml"
    _drop_key(record, "train", "shuffle")
    _drop_key(record, "model", "pad_to_multiple_of_k")
    spec = RunSpec(record.parent, config, "default", "FULL", 1)
    assert check_run_folder(spec) == ("done", 1)
    changed = RunSpec(
        record.parent, tiny(tmp_path, "mechanisms=[FULL]", "train.epochs=1", "train.shuffle=false"), "default", "FULL", 1
    )
    with pytest.raises(ValueError, match="train.shuffle=None, the config now says False"):
        check_run_folder(changed)


@pytest.mark.parametrize(
    "key, value, mode",
    [
        ("train.checkpoint_every", 3, "exact"),
        ("train.concurrent_groups", 2, "exact"),
        ("train.topk_select", "triton", "exact"),
        ("train.fast_attention", "lists", "fast"),
    ],
)
def test_keys_that_do_not_change_results_may_change_between_calls(key, value, mode, tmp_path):
    from sparsefocus.train.loop import check_run_folder

    base = ["mechanisms=[FULL]", "train.epochs=1", "train.batched=true", f"train.batched_mode={mode}", "train.compile=eager"]
    run_experiment(tiny(tmp_path, *base), quiet=True)
    again = tiny(tmp_path, *base, f"{key}={value}")
    assert check_run_folder(RunSpec(tmp_path / "exp/default/FULL/seed-1", again, "default", "FULL", 1)) == ("done", 1)
    other = tiny(tmp_path, *base, "train.batch_size=3")
    with pytest.raises(ValueError, match="train.batch_size"):
        check_run_folder(RunSpec(tmp_path / "exp/default/FULL/seed-1", other, "default", "FULL", 1))


def test_a_study_trained_in_parts_resumes_under_the_whole_grid(tmp_path):
    """A run folder made by a config listing fewer mechanisms and seeds is the same run under the
    whole grid: it is finished there, and only the other runs train."""
    from sparsefocus.train.loop import check_run_folder

    run_experiment(tiny(tmp_path, "mechanisms=[FULL]", "seeds=[1]", "train.epochs=1"), quiet=True)
    whole = tiny(tmp_path, 'mechanisms=[FULL, "TOPK:3"]', "seeds=[1, 2]", "train.epochs=1")
    first = tmp_path / "exp/default/FULL/seed-1"
    assert check_run_folder(RunSpec(first, whole, "default", "FULL", 1)) == ("done", 1)
    before = (first / "metrics.jsonl").read_text()
    run_experiment(whole, quiet=True)
    assert (first / "metrics.jsonl").read_text() == before
    assert sorted(
        p.parent.relative_to(tmp_path / "exp").as_posix() for p in (tmp_path / "exp").glob("*/*/seed-*/metrics.jsonl")
    ) == [
        "default/FULL/seed-1",
        "default/FULL/seed-2",
        "default/TOPK-3/seed-1",
        "default/TOPK-3/seed-2",
    ]


def test_training_adds_the_dsa_indexer_loss(tmp_path):
    """DSA's indexer is reached only through its auxiliary loss (the selection has no gradient):
    the training loop adds it, so the indexer weights move; the logged loss is the task's."""
    from sparsefocus.layers import SparseAttention

    config = tiny(tmp_path, "mechanisms=['dsa:k=5,heads=2,dim=4']", "train.epochs=1", "model.paper_mode=false")
    data = build_data(config, 1, torch.device("cpu"))
    torch.manual_seed(1)
    before = build_model(config.model, "dsa:k=5,heads=2,dim=4", data)
    names = [n for n, _ in before.named_parameters() if "dsa_" in n]
    assert names and any(isinstance(m, SparseAttention) for m in before.modules())
    spec = RunSpec(tmp_path / "run", config, "default", "dsa:k=5,heads=2,dim=4", 1)
    train_run(spec)
    after = torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=False)["model"]
    initial = dict(before.named_parameters())
    assert all(not torch.equal(after[n], initial[n].detach()) for n in names)


def test_slimmed_finished_runs_count_as_finished_and_refuse_analysis(tmp_path):
    """Slimming keeps a finished run's metrics and its 'finished' state in a small checkpoint:
    the experiment resumes past it and reports it; loading its weights is refused by name;
    unfinished runs and the kept seeds are left whole."""
    from sparsefocus.analysis.runs import load_run
    from sparsefocus.train.checkpoint import CheckpointError, load_checkpoint
    from sparsefocus.train.experiment import slim_finished_runs
    from sparsefocus.train.report import write_report

    config = tiny(tmp_path, "mechanisms=[FULL]", "seeds=[1, 2]", "train.epochs=2")
    root = run_experiment(config, quiet=True)
    runs = {seed: root / "default/FULL" / f"seed-{seed}" for seed in (1, 2)}
    before = {seed: (run / "metrics.jsonl").read_text() for seed, run in runs.items()}
    size = (runs[1] / "checkpoint.pt").stat().st_size
    assert slim_finished_runs(root, keep_seeds=(2,)) == [runs[1] / "checkpoint.pt"]
    assert slim_finished_runs(root) == [runs[2] / "checkpoint.pt"]
    assert slim_finished_runs(root) == []  # already slim
    assert (runs[1] / "checkpoint.pt").stat().st_size < size / 4
    state = load_checkpoint(runs[1] / "checkpoint.pt")
    assert state["finished"] and state["epoch"] == 2 and len(state["metrics"]) == 2
    run_experiment(config, quiet=True)  # nothing left to train
    assert {seed: (run / "metrics.jsonl").read_text() for seed, run in runs.items()} == before
    report, _ = write_report(root)
    assert "Left out" not in report.read_text()
    with pytest.raises(CheckpointError, match="metrics only"):
        load_run(runs[1])


def test_unfinished_runs_are_not_slimmed(tmp_path):
    from sparsefocus.train.checkpoint import save_checkpoint
    from sparsefocus.train.experiment import slim_finished_runs

    root = run_experiment(tiny(tmp_path, "mechanisms=[FULL]", "train.epochs=1"), quiet=True)
    path = root / "default/FULL/seed-1/checkpoint.pt"
    state = torch.load(path, weights_only=True)
    save_checkpoint(path, {**state, "finished": False})
    assert slim_finished_runs(root) == []
    assert "model" in torch.load(path, weights_only=True)


def _losses(run_dir) -> list[tuple[float, float]]:
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(m["train_loss"], m["valid_loss"]) for m in lines]


@pytest.mark.parametrize("batched", [False, True])
def test_a_finished_run_continues_to_more_epochs_as_if_trained_to_them_at_once(batched, tmp_path):
    """A config asking finished runs for more epochs (step schedule) continues them from their
    checkpoints: their metrics equal those of runs trained to the larger total at once, and
    config.yaml records the new total."""
    import yaml

    from sparsefocus.train.loop import check_run_folder

    base = ["mechanisms=[FULL]", "seeds=[1, 2]", f"train.batched={str(batched).lower()}", "train.compile=eager"]
    run_experiment(tiny(tmp_path / "parts", *base, "train.epochs=2"), quiet=True)
    longer = tiny(tmp_path / "parts", *base, "train.epochs=4")
    run = tmp_path / "parts/exp/default/FULL/seed-2"
    assert check_run_folder(RunSpec(run, longer, "default", "FULL", 2)) == ("partial", 2)
    run_experiment(longer, quiet=True)
    run_experiment(tiny(tmp_path / "whole", *base, "train.epochs=4"), quiet=True)
    for seed in (1, 2):
        extended = tmp_path / f"parts/exp/default/FULL/seed-{seed}"
        straight = _losses(tmp_path / f"whole/exp/default/FULL/seed-{seed}")
        assert len(_losses(extended)) == 4
        for got, want in zip(_losses(extended), straight, strict=True):
            assert got == pytest.approx(want, rel=1e-5)
    assert yaml.safe_load((run / "config.yaml").read_text())["config"]["train"]["epochs"] == 4
    assert check_run_folder(RunSpec(run, longer, "default", "FULL", 2)) == ("done", 4)


def test_more_epochs_are_refused_where_they_would_change_the_run(tmp_path):
    """A cosine schedule depends on the total, fewer epochs cannot undo training, and a slimmed
    run has no weights to continue from: each is refused, naming the reason."""
    from sparsefocus.train.experiment import slim_finished_runs
    from sparsefocus.train.loop import check_run_folder

    run_experiment(tiny(tmp_path / "cos", "mechanisms=[FULL]", "optim.schedule=cosine", "train.epochs=1"), quiet=True)
    cosine = tiny(tmp_path / "cos", "mechanisms=[FULL]", "optim.schedule=cosine", "train.epochs=2")
    with pytest.raises(ValueError, match="train.epochs=1, the config now says 2"):
        check_run_folder(RunSpec(tmp_path / "cos/exp/default/FULL/seed-1", cosine, "default", "FULL", 1))
    run_experiment(tiny(tmp_path / "step", "mechanisms=[FULL]", "train.epochs=2"), quiet=True)
    fewer = tiny(tmp_path / "step", "mechanisms=[FULL]", "train.epochs=1")
    with pytest.raises(ValueError, match="train.epochs=2, the config now says 1"):
        check_run_folder(RunSpec(tmp_path / "step/exp/default/FULL/seed-1", fewer, "default", "FULL", 1))
    slim_finished_runs(tmp_path / "step/exp")
    with pytest.raises(CheckpointError, match="slimmed .* cannot continue to 3"):
        run_experiment(tiny(tmp_path / "step", "mechanisms=[FULL]", "train.epochs=3"), quiet=True)

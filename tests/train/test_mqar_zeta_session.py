"""benchmarks/mqar_zeta_session.py: a call's flat copies restore the run folders, and training
resumes from them where the previous call stopped."""

import json
from pathlib import Path

import pytest
import yaml

from sparsefocus.train.config import load_config
from sparsefocus.train.experiment import check_experiment, plan, run_experiment
from sparsefocus.train.loop import check_run_folder, train_run

ROOT = Path(__file__).resolve().parents[2]
TINY = [
    "task.vocab_size=64",
    "task.seq_len=32",
    "task.num_kv_pairs=4",
    "task.num_train=64",
    "task.num_valid=16",
    "model.dim=16",
    "model.heads=1",
    "model.mlp_dim=16",
    "model.impl=reference",
    "train.batch_size=32",
    "train.epochs=2",
    "train.device=cpu",
    "train.jobs=1",
    "train.threads=1",
    "mechanisms=[FULL]",
]


class Stop(Exception):
    """Raised inside training to stop it the way a device call killed at its budget would."""


def test_copied_files_restore_the_run_and_training_resumes_from_them(tmp_path, bench_script):
    session = bench_script("mqar_zeta_session")
    first = load_config(ROOT / "experiments" / "mqar_zeta.yaml", TINY + [f"out_dir={tmp_path / 'a'}"])
    [spec] = plan(first, check_experiment(first))

    def stop_after_one_epoch():
        raise Stop  # a call killed at its budget after epoch 1 was checkpointed

    with pytest.raises(Stop):
        train_run(spec, on_epoch=stop_after_one_epoch)
    out = tmp_path / "out"
    out.mkdir()
    copied = session.copy_back(spec.run_dir.parents[2], out)
    assert copied == ["run0.config.yaml", "run0.metrics.jsonl", "run0.checkpoint.pt"]
    assert all("/" not in name for name in copied)

    second = load_config(ROOT / "experiments" / "mqar_zeta.yaml", TINY + [f"out_dir={tmp_path / 'b'}"])
    [resumed] = plan(second, check_experiment(second))
    assert session.restore(out, tmp_path / "b" / second.name) == [str(resumed.run_dir)]
    assert check_run_folder(resumed) == ("partial", 1)
    run_experiment(second, quiet=True)
    assert check_run_folder(resumed) == ("done", 2)
    assert session.restore(out, tmp_path / "b" / second.name) == []  # never overwrites a further run
    progress = session.progress(tmp_path / "b" / second.name)
    assert progress[f"FULL seed={resumed.seed}"]["epochs_done"] == 2


def test_progress_keeps_one_entry_per_seed(tmp_path, bench_script):
    session = bench_script("mqar_zeta_session")
    for seed, accuracies in ((1, [0.5, 0.9]), (2, [0.7])):
        folder = tmp_path / f"seed-{seed}"
        folder.mkdir()
        record = {"label": "zeta:k=2", "seed": seed, "config": {"train": {"epochs": 3}}}
        (folder / "config.yaml").write_text(yaml.safe_dump(record))
        (folder / "metrics.jsonl").write_text("".join(json.dumps({"valid_acc": a, "seconds": 2.0}) + "\n" for a in accuracies))
    progress = session.progress(tmp_path)
    assert progress["zeta:k=2 seed=1"] == {
        "epochs_done": 2,
        "epochs": 3,
        "valid_acc": 0.9,
        "best_valid_acc": 0.9,
        "s_per_epoch": 2.0,
    }
    assert progress["zeta:k=2 seed=2"]["valid_acc"] == 0.7


def test_the_study_fits_the_device_file_limit_and_a_wider_model_is_refused_before_training(bench_script):
    session = bench_script("mqar_zeta_session")
    session.check_checkpoint_size(load_config(ROOT / "experiments" / "mqar_zeta.yaml"))
    with pytest.raises(ValueError, match="shrink model.dim"):
        session.check_checkpoint_size(load_config(ROOT / "experiments" / "mqar_zeta.yaml", ["model.dim=256"]))

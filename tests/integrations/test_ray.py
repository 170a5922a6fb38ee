"""``sparsefocus train CONFIG --ray``: a 2-run sweep as Ray tasks on a local Ray with 2 CPUs, the
same run folders as the in-process runner, and resumption that retrains nothing finished."""

import json

import pytest

from sparsefocus.train import commands
from sparsefocus.train.config import load_config
from sparsefocus.train.loop import RunSpec, train_run

TINY = [
    "task={name: parity, length: 12, num_train: 40, num_valid: 20}",
    "model.blocks=1",
    "model.dim=16",
    "model.mlp_dim=16",
    "model.impl=reference",
    "optim.name=adamw",
    "optim.lr=0.003",
    "train.epochs=2",
    "train.batch_size=20",
    "train.num_cpus=1",
    "seeds=[1]",
    "mechanisms=[FULL,TOPK:3]",
]


def test_ray_flag_parses_an_optional_address():
    assert commands.parse_args(["c.yaml", "--ray"]).ray == ""
    assert commands.parse_args(["c.yaml", "--ray=auto", "seeds=[1]"]).ray == "auto"
    args = commands.parse_args(["c.yaml", "--ray", "seeds=[1]"])
    assert (args.ray, args.overrides) == ("", ["seeds=[1]"])
    assert commands.parse_args(["c.yaml"]).ray is None


def test_a_sweep_runs_as_ray_tasks_and_resumes(tmp_path, monkeypatch):
    """FULL finished and TOPK:3 killed after its first epoch in this process; the Ray run then
    trains only TOPK:3, from its checkpoint, to the same result as an uninterrupted run."""
    pytest.importorskip("ray")
    import sparsefocus.train.experiment as experiment_module
    from sparsefocus.train.experiment import run_experiment
    from sparsefocus.train.ray_runner import run_experiment_ray

    config = load_config(None, [f"out_dir={tmp_path}", "name=exp", *TINY])

    def interrupted(spec, on_epoch=None):
        if spec.label != "TOPK:3":
            return train_run(spec, on_epoch)

        def stop():
            raise KeyboardInterrupt

        return train_run(spec, on_epoch=stop)

    monkeypatch.setattr(experiment_module, "train_run", interrupted)
    with pytest.raises(KeyboardInterrupt):
        run_experiment(config, quiet=True)
    monkeypatch.undo()
    root = tmp_path / "exp"
    full_checkpoint = (root / "default/FULL/seed-1/checkpoint.pt").read_bytes()

    run_experiment_ray(config, quiet=True, init_options={"num_cpus": 2, "include_dashboard": False})
    folders = sorted(p.parent for p in root.glob("**/checkpoint.pt"))
    assert [p.relative_to(root).as_posix() for p in folders] == ["default/FULL/seed-1", "default/TOPK-3/seed-1"]
    assert (root / "default/FULL/seed-1/checkpoint.pt").read_bytes() == full_checkpoint
    resumed = [json.loads(line) for line in (root / "default/TOPK-3/seed-1/metrics.jsonl").read_text().splitlines()]
    fresh = train_run(RunSpec(tmp_path / "fresh", config, "default", "TOPK:3", 1))
    assert [line["epoch"] for line in resumed] == [1, 2]
    assert [line["train_loss"] for line in resumed] == pytest.approx([line["train_loss"] for line in fresh], rel=1e-4)
    import ray

    monkeypatch.setattr(ray, "init", lambda **kwargs: pytest.fail("Ray started with nothing left to train"))
    assert run_experiment_ray(config, quiet=True) == root

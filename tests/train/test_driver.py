"""``sparsefocus train --budget``: each call advances an experiment by whole epochs and stops;
called again it continues; the finished result equals an uninterrupted run, batched or not, and
a folder started by one loop is continued by the other."""

import json
import signal
from pathlib import Path
from types import SimpleNamespace

import pytest

from sparsefocus.train import commands, driver
from sparsefocus.train.config import load_config
from sparsefocus.train.driver import Budget
from sparsefocus.train.experiment import group_progress, nonfinite_runs

TINY = [
    "task={name: parity, length: 10, num_train: 30, num_valid: 15}",
    "model.blocks=1",
    "model.dim=8",
    "model.mlp_dim=8",
    "model.paper_mode=true",
    "model.dropout=0.1",
    "optim.lr=0.5",
    "train.epochs=3",
    "train.batch_size=15",
    "train.threads=1",
    "seeds=[4,5]",
    "mechanisms=[FULL,TOPK:3]",
    "name=exp",
]
KEYS = ("epoch", "train_loss", "train_acc", "valid_loss", "valid_acc", "lr")


def train(out: Path, *extra: str) -> int:
    return commands.main(["defaults", f"out_dir={out}", *TINY, *extra, "--no-report"])


def curves(root: Path) -> dict[str, list[tuple]]:
    out = {}
    for path in sorted(root.glob("*/*/seed-*/metrics.jsonl")):
        lines = [json.loads(line) for line in path.read_text().splitlines()]
        out[str(path.parent.relative_to(root))] = [[m[k] for k in KEYS] for m in lines]
    return out


def assert_same_curves(expected: dict, actual: dict) -> None:
    """Equal up to the batched loop's summation order of the logged loss (fp32 rounding)."""
    assert expected.keys() == actual.keys() and expected
    for run, lines in expected.items():
        assert len(actual[run]) == len(lines), run
        for want, got in zip(lines, actual[run]):
            assert got == pytest.approx(want, rel=1e-6, abs=1e-6), run


def continue_until_done(out: Path, capsys, *extra: str) -> int:
    """Call the command with a tiny budget until it says everything is finished; returns the calls."""
    for calls in range(1, 20):
        assert train(out, *extra, "--budget", "0.001") == 0
        summary = [line for line in capsys.readouterr().out.splitlines() if line.startswith("exp:")]
        assert len(summary) == 1
        if "all finished" in summary[0]:
            return calls
        assert "run the same command again" in summary[0]
    raise AssertionError("the budget driver never finished")


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    out = tmp_path_factory.mktemp("whole")
    assert train(out) == 0
    return curves(out / "exp")


@pytest.mark.parametrize("loop", [[], ["train.batched=true"]], ids=["single", "batched"])
def test_budget_calls_continue_to_the_uninterrupted_result(uninterrupted, loop, tmp_path, capsys):
    calls = continue_until_done(tmp_path, capsys, *loop)
    assert calls > 1  # the tiny budget really stopped it
    assert_same_curves(uninterrupted, curves(tmp_path / "exp"))


def test_one_loop_continues_a_folder_the_other_started(uninterrupted, tmp_path, capsys):
    for step in range(12):
        loop = ["train.batched=true"] if step % 2 else []
        assert train(tmp_path, *loop, "--budget", "0.001") == 0
        if "all finished" in capsys.readouterr().out:
            break
    assert_same_curves(uninterrupted, curves(tmp_path / "exp"))


def test_budget_must_be_positive():
    with pytest.raises(ValueError, match="--budget must be > 0"):
        Budget(0)


def test_compile_phases_come_from_dynamos_accounting():
    import torch

    from sparsefocus.train.driver import compile_phases, compile_seconds

    before = compile_seconds()
    torch.compile(lambda x: x.cos() * 2, backend="eager")(torch.randn(3))  # traced, nothing built
    phases = compile_phases()
    assert "_compile.compile_inner" in phases, phases
    assert all(seconds >= 0 for seconds in phases.values())
    assert compile_seconds() > before


def test_budget_estimates_the_next_epoch_without_the_compiling(monkeypatch):
    import sparsefocus.train.driver as driver

    spent = {"compile": 5.0}
    monkeypatch.setattr(driver, "compile_seconds", lambda: spent["compile"])
    budget = Budget(100.0)
    spent["compile"] = 35.0  # the first epoch compiled for 30 s of its 40
    budget.record(40.0)
    assert budget.last_epoch == pytest.approx(10.0)
    assert budget.allows(), "60 s left and a 10 s epoch expected"
    budget.record(12.0)  # no compiling in the second
    assert budget.last_epoch == pytest.approx(12.0)
    assert not budget.allows(estimate=1000.0)


def test_budget_unpickled_in_another_process_counts_its_compiling_from_zero(monkeypatch):
    import sparsefocus.train.driver as driver

    monkeypatch.setattr(driver, "compile_seconds", lambda: 4.0)
    budget = Budget(100.0, compiled=50.0, pid=-1)  # as made in a parent that had compiled 50 s
    budget.record(10.0)
    assert budget.last_epoch == pytest.approx(6.0) and budget.compiled == 4.0


def test_task_cache_serves_the_built_data(tmp_path):
    import torch

    from sparsefocus.train.config import load_config
    from sparsefocus.train.driver import build_datas, task_cache_path
    from sparsefocus.train.loop import build_data

    config = load_config(None, [f"out_dir={tmp_path}", *TINY, "train.batched=true", "train.task_cache=true"])
    first = build_datas(config, [5], torch.device("cpu"))
    assert task_cache_path(config, 5).exists()
    again = build_datas(config, [4, 5], torch.device("cpu"))[1]  # 4 is built, 5 is read
    fresh = build_data(config, 5, torch.device("cpu"))
    for name in ("train_inputs", "train_targets", "valid_inputs", "valid_targets"):
        assert torch.equal(getattr(again, name), getattr(fresh, name))
        assert torch.equal(getattr(first[0], name), getattr(fresh, name))
    assert (again.vocab_size, again.num_classes, again.pad_id) == (fresh.vocab_size, fresh.num_classes, fresh.pad_id)


def test_task_cache_builds_a_shared_data_seed_once(tmp_path, monkeypatch):
    import torch

    from sparsefocus.train import driver
    from sparsefocus.train.config import load_config
    from sparsefocus.train.loop import build_data

    built, build = [], driver._build_into_cache
    monkeypatch.setattr(driver, "_build_into_cache", lambda config, seed: built.append(seed) or build(config, seed))
    task = "task={name: parity, length: 10, num_train: 30, num_valid: 15, data_seed: 9}"
    config = load_config(None, [f"out_dir={tmp_path}", *TINY, task, "train.batched=true", "train.task_cache=true"])
    datas = driver.build_datas(config, [4, 5, 6], torch.device("cpu"))
    assert len(built) == 1 and driver.task_cache_path(config, 4) == driver.task_cache_path(config, 6)
    fresh = build_data(config, 5, torch.device("cpu"))
    for data in datas:
        assert torch.equal(data.train_inputs, fresh.train_inputs) and torch.equal(data.valid_targets, fresh.valid_targets)


def test_setup_log_names_each_groups_first_evaluation_once(tmp_path, monkeypatch):
    from sparsefocus.train import driver

    monkeypatch.setattr(driver, "SETUP_LOG", [])
    assert train(tmp_path, "train.batched=true", "train.batched_mode=fast") == 0
    firsts = [(entry["group"], entry["what"]) for entry in driver.SETUP_LOG]
    assert sorted(firsts) == [("FULL", "first evaluation"), ("TOPK:3", "first evaluation")]
    assert all(entry["seconds"] >= 0 for entry in driver.SETUP_LOG)


def test_setup_log_times_each_concurrent_groups_first_steps(tmp_path, monkeypatch):
    """Groups trained at once log their first FIRST_STEPS_TIMED steps one by one (a stalled
    first epoch then still shows each group's step time), and their first evaluations."""
    from sparsefocus.train import driver

    monkeypatch.setattr(driver, "SETUP_LOG", [])
    monkeypatch.setattr(driver, "FIRST_STEPS_TIMED", 2)
    monkeypatch.setattr(driver, "PROGRESS_STEPS", (2, 3, 5))  # two steps an epoch: 3 and 5 fall in epochs 2 and 3
    assert train(tmp_path, "train.batched=true", "train.batched_mode=fast", "train.concurrent_groups=2") == 0
    for group in ("FULL", "TOPK:3"):
        entries = [entry for entry in driver.SETUP_LOG if entry["group"] == group]
        whats = [entry["what"] for entry in entries]
        assert whats == [
            "concurrent step 1",
            "concurrent step 2",
            "first evaluation",
            "concurrent steps 1-3, since the first began",
            "concurrent steps 1-5, since the first began",
        ], whats
        assert entries[3]["seconds"] <= entries[4]["seconds"]


def test_blocks_compiled_one_by_one_train_as_the_eager_fast_step(tmp_path, monkeypatch):
    from sparsefocus.train import driver

    compiled = []
    original = driver.compile_blocks
    monkeypatch.setattr(driver, "compile_blocks", lambda model, mode: compiled.append(original(model, mode)) or compiled[-1])
    fast = ["train.batched=true", "train.batched_mode=fast", "model.dropout=0.0", "model.blocks=2"]
    assert train(tmp_path / "eager", *fast, "train.compile=eager") == 0
    assert compiled == []
    assert train(tmp_path / "blocks", *fast, "train.compile=default", "train.compile_scope=blocks") == 0
    assert compiled == [2, 2], "each group's two blocks are compiled"
    eager, blocks = curves(tmp_path / "eager" / "exp"), curves(tmp_path / "blocks" / "exp")
    assert eager.keys() == blocks.keys() and eager
    for run in eager:
        for got, want in zip(blocks[run], eager[run]):
            assert got == pytest.approx(want, rel=1e-4, abs=1e-5), run


def test_compile_scope_is_checked_and_needs_blocks():
    import torch

    from sparsefocus.train.config import load_config
    from sparsefocus.train.driver import compile_blocks

    with pytest.raises(ValueError, match="train.compile_scope must be one of step, blocks"):
        load_config(None, [*TINY, "train.compile_scope=layers"])
    with pytest.raises(ValueError, match="no transformer blocks"):
        compile_blocks(torch.nn.Linear(2, 2), "default")


def test_scheduler_after_a_graph_step_advances_without_the_order_warning():
    """The step graph updates the parameters itself; the scheduler then steps without warning
    that the optimizer never stepped, and its rate still follows the schedule."""
    import warnings

    import torch

    from sparsefocus.train.driver import scheduler_step_after_graph

    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=1.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5**step)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        scheduler_step_after_graph(scheduler)
        scheduler_step_after_graph(scheduler)
    assert [str(w.message) for w in caught] == []
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.25)
    with pytest.warns(UserWarning, match="before `optimizer.step"):
        torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0).step()


def test_compiled_fast_step_of_a_tiled_block_pattern_at_a_length_off_the_tile(tmp_path):
    """moba's per-row block lists at 40 positions (tiles of 16): the compiled fast step trains as
    the eager one (Inductor's CPU code for an ``arange // tile`` index saved for the backward once
    filled only the whole tiles of it)."""
    tiled = [
        "task={name: even_pairs, length: 40, num_train: 50, num_valid: 25}",
        "model.dim=64",
        "model.mlp_dim=64",
        "model.blocks=2",
        "model.paper_mode=false",
        "train.batch_size=25",
        "model.dropout=0.0",
        "train.epochs=1",
        "mechanisms=['moba:block=5,top=1,tile=16']",
        "train.batched=true",
        "train.batched_mode=fast",
    ]
    assert train(tmp_path / "eager", *tiled, "train.compile=eager") == 0
    assert train(tmp_path / "compiled", *tiled, "train.compile=default") == 0
    eager, compiled = curves(tmp_path / "eager" / "exp"), curves(tmp_path / "compiled" / "exp")
    assert eager.keys() == compiled.keys() and eager
    for run in eager:
        for got, want in zip(compiled[run], eager[run]):
            assert got == pytest.approx(want, rel=1e-4, abs=1e-5), run


def test_an_alarm_while_a_part_checkpoints_lands_after_every_run_is_saved(monkeypatch, tmp_path):
    """A time limit's alarm between two runs' checkpoint files would leave the part's runs at
    different epochs; it is held until every run of the part is saved, then delivered."""

    class Stopped(Exception):
        pass

    def stop(signum, frame):
        raise Stopped

    saved = []

    def save(path, state):
        if not saved:
            signal.raise_signal(signal.SIGALRM)
        saved.append(path)

    specs = [SimpleNamespace(run_dir=tmp_path / f"seed-{s}") for s in range(3)]
    trainer = SimpleNamespace(specs=specs, state=lambda run, *rest: {"run": run})
    monkeypatch.setattr(driver, "save_checkpoint", save)
    previous = signal.signal(signal.SIGALRM, stop)
    try:
        with pytest.raises(Stopped):
            driver._save_all(trainer, 2, False, [[], [], []])
    finally:
        signal.signal(signal.SIGALRM, previous)
    assert saved == [spec.run_dir / "checkpoint.pt" for spec in specs]


def test_nonfinite_runs_names_each_run_and_its_first_nan_epoch(tmp_path):
    config = load_config(None, [f"out_dir={tmp_path}", *TINY])
    assert nonfinite_runs(config) == {}  # nothing trained yet
    assert train(tmp_path) == 0
    assert nonfinite_runs(config) == {}
    run = next((tmp_path / "exp" / "default" / "TOPK-3").glob("seed-*"))
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    lines[1]["train_loss"] = float("nan")
    (run / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    assert nonfinite_runs(config) == {f"default/TOPK:3/{run.name}": 2}


def test_group_progress_gives_each_groups_epochs_and_their_spread(tmp_path):
    """Fresh groups stand at 0; a budget call of the single loop trains the first run one epoch,
    so its group's runs differ (a range); a finished experiment stands at the total everywhere."""
    config = load_config(None, [f"out_dir={tmp_path}", *TINY])
    assert group_progress(config) == {"default/FULL": "0/3", "default/TOPK:3": "0/3"}
    assert train(tmp_path, "--budget", "0.001") == 0
    assert group_progress(config) == {"default/FULL": "0-1/3", "default/TOPK:3": "0/3"}
    assert train(tmp_path) == 0
    assert group_progress(config) == {"default/FULL": "3/3", "default/TOPK:3": "3/3"}

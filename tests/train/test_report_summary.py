"""``summary.json`` beside report.md: the per-epoch curves and the tables' numbers of a hand-made
experiment folder, equal to what report.md shows; and the timing line of batched training."""

import json
import re
from pathlib import Path

import pytest
import yaml

from sparsefocus.train.config import load_config
from sparsefocus.train.experiment import run_experiment
from sparsefocus.train.report import MEANINGS, timing_lines, write_report

SEEDS = [1, 2, 3]
TASK = {"name": "parity", "length": 8, "num_train": 8, "num_valid": 200}
# Per mechanism and seed, one list per metric (4 epochs). FULL's median training loss is
# [1.0, 0.9, 0.7, 0.6]; TOPK:3's is [1.0, 0.7, 0.55, 0.45] and first reaches 0.6 at epoch 3;
# BAND:3(1)'s loss is flat (no learning).
CURVES = {
    "FULL": {
        "train_loss": [[1.0, 0.8, 0.6, 0.5], [1.0, 0.9, 0.7, 0.6], [1.2, 1.0, 0.8, 0.7]],
        "train_acc": [[0.5, 0.6, 0.7, 0.8], [0.5, 0.6, 0.8, 0.9], [0.4, 0.5, 0.6, 0.7]],
        "valid_loss": [[1.1, 0.9, 0.7, 0.6], [1.1, 1.0, 0.8, 0.7], [1.3, 1.1, 0.9, 0.8]],
        "valid_acc": [[0.5, 0.8, 0.96, 0.97], [0.5, 0.7, 0.9, 0.96], [0.5, 0.6, 0.7, 0.8]],
    },
    "TOPK:3": {
        "train_loss": [[0.9, 0.6, 0.5, 0.4], [1.0, 0.7, 0.55, 0.45], [1.1, 0.8, 0.6, 0.5]],
        "train_acc": [[0.5, 0.7, 0.8, 0.9], [0.5, 0.7, 0.9, 0.95], [0.4, 0.6, 0.7, 0.8]],
        "valid_loss": [[1.0, 0.7, 0.6, 0.5], [1.1, 0.8, 0.65, 0.55], [1.2, 0.9, 0.7, 0.6]],
        "valid_acc": [[0.6, 0.96, 0.98, 0.99], [0.5, 0.9, 0.97, 0.98], [0.5, 0.8, 0.9, 0.99]],
    },
    "BAND:3(1)": {
        "train_loss": [[0.7, 0.7, 0.7, 0.7]] * 3,
        "train_acc": [[0.5, 0.5, 0.5, 0.5]] * 3,
        "valid_loss": [[0.7, 0.7, 0.7, 0.7], [0.7, 0.7, 0.7, 0.7], [0.7, 0.7, 0.7, float("nan")]],
        "valid_acc": [[0.5, 0.5, 0.5, 0.5]] * 3,
    },
}
EPOCHS = 4


def _experiment(name: str, epochs: int) -> dict:
    return {
        "name": name,
        "task": TASK,
        "model": {
            "blocks": 1,
            "heads": 1,
            "dim": 8,
            "mlp_dim": 8,
            "activation": "relu",
            "dropout": 0.0,
            "positions": "sinusoidal",
            "pooling": "mean",
            "paper_mode": False,
            "impl": "reference",
        },
        "optim": {"name": "adamw", "lr": 0.01, "schedule": "step", "decay": 1.0, "grad_clip": 1.0},
        "train": {"epochs": epochs, "batch_size": 4, "train_loss": "full_eval"},
        "mechanisms": list(CURVES),
        "seeds": SEEDS,
    }


def _write_run(folder: Path, experiment: dict, label: str, seed: int, metrics: list[dict]) -> None:
    folder.mkdir(parents=True)
    record = {"mechanism": label, "label": label, "seed": seed, "setting": "default", "config": experiment}
    (folder / "config.yaml").write_text(yaml.safe_dump(record, sort_keys=False))
    (folder / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in metrics))


def fake_experiment(root: Path) -> Path:
    """An experiment folder written by hand: three mechanisms x three seeds, four epochs each with
    the metrics of ``CURVES`` (0.1 s per epoch, 1 s per run), and one unfinished run."""
    experiment = _experiment("fake", EPOCHS)
    root.mkdir(parents=True)
    (root / "experiment.yaml").write_text(yaml.safe_dump(experiment, sort_keys=False))
    for label, curves in CURVES.items():
        for index, seed in enumerate(SEEDS):
            metrics = [
                {"epoch": epoch + 1, **{key: rows[index][epoch] for key, rows in curves.items()}, "lr": 0.01, "seconds": 0.1}
                for epoch in range(EPOCHS)
            ]
            folder = root / "default" / label.replace(":", "-") / f"seed-{seed}"
            _write_run(folder, experiment, label, seed, metrics)
            (folder / "timing.json").write_text(json.dumps([{"from_epoch": 1, "to_epoch": EPOCHS, "seconds": 1.0}]))
    unfinished = [{"epoch": 1, **{key: rows[0][0] for key, rows in CURVES["FULL"].items()}, "lr": 0.01, "seconds": 0.1}]
    _write_run(root / "default" / "FULL" / "seed-4", experiment, "FULL", 4, unfinished)
    return root


def strict_json(text: str) -> dict:
    """``json.loads`` that refuses NaN and infinities, as ``json.dumps(allow_nan=False)`` would."""

    def refuse(constant: str) -> None:
        raise ValueError(f"{constant} in summary.json")

    return json.loads(text, parse_constant=refuse)


@pytest.fixture
def fake(tmp_path) -> tuple[Path, dict, str]:
    root = fake_experiment(tmp_path / "fake")
    report, _ = write_report(root)
    return root, strict_json((root / "summary.json").read_text()), report.read_text()


def table(text: str, header: str) -> dict[str, list[str]]:
    """The rows (label -> other cells) of the first Markdown table of ``text`` whose header line
    starts with ``header``."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header))
    rows = {}
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        rows[cells[0]] = cells[1:]
    return rows


def shows(cell: str, *values: float | None) -> bool:
    """Whether the numbers in ``cell``, in order, are ``values`` rounded as report.md writes them
    (within half a unit of the last digit shown; None is shown as nan)."""
    shown = re.findall(r"-?\d+(?:\.\d+)?|nan", cell)
    if len(shown) != len(values):
        return False
    for text, value in zip(shown, values):
        if value is None or text == "nan":
            if not (value is None and text == "nan"):
                return False
            continue
        decimals = len(text.split(".")[1]) if "." in text else 0
        if abs(float(text) - value) > 0.5 * 10**-decimals + 1e-6 * abs(value):
            return False
    return True


def assert_summary_is_the_report(setting: dict, text: str) -> None:
    """Every number of one setting's tables in report.md ``text`` is the one summary.json has."""
    final = table(text, "| mechanism | seeds |")
    speed = table(text, "| mechanism | epochs to reach target |")
    assert list(final) == list(speed) == list(setting["mechanisms"])
    target = re.search(
        r"Target: (\S+)'s final median training loss (\S+), which its median curve first reaches at epoch (\w+)", text
    )
    assert target is not None and target[1] == setting["reference"]
    assert shows(target[2], setting["target_train_loss"]) and target[3] == str(setting["reference_epochs_to_target"])
    for label, mechanism in setting["mechanisms"].items():
        seeds, *quartiles, best, convergence, per_epoch, per_run = final[label]
        assert seeds == str(len(mechanism["seeds"])), label
        for cell, key in zip(quartiles, ("train_loss", "valid_loss", "valid_acc")):
            assert shows(cell, *(mechanism["final"][key][q] for q in ("median", "q25", "q75"))), (label, key, cell)
        assert shows(best, mechanism["best_valid_acc_mean"], mechanism["best_valid_acc_std"]), (label, best)
        reached = mechanism["convergence"]
        if reached["mean"] is None:
            assert convergence == f"never (0/{len(reached['epochs'])})", label
        else:
            assert shows(convergence, reached["mean"], reached["std"], reached["reached"], len(reached["epochs"])), label
        assert shows(per_epoch, mechanism["seconds_per_epoch"]), label
        assert per_run == "–" if mechanism["seconds_per_run"] is None else shows(per_run, mechanism["seconds_per_run"]), label
        assert_speed_row(speed[label], mechanism["speed"], label)


def assert_speed_row(cells: list[str], row: dict, label: str) -> None:
    epochs, speedup, paper, gap, relative = cells
    if row["reference"]:
        assert epochs == (row["verdict"] or str(row["epochs_to_target"])) and speedup == "(reference)", label
    elif not row["compared"]:
        assert [epochs, speedup, paper] == [row["verdict"] or "–", "–", "–"], label
    else:
        assert epochs == (str(row["epochs_to_target"]) if row["epochs_to_target"] else f"> {row['epochs']}"), label
        assert speedup == "not reached" if row["speedup"] is None else shows(speedup, row["speedup"]), label
        assert shows(paper, row["max_speedup"], row["max_speedup_epoch"]), label
        assert shows(gap, row["max_gap"]) and shows(relative, row["max_relative_gap"]), label


def test_report_names_the_runs_whose_loss_is_not_finite(fake):
    """BAND:3(1)'s third seed has a NaN held-out loss at epoch 4; no other run has one."""
    _, _, report = fake
    line = next(text for text in report.splitlines() if text.startswith("**Non-finite loss**"))
    named = line.split(": ", 1)[1].split(", ")
    assert len(named) == 1 and "BAND" in named[0] and named[0].endswith(f"/seed-{SEEDS[2]} (from epoch 4)")


def test_first_nonfinite_epoch_reads_training_and_held_out_losses():
    from sparsefocus.train.report import first_nonfinite_epoch

    line = {"train_loss": 1.0, "valid_loss": 1.0}
    assert first_nonfinite_epoch([{"epoch": 1, **line}, {"epoch": 2, **line}]) is None
    assert first_nonfinite_epoch([{"epoch": 1, **line}, {"epoch": 2, **line, "train_loss": float("nan")}]) == 2
    assert first_nonfinite_epoch([{"epoch": 1, **line, "valid_loss": float("inf")}]) == 1


def test_summary_has_each_runs_curves_and_their_median_and_quartiles(fake):
    root, summary, _ = fake
    assert {key: summary[key] for key in ("experiment", "task", "epoch_base", "incomplete")} == {
        "experiment": "fake",
        "task": TASK,
        "epoch_base": 1,
        "incomplete": ["default/FULL/seed-4"],
    }
    mechanisms = summary["settings"]["default"]["mechanisms"]
    assert list(summary["settings"]) == ["default"] and list(mechanisms) == list(CURVES)
    full = mechanisms["FULL"]
    assert full["seeds"] == SEEDS  # the unfinished seed 4 is left out
    for label, curves in CURVES.items():
        for index, seed in enumerate(SEEDS):
            run = mechanisms[label]["runs"][str(seed)]
            assert run["train_loss"] == curves["train_loss"][index] and run["valid_acc"] == curves["valid_acc"][index]
    assert full["median"]["train_loss"] == pytest.approx([1.0, 0.9, 0.7, 0.6])
    assert full["q25"]["train_loss"] == pytest.approx([1.0, 0.85, 0.65, 0.55])
    assert full["q75"]["valid_acc"] == pytest.approx([0.5, 0.75, 0.93, 0.965])
    assert mechanisms["TOPK:3"]["median"]["train_acc"] == pytest.approx([0.5, 0.7, 0.8, 0.9])
    # One seed's NaN held-out loss: null, not NaN, in the curves and in the final quartiles.
    assert mechanisms["BAND:3(1)"]["runs"]["3"]["valid_loss"] == [0.7, 0.7, 0.7, None]
    assert mechanisms["BAND:3(1)"]["final"]["valid_loss"] == {"median": None, "q25": None, "q75": None}


def test_summary_has_the_tables_statistics(fake):
    _, summary, _ = fake
    setting = summary["settings"]["default"]
    assert (setting["reference"], setting["target_train_loss"], setting["reference_epochs_to_target"]) == ("FULL", 0.6, 4)
    full, topk, band = (setting["mechanisms"][label] for label in CURVES)
    assert full["final"]["train_loss"] == pytest.approx({"median": 0.6, "q25": 0.55, "q75": 0.65})
    # Best held-out accuracy per seed: 0.97, 0.96, 0.8.
    assert full["best_valid_acc_mean"] == pytest.approx(0.91) and full["best_valid_acc_std"] == pytest.approx(0.0778888, rel=1e-5)
    assert full["seconds_per_epoch"] == 0.1 and full["seconds_per_run"] == 1.0
    assert full["convergence"] == {
        "threshold": 0.95,
        "epoch_base": 1,
        "epochs": [3, 4, None],
        "reached": 2,
        "mean": 3.5,
        "std": 0.5,
    }
    assert full["speed"]["reference"] and full["speed"]["epochs_to_target"] == 4
    assert topk["speed"]["compared"] and topk["speed"]["epochs_to_target"] == 3
    assert topk["speed"]["speedup"] == pytest.approx(4 / 3, rel=1e-5)
    # FULL's loss 0.7 at epoch 3 was reached by TOPK:3 at epoch 2: 1 of 3 epochs.
    assert topk["speed"]["max_speedup"] == pytest.approx(100 / 3, rel=1e-5) and topk["speed"]["max_speedup_epoch"] == 3
    assert topk["speed"]["max_gap"] == pytest.approx(0.2) and topk["speed"]["max_relative_gap"] == pytest.approx(25.0)
    assert band["speed"]["verdict"] == "no learning (loss never below its epoch-1 value)"
    assert not band["speed"]["compared"] and band["speed"]["speedup"] is None and band["speed"]["max_gap"] is None


def test_summary_numbers_are_those_report_md_shows(fake):
    _, summary, text = fake
    assert_summary_is_the_report(summary["settings"]["default"], text)


def test_summary_counts_convergence_from_the_chosen_epoch_base(tmp_path):
    root = fake_experiment(tmp_path / "fake")
    report, _ = write_report(root, epoch_base=0)
    summary = strict_json((root / "summary.json").read_text())
    full = summary["settings"]["default"]["mechanisms"]["FULL"]["convergence"]
    assert summary["epoch_base"] == 0 and full["epoch_base"] == 0
    assert full["epochs"] == [2, 3, None] and full["mean"] == 2.5
    assert_summary_is_the_report(summary["settings"]["default"], report.read_text())


def test_writing_the_report_twice_gives_the_same_summary(fake):
    root, _, _ = fake
    first = (root / "summary.json").read_bytes()
    write_report(root)
    assert (root / "summary.json").read_bytes() == first


def test_report_of_no_finished_run_writes_an_empty_summary(tmp_path):
    root = tmp_path / "empty"
    root.mkdir()
    (root / "experiment.yaml").write_text(yaml.safe_dump(_experiment("empty", EPOCHS)))
    write_report(root)
    summary = strict_json((root / "summary.json").read_text())
    assert summary == {"experiment": "empty", "task": TASK, "epoch_base": 1, "incomplete": [], "settings": {}}


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
    "train.threads=1",
    "seeds=[1,2]",
    "mechanisms=[FULL,TOPK:3]",
    "settings={optim.lr: [0.003, 0.01]}",
]


def test_summary_of_a_trained_batched_experiment_is_its_report(tmp_path):
    config = load_config(None, [f"out_dir={tmp_path}", "name=exp", *TINY, "train.batched=true"])
    root = run_experiment(config, quiet=True)
    report, _ = write_report(root)
    text = report.read_text()
    summary = strict_json((root / "summary.json").read_text())
    assert list(summary["settings"]) == ["optim.lr=0.003", "optim.lr=0.01"]
    for setting, section in zip(summary["settings"], text.split("\n## ")[1:]):
        assert section.startswith(setting)
        assert_summary_is_the_report(summary["settings"][setting], section)
        for label in ("FULL", "TOPK:3"):
            metrics = [
                json.loads(line)
                for line in (root / setting / label.replace(":", "-") / "seed-2" / "metrics.jsonl").read_text().splitlines()
            ]
            run = summary["settings"][setting]["mechanisms"][label]["runs"]["2"]
            assert run["valid_loss"] == pytest.approx([line["valid_loss"] for line in metrics], rel=1e-5)
    # 2 settings x 2 mechanisms x 2 seeds x 3 epochs, each mechanism's 2 seeds one folded model.
    assert "(24 epochs, batched: 2 seeds folded per model, 1 model at once, " in text


def _timing(folder: Path, entries: list[dict]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "timing.json").write_text(json.dumps(entries))


MACHINE = {"cpus": 16, "torch": "2.11.0+cu130"}


def test_timing_line_says_seeds_folded_and_models_at_once_for_batched_training(tmp_path):
    old = {"seconds": 12.0, "runs_finished": 2, "epochs": 8, "jobs": 2, "threads": 8, "date": "2026-11-30", **MACHINE}
    context = {"jobs": 1, "threads": 16, "date": "2026-12-01", "batched": True, "concurrent_groups": 6, **MACHINE}
    batched = {"seconds": 403.2, "runs_finished": 60, "epochs": 6000, **context}
    _timing(tmp_path, [old, batched])
    _timing(
        tmp_path / "default/FULL/seed-1", [{"from_epoch": 1, "to_epoch": 100, "seconds": 400.0, "folded_runs": 10, **context}]
    )
    # Another invocation's segment (another day, 3 seeds folded) does not describe this one.
    other = {**context, "date": "2026-11-29", "concurrent_groups": 1}
    _timing(tmp_path / "default/TOPK-3/seed-1", [{"from_epoch": 1, "to_epoch": 5, "seconds": 3.0, "folded_runs": 3, **other}])
    assert timing_lines(tmp_path) == [
        "Wall-clock time measured by the trainer: 415 s in 2 invocations that trained: "
        "12 s on 2026-11-30 (8 epochs, 2 runs at once, 16 CPU cores, torch 2.11.0+cu130); "
        "403 s on 2026-12-01 (6000 epochs, batched: 10 seeds folded per model, 6 models at once, 16 CPU cores, torch 2.11.0+cu130).",
        "",
    ]


def test_timing_line_without_run_segments_leaves_out_the_folded_seeds(tmp_path):
    entry = {"seconds": 30.0, "runs_finished": 4, "epochs": 40, "jobs": 1, "threads": 4, "date": "2026-12-01", **MACHINE}
    _timing(tmp_path, [{**entry, "batched": True, "concurrent_groups": 1}])
    assert "(40 epochs, batched: 1 model at once, 16 CPU cores," in timing_lines(tmp_path)[0]
    _timing(tmp_path, [{**entry, "batched": False, "concurrent_groups": 1}])
    assert "(40 epochs, 1 runs at once, 16 CPU cores," in timing_lines(tmp_path)[0]


def test_timing_line_gives_the_range_of_seeds_folded_when_groups_differ(tmp_path):
    context = {"jobs": 1, "threads": 4, "date": "2026-12-01", "batched": True, "concurrent_groups": 2, **MACHINE}
    _timing(tmp_path, [{"seconds": 30.0, "runs_finished": 14, "epochs": 40, **context}])
    # After an interruption the seeds of one mechanism can train as two groups of 6 and 4.
    for seed, folded in ((1, 6), (2, 4), (3, 10)):
        _timing(
            tmp_path / f"default/FULL/seed-{seed}",
            [{"from_epoch": 1, "to_epoch": 2, "seconds": 9.0, "folded_runs": folded, **context}],
        )
    assert "(40 epochs, batched: 4–10 seeds folded per model, 2 models at once, 16 CPU cores," in timing_lines(tmp_path)[0]


def test_timing_line_of_an_entry_older_than_its_batched_key_reads_the_run_segments(tmp_path):
    """Experiment entries did not always record ``batched``; their run segments' folded seeds
    (written by the batched loop only) and concurrent groups still describe the invocation."""
    context = {"jobs": 1, "threads": 16, "date": "2026-12-01", **MACHINE}
    _timing(tmp_path, [{"seconds": 403.0, "runs_finished": 0, "epochs": 6000, **context}])
    segment = {"from_epoch": 1, "to_epoch": 100, "seconds": 402.5, "folded_runs": 10, "concurrent_groups": 6, **context}
    _timing(tmp_path / "default/FULL/seed-1", [segment])
    assert "(6000 epochs, batched: 10 seeds folded per model, 6 models at once, 16 CPU cores," in timing_lines(tmp_path)[0]


def test_meanings_say_concurrent_models_share_the_wall_clock_time():
    line = next(line for line in MEANINGS if "*s/run*" in line)
    assert "with concurrent groups the wall-clock time is shared by the models that trained at once" in line

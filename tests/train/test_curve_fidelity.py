"""sparsefocus fidelity: on hand-made run folders, a chosen experiment whose median stays inside
the reference seeds' range is inside at every epoch; one pushed outside is outside exactly there."""

import json

import pytest
import yaml

from sparsefocus import cli
from sparsefocus.train.fidelity import compare_experiments, compare_group


def write_runs(root, mechanism, curves, epochs=5):
    """curves: seed -> per-epoch (train_loss, valid_acc); folders as the training loop writes them."""
    (root / "experiment.yaml").parent.mkdir(parents=True, exist_ok=True)
    for seed, values in curves.items():
        run = root / "default" / mechanism / f"seed-{seed}"
        run.mkdir(parents=True)
        record = {
            "mechanism": mechanism,
            "label": mechanism,
            "seed": seed,
            "setting": "default",
            "config": {"train": {"epochs": epochs}},
        }
        (run / "config.yaml").write_text(yaml.safe_dump(record))
        lines = [json.dumps({"epoch": e + 1, "train_loss": loss, "valid_acc": acc}) for e, (loss, acc) in enumerate(values)]
        (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")


def curve(offset, length=5, bump=None):
    return [(1.0 - 0.1 * e + offset + (bump or {}).get(e + 1, 0.0), 0.5 + 0.05 * e) for e in range(length)]


@pytest.fixture
def reference(tmp_path):
    root = tmp_path / "fp32"
    write_runs(root, "FULL", {1: curve(-0.1), 2: curve(0.0), 3: curve(0.1)})
    write_runs(root, "TOPK:5", {1: curve(-0.2), 2: curve(0.0), 3: curve(0.2)})
    return root


def test_curves_inside_the_seed_range_are_inside_everywhere(reference, tmp_path):
    chosen = tmp_path / "bf16"
    write_runs(chosen, "FULL", {1: curve(-0.05), 2: curve(0.05), 3: curve(0.0)})
    result = compare_experiments(reference, chosen)
    group = result["groups"]["default/FULL/train_loss"]
    assert group["inside"] == 1.0 and group["worst_excess"] == 0.0 and group["worst_epoch"] is None
    assert group["epochs"] == 5 and group["reference_seeds"] == [1, 2, 3]
    assert set(result["groups"]) == {"default/FULL/train_loss", "default/FULL/valid_acc"}  # TOPK:5 only on one side


def test_a_median_pushed_outside_is_outside_exactly_there(reference, tmp_path):
    chosen = tmp_path / "bf16"
    bump = {3: 0.5, 4: 0.3}
    write_runs(chosen, "FULL", {seed: curve(0.0, bump=bump) for seed in (1, 2, 3)})
    group = compare_experiments(reference, chosen)["groups"]["default/FULL/train_loss"]
    assert group["epochs_outside"] == [3, 4] and group["inside"] == pytest.approx(0.6)
    assert group["worst_epoch"] == 3 and group["worst_excess"] == pytest.approx(0.4)


def test_unfinished_runs_compare_over_the_epochs_they_share(reference, tmp_path):
    chosen = tmp_path / "bf16"
    write_runs(chosen, "FULL", {1: curve(0.0, length=3), 2: curve(0.0)})
    group = compare_experiments(reference, chosen)["groups"]["default/FULL/valid_acc"]
    assert group["epochs"] == 3 and group["inside"] == 1.0


def test_a_spread_needs_two_reference_seeds_and_groups_in_common(tmp_path):
    with pytest.raises(ValueError, match="at least 2 reference seeds"):
        compare_group({1: [1.0, 0.9]}, {1: [1.0, 0.9], 2: [1.0, 0.8]})
    one, other = tmp_path / "a", tmp_path / "b"
    write_runs(one, "FULL", {1: curve(0.0), 2: curve(0.1)})
    write_runs(other, "BAND:5", {1: curve(0.0), 2: curve(0.1)})
    with pytest.raises(ValueError, match="no \\(setting, mechanism\\)"):
        compare_experiments(one, other)


def test_the_command_writes_json_and_png_and_refuses_in_one_line(reference, tmp_path, capsys):
    chosen = tmp_path / "bf16"
    write_runs(chosen, "FULL", {1: curve(0.0), 2: curve(0.05)})
    assert cli.main(["fidelity", str(reference), str(chosen), "--out", str(tmp_path / "out")]) == 0
    saved = json.loads((tmp_path / "out" / "fidelity.json").read_text())
    assert saved["groups"]["default/FULL/train_loss"]["inside"] == 1.0
    assert (tmp_path / "out" / "fidelity.png").stat().st_size > 0
    assert "default/FULL/train_loss | 5 | 100%" in capsys.readouterr().out
    assert cli.main(["fidelity", str(reference), str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("sparsefocus fidelity: error:")

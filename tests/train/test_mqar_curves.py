"""benchmarks/mqar_curves.py: runs from several session folders, seeds kept apart, short names."""

import json
from pathlib import Path

import yaml


def write_run(folder: Path, index: int, mechanism: str, seed: int, accuracies: list[float]) -> None:
    folder.mkdir(exist_ok=True)
    (folder / f"run{index}.config.yaml").write_text(yaml.safe_dump({"mechanism": mechanism, "seed": seed}))
    rows = [{"epoch": e + 1, "valid_acc": a, "valid_loss": 1 - a} for e, a in enumerate(accuracies)]
    (folder / f"run{index}.metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_runs_of_one_mechanism_keep_their_seeds_and_the_table_names_differ(tmp_path, bench_script):
    curves = bench_script("mqar_curves")
    write_run(tmp_path / "a", 0, "zeta:k=32,gamma=0.02", 7, [0.5, 0.9])
    write_run(tmp_path / "a", 1, "zeta:k=32,gamma=0.1", 7, [0.4])
    write_run(tmp_path / "b", 0, "zeta:k=32,gamma=0.02", 1, [0.6, 0.99])
    runs = curves.load_runs([tmp_path / "a", tmp_path / "b"])
    assert list(runs) == ["zeta:k=32,gamma=0.02 seed=7", "zeta:k=32,gamma=0.1", "zeta:k=32,gamma=0.02 seed=1"]
    assert [r["valid_acc"] for r in runs["zeta:k=32,gamma=0.02 seed=1"]] == [0.6, 0.99]
    assert curves.short_names(list(runs)) == ["gamma=0.02 seed=7", "gamma=0.1", "gamma=0.02 seed=1"]
    table = curves.table(runs).splitlines()
    assert table[0] == "| epoch | gamma=0.02 seed=7 | gamma=0.1 | gamma=0.02 seed=1 |"
    assert table[2] == "| 1 | 0.500 | 0.400 | 0.600 |"

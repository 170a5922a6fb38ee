"""benchmarks/gpu_studies.py: a study folder packed into parts and unpacked again is the same
folder (the task cache left out), and the study configs are the paper's Figure-1 grid."""

import json
import random
import signal
import sys
import time
from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def studies(bench_script):
    return bench_script("gpu_studies")


def test_pack_and_unpack_keep_the_study_folder(studies, tmp_path, monkeypatch):
    work = tmp_path / "work" / "even_pairs" / "default" / "FULL" / "seed-1"
    work.mkdir(parents=True)
    (work / "metrics.jsonl").write_text('{"epoch": 1}\n')
    (work / "checkpoint.pt").write_bytes(random.Random(0).randbytes(30_000))  # incompressible
    cache = tmp_path / "work" / "even_pairs" / ".task-cache"
    cache.mkdir()
    (cache / "seed-1.pt").write_bytes(b"cached")
    monkeypatch.setattr(studies, "PART_BYTES", 10_000)  # several parts
    parts = studies.pack(tmp_path / "work", "even_pairs", tmp_path / "out")
    assert len(parts) >= 2 and all(p.stat().st_size <= 10_000 for p in parts)
    assert studies.unpack(tmp_path / "out", "even_pairs", tmp_path / "again")
    again = tmp_path / "again" / "even_pairs" / "default" / "FULL" / "seed-1"
    assert (again / "checkpoint.pt").read_bytes() == (work / "checkpoint.pt").read_bytes()
    assert (again / "metrics.jsonl").read_text() == '{"epoch": 1}\n'
    assert not (tmp_path / "again" / "even_pairs" / ".task-cache").exists()
    assert not studies.unpack(tmp_path / "empty", "even_pairs", tmp_path / "none")


@pytest.mark.parametrize("study, epochs", [("even_pairs", 100), ("missing_duplicate", 250), ("listops_fig1a", 200)])
def test_study_configs_are_the_figure_1_grid(studies, study, epochs, tmp_path):
    config = studies.study_config(study, tmp_path, "highest", "none", "step-graph")
    assert config.mechanisms == studies.FIGURE_1 and len(config.seeds) == 10
    assert config.train.epochs == epochs and config.model.activation == "relu" and config.settings == {}
    assert config.train.topk_select == "triton"


def test_the_open_question_study_keeps_its_nine_mechanisms(studies, tmp_path):
    config = studies.study_config("listops_open", tmp_path, "high", "bf16", "step-graph", 6)
    labels = [m.split(":")[0] for m in config.mechanisms]
    assert labels == ["FULL", "TOPK", "zeta", "moba", "quest", "nsa", "dsa", "lsh", "entmax"]
    assert not config.model.paper_mode and config.train.epochs == 200 and len(config.seeds) == 10
    assert config.train.concurrent_groups == 6 and config.train.autocast == "bf16"


def test_the_even_pairs_open_question_adds_fixed_blocks_and_nsa_with_forced_blocks_only(studies, tmp_path):
    config = studies.study_config("even_pairs_open", tmp_path, "highest", "none", "step-graph")
    labels = [m.split(":")[0] for m in config.mechanisms]
    assert labels == ["FULL", "TOPK", "BLOC", "zeta", "moba", "quest", "nsa", "nsa", "dsa", "lsh", "entmax"]
    assert not config.model.paper_mode and config.train.epochs == 100 and len(config.seeds) == 10
    assert config.task["name"] == "even_pairs" and config.train.autocast == "none"


def test_the_compile_cache_travels_only_when_it_fits_beside_the_study(studies, tmp_path, monkeypatch):
    work, out = tmp_path / "work", tmp_path / "out"
    (work / "even_pairs").mkdir(parents=True)
    (work / "even_pairs" / "metrics.jsonl").write_text("{}\n")
    assert studies.pack_cache(work, out, []) == "none"
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "unset")
    monkeypatch.setenv("TRITON_CACHE_DIR", "unset")
    cache = studies.use_compile_cache(work)
    assert cache == work / studies.CACHE and (cache / "triton").is_dir()
    assert studies.os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(cache)
    (cache / "triton" / "kernel.cubin").write_bytes(random.Random(1).randbytes(20_000))
    monkeypatch.setattr(studies, "PART_BYTES", 8_000)
    parts = studies.pack(work, "even_pairs", out)
    assert studies.pack_cache(work, out, parts).startswith("packed")
    assert list(out.glob(f"{studies.CACHE}.txz.part*")) and all(p.name.startswith("even_pairs.tgz.part") for p in parts)
    assert studies.unpack(out, studies.CACHE, tmp_path / "again")
    assert (tmp_path / "again" / studies.CACHE / "triton" / "kernel.cubin").read_bytes() == (
        cache / "triton" / "kernel.cubin"
    ).read_bytes()
    for limit, files in ((10_000, 8), (10**9, 4)):  # too many bytes; too many files
        monkeypatch.setattr(studies, "MAX_BYTES_BACK", limit)
        monkeypatch.setattr(studies, "MAX_FILES_BACK", files)
        fresh = tmp_path / f"out-{limit}"
        assert studies.pack_cache(work, fresh, studies.pack(work, "even_pairs", fresh)).startswith("left out")
        assert not list(fresh.glob(f"{studies.CACHE}.*.part*"))


def test_the_parts_leave_room_for_the_repository_that_travels_with_them(studies, tmp_path, monkeypatch):
    """A device copy (no .git) counts every file outside the inbox, dot-folders and caches; a
    checkout counts its tracked files; what a call returns is the carry limit less that."""
    tree = tmp_path / "tree"
    for name, size in (("a.py", 100), ("docs/b.json", 50), (".hidden/c", 7), ("pkg/__pycache__/d.pyc", 9), ("inbox/e", 11)):
        (tree / name).parent.mkdir(parents=True, exist_ok=True)
        (tree / name).write_bytes(b"x" * size)
    assert studies.repository_bytes(tree, skip=tree / "inbox") == 150
    studies.subprocess.run(["git", "init", "-q"], cwd=tree, check=True)
    studies.subprocess.run(["git", "add", "a.py"], cwd=tree, check=True)
    assert studies.repository_bytes(tree) == 100
    monkeypatch.setattr(studies, "REPOSITORY", tree)
    assert studies.bytes_back(tree / "inbox") == studies.CARRY_BYTES - 100 - 2**20


def test_a_call_may_train_some_mechanisms_and_seeds_of_the_study(studies, tmp_path, monkeypatch, capsys):
    whole = studies.study_config("listops_fig1a", tmp_path, "high", "bf16", "step-graph")
    only = studies.subset_overrides(whole, ["FULL", "BAND:5(1)"], whole.seeds[:5])
    part = studies.study_config("listops_fig1a", tmp_path, "high", "bf16", "step-graph", 6, only)
    assert part.mechanisms == ["FULL", "BAND:5(1)"] and part.seeds == whole.seeds[:5]
    assert studies.subset_overrides(whole, None, None) == ()
    with pytest.raises(ValueError, match="not mechanisms of listops_fig1a: TOPK:9"):
        studies.subset_overrides(whole, ["TOPK:9"], None)
    with pytest.raises(ValueError, match="not seeds of listops_fig1a: 7"):
        studies.subset_overrides(whole, None, [7])
    argv = ["gpu_studies.py", "--study", "listops_fig1a", "--out", str(tmp_path / "o"), "--work", str(tmp_path / "w")]
    monkeypatch.setattr(studies.sys, "argv", [*argv, "--mechanism", "TOPK:9"])
    assert studies.main() == 2
    assert "not mechanisms of listops_fig1a: TOPK:9" in capsys.readouterr().err
    assert not (tmp_path / "w").exists()  # refused before anything was written


def test_a_failing_call_still_returns_what_was_trained(studies, tmp_path, monkeypatch, capsys):
    def fail_midway(config, quiet, budget):
        run = Path(config.out_dir) / config.name / "default" / "FULL" / "seed-1"
        run.mkdir(parents=True)
        (run / "metrics.jsonl").write_text('{"epoch": 3}\n')
        raise RuntimeError("capture failed")

    monkeypatch.setattr(studies, "run_experiment", fail_midway)
    out, work = tmp_path / "o", tmp_path / "w"
    argv = ["gpu_studies.py", "--study", "even_pairs", "--out", str(out), "--work", str(work), "--no-compile-cache"]
    monkeypatch.setattr(studies.sys, "argv", [*argv, "--inbox", str(tmp_path / "none")])
    assert studies.main() == 1
    record = json.loads((out / "even_pairs_progress.json").read_text())
    assert record["error"] == "RuntimeError: capture failed" and "capture failed" in capsys.readouterr().err
    assert studies.unpack(out, "even_pairs", tmp_path / "again")
    assert (tmp_path / "again" / "even_pairs" / "default" / "FULL" / "seed-1" / "metrics.jsonl").read_text() == '{"epoch": 3}\n'


def test_parts_too_large_to_carry_back_are_named_in_the_record(studies, tmp_path, monkeypatch, capsys):
    """A call whose packed study would not fit what the next call carries in still returns it, and
    its progress record and a warning say so and name the remedies."""

    def train_big(config, quiet, budget):
        run = Path(config.out_dir) / config.name / "default" / "FULL" / "seed-1"
        run.mkdir(parents=True, exist_ok=True)
        (run / "checkpoint.pt").write_bytes(random.Random(2).randbytes(30_000))

    monkeypatch.setattr(studies, "run_experiment", train_big)
    out, work = tmp_path / "o", tmp_path / "w"
    argv = ["gpu_studies.py", "--study", "even_pairs", "--out", str(out), "--work", str(work), "--no-compile-cache"]
    monkeypatch.setattr(studies.sys, "argv", [*argv, "--inbox", str(tmp_path / "none")])
    monkeypatch.setattr(studies, "MAX_BYTES_BACK", 10**9)
    assert studies.main() == 0
    assert json.loads((out / "even_pairs_progress.json").read_text())["parts_warning"] is None
    monkeypatch.setattr(studies, "MAX_BYTES_BACK", 20_000)
    monkeypatch.setattr(studies.sys, "argv", [*argv, "--inbox", str(tmp_path / "none"), "--out", str(tmp_path / "o2")])
    assert studies.main() == 0
    warning = json.loads((tmp_path / "o2" / "even_pairs_progress.json").read_text())["parts_warning"]
    assert "exceed what a call returns" in warning and "--slim" in warning
    assert "gpu_studies: warning: the study's parts" in capsys.readouterr().err
    assert studies.unpack(tmp_path / "o2", "even_pairs", tmp_path / "again")  # returned all the same


def test_groups_a_call_did_not_train_but_carries_are_named(studies, tmp_path, monkeypatch):
    """Groups outside ``--mechanism`` that the study folder holds runs of travel in the parts too:
    ``carried_groups`` names them (not the groups without runs), and so does the warning when the
    parts are too large."""
    whole = studies.study_config("even_pairs", tmp_path, "high", "none", "step-graph")
    part = studies.study_config(
        "even_pairs", tmp_path, "high", "none", "step-graph", 1, studies.subset_overrides(whole, ["TOPK:5"], None)
    )
    progress = {
        id(whole): {"default/FULL": "0-3/100", "default/TOPK:5": "2/100", "default/BAND:5": "0/100"},
        id(part): {"default/TOPK:5": "2/100"},
    }
    monkeypatch.setattr(studies, "group_progress", lambda config: progress[id(config)])
    carried = studies.carried_groups(whole, progress[id(part)])
    assert carried == {"default/FULL": "0-3/100"}
    parts = [tmp_path / "study.tgz.part00"]
    parts[0].write_bytes(b"x" * 30_000)
    monkeypatch.setattr(studies, "MAX_BYTES_BACK", 20_000)
    assert "groups this call did not train (default/FULL 0-3/100)" in studies.parts_warning(parts, None, carried)
    assert "did not train" not in studies.parts_warning(parts, None, {})
    monkeypatch.setattr(studies, "MAX_BYTES_BACK", 10**9)
    assert studies.parts_warning(parts, None, carried) is None

    def other_settings(config):
        if config is whole:
            raise ValueError("a run was trained with train.epochs=60, the config now says 200\nmore")
        return progress[id(config)]

    monkeypatch.setattr(studies, "group_progress", other_settings)
    assert studies.carried_groups(whole, progress[id(part)]) == {
        "(not read)": "ValueError: a run was trained with train.epochs=60, the config now says 200"
    }


def test_start_from_copies_kept_runs_and_the_inbox_parts_win(studies, tmp_path):
    kept = tmp_path / "kept"
    for seed, text in ((1, "kept-1"), (2, "kept-2")):
        run = kept / "default" / "FULL" / f"seed-{seed}"
        run.mkdir(parents=True)
        (run / "metrics.jsonl").write_text(f'{{"epoch": "{text}"}}\n')
        (run / ".lock").write_text("pid 1")
    (kept / ".task-cache").mkdir()
    newer = tmp_path / "newer" / "even_pairs" / "default" / "FULL" / "seed-2"
    newer.mkdir(parents=True)
    (newer / "metrics.jsonl").write_text('{"epoch": "newer-2"}\n')
    studies.pack(tmp_path / "newer", "even_pairs", tmp_path / "inbox")
    work = tmp_path / "work"
    assert studies.start_from(kept, "even_pairs", work) == 2
    assert studies.unpack(tmp_path / "inbox", "even_pairs", work)
    runs = work / "even_pairs" / "default" / "FULL"
    assert (runs / "seed-1" / "metrics.jsonl").read_text() == '{"epoch": "kept-1"}\n'
    assert (runs / "seed-2" / "metrics.jsonl").read_text() == '{"epoch": "newer-2"}\n'
    assert not (runs / "seed-1" / ".lock").exists() and not (work / "even_pairs" / ".task-cache").exists()
    with pytest.raises(ValueError, match="holds no run folder"):
        studies.start_from(tmp_path / "newer" / "nothing", "even_pairs", work)


def test_split_repacks_a_study_by_group_within_the_limit_and_drops_none(studies, tmp_path, monkeypatch, capsys):
    """A returned study too large to carry in whole becomes part folders of whole mechanism groups,
    each within the limit (a group too large alone is a part of its own, marked), every group and
    every top-level file kept, each part naming the --mechanism values that train its groups."""
    study = tmp_path / "work" / "missing_duplicate"
    weights = {"FULL": 40_000, "TOPK-5": 30_000, "BAND-5": 20_000, "BAND-5-1": 15_000, "BLOC-5": 12_000, "BLOC-5-1": 90_000}
    for number, (group, size) in enumerate(weights.items()):
        run = study / "default" / group / "seed-1"
        run.mkdir(parents=True)
        (run / "checkpoint.pt").write_bytes(random.Random(number).randbytes(size))  # incompressible
    (study / "timing.json").write_text("[]")
    (study / "default" / "FULL" / ".task-cache").mkdir()
    studies.pack(tmp_path / "work", "missing_duplicate", tmp_path / "inbox")
    config = studies.study_config("missing_duplicate", tmp_path / "unpacked", "highest", "none", "step-graph", 1)
    limit = 70_000
    entries = studies.split_study(config, tmp_path / "inbox", tmp_path / "split", limit)
    assert json.loads((tmp_path / "split" / "split.json").read_text()) == entries
    seen = []
    for entry in entries:
        again = tmp_path / "again" / entry["folder"]
        assert studies.unpack(tmp_path / "split" / entry["folder"], "missing_duplicate", again)
        held = sorted(str(path.relative_to(again / "missing_duplicate")) for path in again.glob("missing_duplicate/*/*"))
        assert held == entry["groups"] and (again / "missing_duplicate" / "timing.json").read_text() == "[]"
        assert entry["fits"] is (entry["bytes"] <= limit) and entry["fits"] is (entry["groups"] != ["default/BLOC-5-1"])
        label = {"FULL": "FULL", "TOPK-5": "TOPK:5", "BAND-5": "BAND:5", "BAND-5-1": "BAND:5(1)", "BLOC-5": "BLOC:5"}
        label["BLOC-5-1"] = "BLOC:5(1)"
        assert entry["mechanisms"] == [label[group.split("/")[1]] for group in entry["groups"]]
        for group in entry["groups"]:
            run = again / "missing_duplicate" / group / "seed-1" / "checkpoint.pt"
            assert run.read_bytes() == (study / group / "seed-1" / "checkpoint.pt").read_bytes()
        seen += entry["groups"]
    assert sorted(seen) == sorted(f"default/{group}" for group in weights)
    assert len(entries) == 3  # 90K alone; 40K + 20K; 30K + 15K + 12K (largest first, first fit)
    assert not list((tmp_path / "again").rglob(".task-cache"))
    with pytest.raises(ValueError, match="holds no missing_duplicate"):
        studies.split_study(config, tmp_path / "empty", tmp_path / "split2", limit)
    # the same through the command line, the limit being what a call carries in
    monkeypatch.setattr(studies, "MAX_BYTES_BACK", limit)
    command = [
        "gpu_studies.py",
        "--study",
        "missing_duplicate",
        "--work",
        str(tmp_path / "cli"),
        "--inbox",
        str(tmp_path / "inbox"),
    ]
    monkeypatch.setattr(sys, "argv", [*command, "--split", str(tmp_path / "split3")])
    assert studies.main() == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["split"] == entries


def test_adopt_keeps_only_finished_groups_and_replaces_them_whole(studies, tmp_path, monkeypatch, capsys):
    cpu = (
        "task.num_train=40",
        "task.num_valid=20",
        "model.blocks=1",
        "train.epochs=1",
        "train.device=cpu",
        "train.compile=eager",
        "train.topk_select=torch",
        "train.task_cache=false",
        "seeds=[1,2]",
        'mechanisms=["FULL", "TOPK:5"]',
    )
    config = studies.study_config("even_pairs", tmp_path / "work", "highest", "none", "step-graph", 1, cpu)
    studies.run_experiment(
        studies.study_config("even_pairs", tmp_path / "work", "highest", "none", "step-graph", 1, (*cpu, 'mechanisms=["FULL"]')),
        quiet=True,
    )
    studies.run_experiment(
        studies.study_config(
            "even_pairs", tmp_path / "work", "highest", "none", "step-graph", 1, (*cpu, 'mechanisms=["TOPK:5"]', "seeds=[1]")
        ),
        quiet=True,
    )
    (tmp_path / "work" / "even_pairs" / "default" / "FULL" / "seed-1" / ".lock").write_text("")  # as a device call leaves it
    studies.pack(tmp_path / "work", "even_pairs", tmp_path / "parts")
    kept = tmp_path / "kept"
    stale = kept / "default" / "FULL" / "seed-1" / "stale.txt"
    stale.parent.mkdir(parents=True)
    stale.write_text("from an earlier copy")
    assert studies.adopt(config, tmp_path / "parts", kept) == ["default/FULL"]
    assert not stale.exists() and not (kept / "default" / "TOPK-5").exists()
    for seed in (1, 2):
        run = kept / "default" / "FULL" / f"seed-{seed}"
        assert (run / "metrics.jsonl").read_text().count("\n") == 1 and not (run / ".lock").exists()
    assert (kept / "timing.json").is_file() and not list(kept.rglob("*.partial"))
    timing = json.loads((kept / "timing.json").read_text())
    assert timing  # the calls that trained the parts
    (kept / "timing.json").write_text(json.dumps([{"seconds": 1.0, "from": "another study folder"}]))
    written = (tmp_path / "work" / "even_pairs" / "experiment.yaml").read_text()
    assert (kept / "experiment.yaml").read_text() == written  # a new kept folder is an experiment folder
    (kept / "experiment.yaml").write_text("the whole grid's config\n")
    studies.adopt(config, tmp_path / "parts", kept)
    assert (kept / "experiment.yaml").read_text() == "the whole grid's config\n"  # an existing one is kept
    merged = [{"seconds": 1.0, "from": "another study folder"}, *timing]
    assert json.loads((kept / "timing.json").read_text()) == merged  # earlier records kept, this call's added
    studies.adopt(config, tmp_path / "parts", kept)
    assert json.loads((kept / "timing.json").read_text()) == merged  # the same parts again add nothing
    with pytest.raises(ValueError, match="holds no even_pairs"):
        studies.adopt(config, tmp_path / "empty", kept)
    # the same runs as a screen of a longer study, adopted through the command line
    original = studies.study_config

    def longer(study, work, precision, autocast, compile_mode, concurrent=1, extra=(), *rest):
        return original(study, work, precision, autocast, compile_mode, concurrent, (*cpu, "train.epochs=2", *extra), *rest)

    monkeypatch.setattr(studies, "study_config", longer)
    command = ["gpu_studies.py", "--study", "even_pairs", "--work", str(tmp_path / "work"), "--inbox", str(tmp_path / "parts")]
    command += ["--precision", "highest", "--autocast", "none", "--compile", "step-graph"]
    for extra, adopted in (([], []), (["--epochs", "1", "--seeds", "1"], ["default/FULL", "default/TOPK-5"])):
        monkeypatch.setattr(sys, "argv", [*command, "--adopt", str(tmp_path / f"kept{len(extra)}"), *extra])
        assert studies.main() == 0
        assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["adopted"] == adopted


def test_a_screen_trains_to_fewer_epochs_and_refuses_none(studies, tmp_path):
    assert studies.epochs_override(None) == ()
    config = studies.study_config("listops_open", tmp_path, "high", "bf16", "step-graph", 1, studies.epochs_override(40))
    assert config.train.epochs == 40 and config.optim.schedule == "step"
    with pytest.raises(ValueError, match="--epochs must be at least 1"):
        studies.epochs_override(0)


def test_the_hard_stop_interrupts_training_that_outruns_the_call_and_still_packs(studies, tmp_path, monkeypatch):
    """Training that no epoch-boundary budget can stop (a compile, say) is interrupted by the
    alarm, and the call still returns its study folder and names the stop."""

    def compile_forever(config, quiet, budget):
        run = Path(config.out_dir) / config.name / "default" / "FULL" / "seed-1"
        run.mkdir(parents=True)
        (run / "metrics.jsonl").write_text('{"epoch": 1}\n')
        for _ in range(1200):  # a minute at most, then the test fails below on the error's name
            time.sleep(0.05)
        raise AssertionError("not interrupted")

    monkeypatch.setattr(studies, "run_experiment", compile_forever)
    out, work = tmp_path / "o", tmp_path / "w"
    argv = ["gpu_studies.py", "--study", "even_pairs", "--out", str(out), "--work", str(work), "--no-compile-cache"]
    monkeypatch.setattr(studies.sys, "argv", [*argv, "--inbox", str(tmp_path / "none"), "--budget", "1", "--hard-stop", "1.5"])
    assert studies.main() == 1
    record = json.loads((out / "even_pairs_progress.json").read_text())
    assert record["error"].startswith("HardStop: training interrupted by --hard-stop")
    assert studies.unpack(out, "even_pairs", tmp_path / "again")
    assert (tmp_path / "again" / "even_pairs" / "default" / "FULL" / "seed-1" / "metrics.jsonl").exists()
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)  # the alarm is off again


def test_verify_runs_the_tests_first_and_trains_nothing_when_one_fails(studies, tmp_path, monkeypatch, capsys):
    passing, failing = tmp_path / "test_passing.py", tmp_path / "test_failing.py"
    passing.write_text("def test_ok():\n    assert 1 + 1 == 2\n")
    failing.write_text("def test_bad():\n    assert 1 + 1 == 3\n")
    assert studies.verified([str(passing)], tmp_path / "log-pass.txt")
    assert "1 passed" in (tmp_path / "log-pass.txt").read_text()

    def must_not_train(*args, **kwargs):
        raise AssertionError("trained although a --verify test failed")

    monkeypatch.setattr(studies, "run_experiment", must_not_train)
    out, work = tmp_path / "o", tmp_path / "w"
    argv = ["gpu_studies.py", "--study", "even_pairs", "--out", str(out), "--work", str(work), "--no-compile-cache"]
    monkeypatch.setattr(studies.sys, "argv", [*argv, "--verify", str(passing), "--verify", str(failing)])
    assert studies.main() == 3
    assert "--verify tests failed" in capsys.readouterr().err
    assert "1 failed" in (out / "even_pairs_verify.txt").read_text() and not work.exists()


@pytest.mark.parametrize("passed", [True, False])
def test_a_failed_concurrency_check_trains_one_group_at_a_time(studies, passed, tmp_path, monkeypatch, capsys):
    widths = []

    def train(config, quiet, budget):
        widths.append(config.train.concurrent_groups)
        (Path(config.out_dir) / config.name).mkdir(parents=True)

    monkeypatch.setattr(studies, "check_concurrent", lambda *args: {"passed": passed, "allowed": 2e-3})
    monkeypatch.setattr(studies, "run_experiment", train)
    out, work = tmp_path / "o", tmp_path / "w"
    argv = ["gpu_studies.py", "--study", "even_pairs", "--out", str(out), "--work", str(work), "--no-compile-cache"]
    monkeypatch.setattr(studies.sys, "argv", [*argv, "--inbox", str(tmp_path / "none"), "--check", "--concurrent", "3"])
    assert studies.main() == 0
    assert widths == [3 if passed else 1]
    assert json.loads((out / "even_pairs_progress.json").read_text())["settings"]["concurrent"] == (3 if passed else 1)
    assert ("training one group at a time" in capsys.readouterr().err) is not passed


@pytest.mark.parametrize(
    "change,reused",
    [
        ({}, True),
        ({"passed": False}, False),
        ({"device": "another card"}, False),
        ({"code": "0" * 64}, False),
        ({"compile": "eager-graph"}, False),
    ],
)
def test_a_passed_check_an_earlier_call_returned_is_reused_only_on_the_same_identity(
    studies, change, reused, tmp_path, monkeypatch
):
    """A check record in the inbox saves a call the check's three trainings when it passed on the
    same device, torch, code, compile mode, attention and rule; otherwise the call checks again."""
    checked = []

    def check(out, *args):
        checked.append(args)
        return {"passed": True, "allowed": 2e-3}

    def train(config, quiet, budget):
        (Path(config.out_dir) / config.name).mkdir(parents=True)

    monkeypatch.setattr(studies, "check_concurrent", check)
    monkeypatch.setattr(studies, "run_experiment", train)
    inbox, out = tmp_path / "inbox", tmp_path / "o"
    inbox.mkdir()
    earlier = {**studies.check_identity("step-graph", "masks"), "passed": True, "allowed": 2e-3, "max_abs_diff": {}}
    (inbox / "concurrent_check.json").write_text(json.dumps({**earlier, **change}))
    argv = ["gpu_studies.py", "--study", "even_pairs", "--out", str(out), "--work", str(tmp_path / "w"), "--no-compile-cache"]
    monkeypatch.setattr(
        studies.sys, "argv", [*argv, "--inbox", str(inbox), "--check", "--concurrent", "3", "--compile", "step-graph"]
    )
    assert studies.main() == 0
    assert (not checked) is reused
    if reused:
        assert json.loads((out / "concurrent_check.json").read_text()) == {**earlier, "reused": True}


def test_the_code_fingerprint_follows_the_package_sources(studies, tmp_path, monkeypatch):
    (tmp_path / "sparsefocus").mkdir()
    source = tmp_path / "sparsefocus" / "a.py"
    source.write_text("x = 1\n")
    monkeypatch.setattr(studies, "ROOT", tmp_path)
    monkeypatch.setattr(studies, "__file__", str(source))
    first = studies.code_fingerprint()
    assert studies.code_fingerprint() == first
    source.write_text("x = 2\n")
    assert studies.code_fingerprint() != first


def test_the_concurrency_check_trains_afresh_in_a_used_work_folder(studies, tmp_path, monkeypatch):
    """An earlier check's finished runs in the same work folder (another compile mode) are not
    resumed: the training sees an empty check folder, so the verdict is this mode's own."""
    stale = tmp_path / "check" / "alone-1" / "default" / "FULL" / "seed-1"
    stale.mkdir(parents=True)
    (stale / "metrics.jsonl").write_text(json.dumps({"train_loss": 9.0}) + "\n")
    seen = []

    def fake_run(config, quiet):
        root = Path(config.out_dir) / config.name
        seen.append(root.exists())
        run = root / "default" / "FULL" / "seed-1"
        run.mkdir(parents=True)
        line = {"train_loss": 1.0, "train_acc": 0.5, "valid_loss": 1.0, "valid_acc": 0.5}
        (run / "metrics.jsonl").write_text(json.dumps(line) + "\n")
        return root

    monkeypatch.setattr(studies, "run_experiment", fake_run)
    (tmp_path / "out").mkdir()
    record = studies.check_concurrent(tmp_path / "out", tmp_path, "eager-graph")
    assert seen == [False, False, False]
    assert record["passed"] is True and record["compile"] == "eager-graph"


def test_the_concurrency_check_passes_within_its_tolerance_or_the_lone_runs_noise(studies, tmp_path, monkeypatch):
    """The check's verdict from the largest loss changes (its training replaced by fixed metrics):
    the concurrent runs may move by the tolerance, or by the noise factor times the change between
    the two lone trainings where that is larger."""
    tol, factor = studies.CHECK_TOLERANCE, studies.CHECK_NOISE_FACTOR
    shift = {"together": 0.0, "alone-2": 0.0}
    widths = {}

    def fake_run(config, quiet):
        root = Path(config.out_dir) / config.name
        widths[config.name] = config.train.concurrent_groups
        for seed in config.seeds:
            run = root / "default" / "FULL" / f"seed-{seed}"
            run.mkdir(parents=True)
            moved = shift.get(config.name, 0.0) if seed == config.seeds[-1] else 0.0
            line = {"train_loss": 1.0 + moved, "train_acc": 0.5, "valid_loss": 1.0, "valid_acc": 0.5}
            (run / "metrics.jsonl").write_text("\n".join(json.dumps(line) for _ in range(3)) + "\n")
        return root

    monkeypatch.setattr(studies, "run_experiment", fake_run)
    cases = [  # (concurrent change, lone change, passed)
        (0.0, 0.0, True),
        (tol / 2, 0.0, True),
        (tol * 2, 0.0, False),
        (tol * 2, tol * 1.5, True),  # allowed: factor x 1.5 tol
        (tol * factor * 1.5 * 1.1, tol * 1.5, False),
    ]
    for i, (together, alone, passed) in enumerate(cases):
        shift.update({"together": together, "alone-2": alone})
        out = tmp_path / f"out-{i}"
        out.mkdir()
        record = studies.check_concurrent(out, tmp_path / f"work-{i}", "step-graph")
        assert record["passed"] is passed, (together, alone)
        assert record["max_abs_diff"]["train_loss"] == pytest.approx(together)
        assert record["alone_vs_alone"]["train_loss"] == pytest.approx(alone)
        assert record["allowed"] == pytest.approx(max(tol, factor * alone))
        assert json.loads((out / "concurrent_check.json").read_text())["passed"] is passed
    assert widths == {"alone-1": 1, "alone-2": 1, "together": 3}

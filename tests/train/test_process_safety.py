"""Process safety of ``sparsefocus train`` with a pool: one Ctrl-C stops everything with one line
and loses nothing, a killed parent takes its workers with it, and a run folder being trained is
refused to a second trainer."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from sparsefocus.train.config import load_config
from sparsefocus.train.experiment import run_experiment
from sparsefocus.train.workers import RunLocked, lock_runs

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="signals and flock as on Linux")

# 4 runs of EPOCHS epochs, 2 at once: when the first epoch is logged, two runs are queued and the
# running ones have EPOCHS - 1 epochs to go (several seconds on a loaded 2-core machine, where 12
# epochs were once all trained before the test process saw the first one), while the Ctrl-C
# lands within one epoch.
EPOCHS = 60
SLOW = [
    "name=exp",
    "task={name: parity, length: 12, num_train: 200, num_valid: 50}",
    "model.blocks=1",
    "model.dim=16",
    "model.mlp_dim=16",
    "model.impl=reference",
    "optim.name=adamw",
    "train.batch_size=10",
    "mechanisms=[FULL,TOPK:3]",
    "seeds=[1,2]",
    "train.jobs=2",
    "train.threads=1",
]


def start_training(out_dir: Path, epochs: int) -> subprocess.Popen:
    """``sparsefocus train`` in its own session, as a terminal's foreground process group: Ctrl-C
    at its default action and not blocked, as a shell starts a job, whatever the test process's
    own signal state (an ignored or blocked SIGINT would pass through exec to the trainer)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    command = [sys.executable, "-m", "sparsefocus.cli", "train", "defaults", f"out_dir={out_dir}", *SLOW]
    command += [f"train.epochs={epochs}", "--no-report"]
    return subprocess.Popen(
        command,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        preexec_fn=_as_a_shell_starts_a_job,
    )


def _as_a_shell_starts_a_job() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def wait_for(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


def metrics_lines(out_dir: Path) -> dict[str, int]:
    return {str(p.parent): len(p.read_text().splitlines()) for p in out_dir.rglob("metrics.jsonl")}


def descendants(process: subprocess.Popen) -> list[psutil.Process]:
    try:
        return psutil.Process(process.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def all_gone(processes: list[psutil.Process]) -> bool:
    return not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in processes)


def test_one_ctrl_c_stops_the_pool_with_one_line_and_the_same_command_resumes(tmp_path):
    training = start_training(tmp_path, epochs=EPOCHS)
    wait_for(lambda: metrics_lines(tmp_path), 300, "the first epoch")
    children = descendants(training)
    os.killpg(training.pid, signal.SIGINT)  # what a terminal's Ctrl-C does
    _, stderr = training.communicate(timeout=60)
    assert training.returncode == 130, stderr
    messages = [line for line in stderr.splitlines() if "sparsefocus" in line or "rror" in line]
    assert len(messages) == 1 and messages[0].startswith("sparsefocus train: stopped: Ctrl-C: "), stderr
    assert "of 4 runs finished" in messages[0] and "run the same command again" in messages[0]
    assert "Traceback" not in stderr and "leaked" not in stderr, stderr
    wait_for(lambda: all_gone(children), 10, "the workers to exit")

    # No run started after the Ctrl-C: at most the two that were running have metrics.
    after = metrics_lines(tmp_path)
    assert 1 <= len(after) <= 2
    time.sleep(1.5)
    assert metrics_lines(tmp_path) == after, "a process went on training after the Ctrl-C"

    resumed = start_training(tmp_path, epochs=EPOCHS)
    _, stderr = resumed.communicate(timeout=900)
    assert resumed.returncode == 0, stderr
    for run_dir in metrics_lines(tmp_path):
        epochs = [json.loads(line)["epoch"] for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
        assert epochs == list(range(1, EPOCHS + 1)), run_dir
    assert len(metrics_lines(tmp_path)) == 4


def test_workers_die_when_their_parent_is_killed(tmp_path):
    training = start_training(tmp_path, epochs=200)
    wait_for(lambda: metrics_lines(tmp_path), 300, "the first epoch")
    workers = [p for p in descendants(training) if "resource_tracker" not in " ".join(p.cmdline())]
    assert len(workers) >= 2
    training.kill()  # SIGKILL of the parent alone
    training.communicate(timeout=30)
    wait_for(lambda: all_gone(workers), 10, "the orphaned workers to die")
    before = metrics_lines(tmp_path)
    time.sleep(1.5)
    assert metrics_lines(tmp_path) == before, "an orphaned worker went on training"


def test_a_run_folder_being_trained_is_refused_to_a_second_trainer(tmp_path):
    config = load_config(None, [f"out_dir={tmp_path}", *SLOW, "train.jobs=1", "train.epochs=1"])
    busy = tmp_path / "exp/default/TOPK-3/seed-2"
    with lock_runs([busy]):
        with pytest.raises(RunLocked, match=f"{busy} is being trained by pid {os.getpid()}"):
            run_experiment(config, quiet=True)
    assert not (tmp_path / "exp/experiment.yaml").exists()
    assert not list(tmp_path.rglob("metrics.jsonl"))


def test_the_lock_is_released_when_training_ends(tmp_path):
    config = load_config(None, [f"out_dir={tmp_path}", *SLOW, "train.jobs=1", "train.epochs=1", "mechanisms=[FULL]", "seeds=[1]"])
    root = run_experiment(config, quiet=True)
    with lock_runs([root / "default/FULL/seed-1"]):
        pass


def test_a_resume_with_nothing_to_do_keeps_the_measured_time(tmp_path):
    config = load_config(None, [f"out_dir={tmp_path}", *SLOW, "train.jobs=1", "train.epochs=1", "mechanisms=[FULL]", "seeds=[1]"])
    root = run_experiment(config, quiet=True)
    timing = (root / "timing.json").read_text()
    run_timing = json.loads((root / "default/FULL/seed-1/timing.json").read_text())
    assert len(json.loads(timing)) == 1 and run_timing[0]["to_epoch"] == 1 and run_timing[0]["seconds"] > 0
    run_experiment(config, quiet=True)
    assert (root / "timing.json").read_text() == timing

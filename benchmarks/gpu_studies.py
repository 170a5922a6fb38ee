"""Advance the paper's Figure-1 studies on one GPU across calls of a few minutes each.

Each call unpacks the study folder a previous call returned (``--inbox``, parts of a tar.gz),
trains with the budget driver until ``--budget`` seconds are spent, and packs the study folder
again into parts of at most 15 MiB under ``--out`` (without the task cache), with a progress line
(and each mechanism group's epochs) in ``<out>/<study>_progress.json``. Copy the returned parts into the inbox folder for the next
call; parts too large for the next call to carry in are named there (``parts_warning``, with the groups
the call did not train but carries, ``carried_groups``) and on stderr. A call whose training fails (a mechanism that does not compile, say) still packs what was
trained (finished runs, the last checkpoints), names the error in its progress line and exits
with 1; with ``--concurrent`` above 1 only the failing groups stop, the others train on. The budget stops
training between epochs; ``--hard-stop`` (default: the budget + 40 s) interrupts it wherever it is
(compiling many models before the first epoch, say), so a call cut short still returns its
checkpoints and compile cache. The open-question studies compile block by block unless
``--compile-scope`` says otherwise. The studies (the paper's 10 seeds, ReLU, batched fast mode; the six Figure-1 mechanisms
unless noted):

    even_pairs         experiments/nnch_even_pairs.yaml          100 epochs, fp32
    missing_duplicate  experiments/nnch_missing_duplicate.yaml   250 epochs, fp32
    listops_fig1a      experiments/listops.yaml                  200 epochs, ``--precision``
    listops_open       experiments/listops_open_question.yaml    200 epochs, its own nine mechanisms
    even_pairs_open    experiments/nnch_even_pairs_open_question.yaml  100 epochs, fp32, its own ten

Compiling is a large part of a short call (about 50 s per ListOps model on the H200, six models
per call). Inductor's and Triton's caches therefore live in ``<work>/compile-cache`` and travel
beside the study as ``compile-cache.txz.partNN`` (xz: about half of gzip's size for compiled
code) when they fit what a call may return and the next call may carry in beside the repository
(8 files, and 64 MiB less the repository's own files together; the study first): a later call then loads the compiled code instead
of compiling again (on the H200, the first compile of a small folded model took 22.8 s
cold and 2.7 s from the cache). ``--no-compile-cache`` leaves it out.

``--epochs N`` trains the runs to N epochs instead of the study's number, a screen: a later call
with more (or without it) continues them from their checkpoints, the step schedule being
independent of the total. ``--mechanism M`` (repeatable) and ``--seeds S ...`` train part of the
study's grid: a study too long for a few calls can be trained a few groups or seeds at a time into
the same folder (a run is its own mechanism and seed, so folders from parts resume under the whole
grid), and reported whole by a last call without them, which finds every run finished. Finished
groups kept in the repository (say under ``docs/studies/<study>/experiment``) are continued
with ``--start-from FOLDER``; the inbox's parts are unpacked over them. ``--adopt FOLDER`` trains
nothing: it unpacks the inbox's parts and copies the groups whose runs have all finished into the
kept FOLDER (with the precision and autocast flags of the calls that trained them; with
``--epochs``, ``--seeds`` and ``--mechanism``, a screen's groups finished at its epochs, over its
seeds). ``--split FOLDER`` trains nothing either: a returned study too large to carry into the next
call whole (the progress line's ``parts_warning``) is unpacked and packed again as several study
folders of a few mechanism groups each (``FOLDER/part-N/``, each within what a call carries in),
with ``FOLDER/split.json`` naming each part's ``--mechanism`` values; each part then continues in
a call of its own and is adopted like any other. ``--slim`` keeps only the metrics of finished
runs (not the paper's analysis seed, which ``sparsefocus analyze --seed paper`` reads), so that
what a call returns, and what is kept in the repository, is the unfinished runs' checkpoints and
about 16 KB per finished run.

The mechanism groups train ``--concurrent`` at a time (``train.concurrent_groups``: a step of
each in turn, each on its own CUDA stream, each step graph captured and replayed on a stream of its
own; default 1: lanes whose graphs shared a capture stream once moved the later runs of 10-run
folds, docs/scale.md). ``--check`` first trains a small even-pairs grid with dropout, 10 seeds
folded, one group at a time twice and then concurrently, and records how far the concurrent runs
and the second lone runs differ from the first (``<out>/concurrent_check.json``): each group keeps
its own dropout stream, so all three should differ only by the GPU's non-deterministic summation
order. A check whose concurrent losses move by more than ``CHECK_TOLERANCE`` and more than
``CHECK_NOISE_FACTOR`` times the lone runs' own change trains the call's groups one at a time
instead (said on stderr and in the progress line's settings). A passed check that an earlier call
returned, copied into the inbox with the parts, is reused (``"reused": true``) when it ran on the
same device name, torch, code (a hash of the package's sources and this script), compile mode,
attention and rule; a call that lands on another card checks again. ``--verify TESTS`` (repeatable pytest paths) runs
those tests on the machine first and trains nothing unless they pass (exit status 3; their output
in ``<out>/<study>_verify.txt``): a kernel a study trains with is checked on the GPU it trains on.

Usage (one H200):
    python benchmarks/gpu_studies.py --study even_pairs --out $OUT --inbox studies_in --budget 480 --check
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sparsefocus.analysis.commands import PAPER_ANALYSIS_SEED
from sparsefocus.train.checkpoint import CheckpointError, write_text_atomic
from sparsefocus.train.config import (
    COMPILE_SCOPES,
    FAST_ATTENTIONS,
    PAPER_SEEDS,
    ExperimentConfig,
    expand_settings,
    load_config,
)
from sparsefocus.train.driver import SETUP_LOG, STEP_GRAPH_MODES, Budget, compile_phases
from sparsefocus.train.experiment import (
    finished_groups,
    group_progress,
    nonfinite_runs,
    plan,
    progress_line,
    run_experiment,
    slim_finished_runs,
)
from sparsefocus.train.workers import TIMING_NAME

ROOT = Path(__file__).resolve().parents[1]
EXPERIMENT_FILE = "experiment.yaml"  # what run_experiment writes into an experiment folder
FIGURE_1 = ["FULL", "TOPK:5", "BAND:5", "BAND:5(1)", "BLOC:5", "BLOC:5(1)"]
STUDIES = {
    "even_pairs": "nnch_even_pairs.yaml",
    "missing_duplicate": "nnch_missing_duplicate.yaml",
    "listops_fig1a": "listops.yaml",
    "listops_open": "listops_open_question.yaml",
    "even_pairs_open": "nnch_even_pairs_open_question.yaml",
}
OWN_MECHANISMS = ("listops_open", "even_pairs_open")  # studies that keep their config's mechanisms
PART_BYTES = 15 * 2**20
MAX_FILES_BACK = 8  # what one device call returns from its output folder
CARRY_BYTES = 64 * 2**20  # what a call returns, and what the next call carries in beside the repository's files
MAX_BYTES_BACK: int | None = None  # what the parts may total; None: CARRY_BYTES less the repository's files
REPOSITORY = Path(__file__).resolve().parents[1]
CACHE = "compile-cache"
NOT_KEPT = shutil.ignore_patterns(".lock", ".task-cache")  # run locks and the task cache never travel


def study_config(
    study: str,
    work: Path,
    precision: str,
    autocast: str,
    compile_mode: str,
    concurrent: int = 1,
    extra: tuple[str, ...] = (),
    attention: str = "masks",
    compile_scope: str = "step",
):
    """The study's config as this script trains it (``attention``: ``train.fast_attention``,
    ``compile_scope``: ``train.compile_scope``); ``extra`` overrides come last."""
    overrides = [
        f"out_dir={work}",
        f"name={study}",
        *([] if study in OWN_MECHANISMS else [f"mechanisms={json.dumps(FIGURE_1)}"]),
        f"seeds={PAPER_SEEDS}",
        "settings={}",
        "model.activation=relu",
        "train.device=cuda",
        "train.batched=true",
        "train.batched_mode=fast",
        f"train.compile={compile_mode}",
        "train.task_cache=true",
        "train.topk_select=triton",  # exact fp32 scores whatever the matmul precision, and faster
        f"train.matmul_precision={precision}",
        f"train.autocast={autocast}",
        f"train.concurrent_groups={concurrent}",
        f"train.fast_attention={attention}",
        f"train.compile_scope={compile_scope}",
        "train.checkpoint_every=10",  # a budget stop saves every run anyway; 60 saves an epoch cost ~10%
        *extra,
    ]
    return load_config(ROOT / "experiments" / STUDIES[study], overrides)


def subset_overrides(config, mechanisms: list[str] | None, seeds: list[int] | None) -> tuple[str, ...]:
    """Overrides that train only ``mechanisms`` and ``seeds`` of the study ``config`` (None: all).

    Raises:
        ValueError: a mechanism or seed the study does not have."""
    overrides = []
    if mechanisms:
        unknown = [m for m in mechanisms if m not in config.mechanisms]
        if unknown:
            raise ValueError(f"not mechanisms of {config.name}: {', '.join(unknown)} (it has {', '.join(config.mechanisms)})")
        overrides.append(f"mechanisms={json.dumps(mechanisms)}")
    if seeds:
        unknown_seeds = [str(s) for s in seeds if s not in config.seeds]
        if unknown_seeds:
            raise ValueError(f"not seeds of {config.name}: {', '.join(unknown_seeds)}")
        overrides.append(f"seeds={json.dumps(seeds)}")
    return tuple(overrides)


def epochs_override(epochs: int | None) -> tuple[str, ...]:
    """The override that trains to ``epochs`` (None: the study's own number).

    Raises:
        ValueError: ``epochs`` is below 1."""
    if epochs is None:
        return ()
    if epochs < 1:
        raise ValueError(f"--epochs must be at least 1, got {epochs}")
    return (f"train.epochs={epochs}",)


CHECK_TOLERANCE = 2e-3
"""``--check``: the change of a run's train or held-out loss that concurrent training may always
make against the groups alone (the CUDA test's tolerance; when lanes' CUDA graphs shared a cuBLAS
workspace, later runs moved by up to 0.06)."""

CHECK_NOISE_FACTOR = 2.0
"""``--check``: concurrent training may also move a run by up to this many times the largest change
between the groups trained alone twice. The check's grid trains in fp32 with dropout at the
paper's learning rate, where the GPU's summation order alone moved a run by 0.006 in 3 epochs
(H200, ``benchmarks/results/h200_lab_check_noise_a6d4897.json``)."""

CHECK_KEYS = ("train_loss", "train_acc", "valid_loss", "valid_acc")


def _largest_changes(reference: dict, other: dict) -> dict:
    """Per metric, the largest absolute change of any run and epoch from ``reference`` to ``other``."""
    worst = {key: 0.0 for key in CHECK_KEYS}
    for run, lines in reference.items():
        for want, got in zip(lines, other[run], strict=True):
            for key in worst:
                worst[key] = max(worst[key], abs(want[key] - got[key]))
    return worst


CHECK_NAME = "concurrent_check.json"


def code_fingerprint() -> str:
    """sha256 of the package's Python sources and this script (paths and contents, sorted): what a
    concurrency check's verdict depends on besides the machine and the libraries."""
    digest = hashlib.sha256()
    for path in sorted([*(ROOT / "sparsefocus").rglob("*.py"), Path(__file__).resolve()]):
        digest.update(str(path.relative_to(ROOT)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def check_identity(compile_mode: str, attention: str) -> dict:
    """What a concurrency check was run on and with: the same identity lets a later call reuse it."""
    return {
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
        "code": code_fingerprint(),
        "compile": compile_mode,
        "fast_attention": attention,
        "tolerance": CHECK_TOLERANCE,
        "noise_factor": CHECK_NOISE_FACTOR,
    }


def reusable_check(inbox: Path, compile_mode: str, attention: str) -> dict | None:
    """A passed check that an earlier call returned (``<inbox>/concurrent_check.json``) on the same
    device name, torch, code, compile mode, attention and rule; None when there is none or it
    differs in any of them (a call that lands on another card checks again)."""
    try:
        earlier = json.loads((inbox / CHECK_NAME).read_text())
    except (OSError, ValueError):
        return None
    identity = check_identity(compile_mode, attention)
    if earlier.get("passed") is not True or any(earlier.get(key) != value for key, value in identity.items()):
        return None
    return earlier


def check_concurrent(out: Path, work: Path, compile_mode: str, attention: str = "masks") -> dict:
    """FULL, TOPK:5 and BAND:5(1) on a small even-pairs grid with dropout, 10 seeds (a fault once
    reached only the later runs of a 10-run fold), 3 epochs: one group at a time, twice, and all
    three concurrently. Concurrent training passes (``passed``) when no run's loss moves from the
    first lone training by more than ``CHECK_TOLERANCE`` or ``CHECK_NOISE_FACTOR`` times the
    largest change between the two lone trainings, whichever is larger."""
    tiny = [
        "task.num_train=500",
        "task.num_valid=200",
        "model.blocks=2",
        "train.epochs=3",
        "seeds=[1,2,3,4,5,6,7,8,9,10]",
        'mechanisms=["FULL", "TOPK:5", "BAND:5(1)"]',
    ]
    # A check folder left by an earlier check in the same work folder (another compile mode, on a
    # machine kept warm between calls) would resume as finished and hand back its metrics.
    shutil.rmtree(work / "check", ignore_errors=True)
    metrics = {}
    for name, width in (("alone-1", 1), ("alone-2", 1), ("together", 3)):
        config = study_config(
            "even_pairs", work / "check", "highest", "none", compile_mode, width, (f"name={name}", *tiny), attention
        )
        root = run_experiment(config, quiet=True)
        metrics[name] = {
            str(path.parent.relative_to(root)): [json.loads(line) for line in path.read_text().splitlines()]
            for path in sorted(root.glob("*/*/seed-*/metrics.jsonl"))
        }
    moved, noise = (_largest_changes(metrics["alone-1"], metrics[name]) for name in ("together", "alone-2"))
    losses = ("train_loss", "valid_loss")  # accuracies move in steps of one example
    allowed = max(CHECK_TOLERANCE, CHECK_NOISE_FACTOR * max(noise[key] for key in losses))
    record = {
        **check_identity(compile_mode, attention),
        "runs": len(metrics["alone-1"]),
        "epochs": 3,
        "max_abs_diff": moved,
        "alone_vs_alone": noise,
        "allowed": allowed,
        "passed": max(moved[key] for key in losses) <= allowed,
    }
    write_text_atomic(out / CHECK_NAME, json.dumps(record, indent=1))
    return record


class HardStop(BaseException):
    """Raised in the main thread by ``--hard-stop``'s alarm (a BaseException, so that no
    ``except Exception`` on the way swallows it)."""


def _raise_hard_stop(signum, frame) -> None:
    raise HardStop


def train_keeping_progress(config, budget: Budget, hard_stop: float | None = None) -> str | None:
    """``run_experiment`` under ``budget``; None, or the error that stopped it (its traceback on
    stderr). A mechanism that fails (say while compiling or capturing its step) must not cost the
    call what the others trained: finished runs and the last checkpoints are still packed.

    ``budget`` stops between epochs, and cannot stop what comes before the first (compiling and
    capturing ten models at once outlasted a whole 600-second call). ``hard_stop`` seconds from
    now, a SIGALRM interrupts training wherever it is, so that the call still packs its study
    folder (the last checkpoints) and the compile cache built so far."""
    previous = signal.signal(signal.SIGALRM, _raise_hard_stop) if hard_stop else None
    if hard_stop:
        signal.setitimer(signal.ITIMER_REAL, hard_stop)
    try:
        run_experiment(config, quiet=True, budget=budget)
    except HardStop:
        return f"HardStop: training interrupted by --hard-stop after {hard_stop:.0f} s; runs keep their last checkpoints"
    except Exception as error:
        traceback.print_exc()
        return f"{type(error).__name__}: {error}"
    finally:
        if hard_stop:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
    return None


def suffix(name: str) -> str:
    """The archive kind of ``name``'s parts: the compile cache (compiled code and text, which xz
    packs to about half of gzip's size) as ``txz``, the study (mostly incompressible weights, where
    gzip is faster) as ``tgz``."""
    return "txz" if name == CACHE else "tgz"


def unpack(inbox: Path, study: str, work: Path) -> bool:
    """Extract ``<inbox>/<study>.<suffix>.partNN`` (concatenated in order) into ``work``; False
    when there are none. ``study`` may also be ``CACHE``."""
    parts = sorted(inbox.glob(f"{study}.{suffix(study)}.part*"))
    if not parts:
        return False
    data = b"".join(p.read_bytes() for p in parts)
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:*") as archive:
        archive.extractall(work, filter="data")
    return True


def start_from(folder: Path, study: str, work: Path) -> int:
    """Copy a kept study folder (say the finished groups committed under ``docs/studies/``) into
    ``work/<study>``, before the inbox's parts, which are newer, are unpacked over it. Run locks
    and the task cache are left out. Returns the number of run folders copied.

    Raises:
        ValueError: ``folder`` holds no run folder."""
    runs = sorted(folder.glob("*/*/seed-*/metrics.jsonl"))
    if not runs:
        raise ValueError(f"{folder} holds no run folder (<setting>/<mechanism>/seed-<seed>/metrics.jsonl)")
    shutil.copytree(folder, work / study, ignore=NOT_KEPT, dirs_exist_ok=True)
    return len(runs)


def replace_tree(source: Path, target: Path) -> None:
    """Make ``target`` a copy of ``source`` without run locks or the task cache: copied beside it
    under a temporary name and renamed into place, so an interrupted copy leaves the old folder."""
    temporary = target.with_name(f".{target.name}.partial")
    shutil.rmtree(temporary, ignore_errors=True)
    shutil.copytree(source, temporary, ignore=NOT_KEPT)
    old = target.with_name(f".{target.name}.old")
    shutil.rmtree(old, ignore_errors=True)
    if target.exists():
        target.rename(old)
    temporary.rename(target)
    shutil.rmtree(old, ignore_errors=True)


def merged_timing(kept: Path, new: Path) -> str:
    """The kept folder's timing records followed by those of ``new`` it does not hold yet: groups
    adopted from several study folders keep every call's record, and adopting the same parts
    again adds nothing."""
    records = json.loads(kept.read_text()) if kept.exists() else []
    records += [record for record in json.loads(new.read_text()) if record not in records]
    return json.dumps(records, indent=1)


def adopt(config, inbox: Path, into: Path) -> list[str]:
    """Unpack ``inbox``'s study parts into the folder ``config`` trains in and copy every mechanism
    group whose runs have all finished into the kept folder ``into``, with the study's timing
    records (added to those ``into`` holds), and its ``experiment.yaml`` where ``into`` has none
    yet (so that a new kept folder is an experiment folder ``sparsefocus report`` reads); no
    training. Returns the groups copied (``<setting>/<mechanism>``).

    Raises:
        ValueError: ``inbox`` holds no parts of the study."""
    root = Path(config.out_dir) / config.name
    if not unpack(inbox, config.name, root.parent):
        raise ValueError(f"{inbox} holds no {config.name}.{suffix(config.name)}.part* files")
    groups = finished_groups(config)
    for group in groups:
        (into / group.parent.name).mkdir(parents=True, exist_ok=True)
        replace_tree(group, into / group.relative_to(root))
    if groups:
        write_text_atomic(into / TIMING_NAME, merged_timing(into / TIMING_NAME, root / TIMING_NAME))
        if not (into / EXPERIMENT_FILE).exists():
            write_text_atomic(into / EXPERIMENT_FILE, (root / EXPERIMENT_FILE).read_text())
    return [str(group.relative_to(root)) for group in groups]


def without_task_cache(info: tarfile.TarInfo) -> tarfile.TarInfo | None:
    """A tar filter leaving out the task cache (rebuilt on the device)."""
    return None if ".task-cache" in info.name else info


def archive(work: Path, name: str) -> bytes:
    """``work/name`` as tar bytes compressed as ``suffix(name)`` says (xz at preset 3: a few
    seconds for the cache of a call), without the task cache (rebuilt on the device)."""
    buffer = io.BytesIO()
    options = {"mode": "w:xz", "preset": 3} if suffix(name) == "txz" else {"mode": "w:gz"}
    with tarfile.open(fileobj=buffer, **options) as tar:
        tar.add(work / name, arcname=name, filter=without_task_cache)
    return buffer.getvalue()


def write_parts(data: bytes, name: str, out: Path) -> list[Path]:
    """``data`` as ``<out>/<name>.<suffix>.partNN`` files of at most ``PART_BYTES``."""
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for index, start in enumerate(range(0, len(data), PART_BYTES)):
        path = out / f"{name}.{suffix(name)}.part{index:02d}"
        path.write_bytes(data[start : start + PART_BYTES])
        paths.append(path)
    return paths


def pack(work: Path, study: str, out: Path) -> list[Path]:
    """The study folder as a tar.gz split into parts of at most 15 MiB (the task cache left out)."""
    return write_parts(archive(work, study), study, out)


def archive_groups(root: Path, groups: list[Path]) -> bytes:
    """The study folder ``root`` as tar.gz bytes with its top-level files and only ``groups`` (its
    ``<setting>/<mechanism>`` folders), the task cache left out."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        for path in sorted(root.iterdir()):
            if path.is_file():
                tar.add(path, arcname=f"{root.name}/{path.name}")
        for group in groups:
            tar.add(group, arcname=str(Path(root.name) / group.relative_to(root)), filter=without_task_cache)
    return buffer.getvalue()


def split_study(config, inbox: Path, out: Path, limit: int) -> list[dict]:
    """Unpack ``inbox``'s study parts and pack the study again as several study folders of its
    mechanism groups, each of at most ``limit`` bytes where a group allows (largest first into the
    first folder it fits), as ``out/part-N/<study>.tgz.partNN``: each goes into a call of its own
    with the ``--mechanism`` values listed for it. A group too large alone gets a folder of its own,
    marked ``"fits": false``. Nothing is trained, nothing dropped: every group folder of the study
    is in one part. Returns one entry per part folder.

    Raises:
        ValueError: ``inbox`` holds no parts of the study."""
    root = Path(config.out_dir) / config.name
    if not unpack(inbox, config.name, root.parent):
        raise ValueError(f"{inbox} holds no {config.name}.{suffix(config.name)}.part* files")
    mechanisms = {spec.run_dir.parent: spec.mechanism for spec in plan(config, expand_settings(config))}
    groups = [
        group for setting in sorted(root.iterdir()) if setting.is_dir() for group in sorted(setting.iterdir()) if group.is_dir()
    ]
    base = len(archive_groups(root, []))  # the top-level files, in every part
    extra = {group: len(archive_groups(root, [group])) - base for group in groups}
    bins: list[list[Path]] = []
    loads: list[int] = []
    for group in sorted(extra, key=extra.__getitem__, reverse=True):  # largest first, into the first part it fits
        fitting = [number for number, load in enumerate(loads) if base + load + extra[group] <= limit]
        if fitting:
            bins[fitting[0]].append(group)
            loads[fitting[0]] += extra[group]
        else:
            bins.append([group])
            loads.append(extra[group])
    entries = []
    for number, held in enumerate(map(sorted, bins), start=1):
        data = archive_groups(root, held)
        folder = out / f"part-{number}"
        write_parts(data, config.name, folder)
        entries.append(
            {
                "folder": folder.name,
                "groups": [str(group.relative_to(root)) for group in held],
                "mechanisms": [mechanisms[group] for group in held if group in mechanisms],
                "bytes": len(data),
                "fits": len(data) <= limit,
            }
        )
    write_text_atomic(out / "split.json", json.dumps(entries, indent=1))
    return entries


def repository_bytes(root: Path, skip: Path | None = None) -> int:
    """The size of the files that travel with every call: the tracked files where git lists them,
    else every file under ``root`` outside ``skip`` (the inbox), dot-folders and ``__pycache__``
    (a device copy holds the working tree alone)."""
    if (root / ".git").exists():
        listed = subprocess.run(["git", "ls-files", "-z"], cwd=root, capture_output=True, check=True).stdout
        return sum((root / name).stat().st_size for name in listed.decode().split("\0") if (root / name).is_file())
    total = 0
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if not d.startswith(".") and d != "__pycache__" and Path(folder, d) != skip]
        total += sum(Path(folder, name).stat().st_size for name in files)
    return total


def bytes_back(inbox: Path | None) -> int:
    """What the parts of a call may total: ``MAX_BYTES_BACK`` where set, else the carry limit less
    the repository's own files and 1 MiB to spare (the tree grows with the kept studies)."""
    if MAX_BYTES_BACK is not None:
        return MAX_BYTES_BACK
    skip = inbox.resolve() if inbox is not None else None
    return CARRY_BYTES - repository_bytes(REPOSITORY, skip) - 2**20


def pack_cache(work: Path, out: Path, study_parts: list[Path], inbox: Path | None = None) -> str:
    """Pack ``work/compile-cache`` beside the study's parts if the two fit what a call returns
    (``MAX_FILES_BACK`` files with the progress line, ``bytes_back`` bytes); the study always
    goes first. Returns what happened, for the progress line."""
    if not (work / CACHE).is_dir():
        return "none"
    data = archive(work, CACHE)
    files = len(study_parts) + -(-len(data) // PART_BYTES) + 1
    size = sum(p.stat().st_size for p in study_parts) + len(data)
    if files > MAX_FILES_BACK or size > bytes_back(inbox):
        return f"left out: {len(data) / 2**20:.1f} MiB would not fit beside the study"
    return f"packed: {len(data) / 2**20:.1f} MiB in {len(write_parts(data, CACHE, out))} part(s)"


def carried_groups(whole: ExperimentConfig, trained: dict[str, str]) -> dict[str, str]:
    """Groups of the study ``whole`` outside ``trained`` (this call's ``group_progress``) whose runs
    the study folder holds, with their epochs in the same form: they travel in the parts all the
    same."""
    try:
        progress = group_progress(whole)
    except (ValueError, CheckpointError) as error:  # runs of other settings: named, never fatal to the call
        return {"(not read)": f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"}
    return {group: done for group, done in progress.items() if group not in trained and not done.startswith("0/")}


def parts_warning(parts: list[Path], inbox: Path | None, carried: dict[str, str] | None = None) -> str | None:
    """Why the study's parts could not come back from a call and travel into the next (more files
    than a call returns with the progress line, or more bytes than ``bytes_back``), or None;
    ``carried`` (``carried_groups``) is named as the first thing to leave out."""
    size = sum(p.stat().st_size for p in parts)
    if len(parts) + 1 <= MAX_FILES_BACK and size <= bytes_back(inbox):
        return None
    others = ", ".join(f"{group} {done}" for group, done in (carried or {}).items())
    riders = f"; they carry groups this call did not train ({others}), whose parts the inbox need not hold" if others else ""
    return (
        f"the study's parts ({size / 2**20:.1f} MiB in {len(parts)} files) exceed what a call returns and the next carries in "
        f"({bytes_back(inbox) / 2**20:.1f} MiB, {MAX_FILES_BACK - 1} files){riders}: split the returned parts by group (--split), "
        "train fewer groups or seeds per study folder (--mechanism, --seeds) or keep only finished runs' metrics (--slim)"
    )


def use_compile_cache(work: Path) -> Path:
    """Point Inductor's and Triton's caches into ``work/compile-cache`` (read when they are first
    used, so this must run before anything compiles)."""
    cache = work / CACHE
    (cache / "triton").mkdir(parents=True, exist_ok=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache)
    os.environ["TRITON_CACHE_DIR"] = str(cache / "triton")
    return cache


def verified(tests: list[str], log: Path) -> bool:
    """Run pytest on ``tests`` in a fresh process (its output into ``log``); whether all passed."""
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests], capture_output=True, text=True
    )
    write_text_atomic(log, result.stdout + result.stderr)
    print(f"verify: {(result.stdout.strip().splitlines() or ['no output'])[-1]}", flush=True)
    return result.returncode == 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--study", required=True, choices=sorted(STUDIES))
    parser.add_argument("--out", help="where the packed study and its progress line go (needed unless --adopt)")
    parser.add_argument("--inbox", default="studies_in", help="folder with the parts a previous call returned")
    parser.add_argument(
        "--start-from",
        type=Path,
        help="a kept study folder (finished groups) to continue; the inbox's parts are unpacked over it",
    )
    parser.add_argument("--work", default="/tmp/sparsefocus-studies", help="where the study trains")
    parser.add_argument(
        "--budget", type=float, default=480.0, help="seconds of this call, the verification and the check included"
    )
    parser.add_argument(
        "--hard-stop",
        type=float,
        default=None,
        help="interrupt training this many seconds into the call (the check included), wherever it is, and pack what exists"
        " (default: --budget + 40; 0: never)",
    )
    parser.add_argument("--precision", default="highest", choices=("highest", "high", "medium"))
    parser.add_argument("--autocast", default="none", choices=("none", "bf16"))
    parser.add_argument("--compile", default="step-graph", choices=("default", "reduce-overhead", *STEP_GRAPH_MODES))
    parser.add_argument(
        "--concurrent", type=int, default=1, help="mechanism groups trained at once (default 1: see docs/scale.md)"
    )
    parser.add_argument(
        "--fast-attention", default="masks", choices=FAST_ATTENTIONS, help="train.fast_attention (default: masks)"
    )
    parser.add_argument(
        "--compile-scope",
        default=None,
        choices=COMPILE_SCOPES,
        help="train.compile_scope: the whole forward as one graph, or each block (compiles faster; default: blocks"
        " for the open-question studies, which compile nine or ten kinds of model, step otherwise)",
    )
    parser.add_argument("--check", action="store_true", help="first compare concurrent with one-at-a-time training")
    parser.add_argument(
        "--verify",
        action="append",
        default=[],
        metavar="TESTS",
        help="a pytest path (repeatable) that must pass on this machine before anything trains: a kernel the study"
        " runs, checked on the device it trains on; a failure stops the call with status 3",
    )
    parser.add_argument(
        "--no-compile-cache", action="store_true", help="neither unpack nor return Inductor's and Triton's caches"
    )
    parser.add_argument("--mechanism", action="append", help="train only this mechanism of the study (repeatable; default: all)")
    parser.add_argument("--seeds", type=int, nargs="+", help="train only these of the study's seeds (default: all)")
    parser.add_argument(
        "--epochs",
        type=int,
        help="train the runs to this many epochs instead of the study's (a screen; a later call with more continues them)",
    )
    parser.add_argument(
        "--slim",
        action="store_true",
        help="keep only the metrics of finished runs, except the paper's analysis seed (smaller parts to carry)",
    )
    parser.add_argument(
        "--adopt",
        type=Path,
        metavar="KEPT",
        help="train nothing: unpack the inbox's study parts and copy its finished mechanism groups into the kept folder KEPT"
        " (give the precision and autocast of the calls that trained them; with --epochs, --seeds and --mechanism:"
        " groups finished at those epochs, over those seeds)",
    )
    parser.add_argument(
        "--split",
        type=Path,
        metavar="FOLDER",
        help="train nothing: unpack the inbox's study parts and pack them again as FOLDER/part-N/, several study folders"
        " of a few mechanism groups each that fit what a call carries in, with FOLDER/split.json naming each part's"
        " --mechanism values",
    )
    args = parser.parse_args()
    if args.compile_scope is None:
        args.compile_scope = "blocks" if args.study in OWN_MECHANISMS else "step"
    if args.out is None and args.adopt is None and args.split is None:
        parser.error("--out is required unless --adopt or --split is given")
    if args.slim and args.epochs is not None:
        parser.error("--slim drops the weights of finished runs, so runs screened with --epochs could not continue")
    work = Path(args.work)
    full = study_config(args.study, work, args.precision, args.autocast, args.compile, args.concurrent, (), args.fast_attention)
    try:
        only = subset_overrides(full, args.mechanism, args.seeds) + epochs_override(args.epochs)
    except ValueError as error:
        print(f"gpu_studies: error: {error}", file=sys.stderr)
        return 2
    config = study_config(
        args.study,
        work,
        args.precision,
        args.autocast,
        args.compile,
        args.concurrent,
        only,
        args.fast_attention,
        args.compile_scope,
    )
    if args.adopt is not None:
        # a screen's groups count as finished at its --epochs, over its --seeds and --mechanism
        try:
            print(json.dumps({"adopted": adopt(config, Path(args.inbox), args.adopt), "into": str(args.adopt)}))
        except (ValueError, CheckpointError) as error:
            print(f"gpu_studies: error: {error}", file=sys.stderr)
            return 2
        return 0
    if args.split is not None:
        try:
            entries = split_study(config, Path(args.inbox), args.split, bytes_back(args.split))
        except ValueError as error:
            print(f"gpu_studies: error: {error}", file=sys.stderr)
            return 2
        print(json.dumps({"split": entries, "into": str(args.split)}))
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    verify_began = time.time()
    if args.verify and not verified(args.verify, out / f"{args.study}_verify.txt"):
        print(
            f"gpu_studies: error: --verify tests failed (see {out / f'{args.study}_verify.txt'}); nothing trained",
            file=sys.stderr,
        )
        return 3
    work.mkdir(parents=True, exist_ok=True)
    try:
        started = start_from(args.start_from, args.study, work) if args.start_from else 0
    except ValueError as error:
        print(f"gpu_studies: error: {error}", file=sys.stderr)
        return 2
    cached = False
    if not args.no_compile_cache:
        cached = unpack(Path(args.inbox), CACHE, work)
        use_compile_cache(work)
    spent = time.time() - verify_began  # the verification's and the check's time count towards the budget and the hard stop
    budget = Budget(max(args.budget - spent, 0.0))
    called = time.time() - spent
    if args.check:
        check = reusable_check(Path(args.inbox), args.compile, args.fast_attention)
        if check is None:
            check = check_concurrent(out, work, args.compile, args.fast_attention)
        else:
            check = {**check, "reused": True}
            write_text_atomic(out / CHECK_NAME, json.dumps(check, indent=1))
        print(json.dumps({"concurrent_check": check}), flush=True)
        if not check["passed"] and args.concurrent > 1:
            print(
                f"gpu_studies: warning: concurrent groups moved losses by more than {check['allowed']:.2g}; training one"
                " group at a time (--concurrent 1)",
                file=sys.stderr,
            )
            args.concurrent = 1
            config = dataclasses.replace(config, train=dataclasses.replace(config.train, concurrent_groups=1))
    resumed = unpack(Path(args.inbox), args.study, work)
    began = time.time()
    hard_stop = args.budget + 40 if args.hard_stop is None else args.hard_stop
    failure = train_keeping_progress(config, budget, max(hard_stop - (time.time() - called), 1.0) if hard_stop else None)
    line, complete = progress_line(config)
    groups = group_progress(config)
    carried = carried_groups(full, groups)
    slimmed = slim_finished_runs(work / args.study, keep_seeds=(PAPER_ANALYSIS_SEED,)) if args.slim else []
    parts = pack(work, args.study, out)
    cache = "off" if args.no_compile_cache else "not packed yet"
    record = {
        "study": args.study,
        "resumed": resumed,
        "runs_started_from": started,
        "compile_cache": {"found": cached, "returned": cache},
        "slimmed_checkpoints": len(slimmed),
        "progress": line,
        "groups": groups,
        "carried_groups": carried,
        "nonfinite_runs": nonfinite_runs(config),
        "complete": complete,
        "error": failure,
        "seconds": round(time.time() - began, 1),
        "compile_phases_s": {name: round(seconds, 3) for name, seconds in compile_phases().items()},
        "setup_s": SETUP_LOG,
        "parts": [p.name for p in parts],
        "parts_warning": parts_warning(parts, Path(args.inbox) if args.inbox else None, carried),
        "settings": {
            "mechanisms": config.mechanisms,
            "seeds": config.seeds,
            "precision": args.precision,
            "autocast": args.autocast,
            "compile": args.compile,
            "concurrent": args.concurrent,
            "fast_attention": args.fast_attention,
            "compile_scope": args.compile_scope,
        },
    }
    if record["parts_warning"]:
        print(f"gpu_studies: warning: {record['parts_warning']}", file=sys.stderr)
    if record["nonfinite_runs"]:
        print(f"gpu_studies: warning: runs with a non-finite loss (first epoch): {record['nonfinite_runs']}", file=sys.stderr)
    progress = out / f"{args.study}_progress.json"
    write_text_atomic(progress, json.dumps(record, indent=1))  # first, in case packing the cache is cut short
    if not args.no_compile_cache:
        record["compile_cache"]["returned"] = pack_cache(work, out, parts, Path(args.inbox) if args.inbox else None)
        write_text_atomic(progress, json.dumps(record, indent=1))
    print(json.dumps(record))
    return 1 if failure else 0


if __name__ == "__main__":
    sys.exit(main())

"""Training processes that stop when asked and die with their parent, run-folder locks, run timings.

``WorkerPool`` keeps ``jobs`` spawned processes and hands each one run at a time, so nothing is
queued inside a process: when the parent stops them (Ctrl-C, an error) no further run starts.
Workers ignore SIGINT (the parent decides), ask the kernel to kill them when the parent dies
(``PR_SET_PDEATHSIG`` on Linux) and poll their parent's pid elsewhere. ``lock_runs`` takes an
exclusive ``flock`` on ``.lock`` in every run folder it will train, so a second trainer of the same
folders is refused. ``train_timed`` stores the wall-clock time of every run in its ``timing.json``.
"""

from __future__ import annotations

import ctypes
import functools
import json
import multiprocessing
import os
import signal
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timezone
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator

import torch

from sparsefocus.train.checkpoint import write_text_atomic
from sparsefocus.train.loop import RunSpec, train_run

if TYPE_CHECKING:
    from sparsefocus.train.driver import Budget

try:
    import fcntl
except ImportError:  # Windows: no flock; run folders are then not locked
    fcntl = None  # type: ignore[assignment]

PR_SET_PDEATHSIG = 1
LOCK_NAME = ".lock"
TIMING_NAME = "timing.json"


class RunLocked(RuntimeError):
    """A run folder is being trained by another process."""


@contextmanager
def lock_runs(run_dirs: list[Path]) -> Iterator[None]:
    """Hold an exclusive lock on every folder of ``run_dirs`` (made if missing) for the ``with`` body.

    Raises:
        RunLocked: a folder is locked by another trainer, naming the folder and that trainer's pid.
    """
    handles = []
    try:
        for run_dir in run_dirs:
            handles.append(_lock(run_dir))
        yield
    finally:
        for handle in handles:
            handle.close()  # closing the file releases its lock


def _lock(run_dir: Path) -> Any:
    run_dir.mkdir(parents=True, exist_ok=True)
    handle = open(run_dir / LOCK_NAME, "a+")
    if fcntl is None:
        return handle
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        owner = handle.read().strip() or "another process"
        handle.close()
        raise RunLocked(f"{run_dir} is being trained by {owner}; wait for it to finish or stop it first") from None
    handle.seek(0)
    handle.truncate()
    handle.write(f"pid {os.getpid()}")
    handle.flush()
    return handle


def machine() -> dict[str, Any]:
    """Where a timing was measured (with the GPU's name where CUDA is available)."""
    gpu = {"gpu": torch.cuda.get_device_name()} if torch.cuda.is_available() else {}
    return {"cpus": os.cpu_count(), "torch": torch.__version__, **gpu, "date": datetime.now(timezone.utc).strftime("%Y-%m-%d")}


def append_timing(run_dir: Path, segment: dict[str, Any]) -> None:
    """Add one stretch of training (epochs, seconds, machine) to ``run_dir/timing.json``."""
    path = run_dir / TIMING_NAME
    history = json.loads(path.read_text()) if path.exists() else []
    write_text_atomic(path, json.dumps([*history, segment], indent=1))


def train_timed(
    spec: RunSpec,
    start_epoch: int,
    context: dict[str, Any],
    on_epoch: Callable[[], None] | None = None,
    train: Callable[..., Any] = train_run,
) -> Any:
    """``train(spec)``, appending this stretch of training to the run's ``timing.json`` after every
    epoch: wall-clock seconds since the call (data and model building included), the epochs it
    covers and ``context`` (jobs, threads, machine), so a killed run keeps the time it spent."""
    path = spec.run_dir / TIMING_NAME
    history = json.loads(path.read_text()) if path.exists() else []
    began, epoch = time.perf_counter(), start_epoch

    def tick() -> None:
        nonlocal epoch
        epoch += 1
        segment = {"from_epoch": start_epoch + 1, "to_epoch": epoch, "seconds": round(time.perf_counter() - began, 3)}
        write_text_atomic(path, json.dumps([*history, segment | context], indent=1))
        if on_epoch is not None:
            on_epoch()

    return train(spec, on_epoch=tick)


def _die_with_parent(parent_pid: int) -> None:
    """Exit when the parent does: the kernel's parent-death signal on Linux, a pid poll everywhere."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent_pid:  # the parent died before the signal was asked for
        os._exit(1)

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, daemon=True).start()


def _worker_main(parent_pid: int, inbox: Connection, outbox: Connection, threads: int) -> None:
    """A worker's life: train the runs it is sent, one at a time, until told to stop (None)."""
    _die_with_parent(parent_pid)
    torch.set_num_threads(threads)
    while True:
        try:
            job = inbox.recv()
        except EOFError:
            return
        if job is None:
            return
        spec, start_epoch, context, budget = job
        train = train_run if budget is None else functools.partial(train_run, budget=budget)
        try:
            train_timed(spec, start_epoch, context, on_epoch=lambda: outbox.send(("epoch", None)), train=train)
        except Exception as error:  # noqa: BLE001  (any failure is sent to the parent, which re-raises it)
            outbox.send(("error", _picklable(error)))
            continue
        outbox.send(("done", None))


def _picklable(error: Exception) -> Exception:
    try:
        multiprocessing.reduction.ForkingPickler.dumps(error)
        return error
    except Exception:  # noqa: BLE001
        return RuntimeError(f"{type(error).__name__}: {error}")


@dataclass
class _Worker:
    process: Any
    inbox: Connection
    outbox: Connection
    spec: RunSpec | None = None


class WorkerPool:
    """``jobs`` spawned training processes; ``run`` hands them runs, ``stop`` ends them all at once."""

    def __init__(self, jobs: int, threads: int) -> None:
        context = multiprocessing.get_context("spawn")
        self.workers: list[_Worker] = []
        self.budget: Budget | None = None
        with _sigint_ignored():  # inherited through exec: a Ctrl-C during start-up reaches only this process
            for _ in range(jobs):
                inbox_read, inbox_write = context.Pipe(duplex=False)
                outbox_read, outbox_write = context.Pipe(duplex=False)
                process = context.Process(target=_worker_main, args=(os.getpid(), inbox_read, outbox_write, threads), daemon=True)
                process.start()
                inbox_read.close()
                outbox_write.close()
                self.workers.append(_Worker(process, inbox_write, outbox_read))

    def run(
        self,
        todo: list[tuple[RunSpec, int]],
        context: dict[str, Any],
        on_message: Callable[[str, RunSpec], None],
        budget: Budget | None = None,
    ) -> None:
        """Train every (spec, epochs already done) of ``todo``; ``on_message("epoch" | "done", spec)``.
        With a ``budget`` no run starts after its deadline, and each stops at an epoch boundary.

        Raises:
            the first failed run's error, or RuntimeError when a worker process dies.
        """
        queue = list(reversed(todo))
        self.budget = budget
        for worker in self.workers:
            self._assign(worker, queue, context)
        while any(worker.spec is not None for worker in self.workers):
            busy = {worker.outbox: worker for worker in self.workers if worker.spec is not None}
            for outbox in wait(list(busy), timeout=1.0):
                worker = busy[outbox]  # type: ignore[index]
                self._receive(worker, on_message)
                if worker.spec is None:
                    self._assign(worker, queue, context)

    def _assign(self, worker: _Worker, queue: list[tuple[RunSpec, int]], context: dict[str, Any]) -> None:
        if self.budget is not None and time.time() >= self.budget.deadline:
            queue.clear()
        if queue:
            spec, start_epoch = queue.pop()
            worker.spec = spec
            worker.inbox.send((spec, start_epoch, context, self.budget))

    def _receive(self, worker: _Worker, on_message: Callable[[str, RunSpec], None]) -> None:
        spec = worker.spec
        assert spec is not None
        try:
            kind, payload = worker.outbox.recv()
        except EOFError:
            worker.process.join(1)
            raise RuntimeError(f"the worker training {spec.run_dir} died (exit code {worker.process.exitcode})") from None
        if kind == "error":
            raise payload
        if kind == "done":
            worker.spec = None
        on_message(kind, spec)

    def running(self) -> list[RunSpec]:
        return [worker.spec for worker in self.workers if worker.spec is not None]

    def stop(self) -> None:
        """End every worker now: idle ones are told to stop, busy ones are terminated (their runs
        keep their last checkpoint); a second Ctrl-C meanwhile is ignored."""
        with _sigint_ignored():
            for worker in self.workers:
                if worker.spec is None and worker.process.is_alive():
                    try:
                        worker.inbox.send(None)
                    except OSError:
                        pass
                else:
                    worker.process.terminate()
            for worker in self.workers:
                worker.process.join(5)
                if worker.process.is_alive():
                    worker.process.kill()
                    worker.process.join()
                worker.inbox.close()
                worker.outbox.close()


@contextmanager
def _sigint_ignored() -> Iterator[None]:
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)

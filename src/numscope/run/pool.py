"""Several training runs at once: each in its own process with its own torch threads, on one machine.

A tiny model cannot keep several cores busy from one process (its GEMMs are too small for torch's threads to
pay: ``bench_train_step.py --threads N`` measures it), but independent runs can: with ``jobs`` worker
processes of ``threads`` threads each, the runs of a demo or a study finish about ``jobs`` times sooner on
``jobs × threads`` free cores. Each run is :func:`numscope.run.loop.train_run`, which seeds itself from its
config: a run trained in a worker equals one trained here, bit for bit (tested), and an interrupted run
resumes from its checkpoint wherever it runs next.

With ``jobs=1`` nothing is spawned: the runs train in this process (with ``threads`` threads while they
train), one after the other, in the order the queue gives (:meth:`RunPool.add`'s ``first`` puts a run at
its front). Workers are started with ``spawn`` (no forked copy of a process that holds threads) and get the
run data once, when they start.
"""

from __future__ import annotations

import multiprocessing
import os
import queue
from collections.abc import Callable
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from numscope.run.config import RunData, RunResult

ProgressCallback = Callable[[str, int, float], None]
"""``(run name, step, loss)`` after each step of a run."""


def available_cores() -> int:
    """The CPU cores this process may run on (its affinity where the OS tells it, else the machine's)."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


def default_jobs(threads: int | None) -> int:
    """One worker per ``threads`` free cores (at least one)."""
    return max(1, available_cores() // max(1, threads or 1))


@dataclass
class _Job:
    name: str
    kwargs: dict[str, Any]
    """:func:`train_run`'s arguments other than ``data`` and ``on_step`` (picklable where jobs > 1)."""


_WORKER: dict[str, Any] = {}


def _start_worker(data: RunData, threads: int | None, progress: Any) -> None:
    if threads is not None:
        torch.set_num_threads(threads)
    _WORKER.update(data=data, progress=progress)


def _train_in_worker(name: str, kwargs: dict[str, Any]) -> RunResult:
    from numscope.run.loop import train_run

    progress = _WORKER["progress"]
    return train_run(
        data=_WORKER["data"], on_step=lambda step, loss: progress.put((name, step, loss)), **kwargs
    )


@dataclass
class RunPool:
    """A queue of training runs sharing one :class:`RunData`, trained ``jobs`` at a time.

    ``add`` queues a run (``train_run``'s keyword arguments, without ``data`` and ``on_step``);
    ``next_finished`` starts queued runs while fewer than ``jobs`` train and returns the next one to finish
    as ``(name, result)``. A run's error is raised there, after the other runs' workers are stopped (their
    checkpoints stay: a rerun resumes them); a worker that dies (killed, out of memory) raises
    ``BrokenProcessPool`` there instead of leaving the pool waiting. Use as a context manager, which stops
    the workers on leaving.
    ``on_start(name)``, ``on_step(name, step, loss)`` and ``on_end(name)`` are called in this process.
    """

    data: RunData
    jobs: int = 1
    threads: int | None = None
    on_start: Callable[[str], None] | None = None
    on_step: ProgressCallback | None = None
    on_end: Callable[[str], None] | None = None
    _queue: list[_Job] = field(default_factory=list, init=False)
    _running: dict[str, Future[RunResult]] = field(default_factory=dict, init=False)
    _pool: ProcessPoolExecutor | None = field(default=None, init=False)
    _progress: Any = field(default=None, init=False)

    def __post_init__(self) -> None:
        if isinstance(self.jobs, bool) or not isinstance(self.jobs, int) or self.jobs < 1:
            raise ValueError(f"jobs must be a positive integer (worker processes); got {self.jobs!r}")

    def __enter__(self) -> RunPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __bool__(self) -> bool:
        """Whether a run is queued or training."""
        return bool(self._queue or self._running)

    def add(self, name: str, first: bool = False, **kwargs: Any) -> None:
        """Queue the run ``name`` (last, or next to start with ``first``)."""
        if name in self._running or any(job.name == name for job in self._queue):
            raise ValueError(f"run {name!r} is already queued or training")
        job = _Job(name, kwargs)
        if first:
            self._queue.insert(0, job)
        else:
            self._queue.append(job)

    def next_finished(self) -> tuple[str, RunResult]:
        """Train until a run finishes; its name and result."""
        if not self:
            raise RuntimeError("no run is queued or training")
        if self.jobs == 1:
            return self._train_here(self._queue.pop(0))
        try:
            while self._queue and len(self._running) < self.jobs:
                self._start(self._queue.pop(0))
            return self._wait()
        except BaseException:
            self.close(terminate=True)
            raise

    def close(self, terminate: bool = False) -> None:
        """Stop the workers (at once with ``terminate``; a run they were training resumes on a rerun)."""
        if self._pool is not None:
            if terminate or self._running:
                # a run in a worker cannot be cancelled; its process is stopped (Python < 3.14 has no
                # public call for it: the executor's process table, read defensively)
                processes = getattr(self._pool, "_processes", None) or {}
                for process in list(processes.values()):
                    process.terminate()
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
            self._progress.close()
            self._progress = None
        self._running.clear()

    # ------------------------------------------------------------------------------------------- internals
    def _train_here(self, job: _Job) -> tuple[str, RunResult]:
        from numscope.run.loop import train_run

        self._notify(self.on_start, job.name)
        was_threads = torch.get_num_threads()
        if self.threads is not None:
            torch.set_num_threads(self.threads)
        try:
            result = train_run(
                data=self.data,
                on_step=lambda step, loss: self._notify(self.on_step, job.name, step, loss),
                **job.kwargs,
            )
        finally:
            torch.set_num_threads(was_threads)
            self._notify(self.on_end, job.name)
        return job.name, result

    def _start(self, job: _Job) -> None:
        if self._pool is None:
            context = multiprocessing.get_context("spawn")
            self._progress = context.Queue()
            self._pool = ProcessPoolExecutor(
                self.jobs, context, _start_worker, (self.data, self.threads, self._progress)
            )
        self._notify(self.on_start, job.name)
        self._running[job.name] = self._pool.submit(_train_in_worker, job.name, job.kwargs)

    def _wait(self) -> tuple[str, RunResult]:
        while True:
            self._pump(timeout=0.2)
            for name, pending in self._running.items():
                if pending.done():
                    self._pump(timeout=0.0)  # the steps it reported before finishing
                    del self._running[name]
                    self._notify(self.on_end, name)
                    return name, pending.result()  # raises the run's error

    def _pump(self, timeout: float) -> None:
        """Hand on the progress the workers reported (waiting up to ``timeout`` s for the first)."""
        block = timeout > 0
        while True:
            try:
                name, step, loss = self._progress.get(block, timeout if block else None)
            except queue.Empty:
                return
            self._notify(self.on_step, name, step, loss)
            block = False

    @staticmethod
    def _notify(callback: Callable[..., None] | None, *args: Any) -> None:
        if callback is not None:
            callback(*args)

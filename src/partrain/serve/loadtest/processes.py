"""A load generator spread over several processes, for servers faster than one Python client.

One client process tops out at a few thousand requests per second (each request is
encoded, sent, parsed and timed by Python code on one core). A server on a GPU can
answer faster than that: the client then measures itself, and its own queueing
shows up as the server's latency. `ClientProcesses` starts ``processes`` client
processes once (each imports the client and receives the samples and checkers
once), and each `run` splits one load test over them: a closed loop's clients
(and connections), or an open loop's rate, are dealt out as evenly as they go; all
processes start together (a barrier) and stop at the same duration, and their
reports are merged into one (`LoadReport.merge`: every request's outcome kept, the
latencies pooled, the elapsed time the longest).

Every wait is bounded: start-up, the barrier and each run's results. A process that
fails or dies is a `WorkerError` (``partrain loadtest``: one line, exit status 1).
"""

from __future__ import annotations

import dataclasses
import gc
import queue
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ..._process import process_context, signals_held, start_child
from ...errors import UsageError, WorkerError
from .checking import AnswerChecker
from .config import LoadConfig, parse_target
from .report import LoadReport

_START_TIMEOUT = 120.0  # seconds for every process to import the client and say it is ready
_BARRIER_TIMEOUT = 60.0
_ABORT_TIMEOUT = 5.0  # seconds for the start barrier's abort when the processes stop after their run


def split(total: int, parts: int) -> list[int]:
    """``total`` dealt out over ``parts`` as evenly as it goes, larger shares first: 10, 4 -> 3, 3, 2, 2."""
    return [total // parts + (i < total % parts) for i in range(parts)]


def _share(cfg: LoadConfig, index: int, processes: int) -> LoadConfig | None:
    """Process ``index``'s part of ``cfg`` (None: it sits this run out)."""
    if cfg.concurrency is not None:
        clients = split(cfg.concurrency, processes)[index]
        if clients == 0:
            return None
        requests = split(cfg.requests, processes)[index] if cfg.requests is not None else None
        if requests == 0:
            return None
        return dataclasses.replace(cfg, concurrency=clients, requests=requests, connections=None)
    assert cfg.rate is not None
    requests = split(cfg.requests, processes)[index] if cfg.requests is not None else None
    if requests == 0:
        return None
    connections = split(cfg.connections or 256, processes)[index] or 1
    return dataclasses.replace(cfg, rate=cfg.rate / processes, requests=requests, connections=connections,
                               seed=cfg.seed + index)


def _client_main(index: int, commands: Any, barrier: Any, results: Any) -> None:
    """One client process: take the samples and checkers, then for each command wait for the others,
    run its share and send its report back."""
    from ..._process import child_started
    from .runner import run_load

    # Ctrl-C reaches the whole process group: the parent decides (it closes its clients); a
    # parent that dies however it dies takes its clients with it (not an hour's wait on a queue)
    child_started(sigterm_raises=False)
    try:
        samples, checkers = commands.get(timeout=_START_TIMEOUT)
    except queue.Empty:
        return
    results.put(("ready", index))
    while True:
        try:
            command = commands.get(timeout=3600)
        except queue.Empty:
            return  # the parent is gone or idle for an hour: nothing more will come
        if command is None:
            return
        cfg, check = command
        try:
            barrier.wait()
        except Exception as exc:  # noqa: BLE001 - a broken barrier: another process failed first
            results.put((index, None, 0.0, f"{type(exc).__name__} at the start barrier"))
            continue
        if cfg is None:
            results.put((index, None, 0.0, ""))
            continue
        cpu0, wall0 = time.process_time(), time.perf_counter()
        try:
            report = run_load(cfg, samples=samples, checker=checkers.get(check) if check else None)
        except Exception as exc:  # noqa: BLE001 - one line back to the parent
            results.put((index, None, 0.0, f"{type(exc).__name__}: {exc}"))
            continue
        cpu = (time.process_time() - cpu0) / max(time.perf_counter() - wall0, 1e-9)
        results.put((index, report, cpu, ""))


class ClientProcesses:
    """``processes`` load-generator processes kept alive across load tests (a context manager).

    ``samples`` are the inputs every process sends (the same pool, so one checker
    serves all); ``checkers`` name the `AnswerChecker` a run may ask for.
    """

    def __init__(self, processes: int, samples: Sequence[Mapping[str, np.ndarray]],
                 checkers: Mapping[str, AnswerChecker] | None = None) -> None:
        if processes < 1:
            raise UsageError(f"Expected at least one client process. Received: {processes}")
        ctx = process_context()
        self.processes = processes
        self._checker_names = set(checkers or {})
        self._barrier = ctx.Barrier(processes, timeout=_BARRIER_TIMEOUT)
        self._commands = [ctx.Queue() for _ in range(processes)]
        self._results = ctx.Queue()
        # the samples go through the queue, not the start: a start writes its arguments into a pipe
        # the child reads only once it has imported Python, and an interrupt in that write (Ctrl-C)
        # would leave a child this object cannot name, reading a pickle whose queues are gone
        self._procs: list[Any] = []
        self._broken = ""  # why the processes cannot take another run (a run that did not end cleanly)
        try:
            for i, commands in enumerate(self._commands):
                start_child(ctx, _client_main, (i, commands, self._barrier, self._results),
                            name=f"partrain-loadtest-{i}", keep=self._procs.append, daemon=True)
                commands.put((list(samples), dict(checkers or {})))
            deadline = time.monotonic() + _START_TIMEOUT
            for _ in range(processes):
                self._get(deadline, "to start")
        except BaseException:
            self.close(now=True)
            raise

    def _get(self, deadline: float, what: str) -> Any:
        while True:
            try:
                return self._results.get(timeout=max(0.05, min(1.0, deadline - time.monotonic())))
            except queue.Empty:
                dead = [(i, p) for i, p in enumerate(self._procs) if not p.is_alive()]
                if dead:
                    index, p = dead[0]
                    raise WorkerError(index, f"expected {self.processes} processes {what}; {p.name} exited "
                                             f"with status {p.exitcode}", who="load generator") from None
                if time.monotonic() > deadline:
                    raise WorkerError(-1, f"expected {self.processes} processes {what} in time; no answer",
                                      who="load generator") from None

    def run(self, cfg: LoadConfig, check: str | None = None) -> tuple[LoadReport, float]:
        """One load test split over the processes: the merged report, and the busiest process's CPU share."""
        if self._broken:
            raise WorkerError(-1, f"no more runs after {self._broken}", who="load generator")
        cfg.validate()
        parse_target(cfg.url, cfg.model)  # a bad URL or model name: one line here, not one per process
        if check is not None and check not in self._checker_names:
            raise UsageError(f"Expected a checker among {sorted(self._checker_names)}. Received: {check!r}")
        for i, commands in enumerate(self._commands):
            commands.put((_share(cfg, i, self.processes), check))
        deadline = time.monotonic() + _BARRIER_TIMEOUT + cfg.run_limit() + 30.0
        try:
            got = [self._get(deadline, "to report") for _ in range(self.processes)]
        except WorkerError as exc:  # a late report would be taken for the next run's: no next run
            self._broken = exc.summary
            raise
        failed = [(index, error) for index, _, _, error in got if error]
        if failed:
            raise WorkerError(failed[0][0], failed[0][1], who=f"load-generator process {failed[0][0]}")
        reports = [report for _, report, _, _ in sorted(got, key=lambda g: g[0]) if report is not None]
        return LoadReport.merge(reports), max(cpu for _, _, cpu, _ in got)

    def close(self, now: bool = False) -> None:
        """Stop the processes: after their current run, or with ``now`` (an error, Ctrl-C) at once."""
        if self._barrier is None:  # closed already
            return
        self._stop(now)
        # the queues' and the barrier's semaphores are released here, with Ctrl-C held (see
        # `signals_held`: once in CI the resource tracker printed, after the command's one line,
        # the two warnings of a semaphore unlinked but never unregistered, most likely a finalizer
        # cut by a re-sent SIGINT; not reproduced in 8 runs here), not whenever the
        # interrupted frames that hold this object are collected; a queue's feeder thread may
        # still hold its locks a moment, and releases them in its own thread, where no signal lands
        with signals_held():
            self._broken = self._broken or "the processes were closed"
            self._procs, self._commands, self._results, self._barrier = [], [], None, None
            gc.collect()

    def _stop(self, now: bool) -> None:
        """`close`'s stopping: the processes told to stop (or killed), joined, the queues closed."""
        if not now:
            # a process still waiting for one that died stops waiting now. Not with ``now``: the
            # processes are killed below anyway, and the barrier's lock is shared with them: a
            # fresh-clone CI run hung here for good after Ctrl-C, acquiring it (the abort has no
            # timeout), so it is bounded too
            aborting = threading.Thread(target=self._barrier.abort, name="partrain-loadtest-abort", daemon=True)
            aborting.start()
            aborting.join(_ABORT_TIMEOUT)
        for commands, p in zip(self._commands, self._procs):
            if p.is_alive() and not now:
                commands.put(None)
        for p in self._procs:
            if p.pid is None:  # never started (its start failed, or one before it did)
                continue
            if not now:
                p.join(timeout=10)
            if p.is_alive():
                # SIGKILL: a client has nothing to clean up, and one still starting (its signals
                # blocked until it runs our code) would otherwise die later, with a traceback,
                # after this process has removed the queues it unpickles
                p.kill()
            p.join(timeout=5)
        for commands in self._commands:
            # what a stopped process never read must not hold this one's exit: a queue's feeder
            # thread otherwise waits, at exit, to push the samples into a pipe nobody reads
            commands.cancel_join_thread()
            commands.close()

    def __enter__(self) -> ClientProcesses:
        return self

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        self.close(now=exc_type is not None)

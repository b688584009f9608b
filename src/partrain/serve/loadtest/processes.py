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

Every wait is bounded: start-up, the barrier and each run's results.
"""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import queue
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ...errors import UsageError
from .checking import AnswerChecker
from .config import LoadConfig, parse_target
from .report import LoadReport

_START_TIMEOUT = 120.0  # seconds for every process to import the client and say it is ready
_BARRIER_TIMEOUT = 60.0


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


def _client_main(index: int, samples: Sequence[Mapping[str, np.ndarray]],
                 checkers: Mapping[str, AnswerChecker], commands: Any, barrier: Any, results: Any) -> None:
    """One client process: for each command, wait for the others, run its share, send its report back."""
    from .runner import run_load

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
        ctx = mp.get_context("spawn")
        self.processes = processes
        self._checker_names = set(checkers or {})
        self._barrier = ctx.Barrier(processes, timeout=_BARRIER_TIMEOUT)
        self._commands = [ctx.Queue() for _ in range(processes)]
        self._results = ctx.Queue()
        self._procs = [ctx.Process(target=_client_main, name=f"partrain-loadtest-{i}", daemon=True,
                                   args=(i, list(samples), dict(checkers or {}), self._commands[i], self._barrier,
                                         self._results))
                       for i in range(processes)]
        try:
            for p in self._procs:
                p.start()
            deadline = time.monotonic() + _START_TIMEOUT
            for _ in range(processes):
                self._get(deadline, "to start")
        except BaseException:
            self.close()
            raise

    def _get(self, deadline: float, what: str) -> Any:
        while True:
            try:
                return self._results.get(timeout=max(0.05, min(1.0, deadline - time.monotonic())))
            except queue.Empty:
                dead = [p.name for p in self._procs if not p.is_alive()]
                if dead:
                    raise RuntimeError(f"Expected {self.processes} load-generator processes {what}. "
                                       f"Received: {', '.join(dead)} exited") from None
                if time.monotonic() > deadline:
                    raise RuntimeError(f"Expected {self.processes} load-generator processes {what} in time. "
                                       f"Received: no answer") from None

    def run(self, cfg: LoadConfig, check: str | None = None) -> tuple[LoadReport, float]:
        """One load test split over the processes: the merged report, and the busiest process's CPU share."""
        cfg.validate()
        parse_target(cfg.url, cfg.model)  # a bad URL or model name: one line here, not one per process
        if check is not None and check not in self._checker_names:
            raise UsageError(f"Expected a checker among {sorted(self._checker_names)}. Received: {check!r}")
        for i, commands in enumerate(self._commands):
            commands.put((_share(cfg, i, self.processes), check))
        deadline = time.monotonic() + _BARRIER_TIMEOUT + cfg.run_limit() + 30.0
        got = [self._get(deadline, "to report") for _ in range(self.processes)]
        errors = [error for _, _, _, error in got if error]
        if errors:
            raise RuntimeError(f"load generator: {errors[0]}")
        reports = [report for _, report, _, _ in sorted(got, key=lambda g: g[0]) if report is not None]
        return LoadReport.merge(reports), max(cpu for _, _, cpu, _ in got)

    def close(self) -> None:
        self._barrier.abort()  # a process still waiting for one that died stops waiting now
        for commands, p in zip(self._commands, self._procs):
            if p.is_alive():
                commands.put(None)
        for p in self._procs:
            p.join(timeout=10)
            if p.exitcode is None:
                p.terminate()
                p.join(timeout=5)

    def __enter__(self) -> ClientProcesses:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

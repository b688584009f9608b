"""Processes that run a job's ranks, and the supervisor that watches them.

Every local process a `launch` needs comes from `partrain._process.process_context`
(on Linux a fork of a server that imported torch once: ready in milliseconds; else
``spawn``: a fresh interpreter importing torch, seconds) and runs *jobs*: one rank
of one `launch` each. By default the processes live for one job (``launch`` starts
them and they exit with it). A `WorkerPool` keeps them between jobs, so a notebook
or a test module that trains many times pays the rest of a process's start-up (its
first process group, the first use of each kernel) once:

    with partrain.WorkerPool(2):
        for lr in (0.01, 0.05, 0.1):
            partrain.fit(model_fn, "digits", functools.partial(SGD, lr=lr), workers=2)

Each job still gets a fresh process group on a fresh store, the caller's
environment variables and working directory of the moment, and its own
thread count. A process whose job failed or that died is replaced by a new
one at the next job; the others are stopped when a job fails, since they may
be blocked in a collective with the failed rank.

Every process talks to the caller over a pipe of its own (jobs in, reports
out), never a queue shared between processes: a process killed while writing
to a shared queue keeps its lock forever and every later report waits on it.
A killed process breaks only its own pipe, which goes with it.

The supervisor turns every failure into a `WorkerError` naming the rank that
failed first (not one of its victims), unless the strategy survives the loss
of a worker (an asynchronous parameter server): then the job goes on.

Signals: the caller owns its processes. They ignore SIGINT (Ctrl-C reaches the
caller, which stops them), take SIGTERM as an `Interrupted` that unwinds the job,
and stop by themselves when the caller dies, even by SIGKILL (`watch_parent`):
no orphan goes on training and writing files.
"""

from __future__ import annotations

import atexit
import contextlib
import contextvars
import datetime
import itertools
import math
import os
import pickle
import re
import shutil
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from multiprocessing.connection import wait
from multiprocessing.util import Finalize
from typing import Any

import torch.distributed as dist

from ._process import (
    MAIN_GUARD_EXIT,
    SERVER_GONE_EXIT,
    check_not_bootstrapping,
    child_started,
    forked,
    main_guard_message,
    process_context,
    run_in_process,
    start_child,
    stop_processes,
)
from .env import DistEnv, default_backend, pick_device
from .errors import MainGuardError, UsageError, WorkerError, exception_line, signal_name
from .strategies.base import WORKER, Strategy

_CURRENT: contextvars.ContextVar[WorkerPool | None] = contextvars.ContextVar("partrain_pool", default=None)


@dataclass
class Job:
    """One rank of one `launch`: everything its process needs (pickled to it)."""

    job_id: int
    fn: Callable[..., Any]
    args: tuple
    kwargs: dict
    strategy: Strategy
    store_spec: tuple[str, ...]  # ("file", path) or ("tcp", host, port)
    rank: int
    local_rank: int
    local: int  # processes of this job on this machine
    world: int
    backend: str | None
    device: str | None
    timeout: float
    threads: int | None
    # the caller's environment and working directory now: a reused process has those of an earlier
    # job, a forked one the fork server's
    environ: dict[str, str]
    cwd: str


class WorkerPool:
    """Up to ``processes`` worker processes, started on first use and reused by every `launch`.

    Use it as a context manager: inside ``with WorkerPool(n):`` every `launch` (and
    `fit`) of this thread or task runs on the pool; ``launch(..., pool=p)`` and
    ``fit(..., pool=p)`` name one explicitly. A job needing more processes than the
    pool holds is an error. ``close()`` (or leaving the block) stops the processes.
    """

    def __init__(self, processes: int, *, one_shot: bool = False) -> None:
        if isinstance(processes, bool) or not isinstance(processes, int) or processes < 1:
            raise UsageError(f"Expected a positive number of pool processes. Received: processes={processes!r}")
        self.processes = processes
        self.one_shot = one_shot
        self._ctx = process_context()
        self._slots: list[tuple[Any, Any] | None] = [None] * processes  # (process, its pipe's end here)
        self._jobs = itertools.count(1)
        self._closed = False
        self._tokens: list[contextvars.Token] = []
        # a pool nobody closed must not keep the interpreter from exiting (non-daemon children
        # are joined at exit): stop the processes first
        self._finalizer = Finalize(self, _shutdown, args=(self._slots,), exitpriority=10)

    # ----- context ------------------------------------------------------------------------
    def __enter__(self) -> WorkerPool:
        self._tokens.append(_CURRENT.set(self))
        return self

    def __exit__(self, *exc: Any) -> None:
        _CURRENT.reset(self._tokens.pop())
        self.close()

    @staticmethod
    def current() -> WorkerPool | None:
        """The pool of the innermost ``with WorkerPool(...)`` block, if any."""
        return _CURRENT.get()

    def close(self) -> None:
        """Stop every process of the pool (idempotent)."""
        self._closed = True
        self._finalizer()

    def __repr__(self) -> str:
        alive = sum(1 for s in self._slots if s is not None and s[0].exitcode is None)
        return f"WorkerPool(processes={self.processes}, alive={alive})"

    # ----- jobs ---------------------------------------------------------------------------
    def run(self, fn: Callable[..., Any], args: tuple, kwargs: dict, strat: Strategy,
            store_spec: tuple[str, ...], first_rank: int, local: int, world: int, backend: str | None,
            device: str | None, timeout: float, threads: int | None) -> list[Any]:
        """Run one job's ``local`` ranks on this pool; the workers' values in worker-rank order."""
        check_not_bootstrapping()
        if self._closed:
            raise UsageError("Expected an open WorkerPool. Received: one that was closed")
        if local > self.processes:
            raise UsageError(f"Expected a job of at most {self.processes} processes on this pool. "
                             f"Received: {local} (workers plus the strategy's extra processes)")
        job_id = next(self._jobs)
        procs: dict[int, tuple[Any, Any]] = {}
        ok = False
        try:  # a job that cannot be sent (unpicklable) stops the ranks that already got theirs
            for local_rank in range(local):
                rank = first_rank + local_rank
                job = Job(job_id, fn, args, kwargs, strat, store_spec, rank, local_rank, local, world, backend,
                          device, timeout, threads, dict(os.environ), os.getcwd())
                procs[rank] = self._slot(local_rank, name=f"partrain-rank{rank}")
                try:
                    procs[rank][1].send(job)
                except (pickle.PicklingError, AttributeError, TypeError) as exc:
                    raise UsageError(f"Expected the function and arguments of a launch to be picklable "
                                     f"(module-level functions, functools.partial, plain data). Received: "
                                     f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}") from None
            values = _supervise(procs, job_id, strat.roles(world), strat)
            ok = True
        finally:
            if not ok or self.one_shot:
                stop_processes([proc for proc, _ in procs.values()], grace=5.0 if ok else 0.0)
        roles = strat.roles(world)
        return [values.get(r) for r in sorted(procs) if roles[r] == WORKER]  # None for a lost worker

    def _slot(self, index: int, name: str) -> tuple[Any, Any]:
        slot = self._slots[index]
        if slot is None or slot[0].exitcode is not None:
            if slot is not None:
                slot[1].close()
            here, there = self._ctx.Pipe(duplex=True)
            # a Ctrl-C held back while it starts is raised after: the process is in the pool by
            # then, which stops it
            start_child(self._ctx, _process_main, (there, self.one_shot),
                        name=name if self.one_shot else f"partrain-pool{index}",
                        keep=lambda proc: self._slots.__setitem__(index, (proc, here)))
            slot = self._slots[index]
            there.close()  # the child holds it now: its death is an end-of-file here
        return slot


@contextlib.contextmanager
def no_pool() -> Iterator[None]:
    """Inside, a `launch` starts processes of its own even within a ``with WorkerPool`` block."""
    token = _CURRENT.set(None)
    try:
        yield
    finally:
        _CURRENT.reset(token)


def _shutdown(slots: list[tuple[Any, Any] | None]) -> None:
    live = [s for s in slots if s is not None and s[0].exitcode is None]
    for _, conn in live:
        try:
            conn.send(None)  # asks an idle process to return
        except (OSError, ValueError):
            pass
    stop_processes([proc for proc, _ in live], grace=5.0)
    for i, slot in enumerate(slots):
        if slot is not None:
            slot[1].close()
        slots[i] = None


# ----- inside a pool process ----------------------------------------------------------------

_PARENT_GRACE = 5.0  # seconds for a job to unwind after the caller died, then exit at once


def _process_main(conn: Any, one_shot: bool) -> None:
    rendezvous: list[str] = []  # the temporary directory of the job running now (see the watch)
    try:
        # inside the try: a SIGINT pending since the fork, or the caller's SIGTERM while this
        # process still starts (Ctrl-C right after a launch), ends it quietly like one when idle
        child_started(grace=_PARENT_GRACE, on_death=lambda: _remove_temporary(rendezvous))
        while True:
            try:
                job = conn.recv()
            except EOFError:  # the caller is gone
                return
            if job is None:
                _exit_now()
            rendezvous[:] = _launch_directory(job)
            if not _run_job(job, conn):
                # after a failure the process may hold a broken group or threads stuck in gloo:
                # leave now (the pool starts a fresh one); the report is already written
                conn.close()
                os._exit(1)
            if one_shot:
                _exit_now()
    except KeyboardInterrupt:  # SIGTERM (`Interrupted`) while idle: the caller is stopping us
        return


def _exit_now() -> None:
    """End a process whose work is done: the ``atexit`` handlers (the user's, multiprocessing's
    finalizers) and a flush, as at any exit, then no interpreter teardown, which takes a
    second or so with torch loaded (the caller waits for it at every launch and pool close)."""
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(0)


def _launch_directory(job: Job) -> list[str]:
    """The temporary directory `launch` made for ``job``'s FileStore (none for a TCPStore)."""
    if job.store_spec[0] != "file":
        return []
    directory = os.path.dirname(job.store_spec[1])
    return [directory] if os.path.basename(directory).startswith("partrain-") else []


def _remove_temporary(directories: list[str]) -> None:
    """After the caller died: remove what it can no longer remove itself."""
    for directory in directories:
        shutil.rmtree(directory, ignore_errors=True)


def _run_job(job: Job, conn: Any) -> bool:
    try:
        for key in set(os.environ) - set(job.environ):
            del os.environ[key]
        os.environ.update(job.environ)
        os.chdir(job.cwd)
        os.environ.update(RANK=str(job.rank), WORLD_SIZE=str(job.world), LOCAL_RANK=str(job.local_rank),
                          LOCAL_WORLD_SIZE=str(job.local))
        dev = pick_device(job.local_rank, job.device)
        env = DistEnv(job.rank, job.world, job.local_rank, job.local, dev, job.backend or default_backend(dev))
        if job.store_spec[0] == "file":
            store = dist.FileStore(job.store_spec[1], job.world)
        else:
            store = dist.TCPStore(job.store_spec[1], int(job.store_spec[2]), world_size=None, is_master=False,
                                  timeout=datetime.timedelta(seconds=job.timeout))
        value = run_in_process(job.fn, job.args, job.kwargs, job.strategy, env, job.timeout, job.threads, store)
        # plain pickle: tensors go by value (torch's queue reducers would pass shared-memory
        # handles that die with this process before the parent reads them)
        conn.send(("ok", job.job_id, job.rank, pickle.dumps(value)))
        return True
    except BaseException as exc:  # report, then the caller exits non-zero: the parent stops the others
        summary = exception_line(exc)  # the user's file:line where the error came through their code
        try:
            conn.send(("error", job.job_id, job.rank, (summary, traceback.format_exc())))
        except (OSError, ValueError):  # the caller is gone: nobody to tell
            pass
        return False


# ----- the supervisor (in the caller) --------------------------------------------------------

_GRACE = 1.5
_EXIT_GRACE = 10.0  # seconds from a closed pipe to the process's exit being seen
_PEER_LOSS = re.compile(r"gloo|nccl|connection|closed|reset by peer|timed out|timeout|broken pipe", re.I)


def _is_peer_loss(summary: str) -> bool:
    """An error that is the echo of another rank's failure rather than a cause."""
    return bool(_PEER_LOSS.search(summary))


@dataclass
class _Failure:
    rank: int
    summary: str
    traceback: str
    died: bool = False
    exitcode: int | None = None
    order: int = field(default_factory=lambda: next(_ORDER))


_ORDER = itertools.count()


def _supervise(procs: dict[int, tuple[Any, Any]], job_id: int, roles: list[str],
               strat: Strategy) -> dict[int, Any]:
    """Wait until every rank of the job reported (or was lost); raise on the first real failure.

    ``procs`` maps each rank to its process and the caller's end of its pipe.
    """
    values: dict[int, Any] = {}
    failures: list[_Failure] = []
    lost: set[int] = set()
    first_failure = 0.0
    # rank -> when its pipe ended without a report: it is dying; its exit code comes with its sentinel
    ended: dict[int, float] = {}

    def settled(rank: int) -> bool:
        return rank in values or any(f.rank == rank for f in failures)

    while True:
        waiting = {r: pc for r, pc in procs.items() if not settled(r)}
        ready = set(wait([c for r, (_, c) in waiting.items() if r not in ended]
                         + [p.sentinel for p, _ in waiting.values()], timeout=0.1))
        for rank, (proc, conn) in waiting.items():
            if rank not in ended and (conn in ready or (proc.sentinel in ready and conn.poll())):
                try:  # a report, maybe the last words of a process that exits
                    kind, job, _, payload = conn.recv()
                except (EOFError, OSError):  # it is dying before reporting, or mid-report
                    ended[rank] = time.monotonic()
                    continue
                if job == job_id and kind == "ok":
                    values[rank] = pickle.loads(payload)
                elif job == job_id:
                    failures.append(_Failure(rank, *payload))
            elif proc.sentinel in ready or time.monotonic() - ended.get(rank, math.inf) > _EXIT_GRACE:
                proc.join(timeout=0.1)
                failures.append(_Failure(rank, _describe_exit(proc.exitcode, forked(proc)), "", died=True,
                                         exitcode=proc.exitcode))
        if any(f.exitcode == MAIN_GUARD_EXIT for f in failures):  # every rank fails alike: say why once
            raise MainGuardError(main_guard_message())
        for f in [f for f in failures if f.rank not in lost]:
            if roles[f.rank] == WORKER and strat.survives_worker_loss and not f.summary.startswith("UsageError"):
                print(f"partrain: warning: worker rank {f.rank} {f.summary}; strategy {strat.name!r} goes on "
                      f"without it", file=sys.stderr)
                lost.add(f.rank)
        fatal = [f for f in failures if f.rank not in lost]
        if fatal:
            # peers of a failed rank fail too (connection closed): wait a moment so the
            # error names the rank that failed first, not one of its victims
            first_failure = first_failure or time.monotonic()
            if time.monotonic() - first_failure > _GRACE or all(settled(r) for r in procs):
                root = min(fatal, key=lambda f: (not f.died and _is_peer_loss(f.summary), f.order))
                summary = root.summary
                if not root.died and _is_peer_loss(summary) and len(values) == len(procs) - len(fatal) \
                        and len(fatal) == 1:
                    # no rank failed: the others returned while this one still waited on them
                    summary += (" (every other rank had already returned: a collective this rank entered "
                                "alone, e.g. code that takes another path on some ranks)")
                raise WorkerError(root.rank, summary, root.traceback, role=roles[root.rank],
                                  who=strat.describe_rank(root.rank, len(roles)))
        elif all(settled(r) for r in procs):
            return values


def _describe_exit(code: int | None, from_server: bool = False) -> str:
    if code is not None and code < 0:
        return f"died with {signal_name(-code)} (exit code {code})"
    if code is None:
        return "closed its pipe without reporting a result"
    if code == SERVER_GONE_EXIT and from_server:
        return (f"exited with code {code} without reporting a result, or the fork server it came from died "
                f"(multiprocessing reads that as {code} for each of its processes)")
    return f"exited with code {code} without reporting a result"

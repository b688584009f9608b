"""`launch`: run a function in every process of a job, with a strategy set up.

Three ways in, one function:

- **Local spawn** (the default): ``launch(fn, workers=N)`` starts the
  processes the strategy needs (N workers, plus e.g. parameter servers) with
  the ``spawn`` start method. They meet through a FileStore in a temporary
  directory: no port to pick, none to collide.
- **Many machines without torchrun**: give ``master_addr``/``master_port``,
  ``nnodes`` and ``node_rank``; node 0's launcher hosts a TCPStore there and
  every process meets through it.
- **Under torchrun** (or Slurm, Kubernetes... setting its variables):
  nothing is spawned; this process joins the job torchrun made.

Every rendezvous and every collective has ``timeout`` seconds. A process that
raises or dies makes the launcher stop the others and raise `WorkerError`
naming its rank, with its traceback - unless the strategy survives worker
loss (an asynchronous parameter server), in which case a dead worker is
reported and the job goes on.
"""

from __future__ import annotations

import datetime
import itertools
import os
import pickle
import queue as queue_mod
import re
import signal
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import wait
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from .env import (
    DEFAULT_TIMEOUT,
    DistEnv,
    available_cores,
    default_backend,
    in_torchrun,
    pick_device,
)
from .errors import UsageError, WorkerError
from .strategies.base import WORKER, Strategy, get_strategy


def launch(fn: Callable[..., Any], *args: Any, workers: int, strategy: Strategy | str = "allreduce",
           backend: str | None = None, device: str | None = None, timeout: float = DEFAULT_TIMEOUT,
           threads: int | None = None, nnodes: int = 1, node_rank: int = 0,
           master_addr: str | None = None, master_port: int | None = None, **kwargs: Any) -> list[Any]:
    """Run ``fn(strategy, *args, **kwargs)`` on every worker of a job.

    Args:
        workers: worker processes on this machine (under torchrun: ignored, torchrun decides).
        strategy: a `Strategy` or a registered name ("allreduce", "ps", ...).
        backend: "gloo" or "nccl"; default gloo on CPU, NCCL on CUDA.
        device: "cpu", "cuda" or "auto" (default: CUDA when present).
        timeout: seconds for rendezvous and for every collective.
        threads: intra-op threads per process; default: the cores divided among the
            processes on this machine (at least one).

    Returns:
        The return values of the workers, in worker-rank order, when this call spawned
        them (they must be picklable). Under torchrun, a list holding this process's value.
    """
    if not isinstance(workers, int) or workers < 1:
        raise UsageError(f"Expected a positive number of workers. Received: workers={workers!r}")
    if timeout <= 0:
        raise UsageError(f"Expected a positive timeout in seconds. Received: timeout={timeout!r}")
    strat = get_strategy(strategy)
    if in_torchrun():
        env = DistEnv.from_environ(backend, device)
        return [_run(fn, args, kwargs, strat, env, timeout, threads, store=None)]

    if nnodes < 1 or not 0 <= node_rank < nnodes:
        raise UsageError(f"Expected 0 <= node_rank < nnodes. Received: node_rank={node_rank}, nnodes={nnodes}")
    if nnodes > 1 and (master_addr is None or master_port is None):
        raise UsageError("Expected master_addr and master_port with nnodes > 1. Received: none")
    local = workers + (strat.extra_processes(workers * nnodes) if node_rank == 0 else 0)
    world = workers * nnodes + strat.extra_processes(workers * nnodes)
    first_rank = 0 if node_rank == 0 else local_offset(workers, strat, nnodes, node_rank)
    explicit_threads = threads
    if threads is None:
        threads = max(1, available_cores() // local)

    if world == 1 and master_addr is None:
        # one process: no spawn, no process group
        env = DistEnv(0, 1, 0, 1, pick_device(0, device), backend or default_backend(pick_device(0, device)))
        before = torch.get_num_threads()
        try:  # explicit threads apply here too, and the caller's setting comes back after
            return [_run(fn, args, kwargs, strat, env, timeout, explicit_threads, store=None)]
        finally:
            torch.set_num_threads(before)

    with tempfile.TemporaryDirectory(prefix="partrain-") as tmp:
        store_spec: tuple[str, ...]
        host_store = None
        if master_addr is None:
            store_spec = ("file", os.path.join(tmp, "rendezvous"))
        else:
            if node_rank == 0:
                try:
                    host_store = dist.TCPStore(master_addr, int(master_port), world_size=None,
                                               is_master=True, timeout=datetime.timedelta(seconds=timeout),
                                               wait_for_workers=False)
                except Exception as exc:
                    raise UsageError(f"Expected to bind the master address {master_addr}:{master_port}. "
                                     f"Received: {exc}") from None
            else:
                _wait_reachable(master_addr, int(master_port), timeout)
            store_spec = ("tcp", master_addr, str(master_port))
        try:
            return _spawn(fn, args, kwargs, strat, store_spec, first_rank, local, world, backend, device, timeout, threads)
        finally:
            del host_store


def local_offset(workers: int, strat: Strategy, nnodes: int, node_rank: int) -> int:
    """Global rank of this node's first process (node 0 also hosts the extra processes)."""
    return strat.extra_processes(workers * nnodes) + workers * node_rank


def _wait_reachable(host: str, port: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection((host, port), timeout=min(2.0, timeout)):
                return
        except OSError as exc:
            if time.monotonic() >= deadline:
                raise UsageError(
                    f"Expected a reachable master at {host}:{port}. Received: no answer within "
                    f"{timeout:g} s ({exc.strerror or exc})"
                ) from None
            time.sleep(0.2)


def _spawn(fn: Callable[..., Any], args: tuple, kwargs: dict, strat: Strategy, store_spec: tuple[str, ...],
           first_rank: int, local: int, world: int, backend: str | None,
           device: str | None, timeout: float, threads: int) -> list[Any]:
    ctx = mp.get_context("spawn")
    results: Any = ctx.Queue()
    procs = {}
    for local_rank in range(local):
        rank = first_rank + local_rank
        p = ctx.Process(
            target=_worker_entry,
            args=(fn, args, kwargs, strat, store_spec, rank, local_rank, local, world, backend, device,
                  timeout, threads, results),
            name=f"partrain-rank{rank}",
            daemon=False,
        )
        p.start()
        procs[rank] = p

    roles = strat.roles(world)
    worker_ranks = [r for r, role in enumerate(roles) if role == WORKER]
    values: dict[int, Any] = {}
    failures: list[_Failure] = []
    lost: set[int] = set()
    first_failure = 0.0
    try:
        while True:
            _drain(results, values, failures)
            for rank, p in procs.items():
                if p.exitcode is None or rank in values or rank in lost or any(f.rank == rank for f in failures):
                    continue
                _drain(results, values, failures, block=0.5)  # it may have reported just before exiting
                if rank not in values and not any(f.rank == rank for f in failures):
                    failures.append(_Failure(rank, _describe_exit(p.exitcode), "", died=True))
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
                if time.monotonic() - first_failure > _GRACE or all(p.exitcode is not None for p in procs.values()):
                    root = min(fatal, key=lambda f: (not f.died and _is_peer_loss(f.summary), f.order))
                    raise WorkerError(root.rank, root.summary, root.traceback, role=roles[root.rank])
            alive = [p for p in procs.values() if p.exitcode is None]
            if not alive and not fatal:
                break
            wait([p.sentinel for p in alive], timeout=0.1)
        _drain(results, values, failures, block=0.1)
    except BaseException:
        _stop(procs.values())
        raise
    finally:
        for p in procs.values():
            p.join(timeout=5)
        _stop(procs.values())
        results.close()
    return [values.get(r) for r in worker_ranks if procs.get(r) is not None]


_GRACE = 1.5
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
    order: int = field(default_factory=lambda: next(_ORDER))


_ORDER = itertools.count()


def _drain(results: Any, values: dict[int, Any], failures: list[_Failure], block: float = 0.0) -> None:
    while True:
        try:
            kind, rank, payload = results.get(timeout=block) if block else results.get_nowait()
        except queue_mod.Empty:
            return
        block = 0.0
        if kind == "ok":
            values[rank] = pickle.loads(payload)
        else:
            failures.append(_Failure(rank, *payload))


def _describe_exit(code: int | None) -> str:
    if code is not None and code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"died with {name} (exit code {code})"
    return f"exited with code {code} without reporting a result"


def _stop(procs: Any) -> None:
    procs = [p for p in procs if p.exitcode is None]
    for p in procs:
        p.terminate()
    deadline = time.monotonic() + 5
    for p in procs:
        p.join(timeout=max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.exitcode is None:
            p.kill()
            p.join(timeout=5)


def _worker_entry(fn: Callable[..., Any], args: tuple, kwargs: dict, strat: Strategy,
                  store_spec: tuple[str, ...], rank: int, local_rank: int, local: int, world: int,
                  backend: str | None, device: str | None, timeout: float, threads: int,
                  results: Any) -> None:
    try:
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(local_rank),
                          LOCAL_WORLD_SIZE=str(local))
        dev = pick_device(local_rank, device)
        env = DistEnv(rank, world, local_rank, local, dev, backend or default_backend(dev))
        td = datetime.timedelta(seconds=timeout)
        if store_spec[0] == "file":
            store = dist.FileStore(store_spec[1], world)
        else:
            store = dist.TCPStore(store_spec[1], int(store_spec[2]), world_size=None, is_master=False,
                                  timeout=td)
        value = _run(fn, args, kwargs, strat, env, timeout, threads, store=store)
        # plain pickle: tensors go by value (torch's queue reducers would pass shared-memory
        # handles that die with this process before the parent reads them)
        results.put(("ok", rank, pickle.dumps(value)))
    except BaseException as exc:  # report, then exit non-zero: the parent stops the others
        summary = f"{type(exc).__name__}: {exc}".splitlines()[0] if str(exc) else type(exc).__name__
        results.put(("error", rank, (summary, traceback.format_exc())))
        results.close()
        results.join_thread()
        os._exit(1)


def tune_allocator() -> bool:
    """Keep freed tensor memory in glibc's heap instead of returning it to the OS.

    glibc serves large blocks with mmap and gives them back on free, so every training
    step page-faults its activations in afresh; with several processes per machine this
    cost 15-20% of a DDP step on CPU (bench core, raw DDP vs fit, same kernels). Raising
    the mmap and trim thresholds makes the heap reuse those blocks. Applied in worker
    processes partrain starts or joins; ``PARTRAIN_MALLOC_TUNING=0`` turns it off.
    """
    if os.environ.get("PARTRAIN_MALLOC_TUNING", "1") == "0" or not sys.platform.startswith("linux"):
        return False
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        m_trim_threshold, m_mmap_threshold = -1, -3
        ok = libc.mallopt(m_mmap_threshold, 32 * 1024 * 1024) and libc.mallopt(m_trim_threshold, 1 << 30)
        return bool(ok)
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to tune
        return False


def join_store(env: DistEnv, timeout: float) -> dist.Store:
    """The job's store when torchrun (or a scheduler speaking its protocol) started us.

    Under torchrun's elastic agent (``TORCHELASTIC_USE_AGENT_STORE=True``) the agent hosts
    the store and every worker is a client; otherwise rank 0 hosts it, unless a process
    group already exists (Ray Train made one: its store is up, join it). Keys are prefixed
    by ``TORCHELASTIC_RESTART_COUNT``: the agent's store outlives a restart, and a new
    attempt must not meet the keys of the last one (re-forming gloo fails on them).
    """
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not addr or not port or not port.isdigit():
        raise UsageError(f"Expected MASTER_ADDR and a numeric MASTER_PORT for a job of {env.world_size} "
                         f"processes. Received: MASTER_ADDR={addr!r}, MASTER_PORT={port!r}")
    agent_hosts = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    is_host = env.rank == 0 and not agent_hosts and not dist.is_initialized()
    store = dist.TCPStore(addr, int(port), world_size=None, is_master=is_host,
                          timeout=datetime.timedelta(seconds=timeout), wait_for_workers=False)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"partrain/attempt{attempt}", store)


def _run(fn: Callable[..., Any], args: tuple, kwargs: dict, strat: Strategy, env: DistEnv, timeout: float,
         threads: int | None, store: Any) -> Any:
    """Inside one process: threads, process group, strategy, then the role's body."""
    if env.world_size > 1:
        tune_allocator()
    if threads is not None:
        torch.set_num_threads(threads)
    if env.device.type == "cuda":
        torch.cuda.set_device(env.device)
    own_group = False
    if env.world_size > 1:
        if store is None:  # torchrun, Slurm, Ray...: the job's store at MASTER_ADDR:MASTER_PORT
            store = join_store(env, timeout)
        if not dist.is_initialized():
            dist.init_process_group(env.backend, store=store, rank=env.rank, world_size=env.world_size,
                                    timeout=datetime.timedelta(seconds=timeout))
            own_group = True
    try:
        strat.setup(env, store=store, timeout=timeout)
        role = strat.role
        if role == WORKER:
            return fn(strat, *args, **kwargs)
        return strat.run_role(role)
    finally:
        try:
            strat.close()
        finally:
            if own_group and dist.is_initialized():
                dist.destroy_process_group()

"""`launch`: run a function in every process of a job, with a strategy set up.

Three ways in, one function:

- **Local spawn** (the default): ``launch(fn, workers=N)`` starts the
  processes the strategy needs (N workers, plus e.g. parameter servers), forks
  of a server that imported torch once (`partrain._process.process_context`;
  ``spawn`` off Linux or with ``PARTRAIN_START_METHOD=spawn``). They meet
  through a FileStore in a temporary directory: no port to pick, none to collide.
- **Many machines without torchrun**: give ``master_addr``/``master_port``,
  ``nnodes`` and ``node_rank``; node 0's launcher hosts a TCPStore there and
  every process meets through it.
- **Under torchrun, Slurm's srun, a Kubeflow PyTorchJob or Ray Train**
  (`partrain.env.external_job` reads their variables): nothing is spawned; this
  process is one rank of the job that launcher made and joins it.

Local processes live for one call, or as long as a `WorkerPool` that runs
many calls (see `partrain.pool`).

Every rendezvous and every collective has ``timeout`` seconds. A process that
raises or dies makes the launcher stop the others and raise `WorkerError`
naming its rank, with its traceback - unless the strategy survives worker
loss (an asynchronous parameter server), in which case a dead worker is
reported and the job goes on.

Signals: while local processes run, SIGTERM (and SIGINT) raise `Interrupted`, a
`KeyboardInterrupt`, in the caller's main thread, unless the caller installed a
handler of its own: the processes are stopped, the temporary directory removed,
and the exception reaches the caller; the handlers are put back on return. If
the caller dies without unwinding (SIGKILL), its processes notice and stop.
A script that calls `launch` (or `fit`) at import time, outside
``if __name__ == "__main__":``, ends with one line saying so (`SystemExit`).
"""

from __future__ import annotations

import datetime
import math
import os
import socket
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from ._process import check_not_bootstrapping, join_store, run_in_process, tune_allocator
from ._signals import signals_raise
from .env import (
    DEFAULT_TIMEOUT,
    DistEnv,
    available_cores,
    check_device,
    check_ranks_per_gpu,
    default_backend,
    external_launcher,
    pick_device,
)
from .errors import MainGuardError, UsageError
from .pool import WorkerPool
from .strategies.base import Strategy, get_strategy

__all__ = ["check_arguments", "join_store", "launch", "local_offset", "tune_allocator"]


def launch(fn: Callable[..., Any], *args: Any, workers: int, strategy: Strategy | str = "allreduce",
           backend: str | None = None, device: str | None = None, timeout: float = DEFAULT_TIMEOUT,
           threads: int | None = None, nnodes: int = 1, node_rank: int = 0,
           master_addr: str | None = None, master_port: int | None = None, pool: WorkerPool | None = None,
           **kwargs: Any) -> list[Any]:
    """Run ``fn(strategy, *args, **kwargs)`` on every worker of a job.

    Args:
        workers: worker processes on this machine (under torchrun: ignored, torchrun decides).
        strategy: a `Strategy` or a registered name ("allreduce", "ps", ...).
        backend: "gloo" or "nccl"; default gloo on CPU, NCCL on CUDA.
        device: "cpu", "cuda" or "auto" (default: CUDA when present).
        timeout: seconds for rendezvous and for every collective.
        threads: intra-op threads per process; default: the cores this process may use
            (`available_cores`) divided among the processes on this machine (at least one).
        pool: a `WorkerPool` whose processes run the job (default: the one of an enclosing
            ``with WorkerPool(...)`` block, else processes started for this call alone).

    Returns:
        The return values of the workers, in worker-rank order, when this call spawned
        them (they must be picklable). Under torchrun, a list holding this process's value.
    """
    check_arguments(workers, timeout, threads, device=device, backend=backend)
    strat = get_strategy(strategy)
    if external_launcher() is not None:  # torchrun, srun, a PyTorchJob, Ray: join, spawn nothing
        env = DistEnv.from_environ(backend, device)
        return [run_in_process(fn, args, kwargs, strat, env, timeout, threads, store=None)]

    if nnodes < 1 or not 0 <= node_rank < nnodes:
        raise UsageError(f"Expected 0 <= node_rank < nnodes. Received: node_rank={node_rank}, nnodes={nnodes}")
    if nnodes > 1 and (master_addr is None or master_port is None):
        raise UsageError("Expected master_addr and master_port with nnodes > 1. Received: none")
    if master_addr is not None and master_port is None:
        raise UsageError(f"Expected master_port with master_addr. Received: master_addr={master_addr!r}, "
                         f"master_port=None")
    if strat.max_workers is not None and workers * nnodes > strat.max_workers:  # its setup would refuse
        raise UsageError(f"Expected --workers {strat.max_workers} for strategy {strat.name!r}. "
                         f"Received: {workers * nnodes}")
    local = workers + (strat.extra_processes(workers * nnodes) if node_rank == 0 else 0)
    world = workers * nnodes + strat.extra_processes(workers * nnodes)
    first_rank = 0 if node_rank == 0 else local_offset(workers, strat, nnodes, node_rank)
    explicit_threads = threads
    if threads is None:
        threads = max(1, available_cores() // local)

    if not starts_processes(workers, strat, nnodes, master_addr):
        # one process: no spawn, no process group
        env = DistEnv(0, 1, 0, 1, pick_device(0, device), backend or default_backend(pick_device(0, device)))
        before = torch.get_num_threads()
        try:  # explicit threads apply here too, and the caller's setting comes back after
            return [run_in_process(fn, args, kwargs, strat, env, timeout, explicit_threads, store=None)]
        finally:
            torch.set_num_threads(before)

    check_not_bootstrapping()
    try:
        with signals_raise(take_over=False):
            return _spawn(fn, args, kwargs, strat, pool, local, world, first_rank, node_rank, backend, device,
                          timeout, threads, master_addr, master_port)
    except MainGuardError as exc:  # the caller's script is at fault, not this call: no traceback
        raise SystemExit(str(exc)) from None


def starts_processes(workers: int, strat: Strategy, nnodes: int = 1, master_addr: str | None = None) -> bool:
    """Whether `launch` starts processes for this job: more than one in all, or another node to meet,
    and no launcher of its own (torchrun, srun, a PyTorchJob, Ray) that started this process."""
    world = workers * nnodes + strat.extra_processes(workers * nnodes)
    return external_launcher() is None and (world > 1 or master_addr is not None)


def _spawn(fn: Callable[..., Any], args: tuple, kwargs: dict, strat: Strategy, pool: WorkerPool | None,
           local: int, world: int, first_rank: int, node_rank: int, backend: str | None, device: str | None,
           timeout: float, threads: int, master_addr: str | None, master_port: int | None) -> list[Any]:
    """Run the job on local processes that meet through a FileStore here or a TCPStore on node 0."""
    with tempfile.TemporaryDirectory(prefix="partrain-") as tmp:
        store_spec: tuple[str, ...]
        host_store = None
        if master_addr is None:
            store_spec = ("file", os.path.join(tmp, "rendezvous"))
        else:
            assert master_port is not None  # launch refused master_addr without it
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
        runner = pool or WorkerPool.current() or WorkerPool(local, one_shot=True)
        try:
            return runner.run(fn, args, kwargs, strat, store_spec, first_rank, local, world, backend, device,
                              timeout, threads)
        finally:
            if runner.one_shot:
                runner.close()
            del host_store


def check_arguments(workers: Any, timeout: Any, threads: Any = None, *, device: str | None = None,
                    backend: str | None = None) -> None:
    """One line for a bad worker count, timeout, thread count, device or backend (before any process starts)."""
    # workers=None: torchrun's (srun's, Ray's) job decides, and only there
    for name, value, optional in (("workers", workers, external_launcher() is not None), ("threads", threads, True)):
        if (value is not None or not optional) and (isinstance(value, bool) or not isinstance(value, int)
                                                      or value < 1):
            raise UsageError(f"Expected a positive number of {name}. Received: {name}={value!r}")
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not math.isfinite(timeout) \
            or timeout <= 0:
        raise UsageError(f"Expected a positive, finite timeout in seconds. Received: timeout={timeout!r}")
    check_device(device, backend)
    if workers is not None and external_launcher() is None:  # under torchrun, torchrun decides
        check_ranks_per_gpu(workers, device, backend)


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



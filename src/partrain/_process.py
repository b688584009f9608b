"""Inside one process of a job: threads, allocator, the job's store, process group, strategy.

`run_in_process` is what every process of a job runs, whoever started it: a
process `partrain.launch` spawned, a `WorkerPool` process, torchrun's worker,
or the caller itself in a one-process run.
"""

from __future__ import annotations

import datetime
import os
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from .env import DistEnv
from .errors import UsageError
from .strategies.base import WORKER, Strategy


def run_in_process(fn: Callable[..., Any], args: tuple, kwargs: dict, strat: Strategy, env: DistEnv,
                   timeout: float, threads: int | None, store: Any) -> Any:
    """Threads, process group, strategy, then the role's body; the group goes when it returns."""
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

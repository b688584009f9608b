"""`DistEnv`: where this process stands in the job (rank, world size, device, backend).

Read from torchrun's environment variables (RANK, WORLD_SIZE, LOCAL_RANK,
LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT) or built by `partrain.launch`.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from .errors import UsageError

#: seconds for every rendezvous, collective and queue wait unless the caller says otherwise
DEFAULT_TIMEOUT = 300.0


@dataclass(frozen=True)
class DistEnv:
    """One process's place in the job.

    ``rank``/``world_size`` count every process of the job (servers too, for
    strategies that start some); a strategy maps them to worker ranks.
    """

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    device: torch.device = torch.device("cpu")
    backend: str = "gloo"

    @property
    def is_main(self) -> bool:
        """True on global rank 0: the process that logs, writes files, shows progress."""
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @classmethod
    def from_environ(cls, backend: str | None = None, device: str | None = None) -> DistEnv:
        """Read torchrun's variables; a plain ``python script.py`` gives rank 0 of 1."""

        def read(name: str, default: int) -> int:
            raw = os.environ.get(name)
            if raw is None or raw == "":
                return default
            try:
                return int(raw)
            except ValueError:
                raise UsageError(f"Expected an integer in ${name}. Received: {raw!r}") from None

        rank = read("RANK", 0)
        world_size = read("WORLD_SIZE", 1)
        local_rank = read("LOCAL_RANK", 0)
        local_world_size = read("LOCAL_WORLD_SIZE", world_size)
        if world_size < 1 or not 0 <= rank < world_size:
            raise UsageError(f"Expected 0 <= RANK < WORLD_SIZE. Received: RANK={rank}, WORLD_SIZE={world_size}")
        dev = pick_device(local_rank, device)
        return cls(rank, world_size, local_rank, local_world_size, dev, backend or default_backend(dev))


def in_torchrun() -> bool:
    """True when torchrun (or a scheduler speaking its protocol) started this process."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ


def pick_device(local_rank: int, device: str | None = None) -> torch.device:
    """``cuda:<local_rank>`` when CUDA is there (and not refused), else the CPU."""
    if device is not None and device != "auto":
        dev = torch.device(device)
        if dev.type == "cuda" and dev.index is None:
            dev = torch.device("cuda", local_rank % max(1, torch.cuda.device_count()))
        return dev
    if torch.cuda.is_available():
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device("cpu")


def check_device(device: str | None = None, backend: str | None = None) -> None:
    """One line, before any process starts, for a device or backend this machine cannot give.

    ``device``: None or "auto" (CUDA when present), "cpu", "cuda", "cuda:N"...;
    ``backend``: a torch.distributed backend ("gloo", "nccl", ...). NCCL needs CUDA.
    """
    dev = None
    if device is not None and device != "auto":
        try:
            dev = torch.device(device)
        except (RuntimeError, TypeError):
            raise UsageError(f"Expected a device such as cpu, cuda, cuda:1 or auto. Received: {device!r}") from None
        if dev.type == "cuda":
            _check_cuda(f"--device {device}")
            if dev.index is not None and dev.index >= torch.cuda.device_count():
                raise UsageError(f"Expected a visible CUDA device for --device {device}. Received: "
                                 f"{torch.cuda.device_count()} visible (cuda:0 to cuda:{torch.cuda.device_count() - 1})")
    if backend is None:
        return
    import torch.distributed as dist

    known = [b for b in dist.Backend.backend_list if b != "undefined"]
    if backend not in known:
        raise UsageError(f"Expected a backend among {', '.join(known)}. Received: {backend!r}")
    if backend == "nccl":
        _check_cuda("--backend nccl")
        if dev is not None and dev.type != "cuda":
            raise UsageError(f"Expected --device cuda with --backend nccl. Received: --device {device}")


def _check_cuda(what: str) -> None:
    if not torch.cuda.is_available():
        raise UsageError(f"Expected a CUDA device for {what}. Received: none visible "
                         f"(torch.cuda.is_available() is False)")


def default_backend(device: torch.device) -> str:
    """gloo on CPU, NCCL on CUDA."""
    return "nccl" if device.type == "cuda" else "gloo"


def available_cores() -> int:
    """The cores this process may run on: its CPU affinity, capped by a cgroup CPU quota.

    ``os.cpu_count()`` counts the host's cores; under ``taskset``, a container limit
    (Docker ``--cpus``, Kubernetes CPU limits) or Slurm's ``--cpus-per-task`` that
    oversubscribes. ``PARTRAIN_CORES`` overrides both (a positive integer).
    """
    raw = os.environ.get("PARTRAIN_CORES", "").strip()
    if raw:
        try:
            value = int(raw)
        except ValueError:
            value = 0
        if value < 1:
            raise UsageError(f"Expected a positive integer in $PARTRAIN_CORES. Received: {raw!r}")
        return value
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # macOS, Windows: no affinity mask
        cores = os.cpu_count() or 1
    quota = cgroup_cpu_quota()
    if quota is not None:
        cores = min(cores, max(1, math.ceil(quota)))
    return max(1, cores)


def cgroup_cpu_quota(root: str = "/sys/fs/cgroup") -> float | None:
    """CPUs' worth of time the cgroup allows per period (``quota / period``), or None.

    Reads cgroup v2's ``cpu.max`` ("max 100000" = no limit) for this process's
    cgroup, else v1's ``cpu.cfs_quota_us`` (-1 = no limit) / ``cpu.cfs_period_us``.
    """
    base = Path(root)
    try:
        v2_path = next((line.split("::", 1)[1].strip() for line in Path("/proc/self/cgroup").read_text().splitlines()
                        if line.startswith("0::")), "/")
    except OSError:
        v2_path = "/"
    for cpu_max in (base / v2_path.lstrip("/") / "cpu.max", base / "cpu.max"):
        try:
            quota, period = cpu_max.read_text().split()[:2]
        except (OSError, ValueError):
            continue
        return None if quota == "max" else _ratio(quota, period)
    try:
        quota = (base / "cpu" / "cpu.cfs_quota_us").read_text().strip()
        period = (base / "cpu" / "cpu.cfs_period_us").read_text().strip()
    except OSError:
        return None
    return None if quota.startswith("-") else _ratio(quota, period)


def _ratio(quota: str, period: str) -> float | None:
    try:
        q, p = int(quota), int(period)
    except ValueError:
        return None
    return q / p if q > 0 and p > 0 else None

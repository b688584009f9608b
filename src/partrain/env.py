"""`DistEnv`: where this process stands in the job (rank, world size, device, backend).

Read from torchrun's environment variables (RANK, WORLD_SIZE, LOCAL_RANK,
LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT) or built by `partrain.launch`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from .errors import UsageError


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


def default_backend(device: torch.device) -> str:
    """gloo on CPU, NCCL on CUDA."""
    return "nccl" if device.type == "cuda" else "gloo"

"""What ``partrain compare`` sees inside the workers, without changing the training loop.

`probed_model` is the ``model_fn`` the comparison hands to `partrain.fit`: it builds the
user's model and attaches hooks to it (no wrapper module, so a pipeline still cuts the
user's own children and checkpoints keep the user's parameter names):

- a forward pre-hook records the start time and batch size of every training forward:
  the steady-state throughput after the warm-up steps comes from these times, not from
  an epoch's seconds that include the first, slow steps;
- the same hook, on the straggler worker, sleeps ``slowdown - 1`` times the work of its
  previous step (from that step's forward, after its delay, to this one): every
  part of its step, data, compute, optimizer and communication, takes ``slowdown`` times
  as long, as on a slower machine;
- the resident memory of the process is sampled at each record.

The records go to one small JSON file per worker in the run's directory, rewritten
(through a rename) every half second and at each evaluation forward (the end of an
epoch), so the parent reads them after the run.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

FLUSH_SECONDS = 0.5
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


@dataclass(frozen=True)
class ProbeSpec:
    """Where the records go, which global ranks are workers (in worker order), and the straggler."""

    directory: str
    worker_ranks: tuple[int, ...]
    straggler_worker: int | None = None
    slowdown: float = 1.0


def probed_model(model_fn: Callable[[], nn.Module], spec: ProbeSpec) -> nn.Module:
    """``model_fn()`` with the recording (and straggler) hooks of this process's worker attached."""
    model = model_fn()
    rank = int(os.environ.get("RANK", "0"))  # a one-process run has no RANK: it is rank 0
    if rank in spec.worker_ranks:
        _Recorder(model, spec, spec.worker_ranks.index(rank))
    return model


def rss_bytes() -> int:
    """This process's resident memory now (Linux /proc; 0 where it cannot be read)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, IndexError, ValueError):
        return 0


class _Recorder:
    """The hooks of one worker's model and the records they keep (see the module docstring)."""

    def __init__(self, model: nn.Module, spec: ProbeSpec, worker: int) -> None:
        self.spec, self.worker = spec, worker
        self.slow = spec.straggler_worker == worker and spec.slowdown > 1
        self.times: list[float] = []
        self.sizes: list[int] = []
        self.peak_rss = rss_bytes()
        self.last_flush = time.perf_counter()
        model.register_forward_pre_hook(self._before_forward)

    def _before_forward(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        if not (module.training and torch.is_grad_enabled()):
            self.flush()  # an evaluation: the end of an epoch
            return
        if self.slow and self.times:
            work = time.perf_counter() - self.times[-1]  # the previous step, its delay not included
            # the injected delay itself (what makes this worker the straggler), not a wait on anything
            time.sleep((self.spec.slowdown - 1) * work)
        now = time.perf_counter()
        self.times.append(now)
        first = args[0] if args else None
        self.sizes.append(int(first.shape[0]) if isinstance(first, torch.Tensor) and first.dim() else 0)
        if now - self.last_flush >= FLUSH_SECONDS:
            self.flush()

    def flush(self) -> None:
        if not self.times:
            return
        self.peak_rss = max(self.peak_rss, rss_bytes())
        path = os.path.join(self.spec.directory, f"worker{self.worker}.json")
        with open(f"{path}.tmp", "w") as f:
            json.dump({"times": self.times, "sizes": self.sizes, "peak_rss": self.peak_rss}, f)
        os.replace(f"{path}.tmp", path)
        self.last_flush = time.perf_counter()


def read_records(directory: str, workers: int) -> list[dict[str, Any]]:
    """Each worker's records (an empty dict for a worker that wrote none, e.g. pipeline stages)."""
    out = []
    for w in range(workers):
        try:
            with open(os.path.join(directory, f"worker{w}.json")) as f:
                out.append(json.load(f))
        except (OSError, ValueError):
            out.append({})
    return out


def steady_rate(records: list[dict[str, Any]], warmup: int) -> float:
    """Samples per second of all workers together, after each worker's first ``warmup`` steps.

    A worker's rate is the samples of its steps ``warmup .. k-1`` over the time from the
    start of step ``warmup`` to the start of step ``k`` (its last recorded step); a worker
    with few steps (a straggler that claimed few batches) leaves out fewer. NaN when a worker
    recorded fewer than 3 steps.
    """
    total = 0.0
    for rec in records:
        times, sizes = rec.get("times", []), rec.get("sizes", [])
        skip = min(warmup, len(times) - 3)
        if skip < 0 or times[-1] <= times[skip]:
            return float("nan")
        total += sum(sizes[skip:-1]) / (times[-1] - times[skip])
    return total if records else float("nan")

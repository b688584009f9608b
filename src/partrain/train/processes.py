"""How many processes `partrain train` starts when the command does not say (issue 55, item 8).

Data parallel on one CPU host trades intra-op threads for processes: ``n`` workers each run
the step on ``cores / n`` threads, then all-reduce the gradient; one process runs it on every
core and communicates nothing. On a small model the all-reduce (gloo over loopback, on the
same busy cores) costs more than the threads lose, and the workers take a second or two to
start: the bundled digits job ran at about 9,300 samples/s in one process and 7,100 in two.

So, when neither ``--strategy`` nor ``--workers`` is given, the caller times a few steps of
the model on a copy, with every core's threads and with a worker's share, and estimates the
whole run both ways from `scaling.allreduce_seconds` on `LOOPBACK`:

    one process:  steps(b) * t(cores threads)
    n workers:    steps(n b) * (t(cores/n threads) + allreduce(n, S)) + start

and takes the shorter. The estimate and its parts are the start line. `choose` is the rule on
given timings (what the tests drive); `probe` takes the timings.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset

from ..scaling import Link, allreduce_seconds, parameter_bytes
from .prepare import first_batch
from .task import Task

#: gloo's all-reduce between workers that fill every core of a host, over loopback: what one
#: synchronous step costs beyond the worker's own compute, fitted on a 2-core host to two
#: models (a 10k-parameter MLP: +2.4 ms a step; the 151k-parameter digits CNN: +4.6 ms), so
#: it holds DDP's hooks, the wait for the slower worker and the reduction's CPU beside the
#: transfer (gloo alone moved 1 MB in 2 ms there)
LOOPBACK = Link(bandwidth=300e6, latency_s=1e-3)
#: seconds that starting the workers (fork server, process group) adds before the first step,
#: over a run in the caller's process (measured on the same host: 1.5 to 2.5 s)
WORKER_START_S = 1.5
#: the probe's bound per thread setting: steps are timed until this much time is spent
PROBE_BUDGET_S = 0.3
PROBE_STEPS = 5


@dataclass(frozen=True)
class Choice:
    """The estimate for one run: ``workers`` is what it chose (1: one process, ``single``)."""

    workers: int
    candidates: int  # the workers data parallel would use (one per core)
    batch: int
    step_alone_s: float  # one process, every core's threads
    step_worker_s: float  # one worker's step on its share of the threads
    comm_s: float  # the all-reduce a synchronous step adds
    model_bytes: int
    single_steps: int
    parallel_steps: int
    start_s: float = WORKER_START_S

    @property
    def single_run_s(self) -> float:
        return self.single_steps * self.step_alone_s

    @property
    def parallel_run_s(self) -> float:
        return self.parallel_steps * (self.step_worker_s + self.comm_s) + self.start_s

    @property
    def single_rate(self) -> float:
        return self.batch / self.step_alone_s

    @property
    def parallel_rate(self) -> float:
        return self.candidates * self.batch / (self.step_worker_s + self.comm_s)

    def line(self) -> str:
        """The start line: what was chosen, the estimate, its parts, and how to choose otherwise."""
        n = self.candidates
        parts = (f"a step of {self.step_alone_s * 1e3:.1f} ms on {n} cores' threads against "
                 f"{self.step_worker_s * 1e3:.1f} ms per worker + {self.comm_s * 1e3:.1f} ms to all-reduce "
                 f"{self.model_bytes / 1e6:.2g} MB, and {self.start_s:g} s to start the workers")
        estimate = (f"estimated {self.single_run_s:.1f} s in one process against {self.parallel_run_s:.1f} s "
                    f"with allreduce on {n} workers ({self.single_rate:,.0f} against "
                    f"{self.parallel_rate:,.0f} samples/s; {parts})")
        if self.workers == 1:
            return (f"partrain train: one process (single): {estimate}; --strategy allreduce uses every core "
                    "as workers")
        return f"partrain train: allreduce on {n} workers: {estimate}; --strategy single runs one process"

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "single_run_s": self.single_run_s, "parallel_run_s": self.parallel_run_s}


def run_steps(samples: int, batch: int, workers: int, max_steps: int | None) -> int:
    """Optimizer steps of a run over ``samples`` at ``batch`` per worker (its last batch partial)."""
    steps = math.ceil(samples / (batch * workers))
    return min(steps, max_steps) if max_steps is not None else steps


def choose(step_alone_s: float, step_worker_s: float, *, workers: int, batch: int, model_bytes: int,
           run_samples: int, max_steps: int | None = None, link: Link = LOOPBACK,
           start_s: float = WORKER_START_S) -> Choice:
    """One process or ``workers`` allreduce workers, whichever the estimate finishes first (ties:
    one process, which starts nothing)."""
    comm = allreduce_seconds(workers, model_bytes, link)
    c = Choice(1, workers, batch, step_alone_s, step_worker_s, comm, model_bytes,
               run_steps(run_samples, batch, 1, max_steps), run_steps(run_samples, batch, workers, max_steps),
               start_s)
    return dataclasses.replace(c, workers=workers) if c.parallel_run_s < c.single_run_s else c


def time_step(model: nn.Module, optimizer: torch.optim.Optimizer, task: Task, batch: Any, threads: int,
              warm_up: bool) -> float:
    """The median seconds of a training step on ``threads`` intra-op threads (steps until
    `PROBE_BUDGET_S` or `PROBE_STEPS`, at least one, after one untimed step with ``warm_up``)."""
    inputs, target = task.split(batch)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        def step() -> float:
            t0 = time.perf_counter()
            optimizer.zero_grad(set_to_none=True)
            task.loss(task.forward(model, inputs), target).mean().backward()
            optimizer.step()
            return time.perf_counter() - t0

        if warm_up:
            step()
        times: list[float] = []
        while not times or (len(times) < PROBE_STEPS and sum(times) < PROBE_BUDGET_S):
            times.append(step())
        return sorted(times)[len(times) // 2]
    finally:
        torch.set_num_threads(before)


def probe(model_fn: Callable[[], nn.Module], optimizer_fn: Callable[..., torch.optim.Optimizer], task: Task,
          train_ds: Dataset, *, batch: int, workers: int, cores: int, run_samples: int,
          max_steps: int | None = None, seed: int = 0) -> Choice | None:
    """`choose` on this host's timings of the model (a copy; the caller's RNG untouched). None when
    the model cannot take a step here: the run's own checks then say why, in one line."""
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = model_fn()
            model.train()
            optimizer = optimizer_fn(model.parameters())
            sample = first_batch(train_ds, task.collate_fn, batch)
            alone = time_step(model, optimizer, task, sample, cores, warm_up=True)
            worker = time_step(model, optimizer, task, sample, max(1, cores // workers), warm_up=False)
    except Exception:  # noqa: BLE001 - fit's checks name the problem; the estimate just has none
        return None
    return choose(alone, worker, workers=workers, batch=batch, model_bytes=parameter_bytes(model),
                  run_samples=run_samples, max_steps=max_steps)

"""One strategy's measured window: `partrain.fit` for a given number of steps, read back as figures.

`Candidate` names a strategy with its options (``ps`` with ``staleness=inf`` is
"ps async"); `measure` trains it with the user's model, data and optimizer through the
ordinary `fit` loop (the same launch, the same step, the same breakdown a ``partrain
train`` run prints) and turns the epoch rows and the probe's records into one
`Measurement`. (The local link and the host's constants of the scaling model are probed by
`partrain.compare.run.probe_host`.)
"""

from __future__ import annotations

import functools
import inspect
import math
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils.data import Dataset, Subset, TensorDataset

from ..errors import UsageError, WorkerError, first_line
from ..scaling import parameter_bytes
from ..strategies.base import Strategy, get_strategy
from ..strategies.local_sgd import LocalSGD
from . import hostload
from .options import Straggler
from .probe import ProbeSpec, probed_model, read_records, steady_rate

#: optimizer steps at the start of a window that the throughput leaves out (process group,
#: DDP's buckets, the first pull from the servers, allocator growth)
WARMUP_STEPS = 3
#: the fewest steps measured after the warm-up; a window too short for them is skipped
MIN_MEASURED_STEPS = 8
#: the fewest epochs of a window: each ends with an evaluation, a point of the loss curve
MIN_EPOCHS = 2
#: the epochs the first window is planned with (its size sets every window's epoch)
FIRST_EPOCHS = 6
#: held-out samples evaluated at each epoch's end
TEST_SAMPLES = 512


@dataclass(frozen=True)
class Candidate:
    """A strategy to compare: a label, the registered name, its options, and the workers it uses
    (None: the comparison's worker count)."""

    label: str
    strategy: str
    options: dict[str, Any] = field(default_factory=dict)
    workers: int | None = None

    def build(self) -> Strategy:
        return get_strategy(self.strategy, **self.options)


@dataclass
class Measurement:
    """What one window measured (or why it did not run: ``status`` ``skipped`` / ``failed``).

    Times are per worker and per optimizer step (averaged over workers); bytes are what
    every worker put on the network, per step and per training sample.
    """

    label: str
    strategy: str
    options: dict[str, Any]
    workers: int
    status: str = "ok"
    reason: str = ""
    processes: int = 0
    steps: int = 0
    samples: int = 0
    window_s: float = math.nan  # the epochs' training seconds (worker 0)
    wall_s: float = 0.0  # the whole fit call: start-up, training, evaluations
    samples_per_s: float = math.nan  # steady state, after the warm-up steps
    data_s: float = math.nan
    compute_s: float = math.nan
    comm_s: float = math.nan
    bubble_s: float = 0.0
    bytes_per_step: float = 0.0  # per worker
    bytes_per_sample: float = 0.0
    peak_rss_mb: float = math.nan
    #: the largest process's bytes of parameters, gradients and optimizer state (MiB; the run's
    #: ``memory_ranks``, `partrain.memory`): what a strategy that shards the model saves
    state_mb: float = math.nan
    #: (samples trained so far, test loss) at the start and after each epoch of the window
    curve: list[tuple[float, float]] = field(default_factory=list)
    #: the training seconds (worker 0's epochs, evaluations left out) at each point of ``curve``
    curve_s: list[float] = field(default_factory=list)
    #: filled by the decision: loss at equal samples over the reference's, and the what-if rate
    loss_ratio: float = math.nan
    #: the same against ``single``'s curve (what a person asks first: as good as one process?)
    loss_vs_single: float = math.nan
    effective_samples_per_s: float = math.nan
    simulated_comm_s: float = 0.0
    #: training seconds until the common target loss (under the what-if link); NaN: not reached
    time_to_loss: float = math.nan
    #: what the rule ranks by: 1 / time_to_loss (or the effective samples/s without loss curves)
    speed: float = math.nan
    #: the run-off's windows of the same strategy (`partrain.compare.run`): each timed to the same target
    runoff: list[Measurement] = field(default_factory=list)
    #: each window's training seconds to the target (this one first, then the run-off's; NaN: not reached)
    times_to_loss: list[float] = field(default_factory=list)
    #: shares of the host's CPU time during the window that went elsewhere (`partrain.compare.hostload`):
    #: stolen by the hypervisor, and used by processes outside this one's tree; NaN without /proc
    host_steal: float = math.nan
    host_other: float = math.nan

    @property
    def host_load(self) -> float:
        """The host's CPU time that went elsewhere during the window (steal + other processes)."""
        return self.host_steal + self.host_other

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def step_s(self) -> float:
        return self.data_s + self.compute_s + self.comm_s

    def shares(self) -> dict[str, float]:
        """data / compute / comm / bubble as parts of the step (bubble lies inside compute and comm)."""
        step = self.step_s
        if not step > 0:
            return {k: math.nan for k in ("data", "compute", "comm", "bubble")}
        return {"data": self.data_s / step, "compute": self.compute_s / step, "comm": self.comm_s / step,
                "bubble": self.bubble_s / step}


@dataclass(frozen=True)
class Job:
    """What every window trains: the user's model, data and optimizer, and the fit settings."""

    model_fn: Callable[[], torch.nn.Module]
    data: Any
    optimizer_fn: Callable[..., torch.optim.Optimizer]
    batch_size: int = 32
    loss_fn: Any = "auto"
    seed: int = 0
    threads: int | None = None
    timeout: float = 120.0
    device: str | None = None
    fit_options: dict[str, Any] = field(default_factory=dict)


def measure(job: Job, candidate: Candidate, workers: int, epoch_samples: int, epochs: int,
            straggler: Straggler | None = None, initial_loss: float = math.nan) -> Measurement:
    """Train ``candidate`` for ``epochs`` epochs of ``epoch_samples`` training samples (a multiple of
    the global batch) and measure it (a failure is a `Measurement` with status ``failed`` and the
    error's first line, never an exception).

    Every window of a comparison uses the same ``epoch_samples``: the loss curves of all
    strategies then have points at the same sample counts, compared without interpolation.
    Whole epochs, not ``max_steps``: workers that claim batches (asynchronous strategies) count
    their own steps, and `fit` would stop them in different epochs.
    """
    from ..train.fit import fit

    n = candidate.workers or workers
    strat = candidate.build()
    world = n + strat.extra_processes(n)
    worker_ranks = tuple(r for r, role in enumerate(strat.roles(world)) if role == "worker")
    m = Measurement(candidate.label, candidate.strategy, dict(candidate.options), n, processes=world)
    data = functools.partial(window_data, job.data, TEST_SAMPLES)
    cpu_before = hostload.sample()  # before the clock: reading /proc is not the window's time
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="partrain-compare-") as tmp:
        spec = ProbeSpec(tmp, worker_ranks, straggler.worker if straggler else None,
                         straggler.slowdown if straggler else 1.0)
        try:
            result = fit(functools.partial(probed_model, job.model_fn, spec), data, job.optimizer_fn,
                         strategy=strat, loss_fn=job.loss_fn, workers=n, epochs=epochs,
                         samples_per_epoch=epoch_samples, batch_size=job.batch_size, seed=job.seed, quiet=True,
                         checkpoint=False, return_state=False, timeout=job.timeout, threads=job.threads,
                         device=job.device, **job.fit_options)
        except (WorkerError, UsageError, RuntimeError) as exc:
            m.status, m.reason = "failed", first_line(exc) or type(exc).__name__
            m.wall_s = time.perf_counter() - t0
            return m
        records = read_records(tmp, n)
    m.wall_s = time.perf_counter() - t0
    m.host_steal, m.host_other = hostload.shares(cpu_before, hostload.sample())
    assert result is not None  # fit returns worker 0's result when it launched the workers
    fill_from_history(m, result.history, records, initial_loss)
    return m


def window_data(data: Any, test_samples: int) -> tuple[Dataset, Dataset | None]:
    """``data``'s training set whole, and its first ``test_samples`` held-out samples (a window's
    evaluations stay short).

    A window's epochs are ``epoch_samples`` long and walk on through the training set
    (`FitConfig.samples_per_epoch`), as the user's own run would: cut to one epoch's samples and
    repeated, a window learned from a few thousand of them, and the strategies that ran more
    epochs in their window fitted them more (``partrain bench compare``'s split scenario: 3,648
    of 16,384 samples, 6 passes for one process and 15 for local SGD).

    In-memory tensors stay a `TensorDataset` (`fit` indexes them directly); others a `Subset`.
    """
    from ..train.prepare import resolve_data

    train, test = resolve_data(data)
    if test is not None and len(test) > test_samples:  # type: ignore[arg-type]
        test = _take(test, torch.arange(test_samples))
    return train, test


def _take(ds: Dataset, index: torch.Tensor) -> Dataset:
    if isinstance(ds, TensorDataset):
        return TensorDataset(*(t.index_select(0, index) for t in ds.tensors))
    return Subset(ds, index.tolist())


def fill_from_history(m: Measurement, history: list[dict[str, Any]], records: list[dict[str, Any]],
                      initial_loss: float) -> None:
    """The figures of a window from `fit`'s epoch rows and the probe's records."""
    rows = [r for r in history if r.get("samples")]
    m.samples = sum(int(r["samples"]) for r in rows)
    m.steps = int(rows[-1]["step"]) if rows else 0
    m.window_s = sum(float(r["seconds"]) for r in rows)
    steps = max(m.steps, 1)
    m.data_s = sum(r["time_data"] for r in rows) / steps
    m.compute_s = sum(r["time_compute"] for r in rows) / steps
    m.comm_s = sum(r["time_comm"] for r in rows) / steps
    m.bubble_s = sum(r.get("pipeline_bubble_seconds", 0.0) for r in rows[-1:]) / steps
    sent = sum(float(r["comm_bytes"]) for r in rows)
    # a parameter server's pulls come back over the same links; worker 0 counts its own
    sent += float(rows[-1].get("ps_bytes_pulled", 0.0)) * m.workers if rows else 0.0
    m.bytes_per_sample = sent / m.samples if m.samples else 0.0
    m.bytes_per_step = sent / m.workers / steps
    rate = steady_rate(records, WARMUP_STEPS) if records and all(records) else math.nan
    m.samples_per_s = rate if rate == rate else (m.samples / m.window_s if m.window_s > 0 else math.nan)
    rss = [rec["peak_rss"] for rec in records if rec.get("peak_rss")]
    m.peak_rss_mb = max(rss) / 2**20 if rss else math.nan
    ranks = rows[-1].get("memory_ranks") if rows else None
    if ranks:
        m.state_mb = max(r["params"] + r["grads"] + r["optimizer"] for r in ranks) / 2**20
    key = "test_loss" if rows and rows[-1].get("test_loss") == rows[-1].get("test_loss") else "train_loss"
    seen, elapsed = 0.0, 0.0
    m.curve = [(0.0, initial_loss)] if initial_loss == initial_loss else []
    m.curve_s = [0.0] if m.curve else []
    for r in rows:
        seen += r["samples"]
        elapsed += float(r["seconds"])
        m.curve.append((seen, float(r[key])))
        m.curve_s.append(elapsed)


def sync_period(options: dict[str, Any]) -> int:
    """A local-update strategy's steps between averages, from its options (`LocalSGD`'s own default
    where they name none)."""
    if "period" in options:
        return int(options["period"])
    return int(inspect.signature(LocalSGD).parameters["period"].default)


__all__ = ["Candidate", "Job", "Measurement", "WARMUP_STEPS", "measure", "parameter_bytes"]

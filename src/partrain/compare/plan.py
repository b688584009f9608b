"""The window planner of `compare`: how long each strategy's window trains, and each run-off round.

No process starts here and nothing is measured: `WindowPlanner` turns the budget left, the
one-worker step and what the windows so far measured into the plan of the next window;
`partrain.compare.run` runs the windows it plans and tells it what they measured.

Words: a *window* is one strategy's measured run of whole *epochs* (of ``epoch_samples``
samples, the same for every strategy: the first window sets it); its *share* is the budget's
seconds it may spend, start-up and evaluations included; its *step* is the wall seconds of one
optimizer step on a global batch (``batch_size`` per worker). A *calibration* window of
`CALIBRATION_STEPS` steps comes first when the share pays for it: its steady step corrects the
estimate (`WindowPlanner.correction`).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..memory import human_bytes
from ..scaling import Constants, Link, step_seconds
from .measure import (
    FIRST_EPOCHS,
    MIN_EPOCHS,
    MIN_MEASURED_STEPS,
    WARMUP_STEPS,
    Candidate,
    Measurement,
    sync_period,
)
from .options import Straggler

if TYPE_CHECKING:
    from .run import CompareResult

#: start-up of one window (a process group, the model, the data) before the first one measured it
FIRST_OVERHEAD_S = 0.8
#: the share of a window's time its plan fills (steps on a loaded machine run long as often as short)
SAFETY = 0.75
#: a window's step over its estimate, before one was measured
FIRST_CORRECTION = 2.0
#: a window whose minimum (`MIN_EPOCHS`) the first window's length leaves no room for is planned at that
#: minimum only when it costs at most this many times that length (`plan_window`); a slower one keeps its
#: calibration window as its measurement
SLOW_STRETCH = 1.5
#: a pipeline's step over a data-parallel one's, before one was measured (micro-batches, messages)
PIPELINE_FACTOR = 2.0
#: the steps of a calibration window, and the fewest of a full one: warm-up, then measured
CALIBRATION_STEPS = WARMUP_STEPS + MIN_MEASURED_STEPS


@dataclass(frozen=True)
class WindowPlan:
    """One strategy's window as planned: ``epochs`` of ``epoch_samples`` at ``step_s`` per step of
    ``global_batch``. A plan short of the minimum (`fits` false) is not run."""

    epoch_samples: int
    epochs: int
    global_batch: int
    step_s: float

    @property
    def steps(self) -> int:
        return self.epochs * self.epoch_samples // self.global_batch

    @property
    def fits(self) -> bool:
        """At least `MIN_EPOCHS`, and the warm-up and measured steps."""
        return self.epochs >= MIN_EPOCHS and self.steps >= CALIBRATION_STEPS

    @property
    def least_steps(self) -> float:
        """The steps of the smallest window that would fit."""
        return max(MIN_EPOCHS * self.epoch_samples / self.global_batch, CALIBRATION_STEPS)

    @property
    def least_s(self) -> float:
        """The share the smallest window that fits would need (its training over `SAFETY`)."""
        return self.least_steps * self.step_s / SAFETY


class WindowPlanner:
    """Plans the windows of one comparison, one strategy after another, and learns from each.

    What it keeps: the start-up each window cost beyond its training (``overheads``: the next
    shares are net of their median), each strategy's measured step over its estimate
    (``learned``), the epoch the first window set (``epoch_samples``), the training seconds of the
    first window (``longest``: no window plans more, see the module docstring of
    `partrain.compare.run`), and what every full window ran (``planned``: label -> (candidate,
    epochs), the run-off repeats it).
    """

    def __init__(self, strategies: int, workers: int, batch_size: int, step_guess: float, model_bytes: int,
                 straggler: Straggler | None) -> None:
        self.strategies = strategies
        self.workers = workers
        self.batch_size = batch_size
        self.step_guess = step_guess
        self.model_bytes = model_bytes
        self.straggler = straggler
        self.overheads: list[float] = []
        self.learned: dict[str, float] = {}  # label -> measured step over estimated step
        self.epoch_samples = 0  # set by the first window: the same epoch for every strategy
        self.longest = math.inf  # the training seconds the first window was planned for
        self.planned: dict[str, tuple[Candidate, int]] = {}

    def share_s(self, index: int, left_s: float) -> float:
        """The seconds of the ``index``-th strategy's window: an equal share of the ``left_s`` the
        budget has left among it and the strategies after it, less a window's start-up."""
        overhead = statistics.median(self.overheads) if self.overheads else FIRST_OVERHEAD_S
        return left_s / (self.strategies - index) - overhead

    def global_batch(self, c: Candidate) -> int:
        return self.batch_size * (c.workers or self.workers)

    def estimate_step(self, c: Candidate, result: CompareResult) -> float:
        """The wall seconds one optimizer step of ``c`` should take (to size its window): one
        process's (``single``'s window, else the first guess), slowed by the straggler, plus, for the
        strategies that communicate, the scaling model's cost on the probed link."""
        single = result.measurement("single")
        step = self.step_guess
        if single is not None and single.ok and single.samples_per_s > 0:
            step = result.batch_size / single.samples_per_s
        if self.straggler is not None and (c.workers or self.workers) > 1:
            step *= self.straggler.slowdown  # every worker runs max_steps: the window ends with the slowest
        if result.link is not None and (c.workers or self.workers) > 1 and \
                c.strategy in ("allreduce", "ps", "localsgd"):
            # the scaling model's step with h = 1 (the correction learns the rest) and one server shard
            here = Constants(step, result.batch_size, float(self.model_bytes), 1.0, max(1, len(result.buckets)),
                             result.contention_s, result.ddp_overhead_s)
            step = step_seconds(c.strategy, self.workers, here, Link(*result.link), period=sync_period(c.options),
                                shards=1)
        return step

    def correction(self, c: Candidate) -> float:
        """What the estimate of a window's step is multiplied by: what the same strategy's (else the
        slowest other's) window measured over its estimate; before any, `FIRST_CORRECTION`. Several
        processes on few cores, and a pipeline's many small messages, make steps slower than one
        process's step plus the link's transfer time."""
        factor = self.learned.get(c.label, max(self.learned.values(), default=FIRST_CORRECTION))
        return factor * (PIPELINE_FACTOR if c.strategy == "pipeline" and c.label not in self.learned else 1.0)

    def calibrates(self, c: Candidate, share_s: float, base_s: float) -> bool:
        """Whether ``share_s`` pays for a calibration window of ``c`` (estimated step ``base_s``): fixed
        per-step costs (Python, hooks, messages, a server's round trip) make a guess from one
        process's step unreliable."""
        return share_s > CALIBRATION_STEPS * base_s * self.correction(c)

    def learn_calibration(self, c: Candidate, calib: Measurement, base_s: float) -> None:
        """Take in what ``c``'s (successful) calibration window measured: its steady step (or its mean
        step when it has no rate) over the estimate ``base_s``, and its start-up."""
        steady = self.global_batch(c) / calib.samples_per_s if calib.samples_per_s > 0 else math.nan
        self.learned[c.label] = (steady if steady == steady else calib.window_s / max(calib.steps, 1)) / base_s
        self.overheads.append(max(0.0, calib.wall_s - calib.window_s))

    def plan(self, c: Candidate, share_s: float, base_s: float) -> WindowPlan:
        """The window of ``c`` for ``share_s`` (`plan_window` at the corrected step); the first plan
        with any epochs sets ``longest``."""
        step = base_s * self.correction(c)
        self.epoch_samples, epochs, train_s = plan_window(share_s, step, self.global_batch(c), self.epoch_samples,
                                                          self.batch_size * self.workers, self.longest)
        if self.longest == math.inf and epochs:
            self.longest = train_s
        return WindowPlan(self.epoch_samples, epochs, self.global_batch(c), step)

    def too_slow(self, plan: WindowPlan) -> bool:
        """The smallest window that fits would train over `SLOW_STRETCH` times the first window."""
        return plan.least_steps * plan.step_s > SLOW_STRETCH * self.longest

    def learn_window(self, c: Candidate, m: Measurement, epochs: int, base_s: float) -> None:
        """Take in what ``c``'s (successful) full window of ``epochs`` measured: what it ran (for the
        run-off), its start-up, and its step over the estimate ``base_s``."""
        self.planned[c.label] = (c, epochs)
        self.overheads.append(max(0.0, m.wall_s - m.window_s))
        if m.steps:
            self.learned[c.label] = m.window_s / m.steps / base_s


def plan_window(window_s: float, step_s: float, global_batch: int, epoch_samples: int, unit: int,
                longest_s: float = math.inf) -> tuple[int, int, float]:
    """The plan of one window: ``(epoch_samples, epochs, training seconds)``.

    The window trains for `SAFETY` of its share ``window_s`` (a window longer than estimated
    eats the next ones' time), at most ``longest_s`` (the first window's plan), in whole epochs
    at ``step_s`` per step of ``global_batch``. The first window (``epoch_samples`` 0) sets the
    epoch: `FIRST_EPOCHS` of its plan, a multiple of ``unit`` (every global batch: each epoch is
    whole steps). When the cap, not the share, leaves no room for the minimum (`MIN_EPOCHS`,
    and the warm-up and measured steps), the minimum is planned if the share pays for it and it
    costs at most `SLOW_STRETCH` times the cap. Zero epochs: not even that pays for one.

    A strategy whose minimum costs more than that takes samples at under 1 / (`SLOW_STRETCH` x
    `FIRST_EPOCHS` / `MIN_EPOCHS`) of the first window's rate (one process's), and can reach the
    target first only by learning several times more per sample than one process; its window
    would take the time of a run-off round (``partrain bench compare``, 2026-11-28: the pipeline
    of the comm, straggler and split scenarios, 0.15-0.30x the pick's speed, trained 5.5-10.3 s
    where the first window trained 3.5-4 s, while the leaders' second run-off round, 9-13 s, did
    not fit in what was left)."""
    train_s = min(SAFETY * window_s, longest_s)
    planned = train_s / step_s * global_batch if step_s > 0 and window_s > 0 else 0.0
    if not epoch_samples:
        epoch_samples = max(1, round(planned / FIRST_EPOCHS / unit)) * unit
    epochs = int(planned // epoch_samples)
    least = max(MIN_EPOCHS, math.ceil(CALIBRATION_STEPS * global_batch / epoch_samples))
    cost = least * epoch_samples / global_batch * step_s
    if epochs < least and train_s < SAFETY * window_s and cost <= SAFETY * window_s and cost <= SLOW_STRETCH * train_s:
        epochs = least
    return epoch_samples, epochs, epochs * epoch_samples / global_batch * step_s


def runoff_epochs(leaders: list[Measurement], planned: dict[str, tuple[Candidate, int]]) -> dict[str, int]:
    """Each leader's epochs in a run-off round: as many as train, at the rate of its first window,
    for as long as the longest of the leaders' first windows trained (at least its first window's).

    A window that ends above the target counts as never reaching it, and one shorter than a
    rival's time to the target says nothing of which is faster: the first round's windows train
    in whole epochs planned from a calibration's step time, and come out of unequal length
    (``partrain bench compare``'s compute scenario, 2026-11-29: hogwild's 7 epochs trained 3.0 s,
    DiLoCo's 9 epochs 3.9 s; on the run-off's seeds hogwild's 2.9-second windows ended at 0.42
    and 0.41, above the target 0.347, and its median became "never" where its first window had
    been the fastest; the runs to the target had hogwild the fastest, DiLoCo 1.21x its time)."""
    longest = max((m.window_s for m in leaders if m.window_s > 0), default=0.0)  # (NaN: not measured)
    return {m.label: max(planned[m.label][1], round(planned[m.label][1] * longest / m.window_s))
            if m.window_s > 0 else planned[m.label][1] for m in leaders}


def round_cost(leaders: list[Measurement], planned: dict[str, tuple[Candidate, int]]) -> float:
    """What a run-off round of ``leaders`` costs: each one's first window's whole time (start-up
    and evaluations included), stretched by its `runoff_epochs` over its first's."""
    epochs = runoff_epochs(leaders, planned)
    return sum(m.wall_s * epochs[m.label] / max(1, planned[m.label][1]) for m in leaders)


# ----- which strategies fit a process's memory ---------------------------------------------------

#: the strategies whose processes each hold a part of the model's state (parameters, gradients,
#: optimizer state): ``fsdp`` a shard of every tensor, ``tp`` the split layers' slices, ``pipeline``
#: its stages; the others hold it whole
SPLITTING = frozenset({"fsdp", "tp", "pipeline"})


def state_parts(cand: Candidate, workers: int) -> int:
    """In how many parts ``cand``'s processes hold the model's state (1: each holds it whole)."""
    if cand.strategy == "pipeline":
        return int(cand.options.get("stages", workers))
    return (cand.workers or workers) if cand.strategy in SPLITTING else 1


@dataclass(frozen=True)
class MemoryFit:
    """Whether the model's state fits a process: ``state_bytes`` is what one process holding it whole
    holds (parameters, gradients and optimizer state after a step, `partrain.memory.state_bytes`),
    ``available`` each process's memory (``--memory-per-process``, or the host's available memory
    over the processes: ``source`` says which). A strategy that splits the state in ``parts`` needs
    about ``state_bytes / parts`` (its transient buffers aside: a unit's gathered parameters)."""

    state_bytes: float
    available: float
    source: str

    def need(self, parts: int) -> float:
        return self.state_bytes / max(1, parts)

    def fits(self, parts: int) -> bool:
        return self.need(parts) <= self.available

    def reason(self, parts: int) -> str:
        """Why a strategy holding the state in ``parts`` parts is skipped."""
        return (f"does not fit: about {human_bytes(self.need(parts))} of parameters, gradients and optimizer "
                f"state per process, {human_bytes(self.available)} available ({self.source})")

    def line(self, workers: int) -> str:
        """The one line a comparison prints when the state does not fit one process (empty when it does)."""
        if self.fits(1):
            return ""
        whole, split = human_bytes(self.need(1)), human_bytes(self.need(workers))
        avail = f"{human_bytes(self.available)} per process ({self.source})"
        if self.fits(workers):
            return (f"the model only fits sharded: {whole} of state per process replicated, about {split} split "
                    f"over {workers} workers (fsdp, tp, pipeline), {avail}")
        return (f"the model does not fit even sharded: {whole} of state, about {split} per process over "
                f"{workers} workers, {avail}; use more workers")


__all__ = ["SAFETY", "MemoryFit", "WindowPlan", "WindowPlanner", "plan_window", "round_cost", "runoff_epochs",
           "state_parts"]

"""One epoch of one worker: one scaffold, two step bodies.

The scaffold (`run_epoch`) does what every epoch does whatever runs its steps: seed this
worker's random stream from ``(seed, epoch, rank)``, take the epoch's batches from the
sampler, restore a mid-epoch checkpoint's random state and sums, ask the checkpointer
and the stop rule after each step, drive the progress bar, step the epoch's scheduler and
wait for the slowest worker. The body runs the steps:

- `EagerSteps`: every micro-batch through ``Strategy.train_step`` (accumulation windows,
  the `UpdateGuard`, the step-time breakdown);
- `FusedSteps`: one compiled call per batch (`FusedStep`) over a device-resident epoch;
  the loss and metric sums stay on the device.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from ..batch import batch_size
from ..metrics import StepTimes
from ..strategies.base import StepPlan
from .guard import UpdateGuard, check_fused
from .task import SAMPLES

if TYPE_CHECKING:
    from .trainer import Trainer

#: fused epochs read the device's loss sum (the finiteness check) every this many steps
CHECK_EVERY = 64
#: eager epochs add the micro-batches' losses and metrics into the epoch's sums every this many
#: micro-batches, and whenever the sums are read: a step adds nothing up itself. (The metrics are
#: computed each step: keeping the outputs for the window's sum instead, one metric call per
#: window, made a 2-thread CNN step on the CPU 3-5% slower, the heap between its large
#: activations holding 32 small live tensors; the per-sample losses kept here did not show.)
SUM_EVERY = 32


@dataclass
class Position:
    """Where the run stands: the next epoch, optimizer steps taken, the figures so far, and
    for a mid-epoch checkpoint the micro-batches of ``epoch`` done and this worker's state then."""

    epoch: int = 0
    step: int = 0
    history: list[dict[str, Any]] = field(default_factory=list)
    batch: int = 0
    #: this worker's random state and partial epoch sums at ``batch`` (a mid-epoch resume)
    rng: torch.Tensor | None = None
    sums: torch.Tensor | None = None


@dataclass
class EpochTotals:
    """This worker's sums over one epoch (reduced over workers in `Trainer.record`)."""

    loss_sum: torch.Tensor
    metric_sums: torch.Tensor
    seen: int
    times: StepTimes
    comm_bytes: int
    seconds: float = 0.0
    skipped: int = 0
    #: loss units seen (valid tokens) when the task's are not samples (then ``seen`` counts them)
    units: float = 0.0
    #: the micro-batch ``max_steps`` stopped the epoch before (None: the epoch ran to its end)
    stopped_at: int | None = None
    #: when this epoch's part before a mid-epoch checkpoint began (its seconds count too)
    started: float = field(default_factory=time.perf_counter)
    #: set by `record`: some worker has taken ``max_steps`` steps (workers that claim batches
    #: count their own steps, so one may get there an epoch before another: all stop together)
    max_steps_anywhere: bool = False
    #: set by `record`: the workers' mean training seconds of the epoch (the same on every worker)
    seconds_everywhere: float = 0.0

    @classmethod
    def zeros(cls, device: torch.device, metrics: int, comm_bytes: int) -> EpochTotals:
        return cls(torch.zeros((), dtype=torch.float64, device=device),
                   torch.zeros(metrics, dtype=torch.float64, device=device), 0, StepTimes(), comm_bytes)

    def packed(self) -> torch.Tensor:
        """The sums as one float64 row (a mid-epoch checkpoint keeps one per worker)."""
        t = self.times
        return torch.cat([torch.tensor([self.loss_sum.item(), float(self.seen), float(self.skipped), t.data,
                                        t.compute, t.comm, time.perf_counter() - self.started + self.seconds],
                                       dtype=torch.float64), self.metric_sums.cpu(),
                          torch.tensor([self.units], dtype=torch.float64)])

    def restore(self, row: torch.Tensor) -> None:
        self.loss_sum += row[0].item()
        self.seen, self.skipped = int(row[1].item()), int(row[2].item())
        self.times.data, self.times.compute, self.times.comm = (float(v) for v in row[3:6])
        self.seconds = float(row[6])
        m = len(self.metric_sums)
        self.metric_sums += row[7:7 + m].to(self.metric_sums.device)
        if len(row) > 7 + m:  # written before the units were kept: no token-level task then
            self.units = float(row[7 + m])


def run_epoch(trainer: Trainer, epoch: int) -> EpochTotals:
    """One epoch of this worker's batches; advances ``trainer.position.step``."""
    strategy, cfg, position = trainer.strategy, trainer.cfg, trainer.position
    torch.manual_seed(cfg.seed * 7919 + epoch * 1009 + strategy.rank)
    sampler = trainer.train_sampler()
    sampler.set_epoch(epoch)
    first = position.batch  # micro-batches of this epoch done before a mid-epoch checkpoint
    totals = EpochTotals.zeros(strategy.device, len(trainer.task.metric_names), strategy.comm_bytes)
    if position.rng is not None and position.sums is not None:
        torch.set_rng_state(position.rng)
        totals.restore(position.sums)
    position.batch, position.rng, position.sums = 0, None, None
    trainer.model.train()
    body = (FusedSteps if trainer.fused is not None else EagerSteps)(trainer, epoch, sampler, first, totals)
    n_batches = len(sampler)  # the whole epoch's micro-batches (a resumed epoch skips the first ones)
    t_epoch = time.perf_counter()
    bar = trainer.progress_bar(body.count, epoch)
    totals.times.start()
    for i, update in body:
        if bar is not None:
            bar.update(1)
            if i % 10 == 0 or i + 1 == n_batches:
                body.add_up()
                bar.set_postfix(loss=f"{totals.loss_sum.item() / max(totals.seen, 1):.4f}", refresh=False)
        if not update:
            continue
        if trainer.first_step_at is None:
            trainer.first_step_at = time.time()
        if trainer.stop.step_limit(position.step):
            if i + 1 < n_batches and strategy.checkpoints_within_epoch:
                # the run ends inside the epoch: its checkpoint continues the epoch, so that a
                # resume with more steps equals one run (taken before the epoch-end scheduler step)
                body.before_checkpoint()
                totals.stopped_at = i + 1
                trainer.checkpointer.save_within_epoch(position, epoch, i + 1, totals)
            break
        if i + 1 < n_batches and trainer.checkpointer.due(position.step):
            body.before_checkpoint()
            trainer.checkpointer.save_within_epoch(position, epoch, i + 1, totals)
    body.finish()
    if bar is not None:
        bar.close()
    if trainer.scheduler is not None:
        trainer.scheduler.step()
    strategy.barrier()  # the epoch lasts until its slowest worker is done
    totals.seconds += time.perf_counter() - t_epoch
    return totals


class EagerSteps:
    """Every micro-batch through ``Strategy.train_step``; yields ``(micro-batch, optimizer stepped)``."""

    def __init__(self, trainer: Trainer, epoch: int, sampler: Any, first: int, totals: EpochTotals) -> None:
        self.trainer, self.sampler, self.first, self.totals = trainer, sampler, first, totals
        self.batches = trainer.feeder.epoch(sampler, skip=first)  # type: ignore[union-attr]
        self.count = len(self.batches)
        self.guard = UpdateGuard(trainer.strategy, trainer.model, trainer.optimizer, trainer.task, trainer.cfg, epoch)
        self.pending = False  # gradients of an unfinished accumulation window
        # the micro-batches' per-sample losses and metric values since the sums were last added up
        self.losses: list[torch.Tensor] = []
        self.metrics: list[list[torch.Tensor]] = []

    def __iter__(self) -> Iterator[tuple[int, bool]]:
        t, totals, guard, sampler = self.trainer, self.totals, self.guard, self.sampler
        strategy, task, accumulate = t.strategy, t.task, t.cfg.accumulate
        n_batches = len(sampler)
        window_total = 0
        loss_fn = guard.loss if guard.active else task.loss
        plans: dict[tuple[float, bool], StepPlan] = {}  # one per (scale, update): a step reuses its plan
        tokens = task.units != SAMPLES
        units = window_units = 0.0
        for i, item in enumerate(self._token_windows() if tokens else self.batches, start=self.first):
            totals.times.data_ready()
            comm_before = strategy.comm_seconds
            if tokens:
                batch, units, window_units = item
            else:
                batch = item
            inputs, target = task.split(batch)
            n = batch_size(target, inputs)
            if tokens:  # the window's valid tokens, counted ahead (`_token_windows`)
                update = (i + 1) % accumulate == 0 or (not sampler.claims_batches and i + 1 == n_batches)
                window_total = window_units
            elif sampler.claims_batches:
                # claimed batches (asynchronous strategies): the step count is not known ahead, each
                # worker normalises by its own micro-batches and flushes a partial window at the end
                update = (i + 1) % accumulate == 0
                window_total = strategy.num_workers * n * accumulate
            else:
                if accumulate == 1:  # global samples in this optimizer step
                    window_total = sampler.global_batch_size(i)
                elif i % accumulate == 0:
                    window_total = sum(sampler.global_batch_size(j) for j in range(i, min(i + accumulate, n_batches)))
                update = (i + 1) % accumulate == 0 or i + 1 == n_batches
            if update:
                t.schedule_lr()
            guard.step, guard.batch = t.position.step, (inputs, target)
            scale = strategy.num_workers / max(window_total, 1)
            plan = plans.get((scale, update))
            if plan is None:
                plan = StepPlan(loss_fn, loss_scale=scale, update=update, forward_fn=task.forward,
                                before_update=guard if guard.active else None)
                if not tokens:  # a token count's scale changes every step
                    plans[scale, update] = plan
            with t.memory.watch(t.model):  # the first step's activations; later ones: nothing
                out, per_sample = strategy.train_step(t.model, t.optimizer, inputs, target, plan)
            self.pending = not update
            if update:
                t.position.step += 1
            self.losses.append(per_sample)
            if task.metric_names:
                self.metrics.append(task.metric_samples(out, target))
            if len(self.losses) >= SUM_EVERY:
                self.add_up()
            totals.seen += n
            totals.units += units
            totals.times.step_done(strategy.comm_seconds - comm_before)
            yield i, update

    def _token_windows(self) -> Iterator[tuple[Any, float, float]]:
        """A token-level task's batches with their valid tokens and their accumulation window's, as
        a step divides by (`Strategy.step_units`: the global batch's, one all-reduce per window):
        the window's batches are read before its first step."""
        t, first = self.trainer, self.first
        task, accumulate = t.task, t.cfg.accumulate
        batches, i = iter(self.batches), first
        while True:
            window = list(itertools.islice(batches, accumulate - i % accumulate))
            if not window:
                return
            counts = [float(task.count(task.split(b)[1])) for b in window]
            total = t.strategy.step_units(sum(counts))
            for batch, count in zip(window, counts):
                yield batch, count, total
            i += len(window)

    def add_up(self) -> None:
        """The micro-batches' losses and metric values since the last call, into the epoch's sums
        (one sum per figure for up to `SUM_EVERY` micro-batches, in float64)."""
        totals = self.totals
        if self.losses:
            totals.loss_sum += torch.cat(self.losses).sum(dtype=torch.float64)
            self.losses = []
        if self.metrics:
            totals.metric_sums += torch.stack([torch.cat(values).sum(dtype=torch.float64)
                                               for values in zip(*self.metrics)])
            self.metrics = []

    def before_checkpoint(self) -> None:
        self.add_up()
        self.totals.skipped = self.guard.skipped

    def finish(self) -> None:
        t = self.trainer
        self.add_up()
        if self.pending:  # the last accumulation window of claimed batches was partial
            self.guard.check_loss()
            t.strategy.optimizer_step(t.optimizer)
            t.position.step += 1
        self.totals.skipped = self.guard.skipped
        times = self.totals.times
        t.tuned = t.feeder.tune(times.data, times.compute + times.comm, t.cores_left())  # type: ignore[union-attr]


class FusedSteps:
    """One compiled call per batch (`FusedStep`): the epoch's order is on the device, each call
    gets a slice of it; the loss and metric sums stay on the device. The host per step: the
    slice, the learning rates (a schedule), the step count. ``on_nan="stop"`` reads the loss
    sum every `CHECK_EVERY` steps, before a checkpoint and at the end (a non-finite step makes
    it non-finite): the run stops then, before any checkpoint is written. The time is all
    compute (the gathers are inside the step)."""

    def __init__(self, trainer: Trainer, epoch: int, sampler: Any, first: int, totals: EpochTotals) -> None:
        self.trainer, self.epoch, self.first, self.totals = trainer, epoch, first, totals
        self.fused = trainer.fused
        assert self.fused is not None and trainer.feeder is not None
        self.tensors = trainer.feeder.resident().tensors
        self.order = sampler.order().to(trainer.strategy.device)
        self.spans = list(itertools.islice(sampler.spans(), first, None))
        self.count = len(self.spans)
        self.stop_on_nan = trainer.cfg.on_nan == "stop"
        self.checked = trainer.position.step
        # the steps add to the fused step's own buffers (fixed addresses, for CUDA graphs); the
        # epoch's totals read them until the epoch ends, then keep a copy
        self.sums = self.fused.begin_epoch(self.tensors, totals.loss_sum, totals.metric_sums)
        totals.loss_sum, totals.metric_sums = self.sums[0].view(()), self.sums[1]

    def __iter__(self) -> Iterator[tuple[int, bool]]:
        t, fused, position = self.trainer, self.fused, self.trainer.position
        assert fused is not None
        for i, (a, b) in enumerate(self.spans, start=self.first):
            if t.schedule_lr():
                fused.set_lrs()
            fused(self.tensors, self.order[a:b], self.sums)
            self.totals.seen += b - a
            position.step += 1
            if self.stop_on_nan and position.step - self.checked >= CHECK_EVERY:
                self.before_checkpoint()
            yield i, True

    def add_up(self) -> None:
        """Nothing: the steps add to the sums on the device."""

    def before_checkpoint(self) -> None:
        if self.stop_on_nan:
            step = self.trainer.position.step
            check_fused(self.totals.loss_sum, self.trainer.optimizer, self.epoch, self.checked, step)
            self.checked = step

    def finish(self) -> None:
        totals = self.totals
        totals.loss_sum, totals.metric_sums = totals.loss_sum.clone(), totals.metric_sums.clone()
        self.before_checkpoint()
        totals.times.step_done(0.0)

"""`Trainer`: one worker's run of `fit`, from what the caller resolved to the last epoch.

A worker's run is a sequence of named steps: `Trainer.build` (data, model, optimizer, the
strategy's wrap, the weights of a checkpoint), `Trainer.restore` (optimizer, strategy and
scheduler state, the position), then per epoch `Trainer.train_epoch` (`partrain.train.epoch`:
one scaffold, an eager or a fused step body), `Trainer.record` (evaluation and the epoch's
figures, reduced over workers) and `Trainer.publish` (checkpoint, metrics files, the epoch
line). Cadence and stopping are components asked once per step or epoch: the
`Checkpointer` and the `StopRule`; the NaN policy is the `UpdateGuard` inside the step.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer
from torch.utils.data import Dataset

from .. import comm
from ..batch import batch_size, to_device
from ..checkpoint import load_checkpoint
from ..data.bucketing import BucketBatchSampler, lengths_of
from ..data.generated import Generated, GeneratedSampler
from ..data.pipeline import Feeder, InlineBatches
from ..env import available_cores
from ..errors import UsageError, first_line
from ..memory import MemoryMeter, per_rank
from ..metrics import MetricsWriter
from ..nn.checkpointing import checkpoint_blocks
from ..nn.freeze import load_freeze_state_dict
from ..nn.partial import move_model
from ..sharded_checkpoint import consolidate
from ..strategies.base import Strategy
from .checkpointer import Checkpointer, checkpoint_path
from .compiling import FusedStep, compile_model, compile_settings, fused_blocker, optimizer_blocker
from .config import FitConfig
from .epoch import EpochTotals, Position, run_epoch
from .prepare import DataArg, resolve_data
from .report import epoch_row, progress, summary
from .result import RunResult
from .resume import restore
from .schedule import Schedule, parse_schedule
from .stopping import StopRule
from .task import SAMPLES, Task

SchedulerFn = Callable[[Optimizer], Any]


@dataclass
class WorkerJob:
    """What every worker receives from the caller, resolved once there (picklable).

    ``cfg.resume`` is the checkpoint's path (``"auto"`` already resolved, the file already
    read and checked by the caller); ``task`` is resolved against the data (``"auto"``
    losses made concrete); ``cfg.model_spec`` is filled in.
    """

    model_fn: Callable[[], nn.Module]
    data: DataArg
    optimizer_fn: Callable[..., Optimizer]
    task: Task
    scheduler_fn: SchedulerFn | None
    cfg: FitConfig


def run_worker(strategy: Strategy, job: WorkerJob) -> RunResult | None:
    """A worker's entry point (what `launch` runs): worker 0's `RunResult`, None elsewhere."""
    return Trainer(strategy, job).run()


class Trainer:
    """One worker's run: its parts (model, optimizer, data, feeder), where it stands, and the
    components asked along the way. Build it, then `run`."""

    def __init__(self, strategy: Strategy, job: WorkerJob) -> None:
        self.strategy, self.job, self.cfg, self.task = strategy, job, job.cfg, job.task
        self.position = Position()
        self.stop = StopRule(job.cfg)
        self.checkpointer = Checkpointer(self)
        self.scheduler: Any = None
        self.schedule: Schedule = parse_schedule(job.cfg.lr_schedule, job.cfg.warmup_steps)
        self.feeder: Feeder | None = None
        self.fused: FusedStep | None = None
        #: seconds the trial compilation took (``compile``; None: not compiled)
        self.compile_seconds: float | None = None
        #: what the input pipeline changed after the last epoch (``auto``), for the epoch line
        self.tuned: str | None = None
        #: the training set's sample lengths when batches are bucketed by length
        self.lengths: torch.Tensor | None = None
        #: ``time.time()`` when this run's first optimizer step was done (the start-up's end)
        self.first_step_at: float | None = None
        #: this process's memory by kind (the first step's activations: not under compile)
        self.memory = MemoryMeter(strategy.device, count_activations=job.cfg.compile is False)

    # ----- the outer loop -----------------------------------------------------------------
    def run(self) -> RunResult | None:
        cfg = self.cfg
        ckpt = load_checkpoint(cfg.resume) if cfg.resume else None
        if ckpt is not None and not self.strategy.sharded_checkpoints:
            ckpt = consolidate(ckpt)  # a sharded one read whole: this strategy holds the whole model
        self.build(ckpt)
        self.restore(ckpt)
        position = self.position
        writer = self._metrics_writer(resumed=ckpt is not None)
        stopped = None
        try:
            for epoch in range(position.epoch, cfg.epochs):
                stopped = self.stop.before_epoch(position.step)
                if stopped:
                    break
                totals = self.train_epoch(epoch)
                position.history.append(self.record(epoch, totals))
                if totals.stopped_at is not None:
                    # max_steps ended the run inside this epoch, whose checkpoint is written: the
                    # row reports the part that ran
                    self.publish(writer, checkpoint=False)
                    stopped = "max_steps"
                    break
                position.epoch = epoch + 1
                self.publish(writer)
                stopped = self.stop.after_epoch(epoch, position.history, totals.max_steps_anywhere,
                                                totals.seconds_everywhere)
                if stopped:
                    line = self.stop.explain(stopped, position.history)
                    if line and self.strategy.is_main and not cfg.quiet:
                        print(line, flush=True)
                    break
        finally:
            if writer is not None:
                writer.close()
        result = self.result(stopped)
        self.checkpointer.finish()  # a background write done; a sharded checkpoint exported as one file
        return result

    # ----- the steps ------------------------------------------------------------------------
    def build(self, ckpt: dict[str, Any] | None) -> None:
        """Data, model (with a checkpoint's weights and frozen slices), optimizer, strategy wrap."""
        strategy, cfg, job = self.strategy, self.cfg, self.job
        self.train_ds, self.test_ds = resolve_data(job.data)
        torch.manual_seed(cfg.seed)  # same initial weights on every worker
        settings = compile_settings(cfg.compile, strategy.device)
        # a sharded checkpoint loads into the shards (restore); a whole one into what is built
        weights = ckpt["model"] if ckpt is not None and not ckpt.get("sharded_path") else None
        # compiling tries the whole model on a batch first: it is built whole
        model = (Strategy.build_model(strategy, job.model_fn, weights) if settings is not None
                 else strategy.build_model(job.model_fn, weights))
        if ckpt is not None and ckpt.get("freeze"):  # frozen slices stay frozen across a resume
            load_freeze_state_dict(model, ckpt["freeze"], strict=False)
        model = move_model(model, strategy.device)
        checkpoint_blocks(model, cfg.activation_checkpointing)
        self.feeder = Feeder(self.train_ds, strategy.device, cfg.loader_settings(), self.task.collate_fn,
                             on_device=cfg.data_on_device)
        # data on the device and compile: the whole step as one compiled function when it can be
        blocker = fused_blocker(strategy, model, cfg) if settings is not None and cfg.data_on_device else None
        self.lengths = lengths_of(self.train_ds) if cfg.bucket is not False else None
        if blocker is None and self.lengths is not None:
            blocker = "batches bucketed by length"
        if blocker is None and self.task.units != SAMPLES:
            blocker = "a token-level loss (each step divides by its valid tokens)"
        if settings is not None and not cfg.data_on_device:
            t_compile = time.perf_counter()
            if compile_model(model, settings, self._trial_batch(), self.task, quiet=cfg.quiet or not strategy.is_main):
                self.compile_seconds = time.perf_counter() - t_compile
        optimizer = job.optimizer_fn(model.parameters())
        #: the class of the optimizer ``optimizer_fn`` made (before a strategy wrapped it), as module.Name
        self.optimizer_class = f"{type(optimizer).__module__}.{type(optimizer).__qualname__}"
        if cfg.scale_lr:
            for group in optimizer.param_groups:
                group["lr"] = group["lr"] * strategy.num_workers * cfg.accumulate
                if "initial_lr" in group:
                    group["initial_lr"] = group["lr"]
        self.model, self.optimizer = strategy.prepare(model, optimizer)
        if settings is not None and cfg.data_on_device:
            self._fuse(settings, blocker)
        self.scheduler = job.scheduler_fn(self.optimizer) if job.scheduler_fn else None
        self.base_lrs = [g["lr"] for g in self.optimizer.param_groups]
        if isinstance(self.train_ds, Generated):  # its length counts batches per worker
            batches = len(self.train_ds)
        else:
            samples = cfg.samples_per_epoch or len(self.train_ds)  # type: ignore[arg-type]
            batches = math.ceil(samples / (cfg.batch_size * strategy.num_workers))
        self.steps_per_epoch = max(1, math.ceil(batches / cfg.accumulate))
        self.total_steps = self.steps_per_epoch * cfg.epochs
        if cfg.max_steps is not None:
            self.total_steps = min(self.total_steps, cfg.max_steps)

    def restore(self, ckpt: dict[str, Any] | None) -> None:
        """A checkpoint's optimizer, strategy and scheduler state, and where it stopped."""
        self.position = restore(self.strategy, self, ckpt, quiet=self.cfg.quiet, batch_size=self.cfg.batch_size,
                                load_shards=self.checkpointer.shard_loader(ckpt))

    def train_epoch(self, epoch: int) -> EpochTotals:
        return run_epoch(self, epoch)

    def evaluate(self) -> tuple[float, dict[str, float]]:
        """Loss and metrics on the test set, each worker taking its shard, reduced over workers."""
        return evaluate(self.strategy, self.model, self.test_ds, self.task, self.cfg.eval_batch_size)

    def record(self, epoch: int, totals: EpochTotals) -> dict[str, Any]:
        """The epoch's row of figures: training sums and test figures, reduced over workers."""
        strategy, step, times = self.strategy, self.position.step, totals.times
        train = torch.cat([
            torch.tensor([totals.loss_sum.item(), float(totals.seen), times.data, times.compute, times.comm,
                          float(strategy.comm_bytes - totals.comm_bytes), float(totals.skipped),
                          totals.units if self.task.units != SAMPLES else float(totals.seen)],
                         dtype=torch.float64),
            totals.metric_sums.cpu(),
            # the epoch's seconds and a count (the mean over whoever sums: workers, a pipeline's first stages)
            torch.tensor([totals.seconds, 1.0, float(self.stop.step_limit(step))], dtype=torch.float64)])
        test_loss, test_metrics = self.evaluate()
        strategy.all_reduce_sum(train)
        totals.max_steps_anywhere = train[-1].item() > 0
        totals.seconds_everywhere = train[-3].item() / max(train[-2].item(), 1.0)
        row = epoch_row(self, epoch, step, totals, train, test_loss, test_metrics)
        # every process's memory (a strategy that survives a worker's loss: this one's alone)
        memory = self.memory.figures(self.model, self.optimizer)
        row.update(per_rank([memory] if strategy.survives_worker_loss
                            else comm.all_gather_object(memory, strategy.group)))
        return row

    def publish(self, writer: MetricsWriter | None, checkpoint: bool = True) -> None:
        """The end of an epoch: metrics files, checkpoint and the epoch line (worker 0 writes)."""
        history = self.position.history
        state = self.checkpointer.gather(self.position) if checkpoint else None
        if self.strategy.is_main:
            if writer is not None:
                writer.write(history)
            if state is not None:
                self.checkpointer.write(state, history)
            if not self.cfg.quiet:
                print(summary(history[-1], self.cfg.epochs, has_test=self.test_ds is not None), flush=True)
        self.strategy.barrier()

    def result(self, stopped: str | None) -> RunResult | None:
        final_state = None
        if self.cfg.return_state:  # every worker takes part: a strategy may gather the parameters
            final_state = {k: v.detach().cpu().clone() for k, v in self.strategy.model_state_dict(self.model).items()}
        if not self.strategy.is_main:
            return None
        return RunResult(history=self.position.history, out_dir=self.cfg.out_dir,
                         checkpoint=checkpoint_path(self.cfg), model_state=final_state, stopped=stopped,
                         first_step_at=self.first_step_at)

    # ----- what the epoch asks ----------------------------------------------------------------
    def train_sampler(self) -> Any:
        """This worker's batches of the training set: the strategy's shard, bucketed by length
        when the samples have lengths (same workers, same global batches, every sample once)."""
        strategy, cfg = self.strategy, self.cfg
        if isinstance(self.train_ds, Generated):  # the generator shards itself, by rank
            return GeneratedSampler(len(self.train_ds), strategy.rank, strategy.num_workers)
        size = len(self.train_ds)  # type: ignore[arg-type]
        sampler = strategy.shard(cfg.samples_per_epoch or size, cfg.batch_size, shuffle=True, seed=cfg.seed,
                                 drop_last=cfg.drop_last, dataset_size=size)
        if self.lengths is None:
            if cfg.bucket:
                raise UsageError("Expected a training set with per-sample lengths for bucket=True (a "
                                 f"partrain.data.Sequences). Received: {type(self.train_ds).__name__}")
            return sampler
        if sampler.claims_batches:
            if cfg.bucket:
                raise UsageError(f"Expected a strategy with fixed shards for bucket=True. Received: strategy "
                                 f"{strategy.name!r}, whose workers claim batches")
            return sampler
        return BucketBatchSampler(self.lengths, cfg.batch_size, sampler.rank, sampler.num_replicas,
                                  seed=cfg.seed, drop_last=cfg.drop_last, samples_per_epoch=cfg.samples_per_epoch)

    def schedule_lr(self) -> bool:
        """Set the learning rates of the next optimizer step from the schedule (False: none is set)."""
        if self.schedule.kind == "constant" and self.schedule.warmup_steps <= 0:
            return False
        factor = self.schedule.factor(self.position.step, self.total_steps, self.steps_per_epoch)
        for group, base in zip(self.optimizer.param_groups, self.base_lrs):
            group["lr"] = base * factor
        return True

    def cores_left(self) -> int:
        """Cores of this machine that the training processes' threads leave free (loader processes)."""
        local = max(1, min(self.strategy.num_workers, available_cores()))
        return max(1, available_cores() - local * torch.get_num_threads())

    def progress_bar(self, total: int, epoch: int) -> Any:
        """The epoch's progress bar on worker 0 (``progress``; default: when stderr is a terminal)."""
        cfg = self.cfg
        shown = self.strategy.is_main and not cfg.quiet and (cfg.progress if cfg.progress is not None
                                                              else sys.stderr.isatty())
        return progress(total, epoch, cfg.epochs) if shown else None

    # ----- compilation ------------------------------------------------------------------------
    def _fuse(self, settings: dict[str, Any], blocker: str | None) -> None:
        """The fused step (compiled now, on copies, for the epoch's batch sizes), or when it cannot
        be had the forward compiled alone, with one line saying why."""
        strategy, cfg, feeder = self.strategy, self.cfg, self.feeder
        assert feeder is not None
        quiet = cfg.quiet or not strategy.is_main
        t_compile = time.perf_counter()
        reason = blocker or optimizer_blocker(self.optimizer, self.model)
        if reason is None:
            try:
                step = FusedStep(self.model, self.optimizer, self.task, settings)
                tensors = feeder.resident().tensors
                n, b = len(tensors[0]), cfg.batch_size
                sizes = [min(n, b)] + ([n % b] if n > b and n % b and not cfg.drop_last else [])
                device = strategy.device
                with torch.random.fork_rng(devices=[device.index or 0] if device.type == "cuda" else []):
                    step.trial(tensors, sizes, len(self.task.metric_names))
                self.fused, self.compile_seconds = step, time.perf_counter() - t_compile
                return
            except Exception as exc:  # any compiler error: the usual path, which says why once
                reason = f"it did not compile: {type(exc).__name__}: {first_line(exc)[:160]}"
        if compile_model(self.model, settings, self._trial_batch(), self.task, quiet=quiet):
            if not quiet:
                print(f"partrain: data_on_device with compile: the step is not fused ({reason}); only the "
                      "forward is compiled", file=sys.stderr, flush=True)
            self.compile_seconds = time.perf_counter() - t_compile

    def _trial_batch(self) -> Any:
        """A batch as training sees it (its first, of epoch 0) for the trial compilation."""
        feeder, strategy = self.feeder, self.strategy
        assert feeder is not None
        if isinstance(feeder.ds, Generated):
            return to_device(feeder.ds.first(), strategy.device)
        sampler = strategy.shard(len(feeder.ds), self.cfg.batch_size, shuffle=False,  # type: ignore[arg-type]
                                 drop_last=self.cfg.drop_last)
        return next(iter(InlineBatches(feeder.ds, sampler, strategy.device, feeder.collate)))

    def _metrics_writer(self, resumed: bool) -> MetricsWriter | None:
        """Worker 0's metrics writer (config.json is written by the calling process)."""
        if not self.strategy.is_main or not self.cfg.out_dir:
            return None
        return MetricsWriter(self.cfg.out_dir, resume=resumed, tensorboard=self.cfg.tensorboard)


def evaluate(strategy: Strategy, model: nn.Module, ds: Dataset | None, task: Task,
             eval_batch_size: int) -> tuple[float, dict[str, float]]:
    """Loss and metrics on ``ds``, each worker taking its shard, reduced over workers."""
    names = task.metric_names
    if ds is None or len(ds) == 0:  # type: ignore[arg-type]
        return math.nan, {name: math.nan for name in task.reported_metrics}
    net = strategy.unwrap(model)
    was_training = net.training
    net.eval()
    sampler = strategy.shard(len(ds), eval_batch_size, shuffle=False)  # type: ignore[arg-type]
    # summed on the device: no host synchronisation per batch
    totals = torch.zeros(3 + len(names), dtype=torch.float64, device=strategy.device)
    with torch.no_grad():
        for batch in InlineBatches(ds, sampler, strategy.device, task.collate_fn):
            inputs, target = task.split(batch)
            out = task.forward(net, inputs)
            totals[0] += task.loss(out, target).sum()
            totals[1] += batch_size(target, inputs)
            totals[2] += task.count(target) if task.units != SAMPLES else batch_size(target, inputs)
            if names:
                totals[3:] += task.metric_values(out, target)
    net.train(was_training)
    strategy.all_reduce_sum(totals)
    sums = totals.tolist()
    return task.means(sums[0], sums[2], sums[1], sums[3:])

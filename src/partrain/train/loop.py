"""`fit`: the standard training loop, under any strategy, from Python or the CLI.

Batch size is **per worker**: with ``batch_size=32`` and 4 workers a step sees a
global batch of 128 samples (times ``accumulate`` micro-batches). The learning
rate is used as given unless ``scale_lr=True``, which applies the linear
scaling rule: ``lr * workers * accumulate`` (the rate given is the one for a
single worker's batch).

Batches, model outputs, the loss and the metrics are described by a `Task`
(`partrain.train.task`): tensors, tuples or dicts; a loss by name or a function
returning **per-sample** losses. The loss of a step is normalised by the *global*
batch: each worker sums its per-sample losses and divides by the global sample
count (times the number of workers, which all-reduce averaging divides back out).
So synchronous data parallel training computes exactly the gradient of a single
process on the concatenated batch, also when the last batch of an epoch splits
unevenly.

Resume is exact for the same strategy and world size: checkpoints are written
at epoch ends, and every random stream (data order, dropout) is re-seeded from
``(seed, epoch, rank)`` at the start of each epoch; the built-in learning-rate
schedules are functions of the step count, which checkpoints record.

A worker's run is a sequence of named steps: `build` (data, model, optimizer,
weights of a checkpoint), `restore` (optimizer, strategy and scheduler state),
then per epoch `train_epoch` (every micro-batch through ``Strategy.train_step``),
`record` (evaluation and the epoch's figures, reduced over workers) and
`save` (checkpoint, best checkpoint, metrics files, the epoch line).
"""

from __future__ import annotations

import copy
import itertools
import math
import os
import pickle
import shutil
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.optim import Optimizer
from torch.utils.data import Dataset, TensorDataset

from .._process import start_server_early
from ..batch import batch_size, describe, tensors_of, to_device
from ..checkpoint import fit_weights, load_checkpoint, save_checkpoint
from ..data.bucketing import BucketBatchSampler, lengths_of
from ..data.generated import Generated, GeneratedSampler
from ..data.pipeline import Feeder, InlineBatches
from ..env import available_cores, external_launcher, global_rank_from_environ
from ..errors import UsageError, first_line
from ..launch import launch, starts_processes
from ..metrics import MetricsWriter, StepTimes
from ..nn.freeze import freeze_state_dict, load_freeze_state_dict
from ..optim import keep_run_settings
from ..strategies.base import Strategy, get_strategy
from ..strategies.parameter_server import is_ps_state, ps_optimizer_states
from .compiling import FusedStep, compile_model, compile_settings, fused_blocker, optimizer_blocker
from .config import FitConfig, LaunchConfig, split_options
from .prepare import (
    DataArg,
    check_model_takes,
    check_resume,
    check_run_dir,
    describe_callable,
    describe_data,
    infer_model_spec,
    resolve_data,
    write_config,
)
from .schedule import Schedule, parse_schedule
from .task import LossFn, MetricFn, Task

SchedulerFn = Callable[[Optimizer], Any]


def cross_entropy_per_sample(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output, target, reduction="none")


class NonFiniteError(RuntimeError):
    """A non-finite loss or gradient stopped the run (``on_nan="stop"``)."""


@dataclass
class RunResult:
    """What `fit` returns (from worker 0): per-epoch history and the final figures.

    ``model_state`` holds the final parameters (``return_state=True``, the default);
    ``model()`` rebuilds the trained module from them.
    """

    history: list[dict[str, Any]] = field(default_factory=list)
    out_dir: str | None = None
    checkpoint: str | None = None
    model_state: dict[str, torch.Tensor] | None = None
    #: the model factory `fit` was given (set in the calling process)
    model_fn: Callable[[], nn.Module] | None = field(default=None, repr=False)
    #: why training ended before ``epochs``: ``"early_stop"``, ``"max_steps"``, ``"max_seconds"`` or None
    stopped: str | None = None

    @property
    def final(self) -> dict[str, Any]:
        return self.history[-1] if self.history else {}

    @property
    def test_accuracy(self) -> float:
        """The last epoch's test accuracy (NaN for a task without accuracy)."""
        return float(self.final.get("test_accuracy", math.nan))

    @property
    def train_loss(self) -> float:
        return float(self.final.get("train_loss", math.nan))

    def metric(self, name: str) -> float:
        """A figure of the last epoch by its column name (``test_mse``, ``train_loss``, ...)."""
        return float(self.final.get(name, math.nan))

    def model(self) -> nn.Module:
        """The trained model: ``model_fn()`` with the final parameters, in eval mode."""
        if self.model_state is None or self.model_fn is None:
            raise UsageError("Expected a result of fit(..., return_state=True). Received: one without the "
                             "final parameters")
        with torch.random.fork_rng(devices=[]):
            module = self.model_fn()
        module.load_state_dict(self.model_state)
        return module.eval()


def fit(model_fn: Callable[[], nn.Module], data: DataArg, optimizer_fn: Callable[..., Optimizer],
        config: FitConfig | None = None, *, strategy: Strategy | str = "allreduce",
        loss_fn: str | LossFn = "auto", metrics: Sequence[str] | Mapping[str, MetricFn] | None = None,
        forward_fn: Callable[[nn.Module, Any], Any] | None = None,
        collate_fn: Callable[[list], Any] | None = None, task: Task | None = None,
        scheduler_fn: SchedulerFn | None = None, launch_config: LaunchConfig | None = None,
        **options: Any) -> RunResult | None:
    """Train ``model_fn()`` on ``data`` with ``optimizer_fn(params)`` under ``strategy``.

    Args:
        model_fn: builds the model (a module-level function or ``functools.partial``:
            it is sent to the worker processes, and recorded so ``partrain serve`` can
            rebuild the model from the checkpoint).
        data: a dataset name or `DataSpec` (``digits``, ``synthetic``, ``x.npz``,
            ``module:function``), a ``(train, test)`` pair, one Dataset (a share is held out
            for evaluation), or a function returning either. Samples may be ``(x, y)``,
            ``(x1, ..., y)`` or dicts (see `partrain.train.task`).
        optimizer_fn: ``params -> torch.optim.Optimizer``.
        config: how the loop trains (`FitConfig`: epochs, batch_size, accumulate,
            scale_lr, seed, max_steps, out_dir, resume, on_nan, clip_grad, precision,
            lr_schedule, early_stop, ...).
        strategy: a `Strategy` or its name.
        loss_fn: a name (``cross_entropy``, ``mse``, ``l1``, ``bce``, ...; ``auto`` by the
            targets' dtype) or ``(output, target) -> per-sample losses``. A ``torch.nn`` loss
            with ``reduction="mean"`` is used per sample; other whole-batch losses are refused.
        metrics: metric names (``accuracy``, ``mse``, ``mae``) or ``{name: fn}`` with
            ``fn(output, target) -> per-sample values``; None: chosen by the task.
        forward_fn: ``(model, inputs) -> output`` when the model is not called as
            ``model(x)`` / ``model(*xs)`` / ``model(**dict)``.
        collate_fn: how samples form a batch (variable-sized samples need one).
        task: all of the above as one `Task` (then leave them unset).
        scheduler_fn: ``optimizer -> LR scheduler`` stepped once per epoch (or use
            ``lr_schedule`` for a per-step built-in one).
        launch_config: where the workers run (`LaunchConfig`: workers, timeout, backend,
            device, threads, nnodes, node_rank, master_addr, master_port, pool).
        **options: any field of either config by name (``epochs=5, workers=2``);
            they override the objects' values.

    Returns:
        Worker 0's `RunResult` (``None`` on the other machines of a multi-node job).
    """
    cfg, launch_cfg = split_options(config, launch_config, options)
    task = _task_from(task, loss_fn, metrics, forward_fn, collate_fn, cfg.precision)
    if scheduler_fn is not None and cfg.lr_schedule not in (None, "constant"):
        raise UsageError(f"Expected either scheduler_fn or lr_schedule. Received both (lr_schedule="
                         f"{cfg.lr_schedule!r})")
    auto = cfg.resume == "auto"
    if auto:
        candidate = os.path.join(cfg.out_dir or ".", "checkpoint.pt")
        cfg.resume = candidate if os.path.exists(candidate) else None
    ckpt = load_checkpoint(cfg.resume) if cfg.resume is not None else None  # one line when unreadable
    if _is_first_process(launch_cfg) and cfg.out_dir:  # under torchrun every rank runs this: one judges
        # resume="auto" continues whatever is there: a restart before the first checkpoint starts again
        check_run_dir(cfg.out_dir, resume=auto or cfg.resume is not None, overwrite=cfg.overwrite)
    strat = get_strategy(strategy)
    if (cfg.checkpoint_every or cfg.checkpoint_seconds) and not strat.checkpoints_within_epoch:
        raise UsageError("Expected checkpoint_every / checkpoint_seconds with a strategy whose workers agree on "
                         "every step (allreduce, single). Received: strategy "
                         f"{strat.name!r}, which checkpoints at epoch ends only")
    if external_launcher() is None:  # joining a job (torchrun, Ray, Slurm): it runs here, nothing is sent
        for name, obj in (("model_fn", model_fn), ("data", data), ("optimizer_fn", optimizer_fn),
                          ("loss_fn", task.loss_fn), ("metrics", task.metric_spec), ("forward_fn", task.forward_fn),
                          ("collate_fn", task.collate_fn), ("scheduler_fn", scheduler_fn)):
            _check_picklable(name, obj)
    if ckpt is not None and not check_resume(cfg, ckpt, cfg.resume or "", auto):
        history = list(ckpt.get("metrics") or [])
        return RunResult(history=history, out_dir=cfg.out_dir, checkpoint=cfg.resume,
                         model_state=ckpt["model"] if cfg.return_state else None, model_fn=model_fn)
    if starts_processes(launch_cfg.workers, strat, launch_cfg.nnodes, launch_cfg.master_addr):
        start_server_early()  # it imports torch while this process loads the data and checks the model
    train_ds, test_ds = resolve_data(data)
    if isinstance(test_ds, Generated):
        raise UsageError("Expected a Dataset of samples (or None) to evaluate on. Received: a batch generator "
                         "(Generated) as the test set")
    if cfg.samples_per_epoch is not None and isinstance(train_ds, Generated):
        raise UsageError("Expected samples_per_epoch with a Dataset of samples; a batch generator sets its own "
                         f"epoch. Received: samples_per_epoch={cfg.samples_per_epoch} with a Generated training set")
    _check_feeding(cfg, train_ds, task)
    if ckpt is not None:
        _same_samples_per_epoch(ckpt, cfg.samples_per_epoch)
    if ckpt is not None and ckpt.get("within_epoch"):  # one line here rather than from every worker
        if launch_cfg.workers is not None and external_launcher() is None:  # else the job's size decides there
            _same_workers(ckpt["within_epoch"], strat.data_parallel_workers(launch_cfg.workers * launch_cfg.nnodes))
        _resume_batch(int(ckpt["within_epoch"]["batch"]), ckpt, cfg.batch_size,
                      bucketed=cfg.bucket is not False and lengths_of(train_ds) is not None)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        model = model_fn()
    if not isinstance(model, nn.Module):
        raise UsageError(f"Expected model_fn to return a torch.nn.Module. Received: {type(model).__name__}")
    task = check_model_takes(model, train_ds, task=task)
    _check_monitor(cfg, task, has_test=test_ds is not None and len(test_ds) > 0)  # type: ignore[arg-type]
    if ckpt is not None:
        fit_weights(model, ckpt["model"], f"the model of model_fn to resume {cfg.resume!r}")
    if cfg.model_spec is None:
        cfg.model_spec = infer_model_spec(model_fn, train_ds, task, data, task.collate_fn)
    del model
    if cfg.out_dir and _is_first_process(launch_cfg):
        write_config(os.path.join(cfg.out_dir, "config.json"),
                     run_settings(cfg, launch_cfg, strat, task, data, optimizer_fn, model_fn))
    results = launch(_fit_worker, model_fn, data, optimizer_fn, task, scheduler_fn, cfg,
                     strategy=strat, **launch_cfg.as_kwargs())
    result = results[0]
    if result is not None:
        result.model_fn = model_fn
    return result


def _check_feeding(cfg: FitConfig, train_ds: Dataset, task: Task) -> None:
    """The feeding options against the training set: one line here, not an error in every worker."""
    if cfg.data_on_device and not (isinstance(train_ds, TensorDataset) and task.collate_fn is None):
        raise UsageError("Expected an in-memory TensorDataset (and no collate_fn) for data_on_device=True. "
                         f"Received: {type(train_ds).__name__}{' with a collate_fn' if task.collate_fn else ''}")
    if cfg.bucket and lengths_of(train_ds) is None:
        raise UsageError("Expected a training set with per-sample lengths for bucket=True (a "
                         f"partrain.data.Sequences). Received: {type(train_ds).__name__}")


def _task_from(task: Task | None, loss_fn: Any, metrics: Any, forward_fn: Any, collate_fn: Any,
               precision: str) -> Task:
    if task is not None:
        if not isinstance(task, Task):
            raise UsageError(f"Expected task to be a partrain Task. Received: {type(task).__name__}")
        if loss_fn != "auto" or metrics is not None or forward_fn is not None or collate_fn is not None:
            raise UsageError("Expected either task or loss_fn/metrics/forward_fn/collate_fn. Received both")
        task = copy.copy(task)  # resolved here, for this run only
        if precision != "fp32":
            task.precision = precision
        return task
    return Task(loss_fn, metrics, forward_fn, collate_fn, precision=precision)


def _check_picklable(name: str, obj: Any) -> None:
    try:
        pickle.dumps(obj)
    except Exception as exc:
        raise UsageError(
            f"Expected {name} to be picklable (a module-level function, functools.partial or plain "
            f"data) so worker processes can receive it. Received: {obj!r} ({type(exc).__name__})"
        ) from None


def _check_monitor(cfg: FitConfig, task: Task, has_test: bool) -> None:
    if cfg.monitor is None:
        return
    splits = ("train", "test") if has_test else ("train",)
    known = ["epoch", "step", "lr", "samples_per_s"] + [f"{s}_{m}" for s in splits for m in ["loss", *task.metric_names]]
    if cfg.monitor not in known:
        raise UsageError(f"Expected monitor among {known}. Received: {cfg.monitor!r}")


def _is_first_process(launch_cfg: LaunchConfig) -> bool:
    """True in the process that starts the job, or in rank 0 when torchrun started every rank."""
    return launch_cfg.node_rank == 0 and global_rank_from_environ() == 0


def run_settings(cfg: FitConfig, launch_cfg: LaunchConfig, strategy: Strategy, task: Task, data: Any,
                 optimizer_fn: Any, model_fn: Any) -> dict[str, Any]:
    """Every setting of a run, JSON-able: what config.json records."""
    launch_settings = {k: v for k, v in launch_cfg.as_kwargs().items() if k != "pool"}
    fit_settings = {k: v for k, v in asdict(cfg).items() if k != "extra_config"}
    return {**fit_settings, "strategy": strategy.name, "strategy_options": strategy.options(),
            "launch": launch_settings, "task": task.describe(), "data": describe_data(data),
            "optimizer": describe_callable(optimizer_fn), "model": describe_callable(model_fn),
            "torch": torch.__version__, **(cfg.extra_config or {})}


@dataclass
class _Parts:
    """What one worker trains with, as `build` made it."""

    model: nn.Module  # wrapped by the strategy
    optimizer: Optimizer
    scheduler: Any
    train_ds: Dataset
    test_ds: Dataset | None
    task: Task
    schedule: Schedule = field(default_factory=Schedule)
    base_lrs: list[float] = field(default_factory=list)
    steps_per_epoch: int = 1
    total_steps: int = 1
    #: the input pipeline of the training set (`partrain.data.pipeline.Feeder`)
    feeder: Feeder | None = None
    #: the training set's sample lengths when batches are bucketed by length
    lengths: torch.Tensor | None = None
    #: what the input pipeline changed after the last epoch (``auto``), for the epoch line
    tuned: str | None = None
    #: seconds the trial compilation took (``compile``; None: not compiled)
    compile_seconds: float | None = None
    #: the whole step compiled as one function (``data_on_device`` with ``compile``; None: not fused)
    fused: FusedStep | None = None
    #: the class of the optimizer ``optimizer_fn`` made (before a strategy wrapped it), as module.Name
    optimizer_class: str = ""


@dataclass
class _Position:
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
class _EpochTotals:
    """This worker's sums over one epoch (reduced over workers in `record`)."""

    loss_sum: torch.Tensor
    metric_sums: torch.Tensor
    seen: int
    times: StepTimes
    comm_bytes: int
    seconds: float = 0.0
    skipped: int = 0
    #: the micro-batch ``max_steps`` stopped the epoch before (None: the epoch ran to its end)
    stopped_at: int | None = None
    #: when this epoch's part before a mid-epoch checkpoint began (its seconds count too)
    started: float = field(default_factory=time.perf_counter)
    #: set by `record`: some worker has taken ``max_steps`` steps (workers that claim batches
    #: count their own steps, so one may get there an epoch before another: all stop together)
    max_steps_anywhere: bool = False
    #: set by `record`: the workers' mean training seconds of the epoch (the same on every worker)
    seconds_everywhere: float = 0.0

    def packed(self) -> torch.Tensor:
        """The sums as one float64 row (a mid-epoch checkpoint keeps one per worker)."""
        t = self.times
        return torch.cat([torch.tensor([self.loss_sum.item(), float(self.seen), float(self.skipped), t.data,
                                        t.compute, t.comm, time.perf_counter() - self.started + self.seconds],
                                       dtype=torch.float64), self.metric_sums.cpu()])

    def restore(self, row: torch.Tensor) -> None:
        self.loss_sum += row[0].item()
        self.seen, self.skipped = int(row[1].item()), int(row[2].item())
        self.times.data, self.times.compute, self.times.comm = (float(v) for v in row[3:6])
        self.seconds = float(row[6])
        self.metric_sums += row[7:].to(self.metric_sums.device)


def _fit_worker(strategy: Strategy, model_fn: Callable[[], nn.Module], data: DataArg,
                optimizer_fn: Callable[..., Optimizer], task: Task,
                scheduler_fn: SchedulerFn | None, cfg: FitConfig) -> RunResult | None:
    ckpt = load_checkpoint(cfg.resume) if cfg.resume else None
    parts = build(strategy, model_fn, data, optimizer_fn, task, scheduler_fn, cfg, ckpt)
    position = restore(strategy, parts, ckpt, quiet=cfg.quiet, batch_size=cfg.batch_size)
    writer = _start_outputs(strategy, cfg, resumed=ckpt is not None)
    stopped = None
    trained = 0.0  # the workers' mean training seconds of this call's epochs (`FitConfig.max_seconds`)
    try:
        for epoch in range(position.epoch, cfg.epochs):
            if cfg.max_steps is not None and position.step >= cfg.max_steps:
                stopped = "max_steps"
                break
            totals = train_epoch(strategy, parts, cfg, epoch, position)
            if totals.stopped_at is not None:
                # max_steps ended the run inside this epoch, whose checkpoint is written: the row
                # reports the part that ran
                position.history.append(record(strategy, parts, cfg, epoch, position.step, totals))
                save(strategy, parts, cfg, position, writer, checkpoint=False)
                stopped = "max_steps"
                break
            position.history.append(record(strategy, parts, cfg, epoch, position.step, totals))
            position.epoch = epoch + 1
            save(strategy, parts, cfg, position, writer)
            if totals.max_steps_anywhere:
                stopped = "max_steps"
                break
            trained += totals.seconds_everywhere
            if time_is_up(trained, totals.seconds_everywhere, cfg.max_seconds) and epoch + 1 < cfg.epochs:
                stopped = "max_seconds"
                break
            if _early_stop(position.history, cfg):
                stopped = "early_stop"
                if strategy.is_main and not cfg.quiet:
                    print(f"early stop: {_monitor(cfg, position.history[-1])} has not improved for "
                          f"{cfg.early_stop} epochs", flush=True)
                break
    finally:
        if writer is not None:
            writer.close()
    result = _result(strategy, parts, cfg, position)
    if result is not None:
        result.stopped = stopped
    return result


def build(strategy: Strategy, model_fn: Callable[[], nn.Module], data: DataArg,
          optimizer_fn: Callable[..., Optimizer], task: Task, scheduler_fn: SchedulerFn | None,
          cfg: FitConfig, ckpt: dict[str, Any] | None) -> _Parts:
    """Data, model (with a checkpoint's weights and frozen slices), optimizer, strategy wrap."""
    train_ds, test_ds = resolve_data(data)
    torch.manual_seed(cfg.seed)  # same initial weights on every worker
    model = model_fn()
    if ckpt is not None:
        model.load_state_dict(ckpt["model"])
        if ckpt.get("freeze"):  # frozen slices stay frozen across a resume
            load_freeze_state_dict(model, ckpt["freeze"], strict=False)
    model = model.to(strategy.device)
    feeder = Feeder(train_ds, strategy.device, cfg.loader_settings(), task.collate_fn, on_device=cfg.data_on_device)
    settings = compile_settings(cfg.compile, strategy.device)
    compile_seconds = None
    # data on the device and compile: the whole step as one compiled function when it can be
    blocker = fused_blocker(strategy, model, cfg) if settings is not None and cfg.data_on_device else None
    if blocker is None and cfg.bucket is not False and lengths_of(train_ds) is not None:
        blocker = "batches bucketed by length"
    if settings is not None and not cfg.data_on_device:
        t_compile = time.perf_counter()
        if compile_model(model, settings, _trial_batch(feeder, strategy, cfg), task,
                         quiet=cfg.quiet or not strategy.is_main):
            compile_seconds = time.perf_counter() - t_compile
    optimizer = optimizer_fn(model.parameters())
    optimizer_class = f"{type(optimizer).__module__}.{type(optimizer).__qualname__}"
    if cfg.scale_lr:
        for group in optimizer.param_groups:
            group["lr"] = group["lr"] * strategy.num_workers * cfg.accumulate
            if "initial_lr" in group:
                group["initial_lr"] = group["lr"]
    model, optimizer = strategy.prepare(model, optimizer)
    fused = None
    if settings is not None and cfg.data_on_device:
        fused, compile_seconds = _fuse(strategy, model, optimizer, feeder, task, settings, cfg, blocker)
    scheduler = scheduler_fn(optimizer) if scheduler_fn else None
    if isinstance(train_ds, Generated):  # its length counts batches per worker
        batches = len(train_ds)
    else:
        samples = cfg.samples_per_epoch or len(train_ds)  # type: ignore[arg-type]
        batches = math.ceil(samples / (cfg.batch_size * strategy.num_workers))
    steps_per_epoch = max(1, math.ceil(batches / cfg.accumulate))
    total = steps_per_epoch * cfg.epochs
    if cfg.max_steps is not None:
        total = min(total, cfg.max_steps)
    return _Parts(model, optimizer, scheduler, train_ds, test_ds, task,
                  schedule=parse_schedule(cfg.lr_schedule, cfg.warmup_steps),
                  base_lrs=[g["lr"] for g in optimizer.param_groups],
                  steps_per_epoch=steps_per_epoch, total_steps=total, feeder=feeder, compile_seconds=compile_seconds,
                  fused=fused, optimizer_class=optimizer_class,
                  lengths=lengths_of(train_ds) if cfg.bucket is not False else None)


def _fuse(strategy: Strategy, model: nn.Module, optimizer: Optimizer, feeder: Feeder, task: Task,
          settings: dict[str, Any], cfg: FitConfig, blocker: str | None) -> tuple[FusedStep | None, float | None]:
    """The fused step (compiled now, on copies, for the epoch's batch sizes), or when it cannot
    be had the forward compiled alone, with one line saying why. Also: the compile seconds."""
    quiet = cfg.quiet or not strategy.is_main
    t_compile = time.perf_counter()
    reason = blocker or optimizer_blocker(optimizer, model)
    if reason is None:
        try:
            step = FusedStep(model, optimizer, task, settings)
            tensors = feeder.resident().tensors
            n, b = len(tensors[0]), cfg.batch_size
            sizes = [min(n, b)] + ([n % b] if n > b and n % b and not cfg.drop_last else [])
            device = strategy.device
            with torch.random.fork_rng(devices=[device.index or 0] if device.type == "cuda" else []):
                step.trial(tensors, sizes, len(task.metric_names))
            return step, time.perf_counter() - t_compile
        except Exception as exc:  # any compiler error: the usual path, which says why once
            reason = f"it did not compile: {type(exc).__name__}: {first_line(exc)[:160]}"
    if compile_model(model, settings, _trial_batch(feeder, strategy, cfg), task, quiet=quiet):
        if not quiet:
            print(f"partrain: data_on_device with compile: the step is not fused ({reason}); only the "
                  "forward is compiled", file=sys.stderr, flush=True)
        return None, time.perf_counter() - t_compile
    return None, None


def _trial_batch(feeder: Feeder, strategy: Strategy, cfg: FitConfig) -> Any:
    """A batch as training sees it (its first, of epoch 0) for the trial compilation."""
    if isinstance(feeder.ds, Generated):
        return to_device(feeder.ds.first(), strategy.device)
    sampler = strategy.shard(len(feeder.ds), cfg.batch_size, shuffle=False, drop_last=cfg.drop_last)  # type: ignore[arg-type]
    return next(iter(InlineBatches(feeder.ds, sampler, strategy.device, feeder.collate)))


def restore(strategy: Strategy, parts: _Parts, ckpt: dict[str, Any] | None, quiet: bool = False,
            batch_size: int | None = None) -> _Position:
    """Optimizer, strategy and scheduler state of a checkpoint, and where it stopped.

    A checkpoint another strategy wrote gives the model, the optimizer state (a ps
    checkpoint's from its servers, and to ps servers) and the position; that strategy's
    own state is left. One written with another optimizer class gives the model and the
    position; the optimizer starts afresh. This run's optimizer settings (lr, momentum,
    weight decay, ...) win where they differ from the checkpoint's, except an lr that a
    schedule sets. Each of these says so in one line. A mid-epoch checkpoint resumed with
    another ``batch_size`` goes on after the same samples (or refuses in one line when its
    batches cannot be counted in the new size).
    """
    if ckpt is None:
        return _Position()
    say = strategy.is_main and not quiet
    written_by = (ckpt.get("config") or {}).get("strategy")
    foreign = written_by is not None and written_by != strategy.name
    written_with = ckpt.get("optimizer_class")
    new_optimizer = written_with is not None and written_with != parts.optimizer_class
    asked = [dict(group) for group in parts.optimizer.param_groups]  # this run's settings, before loading
    optimizer_state = None if new_optimizer else ckpt.get("optimizer")
    if foreign and optimizer_state is not None and is_ps_state(ckpt.get("strategy")):  # its servers held it
        numels = [p.numel() for group in parts.optimizer.param_groups for p in group["params"]]
        optimizer_state = {**optimizer_state, "state": ps_optimizer_states(ckpt["strategy"], numels)}
    if optimizer_state is not None:
        parts.optimizer.load_state_dict(optimizer_state)
    if foreign or new_optimizer:
        # what the other strategy kept of its own (local SGD's counters and outer momentum or
        # the workers' optimizer states, a pipeline's stage layout, ps versions) has no meaning here
        strategy.adopt_optimizer_state(optimizer_state)
    elif ckpt.get("strategy"):
        strategy.load_state_dict(ckpt["strategy"])
        unused = strategy.unused_state(ckpt["strategy"])
        if unused and say:
            print(f"partrain: resuming with {strategy.name}: {unused} is left unused", flush=True)
    if new_optimizer and say:
        print(f"partrain: resuming a checkpoint of {written_with} with {parts.optimizer_class}: the model and the "
              "position carry over; the optimizer starts afresh", flush=True)
    elif foreign and ckpt.get("strategy") and say:
        print(f"partrain: resuming a {written_by} checkpoint with {strategy.name}: the model, the optimizer "
              f"state and the position carry over; {written_by}'s own state does not", flush=True)
    if optimizer_state is not None:
        # an lr that a schedule sets stays the schedule's (a torch scheduler's state; partrain's
        # own schedule already starts from this run's base lr)
        scheduled_lr = (parts.scheduler is not None or parts.schedule.kind != "constant"
                        or parts.schedule.warmup_steps > 0)
        changed = keep_run_settings(parts.optimizer, asked, skip={"lr"} if scheduled_lr else ())
        if changed and say:
            print("partrain: resuming with this run's optimizer settings where the checkpoint's differ: "
                  + ", ".join(changed), flush=True)
    if parts.scheduler is not None and ckpt.get("scheduler") is not None:
        parts.scheduler.load_state_dict(ckpt["scheduler"])
    position = _Position(ckpt["epoch"], ckpt["step"], list(ckpt.get("metrics") or []))
    within = ckpt.get("within_epoch")
    if within:  # a mid-epoch checkpoint: every worker's random state and sums, row by worker rank
        rng, sums = within["rng"], within["sums"]
        _same_workers(within, strategy.num_workers)
        position.batch = _resume_batch(int(within["batch"]), ckpt, batch_size, bucketed=parts.lengths is not None)
        position.rng = rng[strategy.rank].to(torch.uint8).clone()  # set_rng_state reads a whole storage
        position.sums = sums[strategy.rank]
    return position


def _same_workers(within: dict[str, Any], workers: int) -> None:
    """A mid-epoch checkpoint resumes with its worker count: it holds one random state per worker."""
    if len(within["rng"]) != workers:
        raise UsageError(f"Expected {len(within['rng'])} workers to resume a mid-epoch checkpoint (its random states "
                         f"are per worker). Received: {workers}")


def _same_samples_per_epoch(ckpt: dict[str, Any], n: int | None) -> None:
    """A run resumes with its checkpoint's ``samples_per_epoch``: epoch ``e`` starts at sample ``e N``
    of the passes over the training set, so another ``N`` would go on from another place."""
    old = (ckpt.get("config") or {}).get("samples_per_epoch")
    if old != n:
        raise UsageError(f"Expected samples_per_epoch={old} (the checkpoint's: another epoch length would go on "
                         f"from another place in the training set) to resume. Received: samples_per_epoch={n}")


def _resume_batch(batch: int, ckpt: dict[str, Any], batch_size: int | None, bucketed: bool) -> int:
    """Where a mid-epoch checkpoint goes on, in this run's batches: after the same samples.

    Every batch before a mid-epoch checkpoint was a whole global batch, slices of one
    epoch order that does not depend on the batch size: ``batch`` batches of the old size
    are ``batch * old / new`` of the new one when that divides. Otherwise (or batches
    bucketed by length, which are made for one batch size) one line: before, the run
    skipped ``batch`` batches of the new size and trained on some samples twice or never.
    """
    old = (ckpt.get("config") or {}).get("batch_size")
    if batch_size is None or not isinstance(old, int) or old == batch_size:
        return batch
    done = batch * old
    if not bucketed and done % batch_size == 0:
        return done // batch_size
    if bucketed:
        raise UsageError(f"Expected batch_size {old} (the mid-epoch checkpoint's: batches bucketed by length are "
                         f"made for one size) to resume within its epoch. Received: {batch_size}")
    raise UsageError(f"Expected batch_size {old} (the mid-epoch checkpoint's) or one that divides the {done} "
                     f"samples per worker it had trained on, to resume within its epoch. Received: {batch_size}")


class _UpdateGuard:
    """Runs between the gradient exchange and the optimizer step: clipping and the finiteness check.

    Its ``loss`` wraps the task's loss to see each micro-batch's output and losses. One host
    synchronisation per optimizer step. ``stop`` checks the window's loss (a non-finite input,
    parameter or output makes it non-finite); the worker that sees it stops and the job with
    it. ``skip`` checks the exchanged gradient's norm too: under all-reduce a non-finite
    gradient on one worker is non-finite on all of them after averaging, so every worker
    drops the same step.
    """

    def __init__(self, strategy: Strategy, parts: _Parts, cfg: FitConfig, epoch: int) -> None:
        self.strategy, self.parts, self.cfg, self.epoch = strategy, parts, cfg, epoch
        self.params = [p for p in parts.model.parameters() if p.requires_grad]
        self.active = cfg.on_nan != "off" or cfg.clip_grad is not None
        self.skipped = 0
        self.step = 0
        self.window_loss: torch.Tensor | None = None
        self.batch: tuple[Any, Any] = (None, None)
        self.output: tuple[Any, torch.Tensor] | None = None

    def loss(self, output: Any, target: Any) -> torch.Tensor:
        per_sample = self.parts.task.loss(output, target)
        self.output = (output, per_sample)
        total = per_sample.detach().sum()
        self.window_loss = total if self.window_loss is None else self.window_loss + total
        return per_sample

    def __call__(self) -> bool:
        """True: step. False: drop this step's gradient (``skip``). Raises for ``stop``."""
        try:
            norm = None
            if self.cfg.clip_grad is not None:
                norm = self.strategy.clip_grad_norm_(self.params, self.cfg.clip_grad)
            elif self.cfg.on_nan == "skip":
                # every worker must drop the same steps: the exchanged gradient, not this worker's loss
                norm = self.strategy.grad_norm(self.params)
            if self.cfg.on_nan == "off":
                return True
            # "stop" looks at the loss (a NaN input, parameter or output makes it NaN): one scalar
            # read per step, the host's one synchronisation with a device (per step, tensor ops on
            # 0-d tensors cost the host more than the read itself: they were 7% of a small MLP's step)
            loss = self.window_loss
            if norm is None:
                finite = loss is None or math.isfinite(loss.item())
            elif loss is None:
                finite = math.isfinite(norm.item())
            else:
                finite = bool(torch.isfinite(norm.to(loss.device)) & torch.isfinite(loss))
            if finite:
                return True
            if self.cfg.on_nan == "skip":
                self.skipped += 1
                return False
            raise NonFiniteError(self.explain())
        finally:
            self.window_loss = None

    def check_loss(self) -> None:
        """A window whose gradient was not checked (the final flush of claimed batches)."""
        if (self.cfg.on_nan == "stop" and self.window_loss is not None
                and not bool(torch.isfinite(self.window_loss))):
            raise NonFiniteError(self.explain())

    def explain(self) -> str:
        """One line: the step and the first non-finite tensor, in the order the data flows."""
        where = f"epoch {self.epoch + 1}, optimizer step {self.step + 1}"
        lr = self.parts.optimizer.param_groups[0].get("lr")
        inputs, target = self.batch
        net = self.strategy.unwrap(self.parts.model)
        candidates = [(f"input{p}", t) for p, t in tensors_of(inputs)]
        candidates += [(f"target{p}", t) for p, t in tensors_of(target)]
        candidates += [(f"parameter {n}", p.detach()) for n, p in net.named_parameters()]
        if self.output is not None:
            candidates += [(f"output{p}", t) for p, t in tensors_of(self.output[0])]
            candidates.append(("the loss", self.output[1]))
        candidates += [(f"the gradient of {n}", p.grad) for n, p in net.named_parameters() if p.grad is not None]
        for name, t in candidates:
            if t.is_floating_point():
                bad = int((~torch.isfinite(t)).sum())
                if bad:
                    return (f"Non-finite values at {where}: {name} holds {bad} NaN/Inf of {t.numel()} "
                            f"(lr {lr}); stopped before writing a checkpoint (on_nan='skip' drops such steps)")
        return f"Non-finite loss or gradient at {where} (lr {lr}); stopped before writing a checkpoint"


def train_epoch(strategy: Strategy, parts: _Parts, cfg: FitConfig, epoch: int,
                position: _Position) -> _EpochTotals:
    """One epoch of this worker's batches; advances ``position.step``."""
    if parts.fused is not None:
        return _fused_epoch(strategy, parts, cfg, epoch, position)
    device = strategy.device
    task = parts.task
    torch.manual_seed(cfg.seed * 7919 + epoch * 1009 + strategy.rank)
    sampler = _train_sampler(strategy, parts, cfg)
    sampler.set_epoch(epoch)
    first = position.batch  # micro-batches of this epoch done before a mid-epoch checkpoint
    batches = parts.feeder.epoch(sampler, skip=first)  # type: ignore[union-attr]
    parts.model.train()
    totals = _EpochTotals(torch.zeros((), dtype=torch.float64, device=device),
                          torch.zeros(len(task.metric_names), dtype=torch.float64, device=device), 0,
                          StepTimes(), strategy.comm_bytes)
    if position.rng is not None and position.sums is not None:
        torch.set_rng_state(position.rng)
        totals.restore(position.sums)
    position.batch, position.rng, position.sums = 0, None, None
    clock = _CheckpointClock(strategy, cfg) if cfg.checkpoint_every or cfg.checkpoint_seconds else None
    guard = _UpdateGuard(strategy, parts, cfg, epoch)
    t_epoch = time.perf_counter()
    bar = _progress(len(batches), epoch, cfg.epochs) if _show_bar(strategy, cfg) else None
    n_batches = len(sampler)  # the whole epoch's micro-batches (a resumed epoch skips the first ones)
    window_total = 0
    pending = False  # gradients of an unfinished accumulation window
    scheduled = parts.schedule.kind != "constant" or parts.schedule.warmup_steps > 0
    totals.times.start()
    for i, batch in enumerate(batches, start=first):
        totals.times.data_ready()
        comm_before = strategy.comm_seconds
        inputs, target = task.split(batch)
        n = batch_size(target, inputs)
        if sampler.claims_batches:
            # claimed batches (asynchronous strategies): the step count is not known ahead, each
            # worker normalises by its own micro-batches and flushes a partial window at the end
            update = (i + 1) % cfg.accumulate == 0
            window_total = strategy.num_workers * n * cfg.accumulate
        else:
            if i % cfg.accumulate == 0:  # global samples in this optimizer step
                window_total = sum(sampler.global_batch_size(j)
                                   for j in range(i, min(i + cfg.accumulate, n_batches)))
            update = (i + 1) % cfg.accumulate == 0 or i + 1 == n_batches
        if update and scheduled:
            _set_lr(parts, position.step)
        guard.step, guard.batch = position.step, (inputs, target)
        out, per_sample = strategy.train_step(
            parts.model, parts.optimizer, inputs, target, guard.loss if guard.active else task.loss,
            loss_scale=strategy.num_workers / max(window_total, 1), update=update, forward_fn=task.forward,
            before_update=guard if guard.active else None)
        pending = not update
        if update:
            position.step += 1
        totals.loss_sum += per_sample.sum()
        if task.metric_names:
            totals.metric_sums += task.metric_values(out, target)
        totals.seen += n
        totals.times.step_done(strategy.comm_seconds - comm_before)
        if bar is not None:
            bar.update(1)
            if i % 10 == 0 or i + 1 == n_batches:
                bar.set_postfix(loss=f"{totals.loss_sum.item() / max(totals.seen, 1):.4f}", refresh=False)
        if update and cfg.max_steps is not None and position.step >= cfg.max_steps:
            if i + 1 < n_batches and strategy.checkpoints_within_epoch:
                # the run ends inside the epoch: its checkpoint continues the epoch, so that a
                # resume with more steps equals one run (taken before the epoch-end scheduler step)
                totals.stopped_at, totals.skipped = i + 1, guard.skipped
                save_within_epoch(strategy, parts, cfg, position, epoch, i + 1, totals)
            break
        if update and clock is not None and i + 1 < n_batches and clock.due(position.step):
            totals.skipped = guard.skipped
            save_within_epoch(strategy, parts, cfg, position, epoch, i + 1, totals)
    if pending:  # the last accumulation window of claimed batches was partial
        guard.check_loss()
        strategy.optimizer_step(parts.optimizer)
        position.step += 1
    if bar is not None:
        bar.close()
    if parts.scheduler is not None:
        parts.scheduler.step()
    strategy.barrier()  # the epoch lasts until its slowest worker is done
    totals.seconds += time.perf_counter() - t_epoch
    totals.skipped = guard.skipped
    parts.tuned = parts.feeder.tune(totals.times.data, totals.times.compute + totals.times.comm,  # type: ignore[union-attr]
                                    _cores_left(strategy))
    return totals


#: fused epochs read the device's loss sum (the finiteness check) every this many steps
CHECK_EVERY = 64


def _fused_epoch(strategy: Strategy, parts: _Parts, cfg: FitConfig, epoch: int, position: _Position) -> _EpochTotals:
    """`train_epoch` with one compiled call per batch (`FusedStep`): the epoch's order is on the
    device, each call gets a slice of it; the loss and metric sums stay on the device. The host
    per step: the slice, the learning rates (a schedule), the step count. ``on_nan="stop"``
    reads the loss sum every `CHECK_EVERY` steps and at the end (a non-finite step makes it
    non-finite): the run stops then, before any checkpoint is written. The time is all
    compute (the gathers are inside the step)."""
    fused, device = parts.fused, strategy.device
    assert fused is not None and parts.feeder is not None
    torch.manual_seed(cfg.seed * 7919 + epoch * 1009 + strategy.rank)
    sampler = _train_sampler(strategy, parts, cfg)
    sampler.set_epoch(epoch)
    first = position.batch
    totals = _EpochTotals(torch.zeros((), dtype=torch.float64, device=device),
                          torch.zeros(len(parts.task.metric_names), dtype=torch.float64, device=device), 0,
                          StepTimes(), strategy.comm_bytes)
    if position.rng is not None and position.sums is not None:
        torch.set_rng_state(position.rng)
        totals.restore(position.sums)
    position.batch, position.rng, position.sums = 0, None, None
    parts.model.train()
    tensors = parts.feeder.resident().tensors
    order = sampler.order().to(device)
    spans = list(itertools.islice(sampler.spans(), first, None))
    clock = _CheckpointClock(strategy, cfg) if cfg.checkpoint_every or cfg.checkpoint_seconds else None
    scheduled = parts.schedule.kind != "constant" or parts.schedule.warmup_steps > 0
    n_batches = len(sampler)
    t_epoch = time.perf_counter()
    bar = _progress(len(spans), epoch, cfg.epochs) if _show_bar(strategy, cfg) else None
    totals.times.start()
    # the steps add to the fused step's own buffers (fixed addresses, for CUDA graphs); the
    # epoch's totals read them until the epoch ends, then keep a copy
    sums = fused.begin_epoch(tensors, totals.loss_sum, totals.metric_sums)
    totals.loss_sum, totals.metric_sums = sums[0].view(()), sums[1]
    checked = position.step
    for i, (a, b) in enumerate(spans, start=first):
        if scheduled:
            _set_lr(parts, position.step)
            fused.set_lrs()
        fused(tensors, order[a:b], sums)
        totals.seen += b - a
        position.step += 1
        if cfg.on_nan == "stop" and position.step - checked >= CHECK_EVERY:
            _check_fused(totals, parts, epoch, checked, position.step)
            checked = position.step
        if bar is not None:
            bar.update(1)
            if i % 10 == 0 or i + 1 == n_batches:
                bar.set_postfix(loss=f"{totals.loss_sum.item() / max(totals.seen, 1):.4f}", refresh=False)
        if cfg.max_steps is not None and position.step >= cfg.max_steps:
            if i + 1 < n_batches and strategy.checkpoints_within_epoch:  # as in train_epoch
                if cfg.on_nan == "stop":
                    _check_fused(totals, parts, epoch, checked, position.step)
                    checked = position.step
                totals.stopped_at = i + 1
                save_within_epoch(strategy, parts, cfg, position, epoch, i + 1, totals)
            break
        if clock is not None and i + 1 < n_batches and clock.due(position.step):
            if cfg.on_nan == "stop":
                _check_fused(totals, parts, epoch, checked, position.step)
                checked = position.step
            save_within_epoch(strategy, parts, cfg, position, epoch, i + 1, totals)
    totals.loss_sum, totals.metric_sums = totals.loss_sum.clone(), totals.metric_sums.clone()
    if cfg.on_nan == "stop":
        _check_fused(totals, parts, epoch, checked, position.step)
    totals.times.step_done(0.0)
    if bar is not None:
        bar.close()
    if parts.scheduler is not None:
        parts.scheduler.step()
    strategy.barrier()
    totals.seconds += time.perf_counter() - t_epoch
    return totals


def _check_fused(totals: _EpochTotals, parts: _Parts, epoch: int, since: int, step: int) -> None:
    if not bool(torch.isfinite(totals.loss_sum)):
        lr = parts.optimizer.param_groups[0].get("lr")
        raise NonFiniteError(f"Non-finite loss in epoch {epoch + 1} between optimizer steps {since + 1} and "
                             f"{step} (lr {lr}); stopped before writing a checkpoint (on_nan='skip' drops such "
                             "steps; it trains without the fused step)")


def _cores_left(strategy: Strategy) -> int:
    """Cores of this machine that the training processes' threads leave free (loader processes)."""
    local = max(1, min(strategy.num_workers, available_cores()))
    return max(1, available_cores() - local * torch.get_num_threads())


def _train_sampler(strategy: Strategy, parts: _Parts, cfg: FitConfig) -> Any:
    """This worker's batches of the training set: the strategy's shard, bucketed by length
    when the samples have lengths (same workers, same global batches, every sample once)."""
    if isinstance(parts.train_ds, Generated):  # the generator shards itself, by rank
        return GeneratedSampler(len(parts.train_ds), strategy.rank, strategy.num_workers)
    size = len(parts.train_ds)  # type: ignore[arg-type]
    sampler = strategy.shard(cfg.samples_per_epoch or size, cfg.batch_size, shuffle=True, seed=cfg.seed,
                             drop_last=cfg.drop_last, dataset_size=size)
    if parts.lengths is None:
        if cfg.bucket:
            raise UsageError("Expected a training set with per-sample lengths for bucket=True (a "
                             f"partrain.data.Sequences). Received: {type(parts.train_ds).__name__}")
        return sampler
    if sampler.claims_batches:
        if cfg.bucket:
            raise UsageError(f"Expected a strategy with fixed shards for bucket=True. Received: strategy "
                             f"{strategy.name!r}, whose workers claim batches")
        return sampler
    return BucketBatchSampler(parts.lengths, cfg.batch_size, sampler.rank, sampler.num_replicas,
                              seed=cfg.seed, drop_last=cfg.drop_last, samples_per_epoch=cfg.samples_per_epoch)


def _set_lr(parts: _Parts, step: int) -> None:
    factor = parts.schedule.factor(step, parts.total_steps, parts.steps_per_epoch)
    for group, base in zip(parts.optimizer.param_groups, parts.base_lrs):
        group["lr"] = base * factor


def record(strategy: Strategy, parts: _Parts, cfg: FitConfig, epoch: int, step: int,
           totals: _EpochTotals) -> dict[str, Any]:
    """The epoch's row of figures: training sums and test figures, reduced over workers."""
    times = totals.times
    names = parts.task.metric_names
    train = torch.cat([
        torch.tensor([totals.loss_sum.item(), float(totals.seen), times.data, times.compute, times.comm,
                      float(strategy.comm_bytes - totals.comm_bytes), float(totals.skipped)], dtype=torch.float64),
        totals.metric_sums.cpu(),
        # the epoch's seconds and a count (the mean over whoever sums: workers, a pipeline's first stages)
        torch.tensor([totals.seconds, 1.0, float(cfg.max_steps is not None and step >= cfg.max_steps)],
                     dtype=torch.float64)])
    test_loss, test_metrics = evaluate(strategy, parts.model, parts.test_ds, parts.task, cfg.eval_batch_size)
    strategy.all_reduce_sum(train)
    totals.max_steps_anywhere = train[-1].item() > 0
    totals.seconds_everywhere = train[-3].item() / max(train[-2].item(), 1.0)
    n = max(train[1].item(), 1.0)
    w = strategy.num_workers
    seconds = totals.seconds
    row: dict[str, Any] = {"epoch": epoch + 1, "step": step, "train_loss": train[0].item() / n}
    row.update({f"train_{name}": train[7 + k].item() / n for k, name in enumerate(names)})
    row["test_loss"] = test_loss
    row.update({f"test_{name}": value for name, value in test_metrics.items()})
    row.update({
        "samples": int(train[1].item()),
        "seconds": seconds,
        "samples_per_s": train[1].item() / seconds if seconds > 0 else math.nan,
        "time_data": train[2].item() / w,
        "time_compute": train[3].item() / w,
        "time_comm": train[4].item() / w,
        "comm_bytes": int(train[5].item()),
        "lr": parts.optimizer.param_groups[0]["lr"],
        "workers": w,
        "strategy": strategy.name,
        "loader": parts.feeder.describe() if parts.feeder is not None else "inline",
    })
    if parts.tuned:
        row["loader_tuned"] = parts.tuned
    if parts.compile_seconds is not None:
        row["compile_seconds"] = parts.compile_seconds
        row["compiled"] = "step" if parts.fused is not None else "forward"
    if strategy.device.type == "cuda":
        row["device_utilization"] = _utilization(strategy.device)
    if cfg.on_nan == "skip":
        row["skipped_steps"] = int(train[6].item())
    row.update({f"{strategy.name}_{k}": v for k, v in strategy.metrics().items()})
    return row


def _monitor(cfg: FitConfig, row: dict[str, Any]) -> str:
    if cfg.monitor:
        return cfg.monitor
    return "test_loss" if row.get("test_loss", math.nan) == row.get("test_loss", math.nan) else "train_loss"


def _better(name: str, value: float, best: float) -> bool:
    return value > best if "accuracy" in name else value < best


def _best_epoch(history: list[dict[str, Any]], cfg: FitConfig) -> int | None:
    """Index of the best row by the monitored figure (the earliest among equals)."""
    if not history:
        return None
    name = _monitor(cfg, history[-1])
    if name not in history[-1]:
        raise UsageError(f"Expected monitor among the epoch's figures {sorted(history[-1])}. Received: {name!r}")
    best = None
    for i, row in enumerate(history):
        value = row.get(name, math.nan)
        if value == value and (best is None or _better(name, value, history[best][name])):
            best = i
    return best


def time_is_up(trained: float, last: float, limit: float | None) -> bool:
    """After an epoch that took ``last`` seconds and brought the training time to ``trained``: is
    this epoch's end nearer ``limit`` than the next one's would be (at the same pace)?"""
    return limit is not None and trained + last / 2 >= limit


def _early_stop(history: list[dict[str, Any]], cfg: FitConfig) -> bool:
    if cfg.early_stop is None:
        return False
    best = _best_epoch(history, cfg)
    return best is not None and len(history) - 1 - best >= cfg.early_stop


def _state(strategy: Strategy, parts: _Parts, cfg: FitConfig, position: _Position) -> dict[str, Any]:
    """A checkpoint's content (every worker takes part: a strategy may gather its state)."""
    model_state = strategy.model_state_dict(parts.model)
    return {"model": {k: v.detach().cpu() for k, v in model_state.items()},
            "model_spec": cfg.model_spec,
            "task": parts.task.describe(),
            "freeze": freeze_state_dict(strategy.unwrap(parts.model)),
            "optimizer": _optimizer_state(parts.optimizer),
            "optimizer_class": parts.optimizer_class,
            "strategy": strategy.state_dict(),
            "scheduler": parts.scheduler.state_dict() if parts.scheduler is not None else None,
            "epoch": position.epoch, "step": position.step,
            "config": _jsonable({**asdict(cfg), "strategy": strategy.name, "workers": strategy.num_workers}),
            "metrics": position.history}


def save(strategy: Strategy, parts: _Parts, cfg: FitConfig, position: _Position,
         writer: MetricsWriter | None, checkpoint: bool = True) -> None:
    """The end of an epoch: checkpoint, metrics files and the epoch line (worker 0 writes)."""
    path = _checkpoint_path(cfg) if checkpoint else None
    state = _state(strategy, parts, cfg, position) if path is not None else None
    if strategy.is_main:
        if writer is not None:
            writer.write(position.history)
        if state is not None and path is not None:
            save_checkpoint(path, state)
            if _best_epoch(position.history, cfg) == len(position.history) - 1:
                _copy_atomic(path, os.path.join(os.path.dirname(path), "best.pt"))
        if not cfg.quiet:
            print(_summary(position.history[-1], cfg.epochs), flush=True)
    strategy.barrier()


def save_within_epoch(strategy: Strategy, parts: _Parts, cfg: FitConfig, position: _Position, epoch: int,
                      batch: int, totals: _EpochTotals) -> None:
    """A checkpoint after micro-batch ``batch`` of ``epoch`` (at the end of an accumulation window).

    Besides the usual state it holds every worker's random state and partial sums of the
    epoch (gathered by an all-reduce of one row per worker), so a resume continues the
    epoch exactly: the same remaining batches, dropout masks and epoch figures.
    """
    path = _checkpoint_path(cfg)
    if path is None:
        return
    rng = torch.get_rng_state().to(torch.float64)
    sums = totals.packed()
    rows = torch.zeros(strategy.num_workers, len(rng) + len(sums), dtype=torch.float64)
    rows[strategy.rank] = torch.cat([rng, sums])
    strategy.all_reduce_sum(rows)  # a CPU tensor is fine under nccl too (comm moves it)
    state = _state(strategy, parts, cfg, _Position(epoch, position.step, position.history))
    state["within_epoch"] = {"batch": batch, "rng": rows[:, :len(rng)].to(torch.uint8),
                             "sums": rows[:, len(rng):].clone()}
    if strategy.is_main:
        save_checkpoint(path, state)
    strategy.barrier()


class _CheckpointClock:
    """When a mid-epoch checkpoint is due: every ``checkpoint_every`` optimizer steps, or when
    ``checkpoint_seconds`` have passed on worker 0 (asked every `PROBE_STEPS` steps with one
    small all-reduce, so every worker decides alike)."""

    PROBE_STEPS = 10

    def __init__(self, strategy: Strategy, cfg: FitConfig) -> None:
        self.strategy, self.cfg = strategy, cfg
        self.last = time.monotonic()

    def due(self, step: int) -> bool:
        if self.cfg.checkpoint_every and step % self.cfg.checkpoint_every == 0:
            self.last = time.monotonic()
            return True
        if self.cfg.checkpoint_seconds and step % self.PROBE_STEPS == 0:
            flag = torch.tensor([float(self.strategy.is_main and
                                       time.monotonic() - self.last >= self.cfg.checkpoint_seconds)],
                                dtype=torch.float64, device=self.strategy.device)
            if self.strategy.all_reduce_sum(flag).item() > 0:
                self.last = time.monotonic()
                return True
        return False


def _copy_atomic(src: str, dst: str) -> None:
    tmp = f"{dst}.tmp"
    shutil.copyfile(src, tmp)
    os.replace(tmp, dst)


def _start_outputs(strategy: Strategy, cfg: FitConfig, resumed: bool) -> MetricsWriter | None:
    """Worker 0's metrics writer (config.json is written by the calling process)."""
    if not strategy.is_main or not cfg.out_dir:
        return None
    return MetricsWriter(cfg.out_dir, resume=resumed, tensorboard=cfg.tensorboard)


def _result(strategy: Strategy, parts: _Parts, cfg: FitConfig, position: _Position) -> RunResult | None:
    final_state = None
    if cfg.return_state:  # every worker takes part: a strategy may gather the parameters
        final_state = {k: v.detach().cpu().clone() for k, v in strategy.model_state_dict(parts.model).items()}
    if not strategy.is_main:
        return None
    return RunResult(history=position.history, out_dir=cfg.out_dir,
                     checkpoint=_checkpoint_path(cfg), model_state=final_state)


def _checkpoint_path(cfg: FitConfig) -> str | None:
    return os.path.join(cfg.out_dir, "checkpoint.pt") if cfg.checkpoint and cfg.out_dir else None


def _show_bar(strategy: Strategy, cfg: FitConfig) -> bool:
    return strategy.is_main and not cfg.quiet and (cfg.progress if cfg.progress is not None
                                                   else sys.stderr.isatty())


def evaluate(strategy: Strategy, model: nn.Module, ds: Dataset | None, task: Task,
             eval_batch_size: int) -> tuple[float, dict[str, float]]:
    """Loss and metrics on ``ds``, each worker taking its shard, reduced over workers."""
    names = task.metric_names
    if ds is None or len(ds) == 0:  # type: ignore[arg-type]
        return math.nan, {name: math.nan for name in names}
    net = strategy.unwrap(model)
    was_training = net.training
    net.eval()
    sampler = strategy.shard(len(ds), eval_batch_size, shuffle=False)  # type: ignore[arg-type]
    # summed on the device: no host synchronisation per batch
    totals = torch.zeros(2 + len(names), dtype=torch.float64, device=strategy.device)
    with torch.no_grad():
        for batch in InlineBatches(ds, sampler, strategy.device, task.collate_fn):
            inputs, target = task.split(batch)
            out = task.forward(net, inputs)
            totals[0] += task.loss(out, target).sum()
            totals[1] += batch_size(target, inputs)
            if names:
                totals[2:] += task.metric_values(out, target)
    net.train(was_training)
    strategy.all_reduce_sum(totals)
    n = max(totals[1].item(), 1.0)
    return totals[0].item() / n, {name: totals[2 + k].item() / n for k, name in enumerate(names)}


def _optimizer_state(optimizer: Optimizer) -> dict[str, Any] | None:
    try:
        return optimizer.state_dict()
    except Exception:  # a strategy whose optimizer state lives elsewhere keeps it in its own state
        return None


def _jsonable(obj: Any) -> Any:
    import json

    return json.loads(json.dumps(obj, default=str))


def _progress(total: int, epoch: int, epochs: int):  # noqa: ANN202
    from tqdm import tqdm

    return tqdm(total=total, desc=f"epoch {epoch + 1}/{epochs}", leave=False, dynamic_ncols=True)


def _summary(row: dict[str, Any], epochs: int) -> str:
    """The epoch line: losses, the task's metrics, throughput and the step-time breakdown."""
    t = row["time_data"] + row["time_compute"] + row["time_comm"]
    share = (lambda v: 100 * v / t) if t > 0 else (lambda v: 0.0)
    metric_names = [k[len("train_"):] for k in row if k.startswith("train_") and k != "train_loss"]

    def figures(split: str) -> str:
        parts = [f"{split + '_' if split == 'test' else ''}loss {row[f'{split}_loss']:.4f}"]
        for name in metric_names:
            label = name[:3] if name == "accuracy" else name
            value = row.get(f"{split}_{name}", math.nan)
            parts.append(f"{split + '_' if split == 'test' else ''}{label} {value:.{3 if name == 'accuracy' else 4}f}")
        return "  ".join(parts)

    skipped = f"  skipped {row['skipped_steps']} steps" if row.get("skipped_steps") else ""
    util = row.get("device_utilization")
    device = f" gpu {util:.0f}%" if isinstance(util, (int, float)) and util == util else ""
    return (f"epoch {row['epoch']}/{epochs}  {figures('train')}  {figures('test')}  "
            f"{row['samples_per_s']:,.0f} samples/s  "
            f"[data {share(row['time_data']):.0f}% compute {share(row['time_compute']):.0f}% "
            f"comm {share(row['time_comm']):.0f}%{device}]{skipped}{_input_bound(row, share(row['time_data']))}")


def _input_bound(row: dict[str, Any], data_percent: float) -> str:
    """The epoch line's note when waiting for data took more than `INPUT_BOUND` of the time."""
    from ..data.pipeline import INPUT_BOUND

    if data_percent <= 100 * INPUT_BOUND:
        return ""
    tuned = row.get("loader_tuned")
    advice = (f"{tuned} for the next epoch" if tuned else
              "more --loader-workers / --prefetch, or another --loader (docs/data.md)")
    return f"  input-bound (loader {row.get('loader', '?')}: {advice})"


def _utilization(device: torch.device) -> float:
    """The device's utilisation in percent over the last sample period (NVML), NaN when unknown."""
    try:
        return float(torch.cuda.utilization(device))
    except Exception:  # no NVML (pynvml) or no permission: the breakdown stays without it
        return math.nan


__all__ = ["FitConfig", "LaunchConfig", "NonFiniteError", "RunResult", "Task", "check_model_takes",
           "cross_entropy_per_sample", "describe", "evaluate", "fit", "resolve_data"]

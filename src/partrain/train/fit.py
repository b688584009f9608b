"""`fit`: the standard training loop, under any strategy, from Python or the CLI (the caller's side).

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

**One preflight.** `fit` checks everything it can in the calling process, once, before any
worker starts: the options, the run directory, the checkpoint (read once, ``resume="auto"``
resolved), the data against the model and the loss (one model built), picklability. The
workers receive what it resolved (`WorkerJob`) and run `partrain.train.trainer.Trainer`.
"""

from __future__ import annotations

import contextlib
import copy
import os
import pickle
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer
from torch.utils.data import Dataset, TensorDataset

from .._process import check_not_bootstrapping, start_server_early
from ..checkpoint import fit_weights, load_checkpoint
from ..data.bucketing import lengths_of
from ..data.datasets import DataSpec
from ..data.generated import Generated
from ..env import external_launcher, global_rank_from_environ
from ..errors import UsageError, first_line
from ..launch import launch, starts_processes
from ..nn.checkpointing import blocks_to_checkpoint
from ..nn.partial import on_meta
from ..sharded_checkpoint import consolidate, latest_checkpoint
from ..strategies.base import Strategy, get_strategy
from .config import FitConfig, LaunchConfig, split_options
from .prepare import (
    DataArg,
    check_finite,
    check_model_takes,
    check_resume,
    check_run_dir,
    check_sizes,
    describe_callable,
    describe_data,
    infer_model_spec,
    resolve_data,
    warn_one_step_epochs,
    write_config,
)
from .result import RunResult
from .resume import resume_batch, same_samples_per_epoch, same_workers
from .task import LossFn, MetricFn, OwnLossOnMeta, Task
from .trainer import SchedulerFn, WorkerJob, run_worker


def fit(model_fn: Callable[[], nn.Module], data: DataArg, optimizer_fn: Callable[..., Optimizer],
        config: FitConfig | None = None, *, strategy: Strategy | str = "allreduce",
        loss_fn: str | LossFn = "auto", metrics: Sequence[str] | Mapping[str, MetricFn] | None = None,
        forward_fn: Callable[[nn.Module, Any], Any] | None = None,
        collate_fn: Callable[[list], Any] | None = None, task: Task | None = None,
        scheduler_fn: SchedulerFn | None = None, launch_config: LaunchConfig | None = None,
        parallel: Mapping[str, int] | str | None = None, **options: Any) -> RunResult | None:
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
        parallel: one device mesh for every axis, ``{"dp": 2, "fsdp": 2, "tp": 2, "pp": 2}`` or
            ``"dp=2,tp=2"``: it picks the strategy (`partrain.strategies.mesh`; leave ``strategy``
            unset) and, without ``workers``, the processes (the product of the axes).
        **options: any field of either config by name (``epochs=5, workers=2``);
            they override the objects' values.

    Returns:
        Worker 0's `RunResult` (``None`` on the other machines of a multi-node job).
    """
    check_not_bootstrapping()  # a worker importing a script that calls fit unguarded: before any check
    if parallel is not None:  # the mesh names the strategy, and the processes unless told
        from ..strategies.mesh import MeshSpec, mesh_strategy

        strategy, spec = mesh_strategy(parallel, strategy), MeshSpec.of(parallel)
        if launch_config is None:
            options.setdefault("workers", max(spec.size // options.get("nnodes", 1), 1))
    cfg, launch_cfg = split_options(config, launch_config, options)
    if parallel is not None and external_launcher() is None:  # torchrun's job size is checked in setup
        spec.check_workers(launch_cfg.workers * launch_cfg.nnodes)
    task = _task_from(task, loss_fn, metrics, forward_fn, collate_fn, cfg.precision)
    if scheduler_fn is not None and cfg.lr_schedule not in (None, "constant"):
        raise UsageError(f"Expected either scheduler_fn or lr_schedule. Received both (lr_schedule="
                         f"{cfg.lr_schedule!r})")
    auto = cfg.resume == "auto"
    strat = get_strategy(strategy)
    ckpt = _check_run(cfg, launch_cfg, strat)
    if external_launcher() is None:  # joining a job (torchrun, Ray, Slurm): it runs here, nothing is sent
        for name, obj in (("model_fn", model_fn), ("data", data), ("optimizer_fn", optimizer_fn),
                          ("loss_fn", task.loss_fn), ("metrics", task.metric_spec), ("forward_fn", task.forward_fn),
                          ("collate_fn", task.collate_fn), ("scheduler_fn", scheduler_fn)):
            _check_picklable(name, obj)
    if ckpt is not None and not check_resume(cfg, ckpt, cfg.resume or "", auto):
        history = list(ckpt.get("metrics") or [])
        return RunResult(history=history, out_dir=cfg.out_dir, checkpoint=cfg.resume,
                         model_state=consolidate(ckpt)["model"] if cfg.return_state else None, model_fn=model_fn)
    if starts_processes(launch_cfg.workers, strat, launch_cfg.nnodes, launch_cfg.master_addr):
        start_server_early()  # it imports torch while this process loads the data and checks the model
    train_ds, test_ds = _check_data(data, cfg, launch_cfg, strat, task, ckpt)
    known = launch_cfg.workers is not None and external_launcher() is None
    task = _check_model(model_fn, optimizer_fn, train_ds, test_ds, data, task, cfg, ckpt, strat,
                        launch_cfg.workers * launch_cfg.nnodes if known else None)
    if task.own_loss:
        task.check_exact(strat.data_parallel_workers(launch_cfg.workers) * launch_cfg.nnodes, cfg.accumulate)
        if not cfg.quiet and _is_first_process(launch_cfg):
            print(task.own_loss_line(), file=sys.stderr, flush=True)
    if cfg.out_dir and _is_first_process(launch_cfg):
        write_config(os.path.join(cfg.out_dir, "config.json"),
                     run_settings(cfg, launch_cfg, strat, task, data, optimizer_fn, model_fn))
    job = WorkerJob(model_fn, data, optimizer_fn, task, scheduler_fn, cfg)
    results = launch(run_worker, job, strategy=strat, **launch_cfg.as_kwargs())
    result = results[0]
    if result is not None:
        result.model_fn = model_fn
    return result


def _check_run(cfg: FitConfig, launch_cfg: LaunchConfig, strat: Strategy) -> dict[str, Any] | None:
    """The checkpoint to resume (``resume="auto"`` resolved in ``cfg``, the file read once and
    its model checked against ``cfg.model_spec``), the run directory and the checkpoint cadence."""
    if cfg.resume == "auto":
        cfg.resume = latest_checkpoint(cfg.out_dir or ".")  # checkpoint.pt or checkpoint.dcp
        resuming = True  # resume="auto" continues whatever is there: a restart before the first checkpoint starts again
    else:
        resuming = cfg.resume is not None
    ckpt = load_checkpoint(cfg.resume) if cfg.resume is not None else None  # one line when unreadable
    if ckpt is not None:
        _same_model(ckpt, cfg.model_spec, cfg.resume or "")
    if _is_first_process(launch_cfg) and cfg.out_dir:  # under torchrun every rank runs this: one judges
        check_run_dir(cfg.out_dir, resume=resuming, overwrite=cfg.overwrite)
    if (cfg.checkpoint_every or cfg.checkpoint_seconds) and not strat.checkpoints_within_epoch:
        raise UsageError("Expected checkpoint_every / checkpoint_seconds with a strategy whose workers agree on "
                         "every step (allreduce, single). Received: strategy "
                         f"{strat.name!r}, which checkpoints at epoch ends only")
    if cfg.checkpoint_async and not strat.sharded_checkpoints:
        raise UsageError("Expected checkpoint_async with a strategy that writes sharded checkpoints (fsdp, tp). "
                         f"Received: strategy {strat.name!r}, whose checkpoint is one file written by worker 0")
    return ckpt


def _check_data(data: DataArg, cfg: FitConfig, launch_cfg: LaunchConfig, strat: Strategy, task: Task,
                ckpt: dict[str, Any] | None) -> tuple[Dataset, Dataset | None]:
    """The data loaded once here (a `DataSpec` keeps it for a worker in this process) and
    checked against the feeding options and a mid-epoch checkpoint's position."""
    train_ds, test_ds = resolve_data(data)
    if isinstance(test_ds, Generated):
        raise UsageError("Expected a Dataset of samples (or None) to evaluate on. Received: a batch generator "
                         "(Generated) as the test set")
    if cfg.samples_per_epoch is not None and isinstance(train_ds, Generated):
        raise UsageError("Expected samples_per_epoch with a Dataset of samples; a batch generator sets its own "
                         f"epoch. Received: samples_per_epoch={cfg.samples_per_epoch} with a Generated training set")
    _check_feeding(cfg, train_ds, task)
    if not isinstance(train_ds, Generated):
        known = launch_cfg.workers is not None and external_launcher() is None
        workers = strat.data_parallel_workers(launch_cfg.workers * launch_cfg.nnodes) if known else None
        check_sizes(train_ds, test_ds, workers, _data_name(data))  # type: ignore[operator]
        if not cfg.quiet:
            warn_one_step_epochs(train_ds, cfg.samples_per_epoch, cfg.batch_size * cfg.accumulate, workers or 1)
    if cfg.on_nan == "stop":  # "skip" drops the steps those samples reach, and counts them
        check_finite(train_ds, "training", _data_name(data))
    if cfg.on_nan != "off":
        check_finite(test_ds, "test", _data_name(data))
    if ckpt is not None:
        same_samples_per_epoch(ckpt, cfg.samples_per_epoch)
    if ckpt is not None and ckpt.get("within_epoch"):  # one line here rather than from every worker
        if launch_cfg.workers is not None and external_launcher() is None:  # else the job's size decides there
            same_workers(ckpt["within_epoch"], strat.data_parallel_workers(launch_cfg.workers * launch_cfg.nnodes))
        resume_batch(int(ckpt["within_epoch"]["batch"]), ckpt, cfg.batch_size,
                     bucketed=cfg.bucket is not False and lengths_of(train_ds) is not None)
    return train_ds, test_ds


def _check_model(model_fn: Callable[[], nn.Module], optimizer_fn: Callable[..., Optimizer], train_ds: Dataset,
                 test_ds: Dataset | None, data: DataArg, task: Task, cfg: FitConfig,
                 ckpt: dict[str, Any] | None, strat: Strategy, workers: int | None) -> Task:
    """One model built (with the run's seed) and checked against the data, the loss, the optimizer
    settings, the monitored figure, the checkpoint's weights and the strategy (for ``workers``
    processes, when known here); ``cfg.model_spec`` filled in. Returns the task resolved on the data."""
    # a strategy whose processes each hold a part: never the whole model here (under torchrun every
    # process is a caller), its shapes on the meta device
    with torch.random.fork_rng(devices=[]), torch.device("meta") if strat.holds_part_of_model else contextlib.nullcontext():
        torch.manual_seed(cfg.seed)
        model = model_fn()
    if not isinstance(model, nn.Module):
        raise UsageError(f"Expected model_fn to return a torch.nn.Module. Received: {type(model).__name__}")
    try:
        task = check_model_takes(model, train_ds, _model_name(cfg.model_spec), _data_name(data), task=task)
    except OwnLossOnMeta:  # a Hugging Face head's own loss: how it reduces is read off values
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(cfg.seed)
            model = model_fn()
        task = check_model_takes(model, train_ds, _model_name(cfg.model_spec), _data_name(data), task=task)
    if cfg.activation_checkpointing:
        blocks_to_checkpoint(model, cfg.activation_checkpointing)  # one line here when it names nothing
    _check_optimizer(optimizer_fn, model)
    _check_monitor(cfg, task, has_test=test_ds is not None and len(test_ds) > 0)  # type: ignore[arg-type]
    if ckpt is not None:
        fit_weights(model, ckpt["model"], f"the model of model_fn to resume {cfg.resume!r}")
    if workers is not None:
        strat.check_model(model, workers)
    if cfg.model_spec is None:
        cfg.model_spec = infer_model_spec(model_fn, train_ds, task, data, task.collate_fn)
    return task


def _same_model(ckpt: dict[str, Any], spec: dict[str, Any] | None, path: str) -> None:
    """A checkpoint resumes the model it was written by (when both name theirs)."""
    old, new = (ckpt.get("model_spec") or {}).get("name"), (spec or {}).get("name")
    if old and new and old != new:
        raise UsageError(f"Expected the model {old!r} (the checkpoint's) to resume {path!r}. Received: model {new!r}")


def _model_name(spec: dict[str, Any] | None) -> str:
    """How error lines name the model: by its spec's name when the caller gave one (the CLI's --model)."""
    return f"model {spec['name']!r}" if spec and spec.get("name") else "model"


def _data_name(data: Any) -> str:
    return f"dataset {data.name!r}" if isinstance(data, DataSpec) else "dataset"


def _check_optimizer(optimizer_fn: Callable[..., Optimizer], model: nn.Module) -> None:
    """Bad optimizer settings (a NaN lr, a negative momentum) are one line here, not one per worker.
    A model on the meta device lends the optimizer one-value stand-ins of its parameters' dtypes
    (an optimizer's device checks, e.g. ``fused=True``'s, know no meta device)."""
    params = ([torch.zeros(1, dtype=p.dtype, requires_grad=p.requires_grad) for p in model.parameters()]
              if on_meta(model) else model.parameters())
    try:
        optimizer_fn(params)
    except UsageError:
        raise
    except (ValueError, TypeError) as exc:  # torch.optim's own checks of its settings
        raise UsageError(f"Expected optimizer_fn to build an optimizer of the model's parameters. Received: "
                         f"{type(exc).__name__}: {first_line(exc)}") from None


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
    known = ["epoch", "step", "lr", "samples_per_s"] + [f"{s}_{m}" for s in splits for m in ["loss", *task.reported_metrics]]
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

"""`fit`: the standard training loop, under any strategy, from Python or the CLI.

Batch size is **per worker**: with ``batch_size=32`` and 4 workers a step sees a
global batch of 128 samples (times ``accumulate`` micro-batches). The learning
rate is used as given unless ``scale_lr=True``, which applies the linear
scaling rule: ``lr * workers * accumulate`` (the rate given is the one for a
single worker's batch).

The loss of a step is normalised by the *global* batch: each worker sums its
per-sample losses and divides by the global sample count (times the number of
workers, which all-reduce averaging divides back out). So synchronous data
parallel training computes exactly the gradient of a single process on the
concatenated batch, also when the last batch of an epoch splits unevenly.

Resume is exact for the same strategy and world size: checkpoints are written
at epoch ends, and every random stream (data order, dropout) is re-seeded from
``(seed, epoch, rank)`` at the start of each epoch.

A worker's run is a sequence of named steps: `build` (data, model, optimizer,
weights of a checkpoint), `restore` (optimizer, strategy and scheduler state),
then per epoch `train_epoch` (every micro-batch through ``Strategy.train_step``),
`record` (evaluation and the epoch's figures, reduced over workers) and
`save` (checkpoint, metrics files, the epoch line).
"""

from __future__ import annotations

import json
import math
import os
import pickle
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.optim import Optimizer
from torch.utils.data import DataLoader, Dataset, TensorDataset

from ..data.datasets import DataSpec, load_dataset, sample_shape
from ..errors import UsageError
from ..launch import launch
from ..nn.freeze import freeze_state_dict, load_freeze_state_dict
from ..strategies.base import Strategy, get_strategy
from .checkpoint import load_checkpoint, save_checkpoint
from .config import FitConfig, LaunchConfig, split_options
from .metrics import MetricsWriter, StepTimes

DataArg = DataSpec | str | Callable[[], tuple[Dataset, Dataset]] | tuple[Dataset, Dataset]
LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
SchedulerFn = Callable[[Optimizer], Any]


def cross_entropy_per_sample(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output, target, reduction="none")


@dataclass
class RunResult:
    """What `fit` returns (from worker 0): per-epoch history and the final figures."""

    history: list[dict[str, Any]] = field(default_factory=list)
    out_dir: str | None = None
    checkpoint: str | None = None
    model_state: dict[str, torch.Tensor] | None = None

    @property
    def final(self) -> dict[str, Any]:
        return self.history[-1] if self.history else {}

    @property
    def test_accuracy(self) -> float:
        return float(self.final.get("test_accuracy", math.nan))

    @property
    def train_loss(self) -> float:
        return float(self.final.get("train_loss", math.nan))


def fit(model_fn: Callable[[], nn.Module], data: DataArg, optimizer_fn: Callable[..., Optimizer],
        config: FitConfig | None = None, *, strategy: Strategy | str = "allreduce",
        loss_fn: LossFn = cross_entropy_per_sample, scheduler_fn: SchedulerFn | None = None,
        launch_config: LaunchConfig | None = None, **options: Any) -> RunResult | None:
    """Train ``model_fn()`` on ``data`` with ``optimizer_fn(params)`` under ``strategy``.

    Args:
        model_fn: builds the model (a module-level function or ``functools.partial``:
            it is sent to the worker processes).
        data: a dataset name or `DataSpec` (``digits``, ``synthetic``, ``x.npz``,
            ``module:function``), a function returning ``(train, test)``, or the pair itself.
        optimizer_fn: ``params -> torch.optim.Optimizer``.
        config: how the loop trains (`FitConfig`: epochs, batch_size, accumulate,
            scale_lr, seed, max_steps, out_dir, resume, ...).
        strategy: a `Strategy` or its name.
        loss_fn: ``(output, target) -> per-sample losses`` (``reduction="none"``).
        scheduler_fn: ``optimizer -> LR scheduler`` stepped once per epoch.
        launch_config: where the workers run (`LaunchConfig`: workers, timeout, backend,
            device, threads, nnodes, node_rank, master_addr, master_port, pool).
        **options: any field of either config by name (``epochs=5, workers=2``);
            they override the objects' values.

    Returns:
        Worker 0's `RunResult` (``None`` on the other machines of a multi-node job).
    """
    cfg, launch_cfg = split_options(config, launch_config, options)
    if cfg.resume == "auto":
        candidate = os.path.join(cfg.out_dir or ".", "checkpoint.pt")
        cfg.resume = candidate if os.path.exists(candidate) else None
    if cfg.resume is not None:
        load_checkpoint(cfg.resume)  # fails early with one line when unreadable
    strat = get_strategy(strategy)
    for name, obj in (("model_fn", model_fn), ("data", data), ("optimizer_fn", optimizer_fn),
                      ("loss_fn", loss_fn), ("scheduler_fn", scheduler_fn)):
        _check_picklable(name, obj)
    results = launch(_fit_worker, model_fn, data, optimizer_fn, loss_fn, scheduler_fn, cfg,
                     strategy=strat, **launch_cfg.as_kwargs())
    return results[0]


def _check_picklable(name: str, obj: Any) -> None:
    try:
        pickle.dumps(obj)
    except Exception as exc:
        raise UsageError(
            f"Expected {name} to be picklable (a module-level function, functools.partial or plain "
            f"data) so worker processes can receive it. Received: {obj!r} ({type(exc).__name__})"
        ) from None


def resolve_data(data: DataArg) -> tuple[Dataset, Dataset]:
    if isinstance(data, (DataSpec, str)):
        return load_dataset(data)
    if isinstance(data, tuple) and len(data) == 2:
        return data
    if callable(data):
        return data()
    raise UsageError(f"Expected data as a dataset name, DataSpec, (train, test) or a function. Received: {type(data).__name__}")


def check_model_takes(model: nn.Module, ds: Dataset, model_name: str = "model", data_name: str = "dataset") -> None:
    """One clear line when the model cannot take the dataset's samples."""
    x = torch.stack([ds[i][0] for i in range(min(2, len(ds)))])  # type: ignore[arg-type]
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            model(x)
    except Exception as exc:
        msg = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UsageError(
            f"Expected samples that {model_name} can take. Received: {data_name} with samples of shape "
            f"{tuple(sample_shape(ds))} ({msg})"
        ) from None
    finally:
        model.train(was_training)


class _Batches:
    """This worker's batches of one epoch: direct tensor indexing for in-memory data."""

    def __init__(self, ds: Dataset, sampler: Any, device: torch.device) -> None:
        self.ds, self.sampler, self.device = ds, sampler, device
        self.tensors = ds.tensors if isinstance(ds, TensorDataset) else None

    def __len__(self) -> int:
        return len(self.sampler)

    def __iter__(self):  # noqa: ANN204
        non_blocking = self.device.type == "cuda"
        if self.tensors is not None:
            x_all, y_all = self.tensors[0], self.tensors[1]
            for index in self.sampler.iter_tensors():
                yield (x_all.index_select(0, index).to(self.device, non_blocking=non_blocking),
                       y_all.index_select(0, index).to(self.device, non_blocking=non_blocking))
        else:
            loader = DataLoader(self.ds, batch_sampler=self.sampler, pin_memory=non_blocking)
            for x, y in loader:
                yield x.to(self.device, non_blocking=non_blocking), y.to(self.device, non_blocking=non_blocking)


@dataclass
class _Parts:
    """What one worker trains with, as `build` made it."""

    model: nn.Module  # wrapped by the strategy
    optimizer: Optimizer
    scheduler: Any
    train_ds: Dataset
    test_ds: Dataset


@dataclass
class _Position:
    """Where the run stands: the next epoch, optimizer steps taken, the figures so far."""

    epoch: int = 0
    step: int = 0
    history: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class _EpochTotals:
    """This worker's sums over one epoch (reduced over workers in `record`)."""

    loss_sum: torch.Tensor
    correct: torch.Tensor
    seen: int
    times: StepTimes
    comm_bytes: int
    seconds: float = 0.0


def _fit_worker(strategy: Strategy, model_fn: Callable[[], nn.Module], data: DataArg,
                optimizer_fn: Callable[..., Optimizer], loss_fn: LossFn,
                scheduler_fn: SchedulerFn | None, cfg: FitConfig) -> RunResult | None:
    ckpt = load_checkpoint(cfg.resume) if cfg.resume else None
    parts = build(strategy, model_fn, data, optimizer_fn, scheduler_fn, cfg, ckpt)
    position = restore(strategy, parts, ckpt)
    writer = _start_outputs(strategy, cfg, resumed=ckpt is not None)
    for epoch in range(position.epoch, cfg.epochs):
        if cfg.max_steps is not None and position.step >= cfg.max_steps:
            break
        totals = train_epoch(strategy, parts, loss_fn, cfg, epoch, position)
        position.history.append(record(strategy, parts, loss_fn, cfg, epoch, position.step, totals))
        position.epoch = epoch + 1
        save(strategy, parts, cfg, position, writer)
    return _result(strategy, parts, cfg, position)


def build(strategy: Strategy, model_fn: Callable[[], nn.Module], data: DataArg,
          optimizer_fn: Callable[..., Optimizer], scheduler_fn: SchedulerFn | None, cfg: FitConfig,
          ckpt: dict[str, Any] | None) -> _Parts:
    """Data, model (with a checkpoint's weights and frozen slices), optimizer, strategy wrap."""
    train_ds, test_ds = resolve_data(data)
    torch.manual_seed(cfg.seed)  # same initial weights on every worker
    model = model_fn()
    if strategy.is_main:
        check_model_takes(model, train_ds)
    if ckpt is not None:
        model.load_state_dict(ckpt["model"])
        if ckpt.get("freeze"):  # frozen slices stay frozen across a resume
            load_freeze_state_dict(model, ckpt["freeze"], strict=False)
    model = model.to(strategy.device)
    optimizer = optimizer_fn(model.parameters())
    if cfg.scale_lr:
        for group in optimizer.param_groups:
            group["lr"] = group["lr"] * strategy.num_workers * cfg.accumulate
            if "initial_lr" in group:
                group["initial_lr"] = group["lr"]
    model, optimizer = strategy.prepare(model, optimizer)
    scheduler = scheduler_fn(optimizer) if scheduler_fn else None
    return _Parts(model, optimizer, scheduler, train_ds, test_ds)


def restore(strategy: Strategy, parts: _Parts, ckpt: dict[str, Any] | None) -> _Position:
    """Optimizer, strategy and scheduler state of a checkpoint, and where it stopped."""
    if ckpt is None:
        return _Position()
    if ckpt.get("optimizer") is not None:
        parts.optimizer.load_state_dict(ckpt["optimizer"])
    if ckpt.get("strategy"):
        strategy.load_state_dict(ckpt["strategy"])
    if parts.scheduler is not None and ckpt.get("scheduler") is not None:
        parts.scheduler.load_state_dict(ckpt["scheduler"])
    return _Position(ckpt["epoch"], ckpt["step"], list(ckpt.get("metrics") or []))


def train_epoch(strategy: Strategy, parts: _Parts, loss_fn: LossFn, cfg: FitConfig, epoch: int,
                position: _Position) -> _EpochTotals:
    """One epoch of this worker's batches; advances ``position.step``."""
    device = strategy.device
    torch.manual_seed(cfg.seed * 7919 + epoch * 1009 + strategy.rank)
    sampler = strategy.shard(len(parts.train_ds), cfg.batch_size, shuffle=True, seed=cfg.seed,  # type: ignore[arg-type]
                             drop_last=cfg.drop_last)
    sampler.set_epoch(epoch)
    batches = _Batches(parts.train_ds, sampler, device)
    parts.model.train()
    totals = _EpochTotals(torch.zeros((), dtype=torch.float64, device=device),
                          torch.zeros((), dtype=torch.float64, device=device), 0, StepTimes(),
                          strategy.comm_bytes)
    t_epoch = time.perf_counter()
    bar = _progress(len(batches), epoch, cfg.epochs) if _show_bar(strategy, cfg) else None
    n_batches = len(batches)
    window_total = 0
    pending = False  # gradients of an unfinished accumulation window
    totals.times.start()
    for i, (x, y) in enumerate(batches):
        totals.times.data_ready()
        comm_before = strategy.comm_seconds
        if sampler.claims_batches:
            # claimed batches (asynchronous strategies): the step count is not known ahead, each
            # worker normalises by its own micro-batches and flushes a partial window at the end
            update = (i + 1) % cfg.accumulate == 0
            window_total = strategy.num_workers * len(y) * cfg.accumulate
        else:
            if i % cfg.accumulate == 0:  # global samples in this optimizer step
                window_total = sum(sampler.global_batch_size(j)
                                   for j in range(i, min(i + cfg.accumulate, n_batches)))
            update = (i + 1) % cfg.accumulate == 0 or i + 1 == n_batches
        out, per_sample = strategy.train_step(parts.model, parts.optimizer, x, y, loss_fn,
                                              loss_scale=strategy.num_workers / max(window_total, 1),
                                              update=update)
        pending = not update
        if update:
            position.step += 1
        totals.loss_sum += per_sample.sum()
        totals.correct += _correct(out, y)
        totals.seen += len(y)
        totals.times.step_done(strategy.comm_seconds - comm_before)
        if bar is not None:
            bar.update(1)
        if update and cfg.max_steps is not None and position.step >= cfg.max_steps:
            break
    if pending:  # the last accumulation window of claimed batches was partial
        strategy.optimizer_step(parts.optimizer)
        position.step += 1
    if bar is not None:
        bar.close()
    if parts.scheduler is not None:
        parts.scheduler.step()
    strategy.barrier()  # the epoch lasts until its slowest worker is done
    totals.seconds = time.perf_counter() - t_epoch
    return totals


def record(strategy: Strategy, parts: _Parts, loss_fn: LossFn, cfg: FitConfig, epoch: int, step: int,
           totals: _EpochTotals) -> dict[str, Any]:
    """The epoch's row of figures: training sums and test figures, reduced over workers."""
    times = totals.times
    train = torch.tensor([totals.loss_sum.item(), totals.correct.item(), float(totals.seen), times.data,
                          times.compute, times.comm, float(strategy.comm_bytes - totals.comm_bytes)],
                         dtype=torch.float64)
    test_loss, test_acc = evaluate(strategy, parts.model, parts.test_ds, loss_fn, cfg.eval_batch_size)
    strategy.all_reduce_sum(train)
    n = max(train[2].item(), 1.0)
    w = strategy.num_workers
    seconds = totals.seconds
    row: dict[str, Any] = {
        "epoch": epoch + 1,
        "step": step,
        "train_loss": train[0].item() / n,
        "train_accuracy": train[1].item() / n,
        "test_loss": test_loss,
        "test_accuracy": test_acc,
        "samples": int(train[2].item()),
        "seconds": seconds,
        "samples_per_s": train[2].item() / seconds if seconds > 0 else math.nan,
        "time_data": train[3].item() / w,
        "time_compute": train[4].item() / w,
        "time_comm": train[5].item() / w,
        "comm_bytes": int(train[6].item()),
        "lr": parts.optimizer.param_groups[0]["lr"],
        "workers": w,
        "strategy": strategy.name,
    }
    row.update({f"{strategy.name}_{k}": v for k, v in strategy.metrics().items()})
    return row


def save(strategy: Strategy, parts: _Parts, cfg: FitConfig, position: _Position,
         writer: MetricsWriter | None) -> None:
    """The end of an epoch: checkpoint, metrics files and the epoch line (worker 0 writes)."""
    path = _checkpoint_path(cfg)
    state = None
    if path is not None:  # every worker takes part: a strategy may gather its state
        model_state = strategy.model_state_dict(parts.model)
        state = {"model": {k: v.detach().cpu() for k, v in model_state.items()},
                 "model_spec": cfg.model_spec,
                 "freeze": freeze_state_dict(strategy.unwrap(parts.model)),
                 "optimizer": _optimizer_state(parts.optimizer),
                 "strategy": strategy.state_dict(),
                 "scheduler": parts.scheduler.state_dict() if parts.scheduler is not None else None,
                 "epoch": position.epoch, "step": position.step,
                 "config": _jsonable({**asdict(cfg), "strategy": strategy.name,
                                      "workers": strategy.num_workers}),
                 "metrics": position.history}
    if strategy.is_main:
        if writer is not None:
            writer.write(position.history)
        if state is not None and path is not None:
            save_checkpoint(path, state)
        if not cfg.quiet:
            print(_summary(position.history[-1], cfg.epochs), flush=True)
    strategy.barrier()


def _start_outputs(strategy: Strategy, cfg: FitConfig, resumed: bool) -> MetricsWriter | None:
    """Worker 0's metrics writer, and config.json for a new run."""
    if not strategy.is_main or not cfg.out_dir:
        return None
    writer = MetricsWriter(cfg.out_dir, resume=resumed)
    if not resumed:
        with open(os.path.join(cfg.out_dir, "config.json"), "w") as f:
            json.dump({**asdict(cfg), "strategy": strategy.name,
                       "strategy_options": _jsonable(strategy.options()), "workers": strategy.num_workers},
                      f, indent=2, default=str)
    return writer


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


def _correct(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Correct predictions of a classification batch (0 for other tasks), on the device."""
    if out.dim() == 2 and y.dim() == 1 and not y.is_floating_point():
        return (out.argmax(1) == y).sum()
    return torch.zeros((), dtype=torch.int64, device=out.device)


def evaluate(strategy: Strategy, model: nn.Module, ds: Dataset, loss_fn: LossFn, batch_size: int) -> tuple[float, float]:
    """Loss and accuracy on ``ds``, each worker taking its shard, reduced over workers."""
    if ds is None or len(ds) == 0:  # type: ignore[arg-type]
        return math.nan, math.nan
    net = strategy.unwrap(model)
    was_training = net.training
    net.eval()
    sampler = strategy.shard(len(ds), batch_size, shuffle=False)  # type: ignore[arg-type]
    # summed on the device: no host synchronisation per batch
    totals = torch.zeros(3, dtype=torch.float64, device=strategy.device)
    with torch.no_grad():
        for x, y in _Batches(ds, sampler, strategy.device):
            out = net(x)
            totals[0] += loss_fn(out, y).sum()
            totals[1] += _correct(out, y)
            totals[2] += len(y)
    net.train(was_training)
    strategy.all_reduce_sum(totals)
    n = max(totals[2].item(), 1.0)
    return totals[0].item() / n, totals[1].item() / n


def _optimizer_state(optimizer: Optimizer) -> dict[str, Any] | None:
    try:
        return optimizer.state_dict()
    except Exception:  # a strategy whose optimizer state lives elsewhere keeps it in its own state
        return None


def _jsonable(obj: Any) -> Any:
    return json.loads(json.dumps(obj, default=str))


def _progress(total: int, epoch: int, epochs: int):  # noqa: ANN202
    from tqdm import tqdm

    return tqdm(total=total, desc=f"epoch {epoch + 1}/{epochs}", leave=False, dynamic_ncols=True)


def _summary(row: dict[str, Any], epochs: int) -> str:
    t = row["time_data"] + row["time_compute"] + row["time_comm"]
    share = (lambda v: 100 * v / t) if t > 0 else (lambda v: 0.0)
    return (f"epoch {row['epoch']}/{epochs}  loss {row['train_loss']:.4f}  acc {row['train_accuracy']:.3f}  "
            f"test_loss {row['test_loss']:.4f}  test_acc {row['test_accuracy']:.3f}  "
            f"{row['samples_per_s']:,.0f} samples/s  "
            f"[data {share(row['time_data']):.0f}% compute {share(row['time_compute']):.0f}% "
            f"comm {share(row['time_comm']):.0f}%]")

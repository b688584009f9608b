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
"""

from __future__ import annotations

import contextlib
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
from ..launch import DEFAULT_TIMEOUT, launch
from ..nn.freeze import freeze_state_dict, load_freeze_state_dict
from ..strategies.base import Strategy, get_strategy
from .checkpoint import load_checkpoint, save_checkpoint
from .metrics import MetricsWriter, StepTimes

DataArg = DataSpec | str | Callable[[], tuple[Dataset, Dataset]] | tuple[Dataset, Dataset]
LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def cross_entropy_per_sample(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output, target, reduction="none")


@dataclass
class FitConfig:
    """Everything a worker needs besides the factories (picklable)."""

    epochs: int = 1
    batch_size: int = 32
    eval_batch_size: int = 512
    accumulate: int = 1
    scale_lr: bool = False
    seed: int = 0
    out_dir: str | None = None
    resume: str | None = None
    quiet: bool = False
    progress: bool | None = None
    max_steps: int | None = None
    drop_last: bool = False
    return_state: bool = False
    model_spec: dict[str, Any] | None = None
    checkpoint: bool = True


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


def fit(model_fn: Callable[[], nn.Module], data: DataArg, optimizer_fn: Callable[..., Optimizer], *,
        strategy: Strategy | str = "allreduce", workers: int = 1, epochs: int = 1, batch_size: int = 32,
        accumulate: int = 1, scale_lr: bool = False, loss_fn: LossFn = cross_entropy_per_sample,
        scheduler_fn: Callable[[Optimizer], Any] | None = None, out_dir: str | None = None,
        resume: str | None = None, seed: int = 0, quiet: bool = False, progress: bool | None = None,
        max_steps: int | None = None, drop_last: bool = False, return_state: bool = False,
        model_spec: dict[str, Any] | None = None, timeout: float = DEFAULT_TIMEOUT,
        backend: str | None = None, device: str | None = None, threads: int | None = None,
        eval_batch_size: int = 512, checkpoint: bool = True, nnodes: int = 1, node_rank: int = 0,
        master_addr: str | None = None, master_port: int | None = None) -> RunResult | None:
    """Train ``model_fn()`` on ``data`` with ``optimizer_fn(params)`` under ``strategy``.

    Args:
        model_fn: builds the model (a module-level function or ``functools.partial``:
            it is sent to the worker processes).
        data: a dataset name or `DataSpec` (``digits``, ``synthetic``, ``x.npz``,
            ``module:function``), a function returning ``(train, test)``, or the pair itself.
        optimizer_fn: ``params -> torch.optim.Optimizer``.
        strategy: a `Strategy` or its name; ``workers``: processes to train with.
        batch_size: samples per worker per micro-batch; ``accumulate``: micro-batches
            per optimizer step (inner ones skip gradient communication).
        loss_fn: ``(output, target) -> per-sample losses`` (``reduction="none"``).
        scheduler_fn: ``optimizer -> LR scheduler`` stepped once per epoch.
        out_dir: where metrics, curves and checkpoints go (none written without it).
        resume: a checkpoint path to continue from (``"auto"``: ``out_dir/checkpoint.pt``
            if it exists).
        max_steps: stop after this many optimizer steps in total.
        return_state: put the final model ``state_dict`` in the result.
        timeout, backend, device, threads, nnodes, node_rank, master_addr, master_port:
            passed to `partrain.launch`.

    Returns:
        Worker 0's `RunResult` (``None`` on the other machines of a multi-node job).
    """
    if epochs < 1:
        raise UsageError(f"Expected a positive number of epochs. Received: epochs={epochs}")
    if batch_size < 1:
        raise UsageError(f"Expected a positive batch size. Received: batch_size={batch_size}")
    if accumulate < 1:
        raise UsageError(f"Expected accumulate >= 1. Received: accumulate={accumulate}")
    if resume == "auto":
        candidate = os.path.join(out_dir or ".", "checkpoint.pt")
        resume = candidate if os.path.exists(candidate) else None
    if resume is not None:
        load_checkpoint(resume)  # fails early with one line when unreadable
    strat = get_strategy(strategy)
    cfg = FitConfig(epochs=epochs, batch_size=batch_size, eval_batch_size=eval_batch_size,
                    accumulate=accumulate, scale_lr=scale_lr, seed=seed, out_dir=out_dir, resume=resume,
                    quiet=quiet, progress=progress, max_steps=max_steps, drop_last=drop_last,
                    return_state=return_state, model_spec=model_spec, checkpoint=checkpoint)
    for name, obj in (("model_fn", model_fn), ("data", data), ("optimizer_fn", optimizer_fn),
                      ("loss_fn", loss_fn), ("scheduler_fn", scheduler_fn)):
        _check_picklable(name, obj)
    results = launch(_fit_worker, model_fn, data, optimizer_fn, loss_fn, scheduler_fn, cfg,
                     workers=workers, strategy=strat, timeout=timeout, backend=backend, device=device,
                     threads=threads, nnodes=nnodes, node_rank=node_rank, master_addr=master_addr,
                     master_port=master_port)
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


def _fit_worker(strategy: Strategy, model_fn: Callable[[], nn.Module], data: DataArg,
                optimizer_fn: Callable[..., Optimizer], loss_fn: LossFn,
                scheduler_fn: Callable[[Optimizer], Any] | None, cfg: FitConfig) -> RunResult | None:
    main = strategy.is_main
    device = strategy.device
    train_ds, test_ds = resolve_data(data)

    torch.manual_seed(cfg.seed)  # same initial weights on every worker
    model = model_fn()
    if main:
        check_model_takes(model, train_ds)
    ckpt = load_checkpoint(cfg.resume) if cfg.resume else None
    if ckpt is not None:
        model.load_state_dict(ckpt["model"])
        if ckpt.get("freeze"):  # frozen slices stay frozen across a resume
            load_freeze_state_dict(model, ckpt["freeze"], strict=False)
    model = model.to(device)
    optimizer = optimizer_fn(model.parameters())
    if cfg.scale_lr:
        for group in optimizer.param_groups:
            group["lr"] = group["lr"] * strategy.num_workers * cfg.accumulate
            if "initial_lr" in group:
                group["initial_lr"] = group["lr"]
    model, optimizer = strategy.prepare(model, optimizer)
    scheduler = scheduler_fn(optimizer) if scheduler_fn else None
    start_epoch, step, history = 0, 0, []
    if ckpt is not None:
        if ckpt.get("optimizer") is not None:
            optimizer.load_state_dict(ckpt["optimizer"])
        if ckpt.get("strategy"):
            strategy.load_state_dict(ckpt["strategy"])
        if scheduler is not None and ckpt.get("scheduler") is not None:
            scheduler.load_state_dict(ckpt["scheduler"])
        start_epoch, step, history = ckpt["epoch"], ckpt["step"], list(ckpt.get("metrics") or [])

    writer = MetricsWriter(cfg.out_dir, resume=ckpt is not None) if main and cfg.out_dir else None
    if writer and ckpt is None:
        with open(os.path.join(cfg.out_dir, "config.json"), "w") as f:  # type: ignore[arg-type]
            json.dump({**asdict(cfg), "strategy": strategy.name, "strategy_options": _jsonable(strategy.options()),
                       "workers": strategy.num_workers}, f, indent=2, default=str)
    show_bar = main and not cfg.quiet and (cfg.progress if cfg.progress is not None else sys.stderr.isatty())
    ckpt_path = os.path.join(cfg.out_dir, "checkpoint.pt") if cfg.out_dir else None

    for epoch in range(start_epoch, cfg.epochs):
        if cfg.max_steps is not None and step >= cfg.max_steps:
            break
        torch.manual_seed(cfg.seed * 7919 + epoch * 1009 + strategy.rank)
        sampler = strategy.shard(len(train_ds), cfg.batch_size, shuffle=True, seed=cfg.seed,  # type: ignore[arg-type]
                                 drop_last=cfg.drop_last)
        sampler.set_epoch(epoch)
        batches = _Batches(train_ds, sampler, device)
        model.train()
        times = StepTimes()
        loss_sum = torch.zeros((), dtype=torch.float64, device=device)
        correct = torch.zeros((), dtype=torch.float64, device=device)
        seen = 0
        bytes0 = strategy.comm_bytes
        t_epoch = time.perf_counter()
        bar = _progress(len(batches), epoch, cfg.epochs) if show_bar else None
        n_batches = len(batches)
        window_total = 0
        times.start()
        # claimed batches (asynchronous strategies): the step count is not known ahead, each
        # worker normalises by its own micro-batches and flushes a partial window at the end
        dynamic = getattr(sampler, "dynamic", False)
        pending = False
        for i, (x, y) in enumerate(batches):
            times.data_ready()
            comm_before = strategy.comm_seconds
            if dynamic:
                last_micro = (i + 1) % cfg.accumulate == 0
                window_total = strategy.num_workers * len(y) * cfg.accumulate
            else:
                if i % cfg.accumulate == 0:  # global samples in this optimizer step
                    window_total = sum(sampler.global_batch_size(j)
                                       for j in range(i, min(i + cfg.accumulate, n_batches)))
                last_micro = (i + 1) % cfg.accumulate == 0 or i + 1 == n_batches
            # inner micro-batches of an accumulation window skip gradient communication;
            # the forward pass must be inside no_sync too (DDP decides there)
            sync = strategy.no_sync(model) if not last_micro else contextlib.nullcontext()
            with sync:
                out = model(x)
                per_sample = loss_fn(out, y)
                (per_sample.sum() * (strategy.num_workers / max(window_total, 1))).backward()
            pending = not last_micro
            if last_micro:
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                step += 1
            with torch.no_grad():
                loss_sum += per_sample.detach().sum()
                if out.dim() == 2 and y.dim() == 1 and not y.is_floating_point():
                    correct += (out.detach().argmax(1) == y).sum()
            seen += len(y)
            times.step_done(strategy.comm_seconds - comm_before)
            if bar is not None:
                bar.update(1)
            if last_micro and cfg.max_steps is not None and step >= cfg.max_steps:
                break
        if pending:  # the last accumulation window of claimed batches was partial
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
        if bar is not None:
            bar.close()
        if scheduler is not None:
            scheduler.step()
        strategy.barrier()  # the epoch lasts until its slowest worker is done
        epoch_seconds = time.perf_counter() - t_epoch
        train = torch.tensor([loss_sum.item(), correct.item(), float(seen), times.data, times.compute,
                              times.comm, float(strategy.comm_bytes - bytes0)], dtype=torch.float64)
        test_loss, test_acc = evaluate(strategy, model, test_ds, loss_fn, cfg.eval_batch_size)
        strategy.all_reduce_sum(train)
        n = max(train[2].item(), 1.0)
        w = strategy.num_workers
        row: dict[str, Any] = {
            "epoch": epoch + 1,
            "step": step,
            "train_loss": train[0].item() / n,
            "train_accuracy": train[1].item() / n,
            "test_loss": test_loss,
            "test_accuracy": test_acc,
            "samples": int(train[2].item()),
            "seconds": epoch_seconds,
            "samples_per_s": train[2].item() / epoch_seconds if epoch_seconds > 0 else math.nan,
            "time_data": train[3].item() / w,
            "time_compute": train[4].item() / w,
            "time_comm": train[5].item() / w,
            "comm_bytes": int(train[6].item()),
            "lr": optimizer.param_groups[0]["lr"],
            "workers": w,
            "strategy": strategy.name,
        }
        row.update({f"{strategy.name}_{k}": v for k, v in strategy.metrics().items()})
        history.append(row)
        state = None
        if cfg.checkpoint and ckpt_path is not None:
            model_state = strategy.model_state_dict(model)
            strategy_state = strategy.state_dict()
            state = {"model": {k: v.detach().cpu() for k, v in model_state.items()},
                     "model_spec": cfg.model_spec,
                     "freeze": freeze_state_dict(strategy.unwrap(model)),
                     "optimizer": _optimizer_state(optimizer),
                     "strategy": strategy_state,
                     "scheduler": scheduler.state_dict() if scheduler is not None else None,
                     "epoch": epoch + 1, "step": step,
                     "config": _jsonable({**asdict(cfg), "strategy": strategy.name, "workers": w}),
                     "metrics": history}
        if main:
            if writer is not None:
                writer.write(history)
            if state is not None and ckpt_path is not None and cfg.checkpoint:
                save_checkpoint(ckpt_path, state)
            if not cfg.quiet:
                print(_summary(row, cfg.epochs), flush=True)
        strategy.barrier()

    final_state = None
    if cfg.return_state:  # every worker takes part: a strategy may gather the parameters
        final_state = {k: v.detach().cpu().clone() for k, v in strategy.model_state_dict(model).items()}
    if not main:
        return None
    return RunResult(history=history, out_dir=cfg.out_dir,
                     checkpoint=ckpt_path if cfg.checkpoint and ckpt_path else None, model_state=final_state)


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
            if out.dim() == 2 and y.dim() == 1 and not y.is_floating_point():
                totals[1] += (out.argmax(1) == y).sum()
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

"""When a run writes checkpoints, and what they hold.

`Checkpointer` is asked once per optimizer step (`due`) whether a mid-epoch checkpoint is
due (every ``checkpoint_every`` steps, or ``checkpoint_seconds`` on worker 0's clock, asked
with one small all-reduce so every worker decides alike), and writes the epoch-end one
(`gather` then `write`, with ``best.pt`` when the monitored figure improved) and mid-epoch ones
(`save_within_epoch`, with every worker's random state and partial sums). Every worker takes
part in a save (a strategy may gather its state); worker 0 writes.

A strategy whose processes each hold part of the model (``sharded_checkpoints``: fsdp, tp)
writes ``checkpoint.dcp`` instead (`partrain.sharded_checkpoint`): every process its own
shards, worker 0 the rest (``state.pt``) and the commit; with ``checkpoint_async`` the shards
are copied and written by a background thread while training goes on (the next save and the
run's end wait for it). At the run's end worker 0 exports the newest one as ``checkpoint.pt``
(the one-file form ``partrain serve`` and every strategy read). `shard_loader` reads a sharded
checkpoint into the shards of a run with any mesh or process count.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

import torch
from torch.optim import Optimizer

from .. import comm
from ..checkpoint import save_checkpoint
from ..nn.freeze import freeze_state_dict
from ..sharded_checkpoint import (
    BEST_NAME,
    SHARDED_NAME,
    STATE_FILE,
    commit,
    copy_version,
    export,
    latest_version,
    load_in_place,
    remove_leftovers,
    save_tensors,
    training_tensors,
    version_name,
)
from ..strategies.base import Strategy
from .config import FitConfig
from .epoch import EpochTotals, Position
from .stopping import best_epoch

if TYPE_CHECKING:
    from .trainer import Trainer


class Checkpointer:
    """A worker's checkpoint cadence and writer (``path`` None: the run writes no checkpoint)."""

    #: with ``checkpoint_seconds``, worker 0's clock is asked every this many optimizer steps
    PROBE_STEPS = 10

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer
        self.strategy: Strategy = trainer.strategy
        self.cfg: FitConfig = trainer.cfg
        self.path = checkpoint_path(self.cfg)
        self.within = bool(self.cfg.checkpoint_every or self.cfg.checkpoint_seconds)
        self.last = time.monotonic()
        #: ``OUT/checkpoint.dcp`` when the strategy writes sharded checkpoints, else None
        self.root = os.path.join(os.path.dirname(self.path), SHARDED_NAME) \
            if self.path is not None and self.strategy.sharded_checkpoints else None
        self.pending: _Pending | None = None  # the background write of the last sharded checkpoint
        self.wrote = False  # this run wrote a sharded checkpoint (its end exports one file)
        self._group: Any = None  # the background writes' own process group

    def due(self, step: int) -> bool:
        """Whether a mid-epoch checkpoint is due after optimizer step ``step`` (the same on every worker)."""
        if not self.within:
            return False
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

    def gather(self, position: Position) -> dict[str, Any] | None:
        """The epoch-end checkpoint's state (None: the run writes none, or wrote it sharded now).
        Every worker calls it."""
        if self.path is None:
            return None
        if self.root is not None:
            history = position.history
            self.save_sharded(position, best=bool(history) and best_epoch(history, self.cfg) == len(history) - 1)
            return None
        return self.state(position)

    def write(self, state: dict[str, Any], history: list[dict[str, Any]]) -> None:
        """Worker 0: the epoch-end checkpoint, and ``best.pt`` when this epoch is the best so far."""
        assert self.path is not None
        save_checkpoint(self.path, state)
        if best_epoch(history, self.cfg) == len(history) - 1:
            _copy_atomic(self.path, os.path.join(os.path.dirname(self.path), "best.pt"))

    def save_within_epoch(self, position: Position, epoch: int, batch: int, totals: EpochTotals) -> None:
        """A checkpoint after micro-batch ``batch`` of ``epoch`` (at the end of an accumulation window).

        Besides the usual state it holds every worker's random state and partial sums of the
        epoch (gathered by an all-reduce of one row per worker), so a resume continues the
        epoch exactly: the same remaining batches, dropout masks and epoch figures.
        """
        if self.path is None:
            return
        strategy = self.strategy
        rng = torch.get_rng_state().to(torch.float64)
        sums = totals.packed()
        rows = torch.zeros(strategy.num_workers, len(rng) + len(sums), dtype=torch.float64)
        rows[strategy.rank] = torch.cat([rng, sums])
        strategy.all_reduce_sum(rows)  # a CPU tensor is fine under nccl too (comm moves it)
        within = {"batch": batch, "rng": rows[:, :len(rng)].to(torch.uint8), "sums": rows[:, len(rng):].clone()}
        if self.root is not None:
            self.save_sharded(Position(epoch, position.step, position.history), within=within)
            return
        state = self.state(Position(epoch, position.step, position.history))
        state["within_epoch"] = within
        if strategy.is_main:
            save_checkpoint(self.path, state)
        strategy.barrier()

    def state(self, position: Position) -> dict[str, Any]:
        """A checkpoint's content (every worker takes part: a strategy may gather its state)."""
        t, strategy = self.trainer, self.strategy
        model_state = strategy.model_state_dict(t.model)
        return {"model": {k: v.detach().cpu() for k, v in model_state.items()},
                "optimizer": _optimizer_state(t.optimizer), **self.described(position)}

    def described(self, position: Position) -> dict[str, Any]:
        """A checkpoint's content but the model's and the optimizer's tensors."""
        t, strategy, cfg = self.trainer, self.strategy, self.cfg
        return {"model_spec": cfg.model_spec,
                "task": t.task.describe(),
                "freeze": freeze_state_dict(strategy.unwrap(t.model)),
                "optimizer_class": t.optimizer_class,
                "strategy": strategy.state_dict(),
                "scheduler": t.scheduler.state_dict() if t.scheduler is not None else None,
                "epoch": position.epoch, "step": position.step,
                "config": _jsonable({**asdict(cfg), "strategy": strategy.name, "workers": strategy.num_workers}),
                "metrics": position.history}


    # ----- sharded checkpoints ----------------------------------------------------------------
    def save_sharded(self, position: Position, within: dict[str, Any] | None = None, best: bool = False) -> None:
        """A version of ``checkpoint.dcp``: every process writes its shards (in the background with
        ``checkpoint_async``), worker 0 ``state.pt``, then commits it (and copies it to ``best.dcp``
        when ``best``) once every process has written. Collective."""
        assert self.root is not None
        t, strategy = self.trainer, self.strategy
        self.wait()
        if not self.wrote:  # the first save of this run: what a crashed one left goes first
            if strategy.is_main:
                remove_leftovers(self.root)
            strategy.barrier()
        tensors, extra = training_tensors(strategy.unwrap(t.model), t.optimizer, strategy.checkpoint_layout)
        state = {**self.described(position), "sharded": extra}
        if within is not None:
            state["within_epoch"] = within
        name = version_name(position.step, position.epoch)
        tmp = os.path.join(self.root, f".tmp-{name}")
        os.makedirs(tmp, exist_ok=True)
        if strategy.is_main:
            save_checkpoint(os.path.join(tmp, STATE_FILE), state)
        asynchronous = self.cfg.checkpoint_async and comm.is_distributed()
        if asynchronous and self._group is None:  # its collectives must not interleave with training's
            self._group = comm.new_group(range(strategy.env.world_size), timeout=strategy.timeout, backend="gloo")
        future = save_tensors(tensors, tmp, process_group=self._group, asynchronous=asynchronous)
        self.wrote = True
        done = functools.partial(self._commit, tmp, name, best) if strategy.is_main else None
        if future is None:
            if done is not None:
                done()
        else:
            self.pending = _Pending(future, done)

    def _commit(self, tmp: str, name: str, best: bool) -> None:
        assert self.root is not None
        version = commit(tmp, self.root, name)
        if best:
            copy_version(version, os.path.join(os.path.dirname(self.root), BEST_NAME))

    def wait(self) -> None:
        """The background write of the last sharded checkpoint done and committed (or its error)."""
        pending, self.pending = self.pending, None
        if pending is not None:
            pending.wait(self.strategy.timeout)

    def finish(self) -> None:
        """The run's end: the last write done; worker 0 exports the newest sharded checkpoint as
        ``checkpoint.pt``, the one-file form (in this process, with no collective)."""
        self.wait()
        if self.wrote and self.strategy.is_main and self.path is not None and self.root is not None:
            version = latest_version(self.root)
            if version is not None:
                export(version, self.path)

    def shard_loader(self, ckpt: dict[str, Any] | None) -> Callable[[Optimizer | None], None] | None:
        """For a sharded checkpoint and a strategy that reads one into its shards: the call that
        loads the model and (given) the optimizer state in place (collective). None otherwise."""
        if ckpt is None or not ckpt.get("sharded_path") or not self.strategy.sharded_checkpoints:
            return None
        t, strategy = self.trainer, self.strategy

        def load(optimizer: Optimizer | None) -> None:
            load_in_place(ckpt["sharded_path"], strategy.unwrap(t.model), optimizer, strategy.checkpoint_layout,
                          ckpt.get("sharded") or {})

        return load


class _Pending:
    """A background write (DCP's future) and, on worker 0, the commit that follows it."""

    def __init__(self, future: Future, commit: Callable[[], None] | None) -> None:
        self.commit = commit
        self.error: BaseException | None = None
        self.done = threading.Event()
        future.add_done_callback(self._finish)

    def _finish(self, future: Future) -> None:
        try:
            future.result()
            if self.commit is not None:
                self.commit()
        except BaseException as exc:  # raised in the training thread by `wait`
            self.error = exc
        finally:
            self.done.set()

    def wait(self, timeout: float) -> None:
        if not self.done.wait(timeout):
            raise TimeoutError(f"Expected the background checkpoint write to finish within the timeout. Received: "
                             f"none after {timeout:g} s")
        if self.error is not None:
            raise self.error


def checkpoint_path(cfg: FitConfig) -> str | None:
    return os.path.join(cfg.out_dir, "checkpoint.pt") if cfg.checkpoint and cfg.out_dir else None


def _copy_atomic(src: str, dst: str) -> None:
    tmp = f"{dst}.tmp"
    shutil.copyfile(src, tmp)
    os.replace(tmp, dst)


def _optimizer_state(optimizer: Optimizer) -> dict[str, Any] | None:
    try:
        return optimizer.state_dict()
    except Exception:  # a strategy whose optimizer state lives elsewhere keeps it in its own state
        return None


def _jsonable(obj: Any) -> Any:
    return json.loads(json.dumps(obj, default=str))

"""When a run writes checkpoints, and what they hold.

`Checkpointer` is asked once per optimizer step (`due`) whether a mid-epoch checkpoint is
due (every ``checkpoint_every`` steps, or ``checkpoint_seconds`` on worker 0's clock, asked
with one small all-reduce so every worker decides alike), and writes the epoch-end one
(`gather` then `write`, with ``best.pt`` when the monitored figure improved) and mid-epoch ones
(`save_within_epoch`, with every worker's random state and partial sums). Every worker takes
part in a save (a strategy may gather its state); worker 0 writes.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

import torch
from torch.optim import Optimizer

from ..checkpoint import save_checkpoint
from ..nn.freeze import freeze_state_dict
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
        """The epoch-end checkpoint's state (None: the run writes none). Every worker calls it."""
        return self.state(position) if self.path is not None else None

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
        state = self.state(Position(epoch, position.step, position.history))
        state["within_epoch"] = {"batch": batch, "rng": rows[:, :len(rng)].to(torch.uint8),
                                 "sums": rows[:, len(rng):].clone()}
        if strategy.is_main:
            save_checkpoint(self.path, state)
        strategy.barrier()

    def state(self, position: Position) -> dict[str, Any]:
        """A checkpoint's content (every worker takes part: a strategy may gather its state)."""
        t, strategy, cfg = self.trainer, self.strategy, self.cfg
        model_state = strategy.model_state_dict(t.model)
        return {"model": {k: v.detach().cpu() for k, v in model_state.items()},
                "model_spec": cfg.model_spec,
                "task": t.task.describe(),
                "freeze": freeze_state_dict(strategy.unwrap(t.model)),
                "optimizer": _optimizer_state(t.optimizer),
                "optimizer_class": t.optimizer_class,
                "strategy": strategy.state_dict(),
                "scheduler": t.scheduler.state_dict() if t.scheduler is not None else None,
                "epoch": position.epoch, "step": position.step,
                "config": _jsonable({**asdict(cfg), "strategy": strategy.name, "workers": strategy.num_workers}),
                "metrics": position.history}


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

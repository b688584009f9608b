"""When a run stops before its last epoch: max steps, a time limit, early stopping.

`StopRule` is asked once per optimizer step (`step_limit`: ``max_steps`` reached) and once
per epoch (`before_epoch`, `after_epoch`). The NaN policy is the other stop and lives where
the numbers are seen, between the gradient exchange and the update (`partrain.train.guard`).
"""

from __future__ import annotations

import math
from typing import Any

from ..errors import UsageError
from .config import FitConfig


class StopRule:
    """The stopping conditions of one worker's run; a reason is ``"max_steps"``,
    ``"max_seconds"`` or ``"early_stop"`` (what `RunResult.stopped` reports)."""

    def __init__(self, cfg: FitConfig) -> None:
        self.cfg = cfg
        #: the workers' mean training seconds of this call's epochs (``max_seconds``)
        self.trained = 0.0

    def step_limit(self, step: int) -> bool:
        """After an optimizer step: ``max_steps`` reached."""
        return self.cfg.max_steps is not None and step >= self.cfg.max_steps

    def before_epoch(self, step: int) -> str | None:
        return "max_steps" if self.step_limit(step) else None

    def after_epoch(self, epoch: int, history: list[dict[str, Any]], max_steps_anywhere: bool,
                    seconds: float) -> str | None:
        """After epoch ``epoch`` (0-based) and its checkpoint. ``max_steps_anywhere``: some worker
        has taken ``max_steps`` steps (workers that claim batches may get there an epoch apart);
        ``seconds``: the workers' mean training seconds of the epoch (the same on every worker)."""
        if max_steps_anywhere:
            return "max_steps"
        self.trained += seconds
        if time_is_up(self.trained, seconds, self.cfg.max_seconds) and epoch + 1 < self.cfg.epochs:
            return "max_seconds"
        if self.cfg.early_stop is not None:
            best = best_epoch(history, self.cfg)
            if best is not None and len(history) - 1 - best >= self.cfg.early_stop:
                return "early_stop"
        return None

    def explain(self, reason: str, history: list[dict[str, Any]]) -> str | None:
        """The line a stop prints (None: it prints none)."""
        if reason == "early_stop":
            return (f"early stop: {monitor(self.cfg, history[-1])} has not improved for "
                    f"{self.cfg.early_stop} epochs")
        return None


def time_is_up(trained: float, last: float, limit: float | None) -> bool:
    """After an epoch that took ``last`` seconds and brought the training time to ``trained``: is
    this epoch's end nearer ``limit`` than the next one's would be (at the same pace)?"""
    return limit is not None and trained + last / 2 >= limit


def monitor(cfg: FitConfig, row: dict[str, Any]) -> str:
    """The figure early stopping and ``best.pt`` watch: ``monitor``, else the test loss when
    there is one, else the training loss."""
    if cfg.monitor:
        return cfg.monitor
    return "test_loss" if row.get("test_loss", math.nan) == row.get("test_loss", math.nan) else "train_loss"


def _better(name: str, value: float, best: float) -> bool:
    return value > best if "accuracy" in name else value < best


def best_epoch(history: list[dict[str, Any]], cfg: FitConfig) -> int | None:
    """Index of the best row by the monitored figure (the earliest among equals)."""
    if not history:
        return None
    name = monitor(cfg, history[-1])
    if name not in history[-1]:
        raise UsageError(f"Expected monitor among the epoch's figures {sorted(history[-1])}. Received: {name!r}")
    best = None
    for i, row in enumerate(history):
        value = row.get(name, math.nan)
        if value == value and (best is None or _better(name, value, history[best][name])):
            best = i
    return best

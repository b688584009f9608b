"""The NaN policy and gradient clipping: what runs between the gradient exchange and the update.

``on_nan="stop"`` stops the run at the first non-finite loss (before any checkpoint is
written), ``"skip"`` drops such steps on every worker alike, ``"off"`` trusts the numbers.
`UpdateGuard` is asked once per optimizer step by the strategy (``before_update``); the
fused epoch, which has no host step, asks `check_fused` every few steps instead.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

from ..batch import tensors_of
from ..errors import RunFailed
from ..strategies.base import Strategy
from .config import FitConfig
from .task import Task


class NonFiniteError(RunFailed):
    """A non-finite loss or gradient stopped the run (``on_nan="stop"``): a `RunFailed` (a
    RuntimeError), so that a command ends on its one line and status 1 wherever it ran."""


class UpdateGuard:
    """Runs between the gradient exchange and the optimizer step: clipping and the finiteness check.

    Its ``loss`` wraps the task's loss to see each micro-batch's output and losses. One host
    synchronisation per optimizer step. ``stop`` checks the window's loss (a non-finite input,
    parameter or output makes it non-finite); the worker that sees it stops and the job with
    it. ``skip`` checks the exchanged gradient's norm too: under all-reduce a non-finite
    gradient on one worker is non-finite on all of them after averaging, so every worker
    drops the same step.
    """

    def __init__(self, strategy: Strategy, model: nn.Module, optimizer: Optimizer, task: Task,
                 cfg: FitConfig, epoch: int) -> None:
        self.strategy, self.model, self.optimizer, self.task = strategy, model, optimizer, task
        self.cfg, self.epoch = cfg, epoch
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.active = cfg.on_nan != "off" or cfg.clip_grad is not None
        self.skipped = 0
        self.step = 0
        self.window_loss: torch.Tensor | None = None
        self.batch: tuple[Any, Any] = (None, None)
        self.output: tuple[Any, torch.Tensor] | None = None

    def loss(self, output: Any, target: Any) -> torch.Tensor:
        per_sample = self.task.loss(output, target)
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
        lr = self.optimizer.param_groups[0].get("lr")
        inputs, target = self.batch
        net = self.strategy.unwrap(self.model)
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


def check_fused(loss_sum: torch.Tensor, optimizer: Optimizer, epoch: int, since: int, step: int) -> None:
    """The fused epoch's check: its loss sum on the device is non-finite once any step's was."""
    if not bool(torch.isfinite(loss_sum)):
        lr = optimizer.param_groups[0].get("lr")
        raise NonFiniteError(f"Non-finite loss in epoch {epoch + 1} between optimizer steps {since + 1} and "
                             f"{step} (lr {lr}); stopped before writing a checkpoint (on_nan='skip' drops such "
                             "steps; it trains without the fused step)")

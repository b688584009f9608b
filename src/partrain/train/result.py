"""What `fit` returns."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..errors import UsageError


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
    #: ``time.time()`` when worker 0 finished the run's first optimizer step (None: no step)
    first_step_at: float | None = None

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

    @property
    def memory(self) -> list[dict[str, float]]:
        """Each process's memory in the last epoch, in bytes by kind (`partrain.memory`: ``params``,
        ``grads``, ``optimizer``, ``activations``, ``peak``; ``cuda_peak`` on a GPU), in rank order."""
        return list(self.final.get("memory_ranks", []))

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

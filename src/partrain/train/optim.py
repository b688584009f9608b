"""Optimizers by name, as picklable factories for worker processes."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch.optim import Optimizer

from ..errors import UsageError

OPTIMIZERS = ("sgd", "adam", "adamw")


def make_optimizer(name: str, params: Iterable[torch.nn.Parameter], lr: float = 0.05, momentum: float = 0.9,
                   weight_decay: float = 0.0) -> Optimizer:
    """``sgd`` (with ``momentum``), ``adam`` or ``adamw``: use with ``functools.partial``."""
    if not (lr > 0 and math.isfinite(lr)):
        raise UsageError(f"Expected a positive, finite learning rate. Received: lr={lr}")
    if not (math.isfinite(momentum) and math.isfinite(weight_decay)) or momentum < 0 or weight_decay < 0:
        raise UsageError(f"Expected finite, non-negative momentum and weight decay. Received: momentum={momentum}, "
                         f"weight_decay={weight_decay}")
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=momentum, weight_decay=weight_decay)
    if name == "adam":
        return torch.optim.Adam(params, lr=lr, weight_decay=weight_decay)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    raise UsageError(f"Expected an optimizer among {list(OPTIMIZERS)}. Received: {name!r}")

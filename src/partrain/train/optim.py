"""Optimizers by name, as picklable factories for worker processes."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch.optim import Optimizer

from ..errors import UsageError

OPTIMIZERS = ("sgd", "adam", "adamw")


def make_optimizer(name: str, params: Iterable[torch.nn.Parameter], lr: float = 0.05, momentum: float = 0.9,
                   weight_decay: float = 0.0) -> Optimizer:
    """``sgd`` (with ``momentum``), ``adam`` or ``adamw``: use with ``functools.partial``."""
    if lr <= 0:
        raise UsageError(f"Expected a positive learning rate. Received: lr={lr}")
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=momentum, weight_decay=weight_decay)
    if name == "adam":
        return torch.optim.Adam(params, lr=lr, weight_decay=weight_decay)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    raise UsageError(f"Expected an optimizer among {list(OPTIMIZERS)}. Received: {name!r}")

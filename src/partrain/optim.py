"""Optimizers by name, as picklable factories for worker processes."""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable
from typing import Any

import torch
from torch.optim import Optimizer

from .errors import UsageError

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


def keep_run_settings(optimizer: Optimizer, asked: list[dict[str, Any]], skip: Collection[str] = ()) -> list[str]:
    """After ``optimizer.load_state_dict(checkpoint)``: put back this run's numeric settings.

    ``load_state_dict`` takes the checkpoint's hyperparameters with its state, so a resume
    with ``--lr 0.001`` went on at the checkpoint's 0.05 without a word. ``asked`` is the
    optimizer's ``param_groups`` as this run made them (copied before loading); every
    number or tuple of numbers in it that the checkpoint changed is put back, except the
    keys in ``skip`` (an lr a schedule sets). Returns ``"key value (the checkpoint's old)"``
    for each one put back, for the line that says so.
    """
    several = len(asked) > 1
    changed = []
    for g, (group, mine) in enumerate(zip(optimizer.param_groups, asked, strict=True)):
        for key, value in mine.items():
            if key in ("params", "initial_lr") or key in skip or not _numeric(value):
                continue
            old = group.get(key)
            if _numeric(old) and setting_text(old) != setting_text(value):
                group[key] = value
                changed.append(setting_change(key, value, old, g if several else None))
    return changed


def setting_change(key: str, value: Any, old: Any, group: int | None = None) -> str:
    """``"lr 0.01 (the checkpoint's 0.05)"``: one setting a resume put back, for its line."""
    where = "" if group is None else f" (group {group})"
    return f"{key}{where} {setting_text(value)} (the checkpoint's {setting_text(old)})"


def _numeric(value: Any) -> bool:
    """A number (not a bool) or a tuple or list of numbers: a setting compared across a resume."""
    if isinstance(value, (tuple, list)):
        return bool(value) and all(_numeric(v) for v in value)
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def setting_text(value: Any) -> str:
    """A numeric setting as shown, and compared (a tuple comes back from a checkpoint as a list)."""
    if isinstance(value, (tuple, list)):
        return "(" + ", ".join(f"{float(v):g}" for v in value) + ")"
    return f"{float(value):g}"

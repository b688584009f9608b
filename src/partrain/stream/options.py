"""The small pieces an `OnlineTrainer` is configured with: loss, schedule, batching window, overflow.

Each is a plain function or a tiny class with one job, so a test (or the CLI)
can check it without a trainer, and each turns bad input into one line:
``Expected ... Received: ...``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from ..batching import Policy
from ..errors import UsageError
from ..train.task import NAMED_LOSSES

# --------------------------------------------------------------------------- loss

#: built-in losses by name: per-element functions, reduced per row by `weighted_loss`. They are
#: `fit`'s (`partrain.train.task.NAMED_LOSSES`): labels shaped like the output (an output of
#: [rows, 1] against scalar labels is reshaped); torch would broadcast a label of another size ([1]
#: against an output of [2]) into a loss of another meaning, with a warning, where these say so in
#: one line (the update fails, the items keep their predictions)
LOSSES: dict[str, Callable[[Tensor, Tensor], Tensor]] = {
    name: NAMED_LOSSES[name] for name in ("mse", "l1", "huber", "cross_entropy")} | {
    "bce_logits": NAMED_LOSSES["bce"]}


def resolve_loss(loss_fn: str | Callable[[Any, Tensor], Tensor]) -> Callable[[Any, Tensor], Tensor]:
    """A loss name among `LOSSES`, or a callable ``loss_fn(output, target)``.

    A callable may return one loss per row (shape ``[rows]`` or ``[rows, ...]``,
    e.g. a torch loss with ``reduction="none"``) or a scalar; only per-row losses
    can honour per-item weights (see `weighted_loss`).
    """
    if isinstance(loss_fn, str):
        try:
            return LOSSES[loss_fn.strip().lower().replace("-", "_")]
        except KeyError:
            raise UsageError(f"Expected a loss among {sorted(LOSSES)} or a callable. "
                             f"Received: {loss_fn!r}") from None
    if not callable(loss_fn):
        raise UsageError(f"Expected loss_fn to be a loss name or a callable(output, target). "
                         f"Received: {type(loss_fn).__name__}")
    return loss_fn


def weighted_loss(loss_fn: Callable[[Any, Tensor], Tensor], output: Any, target: Tensor,
                  weights: Tensor | None) -> Tensor:
    """``sum(w_i * loss_i) / sum(w_i)`` over the rows; the plain mean when every weight is 1.

    A per-row loss (dim 0 = rows) is first averaged over its other dims. A scalar
    loss is taken as is, and is refused when the weights differ (it cannot be
    weighted per item). ``weights=None`` means every weight is 1: the mean over
    all of the loss's elements, one op instead of five (every row has as many).
    """
    loss = loss_fn(output, target)
    rows = target.shape[0]
    if loss.dim() > 0 and loss.shape[0] != rows:
        raise UsageError(f"Expected loss_fn to return a scalar or one loss per row ({rows} rows). "
                         f"Received: shape {tuple(loss.shape)}")
    if weights is None:
        return loss if loss.dim() == 0 else loss.mean()
    if loss.dim() == 0:
        if not bool(torch.all(weights == weights[0])):
            raise UsageError("Expected loss_fn to return one loss per row (reduction='none') to weight items. "
                             "Received: a scalar loss")
        return loss
    per_row = loss.reshape(rows, -1).mean(1)
    w = weights.to(per_row.dtype)
    return (w * per_row).sum() / w.sum()


# --------------------------------------------------------------------------- schedule

SCHEDULES = ("constant", "warmup:ITEMS", "invsqrt:ITEMS", "step:ITEMS[:GAMMA]")


def parse_lr_schedule(spec: str | Callable[[int], float] | None) -> Callable[[int], float]:
    """The learning-rate multiplier as a function of labelled items trained on so far.

    - ``constant`` (default): 1;
    - ``warmup:N``: rises linearly from ``1/N`` to 1 over the first N items;
    - ``invsqrt:N``: 1 up to N items, then ``sqrt(N / items)`` (a stream has no end to decay to);
    - ``step:N[:GAMMA]``: times GAMMA (default 0.5) every N items.

    A stream has no epochs and no known length, so the clock is items, which the
    checkpoint records: a resumed trainer continues the same schedule exactly.
    """
    if spec is None:
        return _constant
    if callable(spec):
        return spec
    text = str(spec).strip().lower()
    if text in ("constant", "none"):
        return _constant
    head, _, rest = text.partition(":")
    number, _, gamma_text = rest.partition(":")
    try:
        n = int(number)
        gamma = float(gamma_text) if gamma_text else 0.5
    except ValueError:
        n, gamma = 0, 0.0
    if n >= 1 and head == "warmup" and not gamma_text:
        return lambda items: min(1.0, (items + 1) / n)
    if n >= 1 and head == "invsqrt" and not gamma_text:
        return lambda items: 1.0 if items <= n else math.sqrt(n / items)
    if n >= 1 and head == "step" and 0 < gamma <= 1:
        return lambda items: gamma ** (items // n)
    raise UsageError(f"Expected an lr schedule among {list(SCHEDULES)}. Received: {spec!r}")


def _constant(items: int) -> float:
    return 1.0


# --------------------------------------------------------------------------- batching window


class MinBatchPolicy(Policy):
    """Take what is queued once ``min_batch`` rows wait, or once the oldest waited ``max_wait`` s.

    With the defaults (1 row, no wait) this is dequeue-all: the model is never
    idle while an item waits, and everything that arrived during a step is the
    next batch (up to ``max_batch``). A larger ``min_batch`` trades latency for
    bigger steps; ``max_wait`` bounds what that costs the oldest item.
    """

    name = "min_batch"

    def __init__(self, min_batch: int = 1, max_wait: float = 0.0):
        if isinstance(min_batch, bool) or not isinstance(min_batch, int) or min_batch < 1:
            raise UsageError(f"Expected min_batch >= 1. Received: min_batch={min_batch!r}")
        if not (isinstance(max_wait, (int, float)) and math.isfinite(max_wait) and max_wait >= 0):
            raise UsageError(f"Expected max_wait >= 0 seconds. Received: max_wait={max_wait!r}")
        if min_batch > 1 and max_wait <= 0:
            raise UsageError("Expected max_wait > 0 seconds with min_batch > 1 (how long an item may wait for "
                             f"the batch to fill). Received: min_batch={min_batch}, max_wait={max_wait}")
        self.min_batch = min_batch
        self.max_wait = float(max_wait)

    def wait_time(self, *, queued_requests: int, queued_rows: int, oldest_age: float,
                  since_last_arrival: float, max_batch_size: int) -> float:
        if queued_rows >= min(self.min_batch, max_batch_size):
            return 0.0
        return max(0.0, self.max_wait - oldest_age)

    def __repr__(self) -> str:
        return f"MinBatchPolicy(min_batch={self.min_batch}, max_wait={self.max_wait})"


# --------------------------------------------------------------------------- overflow

OVERFLOW = ("block", "drop_oldest", "reject")


def check_overflow(policy: str) -> str:
    """What `submit` does when ``max_queue`` items wait (see `OnlineTrainer`)."""
    text = str(policy).strip().lower().replace("-", "_")
    if text not in OVERFLOW:
        raise UsageError(f"Expected an overflow policy among {list(OVERFLOW)}. Received: {policy!r}")
    return text

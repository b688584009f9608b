"""Built-in learning-rate schedules, as a pure function of the optimizer step.

``lr_schedule`` is one of ``constant`` (the default), ``cosine`` (from the given rate to 0
over the run), ``linear`` (to 0 over the run) or ``step:EPOCHS[:GAMMA]`` (times ``GAMMA``,
default 0.1, every ``EPOCHS`` epochs); ``warmup_steps`` ramps the rate linearly from 0 over
the first steps. The rate depends only on the step count, which checkpoints record, so a
resumed run follows the same schedule exactly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..errors import UsageError

NAMES = ("constant", "cosine", "linear", "step:EPOCHS[:GAMMA]")


@dataclass(frozen=True)
class Schedule:
    kind: str = "constant"
    every_epochs: int = 0
    gamma: float = 0.1
    warmup_steps: int = 0

    def factor(self, step: int, total_steps: int, steps_per_epoch: int) -> float:
        """The multiplier of the base rate for optimizer step ``step`` (0-based)."""
        warm = min(1.0, (step + 1) / self.warmup_steps) if self.warmup_steps > 0 else 1.0
        total = max(total_steps, 1)
        progress = min(step / total, 1.0)
        if self.kind == "cosine":
            value = 0.5 * (1.0 + math.cos(math.pi * progress))
        elif self.kind == "linear":
            value = 1.0 - progress
        elif self.kind == "step":
            value = self.gamma ** (step // max(self.every_epochs * steps_per_epoch, 1))
        else:
            value = 1.0
        return warm * value


def parse_schedule(spec: str | None, warmup_steps: int = 0) -> Schedule:
    """``"cosine"``, ``"step:3:0.5"``, ... as a `Schedule` (one line when malformed)."""
    if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 0:
        raise UsageError(f"Expected warmup_steps to be a non-negative integer. Received: {warmup_steps!r}")
    text = (spec or "constant").strip().lower()
    if text in ("constant", "none", "cosine", "linear"):
        return Schedule("constant" if text == "none" else text, warmup_steps=warmup_steps)
    head, _, rest = text.partition(":")
    if head == "step" and rest:
        every, _, gamma = rest.partition(":")
        try:
            schedule = Schedule("step", int(every), float(gamma) if gamma else 0.1, warmup_steps)
        except ValueError:
            schedule = None
        if schedule is not None and schedule.every_epochs >= 1 and 0 < schedule.gamma <= 1:
            return schedule
    raise UsageError(f"Expected an lr schedule among {list(NAMES)} (e.g. step:3:0.5). Received: {spec!r}")

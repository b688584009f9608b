"""``single``: one process, no communication. The reference every other strategy is checked against."""

from __future__ import annotations

from typing import Any

from ..env import DEFAULT_TIMEOUT, DistEnv
from ..errors import UsageError
from .base import Strategy, register


@register
class Single(Strategy):
    name = "single"
    max_workers = 1
    checkpoints_within_epoch = True
    fuses_steps = True

    def setup(self, env: DistEnv, *, store: Any = None, timeout: float = DEFAULT_TIMEOUT) -> None:
        if env.world_size != 1:
            raise UsageError(f"Expected one process for strategy 'single'. Received: world_size={env.world_size}")
        super().setup(env, store=store, timeout=timeout)

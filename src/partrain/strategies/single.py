"""``single``: one process, no communication. The reference every other strategy is checked against."""

from __future__ import annotations

from ..env import DistEnv
from ..errors import UsageError
from .base import Strategy, register


@register
class Single(Strategy):
    name = "single"

    def setup(self, env: DistEnv) -> None:
        if env.world_size != 1:
            raise UsageError(f"Expected one process for strategy 'single'. Received: world_size={env.world_size}")
        super().setup(env)

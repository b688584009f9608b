"""A replay buffer of recent labelled items, mixed into each online step against forgetting.

A model trained only on the latest items drifts with the stream and forgets
what it saw an hour ago. Mixing a few items of recent history into each step
keeps it anchored. The buffer holds the last ``capacity`` labelled items (a
ring: the oldest goes first) and draws uniformly, with replacement, from a
seeded `torch.Generator`, whose state the checkpoint keeps with the items: a
resumed trainer draws exactly what the uninterrupted one would have. A draw
takes at most as many items as the buffer holds: early in a stream, asking for
16 from a buffer of 2 must not weigh those 2 items eight times each.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor


@dataclass
class Remembered:
    """One labelled item kept for replay: its inputs (with a batch dim of 1), label, weight."""

    inputs: tuple[Tensor, ...]
    target: Tensor
    weight: float


class ReplayBuffer:
    """The last ``capacity`` labelled items; `sample` draws ``k`` of them with a seeded generator."""

    def __init__(self, capacity: int, seed: int = 0):
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"Expected a replay capacity >= 1. Received: {capacity!r}")
        self.capacity = capacity
        self.items: list[Remembered] = []
        self._next = 0  # where the next item goes once the ring is full
        self.generator = torch.Generator().manual_seed(seed)

    def __len__(self) -> int:
        return len(self.items)

    def add(self, item: Remembered) -> None:
        if len(self.items) < self.capacity:
            self.items.append(item)
        else:
            self.items[self._next] = item
        self._next = (self._next + 1) % self.capacity

    def sample(self, k: int) -> list[Remembered]:
        """``min(k, len(self))`` items drawn uniformly with replacement (none while the buffer is empty)."""
        k = min(k, len(self.items))
        if k < 1:
            return []
        picks = torch.randint(len(self.items), (k,), generator=self.generator)
        return [self.items[i] for i in picks.tolist()]

    def state_dict(self) -> dict[str, Any]:
        """Tensors, numbers and lists only: a checkpoint read with ``weights_only=True`` holds it."""
        return {
            "capacity": self.capacity,
            "next": self._next,
            "inputs": [list(r.inputs) for r in self.items],
            "targets": [r.target for r in self.items],
            "weights": [r.weight for r in self.items],
            "generator": self.generator.get_state(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.capacity = int(state["capacity"])
        self._next = int(state["next"])
        self.items = [Remembered(tuple(inputs), target, float(weight))
                      for inputs, target, weight in zip(state["inputs"], state["targets"], state["weights"])]
        self.generator.set_state(state["generator"])

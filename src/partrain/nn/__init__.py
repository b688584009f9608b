"""Layers and parameter tools for parallel training.

- `SyncBatchNorm` / `convert_sync_batchnorm`: batch statistics over the global
  batch of all ranks, on every backend (gloo on CPU included).
- `freeze` / `unfreeze` (with `idx` for index expressions): chosen elements of
  a parameter keep their exact values through the steps of an optimizer that
  `keep_frozen` was attached to (every strategy attaches it);
  `freeze_state_dict` and `load_freeze_state_dict` carry the masks through
  checkpoints; `hold_frozen` keeps them through other changes (averaging).
- `place`: an ``nn.Sequential``'s layers spread over devices of one process
  (``cuda:0``, ``cuda:1``), activations moved between them.
"""

from .freeze import (
    FrozenGuard,
    freeze,
    freeze_state_dict,
    frozen_mask,
    hold_frozen,
    idx,
    keep_frozen,
    load_freeze_state_dict,
    unfreeze,
)
from .placement import PlacedSequential, place
from .sync_batchnorm import SyncBatchNorm, convert_sync_batchnorm

__all__ = [
    "FrozenGuard",
    "PlacedSequential",
    "SyncBatchNorm",
    "convert_sync_batchnorm",
    "freeze",
    "freeze_state_dict",
    "frozen_mask",
    "hold_frozen",
    "idx",
    "keep_frozen",
    "load_freeze_state_dict",
    "place",
    "unfreeze",
]

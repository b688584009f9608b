"""Layers and parameter tools for parallel training.

- `SyncBatchNorm` / `convert_sync_batchnorm`: batch statistics over the global
  batch of all ranks, on every backend (gloo on CPU included).
- `freeze` / `unfreeze` (with `idx` for index expressions): chosen elements of
  a parameter keep their exact values under any optimizer; `freeze_state_dict`
  and `load_freeze_state_dict` carry the masks through checkpoints.
"""

from .freeze import freeze, freeze_state_dict, frozen_mask, idx, load_freeze_state_dict, unfreeze
from .sync_batchnorm import SyncBatchNorm, convert_sync_batchnorm

__all__ = [
    "SyncBatchNorm",
    "convert_sync_batchnorm",
    "freeze",
    "freeze_state_dict",
    "frozen_mask",
    "idx",
    "load_freeze_state_dict",
    "unfreeze",
]

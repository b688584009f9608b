"""Data: datasets by name, per-worker sharding, batch iteration."""

from .datasets import DataSpec, load_dataset, load_digits, load_npz, synthetic
from .sharding import ShardedBatchSampler

__all__ = ["DataSpec", "ShardedBatchSampler", "load_dataset", "load_digits", "load_npz", "synthetic"]

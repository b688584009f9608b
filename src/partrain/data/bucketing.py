"""Length-bucketed batches: samples of similar length together, so padding stays small.

`BucketBatchSampler` is a `ShardedBatchSampler` whose epoch order groups lengths: the
seeded permutation of the epoch is cut into *pools* of ``pool`` global batches, each
pool is sorted by length, cut into global batches, and the full global batches of the
whole epoch are shuffled (the one incomplete global batch, if any, stays last). Every
worker then takes its contiguous part of each global batch exactly as with the plain
sampler, so everything that holds there holds here: every sample once per epoch,
workers in step, ``global_batch_size`` exact, the same order for a given seed.

A pool bounds the padding: a batch's lengths come from one sorted pool, so they are
neighbours in a sorted run of ``pool * global_batch`` samples. Randomness is kept
where it costs no padding: which samples share a pool, and the order of the batches.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.utils.data import Dataset, Subset

from ..errors import UsageError
from .sharding import ShardedBatchSampler


class BucketBatchSampler(ShardedBatchSampler):
    def __init__(self, lengths: Sequence[int] | torch.Tensor, batch_size: int, rank: int = 0,
                 num_replicas: int = 1, *, seed: int = 0, shuffle: bool = True, drop_last: bool = False,
                 pool: int = 50, samples_per_epoch: int | None = None) -> None:
        lengths = torch.as_tensor(lengths, dtype=torch.int64)
        if lengths.dim() != 1:
            raise UsageError(f"Expected one length per sample (a 1-d sequence). Received: shape {tuple(lengths.shape)}")
        if pool < 1:
            raise UsageError(f"Expected a positive pool of global batches to sort in. Received: pool={pool}")
        super().__init__(samples_per_epoch or len(lengths), batch_size, rank, num_replicas, shuffle=shuffle, seed=seed,
                         drop_last=drop_last, dataset_size=len(lengths))
        self.lengths, self.pool = lengths, pool

    def order(self) -> torch.Tensor:
        """This epoch's order: pools sorted by length, full global batches shuffled, the rest last."""
        base = super().order()
        size = self.pool * self.global_batch
        sorted_pools = []
        for start in range(0, self.num_samples, size):
            chunk = base[start:start + size]
            sorted_pools.append(chunk[torch.sort(self.lengths[chunk], stable=True).indices])
        grouped = torch.cat(sorted_pools)
        full = self.num_samples // self.global_batch
        batches = grouped[:full * self.global_batch].view(full, self.global_batch)
        if self.shuffle and full > 1:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch + 7_777_777)
            batches = batches[torch.randperm(full, generator=g)]
        return torch.cat([batches.reshape(-1), grouped[full * self.global_batch:]])


def lengths_of(ds: Dataset) -> torch.Tensor | None:
    """Per-sample lengths of a dataset that states them (a ``lengths`` attribute, as
    `partrain.data.Sequences` has; through a ``Subset``), else None."""
    if isinstance(ds, Subset):
        parent = lengths_of(ds.dataset)
        return None if parent is None else parent[torch.as_tensor(list(ds.indices), dtype=torch.int64)]
    lengths: Any = getattr(ds, "lengths", None)
    if lengths is None:
        return None
    lengths = torch.as_tensor(lengths, dtype=torch.int64)
    if lengths.shape != (len(ds),):  # type: ignore[arg-type]
        raise UsageError(f"Expected {type(ds).__name__}.lengths to hold one length per sample ({len(ds)}). "  # type: ignore[arg-type]
                         f"Received: shape {tuple(lengths.shape)}")
    return lengths


__all__ = ["BucketBatchSampler", "lengths_of"]

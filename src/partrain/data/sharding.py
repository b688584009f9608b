"""Which samples each worker sees: every sample exactly once per epoch across workers.

`ShardedBatchSampler` yields this worker's batches. The shuffled order of an
epoch (seeded by ``seed`` and the epoch) is cut into *global batches* of
``batch_size * num_replicas`` samples, and each global batch into
``num_replicas`` contiguous parts, one per worker. So:

- concatenating the workers' batches of step ``i`` gives global batch ``i``
  (what a single process training on the global batch would see);
- every worker takes the same number of steps (no worker waits forever in a
  collective), and no sample is repeated or dropped to make shards even
  (unlike `DistributedSampler`, which pads by repeating samples); the last
  global batch may be split unevenly, even leaving a worker with zero samples.
  `global_batch_size(step)` tells the loop the global size so the loss can be
  normalised exactly;
- ``drop_last=True`` drops the final incomplete global batch instead.

`ClaimingBatchSampler` is the variant for asynchronous strategies: workers
*claim* per-worker batches of the epoch's order from a counter the whole job
shares (the process group's store), so a worker twice as fast trains on twice
as many batches and nobody idles at the epoch's end waiting for a straggler.
Every sample is still seen exactly once per epoch; the number of steps now
differs between workers.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import Sampler

from ..errors import UsageError


class ShardedBatchSampler(Sampler[list[int]]):
    #: False: fixed, equal shares known ahead; True: batches claimed at run time (`ClaimingBatchSampler`)
    claims_batches = False

    def __init__(self, num_samples: int, batch_size: int, rank: int = 0, num_replicas: int = 1,
                 *, shuffle: bool = True, seed: int = 0, drop_last: bool = False) -> None:
        if batch_size < 1:
            raise UsageError(f"Expected a positive batch size. Received: batch_size={batch_size}")
        if num_replicas < 1 or not 0 <= rank < num_replicas:
            raise UsageError(f"Expected 0 <= rank < num_replicas. Received: rank={rank}, num_replicas={num_replicas}")
        if num_samples < 1:
            raise UsageError(f"Expected a non-empty dataset. Received: {num_samples} samples")
        self.num_samples = num_samples
        self.batch_size = batch_size
        self.rank = rank
        self.num_replicas = num_replicas
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.epoch = 0

    @property
    def global_batch(self) -> int:
        return self.batch_size * self.num_replicas

    def set_epoch(self, epoch: int) -> None:
        """Reshuffle for ``epoch`` (same order on every worker, different per epoch)."""
        self.epoch = epoch

    def order(self) -> torch.Tensor:
        """This epoch's order of all sample indices (identical on every worker)."""
        if not self.shuffle:
            return torch.arange(self.num_samples)
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        return torch.randperm(self.num_samples, generator=g)

    def __len__(self) -> int:
        full, rest = divmod(self.num_samples, self.global_batch)
        return full if self.drop_last or rest == 0 else full + 1

    def global_batch_size(self, step: int) -> int:
        """How many samples all workers together hold at ``step`` of an epoch."""
        start = step * self.global_batch
        return max(0, min(self.global_batch, self.num_samples - start))

    def __iter__(self) -> Iterator[list[int]]:
        for index in self.iter_tensors():
            yield index.tolist()

    def iter_tensors(self) -> Iterator[torch.Tensor]:
        """The same batches as index tensors (no round trip through Python lists)."""
        order = self.order()
        for start, stop in self.spans():
            yield order[start:stop]

    def spans(self) -> Iterator[tuple[int, int]]:
        """Each batch of this worker as positions ``[start, stop)`` in `order` (the part
        ``torch.tensor_split`` gives this rank of each global batch): a device-resident
        epoch slices its copy of the order with them, no index crossing to the device."""
        for step in range(len(self)):
            first = step * self.global_batch
            size = min(self.global_batch, self.num_samples - first)
            q, r = divmod(size, self.num_replicas)
            start = first + self.rank * q + min(self.rank, r)
            yield start, start + q + (1 if self.rank < r else 0)


class ClaimingBatchSampler(ShardedBatchSampler):
    """Per-worker batches claimed from a shared counter: faster workers take more.

    ``store`` is any c10d store (``add`` is atomic across the job); ``key`` must be
    the same on every worker and new for every sampler of the job.
    """

    claims_batches = True

    def __init__(self, num_samples: int, batch_size: int, rank: int, num_replicas: int, *, store: Any,
                 key: str, shuffle: bool = True, seed: int = 0, drop_last: bool = False) -> None:
        super().__init__(num_samples, batch_size, rank, num_replicas, shuffle=shuffle, seed=seed,
                         drop_last=drop_last)
        self.store = store
        self.key = key

    @property
    def units(self) -> int:
        """Per-worker batches in an epoch (what the workers claim)."""
        full, rest = divmod(self.num_samples, self.batch_size)
        return full if self.drop_last or rest == 0 else full + 1

    def __len__(self) -> int:
        """An estimate (an even split): the real count depends on the workers' speeds."""
        return -(-self.units // self.num_replicas)

    def global_batch_size(self, step: int) -> int:
        """Nominal: workers' batches of a step are not aligned when they are claimed."""
        return self.batch_size * self.num_replicas

    def iter_tensors(self) -> Iterator[torch.Tensor]:
        order = self.order()
        counter = f"{self.key}/epoch{self.epoch}"
        while True:
            unit = int(self.store.add(counter, 1)) - 1
            if unit >= self.units:
                return
            yield order[unit * self.batch_size : (unit + 1) * self.batch_size]

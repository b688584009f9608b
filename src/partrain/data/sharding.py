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

An epoch may be shorter than the dataset (``dataset_size``, `FitConfig.samples_per_epoch`):
epoch ``e`` is then positions ``[e N, (e + 1) N)`` of the passes over the dataset laid end to
end, each pass a seeded permutation of every index, so the epochs walk through the whole
training set (Keras's ``steps_per_epoch`` on a repeated dataset), and no sample repeats before
a pass ends. With ``N`` equal to the dataset, epoch ``e`` is pass ``e``: the plain epochs.

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
                 *, shuffle: bool = True, seed: int = 0, drop_last: bool = False,
                 dataset_size: int | None = None) -> None:
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
        if dataset_size is not None and dataset_size < 1:
            raise UsageError(f"Expected a non-empty dataset. Received: {dataset_size} samples")
        #: the indices an epoch draws from; ``num_samples`` is an epoch's share of their passes
        self.dataset_size = num_samples if dataset_size is None else dataset_size
        self.epoch = 0

    @property
    def global_batch(self) -> int:
        return self.batch_size * self.num_replicas

    def set_epoch(self, epoch: int) -> None:
        """Reshuffle for ``epoch`` (same order on every worker, different per epoch)."""
        self.epoch = epoch

    def order(self) -> torch.Tensor:
        """This epoch's sample indices in order (identical on every worker): the epoch's
        ``num_samples`` positions of the passes over the dataset (see the module docstring)."""
        n, size = self.num_samples, self.dataset_size
        if n == size:
            return self._pass(self.epoch)
        parts, taken = [], 0
        while taken < n:
            which, offset = divmod(self.epoch * n + taken, size)
            part = self._pass(which)[offset:offset + n - taken]
            parts.append(part)
            taken += len(part)
        return torch.cat(parts)

    def _pass(self, which: int) -> torch.Tensor:
        """Pass ``which`` over the dataset: every index once, shuffled by the seed and the pass."""
        if not self.shuffle:
            return torch.arange(self.dataset_size)
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + which)
        return torch.randperm(self.dataset_size, generator=g)

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
                 key: str, shuffle: bool = True, seed: int = 0, drop_last: bool = False,
                 dataset_size: int | None = None) -> None:
        super().__init__(num_samples, batch_size, rank, num_replicas, shuffle=shuffle, seed=seed,
                         drop_last=drop_last, dataset_size=dataset_size)
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

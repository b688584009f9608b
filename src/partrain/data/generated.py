"""Batches from the user's own generator (Keras' ``fit_generator`` case), loaded ahead.

``Generated(fn, steps)`` wraps ``fn(epoch, rank, workers) -> iterable of batches``: each
training worker calls it once per epoch with its own rank and takes exactly ``steps``
batches from it (a generator that ends early is an error naming the worker and the epoch,
never a worker left waiting in a collective). ``fn`` decides which samples each worker
reads, as it knows its source (a file per worker, a range of rows); ``rank`` and
``workers`` are there to shard by. A loader thread runs the generator ahead of the
training loop, at most ``prefetch`` batches in flight.

For an exact resume (mid-epoch checkpoints) ``fn`` must give the same batches for the
same ``(epoch, rank, workers)``; the batches trained on before the checkpoint are drawn
again and dropped. The loss of a step is normalised by ``workers`` times this worker's
batch size, which is exact when every worker's batches have equal sizes.
"""

from __future__ import annotations

import queue
import threading
import traceback
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch.utils.data import Dataset

from .._tree import map_tensors
from ..errors import UsageError
from .pipeline import LoaderError

_END = object()


class Generated(Dataset):
    """``steps`` batches per worker and epoch from ``fn(epoch, rank, workers)``."""

    def __init__(self, fn: Callable[[int, int, int], Iterable[Any]], steps: int) -> None:
        if not callable(fn):
            raise UsageError(f"Expected fn(epoch, rank, workers) returning batches. Received: {type(fn).__name__}")
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise UsageError(f"Expected a positive number of batches per epoch. Received: steps={steps!r}")
        self.fn, self.steps = fn, steps

    def __len__(self) -> int:
        """Batches per worker and epoch (not samples)."""
        return self.steps

    def __getitem__(self, i: int) -> Any:
        raise TypeError("Generated yields whole batches; it has no samples by index")

    def first(self) -> Any:
        """The first batch worker 0 would train on (for `fit`'s checks before it starts)."""
        for batch in self.fn(0, 0, 1):
            return batch
        raise UsageError("Expected the batch generator to yield at least one batch. Received: none")


class GeneratedSampler:
    """The loop's view of a generated epoch: ``steps`` batches, sizes known as they come
    (``claims_batches``: the loss is normalised by this worker's batch times the workers)."""

    claims_batches = True

    def __init__(self, steps: int, rank: int, num_replicas: int) -> None:
        self.steps, self.rank, self.num_replicas, self.epoch = steps, rank, num_replicas, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.steps


class GeneratedBatches:
    """One epoch of a `Generated` source, run ahead by a loader thread into a bounded queue."""

    def __init__(self, ds: Generated, sampler: GeneratedSampler, device: torch.device, skip: int,
                 depth: int, timeout: float) -> None:
        self.ds, self.sampler, self.device = ds, sampler, device
        self.skip, self.depth, self.timeout = skip, max(depth, 1), timeout

    def __len__(self) -> int:
        return self.ds.steps - self.skip

    def _run(self, out: queue.Queue, stop: threading.Event) -> None:
        s = self.sampler
        try:
            it = iter(self.ds.fn(s.epoch, s.rank, s.num_replicas))
            for number in range(self.ds.steps):
                try:
                    batch = next(it)
                except StopIteration:
                    raise LoaderError(f"Expected {self.ds.steps} batches from the generator in epoch {s.epoch + 1} "
                                      f"on worker {s.rank}. Received: {number}") from None
                if number < self.skip:
                    continue  # trained on before a mid-epoch checkpoint
                if self.device.type == "cuda":
                    batch = map_tensors(batch, lambda t: t.pin_memory())
                while not stop.is_set():
                    try:
                        out.put((None, batch), timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if stop.is_set():
                    return
            out.put((None, _END))
        except BaseException as exc:  # handed to the training thread, which raises it
            out.put((exc, "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))))

    def __iter__(self) -> Iterator[Any]:
        out: queue.Queue = queue.Queue(maxsize=self.depth)
        stop = threading.Event()
        thread = threading.Thread(target=self._run, args=(out, stop), name="partrain-generator", daemon=True)
        thread.start()
        try:
            while True:
                try:
                    error, item = out.get(timeout=self.timeout)
                except queue.Empty:
                    raise LoaderError(f"Expected a batch from the generator within {self.timeout:g} s. "
                                      "Received: nothing (a stuck source?)") from None
                if error is not None:
                    if isinstance(error, LoaderError):
                        raise error
                    raise LoaderError(f"The batch generator failed: {type(error).__name__}: {error}\n"
                                      f"Loader traceback:\n{item}") from error
                if item is _END:
                    return
                yield map_tensors(item, lambda t: t.to(self.device, non_blocking=self.device.type == "cuda"))
        finally:
            stop.set()
            thread.join(timeout=self.timeout)


__all__ = ["Generated", "GeneratedBatches", "GeneratedSampler"]

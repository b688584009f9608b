"""Input pipelines: this worker's batches of an epoch, loaded while the model trains.

Vocabulary: a *sampler* says which sample indices make each batch (`ShardedBatchSampler`:
every sample once per epoch across workers, the same order for a given seed); a *loader*
turns one batch of indices into one batch of tensors; a *pipeline* (`Feeder`) runs the
loader for the batches of an epoch, ahead of the training loop, and hands them over in
the sampler's order. Four loaders, one per job:

- ``inline``: in the training thread. An in-memory ``TensorDataset`` is indexed with the
  batch's index tensor (no per-sample Python); other datasets go through a
  ``DataLoader`` without workers.
- ``threads``: a pool of loader threads, at most ``prefetch`` batches in flight. For
  I/O-bound readers (an ``h5py`` slice, a memory-mapped ``.npy``, a network read): they
  wait with the GIL released, so the read overlaps the step.
- ``processes``: ``torch.utils.data.DataLoader`` with ``workers`` processes and
  ``prefetch_factor``: for CPU-bound decoding that needs cores of its own.
- ``device``: the whole dataset copied to the device once; each batch is a slice of the
  epoch's order on the device and a gather there (`DeviceBatches`).

Whatever the loader, batches come in the sampler's order, so training is the same for a
given seed whichever loader fed it, and a mid-epoch resume skips the first batches by
their indices (nothing is loaded for them). A loader that fails stops the epoch with a
`LoaderError` carrying the loader's traceback; every wait for a batch has a timeout.
On CUDA, loaders pin host memory and copies are non-blocking, so the copy of batch i+1
overlaps the step on batch i.

``auto`` (the default) picks ``inline`` for in-memory tensors (nothing to overlap: a
gather is cheaper than a hand-over between threads) and ``threads`` for any other
dataset; after each epoch, when the training loop waited for data more than
`INPUT_BOUND` of the time, it doubles the loader threads and the prefetch depth (up to
`MAX_THREADS`) and says so on the epoch line.
"""

from __future__ import annotations

import collections
import concurrent.futures
import itertools
import traceback
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, TensorDataset, default_collate

from .._tree import map_tensors
from ..errors import UsageError

LOADERS = ("auto", "inline", "threads", "processes")
#: share of the epoch spent waiting for data above which the epoch is *input-bound*
INPUT_BOUND = 0.2
#: most loader threads ``auto`` grows to
MAX_THREADS = 16
#: seconds to wait for one batch before the loader is declared stuck
DEFAULT_TIMEOUT = 300.0


class LoaderError(RuntimeError):
    """A loader thread or process failed (its traceback is in the message), or stalled."""


@dataclass(frozen=True)
class LoaderSettings:
    """How batches are loaded: ``kind`` (`LOADERS`), ``workers`` (threads or processes; None:
    the kind's default), ``prefetch`` (batches in flight per worker), ``timeout`` (seconds
    per batch)."""

    kind: str = "auto"
    workers: int | None = None
    prefetch: int = 2
    timeout: float = DEFAULT_TIMEOUT

    def validate(self) -> None:
        if self.kind not in LOADERS:
            raise UsageError(f"Expected loader among {list(LOADERS)}. Received: {self.kind!r}")
        if self.workers is not None and (isinstance(self.workers, bool) or not isinstance(self.workers, int)
                                         or self.workers < 1):
            raise UsageError(f"Expected a positive number of loader workers or None. Received: "
                             f"loader_workers={self.workers!r}")
        if isinstance(self.prefetch, bool) or not isinstance(self.prefetch, int) or self.prefetch < 1:
            raise UsageError(f"Expected a positive prefetch depth (batches in flight per loader worker). "
                             f"Received: prefetch={self.prefetch!r}")
        if not (isinstance(self.timeout, (int, float)) and self.timeout > 0):
            raise UsageError(f"Expected a positive loader timeout in seconds. Received: {self.timeout!r}")


def collate(samples: list[Any], collate_fn: Callable[[list], Any] | None) -> Any:
    """Samples as one batch; variable-sized samples without a ``collate_fn`` are one line."""
    try:
        return (collate_fn or default_collate)(samples)
    except RuntimeError as exc:
        if collate_fn is None and ("stack expects" in str(exc) or "equal size" in str(exc)
                                   or "resize" in str(exc)):
            shapes = [_describe(s) for s in samples[:2]]
            raise UsageError("Expected samples of equal shape to stack into a batch, or fit(..., collate_fn=...) "
                             f"to batch them (partrain.data.pad_collate pads sequences). Received: {shapes[0]} "
                             f"and {shapes[-1]}") from None
        raise


def _describe(sample: Any) -> str:
    shapes = [f"tensor {tuple(t.shape)}" for t in _tensors(sample)]
    return f"{type(sample).__name__} of ({', '.join(shapes)})" if shapes else type(sample).__name__


def _tensors(obj: Any) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    map_tensors(obj, found.append)
    return found


def collate_samples(samples: list[Any], collate_fn: Callable[[list], Any] | None, ds: Dataset) -> Any:
    """Samples as one batch; a worker's empty share of the last global batch keeps the structure."""
    if samples:
        return collate(samples, collate_fn)
    return map_tensors(collate([ds[0]], collate_fn), lambda t: t[:0])


def fetch(ds: Dataset, index: list[int], collate_fn: Callable[[list], Any] | None) -> Any:
    """One batch of ``ds`` at ``index``: through ``__getitems__`` when the dataset reads whole
    batches (an HDF5 slice, a memory map), else sample by sample; then collated."""
    getitems = getattr(ds, "__getitems__", None)
    samples = getitems(index) if getitems is not None and index else [ds[i] for i in index]
    return collate_samples(list(samples), collate_fn, ds)


class Feeder:
    """One worker's pipeline for a run: which loader, and its settings as `auto` tunes them.

    ``collate`` turns a list of samples into a batch (the task's, with the one-line error
    for samples of unequal shape).
    """

    def __init__(self, ds: Dataset, device: torch.device, settings: LoaderSettings,
                 collate: Callable[[list], Any] | None = None, *, on_device: bool = False) -> None:
        settings.validate()
        self.ds, self.device, self.collate = ds, device, collate
        in_memory = isinstance(ds, TensorDataset) and collate is None
        kind = settings.kind
        from .generated import Generated

        if isinstance(ds, Generated):
            if on_device:
                raise UsageError("Expected an in-memory TensorDataset for data_on_device=True. Received: "
                                 "a batch generator (Generated)")
            kind = "generator"
        elif on_device:
            if not in_memory:
                raise UsageError("Expected an in-memory TensorDataset (and no collate_fn) for data_on_device=True. "
                                 f"Received: {type(ds).__name__}")
            kind = "device"
        elif kind == "auto":
            kind = "inline" if in_memory else "threads"
        self.kind, self.auto = kind, settings.kind == "auto" and kind == "threads"
        default_workers = {"threads": 2, "processes": 2}.get(kind, 0)
        self.workers = settings.workers or default_workers
        self.prefetch = settings.prefetch
        self.timeout = float(settings.timeout)
        self._resident: DeviceBatches | None = None

    def describe(self) -> str:
        if self.kind == "generator":
            return f"generator thread, prefetch {self.prefetch * max(self.workers, 1)}"
        if self.kind in ("threads", "processes"):
            return f"{self.kind} x{self.workers}, prefetch {self.prefetch * self.workers}"
        return self.kind

    def resident(self) -> DeviceBatches:
        """The training set on the device (``device`` loader), copied there at the first call."""
        if self.kind != "device":
            raise RuntimeError(f"the {self.kind} loader keeps no resident copy")
        if self._resident is None:
            self._resident = DeviceBatches(self.ds, self.device)  # type: ignore[arg-type]
        return self._resident

    def epoch(self, sampler: Any, skip: int = 0) -> Iterable[Any]:
        """The batches of one epoch on the device, in ``sampler``'s order, without the first ``skip``."""
        if self.kind == "device":
            return self.resident().epoch(sampler, skip)
        if self.kind == "generator":
            from .generated import GeneratedBatches

            return GeneratedBatches(self.ds, sampler, self.device, skip,  # type: ignore[arg-type]
                                    self.prefetch * max(self.workers, 1), self.timeout)
        if self.kind == "threads":
            return ThreadBatches(self.ds, sampler, self.device, self.collate, skip, self.workers,
                                 self.prefetch * self.workers, self.timeout)
        if self.kind == "processes":
            return ProcessBatches(self.ds, sampler, self.device, self.collate, skip, self.workers,
                                  self.prefetch, self.timeout)
        return InlineBatches(self.ds, sampler, self.device, self.collate, skip)

    def tune(self, data_seconds: float, busy_seconds: float, cores_left: int) -> str | None:
        """After an epoch: more loader threads when data-wait dominated (``auto`` only).

        Returns what changed, for the epoch line, or None."""
        total = data_seconds + busy_seconds
        if not self.auto or total <= 0 or data_seconds / total <= INPUT_BOUND:
            return None
        limit = max(MAX_THREADS if self.kind == "threads" else cores_left, 1)
        if self.workers >= limit:
            return None
        before = self.workers
        self.workers = min(limit, self.workers * 2)
        return f"loader threads {before}->{self.workers}"


def _to_device(batch: Any, device: torch.device) -> Any:
    # pinned host memory (loaders pin on CUDA) lets this copy run while the device computes
    return map_tensors(batch, lambda t: t.to(device, non_blocking=device.type == "cuda"))


class InlineBatches:
    """Batches loaded in the training thread: a gather for in-memory tensors, else a DataLoader."""

    def __init__(self, ds: Dataset, sampler: Any, device: torch.device,
                 collate: Callable[[list], Any] | None = None, skip: int = 0) -> None:
        self.ds, self.sampler, self.device, self.collate = ds, sampler, device, collate
        self.tensors = ds.tensors if isinstance(ds, TensorDataset) and collate is None else None
        self.skip = skip  # batches already trained on (a mid-epoch resume): their indices, never their data

    def __len__(self) -> int:
        return len(self.sampler) - self.skip

    def __iter__(self) -> Iterator[Any]:
        non_blocking = self.device.type == "cuda"
        if self.tensors is not None:
            indices = itertools.islice(self.sampler.iter_tensors(), self.skip, None)
            if non_blocking and all(t.device.type == "cpu" for t in self.tensors):
                gather = PinnedGather(self.tensors, self.device)
                for index in indices:
                    yield gather(index)
                return
            if all(t.device == self.device for t in self.tensors):  # a gather is the whole load
                for index in indices:
                    yield tuple(t.index_select(0, index) for t in self.tensors)
                return
            for index in indices:
                yield tuple(t.index_select(0, index).to(self.device) for t in self.tensors)
            return
        loader = DataLoader(self.ds, batch_sampler=Skipping(self.sampler, self.skip), pin_memory=non_blocking,
                            collate_fn=lambda samples: collate_samples(samples, self.collate, self.ds))
        for batch in loader:
            yield _to_device(batch, self.device)


class PinnedGather:
    """Gathers rows of in-memory tensors into pinned host buffers and copies them to a GPU without blocking.

    A gather into pageable memory makes the copy to the GPU synchronous (the driver stages it),
    so the next batch's copy could not overlap the step on this one. ``depth`` sets of buffers
    take turns; a set is written again only once the copy that last read it has run (a CUDA
    event recorded after it), so a copy still queued behind the device's work never reads a
    later batch's rows. A set grows when a batch has more rows than it holds.
    """

    def __init__(self, tensors: tuple[torch.Tensor, ...], device: torch.device, depth: int = 2) -> None:
        self.tensors, self.device = tuple(t.detach() for t in tensors), device
        self.slots: list[tuple[list[torch.Tensor], Any] | None] = [None] * depth
        self.turn = 0

    def __call__(self, index: torch.Tensor) -> tuple[torch.Tensor, ...]:
        slot, rows = self.turn % len(self.slots), len(index)
        self.turn += 1
        held = self.slots[slot]
        buffers = None
        if held is not None:
            held[1].synchronize()  # the copy that read this set last has finished
            if held[0][0].shape[0] >= rows:
                buffers = held[0]
        if buffers is None:
            buffers = [torch.empty((rows, *t.shape[1:]), dtype=t.dtype, pin_memory=True) for t in self.tensors]
        out = []
        for t, buffer in zip(self.tensors, buffers):
            staged = buffer[:rows]
            torch.index_select(t, 0, index, out=staged)
            out.append(staged.to(self.device, non_blocking=True))
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        self.slots[slot] = (buffers, event)
        return tuple(out)


class Skipping:
    """A batch sampler without its first ``skip`` batches (their indices are drawn, nothing loaded)."""

    def __init__(self, sampler: Any, skip: int) -> None:
        self.sampler, self.skip = sampler, skip

    def __iter__(self) -> Iterator[list[int]]:
        return itertools.islice(iter(self.sampler), self.skip, None)

    def __len__(self) -> int:
        return len(self.sampler) - self.skip


class ThreadBatches:
    """Batches loaded by a pool of threads, ``depth`` in flight, handed over in order.

    The sampler is read in the training thread (a claiming sampler claims at most ``depth``
    batches ahead, and every claimed batch is trained on), so the order is the sampler's
    whatever thread finishes first. Leaving the loop early (an error, ``max_steps``)
    cancels what was not started and waits for the reads in progress.
    """

    def __init__(self, ds: Dataset, sampler: Any, device: torch.device, collate: Callable[[list], Any] | None,
                 skip: int, threads: int, depth: int, timeout: float) -> None:
        self.ds, self.sampler, self.device, self.collate = ds, sampler, device, collate
        self.skip, self.threads, self.depth, self.timeout = skip, threads, max(depth, 1), timeout
        self.pin = device.type == "cuda"

    def __len__(self) -> int:
        return len(self.sampler) - self.skip

    def _load(self, index: list[int]) -> Any:
        batch = fetch(self.ds, index, self.collate)
        return map_tensors(batch, lambda t: t.pin_memory()) if self.pin else batch

    def __iter__(self) -> Iterator[Any]:
        indices = itertools.islice(iter(self.sampler), self.skip, None)
        # a sampler may act when its iteration ends (local SGD syncs the replicas there), so the
        # call that ends it comes after the last batch was trained on; a claiming sampler's count
        # is not known ahead, and it claims up to ``depth`` batches early
        known = None if getattr(self.sampler, "claims_batches", False) else len(self)
        pending: collections.deque[concurrent.futures.Future] = collections.deque()
        pool = concurrent.futures.ThreadPoolExecutor(self.threads, thread_name_prefix="partrain-loader")
        taken = self.skip  # the epoch's number of the batch handed over next
        drawn = 0
        try:
            while True:
                index = next(indices, None) if known is None or drawn < known else None
                if index is None:
                    break
                drawn += 1
                pending.append(pool.submit(self._load, index))
                if len(pending) >= self.depth:
                    yield _to_device(self._take(pending, taken), self.device)
                    taken += 1
            while pending:
                yield _to_device(self._take(pending, taken), self.device)
                taken += 1
            if known is not None:
                next(indices, None)  # the end of the sampler's iteration, after the last step
        finally:
            for future in pending:
                future.cancel()
            pool.shutdown(wait=True, cancel_futures=True)

    def _take(self, pending: collections.deque, number: int) -> Any:
        future = pending.popleft()
        try:
            return future.result(timeout=self.timeout)
        except concurrent.futures.TimeoutError:
            raise LoaderError(f"Expected a loader thread to load batch {number} within "
                              f"{self.timeout:g} s. Received: nothing (a stuck reader?)") from None
        except UsageError:
            raise
        except Exception as exc:
            trace = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
            raise LoaderError(f"A loader thread failed on batch {number} of the epoch: "
                              f"{type(exc).__name__}: {exc}\nLoader traceback:\n{trace}") from exc


class ProcessBatches:
    """Batches loaded by ``torch.utils.data.DataLoader`` worker processes (``prefetch`` each).

    The DataLoader keeps the sampler's order (``in_order``), pins memory on CUDA, stops
    its workers when the epoch ends or fails, and its workers exit when this process dies.
    """

    def __init__(self, ds: Dataset, sampler: Any, device: torch.device, collate: Callable[[list], Any] | None,
                 skip: int, workers: int, prefetch: int, timeout: float) -> None:
        self.ds, self.sampler, self.device, self.collate = ds, sampler, device, collate
        self.skip, self.workers, self.prefetch, self.timeout = skip, workers, prefetch, timeout

    def __len__(self) -> int:
        return len(self.sampler) - self.skip

    def __iter__(self) -> Iterator[Any]:
        loader = DataLoader(self.ds, batch_sampler=Skipping(self.sampler, self.skip),
                            collate_fn=_BatchCollate(self.ds, self.collate), num_workers=self.workers,
                            prefetch_factor=self.prefetch, pin_memory=self.device.type == "cuda",
                            timeout=self.timeout, in_order=True)
        iterator = iter(loader)
        try:
            while True:
                try:
                    batch = next(iterator)
                except StopIteration:
                    return
                except UsageError:
                    raise
                except Exception as exc:  # the DataLoader re-raises a worker's error with its traceback text
                    raise LoaderError(f"A loader process failed: {exc}") from exc
                yield _to_device(batch, self.device)
        finally:
            shutdown = getattr(iterator, "_shutdown_workers", None)
            if shutdown is not None:  # now, not when the iterator is collected
                shutdown()


class _BatchCollate:
    """Picklable collate for worker processes (a lambda would not cross a spawn)."""

    def __init__(self, ds: Dataset, collate: Callable[[list], Any] | None) -> None:
        self.ds, self.collate = ds, collate

    def __call__(self, samples: list[Any]) -> Any:
        return collate_samples(samples, self.collate, self.ds)


class DeviceBatches:
    """A ``TensorDataset`` resident on the device: each batch is a gather there.

    The epoch's order (a permutation drawn on the host from the sampler's seed, so it is
    the order every other loader follows) is copied to the device once per epoch; each
    batch is then a slice of it and an ``index_select`` of every tensor, with no host
    work per batch besides the loop itself.
    """

    def __init__(self, ds: TensorDataset, device: torch.device) -> None:
        self.device = device
        self.tensors = tuple(t.to(device) for t in ds.tensors)

    def epoch(self, sampler: Any, skip: int = 0) -> Iterable[Any]:
        own = itertools.islice(sampler.iter_tensors(), skip, None)
        spans = getattr(sampler, "spans", None)
        if spans is None or getattr(sampler, "claims_batches", False):
            # indices known only as batches are claimed: each crosses to the device
            return _Gathers(self.tensors, (i.to(self.device) for i in own), len(sampler) - skip)
        order = sampler.order().to(self.device)
        # the sampler's own iteration runs alongside (views, nothing copied), so whatever it does
        # at its end (local SGD's sync) happens after the last batch, as with any loader
        slices = (order[a:b] for _, (a, b) in zip(own, itertools.islice(spans(), skip, None)))
        return _Gathers(self.tensors, slices, len(sampler) - skip)


class _Gathers:
    def __init__(self, tensors: tuple[torch.Tensor, ...], indices: Iterator[torch.Tensor], n: int) -> None:
        self.tensors, self.indices, self.n = tensors, indices, n

    def __len__(self) -> int:
        return self.n

    def __iter__(self) -> Iterator[tuple[torch.Tensor, ...]]:
        for index in self.indices:
            yield tuple(t.index_select(0, index) for t in self.tensors)


__all__ = ["DEFAULT_TIMEOUT", "LOADERS", "DeviceBatches", "Feeder", "InlineBatches", "LoaderError",
           "LoaderSettings", "ProcessBatches", "ThreadBatches", "fetch"]

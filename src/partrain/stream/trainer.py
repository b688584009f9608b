"""`OnlineTrainer`: predict on, and train on, whatever arrived while the previous step ran.

Vocabulary: an *item* is one sample from the stream: its input ``x`` (one
sample, no batch dim; a tuple for a model with several inputs), optionally a
label ``y`` (an unlabelled item is only predicted on), a weight, an id. A
*step* is one model call on a batch of items followed, when any item of the
batch is labelled, by one optimizer update. The *version* of the weights is the
number of updates applied to them.

The queue, the batching and the padding are the project's one dynamic batcher
(`partrain.batching.Batcher`): producers hand items over with
`Batcher.submit_threadsafe`, the batcher's own thread (``inline``: the one
thread that collects a batch also runs its step, with no hand-off between
threads per step) runs one step at a time, and items arriving during a step
accumulate for the next one (dequeue-all, bounded by ``max_batch``). The step itself is this module's
`OnlineTrainer._run_batch`, given to the batcher as its ``run_batch`` hook.

The prediction each item gets comes from the batch's forward pass, that is,
from the weights *before* the update that trains on it: an item's prediction
never saw its own label. `Prediction.version` says which weights (the update
that trains on the item is ``version + 1``). The answer goes out as soon as the
forward pass made it, before the backward pass and the update: an item waits
for the step in progress and its own batch's forward pass, not for its update.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import math
import os
import threading
import time
from collections import OrderedDict
from collections.abc import AsyncIterable, Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn

from ..batching import (
    Batcher,
    BatcherClosed,
    Inputs,
    Outputs,
    Pending,
    Pushed,
    QueueFull,
    batch_key,
    split_outputs,
    stack_batch,
)
from ..checkpoint import fit_weights, load_checkpoint, save_checkpoint
from ..env import check_cuda_device
from ..errors import UsageError, error_line
from ..optim import keep_run_settings, setting_change, setting_text
from .metrics import StreamMetrics, plot_curves, prometheus_collector, serve_prometheus
from .options import MinBatchPolicy, check_overflow, parse_lr_schedule, resolve_loss, weighted_loss
from .replay import Remembered, ReplayBuffer

log = logging.getLogger("partrain.stream")
_new = tuple.__new__  # a named tuple made by a C call: `Prediction(...)` runs a Python __new__ per item


class Prediction(NamedTuple):
    """One item's prediction: the model's output for it (no batch dim), and the weights' version.

    ``version`` is the number of optimizer updates applied to the weights that
    produced ``output``; the update that trains on this item (if labelled) is
    update ``version + 1``.
    """

    output: Outputs
    version: int


class _WouldBlock(Exception):
    """`submit` from an event loop found the queue full under overflow "block": wait off the loop."""


class TrainerClosed(BatcherClosed):
    """The trainer is closed or closing and accepts no new items."""


class DuplicateItem(RuntimeError):
    """An item with this id was accepted already (within ``dedup_window`` ids): not trained twice."""

    def __init__(self, item_id: Hashable):
        super().__init__(f"Item id {item_id!r} was accepted already: not trained on twice")
        self.item_id = item_id


@dataclass
class StreamStats:
    """Counts since start. Every accepted item ends as exactly one of: ``predicted`` (answered:
    trained on when labelled, ``trained`` counts those), ``dropped`` (evicted by drop-oldest),
    ``failed`` (its step raised before the predictions; the error is its answer) or ``abandoned``
    (closed without drain). Steps: ``updates``, ``skipped_updates`` (non-finite loss) and
    ``failed_updates`` (the backward pass or the optimizer raised after the batch was answered)."""

    accepted: int = 0
    predicted: int = 0
    trained: int = 0
    replayed: int = 0
    steps: int = 0
    updates: int = 0
    skipped_updates: int = 0  # non-finite loss: the step predicted but did not update
    failed_updates: int = 0  # the update raised after its batch was answered: predicted, not trained on
    rejected: int = 0
    dropped: int = 0
    duplicates: int = 0
    failed: int = 0
    abandoned: int = 0
    malformed: int = 0  # counted by sources (undecodable messages), never reached the trainer

    def as_dict(self) -> dict[str, int]:
        return dict(self.__dict__)

    @property
    def unresolved(self) -> int:
        """Accepted items without an outcome yet (queued or in the running step)."""
        return self.accepted - self.predicted - self.dropped - self.failed - self.abandoned


@dataclass
class StepRecord:
    """What one step did (``on_step`` gets it, in the worker thread, after the update)."""

    version: int  # the weights the batch was predicted with; the update made version + 1
    ids: tuple[Hashable | None, ...]  # the items' ids in batch order
    items: int
    labelled: int
    replayed: int
    loss: float  # the weighted mean loss of the update; NaN when nothing was labelled
    lr: float
    updated: bool
    #: the step's own work: stacking, forward, loss, backward, update (not answering callers). On a GPU
    #: the update runs on after its launch; a step that leaves no item waiting waits for it (`_settle`),
    #: so there its seconds hold the device's work too; with items waiting, the next step's forward
    #: waits for it, and that step's seconds hold it
    seconds: float


SWITCH_INTERVAL = 0.001
"""The GIL switch interval (s) `partrain stream` sets for its process (`sys.setswitchinterval`).

A producer thread that runs Python without blocking (MQTT's network thread at
saturation, a callback) lets other threads have the GIL only every switch
interval: at Python's default of 5 ms, the step's thread waits up to that long
each time it comes back from a torch call. A program that embeds `OnlineTrainer`
may set the same (it is process-wide, so the library does not).
"""


@dataclass(eq=False, slots=True)
class _Entry(Pending):
    """One item through the batcher: its sample's inputs without a batch dim, and what trains on it.

    The label, weight and id live on the request itself rather than in a payload
    object: per item, every object that outlives the hand-over is one more for
    the cyclic collector to count and scan while the stream runs.
    """

    target: Tensor | None = None
    weight: float = 1.0
    item_id: Hashable | None = None


class OnlineTrainer:
    """Train ``model`` online on items submitted from any thread or event loop.

    ``submit(x, y=None)`` returns a future of the item's `Prediction`. One
    worker thread takes every item queued while the previous step ran as the
    next batch (at most ``max_batch``), runs the model on it once, answers each
    item with its rows of the output at once (before the backward pass), and takes one ``optimizer`` step on the
    labelled items' weighted mean loss (``loss_fn``: a name among
    `partrain.stream.options.LOSSES` or ``callable(output, target)``).

    Options:

    - ``min_batch``, ``max_wait``: wait for ``min_batch`` items, at most ``max_wait``
      seconds after the oldest, before a step (default: never wait, dequeue-all);
    - ``max_queue`` and ``overflow``: at most ``max_queue`` items wait; beyond that
      ``"block"`` makes `submit` wait (up to ``block_timeout`` seconds, then
      `QueueFull`), ``"drop_oldest"`` evicts the oldest waiting item (its future
      gets `Evicted`, ``stats.dropped`` counts it), ``"reject"`` raises `QueueFull`
      (``stats.rejected`` counts it);
    - ``replay``: items of recent history (the last ``replay_capacity`` labelled
      ones) drawn into each update, seeded by ``seed`` (at most as many as the
      history holds yet);
    - ``lr_schedule``: the learning-rate multiplier by labelled items trained on
      (`partrain.stream.options.parse_lr_schedule`);
    - ``checkpoint``, ``checkpoint_every``: a checkpoint every N updates and at
      close, written atomically, in the format ``partrain serve`` reads (give
      ``model_spec`` to make it loadable by spec, and ``checkpoint_module``, the part of
      ``model`` the spec rebuilds, when ``model`` wraps it); ``resume=True`` continues from it
      exactly (weights, optimizer, schedule clock, replay buffer and its generator,
      trained ids);
    - ``dedup_window``: ids remembered to refuse a redelivered item (`DuplicateItem`);
    - ``eval_predictions``: predict with a separate forward pass in eval mode (for
      Dropout, BatchNorm) instead of the training pass's output;
    - ``pad``, ``pad_value``: batch items of different trailing sizes by padding
      (else each batch holds one shape);
    - ``input_shape``: refuse items of another shape at `submit` (one line);
    - ``prediction_device``: where the predictions are delivered (default ``"cpu"``: with the
      model on an accelerator, one copy per batch, so a caller reads its answer without a device
      synchronisation of its own; ``None`` keeps them on the model's device);
    - ``metrics_csv``, ``metrics_interval``: a row of figures every interval
      (`partrain.stream.metrics`); ``on_step(StepRecord)``: a hook per step.

    The model must live on one device; items are moved to it. The trainer owns
    the model and optimizer while it runs: read them after `close` (or take a
    `checkpoint_now`).
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                 loss_fn: str | Callable[[Any, Tensor], Tensor] = "mse", *,
                 max_batch: int = 256, min_batch: int = 1, max_wait: float = 0.0,
                 max_queue: int = 10_000, overflow: str = "block", block_timeout: float = 30.0,
                 replay: int = 0, replay_capacity: int = 10_000, seed: int = 0,
                 lr_schedule: str | Callable[[int], float] | None = None,
                 checkpoint: str | None = None, checkpoint_every: int = 0, resume: bool = False,
                 model_spec: dict[str, Any] | None = None, checkpoint_module: nn.Module | None = None,
                 dedup_window: int = 100_000, eval_predictions: bool = False,
                 pad: bool = False, pad_value: float = 0.0,
                 input_shape: Sequence[int] | None = None,
                 prediction_device: str | torch.device | None = "cpu",
                 metrics_csv: str | None = None, metrics_interval: float = 1.0,
                 on_step: Callable[[StepRecord], None] | None = None, name: str = "stream"):
        for label, value, least in (("max_batch", max_batch, 1), ("max_queue", max_queue, 1),
                                    ("replay", replay, 0), ("replay_capacity", replay_capacity, 1),
                                    ("checkpoint_every", checkpoint_every, 0), ("dedup_window", dedup_window, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise UsageError(f"Expected {label} >= {least} (an integer). Received: {label}={value!r}")
        if not (block_timeout > 0 and math.isfinite(block_timeout)):
            raise UsageError(f"Expected block_timeout > 0 seconds. Received: block_timeout={block_timeout!r}")
        if resume and not checkpoint:
            raise UsageError("Expected a checkpoint path to resume from. Received: resume=True, checkpoint=None")
        if not isinstance(model, nn.Module):
            raise UsageError(f"Expected model to be a torch.nn.Module. Received: {type(model).__name__}")
        self.model = model
        self.optimizer = optimizer
        self.loss_fn = resolve_loss(loss_fn)
        self.max_batch = max_batch
        self.overflow = check_overflow(overflow)
        self.max_queue = max_queue
        self.block_timeout = float(block_timeout)
        self.replay = replay
        self.lr_factor = parse_lr_schedule(lr_schedule)
        self.checkpoint_path = checkpoint
        self.checkpoint_every = checkpoint_every
        self.model_spec = model_spec
        self.checkpoint_module = checkpoint_module if checkpoint_module is not None else model
        self.dedup_window = dedup_window
        self.eval_predictions = eval_predictions
        self.pad = pad
        self.pad_value = pad_value
        self.input_shape = tuple(int(d) for d in input_shape) if input_shape is not None else None
        self.on_step = on_step
        self.name = name
        self.device = next((p.device for p in model.parameters()), torch.device("cpu"))
        self.prediction_device = _parse_device(prediction_device, "prediction_device")
        self._stats = StreamStats()
        self.metrics = StreamMetrics(metrics_csv, metrics_interval, max_batch)
        self.version = 0  # optimizer updates applied
        self.items_trained = 0  # labelled items the updates trained on (the schedule's clock)
        self._base_lr = [g["lr"] for g in optimizer.param_groups]
        self._buffer = ReplayBuffer(replay_capacity, seed)
        self._target_spec: tuple[tuple[int, ...], torch.dtype] | None = None
        self._key: tuple | None = None  # the last item's shape, dtype, device and batch key
        self._answered: list[Prediction] | None = None  # the running step's predictions, once sent
        self._released = False  # the running step's items have left the queue's count (`_release`)
        self._seen: OrderedDict[Hashable, None] = OrderedDict()  # ids accepted (the last dedup_window)
        self._trained_ids: OrderedDict[Hashable, None] = OrderedDict()  # what a checkpoint keeps
        self._ids_given = False  # an item carried an id (until then, steps remember none)
        # guards accepting, waiting count, ids and stats; taken as the lock itself (a C call: the
        # Condition's own `with` is Python code, per item on the producer's thread)
        self._lock = threading.RLock()
        self._cond = threading.Condition(self._lock)  # blocked producers wait on it, under `_lock`
        self._waiting = 0  # accepted items not yet taken into a step
        self._closed = False
        self._prometheus: Any = None
        self.error: Exception | None = None  # the first failure after an update (checkpoint, hook)
        if resume and checkpoint is not None:
            if os.path.exists(checkpoint):
                self._restore(load_checkpoint(checkpoint), checkpoint)
        policy = MinBatchPolicy(min_batch, max_wait)
        self._batcher = Batcher(None, max_batch_size=max_batch, policy=policy, max_queue=max_queue,
                                pad=pad, pad_value=pad_value, name=name, run_batch=self._run_batch,
                                inline=True)
        self._batcher.start_background()

    # ---------------------------------------------------------------- producers

    def submit(self, x: Inputs, y: Tensor | float | int | Sequence[float] | None = None, *,
               weight: float = 1.0, id: Hashable | None = None,  # noqa: A002
               on_answer: Callable[[Prediction | None, BaseException | None], None] | None = None) -> Any:
        """Hand one item over from any thread; returns a future of its `Prediction`.

        The item is *accepted* when this returns: from then on it is trained on
        (or answered with the reason it was not: `Evicted`, the step's error,
        `TrainerClosed`). Raises `QueueFull` (overflow ``"reject"``, or ``"block"``
        past ``block_timeout``), `DuplicateItem`, `TrainerClosed`, or `UsageError`
        for an item that does not fit (one line). From a coroutine, use `asubmit`
        (``"block"`` would block the event loop).

        ``on_answer(prediction, error)``: instead of a future to wait on, the answer is pushed,
        once, on the trainer's thread (a source that replies per item, as MQTT's does: a
        `concurrent.futures.Future` per item costs its producer thread a condition variable);
        then a `partrain.batching.Pushed` is returned.
        """
        return self._submit(x, y, weight, id, wait=True, on_answer=on_answer)

    def _submit(self, x: Inputs, y: Any, weight: float, id: Hashable | None,  # noqa: A002
                wait: bool, on_answer: Callable[[Any, BaseException | None], None] | None = None) -> Any:
        # Per item, on the producer's thread and under the GIL the step needs between its torch
        # calls: every microsecond here is one the step can wait. The common item (one tensor,
        # a tensor label, weight 1, no id) takes the short branches.
        if x.__class__ is Tensor and self.input_shape is None:
            inputs: tuple[Tensor, ...] = (x,)  # the sample as it is: the step stacks the batch
            cached = self._key  # items of a stream share their shape: one key object for all of them
            if cached is None or x.shape != cached[0] or x.dtype != cached[1] or x.device != cached[2]:
                cached = self._key = (x.shape, x.dtype, x.device, batch_key(inputs, self.pad, batched=False))
            key = cached[3]
        else:
            inputs = self._check_inputs(x)
            key = batch_key(inputs, self.pad, batched=False)
        spec = self._target_spec  # a tensor label like the first one: no call, nothing to convert
        if y.__class__ is Tensor and spec is not None and y.shape == spec[0] and y.dtype == spec[1]:
            target = y
        else:
            target = self._check_target(y)
        if weight != 1.0 or weight.__class__ is not float:
            self._check_weight(weight)
        if id is not None and not isinstance(id, (str, int)):
            raise UsageError(f"Expected an item id as a str or int. Received: {type(id).__name__}")
        with self._lock:
            if self._closed or id is not None or self._waiting >= self.max_queue:
                self._admit(id, wait)
                if id is not None:
                    self._ids_given = True
                    self._seen[id] = None
                    while len(self._seen) > self.dedup_window:
                        self._seen.popitem(last=False)
            self._waiting += 1
            self._stats.accepted += 1
        future: Any = concurrent.futures.Future() if on_answer is None else Pushed(on_answer)
        # positional (a keyword call costs more, per item): inputs, rows, future, deadline, enqueued,
        # key, dead, dispatched, payload, evict, then _Entry's target, weight, item_id
        entry = _Entry(inputs, 1, future, None, time.monotonic(), key, False, False, None,
                       self.overflow == "drop_oldest", target, float(weight), id)
        # outside the lock: a step starting now must not wait for this hand-over
        try:
            self._batcher.hand_over(entry)
        except BatcherClosed:
            with self._lock:
                self._waiting -= 1
                self._stats.accepted -= 1
                self._seen.pop(id, None)
            raise TrainerClosed(f"Online trainer {self.name!r} is closed") from None
        return future

    @staticmethod
    def _check_weight(weight: Any) -> None:
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not (
                math.isfinite(weight) and weight >= 0):
            raise UsageError(f"Expected an item weight >= 0. Received: weight={weight!r}")

    async def asubmit(self, x: Inputs, y: Any = None, *, weight: float = 1.0,
                      id: Hashable | None = None) -> Prediction:  # noqa: A002
        """`submit` and await the prediction from a coroutine; a full queue is waited on off the loop."""
        try:
            future = self._submit_now(x, y, weight, id)
        except _WouldBlock:
            future = await asyncio.to_thread(self.submit, x, y, weight=weight, id=id)
        return await asyncio.wrap_future(future)

    def _submit_now(self, x: Inputs, y: Any, weight: float, item_id: Hashable | None) -> concurrent.futures.Future:
        """`submit` that never blocks (an event loop calls it): `WouldBlock` when it would."""
        return self._submit(x, y, weight, item_id, wait=False)

    def predict(self, x: Inputs, y: Any = None, *, weight: float = 1.0, id: Hashable | None = None,  # noqa: A002
                timeout: float | None = 60.0) -> Prediction:
        """`submit` and wait for the prediction (a blocking call, e.g. in an ``on_message`` callback)."""
        return self.submit(x, y, weight=weight, id=id).result(timeout)

    def _admit(self, item_id: Hashable | None, wait: bool) -> None:
        """Under the lock: refuse a closed trainer, a duplicate, or (by the overflow policy) a full queue."""
        if self._closed:
            raise TrainerClosed(f"Online trainer {self.name!r} is closed")
        if item_id is not None and item_id in self._seen:
            self._stats.duplicates += 1
            raise DuplicateItem(item_id)
        if self._waiting < self.max_queue or self.overflow == "drop_oldest":
            return
        if self.overflow == "reject":
            self._stats.rejected += 1
            raise QueueFull(f"Online trainer {self.name!r} queue is full ({self.max_queue} items waiting); "
                            f"{self._stats.rejected} rejected so far")
        if not wait:
            raise _WouldBlock()
        deadline = time.monotonic() + self.block_timeout
        while self._waiting >= self.max_queue:
            left = deadline - time.monotonic()
            if left <= 0 or self._closed:
                self._stats.rejected += 1
                raise QueueFull(f"Online trainer {self.name!r} queue stayed full ({self.max_queue} items) for "
                                f"{self.block_timeout:g} s" if not self._closed else
                                f"Online trainer {self.name!r} closed while the queue was full")
            self._cond.wait(left)
        if self._closed:
            raise TrainerClosed(f"Online trainer {self.name!r} is closed")

    def _check_inputs(self, x: Inputs) -> tuple[Tensor, ...]:
        parts = (x,) if isinstance(x, Tensor) else tuple(x) if isinstance(x, (tuple, list)) else None
        if not parts or not all(isinstance(t, Tensor) for t in parts):
            raise UsageError(f"Expected an item's x as a Tensor or a tuple of Tensors (one sample, no batch "
                             f"dim). Received: {type(x).__name__}")
        if self.input_shape is not None and tuple(parts[0].shape) != self.input_shape:
            raise UsageError(f"Expected an input of shape {list(self.input_shape)}. "
                             f"Received: {list(parts[0].shape)}")
        return parts

    def _check_target(self, y: Any) -> Tensor | None:
        if y is None:
            return None
        target = y if isinstance(y, Tensor) else torch.as_tensor(y)
        spec = self._target_spec
        if spec is None:  # the first label sets the contract (set once, under the lock)
            with self._lock:
                if self._target_spec is None:
                    self._target_spec = (target.shape, target.dtype)
                spec = self._target_spec
        if target.shape != spec[0] or target.dtype != spec[1]:
            shape, dtype = spec
            raise UsageError(f"Expected a label of shape {list(shape)} and dtype {dtype} like the first one. "
                             f"Received: shape {list(target.shape)}, dtype {target.dtype}")
        return target

    # ---------------------------------------------------------------- sources

    def consume(self, items: Iterable[Any]) -> int:
        """Submit every item of an iterable (``x``, ``(x, y)`` or a dict with x, y, weight, id).

        Waits for none of the predictions (the futures are dropped; outcomes are
        counted in `stats`); duplicates are counted and skipped. Returns how many
        were accepted. A full queue blocks the iteration (overflow ``"block"``).
        """
        accepted = 0
        for item in items:
            if self._submit_item(item) is not None:
                accepted += 1
        return accepted

    async def aconsume(self, items: AsyncIterable[Any]) -> int:
        """`consume` for an async iterator; a full queue is waited on without blocking the loop."""
        accepted = 0
        async for item in items:
            x, y, weight, item_id = unpack_item(item)
            try:
                try:
                    self._submit_now(x, y, weight, item_id)
                except _WouldBlock:
                    await asyncio.to_thread(self.submit, x, y, weight=weight, id=item_id)
            except (DuplicateItem, QueueFull):
                continue
            accepted += 1
        return accepted

    def _submit_item(self, item: Any) -> concurrent.futures.Future | None:
        x, y, weight, item_id = unpack_item(item)
        try:
            return self.submit(x, y, weight=weight, id=item_id)
        except (DuplicateItem, QueueFull):
            return None

    # ---------------------------------------------------------------- the step

    def _run_batch(self, batch: list[Pending]) -> list[Prediction]:
        """One step, in the batcher's thread; outcomes are counted here, not per answer.

        (A done-callback per item would cost the loop thread, and the GIL, a few
        microseconds per item between two steps: at thousands of items per second
        that is the difference to a hand-written loop.)
        """
        self._released = False
        self._answered = None
        try:
            predictions, record = self._step(batch)
        except BaseException as exc:
            self._release(batch)
            if self._answered is None:  # before the predictions: the error is every item's answer
                with self._lock:
                    self._stats.failed += len(batch)
                raise
            if not isinstance(exc, Exception):
                raise
            # the batch has its predictions: the error can reach nobody else, so it is said here
            log.error("the update after version %d failed; its %d item(s) were predicted, not trained "
                      "on: %s", self.version, len(batch), error_line(exc))
            with self._lock:
                self._stats.steps += 1
                self._stats.failed_updates += 1
            return self._answered
        self._after_step(record)
        return predictions

    def _release(self, batch: list[Pending]) -> None:
        """The batch's items leave the queue's count, once: blocked producers may go on.

        Called by the step just before its forward pass, which runs without the GIL: the
        producers' hand-overs (a few microseconds of GIL each, a batch of them at once when
        the queue was full) then overlap the forward pass instead of the step's own Python
        work before it (at saturation they delayed each step by ~4 ms of 40)."""
        if not self._released:
            self._released = True
            with self._lock:
                self._waiting -= len(batch)
                self._cond.notify_all()

    def _answer(self, batch: list[Pending], predictions: list[Prediction]) -> float:
        """Send each item its prediction now, before the update: its latency ends here.

        Returns the seconds the answers took (callbacks included): not the step's own work."""
        t0 = time.perf_counter()
        self._batcher.answer_now(batch, predictions)
        self._answered = predictions
        answering = time.perf_counter() - t0
        now = time.monotonic()
        self.metrics.record_latencies([now - p.enqueued for p in batch])  # enqueued: its hand-over
        with self._lock:
            self._stats.predicted += len(batch)
        return answering

    def _step(self, batch: list[Pending]) -> tuple[list[Prediction], StepRecord]:
        """Forward, predictions (answered at once, `_answer`), update; a failure before the answers is
        every item's error, one after them a failed update (`_run_batch`)."""
        t0 = time.perf_counter()
        version = self.version
        labelled = [p for p in batch if p.target is not None]
        replayed = self._buffer.sample(self.replay) if labelled and self.replay else []
        key = batch[0].key
        if not self.pad:  # without padding a batch holds one shape: replay only items of this one
            replayed = [r for r in replayed if batch_key(r.inputs, False) == key]
        # every row as a sample without its batch dim (replay keeps a batch dim of 1: its row 0)
        samples = [p.inputs for p in batch] + [tuple(t[0] for t in r.inputs) for r in replayed]
        n_replayed = len(replayed)
        stacked, own, padded = _stack_samples(samples, self.pad, self.pad_value)
        stacked = tuple(t.to(self.device) for t in stacked)
        n = len(batch)
        model = self.model
        self._release(batch)

        if self.eval_predictions:
            model.eval()
            with torch.no_grad():
                shown = model(*(t[:n] for t in stacked))
            model.train()
        update = bool(labelled)
        if update:
            model.train()
            output = model(*stacked)
        else:
            with torch.no_grad():
                output = model(*stacked)
        if not self.eval_predictions:
            shown = _rows(output, 0, n)
        if isinstance(shown, Tensor) and not padded and n == len(batch):
            # one row per item, nothing to cut back: one view per item in a single call (splitting
            # item by item costs two tensor calls, and two GIL hand-offs, per item)
            if shown.dim() == 0 or shown.shape[0] != n:
                split_outputs(shown, batch, stacked, own, padded)  # raises its one-line error
            # a copy (one call, or one transfer off the device): a caller may change its answer in
            # place while the update still runs
            predictions = [_new(Prediction, (row, version)) for row in self._delivered(shown.detach(), True).unbind(0)]
        else:
            answers = split_outputs(self._delivered(_detached(shown), False), batch, tuple(t[:n] for t in stacked),
                                    own[:len(batch)], padded)
            predictions = [Prediction(_drop_batch_dim(a), version) for a in answers]
        answering = self._answer(batch, predictions)

        loss_value, lr = math.nan, self._current_lr()
        if update:
            target = torch.stack([p.target for p in labelled] + [r.target for r in replayed]).to(self.device)
            given = [p.weight for p in labelled] + [r.weight for r in replayed]
            # every weight 1 (the common case): the plain mean, without a weights tensor and its ops
            weights = None if given.count(1.0) == len(given) else torch.tensor(given, dtype=torch.float64,
                                                                              device=self.device)
            if len(labelled) == n:  # every row labelled (the common case): the output as it is, no gather
                picked = output
            else:
                index = [i for i, p in enumerate(batch) if p.target is not None] + list(range(n, len(samples)))
                picked = _rows_at(output, torch.tensor(index, device=self.device))
            loss = weighted_loss(self.loss_fn, picked, target, weights)
            loss_value = float(loss.detach())
            if math.isfinite(loss_value) and (weights is None or float(weights.sum()) > 0):
                factor = self.lr_factor(self.items_trained)
                for group, base in zip(self.optimizer.param_groups, self._base_lr):
                    group["lr"] = base * factor
                lr = self._current_lr()
                self.optimizer.zero_grad(set_to_none=True)
                loss.backward()
                self.optimizer.step()
                self.version += 1
                self.items_trained += len(labelled)
                if self.replay:
                    for p in labelled:
                        self._buffer.add(Remembered(tuple(t[None] for t in p.inputs), p.target, p.weight))
            else:
                update = False
                log.warning("non-finite loss %s at version %d: update skipped", loss_value, version)
        if update:
            self._settle()
        self._count_step(batch, labelled, n_replayed, update)
        seconds = time.perf_counter() - t0 - answering
        self.metrics.record_step(items=len(batch), loss=loss_value, lr=lr, version=self.version,
                                 items_trained=self.items_trained)
        record = StepRecord(version, tuple([p.item_id for p in batch]), len(batch), len(labelled),
                            n_replayed, loss_value, lr, update, seconds)
        return predictions, record

    def _settle(self) -> None:
        """On a GPU, with no item waiting, wait for the update just launched before the step ends.

        The predictions' copy off the device waits for the forward pass; the backward pass and the
        optimizer's step are launched and run on after it. A step timed to their launch is a
        forward pass and some Python: at a low rate, where the device is idle between steps, the
        `StepRecord.seconds` of every step (and a latency held against one step's time) left out
        most of its work. The wait costs nothing there: the next item's forward pass would queue
        behind the update on the device anyway. With items waiting (saturation) there is no wait:
        the host stacks the next batch while the device updates, and that step's copy waits for the
        update instead, so its seconds hold it."""
        if self.device.type != "cuda":
            return
        with self._lock:
            idle = not self._waiting
        if idle:
            torch.cuda.current_stream(self.device).synchronize()

    def _delivered(self, output: Outputs, copy: bool) -> Outputs:
        """``output`` on `prediction_device` (one transfer per tensor for the whole batch); a copy
        when ``copy`` even where it is there already."""
        target = self.prediction_device
        if isinstance(output, Tensor):
            moved = output.to(target) if target is not None and output.device != target else output
            return output.clone() if copy and moved is output else moved
        if isinstance(output, (tuple, list)):
            return tuple(self._delivered(o, copy) for o in output)
        return output  # not a tensor: split_outputs says so in one line

    def _after_step(self, record: StepRecord) -> None:
        """Checkpoint, metrics row, hook: the items are trained on, so a failure here is not theirs."""
        try:
            if record.updated and self.checkpoint_every and self.version % self.checkpoint_every == 0:
                self.checkpoint_now()
            if self.metrics.due():
                self.metrics.row(self.counts(), self._batcher.queue_depth)
            if self.on_step is not None:
                self.on_step(record)
        except Exception as exc:  # noqa: BLE001 - kept, logged once, raised again by close()
            if self.error is None:
                log.error("after update %d: %s", self.version, error_line(exc))
                self.error = exc

    def _count_step(self, batch: list[Pending], labelled: list[Pending], n_replayed: int, updated: bool) -> None:
        with self._lock:
            st = self._stats
            st.steps += 1
            if updated:
                st.updates += 1
                st.trained += len(labelled)
                st.replayed += n_replayed
            elif labelled:
                st.skipped_updates += 1
            if updated and self._ids_given:  # no item carried an id so far: nothing to remember
                for p in labelled:
                    if p.item_id is not None:
                        self._trained_ids[p.item_id] = None
                while len(self._trained_ids) > self.dedup_window:
                    self._trained_ids.popitem(last=False)

    def _current_lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"]) if self.optimizer.param_groups else math.nan

    # ---------------------------------------------------------------- state

    @property
    def stats(self) -> StreamStats:
        """The counts so far (`StreamStats`); ``dropped`` is the batcher's evictions."""
        with self._lock:
            self._stats.dropped = self._batcher.stats.evicted if hasattr(self, "_batcher") else 0
            return self._stats

    @property
    def queue_depth(self) -> int:
        """Items waiting for a step (not counting the running one)."""
        return self._batcher.queue_depth

    def count_malformed(self) -> None:
        """A source could not decode a message (it never became an item): counted here with the rest."""
        with self._lock:
            self._stats.malformed += 1

    def counts(self) -> dict[str, int]:
        return dict(self.stats.as_dict())

    def state_dict(self) -> dict[str, Any]:
        """Everything exact resume needs (call from the worker thread, or once closed)."""
        return {
            "model": {k: v.detach().clone() for k, v in self.checkpoint_module.state_dict().items()},
            "model_spec": self.model_spec,
            "optimizer": self.optimizer.state_dict(),
            "task": {"loss": getattr(self.loss_fn, "__name__", "custom"), "stream": True},
            "step": self.version,
            "stream": {
                "version": self.version,
                "items_trained": self.items_trained,
                "base_lr": list(self._base_lr),
                "replay": self._buffer.state_dict(),
                "trained_ids": list(self._trained_ids),
                "target_spec": None if self._target_spec is None else
                [list(self._target_spec[0]), str(self._target_spec[1]).removeprefix("torch.")],
            },
        }

    def checkpoint_now(self, path: str | None = None) -> str:
        """Write a checkpoint (atomically) now; from the worker thread (``on_step``) or once closed."""
        path = path or self.checkpoint_path
        if not path:
            raise UsageError("Expected a checkpoint path. Received: none (pass checkpoint= to the trainer)")
        save_checkpoint(path, self.state_dict())
        return path

    def _restore(self, state: dict[str, Any], path: str) -> None:
        stream = state.get("stream")
        if not isinstance(stream, dict):
            raise UsageError(f"Expected a checkpoint written by an online trainer in {path!r}. "
                             "Received: one without stream state")
        fit_weights(self.checkpoint_module, state.get("model"), f"the online model from {path!r}")
        asked = [dict(group) for group in self.optimizer.param_groups]  # this run's settings
        try:
            self.optimizer.load_state_dict(state["optimizer"])
        except (KeyError, ValueError, TypeError) as exc:
            raise UsageError(f"Expected the optimizer state in {path!r} to fit the optimizer. "
                             f"Received: {error_line(exc)}") from None
        self.version = int(stream["version"])
        self.items_trained = int(stream["items_trained"])
        # this run's settings win where the checkpoint's differ (its lr is the schedule's base
        # times the factor it had reached: the base is compared, and the schedule sets the lr)
        changed = keep_run_settings(self.optimizer, asked, skip={"lr"})
        changed += [setting_change("lr", mine, theirs, g if len(asked) > 1 else None)
                    for g, (mine, theirs) in enumerate(zip(self._base_lr, stream["base_lr"], strict=True))
                    if setting_text(mine) != setting_text(theirs)]
        if changed:
            log.info("resuming with this run's optimizer settings where the checkpoint's differ: %s",
                     ", ".join(changed))
        self._buffer.load_state_dict(stream["replay"])
        for item_id in stream["trained_ids"]:
            self._trained_ids[item_id] = None
            self._seen[item_id] = None
        if stream.get("target_spec"):
            shape, dtype = stream["target_spec"]
            self._target_spec = (torch.Size(shape), getattr(torch, dtype))

    # ---------------------------------------------------------------- metrics endpoint

    def serve_metrics(self, host: str = "127.0.0.1", port: int = 0) -> str:
        """Prometheus ``/metrics`` on a thread (prometheus-client); returns its URL."""
        try:
            collector = prometheus_collector(self.metrics, self.counts, lambda: {
                "queue_depth": float(self.queue_depth), "version": float(self.version),
                "items_trained": float(self.items_trained), "loss": float(self.metrics.last["loss"]),
            })
        except ImportError:
            raise UsageError("Expected prometheus-client for /metrics (pip install 'partrain[stream]'). "
                             "Received: not installed") from None
        self._prometheus, url = serve_prometheus(collector, host, port)
        return url

    # ---------------------------------------------------------------- closing

    def close(self, drain: bool = True, timeout: float = 120.0, curves: str | None = None) -> StreamStats:
        """Stop accepting; train on every waiting item (``drain``) or answer it `BatcherClosed`; then stop.

        Afterwards every accepted item has an outcome (`StreamStats`). With a
        checkpoint path, a final checkpoint is written; ``curves`` names a PNG of
        the metrics rows. Idempotent. Raises the first error a checkpoint or the
        ``on_step`` hook raised during the run (after everything is closed).
        """
        with self._lock:
            already = self._closed
            self._closed = True
            self._cond.notify_all()
        if not already:
            self._batcher.stop_background(drain=drain, timeout=timeout)
            with self._lock:  # what is still without an outcome was answered BatcherClosed
                st = self._stats
                st.dropped = self._batcher.stats.evicted
                st.abandoned = st.accepted - st.predicted - st.failed - st.dropped
            if self.checkpoint_path:
                self.checkpoint_now()
            self.metrics.row(self.counts(), 0)
            if curves and self.metrics.history:
                with contextlib.suppress(ImportError):
                    plot_curves(self.metrics.history, curves)
            if self._prometheus is not None:
                self._prometheus.shutdown()
                self._prometheus.server_close()
                self._prometheus = None
        if self.error is not None:
            error, self.error = self.error, None
            raise error
        return self.stats

    def __enter__(self) -> OnlineTrainer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close(drain=True)


# --------------------------------------------------------------------------- helpers


def unpack_item(item: Any) -> tuple[Any, Any, float, Hashable | None]:
    """An iterator's item as ``(x, y, weight, id)``.

    The contract: a Tensor is ``x`` (unlabelled); a 2-tuple is ``(x, y)``; a dict
    has ``x`` and optionally ``y``, ``weight``, ``id`` (the only way to pass a
    multi-input ``x``, as a tuple under ``"x"``).
    """
    if isinstance(item, dict):
        if "x" not in item:
            raise UsageError(f"Expected an item dict with an 'x' entry. Received keys {sorted(item)}")
        return item["x"], item.get("y"), float(item.get("weight", 1.0)), item.get("id")
    if isinstance(item, tuple):
        if len(item) != 2:
            raise UsageError(f"Expected an item as x, (x, y) or a dict. Received: a tuple of {len(item)}")
        return item[0], item[1], 1.0, None
    return item, None, 1.0, None


def _stack_samples(samples: list[tuple[Tensor, ...]], pad: bool,
                   pad_value: float) -> tuple[tuple[Tensor, ...], list[list[tuple[int, ...]]], bool]:
    """The batch of ``samples`` (each a tuple of inputs without a batch dim), per input.

    Returns the batched inputs, each row's own input shapes (only when padding was
    applied; `split_outputs` cuts the answers back with them) and whether it was.
    Without padding every sample has one shape (the items' keys saw to it): a plain
    ``torch.stack``. With padding, the batcher's `stack_batch` (the project's one
    padding rule) on views with a batch dim of 1.
    """
    if not pad:
        return tuple(torch.stack([s[i] for s in samples]) for i in range(len(samples[0]))), [], False
    padded = len({tuple(tuple(t.shape) for t in s) for s in samples}) > 1
    rows = [Pending(tuple(t[None] for t in s), 1, None) for s in samples]
    stacked, own = stack_batch(rows, pad_value, same_shapes=not padded)
    return stacked, own, padded


def _rows(output: Outputs, start: int, stop: int) -> Outputs:
    if isinstance(output, Tensor):
        return output[start:stop]
    return tuple(o[start:stop] for o in output)


def _rows_at(output: Outputs, index: Tensor) -> Outputs:
    if isinstance(output, Tensor):
        return output.index_select(0, index)
    return tuple(o.index_select(0, index) for o in output)


def _parse_device(value: str | torch.device | None, label: str) -> torch.device | None:
    """``None``, or the `torch.device` ``value`` names (one line for a name torch refuses)."""
    if value is None:
        return None
    try:
        device = torch.device(value)
    except (RuntimeError, TypeError) as exc:
        raise UsageError(f"Expected {label} to be a device such as 'cpu' or 'cuda:0', or None. "
                         f"Received: {value!r}") from exc
    if device.type == "cuda":
        check_cuda_device(device, f"{label}={value!r}")  # else every step would fail at its answers
    return device


def _detached(output: Outputs) -> Outputs:
    if isinstance(output, Tensor):
        return output.detach()
    return tuple(o.detach() for o in output)


def _drop_batch_dim(answer: Outputs) -> Outputs:
    if isinstance(answer, Tensor):
        return answer[0].clone()
    return tuple(a[0].clone() for a in answer)

"""The project's one dynamic batcher: many callers, one model call per batch, no I/O.

Vocabulary used throughout: a *request* is one caller's input, a tensor (or a
tuple of tensors for a model with several inputs) whose dim 0 holds its *rows*;
a *batch* is the rows of several requests concatenated along dim 0 and passed to
the model in one call.

Two faces (as in TorchBeast's dynamic batcher and LitServe's loop):

- callers ``await batcher.submit(x)`` (asyncio) or ``batcher.submit_blocking(x)``
  (any thread) and get back exactly their own rows of the output;
- the dispatch loop asks the *policy* how long to wait, takes the next batch
  off the queue with the plain function `collect_batch` (a test calls it with a
  bare deque), runs the model in a worker thread and hands each caller its slice.

The HTTP server, central inference for RL actors and streaming training all use
this class; none of them batches on its own.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Union

import torch
from torch import Tensor

from .data.padding import pad_cat

Inputs = Union[Tensor, tuple[Tensor, ...]]  # noqa: UP007 - runtime alias, py3.10
Outputs = Union[Tensor, tuple[Tensor, ...]]  # noqa: UP007 - runtime alias, py3.10


class QueueFull(RuntimeError):
    """The batcher's queue holds ``max_queue`` requests: retry later (HTTP 503)."""


class BatcherClosed(RuntimeError):
    """The batcher is stopped or stopping and accepts no new requests."""


class Evicted(QueueFull):
    """The request waited in a full queue and was dropped to make room for a newer one.

    Only with ``submit_threadsafe(..., evict_oldest=True)`` (a drop-oldest overflow
    policy): the oldest request not yet dispatched gets this error and never runs.
    """


# --------------------------------------------------------------------------- requests


@dataclass(eq=False, slots=True)  # slots: no dict per request (fewer objects for the collector)
class Pending:
    """One accepted request waiting in the queue.

    ``inputs`` is always a tuple of tensors (one per model input); ``key`` groups
    requests that may share a batch (see `batch_key`).
    """

    inputs: tuple[Tensor, ...]
    rows: int
    future: Any  # asyncio.Future or concurrent.futures.Future; set exactly once
    deadline: float | None = None  # time.monotonic() value; None = no deadline
    enqueued: float = field(default_factory=time.monotonic)
    key: tuple = ()
    dead: bool = False  # cancelled or timed out by its caller: drop, never run
    dispatched: bool = False
    payload: Any = None  # what travels with the request unbatched (a label, a weight); see run_batch
    evict: bool = False  # submit_threadsafe(evict_oldest=True): when the queue is full, evict the oldest


def as_inputs(x: Inputs) -> tuple[Tensor, ...]:
    """Normalise a request to a tuple of tensors sharing their leading (row) dim."""
    if isinstance(x, Tensor) and x.dim() > 0 and x.shape[0] >= 1:  # the common case, cheaply
        return (x,)
    inputs = (x,) if isinstance(x, Tensor) else tuple(x)
    if not inputs or not all(isinstance(t, Tensor) for t in inputs):
        raise TypeError(
            "Expected a Tensor or a non-empty tuple of Tensors. "
            f"Received: {type(x).__name__}"
        )
    if any(t.dim() == 0 for t in inputs):
        raise ValueError("Expected tensors with a leading row dimension. Received: a 0-d tensor")
    rows = inputs[0].shape[0]
    if rows < 1 or any(t.shape[0] != rows for t in inputs):
        raise ValueError(
            "Expected every input to carry the same number (>= 1) of rows in dim 0. "
            f"Received: shapes {[tuple(t.shape) for t in inputs]}"
        )
    return inputs


def batch_key(inputs: tuple[Tensor, ...], pad: bool, *, batched: bool = True) -> tuple:
    """Requests with equal keys may share a batch.

    Without padding the key is every input's trailing shape and dtype (grouping by
    shape); with padding only the rank and dtype must agree, trailing sizes may differ.
    ``batched=False``: the inputs are single samples without their batch dim, and
    the key is the one they would have with it (the online trainer's items).
    """
    lead = 1 if batched else 0
    if len(inputs) == 1:  # the common case, without a list per request
        t = inputs[0]
        return ((t.dim() + 1 - lead, t.dtype, t.device),) if pad else ((t.shape[lead:], t.dtype, t.device),)
    if pad:
        return tuple([(t.dim() + 1 - lead, t.dtype, t.device) for t in inputs])
    return tuple([(t.shape[lead:], t.dtype, t.device) for t in inputs])  # torch.Size is a tuple


def collect_batch(queue: deque[Pending], max_batch_size: int, now: float) -> tuple[list[Pending], list[Pending]]:
    """Take the next batch off ``queue``: a plain function, no server needed.

    Drops dead requests (their callers cancelled or gave up), moves expired ones
    into the second list (the caller answers them with `TimeoutError`; they never
    run), and takes requests in arrival order whose key equals the first live
    request's key while their rows fit in ``max_batch_size``. A request larger than
    ``max_batch_size`` runs alone. Requests of another shape group stay queued in
    order, so the oldest request is always in the batch taken.
    """
    batch: list[Pending] = []
    expired: list[Pending] = []
    skipped: list[Pending] = []
    rows = 0
    key = None
    while queue:
        item = queue.popleft()
        if item.dead:
            continue
        if item.deadline is not None and item.deadline <= now:
            expired.append(item)
            continue
        if key is None:
            key = item.key
        elif item.key != key:
            skipped.append(item)
            continue
        if batch and rows + item.rows > max_batch_size:
            queue.appendleft(item)
            break
        batch.append(item)
        rows += item.rows
        if rows >= max_batch_size:
            break
    queue.extendleft(reversed(skipped))
    return batch, expired


def stack_batch(batch: Sequence[Pending], pad_value: float = 0.0, *,
                same_shapes: bool = False) -> tuple[tuple[Tensor, ...], list[list[tuple[int, ...]]]]:
    """Concatenate the requests' rows per input, padding trailing dims to the largest.

    Returns the batched inputs and, per request, each input's own trailing shape
    (used to cut padded outputs back). ``same_shapes=True`` says the caller knows the
    requests share their trailing shapes (a batch `collect_batch` took without
    padding): nothing to pad, so the per-request shape checks are skipped, and the
    shapes list is empty (`split_outputs` reads it only for a padded batch).
    """
    n_inputs = len(batch[0].inputs)
    own = [] if same_shapes else [[tuple(p.inputs[i].shape[1:]) for i in range(n_inputs)] for p in batch]
    stacked = []
    for i in range(n_inputs):
        parts = [p.inputs[i] for p in batch]
        if same_shapes:
            stacked.append(parts[0] if len(parts) == 1 else torch.cat(parts, 0))
            continue
        stacked.append(pad_cat(parts, pad_value))  # the project's one padding rule (partrain.data.padding)
    return tuple(stacked), own


def split_outputs(
    output: Outputs, batch: Sequence[Pending], batched_inputs: tuple[Tensor, ...],
    own_shapes: list[list[tuple[int, ...]]], padded: bool,
) -> list[Outputs]:
    """Give each request its own rows of ``output`` (and cut padding back).

    Cutting rule (only when padding was applied): for every output dim ``d >= 1``
    whose size equals the padded size of input 0 at the same dim ``d``, the
    request's slice is cut to its own size of input 0 at ``d`` - the contract of a
    sequence model whose output keeps the padded dims in place. ``own_shapes`` (from
    `stack_batch`) is read only when ``padded``.
    """
    outs = (output,) if isinstance(output, Tensor) else tuple(output)
    total = sum(p.rows for p in batch)
    for o in outs:
        if not isinstance(o, Tensor) or o.dim() == 0 or o.shape[0] != total:
            got = tuple(o.shape) if isinstance(o, Tensor) else type(o).__name__
            raise RuntimeError(
                f"Expected the model to return {total} rows in dim 0 (one per input row). "
                f"Received: {got}"
            )
    results: list[Outputs] = []
    start = 0
    ref = batched_inputs[0].shape
    for k, p in enumerate(batch):
        mine = []
        for o in outs:
            piece = o[start:start + p.rows]
            if padded:
                for d in range(1, min(o.dim(), len(ref))):
                    mine_size = own_shapes[k][0][d - 1]
                    if o.shape[d] == ref[d] and mine_size != ref[d]:
                        piece = piece.narrow(d, 0, mine_size)
            mine.append(piece)
        start += p.rows
        results.append(mine[0] if isinstance(output, Tensor) else tuple(mine))
    return results


class Pushed:
    """A request's answer slot that pushes the answer to ``callback(result, error)`` on the thread
    that answers, once: what a caller that never waits needs of a future (`done`, `set_result`,
    `set_exception`), without a `concurrent.futures.Future`'s condition variable, whose creation
    alone cost a stream over MQTT a fifth of its network thread."""

    __slots__ = ("callback", "_once")

    def __init__(self, callback: Callable[[Any, BaseException | None], None]) -> None:
        self.callback = callback
        self._once = threading.Lock()  # held once answered: set exactly once, from any thread

    def done(self) -> bool:
        return self._once.locked()

    def cancelled(self) -> bool:
        return False

    def set_result(self, result: Any) -> None:
        self._push(result, None)

    def set_exception(self, error: BaseException) -> None:
        self._push(None, error)

    def _push(self, result: Any, error: BaseException | None) -> None:
        if not self._once.acquire(False):
            raise concurrent.futures.InvalidStateError("answered already")
        try:
            self.callback(result, error)
        except Exception:  # a callback's failure is its own: never the dispatch loop's
            logging.getLogger("partrain.batching").exception("an answer's callback failed")


def _settle(future: Any, *, result: Any = None, error: BaseException | None = None) -> bool:
    """Answer ``future`` unless it is done; False if it was (a caller may cancel it any time).

    A `concurrent.futures.Future` (`Batcher.submit_threadsafe`) can be cancelled from
    another thread at any time; that must never break the dispatch loop. No ``done()``
    check first: setting a done future raises, which says the same for one lock less
    per answer (a stream answers thousands per second).
    """
    try:
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)
    except (asyncio.InvalidStateError, concurrent.futures.InvalidStateError):
        return False
    return True


# --------------------------------------------------------------------------- policies


class Policy:
    """Decides how long the dispatcher waits before taking a batch.

    The dispatcher calls `wait_time` whenever the model is idle and requests are
    queued; it dispatches when the answer is 0, otherwise waits that long or until
    the next arrival, then asks again. `observe_arrival` and `observe_batch` feed
    measurements.
    """

    name = "policy"

    def observe_arrival(self, now: float) -> None:  # noqa: B027 - optional hook
        pass

    def observe_arrivals(self, now: float, count: int) -> None:
        """``count`` requests accepted together at ``now`` (a thread's hand-overs taken at once)."""
        if type(self).observe_arrival is Policy.observe_arrival:
            return  # nothing to feed: skip the call per request
        for _ in range(count):
            self.observe_arrival(now)

    def observe_batch(self, rows: int, seconds: float) -> None:  # noqa: B027 - optional hook
        pass

    def wait_time(self, *, queued_requests: int, queued_rows: int, oldest_age: float,
                  since_last_arrival: float, max_batch_size: int) -> float:
        raise NotImplementedError


class FixedPolicy(Policy):
    """Wait up to ``max_wait`` seconds after the oldest request (or until the batch is full)."""

    name = "fixed"

    def __init__(self, max_wait: float):
        if not (max_wait >= 0 and math.isfinite(max_wait)):
            raise ValueError(f"Expected max_wait >= 0 seconds. Received: max_wait={max_wait}")
        self.max_wait = float(max_wait)

    def wait_time(self, *, queued_requests: int, queued_rows: int, oldest_age: float,
                  since_last_arrival: float, max_batch_size: int) -> float:
        if queued_rows >= max_batch_size:
            return 0.0
        return max(0.0, self.max_wait - oldest_age)

    def __repr__(self) -> str:
        return f"FixedPolicy(max_wait={self.max_wait})"


class AdaptivePolicy(Policy):
    """Wait only when the next request is expected sooner than waiting costs.

    Measured online: ``gap``, an EWMA of the time between request arrivals, and
    ``L(b)``, the model's latency per batch-size bucket (powers of two; an
    unmeasured bucket borrows the nearest measured one), taken as the minimum of
    the bucket's last 16 batches: noise from a busy CPU or a first-call warm-up only
    ever adds time, and an inflated ``L`` would make a lone request wait. The rule,
    asked each time the model is idle and ``q`` requests are queued:

    1. dispatch now if the queued rows fill a batch;
    2. dispatch now if ``q * gap >= L(rows)``: waiting one gap delays ``q`` callers
       by ``gap`` each, while the request it would catch saves at most one model
       run ``L``. A lone request at low load (``gap`` long) therefore waits for
       nothing;
    3. otherwise wait for the next arrival, at most ``2 * gap`` after the latest
       one (a burst that has ended is not waited for), and never longer than
       ``L(max_batch_size)`` after the oldest queued request.

    While the model runs (one batch in flight) requests simply accumulate, so a
    busy server fills its batches without waiting at all.
    """

    name = "adaptive"

    def __init__(self, alpha: float = 0.2):
        self.alpha = alpha
        self.gap: float | None = None
        self._last_arrival: float | None = None
        self._latency: dict[int, float] = {}
        self._recent: dict[int, deque[float]] = {}

    @staticmethod
    def _bucket(rows: int) -> int:
        return 1 << max(0, (max(1, rows) - 1).bit_length())

    def observe_arrival(self, now: float) -> None:
        if self._last_arrival is not None:
            gap = max(0.0, now - self._last_arrival)
            self.gap = gap if self.gap is None else self.gap + self.alpha * (gap - self.gap)
        self._last_arrival = now

    def observe_batch(self, rows: int, seconds: float) -> None:
        b = self._bucket(rows)
        recent = self._recent.setdefault(b, deque(maxlen=16))
        recent.append(seconds)
        self._latency[b] = min(recent)

    def latency(self, rows: int) -> float | None:
        """Estimated model latency for a batch of ``rows`` rows (None before any batch)."""
        if not self._latency:
            return None
        b = self._bucket(rows)
        if b in self._latency:
            return self._latency[b]
        nearest = min(self._latency, key=lambda k: abs(math.log2(k) - math.log2(b)))
        return self._latency[nearest]

    def wait_time(self, *, queued_requests: int, queued_rows: int, oldest_age: float,
                  since_last_arrival: float, max_batch_size: int) -> float:
        if queued_rows >= max_batch_size or self.gap is None:
            return 0.0
        lat = self.latency(queued_rows)
        if lat is None or queued_requests * self.gap >= lat:
            return 0.0
        budget = (self.latency(max_batch_size) or lat) - oldest_age
        window = 2.0 * self.gap - since_last_arrival
        return max(0.0, min(budget, window))

    def __repr__(self) -> str:
        return f"AdaptivePolicy(gap={self.gap}, latency={self._latency})"


def make_policy(policy: str | Policy) -> Policy:
    """``"adaptive"``, ``"fixed:MS"`` / ``"fixed(MS)"`` (milliseconds), ``"none"``, or a Policy."""
    if isinstance(policy, Policy):
        return policy
    text = str(policy).strip().lower()
    if text == "adaptive":
        return AdaptivePolicy()
    if text in ("none", "off"):
        return FixedPolicy(0.0)
    if text.startswith("fixed"):
        arg = text[5:].strip(":()= ")
        try:
            ms = float(arg)
        except ValueError:
            ms = -1.0
        if ms >= 0 and math.isfinite(ms):
            return FixedPolicy(ms / 1000.0)
    raise ValueError(
        "Expected a batching policy 'adaptive', 'none' or 'fixed:MS' (milliseconds). "
        f"Received: {policy!r}"
    )


# --------------------------------------------------------------------------- stats


@dataclass
class BatcherStats:
    """Counters since start; ``batch_sizes`` maps rows per batch to how many batches."""

    submitted: int = 0
    answered: int = 0
    rejected: int = 0  # QueueFull, and evictions (``evicted`` counts those)
    evicted: int = 0
    expired: int = 0
    cancelled: int = 0
    failed: int = 0
    batches: int = 0
    rows: int = 0
    model_seconds: float = 0.0
    batch_sizes: dict[int, int] = field(default_factory=dict)

    @property
    def mean_batch_size(self) -> float:
        return self.rows / self.batches if self.batches else 0.0


# --------------------------------------------------------------------------- batcher


class Batcher:
    """Dynamic batcher: concurrent callers share one model call per batch.

    ``fn(batch)`` gets a Tensor (or a tuple of Tensors for a multi-input model)
    whose dim 0 stacks the rows of several requests, and returns a Tensor (or a
    tuple of Tensors) with the same number of rows. It runs in one worker thread
    (never on the event loop) under ``torch.inference_mode``; one batch is in
    flight at a time, and requests arriving meanwhile accumulate for the next one.

    Batching rule: see `AdaptivePolicy` (default) and `FixedPolicy`. Shapes:
    requests whose trailing shapes differ are grouped by shape (never mixed)
    unless ``pad=True``, which pads them to the largest size with ``pad_value``
    and cuts each answer back (see `split_outputs`). A request with more rows
    than ``max_batch_size`` runs alone.

    Guarantees: each accepted request is answered exactly once - with its rows of
    the output, the exception ``fn`` raised for its batch, `TimeoutError` if its
    deadline passed before dispatch (it never runs), or `BatcherClosed` when
    stopped without draining. A cancelled caller's rows are dropped if not yet
    dispatched. `QueueFull` is raised by ``submit`` when ``max_queue`` requests wait.

    ``on_batch(rows, requests, seconds)`` is called after each model run (metrics).

    ``run_batch(batch) -> outputs`` replaces the default model call for users that
    need more than ``fn`` on the stacked inputs (online training: the batch's labels
    travel in each request's ``payload``, and the call needs autograd). It gets the
    `Pending` requests of one batch, runs in the same worker thread, one batch at a
    time, *without* ``inference_mode``, and returns one output per request (build it
    with `stack_batch` and `split_outputs`, the code the default path uses).

    ``overlap_answers=True`` answers a finished batch's callers only once the next
    batch has been handed to the worker thread (or the loop has nothing to run):
    setting hundreds of futures then overlaps the next model call instead of
    delaying it. For throughput-bound users (online training); `in_flight` counts
    those requests until they are answered.

    ``inline=True`` runs each batch on the loop's own thread instead of handing it
    to the worker thread: no thread hand-off per batch (each costs a wake-up and a
    wait for the GIL, up to the switch interval while a producer runs Python). The
    loop serves nothing else while a batch runs, so only for a loop of its own
    (`start_background`) fed by `submit_threadsafe`, as the online trainer does.
    Requests handed over during a batch wait in the inbox and make the next batch
    (dequeue-all); `stop_background` refuses new requests at once, even during a
    batch, and the stop itself takes effect when the batch ends.
    """

    def __init__(self, fn: Callable[[Inputs], Outputs] | None, *, max_batch_size: int = 64,
                 policy: str | Policy = "adaptive", max_queue: int = 4096,
                 pad_value: float = 0.0, name: str = "model", pad: bool = False,
                 on_batch: Callable[[int, int, float], None] | None = None,
                 run_batch: Callable[[list[Pending]], Sequence[Any]] | None = None,
                 overlap_answers: bool = False, inline: bool = False):
        if not isinstance(max_batch_size, int) or max_batch_size < 1:
            raise ValueError(f"Expected max_batch_size >= 1. Received: max_batch_size={max_batch_size!r}")
        if not isinstance(max_queue, int) or max_queue < 1:
            raise ValueError(f"Expected max_queue >= 1. Received: max_queue={max_queue!r}")
        if fn is None and run_batch is None:
            raise ValueError("Expected a model function fn or a run_batch hook. Received: neither")
        self.fn = fn
        self.run_batch = run_batch
        self.overlap_answers = overlap_answers and not inline  # inline: nothing runs beside the answers
        self.inline = inline
        self._deferred: list[tuple[list[Pending], list[Any]]] = []  # finished, not yet answered
        self.max_batch_size = max_batch_size
        self.policy = make_policy(policy)
        self.max_queue = max_queue
        self.pad_value = pad_value
        self.pad = pad
        self.name = name
        self.on_batch = on_batch
        self.stats = BatcherStats()
        self._queue: deque[Pending] = deque()
        self._queued = 0  # live requests in the queue
        self._queued_rows = 0
        self._last_arrival = 0.0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wakeup: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._accepting = False
        self._refusing = False  # stop_background was called: refuse new requests before the loop stops
        self._draining = True
        self._in_flight = 0  # requests dispatched and not answered yet
        self._answered_early: Sequence[Pending] | None = None  # the running batch, if `answer_now` answered it
        self._thread: threading.Thread | None = None
        self._inbox: deque[Pending] = deque()  # submit_threadsafe -> the loop
        self._inbox_scheduled = False
        self._loop_waiting = False  # the dispatch loop waits for an arrival: wake it
        self._handover = threading.RLock()  # submit_threadsafe's append vs stop's last look at the inbox

    # ---------------------------------------------------------------- lifecycle

    @property
    def running(self) -> bool:
        return self._accepting and not self._refusing

    @property
    def queue_depth(self) -> int:
        """Live requests waiting for a batch (not counting the one in flight), the inbox's included."""
        return self._queued + len(self._inbox)

    @property
    def in_flight(self) -> int:
        """Requests dispatched and not answered yet: the batch the model runs (0 while idle).

        With `queue_depth` it tells where every accepted, unanswered request is:
        an operator (or a test) waits on these instead of guessing a time.
        """
        return self._in_flight

    async def start(self) -> None:
        """Start the dispatch loop on the running event loop."""
        if self._task is not None:
            raise RuntimeError(f"Batcher {self.name!r} is already started")
        self._loop = asyncio.get_running_loop()
        self._wakeup = asyncio.Event()
        if not self.inline:
            self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"batcher-{self.name}")
        self._accepting = True
        self._refusing = False
        self._task = asyncio.create_task(self._dispatch_loop(), name=f"batcher-{self.name}")

    async def stop(self, drain: bool = True) -> None:
        """Stop accepting; answer every queued request (run it if ``drain``), then end."""
        if self._task is None:
            return
        with self._handover:  # requests handed over before the stop are accepted, then drained or answered
            self._take_inbox()
            self._accepting = False
        self._draining = drain
        assert self._wakeup is not None
        self._wakeup.set()
        try:
            await self._task
        finally:
            self._task = None
            if self._executor is not None:
                self._executor.shutdown(wait=True)
                self._executor = None

    async def __aenter__(self) -> Batcher:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop(drain=True)

    def start_background(self) -> Batcher:
        """Run the batcher on its own event-loop thread (for synchronous users)."""
        if self._thread is not None:
            raise RuntimeError(f"Batcher {self.name!r} is already running in the background")
        started = threading.Event()
        loop = asyncio.new_event_loop()

        def main() -> None:
            asyncio.set_event_loop(loop)
            loop.run_until_complete(self.start())
            started.set()
            loop.run_forever()
            loop.close()

        self._thread = threading.Thread(target=main, name=f"batcher-loop-{self.name}", daemon=True)
        self._thread.start()
        started.wait()
        return self

    def stop_background(self, drain: bool = True, timeout: float | None = 60.0) -> None:
        """Stop a batcher started with `start_background` (drains by default)."""
        if self._thread is None:
            return
        loop = self._loop
        assert loop is not None
        with self._handover:  # from now on nothing new is accepted, even while a batch runs on the loop
            self._refusing = True
        asyncio.run_coroutine_threadsafe(self.stop(drain), loop).result(timeout)
        loop.call_soon_threadsafe(loop.stop)
        self._thread.join(timeout)
        self._thread = None

    # ---------------------------------------------------------------- callers

    def _enqueue(self, item: Pending, now: float) -> None:
        """Queue ``item`` (in the loop's thread), count it, and wake the loop."""
        self._queue.append(item)
        self._queued += 1
        self._queued_rows += item.rows
        self.stats.submitted += 1
        self.policy.observe_arrival(now)
        self._last_arrival = now
        assert self._wakeup is not None
        self._wakeup.set()

    async def submit(self, x: Inputs, *, deadline: float | None = None) -> Outputs:
        """Queue ``x`` (n >= 1 rows) and return its rows of the model's output.

        ``deadline`` is an absolute `time.monotonic()` time: if the request is not
        dispatched by then it never runs and `TimeoutError` is raised. Cancelling
        the awaiting task drops the request if it was not dispatched yet.
        """
        if not self.running:
            raise BatcherClosed(f"Batcher {self.name!r} is not accepting requests (stopped or stopping)")
        if asyncio.get_running_loop() is not self._loop:
            raise RuntimeError(
                "Expected submit() on the batcher's event loop. Received a call from another loop; "
                "use submit_blocking() from other threads"
            )
        inputs = as_inputs(x)
        if self._queued >= self.max_queue:
            self.stats.rejected += 1
            raise QueueFull(f"Batcher {self.name!r} queue is full ({self.max_queue} requests waiting)")
        now = time.monotonic()
        assert self._loop is not None and self._wakeup is not None
        item = Pending(inputs, inputs[0].shape[0], self._loop.create_future(), deadline, now,
                       batch_key(inputs, self.pad))
        self._enqueue(item, now)
        try:
            if deadline is None:
                return await asyncio.shield(item.future)
            while True:
                remaining = deadline - time.monotonic()
                if item.dispatched or item.future.done() or remaining <= 0:
                    if not item.dispatched and not item.future.done():
                        self._drop(item)
                        self.stats.expired += 1
                        raise TimeoutError(f"Request expired before dispatch (batcher {self.name!r})")
                    return await asyncio.shield(item.future)
                await asyncio.wait({item.future}, timeout=remaining)
        except asyncio.CancelledError:
            if not item.dispatched and not item.future.done():
                self._drop(item)
                self.stats.cancelled += 1
            raise

    def submit_blocking(self, x: Inputs, *, timeout: float | None = None) -> Outputs:
        """Thread-safe `submit` from any thread but the batcher's loop thread.

        ``timeout`` (seconds) becomes the request's deadline; raises `TimeoutError`.
        """
        loop = self._loop
        if loop is None or not self.running:
            raise BatcherClosed(f"Batcher {self.name!r} is not running")
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            raise RuntimeError("submit_blocking() called on the batcher's own event loop: use submit()")
        deadline = None if timeout is None else time.monotonic() + timeout
        fut = asyncio.run_coroutine_threadsafe(self.submit(x, deadline=deadline), loop)
        return fut.result()

    def submit_threadsafe(self, x: Inputs, *, payload: Any = None,
                          evict_oldest: bool = False) -> concurrent.futures.Future:
        """Queue ``x`` from any thread (the loop's own included) without waiting for the answer.

        Returns a `concurrent.futures.Future` set exactly once, like `submit`'s
        answer: the request's output, the batch's exception, `BatcherClosed` if the
        batcher stopped before the request reached its queue, or `QueueFull` when
        ``max_queue`` requests wait - unless ``evict_oldest``, which instead drops the
        oldest waiting request (its future gets `Evicted`) to make room. Requests of
        one thread reach the queue in the order of the calls. Cheaper than
        `submit_blocking` (no task per request): a producer thread can hand over
        thousands of items per second and collect the answers later.
        """
        inputs = as_inputs(x)
        future: concurrent.futures.Future = concurrent.futures.Future()
        self.hand_over(Pending(inputs, inputs[0].shape[0], future, None, time.monotonic(), batch_key(inputs, self.pad),
                               payload=payload, evict=evict_oldest))
        return future

    def hand_over(self, item: Pending) -> None:
        """`submit_threadsafe` for a request its caller built itself (its future a
        `concurrent.futures.Future`, ``enqueued`` its `time.monotonic()` hand-over time).

        The online trainer builds its items (a `Pending` subclass carrying the label)
        more cheaply than the general path, which must normalise any input.
        """
        loop = self._loop
        if loop is None or not self._accepting or self._refusing:
            raise BatcherClosed(f"Batcher {self.name!r} is not running")
        with self._handover:  # either in the inbox before `stop` takes it for the last time, or refused
            if not self._accepting or self._refusing:
                raise BatcherClosed(f"Batcher {self.name!r} is not running")
            self._inbox.append(item)
        # The loop is woken only when it waits for arrivals; while a batch runs it takes
        # the inbox itself before collecting the next one. One wake-up per request (a
        # socket write, a thread switch) would keep the loop thread and the GIL busy
        # while a producer hands over thousands of items, slowing the batch itself.
        # Order matters (no lost wake-up): append, then read the flags; the loop sets
        # _loop_waiting, then looks at the inbox, then waits.
        if self._loop_waiting and not self._inbox_scheduled:
            self._inbox_scheduled = True
            try:
                loop.call_soon_threadsafe(self._take_inbox)
            except RuntimeError:  # the loop closed between the check and the call
                self._inbox_scheduled = False
                raise BatcherClosed(f"Batcher {self.name!r} is not running") from None

    def _take_inbox(self) -> None:
        """On the loop: accept every request `submit_threadsafe` left in the inbox, in order."""
        self._inbox_scheduled = False  # first: a request appended from now on schedules another call
        if not self._inbox:
            return
        with self._handover:  # the whole inbox at once: producers append to a fresh one meanwhile
            taken, self._inbox = self._inbox, deque()
        now = time.monotonic()
        if self._accepting and self._queued + len(taken) <= self.max_queue:
            # the common case: room for all of them, so no request is refused or evicts another:
            # accepted together (per request, this loop runs for every item of a stream)
            self._queue.extend(taken)
            self._queued += len(taken)
            self._queued_rows += sum([p.rows for p in taken])
            self.stats.submitted += len(taken)
            self.policy.observe_arrivals(now, len(taken))
            self._last_arrival = now
            assert self._wakeup is not None
            self._wakeup.set()
            return
        for item in taken:
            self._accept(item, now)

    def _accept(self, item: Pending, now: float) -> None:
        """On the loop: put a `submit_threadsafe` request in the queue (or answer why not)."""
        if not self._accepting:
            _settle(item.future, error=BatcherClosed(f"Batcher {self.name!r} is not accepting requests"))
            return
        if self._queued >= self.max_queue:
            oldest = next((p for p in self._queue if not p.dead), None) if item.evict else None
            if oldest is None:
                self.stats.rejected += 1
                _settle(item.future, error=QueueFull(
                    f"Batcher {self.name!r} queue is full ({self.max_queue} requests waiting)"))
                return
            self._drop(oldest)
            self.stats.rejected += 1
            self.stats.evicted += 1
            _settle(oldest.future, error=Evicted(
                f"Dropped from the full queue of batcher {self.name!r} (drop-oldest policy)"))
        self._enqueue(item, now)

    # ---------------------------------------------------------------- dispatcher

    def _drop(self, item: Pending) -> None:
        if not item.dead:
            item.dead = True
            self._queued -= 1
            self._queued_rows -= item.rows

    def _answer_expired(self, expired: list[Pending]) -> None:
        for item in expired:
            self._drop(item)
            if not item.future.done():
                self.stats.expired += 1
                item.future.set_exception(TimeoutError(f"Request expired before dispatch (batcher {self.name!r})"))

    async def _dispatch_loop(self) -> None:
        assert self._wakeup is not None
        while True:
            self._take_inbox()
            if self._refusing and self._accepting:  # stop_background was called: its stop decides what runs
                self._wakeup.clear()
                await self._wait_for_arrival(None)
                continue
            if not self._queued:
                self._queue.clear()  # only dead (cancelled / timed-out) requests are left
                if not self._accepting:
                    self._flush_answers()
                    break
                self._wakeup.clear()
                await self._wait_for_arrival(None)
                continue
            if self._accepting:
                now = time.monotonic()
                oldest = next((p for p in self._queue if not p.dead), None)
                wait = self.policy.wait_time(
                    queued_requests=self._queued, queued_rows=self._queued_rows,
                    oldest_age=now - oldest.enqueued if oldest else 0.0,
                    since_last_arrival=now - self._last_arrival,
                    max_batch_size=self.max_batch_size,
                )
                if wait > 0:
                    self._wakeup.clear()
                    if await self._wait_for_arrival(wait):
                        continue  # a new arrival (or stop): ask the policy again
                    # window over: dispatch what is queued
            elif not self._draining:
                self._flush_answers()
                for item in self._queue:
                    if not item.dead:
                        _settle(item.future, error=BatcherClosed(f"Batcher {self.name!r} stopped"))
                self._queue.clear()
                self._queued = self._queued_rows = 0
                break
            batch, expired = collect_batch(self._queue, self.max_batch_size, time.monotonic())
            self._answer_expired(expired)
            if batch:
                await self._run(batch)

    async def _wait_for_arrival(self, timeout: float | None) -> bool:
        """Wait for a wake-up (an arrival, a stop) at most ``timeout`` s; True if one came."""
        assert self._wakeup is not None
        self._flush_answers()  # nobody waits for answers while the loop waits for arrivals
        self._loop_waiting = True  # first: a producer appending from now on wakes the loop
        try:
            self._take_inbox()  # then look: what was appended before is taken here
            if self._wakeup.is_set():
                return True
            if timeout is None:
                await self._wakeup.wait()
                return True
            try:
                await asyncio.wait_for(self._wakeup.wait(), timeout)
            except asyncio.TimeoutError:
                return False
            return True
        finally:
            self._loop_waiting = False

    async def _run(self, batch: list[Pending]) -> None:
        rows = 0
        for item in batch:
            item.dispatched = True
            rows += item.rows
        self._queued -= len(batch)
        self._queued_rows -= rows
        loop = asyncio.get_running_loop()
        t0 = time.perf_counter()
        self._in_flight += len(batch)
        try:
            if self.inline:
                results = self._compute(batch)
            else:
                work = loop.run_in_executor(self._executor, self._compute, batch)
                self._flush_answers()  # the previous batch's callers (overlap_answers), while this one runs
                results = await work
        except Exception as exc:  # noqa: BLE001 - delivered to every caller of the batch
            self.stats.failed += len(batch)
            for item in batch:
                _settle(item.future, error=exc)
            results = None
            self._in_flight -= len(batch)
        seconds = time.perf_counter() - t0
        self.policy.observe_batch(rows, seconds)
        st = self.stats
        st.batches += 1
        st.rows += rows
        st.model_seconds += seconds
        st.batch_sizes[rows] = st.batch_sizes.get(rows, 0) + 1
        if results is not None:
            if batch is self._answered_early:  # `answer_now` answered every caller: nothing to settle twice
                self._in_flight -= len(batch)
            else:
                self._deferred.append((batch, results))
                if not self.overlap_answers:
                    self._flush_answers()
        self._answered_early = None
        if self.on_batch is not None:
            try:
                self.on_batch(rows, len(batch), seconds)
            except Exception:  # noqa: BLE001 - metrics must never break serving
                pass
        if self.inline:
            await asyncio.sleep(0)  # let the loop's callbacks (a stop, a wake-up) run between batches

    def answer_now(self, batch: Sequence[Pending], results: Sequence[Any]) -> None:
        """From inside ``run_batch`` on an ``inline`` batcher: answer the batch's callers before it returns.

        For a ``run_batch`` whose answers are ready before its work ends (the online
        trainer's predictions, made before its update). Called with the very batch
        ``run_batch`` got, the batch's own answers are then skipped (setting a done
        future again costs a lock and an exception per caller); for part of it, they
        find those futures done and leave them as they are. An exception the hook
        raises afterwards no longer reaches the callers answered (the hook reports it).
        """
        if not self.inline:
            raise RuntimeError("Expected answer_now() from run_batch on an inline batcher (the loop's own "
                               "thread). Received: a call on a batcher that runs batches in a worker thread")
        answered = 0
        for item, result in zip(batch, results):
            answered += _settle(item.future, result=result)
        self.stats.answered += answered
        if len(results) == len(batch):
            self._answered_early = batch

    def _flush_answers(self) -> None:
        """Answer the callers of the finished batch whose answers wait (see ``overlap_answers``)."""
        while self._deferred:
            batch, results = self._deferred.pop(0)
            for item, result in zip(batch, results):
                if _settle(item.future, result=result):
                    self.stats.answered += 1
            self._in_flight -= len(batch)

    def _compute(self, batch: list[Pending]) -> list[Any]:
        """Runs in the worker thread (the loop's, ``inline``): stack, call the model, split (or ``run_batch``)."""
        if self.run_batch is not None:
            results = list(self.run_batch(batch))
            if len(results) != len(batch):
                raise RuntimeError(f"Expected run_batch to return {len(batch)} outputs (one per request). "
                                   f"Received: {len(results)}")
            return results
        assert self.fn is not None
        padded = self.pad and len({tuple(tuple(t.shape[1:]) for t in p.inputs) for p in batch}) > 1
        inputs, own = stack_batch(batch, self.pad_value, same_shapes=not self.pad)
        with torch.inference_mode():
            output = self.fn(inputs[0] if len(inputs) == 1 else inputs)
        return split_outputs(output, batch, inputs, own, padded)
